"""Functional attention ops (no parameters): PaTH, TAPA, VLA and the baselines of SPEC §5."""

from .path import path_attention

__all__ = ["path_attention"]
