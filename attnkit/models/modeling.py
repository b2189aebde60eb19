"""``AttnKitModel`` and ``AttnKitForCausalLM``: a Llama-style decoder whose token mixer is chosen per layer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from .. import layers
from ..layers.base import State, check_attention_mask, check_decode_mask
from ..ops.common.validation import check_cu_seqlens, data_checked
from .cache import AttnKitCache
from .configuration import MIXER_LAYERS, AttnKitConfig

logger = logging.get_logger(__name__)

IGNORE_INDEX = -100


def build_mixer(config: AttnKitConfig, layer_idx: int) -> nn.Module:
    """The token mixer of layer ``layer_idx`` as the config describes it."""
    name = config.layer_mixers[layer_idx]
    cls_name, fixed, takes_kv_heads = MIXER_LAYERS[name]
    kwargs = {**fixed, **config.mixer_kwargs.get(name, {})}
    if takes_kv_heads:
        kwargs["num_kv_heads"] = config.num_kv_heads
    return getattr(layers, cls_name)(
        config.hidden_size,
        config.num_heads,
        head_dim=config.head_dim,
        layer_idx=layer_idx,
        backend=config.backend,
        **kwargs,
    )


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) · up(x))``, as in Llama."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AttnKitBlock(GradientCheckpointingLayer):
    """Pre-norm residual block: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))``.

    ``cache`` is this layer's state (the dict its mixer returned), and the block returns the new state rather than
    writing it anywhere, so under gradient checkpointing the backward's replay reads the same state: it may keep
    the cache (``_can_checkpoint_with_cache``). ``hidden_states`` must be passed positionally and the rest by
    keyword, as ``GradientCheckpointingLayer`` requires for ``use_reentrant=True``.
    """

    _can_checkpoint_with_cache = True

    def __init__(self, config: AttnKitConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = build_mixer(config, layer_idx)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: State | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, State | None]:
        mixed, state = self.attn(self.attn_norm(hidden_states), attention_mask, cu_seqlens, cache, use_cache)
        hidden_states = hidden_states + mixed
        return hidden_states + self.mlp(self.mlp_norm(hidden_states)), state


class AttnKitPreTrainedModel(PreTrainedModel):
    config_class = AttnKitConfig
    config: AttnKitConfig
    base_model_prefix = "model"
    _no_split_modules = ["AttnKitBlock"]
    # the blocks are GradientCheckpointingLayers: gradient_checkpointing_enable() recomputes each in the backward
    supports_gradient_checkpointing = True
    # recurrent states cannot be rolled back to an earlier token (no assisted generation)
    _is_stateful = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # the model makes its own AttnKitCache; generate() must not hand it a DynamicCache
        return False


def check_input_ids(input_ids: object, vocab_size: int) -> None:
    """``input_ids``: an integer ``[B, T]`` tensor of ids in ``[0, vocab_size)``.

    The range is checked without a host synchronisation off the CPU: CPU tensors (eager) raise a ``ValueError``
    at once; on other devices, and while ``torch.compile`` traces, the check is ``torch._assert_async``, so a bad
    id fails at the next synchronisation with this message (a device-side assertion, which, like the embedding's
    own out-of-range assertion that it pre-empts, leaves the CUDA context unusable).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids: expected a [B, T] tensor of token ids, got {shape}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids: expected an integer dtype, got {input_ids.dtype}")
    in_range = ((input_ids >= 0) & (input_ids < vocab_size)).all()
    if input_ids.device.type == "cpu" and not torch.compiler.is_compiling():
        if not in_range:
            low, high = int(input_ids.min()), int(input_ids.max())
            raise ValueError(f"input_ids: expected ids in [0, vocab_size={vocab_size}), got values in [{low}, {high}]")
    else:
        torch._assert_async(in_range, f"input_ids: expected ids in [0, vocab_size={vocab_size})")


