"""Recurrent baseline layers of SPEC §5/§6: normalised linear attention and DeltaNet.

Both are recurrent mixers: no per-token cache, the state of each sequence lives in ``seq_state``
(``[N, ...]``, float32). Prefill runs the chunked ops; a decode step is the recurrence for one token
written out here (a few batched matmuls), which is much cheaper than the chunked op at ``T = 1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.ops.baselines import delta_rule, linear_attention
from attnkit.ops.baselines.delta_rule import delta_rule_step
from attnkit.ops.baselines.linear import linear_attention_step
from attnkit.ops.common.validation import check_scalar

from .base import State, TokenMixer

__all__ = ["DeltaNetAttention", "LinearAttention"]


class LinearAttention(TokenMixer):
    """Normalised linear attention (Katharopoulos et al. 2020) with ``elu + 1`` features and GQA.

    Cache: ``S [N, H, V, K]`` and ``n [N, H, K]`` in float32.
    """

    cache_keys = ("S", "n")

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        eps: float = 1e-4,
        layer_idx: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, backend)
        self.eps = check_scalar("eps", eps, low=0.0)
        HQ, H, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(self.hidden_size, HQ * D, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, H * D, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, H * D, bias=False)
        self.o_proj = nn.Linear(HQ * D, self.hidden_size, bias=False)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        q = F.elu(self.q_proj(x).view(B, T, self.num_heads, self.head_dim)) + 1
        k = F.elu(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)) + 1
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        return q, k, v

    def prefill(self, x: torch.Tensor, cu_seqlens: torch.Tensor, use_cache: bool) -> tuple[torch.Tensor, State, State]:
        q, k, v = self._qkv(x)
        o, (S, n) = linear_attention(
            q, k, v, eps=self.eps, output_final_state=True, cu_seqlens=cu_seqlens, backend=self.backend
        )
        return self.o_proj(o.flatten(2)), {}, {"S": S, "n": n}

    def step(self, x: torch.Tensor, state: State, position: torch.Tensor) -> tuple[torch.Tensor, State]:
        q, k, v = self._qkv(x)
        o, S, n = linear_attention_step(q, k, v, state["S"], state["n"], self.eps)
        return self.o_proj(o.flatten(2)), {**state, "S": S, "n": n}


class DeltaNetAttention(TokenMixer):
    """DeltaNet (Yang et al. 2024): L2-normalised queries and keys per head, ``beta = sigmoid(linear(x))``
    in float32 (times 2 with ``allow_neg_eigval``, so the transition ``I − β k kᵀ`` may flip sign along k).

    Cache: ``S [N, H, V, K]`` in float32.
    """

    cache_keys = ("S",)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        allow_neg_eigval: bool = False,
        layer_idx: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, backend, same_heads=True)
        if not isinstance(allow_neg_eigval, bool):
            raise ValueError(f"allow_neg_eigval: expected a bool, got {allow_neg_eigval!r}")
        self.allow_neg_eigval = allow_neg_eigval
        self.scale = self.head_dim**-0.5
        H, D = self.num_heads, self.head_dim
        self.q_proj = nn.Linear(self.hidden_size, H * D, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, H * D, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, H * D, bias=False)
        self.b_proj = nn.Linear(self.hidden_size, H, bias=False)
        self.o_proj = nn.Linear(H * D, self.hidden_size, bias=False)

    def _qkvb(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        v = self.v_proj(x).view(B, T, H, D)
        # normalisation and gates in float32 at least (float64 stays float64, for the reference tests)
        acc = torch.promote_types(v.dtype, torch.float32)
        q, k = (F.normalize(p(x).view(B, T, H, D).to(acc), dim=-1).to(v.dtype) for p in (self.q_proj, self.k_proj))
        beta = self.b_proj(x).to(acc).sigmoid()
        if self.allow_neg_eigval:
            beta = 2 * beta
        return q, k, v, beta

    def prefill(self, x: torch.Tensor, cu_seqlens: torch.Tensor, use_cache: bool) -> tuple[torch.Tensor, State, State]:
        q, k, v, beta = self._qkvb(x)
        o, S = delta_rule(
            q, k, v, beta, scale=self.scale, output_final_state=True, cu_seqlens=cu_seqlens, backend=self.backend
        )
        return self.o_proj(o.flatten(2)), {}, {"S": S}

    def step(self, x: torch.Tensor, state: State, position: torch.Tensor) -> tuple[torch.Tensor, State]:
        q, k, v, beta = self._qkvb(x)
        o, S = delta_rule_step(q, k, v, beta, state["S"], self.scale)
        return self.o_proj(o.flatten(2)), {**state, "S": S}
