"""Build an attnkit model from a Hugging Face Llama-family model.

The first step of the paper's RoPE → PaTH conversion: embeddings, norms, MLPs and the q/k/v/o projections
are copied; what the new mixer adds (PaTH's transition and gate projections, TAPA needs nothing new, VLA's
penalty projection and output norm ...) keeps its fresh initialisation and is what fine-tuning learns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .configuration import AttnKitConfig
from .modeling import AttnKitForCausalLM

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ATTN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _copy_linear(name: str, dst: nn.Linear, src: nn.Linear, head_dim: int) -> None:
    weight = src.weight.detach()
    if weight.shape != dst.weight.shape:
        # a mixer without GQA (VLA, DeltaNet) gets every key/value head repeated for its query heads
        rows, cols = dst.weight.shape
        if cols != weight.shape[1] or rows % weight.shape[0]:
            raise ValueError(f"llama: {name} has shape {list(weight.shape)}, expected {list(dst.weight.shape)}")
        groups = rows // weight.shape[0]
        weight = weight.view(-1, head_dim, cols).repeat_interleave(groups, dim=0).reshape(rows, cols)
    with torch.no_grad():
        dst.weight.copy_(weight)


def from_llama(
    llama: nn.Module, mixer: str | list[str] = "path", mixer_kwargs: dict[str, dict[str, Any]] | None = None, **config
) -> AttnKitForCausalLM:
    """An ``AttnKitForCausalLM`` with the weights of ``llama`` (a ``LlamaForCausalLM`` or a model of the
    same layout: ``model.embed_tokens``, ``model.layers[i].{input_layernorm, self_attn.{q,k,v,o}_proj,
    post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``model.norm``, ``lm_head``).

    ``mixer="rope"`` reproduces the Llama model itself (same rotary base and scaling), a check of the copy.
    Extra keyword arguments override ``AttnKitConfig`` fields.
    """
    lc = llama.config
    if getattr(lc, "attention_bias", False) or getattr(lc, "mlp_bias", False):
        raise ValueError("llama: projections with biases are not supported")
    if getattr(lc, "hidden_act", "silu") != "silu":
        raise ValueError(f"llama: hidden_act {lc.hidden_act!r} is not supported (only silu)")
    head_dim = getattr(lc, "head_dim", None) or lc.hidden_size // lc.num_attention_heads
    mixer_kwargs = {name: dict(extra) for name, extra in (mixer_kwargs or {}).items()}
    rope = getattr(lc, "rope_parameters", None) or getattr(lc, "rope_scaling", None)
    rope_kwargs = mixer_kwargs.setdefault("rope", {})
    if rope:
        rope_kwargs.setdefault("rope_scaling", dict(rope))
    if getattr(lc, "rope_theta", None) is not None:
        rope_kwargs.setdefault("rope_theta", lc.rope_theta)
    settings = dict(
        vocab_size=lc.vocab_size,
        hidden_size=lc.hidden_size,
        num_hidden_layers=lc.num_hidden_layers,
        num_heads=lc.num_attention_heads,
        num_kv_heads=lc.num_key_value_heads or lc.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=lc.intermediate_size,
        rms_norm_eps=lc.rms_norm_eps,
        tie_word_embeddings=getattr(lc, "tie_word_embeddings", False),
        pad_token_id=lc.pad_token_id,
        bos_token_id=lc.bos_token_id,
        eos_token_id=lc.eos_token_id,
        mixer=mixer,
        mixer_kwargs=mixer_kwargs,
    )
    settings.update(config)
    model = AttnKitForCausalLM(AttnKitConfig(**settings))
    src, dst = llama.model, model.model
    with torch.no_grad():
        dst.embed_tokens.weight.copy_(src.embed_tokens.weight)
        dst.norm.weight.copy_(src.norm.weight)
        if not model.config.tie_word_embeddings:
            model.lm_head.weight.copy_(llama.lm_head.weight)
        for i, (s, d) in enumerate(zip(src.layers, dst.layers, strict=True)):
            d.attn_norm.weight.copy_(s.input_layernorm.weight)
            d.mlp_norm.weight.copy_(s.post_attention_layernorm.weight)
            pairs = [(f"mlp.{p}", getattr(d.mlp, p), getattr(s.mlp, p)) for p in MLP_PROJECTIONS]
            pairs += [(f"self_attn.{p}", getattr(d.attn, p), getattr(s.self_attn, p)) for p in ATTN_PROJECTIONS]
            for name, dst_proj, src_proj in pairs:
                _copy_linear(f"layers[{i}].{name}", dst_proj, src_proj, head_dim)
    return model.to(next(llama.parameters()).dtype)
