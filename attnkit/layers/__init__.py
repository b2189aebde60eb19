"""Attention layers (``nn.Module``): projections, feature maps and decoding caches around ``attnkit.ops``."""

from .base import State, TokenMixer
from .linear import DeltaNetAttention, LinearAttention
from .path import PaTHAttention
from .softmax import FoXAttention, NoPEAttention, RoPEAttention
from .stickbreaking import StickBreakingAttention
from .tapa import TAPAAttention
from .vla import VLAAttention

__all__ = [
    "State",
    "TokenMixer",
    "DeltaNetAttention",
    "LinearAttention",
    "VLAAttention",
    "PaTHAttention",
    "RoPEAttention",
    "NoPEAttention",
    "FoXAttention",
    "StickBreakingAttention",
    "TAPAAttention",
]
