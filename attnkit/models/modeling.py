"""``AttnKitModel`` and ``AttnKitForCausalLM``: a Llama-style decoder whose token mixer is chosen per layer."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .. import layers
from .cache import AttnKitCache
from .configuration import AttnKitConfig

# mixer name -> (layer class, fixed arguments, whether it takes num_kv_heads)
MIXER_LAYERS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "path": ("PaTHAttention", {}, True),
    "path_fox": ("PaTHAttention", {"use_forget_gate": True}, True),
    "tapa": ("TAPAAttention", {}, True),
    "vla": ("VLAAttention", {}, False),
    "rope": ("RoPEAttention", {}, True),
    "nope": ("NoPEAttention", {}, True),
    "fox": ("FoXAttention", {}, True),
    "linear": ("LinearAttention", {}, True),
    "deltanet": ("DeltaNetAttention", {}, False),
    "stickbreaking": ("StickBreakingAttention", {}, True),
}


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


class AttnKitBlock(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: AttnKitConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = build_mixer(config, layer_idx)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        past_state: dict[str, torch.Tensor] | None,
        use_cache: bool,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        mixed, state = self.attn(self.attn_norm(hidden_states), attention_mask, cu_seqlens, past_state, use_cache)
        hidden_states = hidden_states + mixed
        return hidden_states + self.mlp(self.mlp_norm(hidden_states)), state


class AttnKitPreTrainedModel(PreTrainedModel):
    config_class = AttnKitConfig
    config: AttnKitConfig
    base_model_prefix = "model"
    _no_split_modules = ["AttnKitBlock"]
    # recurrent states cannot be rolled back to an earlier token (no assisted generation)
    _is_stateful = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # the model makes its own AttnKitCache; generate() must not hand it a DynamicCache
        return False


class AttnKitModel(AttnKitPreTrainedModel):
    """Embeddings, the stack of blocks and the final norm."""

    def __init__(self, config: AttnKitConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(AttnKitBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
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
        """``input_ids [B, T]`` (or ``inputs_embeds``) -> last hidden states ``[B, T, hidden]``.

        Positions are derived from ``attention_mask`` (left padding) and the cache, or restart at every
        ``cu_seqlens`` boundary for packed batches; ``position_ids`` is accepted for compatibility with
        ``generate()`` and not used.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids: pass exactly one of input_ids and inputs_embeds")
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is not None and not isinstance(cache, AttnKitCache):
            raise ValueError(f"cache: expected an AttnKitCache, got {type(cache).__name__}")
        if use_cache and cache is None:
            cache = AttnKitCache(self.config.num_hidden_layers)
        for i, block in enumerate(self.layers):
            past = None if cache is None else cache.layers[i].state
            hidden_states, state = block(hidden_states, attention_mask, cu_seqlens, past, use_cache)
            if use_cache:
                cache.layers[i].state = state
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache if use_cache else None)


class AttnKitForCausalLM(AttnKitPreTrainedModel, GenerationMixin):
    """``AttnKitModel`` with a language-modelling head; works with ``generate()`` and its cache."""

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
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits ``[B, T, vocab]`` (the last ``logits_to_keep`` positions when it is non-zero) and, with
        ``labels`` (``-100`` where nothing is scored), the next-token cross-entropy."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cu_seqlens=cu_seqlens,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)
