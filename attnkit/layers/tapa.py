"""TAPA attention layer (arXiv 2509.12635), SPEC §3 and §6.

The decoding cache holds per token the raw keys, the values and the token's position within its sequence
(int64); a step appends its token and calls :func:`attnkit.ops.tapa.tapa_decode_step` with ``state["mask"]``.
"""

from __future__ import annotations

import torch

from attnkit.ops.common.validation import check_scalar
from attnkit.ops.tapa import tapa_attention, tapa_decode_step
from attnkit.ops.tapa.torch_impl import check_phase, check_theta

from .base import State, TokenMixer, token_positions


class TAPAAttention(TokenMixer):
    """Token-aware phase attention.

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim: ``q: hidden -> HQ*D``, ``k, v: hidden -> H*D``,
            ``o: HQ*D -> hidden``, bias-free; ``H`` defaults to ``HQ`` and ``D`` to ``hidden_size // HQ``.
        theta: fraction of each head used for the amplitude (``round(theta·D)`` channels); amplitude and
            phase parts must both be non-empty.
        alpha: exponent of the distance in the phase, ``>= 0``.
        phase: the phase function, ``"quadratic"`` (the paper's ``(q_P·k_P)/sqrt(dP)``) or ``"linear"`` (our analog
            of the paper's linear-phase ablation, ``(Σ q_P − Σ k_P)/sqrt(2·dP)``); see
            :func:`attnkit.ops.tapa_attention`. In a model config: ``mixer_kwargs={"tapa": {"phase": "linear"}}``.
        layer_idx: index of the layer in a model (for the model's cache), or None.
        backend: ``"auto" | "torch" | "triton"``, passed to :func:`attnkit.ops.tapa_attention`.
    """

    cache_keys = ("k", "v", "pos")

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        theta: float = 0.5,
        alpha: float = 0.1,
        layer_idx: int | None = None,
        backend: str = "auto",
        phase: str = "quadratic",
    ) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, backend)
        D = self.head_dim
        self.theta = check_theta(theta, D)
        self.alpha = check_scalar("alpha", alpha, low=0.0, strict=False)
        self.phase = check_phase(phase)
        self.init_qkvo()

    def prefill(self, x: torch.Tensor, cu_seqlens: torch.Tensor, use_cache: bool) -> tuple[torch.Tensor, State, State]:
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        kwargs = dict(theta=self.theta, alpha=self.alpha, phase=self.phase)
        o = tapa_attention(q, k, v, cu_seqlens=cu_seqlens, backend=self.backend, **kwargs)
        token_state = {"k": k, "v": v, "pos": token_positions(x, cu_seqlens)}
        return self.o_proj(o.reshape(B, T, o.shape[2] * o.shape[3])), token_state, {}

    def step(self, x: torch.Tensor, state: State, position: torch.Tensor) -> tuple[torch.Tensor, State]:
        B = x.shape[0]
        q, k, v = self.qkv(x)
        state = dict(state)
        state["k"] = torch.cat([state["k"], k], dim=1)
        state["v"] = torch.cat([state["v"], v], dim=1)
        state["pos"] = torch.cat([state["pos"], position[:, None].to(state["pos"].dtype)], dim=1)
        o = tapa_decode_step(
            q, state["k"], state["v"], position, state["pos"], state["mask"], theta=self.theta, alpha=self.alpha,
            phase=self.phase,
        )  # fmt: skip
        return self.o_proj(o.reshape(B, 1, -1)), state