def check_targets(name: str, targets: object, tokens: tuple[int, int]) -> None:
    """``labels`` or ``shift_labels``: an integer tensor shaped like the input's ``[B, T]``."""
    if not isinstance(targets, torch.Tensor):
        raise ValueError(f"{name}: expected a [B, T] tensor of token ids, got {type(targets).__name__}")
    if tuple(targets.shape) != tokens:
        raise ValueError(f"{name}: expected shape {list(tokens)} (the input's [B, T]), got {list(targets.shape)}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer dtype, got {targets.dtype}")


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Cross-entropy of ``logits [B, T, V]`` (in float32) against the targets of each position.

    Transformers' convention (``ForCausalLMLoss``): ``labels [B, T]`` are the tokens themselves, so position
    ``t`` is scored against ``labels[:, t + 1]`` (shifted here; the last position is not scored);
    ``shift_labels [B, T]`` are already aligned, position ``t`` against ``shift_labels[:, t]``, and win when both
    are given. ``ignore_index`` marks positions that are not scored.

    The sum over scored positions is divided by ``num_items_in_batch`` when given (the HF Trainer counts the
    scored tokens of the whole accumulated batch), else by the scored positions of this batch, at least 1: a
    batch with nothing to score (``T = 0``, every target ignored) has loss 0 on the graph, not NaN. This is the
    loss of attnkit's trainer.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[:, 1:]
    targets = shift_labels.to(logits.device).long().flatten()
    total = F.cross_entropy(logits.float().flatten(0, 1), targets, ignore_index=ignore_index, reduction="sum")
    count = (targets != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
    if isinstance(count, torch.Tensor):
        return total / count.to(total.device).clamp_min(1)
    return total / max(count, 1)


class AttnKitModel(AttnKitPreTrainedModel):
    """Embeddings, the stack of blocks and the final norm."""

    def __init__(self, config: AttnKitConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(AttnKitBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: AttnKitCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """``input_ids [B, T]`` (ids in ``[0, vocab_size)``; see :func:`check_input_ids`) or ``inputs_embeds
        [B, T, hidden]`` -> last hidden states ``[B, T, hidden]``.

        Positions are derived from ``attention_mask`` (left padding) and the cache, or restart at every
        ``cu_seqlens`` boundary for packed batches; ``position_ids`` is accepted for compatibility with
        ``generate()`` and not used. Rows of ``attention_mask`` that are all padding give finite hidden states
        (the mixers output zeros there). A batch without tokens (``B = 0`` or ``T = 0``) gives an empty output
        on the graph, and the cache is returned as it was given.

        Under gradient checkpointing in training (with gradients enabled), ``use_cache`` is turned off with a
        warning, as in transformers' models; the blocks are recomputed in the backward.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids: pass exactly one of input_ids and inputs_embeds")
        if input_ids is not None:
            check_input_ids(input_ids, self.config.vocab_size)
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            logger.warning_once(
                "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`."
            )
            use_cache = False
        if cache is not None and not isinstance(cache, AttnKitCache):
            raise ValueError(f"cache: expected an AttnKitCache, got {type(cache).__name__}")
        if use_cache and cache is None:
            cache = AttnKitCache(self.config.num_hidden_layers)
        if hidden_states.dim() == 3 and hidden_states.shape[0] * hidden_states.shape[1] == 0:
            # Nothing to mix and nothing to cache: each block runs on the empty dense batch, which every mixer
            # handles on the graph; a mask, packing or a past state would only describe tokens that are not there.
            for block in self.layers:
                hidden_states, _ = block(hidden_states)
            return BaseModelOutputWithPast(
                last_hidden_state=self.norm(hidden_states), cache=cache if use_cache else None
            )
        # The index inputs are checked once here, not once a layer (each check reads the device).
        B, T = hidden_states.shape[:2]
        if cu_seqlens is not None and hidden_states.dim() == 3:
            check_cu_seqlens(cu_seqlens, B, T, hidden_states.device)
        if attention_mask is not None and hidden_states.dim() == 3:
            if cache is not None and cache.layers[0].state is not None:
                check_decode_mask(attention_mask, B, T)
            else:
                check_attention_mask(attention_mask, B, T)
        with data_checked():
            for i, block in enumerate(self.layers):
                past = None if cache is None else cache.layers[i].state
                hidden_states, state = block(
                    hidden_states, attention_mask=attention_mask, cu_seqlens=cu_seqlens, cache=past, use_cache=use_cache
                )
                if use_cache:
                    cache.layers[i].state = state
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache if use_cache else None)


class AttnKitForCausalLM(AttnKitPreTrainedModel, GenerationMixin):
    """``AttnKitModel`` with a language-modelling head; works with ``generate()`` and its cache, and with
    ``gradient_checkpointing_enable()``."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: AttnKitConfig) -> None:
        super().__init__(config)
        self.model = AttnKitModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: AttnKitCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cu_seqlens: torch.Tensor | None = None,
        shift_labels: torch.LongTensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits ``[B, T, vocab]`` (the last ``logits_to_keep`` positions when it is non-zero) and, with targets,
        the cross-entropy of :func:`causal_lm_loss`.

        Targets, ``[B, T]`` integer tensors with ``-100`` where nothing is scored:

        - ``labels``: the Hugging Face convention, the tokens themselves; shifted inside, so position ``t`` is
          scored against ``labels[:, t + 1]``.
        - ``shift_labels``: targets already aligned with the positions, position ``t`` against
          ``shift_labels[:, t]``, not shifted again (transformers' keyword of the same name). attnkit's tasks
          produce such targets, some of which are not the next token (the running product of a group word,
          the value at a VLA-MQAR query); :class:`attnkit.tasks.collator.TaskCollator` passes them this way.
          When both are given, ``shift_labels`` is used, as in transformers.

        ``num_items_in_batch`` (in ``kwargs``, from the HF Trainer) divides the summed loss instead of the
        scored count. A loss needs the logits of every position (``logits_to_keep=0``).
        """
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cu_seqlens=cu_seqlens,
        )
        hidden_states = outputs.last_hidden_state
        tokens = tuple(hidden_states.shape[:2])
        for name, targets in (("labels", labels), ("shift_labels", shift_labels)):
            if targets is not None:
                check_targets(name, targets, tokens)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep])
        loss = None
        if labels is not None or shift_labels is not None:
            if logits.shape[1] != tokens[1]:
                raise ValueError("logits_to_keep: a loss needs the logits of every position; pass logits_to_keep=0")
            loss = causal_lm_loss(
                logits,
                labels,
                shift_labels,
                num_items_in_batch=kwargs.get("num_items_in_batch"),
                ignore_index=kwargs.get("ignore_index", IGNORE_INDEX),
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)
