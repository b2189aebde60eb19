"""Functional attention ops (no parameters): PaTH, TAPA, VLA and the baselines of SPEC §5."""

from .baselines import delta_rule, linear_attention, softmax_attention
from .path import path_attention
from .stickbreaking import stickbreaking_attention
from .tapa import tapa_attention
from .vla import vla_attention

__all__ = [
    "delta_rule",
    "linear_attention",
    "path_attention",
    "softmax_attention",
    "stickbreaking_attention",
    "tapa_attention",
    "vla_attention",
]
