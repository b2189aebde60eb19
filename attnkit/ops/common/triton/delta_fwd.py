"""Generalised delta rule, forward kernels: ``S_t = S_{t-1} + (v_t − S_{t-1} k_t) a_tᵀ``, ``o_t = S_t q_t``.

Chunks of ``BT`` tokens, with the state kept as ``h = Sᵀ`` (``[K, V]``). Per chunk (derivation: the VLA
``README.md``, "The S update"): ``T = (I + strict_tril(K Aᵀ))⁻¹`` by blocked forward substitution, ``W = T K``,
``Ũ = T V``; across chunks, sequentially, ``U = Ũ − W h``, ``h ← h + Aᵀ U``; then per chunk
``O = Q h + tril(Q Aᵀ) U``. Three kernels: prepare (parallel over chunks), state (sequential over chunks, parallel
over heads and value blocks), output (parallel over chunks). The caller's ``q, k, v, a`` (and ``beta``) are
``[B, T, H, ·]``, read through their strides in their own dtypes, ``q`` times ``scale`` and, for DeltaNet, ``a = β k``
formed as they are loaded; ``o`` is written ``[B, T, H, V]``. What the kernels keep for each other (``W``, ``U``,
``T``, the chunk states) is ``[B, H, T, ·]`` float32, ``B·H`` flattened. Packed sequences (``cu_seqlens``,
``B == 1``) run in the same launches, each chunk within one sequence (the sequences' first chunks computed on the
device, :func:`chunk_layout`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.tril_inverse import tril_inverse, tril_inverse_of
from attnkit.ops.common.triton_seq import block_offsets, locate_block
from attnkit.ops.common.triton_utils import block_dim, multiprocessors


@triton.jit
def seq_tiles(row0, i_c, length, o_k, o_v, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """Offsets and masks ``(p_k, m_k, p_v, m_v)`` of the ``[BT, ·K]`` and ``[BT, ·V]`` row tiles of chunk ``i_c`` of a
    sequence whose first row is ``row0`` (64-bit) in ``[rows, ·]`` tensors; positions past ``length`` masked."""
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < length
    rows = row0 + o_t
    p_k = rows[:, None] * K + o_k[None, :]
    p_v = rows[:, None] * V + o_v[None, :]
    return p_k, m_t[:, None] & (o_k < K)[None, :], p_v, m_t[:, None] & (o_v < V)[None, :]


@triton.jit
def chunk_program(cu_seqlens, offsets, i_p, i_bh, T, N, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr):
    """Where program ``(i_p, i_bh)`` of a launch over chunks works, as ``(row0, length, i_c)``: the first row of its
    sequence in ``[BH, T]`` rows, the sequence's length and the chunk's index in it. Dense: chunk ``i_p`` of row
    ``i_bh``. Packed (``B == 1``, ``i_bh`` the head): the ``i_p``-th chunk of all sequences together (its per-chunk
    slot is ``i_p`` in both cases), found in ``offsets`` (:func:`chunk_offsets`); length 0 past the last chunk."""
    if IS_VARLEN:
        i_n, i_c = locate_block(offsets, i_p, N, LOG_N)
        i_s = tl.minimum(i_n, N - 1)
        bos = tl.load(cu_seqlens + i_s).to(tl.int64)
        length = tl.where(i_n < N, tl.load(cu_seqlens + i_s + 1).to(tl.int64) - bos, 0).to(tl.int32)
        return i_bh.to(tl.int64) * T + bos, length, i_c
    return i_bh.to(tl.int64) * T, T, i_p


@triton.jit
def seq_site(cu_seqlens, offsets, i_nh, H, T, IS_VARLEN: tl.constexpr):
    """``(i_b, i_h, bos, L, c0)`` of program ``i_nh = n·H + h`` of a launch over (sequence, key/value head): the
    batch row (int64), the head, the sequence's first token in the row (int64), its length and its first chunk
    slot."""
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        L = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        return bos * 0, i_h, bos, L, tl.load(offsets + i_n)
    return i_n.to(tl.int64), i_h, i_n.to(tl.int64) * 0, T, 0


@triton.jit
def chunk_site(cu_seqlens, offsets, i_p, i_bh, T, N, HEADS: tl.constexpr, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr):
    """``(i_b, i_head, bos, L, i_c)`` of program ``(i_p, i_bh)`` of a launch over (chunk slot, batch row × head):
    the chunk's batch row (int64), head, its sequence's first token in the row (int64), the sequence's length (0
    for slots past the last chunk) and the chunk's index in the sequence (:func:`chunk_program` with row 0:
    offsets within the row)."""
    bos, L, i_c = chunk_program(cu_seqlens, offsets, i_p, i_bh * 0, T, N, IS_VARLEN, LOG_N)
    return (i_bh // HEADS).to(tl.int64), i_bh % HEADS, bos, L, i_c


@triton.jit
def row_offsets(i_b, i_h, bos, i_c, L, sb, st, sh, sd, o_d, D: tl.constexpr, BT: tl.constexpr):
    """``(offsets, mask, o_t, m_t)`` of chunk ``i_c``'s ``[BT, ·]`` rows of head ``i_h`` of a ``[B, T, heads, D]``
    tensor of strides ``(sb, st, sh, sd)`` (64-bit; masked past the sequence and past ``D``), the positions and
    their mask."""
    o_t = i_c * BT + tl.arange(0, BT)
    m_t = o_t < L
    p = i_b * sb + i_h.to(tl.int64) * sh + (bos + o_t.to(tl.int64))[:, None] * st + o_d[None, :] * sd
    return p, m_t[:, None] & (o_d < D)[None, :], o_t, m_t


@triton.jit
def row_tile(x, i_b, i_h, bos, i_c, L, sb, st, sh, sd, o_d, D: tl.constexpr, BT: tl.constexpr):
    """``(tile [BT, ·], o_t, m_t)``: chunk ``i_c``'s rows of head ``i_h`` of a ``[B, T, heads, D]`` tensor read
    through its strides in its dtype (zeros past the sequence and past ``D``), the positions and their mask."""
    p, m, o_t, m_t = row_offsets(i_b, i_h, bos, i_c, L, sb, st, sh, sd, o_d, D, BT)
    return tl.load(x + p, mask=m, other=0.0), o_t, m_t


@triton.jit
def dense_rows(i_b, i_h, bos, i_c, L, T, H: tl.constexpr, o_d, D: tl.constexpr, BT: tl.constexpr):
    """:func:`row_offsets` ``(offsets, mask)`` in a contiguous ``[B, T, H, D]`` tensor (the outputs)."""
    p, m, _, _ = row_offsets(i_b * T, i_h, bos, i_c, L, H * D, H * D, D, 1, o_d, D, BT)  # i_b·T: 64-bit first
    return p, m


@triton.jit
def dense_tokens(i_b, i_h, bos, o_t, T, H: tl.constexpr):
    """Offsets of positions ``o_t`` of head ``i_h`` in a contiguous ``[B, T, H]`` tensor (64-bit)."""
    return (i_b * T + bos + o_t.to(tl.int64)) * H + i_h


@triton.jit
def token_values(x, i_b, i_h, bos, o_t, m_t, sb, st, sh):
    """Positions ``o_t`` (any shape, within the sequence at ``bos``) of head ``i_h`` of a ``[B, T, heads]`` tensor of
    strides ``(sb, st, sh)``, as float32 (64-bit offsets; zeros where ``m_t`` is False)."""
    p = x + i_b * sb + i_h.to(tl.int64) * sh + (bos + o_t.to(tl.int64)) * st
    return tl.load(p, mask=m_t, other=0.0).to(tl.float32)


@triton.jit
def operand(x, LOW: tl.constexpr):
    """``x`` as a ``tl.dot`` operand of the state passes: rounded to ``LOW`` (``"bf16"``, ``"fp16"``) where
    :data:`STATE_16BIT` applies, else as it is."""
    if LOW == "bf16":
        return x.to(tl.bfloat16)
    elif LOW == "fp16":
        return x.to(tl.float16)
    else:
        return x


@triton.jit
def write_rows(
    a, beta, i_b, i_h, bos, i_c, L, sab, sat, sah, sad, sbeb, sbet, sbeh, o_k, K: tl.constexpr, BT: tl.constexpr
):
    """The chunk's write directions ``a_t`` as a float32 ``[BT, ·K]`` tile: ``a``'s rows, times ``beta_t`` when
    ``beta [B, T, H]`` is given (DeltaNet: ``a`` is then ``k``, and ``β k`` exists only here)."""
    b_a, o_t, m_t = row_tile(a, i_b, i_h, bos, i_c, L, sab, sat, sah, sad, o_k, K, BT)
    b_a = b_a.to(tl.float32)
    if beta is not None:
        b_a *= token_values(beta, i_b, i_h, bos, o_t, m_t, sbeb, sbet, sbeh)[:, None]
    return b_a


def chunk_layout(
    cu_seqlens: torch.Tensor | None,
    batch: int,
    seq_len: int,
    chunk_size: int,
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, int, dict]:
    """What a launch over chunks needs, with no host sync: ``(offsets, NC, varlen)`` where ``offsets`` are the
    sequences' first chunks (:func:`~attnkit.ops.common.triton_seq.block_offsets`, unless given: the forward's; None
    for a dense batch),
    ``NC`` the chunk slots per row (``⌈T / C⌉``, plus one per sequence when packed: a bound, the rest stay unused)
    and ``varlen`` the kernels' ``cu_seqlens``, ``offsets``, ``N``, ``IS_VARLEN`` and ``LOG_N`` arguments."""
    NC = triton.cdiv(seq_len, chunk_size)
    if cu_seqlens is None:
        return None, NC, dict(cu_seqlens=None, offsets=None, N=batch, IS_VARLEN=False, LOG_N=1)
    N = cu_seqlens.numel() - 1
    if offsets is None:
        offsets = block_offsets(cu_seqlens, chunk_size)
    return offsets, NC + N, dict(cu_seqlens=cu_seqlens, offsets=offsets, N=N, IS_VARLEN=True, LOG_N=N.bit_length())


