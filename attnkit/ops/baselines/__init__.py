"""Baselines of SPEC §5: softmax / FoX attention, RoPE with PI, NTK and YaRN scaling, linear attention and
DeltaNet, under the conventions of the attnkit ops."""

from .delta_rule import delta_rule
from .linear import linear_attention
from .rope import apply_rope, rope_cos_sin, rope_inv_freq
from .softmax import softmax_attention

__all__ = ["apply_rope", "delta_rule", "linear_attention", "rope_cos_sin", "rope_inv_freq", "softmax_attention"]
