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
    normalised read ``S q / nᵀq`` has no fixed scale. Where the attention runs its Triton kernels (``vla_backend``) the
    prefill fuses its glue around them: ``elu + 1`` of ``q`` and ``k`` (``attnkit::elu_plus_one``), ``u``'s
    normalisation (``attnkit::vla_unit_keys``) and the LayerNorm (``attnkit::layer_norm``, written in ``o_proj``'s
    compute dtype), each one launch forward and one backward; the parameters are the same either way.
    ``normalize_write=False`` is the paper's ablation that writes along the unnormalised ``A_t k̂_t``
    (``mixer_kwargs={"vla": {"normalize_write": False}}`` in a model).

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

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections of ``q, k, v, u``, each ``[B, T, H, D]``."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        return tuple(p(x).view(B, T, H, D) for p in (self.q_proj, self.k_proj, self.v_proj, self.u_proj))

    def _features(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, u: torch.Tensor, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v, u [B, T, H, D]`` from the projections. ``fused`` (the prefill's, where the attention runs its
        Triton kernels): ``u``'s normalisation and scale in one kernel forward and one backward
        (``attnkit::vla_unit_keys`` with a floor and a scale) rather than a cast, a norm, a division and a product, each
        with its backward, on ``[B, T, H·D]`` float32; ``elu + 1`` of ``q`` and ``k`` in one launch forward and one
        backward (``attnkit::elu_plus_one``) rather than an elu and an add each, and an elu backward each. The decoding
        step keeps the PyTorch formulas (one token)."""
        D = self.head_dim
        if fused:
            # Imported here: Triton is a Linux-only dependency, and the PyTorch path must import without it.
            from attnkit.ops.common.feature_map import elu_plus_one
            from attnkit.ops.vla.parallel import vla_unit_keys_op

            return *elu_plus_one(q, k), v, vla_unit_keys_op(u, 1e-12, D**-0.5)[0]  # F.normalize's floor
        q, k = F.elu(q) + 1, F.elu(k) + 1
        acc = torch.promote_types(v.dtype, torch.float32)  # float32 at least, float64 for the reference tests
        return q, k, v, F.normalize(u.to(acc), dim=-1) * D**-0.5

    def _qkvu(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v, u [B, T, H, D]`` of ``x [B, T, hidden]`` by the PyTorch formulas (the decoding step's)."""
        return self._features(*self._project(x), fused=False)

    def _out(self, o: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``o [B, T, H, D]`` -> the output ``[B, T, hidden]``. ``fused`` (as :meth:`_features`): ``o_norm`` in one
        kernel forward and one backward (``attnkit::layer_norm``, its own weight, bias and eps) that read ``o`` in its
        dtype and write the dtype ``o_proj`` computes in, the autocast dtype under autocast (PyTorch's LayerNorm would
        run in float32 there, between casts each way), else ``o``'s (``o_norm``'s own result dtype)."""
        o = o.flatten(2)
        if not fused:
            return self.o_proj(self.o_norm(o))
        from attnkit.ops.common.layer_norm import MAX_N, layer_norm  # Triton's, imported where it runs (as u's op)

        if o.shape[-1] > MAX_N:  # rows wider than the kernels hold in registers: PyTorch's
            return self.o_proj(self.o_norm(o))
        device = o.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else o.dtype
        return self.o_proj(layer_norm(o, self.o_norm.weight, self.o_norm.bias, self.o_norm.eps, dtype))

    def prefill(self, x: torch.Tensor, cu_seqlens: torch.Tensor, use_cache: bool) -> tuple[torch.Tensor, State, State]:
        q, k, v, u = self._project(x)
        fused = vla_backend(self.backend, q, v) == "triton"
        q, k, v, u = self._features(q, k, v, u, fused)
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
            return self._out(o, fused), {}, {}
        S, A, n = state
        return self._out(o, fused), {}, {"S": S, "A": A, "n": n}

    def step(self, x: torch.Tensor, state: State, position: torch.Tensor) -> tuple[torch.Tensor, State]:
        o, (S, A, n) = vla_decode_step(
            *self._qkvu(x),
            (state["S"], state["A"], state["n"]),
            lam0=self.lam0,
            eps=self.eps,
            normalize_write=self.normalize_write,
        )
        return self._out(o), {**state, "S": S, "A": A, "n": n}
