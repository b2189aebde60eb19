"""The VLA layer (SPEC §6): variational linear attention around ``attnkit.ops.vla``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.ops.common.validation import check_scalar
from attnkit.ops.vla import vla_attention, vla_backend, vla_decode_step

from .base import State, TokenMixer

__all__ = ["VLAAttention"]


class VLAAttention(TokenMixer):
    """Variational linear attention (arXiv 2605.11196).

    ``q`` and ``k`` go through ``elu + 1``; the penalty directions ``u`` come from their own projection,
    unit-normalised per head and divided by ``sqrt(K)`` (so ``Σ u uᵀ`` grows like ``t / K`` in trace);
    the heads' outputs are concatenated and LayerNorm-ed before the output projection, because the
    normalised read ``S q / nᵀq`` has no fixed scale. ``normalize_write=False`` is the paper's ablation that
    writes along the unnormalised ``A_t k̂_t`` (``mixer_kwargs={"vla": {"normalize_write": False}}`` in a model).

    Cache: ``S [N, H, V, K]``, ``A [N, H, K, K]``, ``n [N, H, K]`` in float32 (the ops' state).
    """

    cache_keys = ("S", "A", "n")

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        lam0: float = 0.1,
        eps: float = 1e-4,
        normalize_write: bool = True,
        layer_idx: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, backend, same_heads=True)
        self.lam0 = check_scalar("lam0", lam0, low=0.0)
        self.eps = check_scalar("eps", eps, low=0.0)
        if not isinstance(normalize_write, bool):
            raise ValueError(f"normalize_write: expected a bool, got {normalize_write!r}")
        self.normalize_write = normalize_write
        width = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(self.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, width, bias=False)
        self.u_proj = nn.Linear(self.hidden_size, width, bias=False)
        self.o_norm = nn.LayerNorm(width)
        self.o_proj = nn.Linear(width, self.hidden_size, bias=False)

    def _qkvu(
        self, x: torch.Tensor, fuse: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v, u [B, T, H, D]``. ``fuse`` (the prefill's), where the attention runs its Triton kernels: ``u``'s
        normalisation and scale in one kernel forward and one backward (``attnkit::vla_unit_keys`` with a floor and a
        scale) rather than a cast, a norm, a division and a product, each with its backward, on ``[B, T, H·D]``
        float32. The decoding step keeps the PyTorch formula (one token)."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q = F.elu(self.q_proj(x).view(B, T, H, D)) + 1
        k = F.elu(self.k_proj(x).view(B, T, H, D)) + 1
        v = self.v_proj(x).view(B, T, H, D)
        u = self.u_proj(x).view(B, T, H, D)
        if fuse and vla_backend(self.backend, q, v) == "triton":
            # Imported here: Triton is a Linux-only dependency, and the PyTorch path must import without it.
            from attnkit.ops.vla.parallel import vla_unit_keys_op

            return q, k, v, vla_unit_keys_op(u, 1e-12, D**-0.5)[0]  # F.normalize's floor
        acc = torch.promote_types(v.dtype, torch.float32)  # float32 at least, float64 for the reference tests
        return q, k, v, F.normalize(u.to(acc), dim=-1) * D**-0.5

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.o_norm(o.flatten(2)))

    def prefill(self, x: torch.Tensor, cu_seqlens: torch.Tensor, use_cache: bool) -> tuple[torch.Tensor, State, State]:
        q, k, v, u = self._qkvu(x, fuse=True)
        o, state = vla_attention(
            q,
            k,
            v,
            u,
            lam0=self.lam0,
            eps=self.eps,
            normalize_write=self.normalize_write,
            output_final_state=use_cache,  # training asks for no state: the kernels then skip the final A's inverse
            cu_seqlens=cu_seqlens,
            backend=self.backend,
        )
        if not use_cache:
            return self._out(o), {}, {}
        S, A, n = state
        return self._out(o), {}, {"S": S, "A": A, "n": n}

    def step(self, x: torch.Tensor, state: State, position: torch.Tensor) -> tuple[torch.Tensor, State]:
        o, (S, A, n) = vla_decode_step(
            *self._qkvu(x),
            (state["S"], state["A"], state["n"]),
            lam0=self.lam0,
            eps=self.eps,
            normalize_write=self.normalize_write,
        )
        return self._out(o), {**state, "S": S, "A": A, "n": n}
