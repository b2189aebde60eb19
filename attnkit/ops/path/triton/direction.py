"""PaTH's transition directions in one fused op, ``attnkit::path_direction``: for ``u [B, T, C]`` (``C = H·D``) and
a depthwise causal convolution ``weight [C, W]`` (column ``W − 1`` multiplies the current token)

    conv[t, c] = Σ_{i<W} u[t − i, c] · weight[c, W − 1 − i]     (taps inside the token's own sequence only)
    w[t, h, :] = silu(conv[t, hD:(h+1)D]) / max(‖silu(conv[t, hD:(h+1)D])‖, 1e-12)          (float32)

what the layer's PyTorch glue computes in a dozen elementwise launches. One program per (block of ``BT`` positions
of a sequence, head) holds a head's ``D`` channels, so the norm is a row sum in registers. The backward (one kernel)
recomputes the forward: with ``s = silu(conv)``, ``m = max(‖s‖, ε)`` and ``w = s / m``,

    ds = (dw − [‖s‖ > ε] · w (w · dw)) / m,     dconv = ds · σ(conv) (1 + conv (1 − σ(conv)))
    du[t] = Σ_i dconv[t + i] · weight[:, W − 1 − i],     dweight[:, W − 1 − i] = Σ_t dconv[t] · u[t − i]

the first sum over ``t + i`` in ``t``'s sequence: a program recomputes ``dconv`` at its rows shifted by each tap
(``W²`` loads of ``u`` tiles, mostly cache hits) rather than storing it, and writes its share of ``dweight`` to its own
slot of a ``[programs, C, W]`` buffer that one sum reduces (deterministic, no atomics). Storing ``dconv`` once a
position instead (a float32 ``[B, T, C]`` buffer, then ``du`` and ``dweight`` from its shifted tiles) was slower on an
H100: 251 against 236 µs at ``[4, 4096, 1024]``, bf16 ``u`` (thirty-sixth session,
``direction_ab_session36_h100.json``). Packed sequences (``cu_seqlens``, ``B == 1``) run in the same launches
(:func:`~attnkit.ops.common.triton_seq.launch_grid`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_seq import launch_grid, program_block
from attnkit.ops.common.triton_utils import block_dim, interpreting
from attnkit.ops.common.validation import check_cu_seqlens

EPS = 1e-12  # F.normalize's


@triton.jit
def shifted_u(u, i_b, bos, o_t, i, L, o_c, m_c, s_b, s_t, s_c):
    """``u`` at positions ``o_t − i`` of the sequence starting at token ``bos`` of row ``i_b``, channels ``o_c`` (mask
    ``m_c``), read through its strides: float32 ``[BT, BD]``, zero where ``o_t − i < 0`` or ``o_t >= L``."""
    o_s = o_t - i
    p_u = u + i_b * s_b + (bos + o_s).to(tl.int64)[:, None] * s_t + o_c[None, :] * s_c
    return tl.load(p_u, mask=((o_s >= 0) & (o_t < L))[:, None] & m_c[None, :], other=0.0).to(tl.float32)


@triton.jit
def conv_tile(
    u, weight, i_b, bos, o_t, L, o_c, m_c, s_b, s_t, s_c, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr
):
    """``conv`` at positions ``o_t`` (float32 ``[BT, BD]``, zero outside ``[0, L)``); arguments of :func:`shifted_u`."""
    b_c = tl.zeros([BT, BD], dtype=tl.float32)
    for i in tl.static_range(W):
        b_u = shifted_u(u, i_b, bos, o_t, i, L, o_c, m_c, s_b, s_t, s_c)
        b_w = tl.load(weight + o_c * W + (W - 1 - i), mask=m_c, other=0.0).to(tl.float32)
        b_c += b_u * b_w[None, :]
    return b_c


@triton.jit
def token_offsets(i_b, bos, o_t, T, o_c, C):
    """Offsets of positions ``o_t`` of the sequence, channels ``o_c``, in a contiguous ``[B, T, C]`` tensor."""
    return (i_b * T + bos + o_t.to(tl.int64))[:, None] * C + o_c[None, :]


@triton.jit
def silu_normalize(b_c, eps):
    """``(w, σ(conv), ‖s‖, max(‖s‖, ε))`` of a ``[BT, BD]`` tile of ``conv``, ``s = silu(conv)``, norms per row."""
    b_sig = 1.0 / (1.0 + tl.exp(-b_c))
    b_s = b_c * b_sig
    b_n = tl.sqrt(tl.sum(b_s * b_s, 1))
    b_m = tl.maximum(b_n, eps)
    return b_s / b_m[:, None], b_sig, b_n, b_m


@triton.jit
def direction_fwd_kernel(
    u, weight, w, cu_seqlens, offsets, N, T, s_b, s_t, s_c, eps,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
    LOG_N: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """``u [B, T, H·D]`` (strided), ``weight [H·D, W]`` -> ``w [B, T, H, D]`` float32. Grid :func:`launch_grid`."""
    i_b, i_h, bos, L, i_blk = program_block(cu_seqlens, offsets, N, T, H, LOG_N, IS_VARLEN)
    o_t = i_blk * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_c = i_h * D + o_d
    b_c = conv_tile(u, weight, i_b, bos, o_t, L, o_c, m_d, s_b, s_t, s_c, W, BT, BD)
    b_w, _, _, _ = silu_normalize(b_c, eps)
    tl.store(w + token_offsets(i_b, bos, o_t, T, o_c, H * D), b_w, mask=(o_t < L)[:, None] & m_d[None, :])


@triton.jit
def direction_bwd_kernel(
    u, weight, dw, du, dweight, cu_seqlens, offsets, N, T, s_b, s_t, s_c, eps,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
    LOG_N: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """``dw [B, T, H, D]`` float32 -> ``du [B, T, H·D]`` (contiguous, ``du``'s dtype) and this program's share of
    ``dweight`` in its slot of ``dweight [programs, H·D, W]`` float32. Grid :func:`launch_grid`."""
    i_b, i_h, bos, L, i_blk = program_block(cu_seqlens, offsets, N, T, H, LOG_N, IS_VARLEN)
    o_t = i_blk * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_c = i_h * D + o_d
    m_t = o_t < L
    b_du = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        # dconv at the positions j after this block's: tap j of those tokens reads this block's u
        o_r = o_t + j
        m_r = (o_r < L)[:, None] & m_d[None, :]
        b_c = conv_tile(u, weight, i_b, bos, o_r, L, o_c, m_d, s_b, s_t, s_c, W, BT, BD)
        b_w, b_sig, b_n, b_m = silu_normalize(b_c, eps)
        b_dw = tl.load(dw + token_offsets(i_b, bos, o_r, T, o_c, H * D), mask=m_r, other=0.0)
        b_proj = tl.where(b_n > eps, tl.sum(b_w * b_dw, 1), 0.0)
        b_ds = (b_dw - b_w * b_proj[:, None]) / b_m[:, None]
        b_dc = b_ds * b_sig * (1.0 + b_c * (1.0 - b_sig))
        b_k = tl.load(weight + o_c * W + (W - 1 - j), mask=m_d, other=0.0).to(tl.float32)
        b_du += b_dc * b_k[None, :]
        if j == 0:
            slot = i_b * tl.num_programs(0) + tl.program_id(0)
            for i in tl.static_range(W):
                b_u = shifted_u(u, i_b, bos, o_t, i, L, o_c, m_d, s_b, s_t, s_c)
                tl.store(dweight + (slot * H * D + o_c) * W + (W - 1 - i), tl.sum(b_dc * b_u, 0), mask=m_d)
    tl.store(
        du + token_offsets(i_b, bos, o_t, T, o_c, H * D), b_du.to(du.dtype.element_ty), mask=m_t[:, None] & m_d[None, :]
    )


def block_tokens(head_dim: int) -> int:
    """Positions a forward program: ``[BT, BD]`` tiles of about 2048 floats on a GPU (8 a thread with 8 warps); 16
    under the interpreter, so that the tests' short sequences cross blocks."""
    return 16 if interpreting() else max(16, min(128, 2048 // block_dim(head_dim)))


def backward_tiles(head_dim: int) -> tuple[int, int]:
    """``(positions, warps)`` of a backward program: tiles of about 512 floats a warp, 8 positions at least (16 under
    the interpreter). Its reductions along the rows then stay inside a warp: at ``[4, 4096, 1024]``, ``D = 64`` on an
    H100 the backward took 130 µs with 8 positions on one warp, 146 with 16 on two, 215 with 16 on four, 236–251 with
    32–128 positions on four or eight warps, the earlier 32 on eight (``direction_tune_session36_h100.json``; the
    forward 40–44 µs in every one). ``D = 128`` (two warps) is the same rule, untimed. The ``dweight`` shares, one
    slot a program, are then ``T / 8`` slots of ``H·D·W`` floats a sequence: 50 MB at 32k tokens of ``H·D = 1024``."""
    if interpreting():
        return 16, 1
    positions = max(8, 512 // block_dim(head_dim))
    return positions, max(1, positions * block_dim(head_dim) // 512)


def _launch(u: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None, heads: int, backward: bool = False):
    B, T, C = u.shape
    D = C // heads
    BT, warps = backward_tiles(D) if backward else (block_tokens(D), 8)
    grid, offsets, N, LOG_N = launch_grid(cu_seqlens, B, T, heads, BT)
    args = dict(H=heads, D=D, BD=block_dim(D), W=weight.shape[1], BT=BT, LOG_N=LOG_N, IS_VARLEN=cu_seqlens is not None)
    args["num_warps"] = warps
    return grid, (cu_seqlens, offsets, N, T, *u.stride(), EPS), args


def path_direction_fwd_fn(
    u: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None, heads: int
) -> torch.Tensor:
    """``w [B, T, H, D]`` float32 from ``u [B, T, H·D]`` (any strides) and a contiguous ``weight [H·D, W]``."""
    B, T, C = u.shape
    w = torch.empty(B, T, heads, C // heads, dtype=torch.float32, device=u.device)
    if w.numel() > 0:
        grid, common, args = _launch(u, weight, cu_seqlens, heads)
        direction_fwd_kernel[grid](u, weight, w, *common, **args)
    return w


def path_direction_bwd_fn(
    u: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None, dw: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(du [B, T, H·D]`` in ``u``'s dtype, ``dweight [H·D, W]`` float32``)`` from a contiguous ``dw [B, T, H, D]``:
    one kernel and one sum over the programs' slots of ``dweight``."""
    B, T, C = u.shape
    du = torch.empty(B, T, C, dtype=u.dtype, device=u.device)
    if du.numel() == 0:
        return du, torch.zeros(weight.shape, dtype=torch.float32, device=u.device)
    grid, common, args = _launch(u, weight, cu_seqlens, heads, backward=True)
    partial = torch.empty(grid[0] * grid[1] // heads, C, weight.shape[1], dtype=torch.float32, device=u.device)
    direction_bwd_kernel[grid](u, weight, dw, du, partial, *common, **args)
    return du, partial.sum(0)


@torch.library.custom_op("attnkit::path_direction", mutates_args=(), device_types=("cuda", "cpu"))
def path_direction_op(
    u: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None, heads: int
) -> torch.Tensor:
    """``w [B, T, H, D]`` float32 through the fused forward (validated inputs; CPU tensors run through Triton's
    interpreter)."""
    return path_direction_fwd_fn(u, weight.contiguous(), cu_seqlens, heads)


@path_direction_op.register_fake
def _(u, weight, cu_seqlens, heads):
    B, T, C = u.shape
    return u.new_empty(B, T, heads, C // heads, dtype=torch.float32)


@torch.library.custom_op("attnkit::path_direction_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def path_direction_bwd_op(
    u: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor | None, dw: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(du, dweight)`` of ``attnkit::path_direction`` (:func:`path_direction_bwd_fn`)."""
    return path_direction_bwd_fn(u, weight.contiguous(), cu_seqlens, dw.float().contiguous(), heads)


@path_direction_bwd_op.register_fake
def _(u, weight, cu_seqlens, dw, heads):
    return u.new_empty(u.shape), weight.new_empty(weight.shape, dtype=torch.float32)


def _setup(ctx, inputs, output):
    u, weight, cu_seqlens, heads = inputs
    ctx.save_for_backward(u, weight, cu_seqlens)
    ctx.heads = heads


def _backward(ctx, dw):
    u, weight, cu_seqlens = ctx.saved_tensors
    du, dweight = path_direction_bwd_op(u, weight, cu_seqlens, dw, ctx.heads)
    return du, dweight.to(weight.dtype), None, None


path_direction_op.register_autograd(_backward, setup_context=_setup)


def path_direction(
    u: torch.Tensor, weight: torch.Tensor, heads: int, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """PaTH's directions ``w = normalize(silu(conv(u)))`` per head, fused (module docstring).

    Args:
        u: ``[B, T, H·D]`` any float dtype, any strides.
        weight: ``[H·D, W]`` depthwise causal convolution (a layer's ``w_conv.weight[:, 0]``), float32.
        heads: ``H``; ``D = C / H`` up to 256.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (requires ``B == 1``); the convolution
            restarts at each.

    Returns:
        ``[B, T, H, D]`` float32 unit vectors (zero where ``silu(conv)`` is).
    """
    if u.dim() != 3 or weight.dim() != 2 or weight.shape[0] != u.shape[2]:
        raise ValueError(f"u, weight: expected [B, T, C] and [C, W], got {list(u.shape)} and {list(weight.shape)}")
    if u.shape[2] % heads or u.shape[2] // heads > 256:
        raise ValueError(f"heads: expected a divisor of C = {u.shape[2]} with C / heads <= 256, got {heads}")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, u.shape[0], u.shape[1], u.device)
    return path_direction_op(u, weight, cu_seqlens, heads)
