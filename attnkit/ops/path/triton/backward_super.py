"""PaTH backward between superblocks: the gradients of the logits of query chunks and key chunks in different
superblocks, by two kernels with O(T) memory.

A superblock is ``R`` consecutive chunks. With ``q̂`` the queries carried to their superblock's start, ``k̂`` the
keys carried to their superblock's end and ``Σ_n`` superblock ``n``'s product of transitions (all three local to a
superblock: ``local.py`` and ``carry.py`` compute them, ``local.py`` takes their gradients back), a query chunk
``c`` of superblock ``s`` meets a key chunk ``m`` of superblock ``n < s`` with the logits
``S = scale · L_{c,n} k̂_mᵀ``, where ``L_{c,s−1} = q̂_c`` and ``L_{c,n−1} = L_{c,n} Σ_nᵀ`` (one dense ``K × K``
carry a superblock). It is the chunk-level scheme of ``backward.py`` with a superblock in place of a chunk and a
dense carry in place of the rank-``C`` one; every key chunk of a superblock meets the same carried query, so the
carries cost ``R`` times less per chunk pair.

- ``path_bwd_super_kv_kernel``, one program per (key chunk ``m``, key/value head), walks the later superblocks left
  to right carrying ``Π = Σ_{s−1}ᵀ ··· Σ_{n+1}ᵀ`` once for the query heads of its group: ``y = k̂_m Πᵀ`` meets
  every query chunk of superblock ``s``; ``dk̂_m += scale · Σ dSᵀ q̂ Π``, ``dV_m += Σ Pᵀ dO``, and both sides of
  the gates' gradient from the same ``dS`` (the key side stored, the query rows' side by atomic adds; why both:
  :func:`attnkit.ops.path.triton.backward.key_chunk_grads`).
- ``path_bwd_super_q_kernel``, one program per (query chunk, query head), runs ``L`` right to left, checkpointed
  every ``⌈√n⌉`` superblocks, then walks the segments left to right with the gradient ``Γ`` of ``L``
  (``Γ ← Γ Σ_n + scale · Σ_m dS_cm k̂_m``): ``dΣ_n += Γᵀ L_{c,n}`` by atomic adds (``K²`` a query chunk and
  superblock) and ``dq̂_c = Γ`` at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_seq import seq_bounds
from attnkit.ops.common.triton_utils import block_dim
from attnkit.ops.path.triton import backward
from attnkit.ops.path.triton.backward import key_chunk_grads, load_key_chunk, store_key_chunk_grads
from attnkit.ops.path.triton.prepare import chunk_offsets, first_chunk, precisions


def launch_config(key_dim: int, chunk: int) -> dict[str, int]:
    """``tile`` (rows of a query or key tile), ``num_warps`` and ``num_stages`` of the between-superblock kernels.
    They need no chunk structure, only ``q̂``, ``k̂`` per token and ``Σ`` per superblock, so their tile is free of the
    backward's chunk (it must divide the superblock): the chunk and the chunk kernels' warps, with three stages of
    software pipelining above K = 64 and none up to it, as timed on the H200 (``benchmarks/path_tune.py
    --super-only``, ``benchmarks/results/path_h200.md``): at T = 32k, K = 128 a forward+backward took 381 ms with
    one stage, 366 with two, 359 with three, twice each; at K = 64 the stages made no difference beyond the ±6%
    that one configuration varied by. A 64-row tile at K = 128 asks for more shared memory than a block has."""
    stages = 3 if key_dim > 64 else 1
    return dict(tile=chunk, num_warps=backward.backward_config(key_dim)[1], num_stages=stages)


@triton.jit
def path_bwd_super_kv_kernel(
    xh, kh, v, sig, gcum, do, lse, delta, dkh, dv, dgcum, cu_seqlens, sb_offsets, T, NSB, R, scale,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, BG: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    CARRY_PRECISION: tl.constexpr,
):  # fmt: skip
    """``xh [*, HQ, K]`` float32 (queries carried to their superblock's start), ``kh [*, H, K]`` float32 (keys carried
    to their superblock's end), ``v [*, H, V]``, ``sig [superblocks, H, BK, BK]`` float32, ``gcum [*, HQ]``,
    ``do [*, HQ, V]``, ``lse, delta [*, HQ]`` float32 -> ``dkh [*, H, K]``, ``dv [*, H, V]``, ``dgcum [*, HQ]``
    float32 (both sides of the pairs across superblocks, added to; zero-initialised). Grid ``(chunks of the longest
    sequence, N * H)``."""
    i_m, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    n_chunks = tl.cdiv(L, BT)
    n_sb = tl.cdiv(n_chunks, R)
    if i_m // R + 1 >= n_sb:
        return
    sb0 = first_chunk(sb_offsets, i_n, NSB, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k, o_v, o_g = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BG)
    m_k, m_v = (o_k < K)[None, :], (o_v < V)[None, :]
    # A later superblock exists, so key chunk m is complete.
    p_m, b_kh, b_v, b_pi, b_dkh, b_dv, b_dg = load_key_chunk(
        kh, v, bos, i_m, i_h, o_t, o_k, o_v, m_k, m_v, H, K, V, BK, BV, BT, BG
    )
    for s in range(i_m // R + 1, n_sb):
        b_y = tl.dot(b_kh, tl.trans(b_pi), input_precision=CARRY_PRECISION)  # k̂_m at superblock s's start
        b_dys = tl.zeros([BT, BK], dtype=tl.float32)
        for i_c in range(s * R, tl.minimum(s * R + R, n_chunks)):
            b_dy, b_dv, b_dg = key_chunk_grads(
                xh, do, lse, delta, gcum, dgcum, b_y, b_v, b_dv, b_dg, bos, L, i_c, p_m, i_h, scale, o_t, o_k, o_v, o_g,
                m_k, m_v, HQ, H, K, V, BK, BT, USE_G, PRECISION, True,
            )  # fmt: skip
            b_dys += b_dy
        b_dkh += tl.dot(b_dys * scale, b_pi, input_precision=CARRY_PRECISION)
        if s + 1 < n_sb:  # Π ← Σ_sᵀ Π
            b_sig = tl.load(sig + ((sb0 + s) * H + i_h) * (BK * BK) + o_k[:, None] * BK + o_k[None, :])
            b_pi = tl.dot(tl.trans(b_sig), b_pi, input_precision=CARRY_PRECISION)
    store_key_chunk_grads(dkh, dv, dgcum, b_dkh, b_dv, b_dg, p_m, i_h, o_k, o_v, o_g, m_k, m_v, HQ, H, K, V)


@triton.jit
def path_bwd_super_q_kernel(
    xh, kh, v, sig, gcum, do, lse, delta, dxh, dsig, scratch, cu_seqlens, sb_offsets, T, NSB, R,
    c_base, EVERY, SLOTS, scale,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    CARRY_PRECISION: tl.constexpr,
):  # fmt: skip
    """Inputs as :func:`path_bwd_super_kv_kernel`, but ``kh`` in the inputs' dtype (the forward's rounding of the
    carried keys: the logits and ``dS k̂`` take 16-bit operands, as the forward's and FlashAttention's do) ->
    ``dxh [*, HQ, K]`` (stored) and ``dsig
    [superblocks, H, BK, BK]`` (atomic adds, zero-initialised), float32. Grid ``(chunks of this wave, N * HQ)``:
    program ``(j, ·)`` takes query chunk ``c_base + j`` and ``SLOTS`` scratch tiles of ``[BT, BK]`` float32 (the
    carried query at the right end of every segment of ``EVERY`` superblocks, then one segment's worth)."""
    i_j, i_nh = tl.program_id(0), tl.program_id(1)
    i_c = c_base + i_j
    i_n, i_hq = i_nh // HQ, i_nh % HQ
    i_h = i_hq // (HQ // H)
    bos, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    n_back = i_c // R  # the superblocks before the query's
    if n_back == 0 or i_c * BT >= L:
        return
    sb0 = first_chunk(sb_offsets, i_n, NSB, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = (o_k < K)[None, :], (o_v < V)[None, :]
    p_slot = scratch + ((i_j * tl.num_programs(1) + i_nh).to(tl.int64) * SLOTS) * (BT * BK)
    p_slot += o_t[:, None] * BK + o_k[None, :]
    p_seg = p_slot + (SLOTS - EVERY) * (BT * BK)  # the segment's tiles follow the checkpoints
    p_sig = sig + (sb0 * H + i_h) * (BK * BK) + o_k[:, None] * BK + o_k[None, :]  # + n * H * BK * BK: superblock n

    o_i = i_c * BT + o_t
    m_i = o_i < L
    p_i = bos + o_i.to(tl.int64)
    # Right to left: L_{c,s-1} = q̂_c, L_{c,n-1} = L_{c,n} Σ_nᵀ; checkpoint L_{c,n} at each segment's right end.
    b_l = tl.load(xh + p_i[:, None] * (HQ * K) + i_hq * K + o_k[None, :], mask=m_i[:, None] & m_k, other=0.0)
    for i_back in range(0, n_back):
        n = n_back - 1 - i_back
        if (n == n_back - 1) or (n % EVERY == EVERY - 1):
            tl.store(p_slot + (n // EVERY) * (BT * BK), b_l)
        if n > 0:
            b_sig = tl.load(p_sig + n * (H * BK * BK))
            b_l = tl.dot(b_l, tl.trans(b_sig), input_precision=CARRY_PRECISION)
    tl.debug_barrier()

    b_do = tl.load(do + p_i[:, None] * (HQ * V) + i_hq * V + o_v[None, :], mask=m_i[:, None] & m_v, other=0.0)
    b_lse = tl.load(lse + p_i * HQ + i_hq, mask=m_i, other=0.0)
    b_delta = tl.load(delta + p_i * HQ + i_hq, mask=m_i, other=0.0)
    b_gq = tl.zeros([BT], dtype=tl.float32)
    if USE_G:
        b_gq = tl.load(gcum + p_i * HQ + i_hq, mask=m_i, other=0.0)
    b_gam = tl.zeros([BT, BK], dtype=tl.float32)
    # Left to right, a segment at a time: Γ is the gradient of L_{c,n-1}; crossing superblock n adds Γᵀ L_{c,n}
    # to dΣ_n.
    for i_s in range(0, tl.cdiv(n_back, EVERY)):
        lo = i_s * EVERY
        top = tl.minimum(lo + EVERY - 1, n_back - 1)
        b_l = tl.load(p_slot + i_s * (BT * BK))
        tl.store(p_seg + (top - lo) * (BT * BK), b_l)
        for i_back in range(0, top - lo):
            n = top - i_back
            b_sig = tl.load(p_sig + n * (H * BK * BK))
            b_l = tl.dot(b_l, tl.trans(b_sig), input_precision=CARRY_PRECISION)
            tl.store(p_seg + (n - 1 - lo) * (BT * BK), b_l)
        tl.debug_barrier()
        for n in range(lo, top + 1):
            b_l = tl.load(p_seg + (n - lo) * (BT * BK))
            if n > 0:
                b_dsig = tl.dot(tl.trans(b_gam), b_l, input_precision=CARRY_PRECISION)
                tl.atomic_add(dsig + ((sb0 + n) * H + i_h) * (BK * BK) + o_k[:, None] * BK + o_k[None, :], b_dsig)
                b_gam = tl.dot(b_gam, tl.load(p_sig + n * (H * BK * BK)), input_precision=CARRY_PRECISION)
            for i_m in range(n * R, n * R + R):  # superblock n's key chunks, all complete
                p_m = bos + (i_m * BT + o_t).to(tl.int64)
                b_kh = tl.load(kh + p_m[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_k, other=0.0)
                b_v = tl.load(v + p_m[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_v, other=0.0)
                if USE_G:  # read with the key chunk, not at its first use
                    b_gk = tl.load(gcum + p_m * HQ + i_hq)
                b_s = tl.dot(b_l.to(b_kh.dtype), tl.trans(b_kh), input_precision=PRECISION) * scale
                if USE_G:
                    b_s = b_s + b_gq[:, None] - b_gk[None, :]
                b_p = tl.where(m_i[:, None], tl.exp(b_s - b_lse[:, None]), 0.0)
                b_ds = b_p * (tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION) - b_delta[:, None])
                b_gam += tl.dot(b_ds.to(b_kh.dtype), b_kh, input_precision=PRECISION) * scale
    tl.store(dxh + p_i[:, None] * (HQ * K) + i_hq * K + o_k[None, :], b_gam, mask=m_i[:, None] & m_k)


def path_bwd_super_fn(
    xh: torch.Tensor,
    kh: torch.Tensor,
    kh_low: torch.Tensor,
    v: torch.Tensor,
    sig: torch.Tensor,
    gcum: torch.Tensor | None,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None,
    chunk: int,
    span: int,
    longest: int,
    sb_offsets: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    dgcum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The gradients of the logits between superblocks of ``span`` chunks of ``chunk`` positions. ``xh [B,T,HQ,K]``
    and ``kh [B,T,H,K]`` float32, ``kh_low`` the same keys in ``v.dtype`` (the query kernel's operand),
    ``v [B,T,H,V]``, ``sig [superblocks,H,BK,BK]`` float32 (rows per packed sequence as
    :func:`attnkit.ops.path.triton.carry.carry_keys_fn` lays them out), ``gcum`` (or None), ``lse``, ``delta
    [B,T,HQ]`` float32, ``do [B,T,HQ,V]``, all contiguous. Returns float32 ``(dxh [B,T,HQ,K], dkh [B,T,H,K],
    dv [B,T,H,V], dsig [superblocks,H,BK,BK], dg [B,T,HQ])`` (``dg`` the gradient of ``gcum``, both sides). ``longest``:
    the longest sequence's length (no host sync); ``sb_offsets``: ``chunk_offsets(cu_seqlens, chunk * span)`` where
    the caller has it; ``dv``, ``dgcum``: float32 buffers to add into (returned), else new zeros."""
    B, T, HQ, K = xh.shape
    H, V = kh.shape[2], v.shape[-1]
    config = launch_config(K, chunk)
    length = chunk * span  # a superblock's positions
    BT, BK, BV = config["tile"], block_dim(K), block_dim(V)
    if length % BT:
        raise ValueError(f"launch_config: a tile of {BT} rows does not divide a superblock of {length} positions")
    tiles = length // BT  # a superblock's tiles
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if sb_offsets is None:
        sb_offsets = chunk_offsets(cu_seqlens, length)
    NSB = triton.cdiv(T, length)
    f32 = dict(dtype=torch.float32, device=xh.device)
    dxh, dkh = torch.zeros(B, T, HQ, K, **f32), torch.zeros(B, T, H, K, **f32)
    dv = torch.zeros(B, T, H, V, **f32) if dv is None else dv
    dsig = torch.zeros_like(sig)
    dgcum = torch.zeros(B, T, HQ, **f32) if dgcum is None else dgcum
    n_long = triton.cdiv(longest, BT)
    n_sb = triton.cdiv(n_long, tiles)
    if n_sb < 2:
        return dxh, dkh, dv, dsig, dgcum
    precision, carry = precisions(v.dtype)
    common = dict(HQ=HQ, H=H, K=K, V=V, BK=BK, BV=BV, BT=BT, USE_G=gcum is not None, IS_VARLEN=cu_seqlens is not None,
                  PRECISION=precision, CARRY_PRECISION=carry)  # fmt: skip
    common.update(num_warps=config["num_warps"], num_stages=config["num_stages"])
    path_bwd_super_kv_kernel[((n_sb - 1) * tiles, N * H)](  # the key tiles with a later superblock
        xh, kh, v, sig, gcum, do, lse, delta, dkh, dv, dgcum, cu_seqlens, sb_offsets, T, NSB, tiles, scale,
        BG=triton.next_power_of_2(HQ // H), **common,
    )  # fmt: skip
    every = backward.checkpoint_every(n_sb)
    slots = triton.cdiv(n_sb, every) + every
    per_chunk = slots * BT * BK * N * HQ  # float32 numbers of one query chunk's programs
    wave = max(1, min(n_long - tiles, backward.SCRATCH_BYTES // (per_chunk * 4)))
    scratch = torch.empty(wave * per_chunk, **f32)
    for c_base in range(tiles, n_long, wave):
        path_bwd_super_q_kernel[(min(wave, n_long - c_base), N * HQ)](
            xh, kh_low, v, sig, gcum, do, lse, delta, dxh, dsig, scratch, cu_seqlens, sb_offsets, T, NSB, tiles,
            c_base, every, slots, scale, **common,
        )  # fmt: skip
    return dxh, dkh, dv, dsig, dgcum