STRIDES = {"q": "sq", "k": "sk", "v": "sv", "a": "sa", "beta": "sbe", "do": "sdo"}


def strides(**tensors: torch.Tensor | None) -> dict[str, int]:
    """The kernels' stride arguments of the caller's ``[B, T, H, ·]`` tensors: ``sqb, sqt, sqh, sqd`` for ``q=``, and
    so on (:data:`STRIDES`; ``beta [B, T, H]`` has three); zeros for None."""
    out = {}
    for name, x in tensors.items():
        dims = "bth" if name == "beta" else "bthd"
        out |= {STRIDES[name] + d: (0 if x is None else x.stride(i)) for i, d in enumerate(dims)}
    return out


@triton.jit
def delta_prepare_kernel(
    k, a, beta, v, w_out, u_out, t_out, cu_seqlens, offsets, T, N,
    skb, skt, skh, skd, sab, sat, sah, sad, sbeb, sbet, sbeh, svb, svt, svh, svd,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    SB: tl.constexpr, PRECISION: tl.constexpr, SOLVE_PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr,
    LOG_N: tl.constexpr, LOW_Z: tl.constexpr = False,
):  # fmt: skip
    """``k, a [B, T, H, K]``, ``v [B, T, H, V]`` (strided; ``a = β k`` when ``beta`` is given, :func:`write_rows`)
    -> the chunk's ``T = (I + Z)⁻¹``, ``Z = strict_tril(K Aᵀ)``, row by row (``t_out [BH, T, BT]``, also for the
    backward), ``W = T K`` (``w_out [BH, T, K]``) and ``Ũ = T V`` (``u_out [BH, T, V]``), float32. Grid
    ``(chunk slots, BH)`` (:func:`chunk_program`).

    ``T`` by blocks of ``SB`` rows, in registers (:func:`tril_inverse.tril_inverse`). It replaced the row-by-row
    kernel (``delta_prepare_rows.py``, deleted), which it beat at every size timed on the H200, DeltaNet
    forward+backward on 32768-token batches in bf16: 2.454 / 3.224 / 6.747 ms against 3.317 / 4.132 / 7.662 at
    D = 64, T = 2k / 8k / 32k, and 5.230 / 6.218 against 8.348 / 8.303 at D = 128, T = 2k / 8k
    (``benchmarks/results/ops_blocked_prepare_h200.json``, ``ops_rows_prepare_h200.json``). Compiled for sm_90a
    (Triton 3.6, K = 64, 4 warps): 186–198 registers and no spills (the row-by-row kernel: 255 and 24–32 bytes);
    K = 128, 8 warps: 0–204 bytes (880–1904). With the strided ``[B, T, H, ·]`` loads (bf16 ``k``, ``a``): 255
    registers and no spills at K = 64, 200 bytes at K = 128. The solve's products are float32-accurate
    (``SOLVE_PRECISION``) whatever ``PRECISION``: ``T`` enters every later product, and with ``beta`` near 2 its
    entries are large. ``LOW_Z`` (:data:`PREPARE_16BIT_Z`; ``k`` and ``a`` of one 16-bit dtype): ``K Aᵀ`` multiplies
    the 16-bit rows as they are (their products exact, float32 sums), then scales its columns by ``β``, instead of
    3xTF32 products of float32 ``K`` and ``β K``."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, i_bh, T, N, H, IS_VARLEN, LOG_N)
    row0 = (i_b * H + i_h) * T + bos
    NB: tl.constexpr = BT // SB
    o_k, o_v, o_t = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BT)
    o_r3 = i_c * BT + tl.arange(0, NB)[:, None, None] * SB + tl.arange(0, SB)[None, :, None]  # [NB, SB, 1]
    tok3 = bos + o_r3.to(tl.int64)
    m_3 = (o_r3 < L) & (o_k < K)[None, None, :]
    p_k3 = i_b * skb + i_h.to(tl.int64) * skh + tok3 * skt + o_k[None, None, :] * skd
    p_a3 = i_b * sab + i_h.to(tl.int64) * sah + tok3 * sat + o_k[None, None, :] * sad
    if LOW_Z:
        b_k3 = tl.load(k + p_k3, mask=m_3, other=0.0)
        b_a3 = tl.load(a + p_a3, mask=m_3, other=0.0)  # DeltaNet: k itself
        b_z = tl.dot(tl.reshape(b_k3, (BT, BK)), tl.trans(tl.reshape(b_a3, (BT, BK))))
        b_zd = tl.dot(b_k3, tl.trans(b_a3, (0, 2, 1)))
        if beta is not None:  # Z_ij = β_j k_i · k_j
            o_c = i_c * BT + o_t
            b_z *= token_values(beta, i_b, i_h, bos, o_c, o_c < L, sbeb, sbet, sbeh)[None, :]
            o_c3 = i_c * BT + tl.arange(0, NB)[:, None, None] * SB + tl.arange(0, SB)[None, None, :]  # [NB, 1, SB]
            b_zd *= token_values(beta, i_b, i_h, bos, o_c3, o_c3 < L, sbeb, sbet, sbeh)
        b_t = tril_inverse_of(b_z, b_zd, BT, SB, SOLVE_PRECISION)
    else:
        b_k3 = tl.load(k + p_k3, mask=m_3, other=0.0).to(tl.float32)
        b_a3 = tl.load(a + p_a3, mask=m_3, other=0.0).to(tl.float32)
        if beta is not None:
            b_a3 *= token_values(beta, i_b, i_h, bos, o_r3, o_r3 < L, sbeb, sbet, sbeh)
        b_t = tril_inverse(b_k3, b_a3, BT, SB, BK, SOLVE_PRECISION)
    p_t, m_t, _, _ = seq_tiles(row0, i_c, L, o_t, o_t, BT, BT, BT)
    tl.store(t_out + p_t, b_t, mask=m_t)
    # read again, not held through the solve
    b_k = row_tile(k, i_b, i_h, bos, i_c, L, skb, skt, skh, skd, o_k, K, BT)[0].to(tl.float32)
    b_v = row_tile(v, i_b, i_h, bos, i_c, L, svb, svt, svh, svd, o_v, V, BT)[0].to(tl.float32)
    p_k, m_k, p_v, m_v = seq_tiles(row0, i_c, L, o_k, o_v, K, V, BT)
    tl.store(w_out + p_k, tl.dot(b_t, b_k, input_precision=PRECISION), mask=m_k)
    tl.store(u_out + p_v, tl.dot(b_t, b_v, input_precision=PRECISION), mask=m_v)


@triton.jit
def fwd_state_step(b_w, b_a, b_u0, b_h, PRECISION: tl.constexpr, LOW: tl.constexpr):
    """One chunk of the forward's state pass: ``U = Ũ − W h`` and the state carried to the next chunk's start,
    ``h + Aᵀ U``. Returns ``(U, h)``."""
    b_u = b_u0 - tl.dot(operand(b_w, LOW), operand(b_h, LOW), input_precision=PRECISION)
    return b_u, b_h + tl.dot(operand(tl.trans(b_a), LOW), operand(b_u, LOW), input_precision=PRECISION)


@triton.jit
def free_rows(
    w, u, a, beta, i_b, i_h, bos, i_c, L, row0, sab, sat, sah, sad, sbeb, sbet, sbeh, o_k, o_v,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """The tiles of chunk ``i_c`` that the forward's state step reads and that do not depend on the state:
    ``(W, A, Ũ)``, ``A`` float32 (:func:`write_rows`)."""
    p_k, m_k, p_v, m_v = seq_tiles(row0, i_c, L, o_k, o_v, K, V, BT)
    b_w = tl.load(w + p_k, mask=m_k, other=0.0)
    b_a = write_rows(a, beta, i_b, i_h, bos, i_c, L, sab, sat, sah, sad, sbeb, sbet, sbeh, o_k, K, BT)
    return b_w, b_a, tl.load(u + p_v, mask=m_v, other=0.0)


@triton.jit
def delta_fwd_state_kernel(
    w, u, a, beta, h0, hs, u_new, ht, cu_seqlens, offsets, T, NC, H, sab, sat, sah, sad, sbeb, sbet, sbeh,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    USE_H0: tl.constexpr, PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr, LOW: tl.constexpr = "",
    PREFETCH: tl.constexpr = False,
):  # fmt: skip
    """The sequential part. ``w [BH, T, K]``, ``u [BH, T, V]`` float32 from the prepare kernel, ``a`` (and
    ``beta``) as the prepare kernel's, ``h0 [NH, V, K]`` (``S_0`` of each sequence and head) -> ``hs [BH, NC, K, V]``
    (the state at each chunk's start, float32), ``u_new [BH, T, V]`` (``U = Ũ − W h``, float32), ``ht [NH, V, K]``
    float32 (the final ``S``). Grid ``(value blocks, NH)`` (:func:`seq_site`). ``PREFETCH``
    (:data:`STATE_PREFETCH`): each chunk's ``W``, ``A`` and ``Ũ`` are read during the chunk before it."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, bos, L, c0 = seq_site(cu_seqlens, offsets, i_nh, H, T, IS_VARLEN)
    i_bh = i_b * H + i_h
    row0 = i_bh * T + bos
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    p_state = i_nh.to(tl.int64) * V * K + o_v[None, :] * K + o_k[:, None]  # [K, V] view of an [V, K] state
    if USE_H0:
        b_h = tl.load(h0 + p_state, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if PREFETCH:  # the tiles that do not depend on the state, read one chunk ahead of their use
        b_w, b_a, b_u0 = free_rows(
            w, u, a, beta, i_b, i_h, bos, 0, L, row0, sab, sat, sah, sad, sbeb, sbet, sbeh, o_k, o_v, K, V, BT
        )
    for i_c in range(0, tl.cdiv(L, BT)):
        p_hs = (i_bh * NC + c0 + i_c) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(hs + p_hs, b_h, mask=m_kv)
        # The tiles read now: this chunk's, or with PREFETCH chunk i_c + 1's (past the last chunk every row is masked:
        # zeros, unused).
        n_w, n_a, n_u0 = free_rows(
            w, u, a, beta, i_b, i_h, bos, i_c + 1 if PREFETCH else i_c, L, row0, sab, sat, sah, sad, sbeb, sbet, sbeh,
            o_k, o_v, K, V, BT,
        )  # fmt: skip
        if not PREFETCH:
            b_w, b_a, b_u0 = n_w, n_a, n_u0
        _, _, p_v, m_v = seq_tiles(row0, i_c, L, o_k, o_v, K, V, BT)
        b_u, b_h = fwd_state_step(b_w, b_a, b_u0, b_h, PRECISION, LOW)
        tl.store(u_new + p_v, b_u, mask=m_v)
        if PREFETCH:
            b_w, b_a, b_u0 = n_w, n_a, n_u0
    tl.store(ht + p_state, b_h, mask=m_kv)


@triton.jit
def query_chunk(
    q, a, beta, cu_seqlens, offsets, T, N, scale, sqb, sqt, sqh, sqd, sab, sat, sah, sad, sbeb, sbet, sbeh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """What a program of a launch over ``(chunk slots, BH, value blocks)`` reads first: its :func:`chunk_site`
    ``(i_b, i_h, bos, L, i_c)``, then ``(i_bh, o_k, o_v, p_v, m_v, Q, A)``: its chunk's row (batch row × head), key
    and value offsets, its ``[BT, BV]`` tile's offsets and mask in ``[BH, T, V]`` rows, the queries times ``scale``
    and the write directions (float32)."""
    i_p, i_v = tl.program_id(0), tl.program_id(2)
    i_b, i_h, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, tl.program_id(1), T, N, H, IS_VARLEN, LOG_N)
    i_bh = i_b * H + i_h
    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    _, _, p_v, m_v = seq_tiles(i_bh * T + bos, i_c, L, o_k, o_v, K, V, BT)
    b_q = row_tile(q, i_b, i_h, bos, i_c, L, sqb, sqt, sqh, sqd, o_k, K, BT)[0].to(tl.float32) * scale
    b_a = write_rows(a, beta, i_b, i_h, bos, i_c, L, sab, sat, sah, sad, sbeb, sbet, sbeh, o_k, K, BT)
    return i_b, i_h, bos, L, i_c, i_bh, o_k, o_v, p_v, m_v, b_q, b_a


@triton.jit
def delta_fwd_output_kernel(
    q, a, beta, hs, u_new, o, cu_seqlens, offsets, T, NC, N, scale,
    sqb, sqt, sqh, sqd, sab, sat, sah, sad, sbeb, sbet, sbeh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """``O = Q h + tril(Q Aᵀ) U`` per chunk, ``Q`` the queries times ``scale``: ``q [B, T, H, K]`` (strided), ``a``
    (and ``beta``) as the prepare kernel's, ``hs``, ``u_new`` from the state kernel -> ``o [B, T, H, V]``
    (contiguous, its dtype). Grid ``(chunk slots, BH, value blocks)``."""
    i_p = tl.program_id(0)
    i_b, i_h, bos, L, i_c, i_bh, o_k, o_v, p_v, m_v, b_q, b_a = query_chunk(
        q, a, beta, cu_seqlens, offsets, T, N, scale, sqb, sqt, sqh, sqd, sab, sat, sah, sad, sbeb, sbet, sbeh,
        H, K, V, BK, BV, BT, IS_VARLEN, LOG_N,
    )  # fmt: skip
    b_u = tl.load(u_new + p_v, mask=m_v, other=0.0)
    p_hs = (i_bh * NC + i_p) * K * V + o_k[:, None] * V + o_v[None, :]
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :] & (o_k * 0 + L > 0)[:, None]  # no state past the last chunk
    b_h = tl.load(hs + p_hs, mask=m_kv, other=0.0)
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    b_qa = tl.where(rows >= cols, tl.dot(b_q, tl.trans(b_a), input_precision=PRECISION), 0.0)
    b_o = tl.dot(b_q, b_h, input_precision=PRECISION) + tl.dot(b_qa, b_u, input_precision=PRECISION)
    p_o, m_o = dense_rows(i_b, i_h, bos, i_c, L, T, H, o_v, V, BT)
    tl.store(o + p_o, b_o.to(o.dtype.element_ty), mask=m_o)


def launch_config(key_dim: int, wide: bool = False) -> dict[str, int]:
    """Warps and pipeline stages of the delta-rule kernels. Compiled for sm_90a (Triton 3.6): four warps at
    ``K <= 64`` and eight above (half the register spills), no software pipelining (the loops are the sequential
    state passes, whose loads do not pay for extra shared-memory stages); every kernel then fits the 227 KB of
    shared memory up to ``K = V = 128``. ``wide``: eight warps from ``K = 64`` for the backward's WY kernel,
    whose 64-step substitution and ten ``[64, 64]`` products ran at 7 ms of a 25 ms VLA step on an H200 with four
    (one 131 KB block per SM; eight warps also clear its register spills)."""
    eight = key_dim >= 64 if wide else key_dim > 64
    return dict(num_warps=8 if eight else 4, num_stages=1)


# The sequential state passes (delta_fwd_state_kernel, and delta_bwd_state_kernel in the backward): their
# value-block width and pipeline stages. Each program walks every chunk of its sequence, so at long T and a narrow
# batch a handful of programs carry the whole pass (at T = 32k, B = 1, H = 16: 16 programs on the H200's 132 SMs, 512
# chunks each), and on the H200 our DeltaNet fell from FLA's time at 2k to 2.1x it at 32k with the same tokens. Timed on
# the H200 (`bash benchmarks/run_gpu.sh deltastate`, seventeenth session, D = 64, bf16, forward+backward kernel time):
# at T = 32k, B = 1, 16-column blocks took 5.30 ms against 6.84 with the default 64 (32 columns 5.92, two stages 6.40,
# 32 columns on two stages 5.53); at T = 2k, B = 16 (256 programs) the default 64 took 2.59 ms against 3.01 with 16
# columns and 2.82 with 32 on two stages. So the passes narrow to 16 columns where the default launch would fill at most
# a quarter of the SMs (NARROW_STATE_FILL), at K <= 64 only: at K = 128 (eight warps) 16-column blocks hit an illegal
# memory access on the H200 (Triton 3.6). Between 33 and 255 programs (e.g. the model at T = 4k, B = 4, H = 16: 64) it
# is untimed and keeps the default. STATE_BV (None: that rule) forces a width, STATE_STAGES the stages.
STATE_BV: int | None = None
STATE_STAGES = 1
NARROW_STATE_FILL = 0.25
# The state passes' products on 16-bit operands for 16-bit inputs (the state, W and U rounded to the inputs' dtype for
# each tl.dot, the state and the products kept in float32), as FLA's chunk_delta_rule multiplies: half the tensor-core
# steps of one TF32 pass. Timed on the H200 (eighteenth session, DeltaNet D = 64, bf16, forward+backward kernels): at
# T = 2k, B = 16 (64 columns) 2.366 ms against 2.448 (the backward's state pass 227 us against 311, the forward's 201
# against 190); at T = 32k, B = 1 on 16-column blocks an illegal memory access (Triton 3.6), as 16 columns at K = 128
# hit in the seventeenth session, so it applies only to blocks of 32 columns or more. Off: its drift at long T is not
# yet measured (benchmarks/results/mixers_h200.md).
STATE_16BIT = False
# The state passes read each chunk's tiles that do not depend on the state (the forward's W, A, Ũ; the backward's Q,
# A, W, dO) during the chunk before, held in registers across the loop's step, so that their global loads overlap the
# previous chunk's products instead of stalling each step of the chain (the pipeline stages, STATE_STAGES, did so only
# partly on the H200: at 32k, B = 1, two stages took the 64-column passes from 4.75 to 4.31 ms). FLA's state kernels
# take a chunk step in about a quarter of ours at 32k, B = 1 (benchmarks/results/mixers_h200.md, eighteenth
# session). Timed on the H200 (twentieth session, DeltaNet D = 64, bf16, forward+backward kernels; delta_state_session20
# in mixers_h200.md): the forward pass went from 1286 to 832 us at T = 32k, B = 1 and from 204 to 163 at T = 2k,
# B = 16; the backward pass from 1969 to 1901 at 32k but from 304 to 349 at 2k. "forward" (the default): the forward
# pass only; True: both; False: neither.
STATE_PREFETCH: bool | str = "forward"


def low_name(dtype: torch.dtype) -> str:
    """:func:`operand`'s ``LOW`` for inputs of ``dtype``: ``"bf16"``, ``"fp16"``, else ``""`` (no rounding)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "")


def few_state_programs(bv_state: int, dims: dict, programs: int, device: torch.device) -> bool:
    """Whether the state passes at the default width ``bv_state`` would launch at most :data:`NARROW_STATE_FILL` of
    the device's multiprocessors (``programs`` ``(sequence, head)`` pairs, a program per value block each): there a
    pass's time is its chain of chunk steps, not its work."""
    return programs * triton.cdiv(dims["V"], bv_state) <= NARROW_STATE_FILL * multiprocessors(device)


def state_launch(
    bv_state: int, dims: dict, programs: int, device: torch.device, dtype: torch.dtype, backward: bool = False
) -> tuple[int, dict]:
    """The state passes' value-block width and launch constexprs from the other kernels' ``BV_STATE``, ``dims`` and
    the number of ``(sequence, head)`` programs: :data:`STATE_BV` if set, else 16 columns at ``K <= 64`` where the
    default width would launch at most :data:`NARROW_STATE_FILL` of the device's multiprocessors, else ``BV_STATE``;
    :data:`STATE_STAGES` stages; 16-bit operands (``LOW``) for inputs of 16-bit ``dtype`` where
    :data:`STATE_16BIT`, on blocks of 32 columns or more; :data:`STATE_PREFETCH` for the forward pass, or for the
    ``backward`` one."""
    wide_keys = dims["K"] > 64
    if STATE_BV is not None:
        bv = min(block_dim(STATE_BV), bv_state)
        if wide_keys and bv < 32:
            raise ValueError(f"delta_fwd.STATE_BV must be at least 32 at K > 64, got {STATE_BV}")
    else:
        few = few_state_programs(bv_state, dims, programs, device)
        bv = min(16, bv_state) if few and not wide_keys else bv_state
    low = low_name(dtype) if STATE_16BIT and bv >= 32 else ""
    prefetch = STATE_PREFETCH is True or (STATE_PREFETCH == "forward" and not backward)
    return bv, dims | dict(num_stages=STATE_STAGES, LOW=low, PREFETCH=prefetch)


# The prepare kernel's K Aᵀ on the 16-bit rows themselves where k and a share a 16-bit dtype (DeltaNet: a = k, β
# applied to the product's columns after): one 16-bit product with float32 sums, exact products, in place of 3xTF32
# products of float32 rows, whose hi/lo splits and extra passes are much of the kernel's ~6100 SASS instructions
# (compiled for sm_90a, K = 64: 567 LOP3 and 620 FADD, mostly splits). On an H100 (DeltaNet D = 64, bf16, thirty-second
# session) it took the kernel from 735 to 661 us at T = 32k, B = 1 and from 728 to 657 at 2k, B = 16 (−1.7 % and
# −2.8 % on the step), and on an H200 from 727 to 659 and 724 to 655 us (−1.8 % and −2.8 %). On by default since its GPU
# tests passed there (the output as close to the float64 delta rule as the float32-row one's; DeltaNet's real sizes).
PREPARE_16BIT_Z = True
# A cap on the prepare kernel's registers a thread (None: ptxas's choice, 253 at K = 64 on four warps: two programs an
# SM). Compiled for sm_90a (Triton 3.6, DeltaNet K = 64, bf16, thirty-third session) 168 spills 448 bytes a thread and
# lets three programs share an SM, 128 spills 1576 (four). Off and untimed: the kernel is latency-bound at ~660 us
# against ~190 of its bytes (mixers_h200.md, thirty-first session), which more programs an SM may hide.
PREPARE_MAXNREG: int | None = None


def register_cap(cap: int | None) -> dict[str, int]:
    """A launch's ``maxnreg`` option for a register cap (ptxas spills past it), or nothing for ``None``."""
    return {} if cap is None else {"maxnreg": cap}


def launch_dims(key_dim: int, value_dim: int, chunk_size: int, precision: str) -> tuple[int, dict]:
    """What every delta-rule launch shares: the state passes' value-block width (at most 64: the ``[K, V]`` state
    tiles of ``K = V = 128`` would not fit shared memory) and the kernels' common constexprs and warps."""
    dims = dict(K=key_dim, V=value_dim, BK=block_dim(key_dim), BT=chunk_size, PRECISION=precision)
    return min(block_dim(value_dim), 64), dims | launch_config(key_dim)


def delta_fwd_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    chunk_size: int,
    precision: str,
    cu_seqlens: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``q, k [B, T, H, K]``, ``v [B, T, H, V]`` and ``a [B, T, H, K]``, or ``beta [B, T, H]`` for ``a = β k``
    (DeltaNet), any strides with unit last stride, each in its own dtype; ``initial_state [N, H, V, K]`` or None ->
    ``(o [B, T, H, V] in v.dtype, S_T [N, H, V, K] float32, saved)``, the queries scaled by ``scale``. ``saved``
    holds the chunk states, ``U`` and each chunk's ``T`` for the backward (float32 ``[B, H, T, ·]``,
    ``T·(V + BT + K·V/BT)`` numbers per head: linear in ``T``) and the packed layout. ``cu_seqlens [N + 1]``: packed
    sequences (``B == 1``), each its own recurrence, all in one launch per kernel."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    a_or_k = k if a is None else a
    offsets, NC, varlen = chunk_layout(cu_seqlens, B, T, chunk_size)
    N = varlen["N"]
    BV_STATE, dims = launch_dims(K, V, chunk_size, precision)
    f32 = dict(dtype=torch.float32, device=k.device)
    w = torch.empty(B, H, T, K, **f32)
    u = torch.empty(B, H, T, V, **f32)
    tm = torch.empty(B, H, T, chunk_size, **f32)
    hs = torch.empty(B, H, NC, K, V, **f32)
    u_new = torch.empty(B, H, T, V, **f32)
    ht = torch.empty(N, H, V, K, **f32)
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    write = strides(a=a_or_k, beta=beta)
    solve = "ieee" if precision == "ieee" else "tf32x3"
    BV = block_dim(V)
    low_z = PREPARE_16BIT_Z and k.dtype in (torch.bfloat16, torch.float16) and a_or_k.dtype == k.dtype
    delta_prepare_kernel[(NC, B * H)](
        k, a_or_k, beta, v, w, u, tm, T=T, H=H, BV=BV, SB=16, SOLVE_PRECISION=solve, LOW_Z=low_z,
        **strides(k=k, v=v), **write, **varlen, **dims, **register_cap(PREPARE_MAXNREG),
    )  # fmt: skip
    seq = {n: varlen[n] for n in ("cu_seqlens", "offsets", "IS_VARLEN")}
    bv, state_dims = state_launch(BV_STATE, dims, N * H, k.device, k.dtype)
    delta_fwd_state_kernel[(triton.cdiv(V, bv), N * H)](
        w, u, a_or_k, beta, initial_state, hs, u_new, ht, T=T, NC=NC, H=H, BV=bv,
        USE_H0=initial_state is not None, **write, **seq, **state_dims,
    )  # fmt: skip
    delta_fwd_output_kernel[(NC, B * H, triton.cdiv(V, BV_STATE))](
        q, a_or_k, beta, hs, u_new, o, T=T, NC=NC, scale=scale, H=H, BV=BV_STATE, **strides(q=q), **write, **varlen,
        **dims,
    )  # fmt: skip
    return o, ht, {"w": w, "hs": hs, "u_new": u_new, "tm": tm, "offsets": offsets}
