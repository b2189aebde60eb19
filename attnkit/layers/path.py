"""PaTH and PaTH-FoX attention layers (arXiv 2505.16381), SPEC §2 and §6.

Per token: ``w`` = L2-normalised ``silu(conv(W_up W_down x))`` per key/value head, where ``conv`` is a short
causal depthwise convolution over the ``H*K`` output of the low-rank projection (the placement of FLA's
``PaTHAttention``, so every channel of ``w`` mixes a few neighbouring tokens); ``beta = 2·sigmoid(linear(x))``
in float32, optionally capped at ``beta_max``; for PaTH-FoX ``g = logsigmoid(linear(x))`` per query head.
The gates' projections and ``W_down`` run as one float32 product on their stacked weights (``linear_fp32``).
Where the attention runs its Triton kernels (:func:`attnkit.ops.path.path_backend`), the prefill computes ``w`` from
the projection's output in one fused op, forward and backward (``attnkit::path_direction``,
``ops/path/triton/direction.py``: the convolution restarted per sequence, ``silu`` and the normalisation, float32
inside) instead of a dozen elementwise PyTorch launches on ``[B, T, H*K]`` float32 tensors; the decoding step keeps
the PyTorch formula (one token).

The decoding cache holds per token the keys carried to the newest position (``path_carry_keys``), the values
and, for PaTH-FoX, the cumulative gate ``G`` (float32); per sequence it holds the last ``conv_size − 1``
inputs of the convolution (zero before the start of the sequence). Outside autograd a step runs in place
(``path_decode_step_``) on caches preallocated past their length, which grow by a quarter when full, so a step
copies no cache; under autograd it runs the copying ``path_decode_step``, which leaves earlier states intact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.ops.common.validation import check_scalar
from attnkit.ops.path import path_attention, path_backend, path_carry_keys, path_decode_step, path_decode_step_

from .base import State, TokenMixer, check_int, linear_fp32, segment_cumsum, sequence_lengths, token_positions

# FLA's PaTHAttention uses a rank-32 factorisation of the w projection; the paper's ablations do not tune it.
DEFAULT_W_RANK = 32


class PaTHAttention(TokenMixer):
    """PaTH attention; PaTH-FoX with ``use_forget_gate=True``.

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim: ``q: hidden -> HQ*D``, ``k, v: hidden -> H*D``,
            ``o: HQ*D -> hidden``, bias-free; ``H`` defaults to ``HQ`` and ``D`` to ``hidden_size // HQ``.
        use_forget_gate: add the FoX gate ``g = logsigmoid(linear(x))`` (with bias) per query head.
        w_rank: inner dimension of the low-rank ``w`` projection ``hidden -> w_rank -> H*D``;
            ``min(32, H*D)`` by default (FLA's choice).
        conv_size: taps of the causal depthwise convolution on ``w`` (1 disables the mixing of tokens).
        beta_max: None, or a cap on ``beta`` in ``(0, 2]`` (``2 − 1e-3`` is the paper's remedy for the bf16
            instability of long products of near-reflections).
        layer_idx: index of the layer in a model (for the model's cache), or None.
        backend: ``"auto" | "torch" | "triton"``, passed to :func:`attnkit.ops.path_attention`; where that runs
            its Triton kernels, the prefill's ``w`` comes from the fused ``attnkit::path_direction`` too.
    """

    cache_keys = ("k", "v", "conv")

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        use_forget_gate: bool = False,
        w_rank: int | None = None,
        conv_size: int = 3,
        beta_max: float | None = None,
        layer_idx: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, backend)
        HQ, H, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.use_forget_gate = bool(use_forget_gate)
        self.w_rank = min(DEFAULT_W_RANK, H * D) if w_rank is None else check_int("w_rank", w_rank)
        self.conv_size = check_int("conv_size", conv_size)
        self.beta_max = beta_max
        if beta_max is not None:
            self.beta_max = check_scalar("beta_max", beta_max, low=0.0, high=2.0, strict=False)
            if self.beta_max == 0.0:
                raise ValueError("beta_max: expected a value in (0, 2], got 0.0")

        self.init_qkvo()
        self.w_down = nn.Linear(hidden_size, self.w_rank, bias=False)
        self.w_up = nn.Linear(self.w_rank, H * D, bias=False)
        # Only the [C, 1, conv_size] weight and its initialisation are used: the convolution itself is written
        # out so that it restarts at every packed sequence.
        self.w_conv = nn.Conv1d(H * D, H * D, self.conv_size, groups=H * D, bias=False)
        self.beta_proj = nn.Linear(hidden_size, H, bias=True)
        self.g_proj = nn.Linear(hidden_size, HQ, bias=True) if self.use_forget_gate else None

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(r, beta, g)``: the low-rank ``r = w_down(x) [B,T,w_rank]``, ``beta [B,T,H]`` and ``g [B,T,HQ]`` (or
        None), all float32 under autocast too, from one product on the stacked weights of ``w_down``, ``beta_proj``
        and ``g_proj``: ``x`` read once and one gradient of ``x`` in the backward, where a 16-bit ``w_down`` of its
        own adds a cast of ``x``, its 16-bit products, and a cast and a sum of its gradient (in the profile of a 4-layer
        training step on 16384 tokens of hidden size 1024, H100, thirty-sixth session: about 0.7 ms of 58.9)."""
        layers = (self.w_down, self.beta_proj) if self.g_proj is None else (self.w_down, self.beta_proj, self.g_proj)
        r, beta_logit, *g_logit = linear_fp32(x, *layers)
        g = F.logsigmoid(g_logit[0]) if g_logit else None
        beta = 2 * torch.sigmoid(beta_logit)
        if self.beta_max is not None:
            beta = beta.clamp_max(self.beta_max)
        return r, beta, g

    def _low_rank(self, r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``u = w_up(r)`` ``[B, T, H*D]`` from :meth:`_projections`' float32 ``r``, in ``x``'s dtype before the
        product (autocast casts it further)."""
        return self.w_up(r.to(x.dtype))

    def _direction(self, conv_out: torch.Tensor) -> torch.Tensor:
        """``[B, T, H*D]`` convolution output -> unit ``w [B, T, H, D]`` (float32)."""
        B, T, _ = conv_out.shape
        return F.normalize(F.silu(conv_out.float()).view(B, T, self.num_kv_heads, self.head_dim), dim=-1)

    def _conv_direction(self, u: torch.Tensor, cu_seqlens: torch.Tensor | None, fused: bool) -> torch.Tensor:
        """``u [B, T, H*D]`` -> unit ``w [B, T, H, D]`` (float32) through the causal convolution restarted at every
        sequence; ``fused``: in one op (``attnkit::path_direction``, Triton), else in PyTorch."""
        weight = self.w_conv.weight[:, 0]  # [C, W]; column W-1 multiplies the current token
        if fused:
            # Imported here: Triton is a Linux-only dependency, and the PyTorch path must import without it.
            from attnkit.ops.path.triton.direction import path_direction

            return path_direction(u, weight, self.num_kv_heads, cu_seqlens)
        # tap i reads the token i back, if that is in the same sequence
        T = u.shape[1]
        positions = token_positions(u, cu_seqlens)
        conv = u * weight[:, -1]
        for i in range(1, self.conv_size):
            shifted = F.pad(u, (0, 0, i, 0))[:, :T]
            conv = conv + shifted * weight[:, -1 - i] * (positions >= i)[..., None]
        return self._direction(conv)

    def prefill(self, x: torch.Tensor, cu_seqlens: torch.Tensor, use_cache: bool) -> tuple[torch.Tensor, State, State]:
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        r, beta, g = self._projections(x)
        u = self._low_rank(r, x)  # [B, T, H*D]
        w = self._conv_direction(u, cu_seqlens, fused=path_backend(self.backend, q, v) == "triton")
        o = path_attention(q, k, v, w, beta, g, cu_seqlens=cu_seqlens, backend=self.backend)

        out = self.o_proj(o.reshape(B, T, o.shape[2] * o.shape[3]))
        if not use_cache:
            return out, {}, {}
        token_state = {"k": path_carry_keys(k, w, beta, cu_seqlens=cu_seqlens, backend=self.backend), "v": v}
        if g is not None:
            token_state["g"] = segment_cumsum(g, cu_seqlens)
        # the last conv_size - 1 inputs of every sequence, zero where the sequence is shorter
        lengths = sequence_lengths(x, cu_seqlens)
        eos = lengths.cumsum(0)
        index = eos[:, None] - (self.conv_size - 1) + torch.arange(self.conv_size - 1, device=x.device)
        rows = F.pad(u.reshape(B * T, u.shape[-1]), (0, 0, 1, 0))  # a zero row first: indexable when x is empty
        tail = rows[(index + 1).clamp_min(0)] * (index >= (eos - lengths)[:, None])[..., None]
        return out, token_state, {"conv": tail}

    def step(self, x: torch.Tensor, state: State, position: torch.Tensor) -> tuple[torch.Tensor, State]:
        B = x.shape[0]
        q, k, v = self.qkv(x)
        r, beta, g = self._projections(x)
        window = torch.cat([state["conv"], self._low_rank(r, x)], dim=1)  # [B, conv_size, C]
        w = self._direction((window * self.w_conv.weight[:, 0].t()).sum(1, keepdim=True))
        t = state["mask"].shape[1] - 1  # cached tokens before this one; slots past t are spare capacity
        names = ("k", "v", "g") if g is not None else ("k", "v")
        state = {**state, "conv": window[:, 1:]}
        if torch.is_grad_enabled():
            o, *caches = path_decode_step(
                q, k, v, w, beta, state["k"][:, :t], state["v"][:, :t], g, state["g"][:, :t] if g is not None else None,
                cache_mask=state["mask"], backend=self.backend,
            )  # fmt: skip
            state.update(zip(names, caches))
        else:
            state.update((name, _reserve(state[name], t)) for name in names)
            o = path_decode_step_(
                q, k, v, w, beta, state["k"], state["v"], t, g, state.get("g"), cache_mask=state["mask"],
                backend=self.backend,
            )  # fmt: skip
        return self.o_proj(o.reshape(B, 1, -1)), state


def _reserve(cache: torch.Tensor, t: int) -> torch.Tensor:
    """``cache [B, CAP, ...]`` whose first ``t`` slots are in use, with a free slot ``t``: the same tensor when it
    has one (and is contiguous), else a copy of those slots with a quarter more capacity (at least 256 slots)."""
    if cache.shape[1] > t and cache.is_contiguous():
        return cache
    grown = cache.new_zeros(cache.shape[0], t + max(256, t // 4), *cache.shape[2:])
    grown[:, :t] = cache[:, :t]
    return grown
