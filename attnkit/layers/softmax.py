"""Softmax attention baselines: RoPE, NoPE and the Forgetting Transformer (FoX), one implementation.

The decoding cache holds per token the keys (RoPE already applied), the values and, for FoX, the cumulative
log forget gate ``G`` of the token (float32); a step appends its token and attends over the cache with
``state["mask"]`` so that left-padding slots are excluded.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.ops.baselines.rope import apply_rope, rope_cos_sin, rope_inv_freq
from attnkit.ops.baselines.softmax import softmax_attention, softmax_decode_step
from attnkit.ops.common.validation import check_scalar

from .base import State, TokenMixer, linear_fp32, segment_cumsum, sequence_lengths, token_positions


class SoftmaxAttention(TokenMixer):
    """Causal softmax attention with GQA, optional RoPE and an optional FoX forget gate.

    Use the named layers :class:`RoPEAttention`, :class:`NoPEAttention` and :class:`FoXAttention`.

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim: ``q: hidden -> HQ*D``, ``k, v: hidden -> H*D``,
            ``o: HQ*D -> hidden``, bias-free; ``H`` defaults to ``HQ`` and ``D`` to ``hidden_size // HQ``.
        use_rope: rotate queries and keys by their position within the sequence (``D`` must be even).
        rope_theta: the RoPE base.
        rope_scaling: None or a transformers-style dict (``"linear"``, ``"ntk"``, ``"dynamic"``,
            ``"yarn"``), see :mod:`attnkit.ops.baselines.rope`. ``"dynamic"`` recomputes the base from each
            sequence's own length (prefill) or current length (decode), so cached keys keep the base they
            were rotated with, as in transformers; prefill + decode equals a full forward only while the
            sequence stays within ``original_max_position_embeddings``.
        use_forget_gate: FoX: ``g = logsigmoid(linear(x))`` per query head (with bias), logit
            ``scale·qᵀk + G_i − G_j``.
        layer_idx: index of the layer in a model (for the model's cache), or None.
        backend: ``"auto" | "torch" | "triton"``, passed to :func:`softmax_attention` (``"auto"`` runs SDPA
            without a gate, the FoX kernels on CUDA with one).
    """

    cache_keys = ("k", "v")

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        use_rope: bool = True,
        rope_theta: float = 10000.0,
        rope_scaling: Mapping | None = None,
        use_forget_gate: bool = False,
        layer_idx: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, backend)
        D = self.head_dim
        self.use_rope, self.use_forget_gate = bool(use_rope), bool(use_forget_gate)
        self.init_qkvo()
        self.g_proj = nn.Linear(hidden_size, self.num_heads, bias=True) if self.use_forget_gate else None
        self.rope_type = None
        if self.use_rope:
            if D % 2:
                raise ValueError(f"head_dim: RoPE needs an even head dimension, got {D}")
            self.rope_theta = check_scalar("rope_theta", rope_theta, low=1.0)
            if rope_scaling is not None and not isinstance(rope_scaling, Mapping):
                raise ValueError(f"rope_scaling: expected None or a dict, got {type(rope_scaling).__name__}")
            self.rope_scaling = None if rope_scaling is None else dict(rope_scaling)
            _, self.attention_factor = self._inv_freq()  # validates rope_scaling
            scaling = self.rope_scaling or {}
            self.rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        # Not a buffer: a float32 function of the config, so it must neither follow model.to(bfloat16) nor be
        # left uninitialised when Hugging Face builds the model on the meta device and loads the checkpoint.
        self._inv_freq_cache: dict[torch.device, torch.Tensor] = {}

    def _inv_freq(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        try:
            with torch.device("cpu"):
                return rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling, seq_len=seq_len)
        except ValueError as e:
            raise ValueError(f"rope_scaling: {e}") from e

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor):
        """RoPE on ``q [B,T,HQ,D]``, ``k [B,T,H,D]`` at ``positions [B,T]``; ``lengths [B,T]`` is the length of
        each token's sequence, read by ``"dynamic"`` scaling only."""
        device = q.device
        if self.rope_type == "dynamic":
            distinct, index = lengths.unique(return_inverse=True)
            inv_freq = torch.stack([self._inv_freq(n)[0] for n in distinct.tolist()]).to(device)[index]
        else:
            if device not in self._inv_freq_cache:
                self._inv_freq_cache[device] = self._inv_freq()[0].to(device)
            inv_freq = self._inv_freq_cache[device]
        cos, sin = rope_cos_sin(positions, inv_freq, self.attention_factor, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        q, k, v = self.qkv(x)
        g = None
        if self.g_proj is not None:
            g = F.logsigmoid(linear_fp32(x, self.g_proj))  # float32, under autocast too
        return q, k, v, g

    def prefill(self, x: torch.Tensor, cu_seqlens: torch.Tensor, use_cache: bool) -> tuple[torch.Tensor, State, State]:
        B, T, _ = x.shape
        q, k, v, g = self._project(x)
        if self.use_rope:
            positions = token_positions(x, cu_seqlens)
            seq_lengths = sequence_lengths(x, cu_seqlens)
            if cu_seqlens is None:
                lengths = seq_lengths[:, None].expand(B, T)
            else:
                lengths = torch.repeat_interleave(seq_lengths, seq_lengths)[None]
            q, k = self._rotate(q, k, positions, lengths)
        o = softmax_attention(q, k, v, g, cu_seqlens=cu_seqlens, backend=self.backend)
        token_state = {"k": k, "v": v}
        if g is not None and use_cache:  # the cache's cumulative gates; training needs no cache
            token_state["g"] = segment_cumsum(g, cu_seqlens)
        return self.o_proj(o.reshape(B, T, o.shape[2] * o.shape[3])), token_state, {}

    def step(self, x: torch.Tensor, state: State, position: torch.Tensor) -> tuple[torch.Tensor, State]:
        B = x.shape[0]
        q, k, v, g = self._project(x)
        if self.use_rope:
            q, k = self._rotate(q, k, position[:, None], position[:, None] + 1)
        state = dict(state)
        state["k"] = torch.cat([state["k"], k], dim=1)
        state["v"] = torch.cat([state["v"], v], dim=1)
        G_t = None
        if g is not None:
            G_t = g[:, 0] + (state["g"][:, -1] if state["g"].shape[1] else 0)
            state["g"] = torch.cat([state["g"], G_t[:, None]], dim=1)
        o = softmax_decode_step(q, state["k"], state["v"], state["mask"], state.get("g"), G_t)
        return self.o_proj(o.reshape(B, 1, -1)), state


class RoPEAttention(SoftmaxAttention):
    """Softmax attention with rotary position embedding (Llama); see :class:`SoftmaxAttention`."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        rope_theta: float = 10000.0,
        rope_scaling: Mapping | None = None,
        layer_idx: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(
            hidden_size, num_heads, num_kv_heads, head_dim, use_rope=True, rope_theta=rope_theta,
            rope_scaling=rope_scaling, layer_idx=layer_idx, backend=backend,
        )  # fmt: skip


class NoPEAttention(SoftmaxAttention):
    """Causal softmax attention without any position encoding; see :class:`SoftmaxAttention`."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        layer_idx: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(
            hidden_size, num_heads, num_kv_heads, head_dim, use_rope=False, layer_idx=layer_idx, backend=backend
        )


class FoXAttention(SoftmaxAttention):
    """Forgetting Transformer: softmax attention without RoPE plus a data-dependent forget gate per query head
    (``g = logsigmoid(linear(x))``, logit ``scale·qᵀk + G_i − G_j``); see :class:`SoftmaxAttention`."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        layer_idx: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(
            hidden_size, num_heads, num_kv_heads, head_dim, use_rope=False, use_forget_gate=True,
            layer_idx=layer_idx, backend=backend,
        )  # fmt: skip
