"""``AttnKitLM``: lm-eval-harness's ``HFLM`` for attnkit models, registered with lm-eval as model ``"attnkit"``.

Importing this module needs lm-eval-harness (``pip install 'attnkit[eval]'``) and registers ``"attnkit"`` with
``AutoConfig``/``AutoModelForCausalLM`` too, so ``HFLM``'s own loading (config, weights, tokenizer through
``AutoTokenizer``, dtype, device, batch size) works on a run folder unchanged. What differs from a Hub model:

- the backend is always ``"causal"``, and a folder holding another model type is refused before its weights load;
- scoring forwards build no recurrent-state cache (``use_cache=False``); ``generate`` still uses it;
- the tokenizer returns no ``token_type_ids`` (the model has no segment embeddings);
- the end-of-text and prefix tokens fall back to the model config's ``eos_token_id``/``bos_token_id`` when the
  tokenizer has none, and a tokenizer with more tokens than the model's vocabulary is refused;
- log-softmax runs in float32 by default, so bf16 or fp16 weights do not round the log-likelihoods.
"""

from __future__ import annotations

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from attnkit.models import AttnKitForCausalLM  # importing it registers "attnkit" with the Auto classes


def _first(token_id: int | list[int] | None) -> int | None:
    return token_id[0] if isinstance(token_id, (list, tuple)) else token_id


@register_model("attnkit")
class AttnKitLM(HFLM):
    """An attnkit model (a ``save_pretrained`` folder, e.g. a run folder, or an ``AttnKitForCausalLM``) for
    lm-eval-harness.

    Takes ``HFLM``'s arguments, e.g. ``AttnKitLM(pretrained="runs/train", device="cuda", dtype="bfloat16",
    batch_size=16)``; ``max_length`` defaults to the config's ``max_position_embeddings``. From lm-eval's own API,
    after ``import attnkit.experiments.evaluate.lm``: ``simple_evaluate(model="attnkit",
    model_args={"pretrained": "runs/train"}, tasks=[...])``.
    """

    AUTO_MODEL_CLASS = transformers.AutoModelForCausalLM

    def __init__(
        self,
        pretrained: str | AttnKitForCausalLM,
        backend: str = "causal",
        softmax_dtype: str | torch.dtype | None = "float32",
        **kwargs,
    ) -> None:
        if backend not in ("causal", "default"):
            raise ValueError(f"backend: attnkit models are decoder-only ('causal'), got {backend!r}")
        if not isinstance(pretrained, (str, AttnKitForCausalLM)):
            raise ValueError(f"pretrained: expected a folder or an AttnKitForCausalLM, got {type(pretrained).__name__}")
        super().__init__(pretrained=pretrained, backend="causal", softmax_dtype=softmax_dtype, **kwargs)
        if self.prefix_token_id is None:
            raise ValueError(
                "tokenizer: neither it nor the model config has a BOS or EOS token, which lm-eval scores the first "
                "token after; pass prefix_token_id"
            )
        if len(self.tokenizer) > self.config.vocab_size:
            raise ValueError(
                f"tokenizer: {len(self.tokenizer)} tokens (with any pad token lm-eval added) but the model's "
                f"vocabulary has {self.config.vocab_size}"
            )

    def _get_config(self, pretrained: str, **kwargs) -> None:
        super()._get_config(pretrained, **kwargs)
        if self._config.model_type != "attnkit":
            raise ValueError(f"pretrained: {pretrained} holds a {self._config.model_type!r} model, not an attnkit one")

    def _create_tokenizer(self, *args, **kwargs) -> None:
        super()._create_tokenizer(*args, **kwargs)
        self.tokenizer.model_input_names = [n for n in self.tokenizer.model_input_names if n != "token_type_ids"]

    @property
    def eot_token_id(self) -> int | None:
        eos = self.tokenizer.eos_token_id
        return _first(self.config.eos_token_id) if eos is None else eos

    @property
    def prefix_token_id(self) -> int | None:
        """The token an empty context (and every rolling window's first token) is scored after."""
        candidates = (
            self.custom_prefix_token_id,
            self.tokenizer.bos_token_id,
            _first(self.config.bos_token_id),
            self.eot_token_id,
        )
        return next((t for t in candidates if t is not None), None)

    def _model_call(
        self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of the right-padded ``inps [B, T]`` (causal: padding cannot reach earlier
        positions), without building a cache."""
        if attn_mask is not None or labels is not None:
            raise ValueError("attn_mask: attnkit models are decoder-only; encoder masks and labels do not apply")
        amp = self.mixed_precision_dtype
        with torch.no_grad(), torch.autocast(self.device.type, dtype=amp, enabled=amp is not None):
            return self.model(input_ids=inps, use_cache=False).logits
