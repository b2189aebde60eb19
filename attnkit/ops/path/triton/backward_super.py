"""PaTH backward between superblocks: the gradients of the logits of query and key tiles in different superblocks, by
one key-major sweep with O(T) memory, no checkpoints and no ``K²`` atomics.

A superblock is ``R`` consecutive tiles. With ``q̂`` the queries carried to their superblock's start, ``k̂`` the keys
carried to their superblock's end and ``Σ_n`` superblock ``n``'s product of transitions (all three local to a
superblock: ``local.py`` and ``carry.py`` compute them, ``local.py`` takes their gradients back), a query of superblock
``s`` meets a key of superblock ``n < s`` with the logit ``scale · q̂ Π_{n,s} k̂ᵀ`` (``+ G_i − G_j``), where
``Π_{n,s} = Σ_{s−1}ᵀ ··· Σ_{n+1}ᵀ`` (``Π_{n,n+1} = I``). Three kernels, in waves of key superblocks (rows ``n``)
whose scratch fits ``SCRATCH_BYTES`` (``README.md`` beside the op derives the formulas):

- ``path_bwd_super_kv_kernel``, one program per (``tiles_per_program`` key tiles of superblock ``n``, key/value
  head), first walks the later superblocks ``s`` left to right carrying ``Π_{n,s}`` (``Π ← Σ_sᵀ Π``, one ``K × K``
  product a step) into its own scratch slots, then for each of its key tiles and the query heads of its group walks
  them again with ``Π`` read back: ``y = k̂ Πᵀ`` meets every query tile of ``s``;
  ``dk̂ += scale · Σ dSᵀ q̂ Π``, ``dV += Σ Pᵀ dO``, both sides of the gates' gradient, ``dq̂ += scale · dS y`` by
  float32 atomic adds (FlashAttention-2's ``dQ``) and the row ``E_{n,s} = scale · Σ_heads q̂ᵀ dS k̂`` (``K × K``,
  the gradient of ``Π_{n,s}``) into the program's own scratch slots.
  With ``SWEEP_ORDER = "superblocks"`` the program walks the later superblocks outside and its tiles inside, ``Π``
  in one slot a program, so that a wave's scratch is ``E``'s row alone.
- ``path_bwd_super_row_kernel``, one program per (row ``n``, key/value head): right to left
  ``F_{n,p} = E_{n,p+1}ᵀ + F_{n,p+1} Σ_{p+1}ᵀ``, in place of ``E``, then left to right (``Π`` recomputed, one
  product a step) ``Z_{n,p} = Π_{n,p} F_{n,p}``, in place again.
- ``path_bwd_super_sig_kernel``, one program per (superblock ``p``, key/value head): ``dΣ_p += Σ_n Z_{n,p}`` over the
  wave's rows (plain adds: the program owns ``dΣ_p``).

The logits ``q̂ yᵀ``, ``dS y`` and ``dSᵀ q̂`` take 16-bit operands for 16-bit inputs (``q̂`` is stored in the inputs'
dtype, ``y`` rounded to it: the forward rounds both the same way for its logits between superblocks), and every
carry (``Π``, ``y``, ``E``, ``F``, ``Z``) is float32 in the carries' precision
(:func:`attnkit.ops.path.triton.prepare.precisions`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_seq import seq_bounds
from attnkit.ops.common.triton_utils import block_dim, interpreting
from attnkit.ops.path.triton import backward
from attnkit.ops.path.triton.backward import key_chunk_grads, load_key_chunk, store_key_chunk_grads
from attnkit.ops.path.triton.prepare import chunk_offsets, first_chunk, pair_dot, precisions

SCRATCH_BYTES = 1 << 28  # E_{n,s} and Π_{n,s} of a wave of key superblocks (float32 K × K each a pair and group)
# The sweep's three products a (key tile, later superblock) pair for 16-bit inputs on a GPU: the key carried to the
# superblock, y = k̂ Π_{n,s}ᵀ (rounded to the inputs' dtype for the logits at once), dk̂ += dY Π_{n,s} and the row
# E_{n,s} += dYᵀ k̂. None: the carries' precision (three bf16 passes); "tf32": one pass, slower on the H200 (PaTH-FoX,
# T = 4k, D = 64: 21.47 ms against the default's 20.13; ninth session, benchmarks/path_tune.py --local-only); "16bit":
# one pass on operands rounded to the inputs' dtype (y is rounded to it for the logits anyway, and FlashAttention
# takes its dK, dQ products so), a third of the default's tensor-core passes; on an H100 15.97 ms against 15.25 (24th
# session, path_local_session24_h100.json), errors unchanged. The chain Π ← Σᵀ Π keeps the carries'.
PAIR_16BIT: str | None = None
# The sweep's loop order. "tiles": a program takes each of its key tiles in turn through every later superblock, with
# Π_{n,s} of every s in its slots (a row of them beside E's); "superblocks": every later superblock in turn through
# each of its tiles, with Π_{n,s} in one slot a program, the tiles' dk̂ and dV added a pair at a time, so that a wave's
# scratch is E's row alone. Slower on an H100 (D = 64, 24th session, path_local_session24_h100.json): 16.35 ms against
# 15.25 at 4k (peak 1464 MiB against 1548); at 32k 110.6 ms against 101.2, peak unchanged (with a 128 MiB budget
# 116.1 ms and 1452 MiB against 1578).
SWEEP_ORDER = "tiles"


def launch_config(key_dim: int, chunk: int, dtype: torch.dtype = torch.bfloat16, value_dim: int = 0) -> dict[str, int]:
    """``tile`` (rows of a query or key tile), ``tiles_per_program`` (the key tiles one program of the sweep takes in
    turn: fewer means more programs, each with its own ``E`` and ``Π`` slots, so more scratch and more waves),
    ``num_warps`` and ``num_stages`` of the between-superblock kernels. They need no chunk structure, only ``q̂``,
    ``k̂`` per token and ``Σ`` per superblock, so their tile is free of the backward's chunk (it must divide the
    superblock). Defaults: the chunk and the chunk kernels' warps, three stages of software pipelining above K = 64
    and none up to it, and ``tiles_per_program`` 0, which leaves it to :func:`program_groups` (as many programs a
    superblock as keep one wave). On the H200 at T = 4k, D = 64 (PaTH-FoX, ``path_tune.py --super-only``), two
    stages and eight warps were slower (26.2 and 28.8 ms against 25.8). Compiled for sm_90a with Triton 3.6 (bf16
    inputs, tenth session), the sweep kernel needs 64 KB of shared memory at K = 64 (64-row tiles) and 96 KB at
    K = 128 (32-row tiles), and spills 488 and 2396 bytes a thread (720 and 2560 with FoX's gates); 64-row tiles at
    K = 128 on eight warps and one stage take 144 KB and spill 1380, and on the H200 (PaTH-FoX, T = 4k, D = 128,
    eleventh session) forward+backward took 41.1 ms with them against 47.0 with 32-row tiles on three stages: they
    are the default from K = 65 to 128 (on a GPU; the interpreter keeps the chunk's tile). Float32 inputs (``dtype``;
    ``value_dim``, V) take their products in 3xTF32 (``prepare.precisions``), whose float32 operands double the
    tiles' shared memory: where they do (on a GPU up to a padded K and V of 128; exact elsewhere), at a padded K or V
    above 64 the sweep takes 32-row tiles on eight warps and one stage, 192 KB at K = V = 128 where 64-row tiles
    wanted 352 KB (over the 227 KB a Hopper block may have; sm_90a, Triton 3.6, thirtieth session)."""
    float32_operands = dtype == torch.float32 and precisions(dtype, key_dim, value_dim)[0] != "ieee"
    if float32_operands and max(block_dim(key_dim), block_dim(value_dim)) > 64:
        return dict(tile=32, tiles_per_program=0, num_warps=8, num_stages=1)
    if 64 < key_dim <= 128 and not interpreting():
        return dict(tile=64, tiles_per_program=0, num_warps=8, num_stages=1)
    stages = 3 if key_dim > 64 else 1
    return dict(tile=chunk, tiles_per_program=0, num_warps=backward.backward_config(key_dim)[1], num_stages=stages)


@triton.jit
def row_offset(i_r, n0, NL):
    """The first entry of row ``n0 + i_r`` among a wave's rows ``n0, n0 + 1, …`` of ``NL − 1 − n`` entries each."""
    return i_r * (NL - 1 - n0) - (i_r * (i_r - 1)) // 2


@triton.jit
def sweep_pair(
    xh, do, lse, delta, gcum, dgcum, dxh, kh, p_pi, p_s, b_kh, b_v, b_dkh, b_dv, b_dg, first, bos, L, s, R, n_tiles,
    p_m, i_h, scale, o_t, o_k, o_v, o_g, m_k, m_v,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    USE_G: tl.constexpr, PRECISION: tl.constexpr, PAIR_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (key tile, later superblock ``s``) pair of :func:`path_bwd_super_kv_kernel`: the key tile (rows ``p_m``,
    ``b_kh`` float32, ``b_v``) meets every query tile of ``s`` with ``Π_{n,s}`` read from ``p_pi`` (a ``[BK, BK]``
    block of pointers); returns its gradients ``(dk̂, dV, the gates' key side)`` added to ``b_dkh, b_dv, b_dg``, adds
    ``dq̂`` and the gates' query side atomically and its share of ``E_{n,s}`` into the slot ``p_s`` (written where
    ``first``, else added)."""
    BC: tl.constexpr = 64 if BK > 64 else BK
    # k̂ at superblock s's start, in the products' dtype: the logits and dS y take 16-bit operands, as the forward's
    # logits between superblocks do.
    b_y = pair_dot(b_kh, tl.trans(tl.load(p_pi)), PAIR_PRECISION, do.dtype.element_ty)
    b_y = b_y.to(do.dtype.element_ty)
    b_dys = tl.zeros([BT, BK], dtype=tl.float32)
    for i_c in range(s * R, tl.minimum(s * R + R, n_tiles)):
        b_dy, b_dv, b_dg = key_chunk_grads(
            xh, do, lse, delta, gcum, dgcum, dxh, b_y, b_v, b_dv, b_dg, bos, L, i_c, p_m, i_h, scale, o_t, o_k, o_v,
            o_g, m_k, m_v, HQ, H, K, V, BK, BT, USE_G, PRECISION, True, True,
        )  # fmt: skip
        b_dys += b_dy
    b_dys *= scale
    b_dkh += pair_dot(b_dys, tl.load(p_pi), PAIR_PRECISION, do.dtype.element_ty)
    for cb in tl.static_range(BK // BC):
        o_c = cb * BC + tl.arange(0, BC)
        b_kc = tl.load(kh + p_m[:, None] * (H * K) + i_h * K + o_c[None, :], mask=(o_c < K)[None, :], other=0.0)
        b_kc = b_kc.to(tl.float32)
        b_e = pair_dot(tl.trans(b_dys), b_kc, PAIR_PRECISION, do.dtype.element_ty)
        p_c = p_s + o_k[:, None] * BK + o_c[None, :]
        if not first:
            b_e += tl.load(p_c)
        tl.store(p_c, b_e)
    return b_dkh, b_dv, b_dg


@triton.jit
def zero_last_tiles(
    dkh, dv, bos, L, i_m0, i_h,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    TPP: tl.constexpr,
):  # fmt: skip
    """Zeros into rows ``i_m0 · BT …`` (``TPP`` tiles, those before ``L``) of key/value head ``i_h`` of ``dkh`` and
    ``dv``: the share of a superblock that meets no later one, where :func:`path_bwd_super_kv_kernel` stores first."""
    o_t, o_k, o_v = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BV)
    for t in range(0, TPP):
        o_r = (i_m0 + t) * BT + o_t
        p_m = bos + o_r.to(tl.int64)
        m_r = (o_r < L)[:, None]
        tl.store(dkh + p_m[:, None] * (H * K) + i_h * K + o_k[None, :], tl.zeros([BT, BK], dtype=tl.float32),
                 mask=m_r & (o_k < K)[None, :])  # fmt: skip
        tl.store(dv + p_m[:, None] * (H * V) + i_h * V + o_v[None, :], tl.zeros([BT, BV], dtype=tl.float32),
                 mask=m_r & (o_v < V)[None, :])  # fmt: skip


@triton.jit
def path_bwd_super_kv_kernel(
    xh, kh, v, sig, gcum, do, lse, delta, dxh, dkh, dv, dgcum, rows_e, rows_pi, cu_seqlens, sb_offsets, T, NSB, NL, R,
    GROUPS, n0, WR, WE, scale,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, BG: tl.constexpr, TPP: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr, CARRY_PRECISION: tl.constexpr, PAIR_PRECISION: tl.constexpr = "tf32x3",
    SUPERBLOCKS_OUTER: tl.constexpr = False, FRESH: tl.constexpr = False,
):  # fmt: skip
    """``xh [*, HQ, K]`` (queries carried to their superblock's start, in ``do``'s dtype or float32), ``kh [*, H, K]``
    float32 (keys carried to their superblock's end), ``v [*, H, V]``, ``sig [superblocks, H, BK, BK]`` float32,
    ``gcum [*, HQ]``, ``do [*, HQ, V]``, ``lse, delta [*, HQ]`` float32 -> ``dkh [*, H, K]``, ``dv [*, H, V]`` (added
    to), ``dxh [*, HQ, K]``, ``dgcum [*, HQ]`` (atomic adds) float32, and ``rows_e [N * H, GROUPS, WE, BK, BK]``
    float32 (each program group's share of ``E_{n,s}``, written; ``rows_pi``, of the same shape, holds the program's
    ``Π_{n,s}``). Grid ``(rows of this wave × GROUPS, N * H)``: program
    ``(r · GROUPS + u, ·)`` takes key superblock ``n0 + r``'s tiles ``u · TPP … u · TPP + TPP − 1`` (``R`` tiles a
    superblock, ``NL`` superblocks in the longest sequence, ``NSB`` rows of ``sig`` a dense sequence).
    ``SUPERBLOCKS_OUTER``: the later superblocks in the outer loop and the tiles inside (:data:`SWEEP_ORDER`),
    ``Π_{n,s}`` carried in one slot a program (``rows_pi [N * H, programs of the wave, BK, BK]``) and the tiles'
    gradients added to ``dkh``, ``dv`` a pair at a time.

    ``FRESH`` (the tiles' order): ``dkh`` and ``dv`` come uninitialised and every row of them is stored once, not
    added to: a program stores its tiles' gradients, and the programs of each sequence's last superblock, which meets
    no later one, store zeros (the rows past the wave's ``WR`` rows, launched with the first wave only, take the
    longest sequences' last superblock, ``NL − 1``, which no wave's rows reach)."""
    i_ru, i_nh = tl.program_id(0), tl.program_id(1)
    i_r, i_u = i_ru // GROUPS, i_ru % GROUPS
    n = tl.where(i_r < WR, n0 + i_r, NL - 1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    n_tiles = tl.cdiv(L, BT)
    n_sb = tl.cdiv(n_tiles, R)
    if n + 1 >= n_sb:
        if FRESH and n + 1 == n_sb:
            zero_last_tiles(dkh, dv, bos, L, n * R + i_u * TPP, i_h, H, K, V, BK, BV, BT, TPP)
        return
    sb0 = first_chunk(sb_offsets, i_n, NSB, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k, o_v, o_g = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BG)
    m_k, m_v = (o_k < K)[None, :], (o_v < V)[None, :]
    p_kk = o_k[:, None] * BK + o_k[None, :]
    p_slots = ((i_nh * GROUPS + i_u).to(tl.int64) * WE + row_offset(i_r, n0, NL)) * (BK * BK)
    p_e = rows_e + p_slots
    if SUPERBLOCKS_OUTER:
        # Π_{n,s} in one slot, stepped after every tile has read it: each E_{n,s} is the program's whole share once
        # its tiles have met s, and no row of Π is kept.
        p_pi = rows_pi + (i_nh.to(tl.int64) * tl.num_programs(0) + i_ru) * (BK * BK) + p_kk
        tl.store(p_pi, tl.where((o_k[:, None] == o_k[None, :]) & m_k, 1.0, 0.0))
        tl.debug_barrier()
        for s in range(n + 1, n_sb):
            p_s = p_e + (s - n - 1) * (BK * BK)
            for t in range(0, TPP):
                i_m = n * R + i_u * TPP + t
                p_m, b_kh, b_v, b_dkh, b_dv, b_dg = load_key_chunk(
                    kh, v, bos, i_m, i_h, o_t, o_k, o_v, m_k, m_v, H, K, V, BK, BV, BT, BG
                )
                b_dkh, b_dv, b_dg = sweep_pair(
                    xh, do, lse, delta, gcum, dgcum, dxh, kh, p_pi, p_s, b_kh, b_v, b_dkh, b_dv, b_dg, t == 0, bos, L,
                    s, R, n_tiles, p_m, i_h, scale, o_t, o_k, o_v, o_g, m_k, m_v, HQ, H, K, V, BK, BT, USE_G,
                    PRECISION, PAIR_PRECISION,
                )  # fmt: skip
                store_key_chunk_grads(
                    dkh, dv, dgcum, b_dkh, b_dv, b_dg, p_m, i_h, o_k, o_v, o_g, m_k, m_v, HQ, H, K, V, USE_G
                )
                tl.debug_barrier()  # the next tile reads the E slot this one wrote
            if s + 1 < n_sb:  # Π ← Σ_sᵀ Π
                b_sig = tl.load(sig + ((sb0 + s) * H + i_h) * (BK * BK) + p_kk)
                b_pi = tl.dot(tl.trans(b_sig), tl.load(p_pi), input_precision=CARRY_PRECISION)
                tl.debug_barrier()  # every thread has read the slot before it is overwritten
                tl.store(p_pi, b_pi)
                tl.debug_barrier()
    else:
        p_pi = rows_pi + p_slots
        # Π_{n,s} for every later superblock s, once for the program's key tiles (Π ← Σ_sᵀ Π, one K × K product a
        # step), into the program's own slots, which every tile then reads: recomputed per tile, the chain cost R K³
        # carries a step, as much as a superblock's pairs at K = 128.
        b_pi = tl.where((o_k[:, None] == o_k[None, :]) & m_k, 1.0, 0.0)
        for s in range(n + 1, n_sb):
            tl.store(p_pi + (s - n - 1) * (BK * BK) + p_kk, b_pi)
            if s + 1 < n_sb:
                b_sig = tl.load(sig + ((sb0 + s) * H + i_h) * (BK * BK) + p_kk)
                b_pi = tl.dot(tl.trans(b_sig), b_pi, input_precision=CARRY_PRECISION)
        tl.debug_barrier()  # the tiles read the slots every thread wrote
        for t in range(0, TPP):
            # A later superblock exists, so key tile i_m is complete.
            i_m = n * R + i_u * TPP + t
            p_m, b_kh, b_v, b_dkh, b_dv, b_dg = load_key_chunk(
                kh, v, bos, i_m, i_h, o_t, o_k, o_v, m_k, m_v, H, K, V, BK, BV, BT, BG
            )
            for s in range(n + 1, n_sb):
                b_dkh, b_dv, b_dg = sweep_pair(
                    xh, do, lse, delta, gcum, dgcum, dxh, kh, p_pi + (s - n - 1) * (BK * BK) + p_kk,
                    p_e + (s - n - 1) * (BK * BK), b_kh, b_v, b_dkh, b_dv, b_dg, t == 0, bos, L, s, R, n_tiles, p_m,
                    i_h, scale, o_t, o_k, o_v, o_g, m_k, m_v, HQ, H, K, V, BK, BT, USE_G, PRECISION, PAIR_PRECISION,
                )  # fmt: skip
            store_key_chunk_grads(
                dkh, dv, dgcum, b_dkh, b_dv, b_dg, p_m, i_h, o_k, o_v, o_g, m_k, m_v, HQ, H, K, V, USE_G, FRESH
            )
            tl.debug_barrier()  # the next tile reads the E slots this one wrote


@triton.jit
def split_product(a, sa, ta, b, sb, tb, BK: tl.constexpr, PRECISION: tl.constexpr):
    """``A B`` of two ``[BK, BK]`` float32 matrices in memory (``A[i, j] = a[i · sa + j · ta]``, ``B`` likewise), as a
    sum over 64-wide blocks of the inner dimension: a dot's operands are then ``[BK, 64]`` and ``[64, BK]``
    (3×TF32 on two full ``128 × 128`` operands asks for 256 KB of shared memory, over the 227 KB of an H200 block)."""
    BC: tl.constexpr = 64 if BK > 64 else BK
    o_k, o_c = tl.arange(0, BK), tl.arange(0, BC)
    b_c = tl.zeros([BK, BK], dtype=tl.float32)
    for kb in tl.static_range(BK // BC):
        b_a = tl.load(a + o_k[:, None] * sa + (kb * BC + o_c)[None, :] * ta)
        b_b = tl.load(b + (kb * BC + o_c)[:, None] * sb + o_k[None, :] * tb)
        b_c += tl.dot(b_a, b_b, input_precision=PRECISION)
    return b_c


@triton.jit
def path_bwd_super_row_kernel(
    sig, rows_e, cu_seqlens, sb_offsets, T, NSB, NL, R, GROUPS, n0, WE,
    H: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr, CARRY_PRECISION: tl.constexpr,
):  # fmt: skip
    """Row ``n0 + r`` of ``rows_e`` (as :func:`path_bwd_super_kv_kernel` wrote it): right to left
    ``F_{n,p} = E_{n,p+1}ᵀ + F_{n,p+1} Σ_{p+1}ᵀ`` (``E`` summed over the program groups), stored in group 0's slot of
    ``E_{n,p+1}``, then left to right ``Z_{n,p} = Π_{n,p} F_{n,p}`` in the same slot, for ``n < p < n_sb − 1``
    (``Π`` kept in the slot of ``E_{n,n+1}``, which no ``F`` needs). Every product reads its operands from memory
    (:func:`split_product`). Grid ``(rows of this wave, N * H)``."""
    i_r, i_nh = tl.program_id(0), tl.program_id(1)
    n = n0 + i_r
    i_n, i_h = i_nh // H, i_nh % H
    _, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    n_sb = tl.cdiv(tl.cdiv(L, BT), R)
    if n + 2 >= n_sb:
        return
    sb0 = first_chunk(sb_offsets, i_n, NSB, IS_VARLEN)
    o_k = tl.arange(0, BK)
    p_kk = o_k[:, None] * BK + o_k[None, :]
    p_row = rows_e + (i_nh.to(tl.int64) * GROUPS * WE + row_offset(i_r, n0, NL)) * (BK * BK)
    p_sig = sig + (sb0 * H + i_h) * (BK * BK)  # + p * H * BK * BK: superblock p
    for i in range(0, n_sb - 2 - n):
        p = n_sb - 2 - i
        b_f = tl.zeros([BK, BK], dtype=tl.float32)
        for u in range(0, GROUPS):  # E_{n,p+1}ᵀ, read transposed
            b_f += tl.load(p_row + (u * WE + p - n) * (BK * BK) + o_k[None, :] * BK + o_k[:, None])
        if i > 0:  # + F_{n,p+1} Σ_{p+1}ᵀ
            p_next = p_row + (p + 1 - n) * (BK * BK)
            b_f += split_product(p_next, BK, 1, p_sig + (p + 1) * (H * BK * BK), 1, BK, BK, CARRY_PRECISION)
        tl.debug_barrier()  # every thread has read the slot before it is overwritten
        tl.store(p_row + (p - n) * (BK * BK) + p_kk, b_f)
    tl.store(p_row + p_kk, tl.where(o_k[:, None] == o_k[None, :], 1.0, 0.0))  # Π_{n,n+1}
    tl.debug_barrier()
    for p in range(n + 1, n_sb - 1):
        p_f = p_row + (p - n) * (BK * BK)
        b_z = split_product(p_row, BK, 1, p_f, BK, 1, BK, CARRY_PRECISION)
        b_pi = split_product(p_sig + p * (H * BK * BK), 1, BK, p_row, BK, 1, BK, CARRY_PRECISION)  # Σ_pᵀ Π
        tl.debug_barrier()
        tl.store(p_f + p_kk, b_z)
        tl.store(p_row + p_kk, b_pi)
        tl.debug_barrier()


@triton.jit
def path_bwd_super_sig_kernel(
    dsig, rows_e, cu_seqlens, sb_offsets, T, NSB, NL, R, GROUPS, n0, n1, WE,
    H: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """``dsig [superblocks, H, BK, BK]`` float32 ``+= Σ_n Z_{n,p}`` over the wave's rows ``n0 ≤ n < n1``, ``n < p``
    (as :func:`path_bwd_super_row_kernel` left them); the first wave (``n0 = 0``) stores rather than adds, zeros
    where nothing lands (the first and last superblocks), so that ``dsig`` needs no zeros before it. Grid
    ``(superblocks of the longest sequence, N * H)``."""
    p, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    _, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    n_sb = tl.cdiv(tl.cdiv(L, BT), R)
    if p >= n_sb:
        return
    top = tl.where(p + 1 < n_sb, tl.minimum(n1, p), n0)  # the last superblock's Σ carries no query: no gradient
    if n0 > 0 and n0 >= top:
        return
    o_k = tl.arange(0, BK)
    p_kk = o_k[:, None] * BK + o_k[None, :]
    p_base = rows_e + i_nh.to(tl.int64) * GROUPS * WE * (BK * BK) + p_kk
    b_acc = tl.zeros([BK, BK], dtype=tl.float32)
    for n in range(n0, top):
        b_acc += tl.load(p_base + (row_offset(n - n0, n0, NL) + p - n) * (BK * BK))
    p_dsig = dsig + ((first_chunk(sb_offsets, i_n, NSB, IS_VARLEN) + p) * H + i_h) * (BK * BK) + p_kk
    if n0 > 0:
        b_acc += tl.load(p_dsig)
    tl.store(p_dsig, b_acc)


def program_groups(tiles: int, superblocks: int, pair_bytes: int) -> int:
    """Programs a key superblock of ``tiles`` tiles when ``launch_config`` leaves it open (``tiles_per_program`` 0): the
    most, a power of two dividing ``tiles``, whose slots for every pair of the ``superblocks`` (``pair_bytes`` a pair
    and program group) fit one wave of ``SCRATCH_BYTES``, else one. More programs fill the machine at short ``T`` (8
    rows of key superblocks at 4k): on the H200 at T = 4k, D = 64, PaTH-FoX forward+backward took 25.8 ms with one
    program a superblock, 24.6 with four (two tiles each) and 24.5 with eight (one tile each); at long ``T`` they would
    multiply the waves."""
    pairs = superblocks * (superblocks - 1) // 2
    groups = 1
    while tiles % (2 * groups) == 0 and pairs * pair_bytes * 2 * groups <= SCRATCH_BYTES:
        groups *= 2
    return groups


def waves(rows: int, entry_bytes: int, row_bytes: int = 0) -> list[tuple[int, int, int]]:
    """Consecutive rows ``[n0, n1)`` of the first ``rows`` key superblocks of ``rows + 1`` (row ``n`` of
    ``rows − n`` entries, one for each later superblock, and ``row_bytes`` more), each wave's scratch within
    ``SCRATCH_BYTES`` (at least one row a wave): ``(n0, n1, entries)``. A function of the shapes alone (no device
    read)."""
    out, n0 = [], 0
    while n0 < rows:
        n1, entries = n0 + 1, rows - n0
        while n1 < rows and (entries + rows - n1) * entry_bytes + (n1 + 1 - n0) * row_bytes <= SCRATCH_BYTES:
            entries += rows - n1
            n1 += 1
        out.append((n0, n1, entries))
        n0 = n1
    return out


def path_bwd_super_fn(
    xh: torch.Tensor,
    kh: torch.Tensor,
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
    """The gradients of the logits between superblocks of ``span`` chunks of ``chunk`` positions. ``xh [B,T,HQ,K]`` in
    ``do``'s dtype or float32, ``kh [B,T,H,K]`` float32, ``v [B,T,H,V]``, ``sig [superblocks,H,BK,BK]`` float32 (rows
    per packed sequence as :func:`attnkit.ops.path.triton.carry.carry_keys_fn` lays them out), ``gcum`` (or None),
    ``lse``, ``delta [B,T,HQ]`` float32, ``do [B,T,HQ,V]``, all contiguous. Returns float32 ``(dxh [B,T,HQ,K], dkh
    [B,T,H,K], dv [B,T,H,V], dsig [superblocks,H,BK,BK], dg [B,T,HQ])`` (``dg`` the gradient of ``gcum``, both sides).
    ``longest``: the longest sequence's length (no host sync); ``sb_offsets``: ``chunk_offsets(cu_seqlens, chunk *
    span)`` where the caller has it; ``dv``, ``dgcum``: float32 buffers to add into (returned), else new ones (``dg``
    empty without gates). Three launches a wave of key superblocks (:func:`waves`: one wave unless the pairs'
    ``K × K`` slots outgrow ``SCRATCH_BYTES``). ``dsig`` is stored first by the first wave; without a ``dv`` to add
    into, ``dkh`` and ``dv`` are too (``FRESH``, in the tiles' order), so that only the atomic adds' buffers (``dxh``,
    ``dg``) are zeroed before them."""
    B, T, HQ, K = xh.shape
    H, V = kh.shape[2], v.shape[-1]
    config = launch_config(K, chunk, v.dtype, V)
    length = chunk * span  # a superblock's positions
    BT, BK, BV = config["tile"], block_dim(K), block_dim(V)
    if length % BT:
        raise ValueError(f"launch_config: a tile of {BT} rows does not divide a superblock of {length} positions")
    tiles = length // BT  # a superblock's tiles
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    NL = triton.cdiv(longest, length)  # superblocks of the longest sequence
    outer = SWEEP_ORDER == "superblocks"
    if SWEEP_ORDER not in ("tiles", "superblocks"):
        raise ValueError(f"SWEEP_ORDER: expected 'tiles' or 'superblocks', got {SWEEP_ORDER!r}")
    # A pair's E slot and, in the tiles' order, its Π slot, every head, one program group (the superblocks' order
    # keeps one Π slot a program: half a slot a pair at worst, counted as one).
    pair_bytes = 2 * N * H * BK * BK * 4
    tpp = config["tiles_per_program"] or tiles // program_groups(tiles, NL, pair_bytes)
    if tiles % tpp:
        raise ValueError(f"launch_config: {tpp} tiles a program do not divide a superblock of {tiles} tiles")
    groups = tiles // tpp
    if sb_offsets is None:
        sb_offsets = chunk_offsets(cu_seqlens, length)
    NSB = triton.cdiv(T, length)
    f32 = dict(dtype=torch.float32, device=xh.device)
    if dgcum is None:
        dgcum = torch.empty(0, **f32) if gcum is None else torch.zeros(B, T, HQ, **f32)
    dxh = torch.zeros(B, T, HQ, K, **f32)
    if NL < 2:
        dv = torch.zeros(B, T, H, V, **f32) if dv is None else dv
        return dxh, torch.zeros(B, T, H, K, **f32), dv, torch.zeros_like(sig), dgcum
    fresh = dv is None and not outer  # every row of dkh and dv stored once
    alloc = torch.empty if fresh else torch.zeros
    dkh = alloc(B, T, H, K, **f32)
    dv = alloc(B, T, H, V, **f32) if dv is None else dv
    dsig = torch.empty_like(sig) if NL >= 3 else torch.zeros_like(sig)  # the sig kernel's first wave stores
    precision, carry = precisions(v.dtype, K, V)
    if PAIR_16BIT == "16bit" and v.dtype != torch.float32:  # 16-bit operands: under the interpreter too (fp16)
        pair = PAIR_16BIT
    else:  # float32 inputs and the interpreter: the carries' own
        pair = carry if carry == "ieee" or v.dtype == torch.float32 or PAIR_16BIT is None else PAIR_16BIT
    varlen = cu_seqlens is not None
    launch = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    slot = pair_bytes // 2 * groups  # a K × K float32 slot for every program of a row
    plan = waves(NL - 1, slot, slot) if outer else waves(NL - 1, 2 * slot)
    rows_e = torch.empty(max(e for _, _, e in plan) * slot // 4, **f32)
    rows_pi = torch.empty(max(n1 - n0 for n0, n1, _ in plan) * slot // 4, **f32) if outer else torch.empty_like(rows_e)
    shape = (cu_seqlens, sb_offsets, T, NSB, NL, tiles, groups)
    for n0, n1, entries in plan:
        extra = int(fresh and n0 == 0)  # the first wave also zeros the longest sequences' last superblock
        path_bwd_super_kv_kernel[((n1 - n0 + extra) * groups, N * H)](
            xh, kh, v, sig, gcum, do, lse, delta, dxh, dkh, dv, dgcum, rows_e, rows_pi, *shape, n0, n1 - n0, entries,
            scale, HQ=HQ, H=H,
            K=K, V=V, BK=BK, BV=BV, BT=BT, BG=triton.next_power_of_2(HQ // H), TPP=tpp, USE_G=gcum is not None,
            IS_VARLEN=varlen, PRECISION=precision, CARRY_PRECISION=carry, PAIR_PRECISION=pair,
            SUPERBLOCKS_OUTER=outer, FRESH=fresh, **launch,
        )  # fmt: skip
        if NL < 3:  # no superblock lies between two others: Σ has no gradient here
            continue
        path_bwd_super_row_kernel[(n1 - n0, N * H)](
            sig, rows_e, *shape, n0, entries, H=H, BK=BK, BT=BT, IS_VARLEN=varlen, CARRY_PRECISION=carry, **launch
        )
        path_bwd_super_sig_kernel[(NL, N * H)](
            dsig, rows_e, *shape, n0, n1, entries, H=H, BK=BK, BT=BT, IS_VARLEN=varlen, **launch
        )
    return dxh, dkh, dv, dsig, dgcum
