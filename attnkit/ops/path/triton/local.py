"""PaTH backward: the chunk-local and superblock-local terms and their adjoints, in kernels (no autograd).

The kernels between chunks and superblocks (``backward.py``, ``backward_super.py``) take the queries carried to
their chunk's start ``x`` and to their superblock's start ``x̂``, the keys carried to their chunk's end ``K̃`` and to
their superblock's end ``k̂``, and each superblock's product of transitions ``Σ``; they give the gradients of those,
``dx``, ``dx̂``, ``dK̃``, ``dk̂``, ``dΣ``, and the gradient of each chunk's carry ``A = I − Wᵀ M W`` between chunks.
This file holds the rest of the backward (``README.md`` beside the op derives every formula):

- :func:`path_query_terms_kernel`: ``x = Q − tril(Q Wᵀ) M W`` and ``x̂`` (``x`` carried across the earlier chunks of
  its superblock, ``x ← x − (x W_mᵀ)(M_m W_m)``), one program per (chunk, query head).
- :func:`path_super_terms_bwd_kernel`: the adjoint of ``x̂ = x A_{r−1} ··· A_0``, ``k̂ = K̃ A_{r+1}ᵀ ··· A_{R−1}ᵀ`` and
  ``Σ = A_0ᵀ ··· A_{R−1}ᵀ`` within each superblock of ``R`` chunks: ``dx += dx̂ Pᵀ``, ``dK̃ += dk̂ Sᵀ`` and
  ``dA_j += U_j P_jᵀ + S_j V_jᵀ`` with the prefix ``P_j = A_{j−1} ··· A_0``, the suffix
  ``S_j = A_{j+1}ᵀ ··· A_{R−1}ᵀ``, ``U_j = Σ_{r>j} (A_{j+1}ᵀ ··· A_{r−1}ᵀ) x_rᵀ dx̂_r`` and
  ``V_j = P_j dΣ + Σ_{r<j} (A_{j−1} ··· A_{r+1}) K̃_rᵀ dk̂_r``, one program per (superblock, 64 columns of these
  matrices, key/value head). ``S`` and ``U`` go right to left into a scratch of two ``K × K`` float32 matrices a
  chunk, which the left-to-right pass of ``P`` and ``V`` reads: ``2R`` carries a superblock (recomputing ``S_j`` and
  ``U_j`` for each ``j`` took ``R²/2``).
- :func:`path_local_bwd_kernel`: each chunk's diagonal block (``dS = P (dO Vᵀ − Δ)``, ``dV``, the gates' sums) and
  the adjoint of the chunk-local terms — ``K̃``, ``x``, the intra-chunk logits, ``A`` — back to ``q, k, w`` and,
  through the UT transform ``M = L⁻¹ diag(β)``, to ``w`` and ``β``, one program per (chunk, key/value head) with the
  group's query heads in turn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_seq import locate_block, seq_bounds
from attnkit.ops.common.triton_utils import block_dim, interpreting
from attnkit.ops.path.triton import backward
from attnkit.ops.path.triton.prepare import applies_16bit, first_chunk, measured_16bit, pair_dot, precisions

SCRATCH_BYTES = 1 << 26  # the superblock-local adjoint's S_j and U_j, per wave of superblocks
# ... but a wave has at least this many programs, whatever SCRATCH_BYTES asks (about two an SM on the H200's 132):
# a smaller budget then costs launches, not parallelism. At T = 32k, D = 64, PaTH-FoX the scratch is 4 of the
# backward's 25.4 bf16 [B, T, H·D] tensors at its peak (benchmarks/path_memory.py) with 256 MiB; 64 MiB (four waves
# of 256 programs there) makes it 1. On the H200 at T = 4k, D = 64 (PaTH-FoX, bf16, 32768 tokens) 64 MiB took 14.89 ms
# against 14.85 and a peak of 1756 MiB against 1948 (path_tune.py's LOCAL row "superblock terms' scratch 64 MiB",
# path_local_session20_h200_d64.json): the default. At D = 128 a superblock row of every head holds 16 MiB, so 256
# programs keep 256 MiB either way.
SCRATCH_MIN_PROGRAMS = 256
# The chunk-local adjoint's gradient products (the query-head loop, the carries' dA) for 16-bit inputs: "bf16" rounds
# both operands to bfloat16, one tensor-core pass at twice TF32's rate on half the shared memory; None keeps the
# attention products' precision (one TF32 pass). At K = C = 64 (sm_90a, Triton 3.6) the kernel takes 112 KB of
# shared memory with them in bf16, two programs an SM, against 208 KB, one. On the H200 (T = 4k, D = 64, PaTH-FoX,
# 32768 tokens) forward+backward went from 24.5 to 21.4 ms and the largest error from the PyTorch backend (beta in
# (1.5, 2), unit float32 w) from 3.9e-3 to 4.6e-3 (benchmarks/results/path_h200.md, "The local adjoint's precision").
# The products that recompute the diagonal block's logits and take the UT transform's adjoint stay in TF32. It applies
# where its accuracy was measured (prepare.measured_16bit: bfloat16 inputs at K = 64 and 128; at K = 128 the kernel
# took 2.80 ms with it, 3.20 in TF32 at 78d152a).
LOCAL_GRADS_16BIT: str | None = "bf16"
# The UT transform's adjoint needs Q = L⁻ᵀ dM (L = I + diag(β) N, N = strict_tril(W Wᵀ)). None: a back substitution,
# BT dependent steps with two cross-thread reductions each over the [BT, BT] tile (latency the kernel cannot hide:
# one or two programs an SM). A precision ("bf16x3", "tf32"): two products from L⁻¹ = I − M N (L⁻¹ L = I; M = L⁻¹
# diag(β) is the prepare kernel's), Q = dM − Nᵀ (Mᵀ dM), in that precision (float32 inputs: their products', see
# local_solve). In one TF32 pass, or in bf16, a float64 emulation on nearly parallel w with beta in (1.5, 2) (cond(L)
# 136–641) put Q, dβ and dN 1.8e-3 to 2.8e-2 off (path_h200.md, eighth session); bf16x3 keeps about 16 bits of each
# operand. Compiled for sm_90a (Triton 3.6, K = 64, bf16 inputs, this file's defaults) the kernel keeps its 112 KB of
# shared memory (two programs an SM; 128 KB before Mᵀ was loaded transposed for the first product) and goes from about
# 28.8k to 7.4k instructions a thread (the substitution's 63 steps of 362 were 79 % of them), spilling 1748 bytes a
# thread against 1472. On the H200 (T = 4k, D = 64, PaTH-FoX, bf16, 32768 tokens) forward+backward went from 19.01 to
# 17.14 ms (17.74 in one TF32 pass) with every error from the PyTorch backend unchanged (largest 4.7e-3 on
# path_accuracy's inputs; path_h200.md, tenth session): the default.
LOCAL_SOLVE: str | None = "bf16x3"
# Where the kernels between chunks project each chunk's carry gradient dA onto dM and dW (BK > BT: K = 128 on the
# GPU), the superblock-local adjoint projects its share of dA there too (path_super_terms_bwd_kernel's PROJECT)
# instead of summing it into a K × K float32 matrix a chunk, which the local adjoint then projected: at K = 128,
# T = 4k, 8 heads that buffer was 512 MiB, a quarter of the backward's peak (benchmarks/path_memory.py: 32.6 → 24.6
# bf16 [B, T, H·D] tensors, twelfth session). Compiled for sm_90a (Triton 3.6, K = 128) with bf16 inputs the kernel
# keeps its 96 KB of shared memory and spills 1656 bytes a thread against 1824; with float16 inputs, whose carries
# take three TF32 passes, it spills 7788 bytes against 4392 (96 KB of shared memory against 128). On the H200 (PaTH-FoX,
# T = 4k, D = 128, float32 w, beta, g) forward+backward took 41.65 ms against 40.62 the old way, errors unchanged
# (path_h200.md, thirteenth session): kept for the memory. False: the old way (path_tune.py's LOCAL row
# "superblock terms' dA as K × K").
SUPER_DA_PROJECT = True
# Between superblocks, the order of the last two steps: the superblock terms' adjoint first, in place (dx̂ Pᵀ
# overwrites dx̂ and dk̂ Sᵀ overwrites dk̂: path_super_terms_bwd_kernel's IN_PLACE), then the kernels between chunks
# adding their dx, dK̃ and dA into those buffers, instead of the kernels between chunks first and the superblock terms
# adding into their dx, dK̃, which held dx̂, dk̂ and dx, dK̃ at once (four float32 [B, T, H, K] buffers, two of them
# needless). The same sums, in another order. Where one program takes every column of a head (BK <= 64) and the
# kernels between chunks sum dA (terms_in_place). At T = 32k, D = 64, PaTH-FoX the superblock terms' step then holds
# 21.4 bf16 [B, T, H·D] tensors instead of 25.4, and the backward's peak (now the sweep's) is 22.6
# (benchmarks/path_memory.py; 19.6 with prepare.BUFFERS_16BIT and a 64 MiB SCRATCH_BYTES). On the H200 at T = 4k,
# D = 64 (PaTH-FoX, bf16, 32768 tokens) forward+backward took 14.87 ms against 14.85, its peak 1740 MiB against 1948,
# every error from the PyTorch backend unchanged; with the other two memory settings 14.76 ms and 1552 MiB
# (path_local_session20_h200_d64.json): the default. False: the old order.
SUPER_TERMS_IN_PLACE = True


# The carries of the superblock-local terms (path_query_terms_kernel's x → x̂ across the earlier chunks of its
# superblock; path_super_terms_bwd_kernel's S, U, P, V) on operands rounded to the inputs' 16-bit dtype, float32
# accumulation, one tensor-core pass at twice TF32's rate on half the shared memory, instead of the carries' precision
# inside superblocks (prepare.inner_carry: one TF32 pass for bf16 at K = 64 and 128), as the backward's query kernel
# carries L and Γ (backward.INNER_CARRY_LOW, the default since the eighteenth session, every error unchanged to two
# digits). x̂ is stored in the inputs' dtype anyway. None (the default): where prepare.measured_16bit. On the H200 at
# T = 4k (PaTH-FoX, bf16, 32768 tokens; path_tune.py's LOCAL row "superblock terms' carries 16-bit") forward+backward
# took 14.45 ms against 14.85 at D = 64 and 35.11 against 35.57 at D = 128, every error from the PyTorch backend
# unchanged (path_local_session20_h200_d{64,128}.json). False: the carries' precision.
TERMS_CARRY_LOW: bool | None = None


def terms_low(dtype: torch.dtype, key_dim: int) -> bool:
    """Whether the superblock-local terms' carries take 16-bit operands (:data:`TERMS_CARRY_LOW`)."""
    return applies_16bit(TERMS_CARRY_LOW, dtype, key_dim)


def low_dtype(dtype: torch.dtype):
    """The Triton dtype the 16-bit carries round their operands to for inputs of ``dtype``: float16 for float16,
    else bfloat16."""
    return tl.float16 if dtype == torch.float16 else tl.bfloat16


def terms_in_place(key_dim: int, chunk: int) -> bool:
    """Whether the superblock terms' adjoint runs first and in place (:data:`SUPER_TERMS_IN_PLACE`): where one
    program takes a head's columns and the kernels between chunks sum ``dA``
    (:func:`backward.sums_carry_gradient`, into the buffer this adjoint starts)."""
    return SUPER_TERMS_IN_PLACE and block_dim(key_dim) <= 64 and backward.sums_carry_gradient(key_dim, chunk)


def launch_config(key_dim: int) -> dict[str, int]:
    """Warps and stages of this file's kernels: one warp under the interpreter, four at ``K <= 64``, eight above
    (their float32 ``K × K`` and ``C × C`` tiles). Not tuned yet."""
    if interpreting():
        return dict(num_warps=1, num_stages=1)
    return dict(num_warps=4 if key_dim <= 64 else 8, num_stages=1)


@triton.jit
def path_query_terms_kernel(
    q, w, mw, x_out, xh_out, cu_seqlens, T, SPAN,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, WRITE_XH: tl.constexpr, LOW: tl.constexpr = False,
    DT: tl.constexpr = tl.float32,
):  # fmt: skip
    """``q [*, HQ, K]``, ``w, mw [*, H, K]`` (``mw`` = ``M W`` per chunk) -> ``x_out [*, HQ, K]`` (its own dtype),
    the queries carried to their chunk's start, and with ``WRITE_XH`` ``xh_out`` (its own dtype) the same carried on
    to the start of their superblock of ``SPAN`` chunks (with ``LOW`` each carry's products on operands rounded to
    ``DT``, :data:`TERMS_CARRY_LOW`). Grid ``(chunks, N * HQ)``."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hq = i_nh // HQ, i_nh % HQ
    i_h = i_hq // (HQ // H)
    bos, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    start = i_c * BT
    if start >= L:
        return
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = (o_k < K)[None, :]
    p_t = bos + (start + o_t).to(tl.int64)
    m_tk = (start + o_t < L)[:, None] & m_k
    b_q = tl.load(q + p_t[:, None] * (HQ * K) + i_hq * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    p_kv = p_t[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_w = tl.load(w + p_kv, mask=m_tk, other=0.0).to(tl.float32)
    b_mw = tl.load(mw + p_kv, mask=m_tk, other=0.0).to(tl.float32)
    b_u = tl.dot(b_q, tl.trans(b_w), input_precision=PRECISION)
    b_u = tl.where(o_t[:, None] >= o_t[None, :], b_u, 0.0)
    b_x = b_q - tl.dot(b_u, b_mw, input_precision=PRECISION)
    p_x = p_t[:, None] * (HQ * K) + i_hq * K + o_k[None, :]
    tl.store(x_out + p_x, b_x.to(x_out.dtype.element_ty), mask=m_tk)
    if WRITE_XH:
        first = (i_c // SPAN) * SPAN
        P: tl.constexpr = "16bit" if LOW else PRECISION
        for i_back in range(0, i_c - first):  # chunks i_c − 1, …, first: x ← x − (x W_mᵀ)(M_m W_m)
            p_m = bos + ((i_c - 1 - i_back) * BT + o_t).to(tl.int64)
            p_mkv = p_m[:, None] * (H * K) + i_h * K + o_k[None, :]
            b_wm = tl.load(w + p_mkv, mask=m_k, other=0.0).to(tl.float32)
            b_mwm = tl.load(mw + p_mkv, mask=m_k, other=0.0).to(tl.float32)
            b_x = b_x - pair_dot(pair_dot(b_x, tl.trans(b_wm), P, DT), b_mwm, P, DT)
        tl.store(xh_out + p_x, b_x.to(xh_out.dtype.element_ty), mask=m_tk)


@triton.jit
def carry_columns(b_r, w, mw, p_t, m_t, i_h, o_k, H: tl.constexpr, K: tl.constexpr, TRANSPOSED: tl.constexpr,
                  PRECISION: tl.constexpr, LOW: tl.constexpr = False, DT: tl.constexpr = tl.float32):  # fmt: skip
    """Columns ``R [BK, BC]`` multiplied on the left by the carry of the chunk whose token offsets are ``p_t`` (valid
    rows ``m_t``): ``A R = R − Wᵀ ((M W) R)``, or with ``TRANSPOSED`` ``Aᵀ R = R − (M W)ᵀ (W R)`` (``A = I − Wᵀ M W``),
    two rank-``BT`` products instead of the ``K × K`` carry; with ``LOW`` both on operands rounded to ``DT`` (float32
    accumulation, ``R`` kept float32)."""
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    p_kv = p_t[:, None] * (H * K) + i_h * K + o_k[None, :]
    P: tl.constexpr = "16bit" if LOW else PRECISION
    b_w = tl.load(w + p_kv, mask=m_tk, other=0.0).to(tl.float32)
    b_mw = tl.load(mw + p_kv, mask=m_tk, other=0.0).to(tl.float32)
    if TRANSPOSED:
        return b_r - pair_dot(tl.trans(b_mw), pair_dot(b_w, b_r, P, DT), P, DT)
    return b_r - pair_dot(tl.trans(b_w), pair_dot(b_mw, b_r, P, DT), P, DT)


@triton.jit
def path_super_terms_bwd_kernel(
    x, kt, w, mw, m, dxh, dkh, dsig, dx, dkt, da, dm, dw, su, cu_seqlens, chunk_offsets, sb_offsets, T, NC, NSB, SPAN,
    r0, N,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr, PRECISION: tl.constexpr, PROJECT: tl.constexpr = False,
    IN_PLACE: tl.constexpr = False, LOW: tl.constexpr = False, DT: tl.constexpr = tl.float32,
):  # fmt: skip
    """The adjoint of the superblock-local terms (module docstring): ``x, dxh [*, HQ, K]``, ``kt, dkh [*, H, K]``,
    ``w``, ``mw [*, H, K]``, ``dsig [superblocks, H, BK, BK]`` (float32 but ``w``; ``x``, ``kt`` in
    ``prepare.buffer_dtype``) -> adds into ``dx``, ``dkt`` and either ``da [chunks, H, BK, BK]`` (each chunk's
    ``dA``) or, with ``PROJECT``, its projections through ``A = I − Wᵀ M W`` onto ``dm [chunks, H, BT, BT]`` and
    ``dw [*, H, K]`` (``m``: each chunk's ``M``; ``dM −= W dA Wᵀ``, ``dW −= (M W) dAᵀ + Mᵀ W dA``, as the kernels
    between chunks project theirs when ``BK > BT``: no ``K × K`` buffer a chunk), all by atomic adds;
    ``su [wave, H, BK / BC, SPAN, 2, BK, BC]`` float32 is the programs' scratch. Grid
    ``(rows r0, r0 + 1, … of this wave, BK / BC, H)`` over the rows of ``dΣ`` (every sequence's superblocks; a packed
    batch finds a row's sequence by binary search over ``sb_offsets``, rows past the last return): ``P``, ``S``,
    ``U`` and ``V`` evolve by products on the left, so their columns do independently; a program takes ``BC`` of
    them. A right-to-left pass writes every chunk's ``S_j`` and ``U_j`` to the scratch, then a left-to-right pass
    carries ``P_j`` and ``V_j`` and adds its share of ``dA_j = U_j P_jᵀ + S_j V_jᵀ``, ``dx̂ Pᵀ`` and ``dk̂ Sᵀ`` (sums
    over the columns): ``2R − 1`` carries a superblock. The ``Σ`` term ``S_j dΣᵀ P_jᵀ`` is folded into ``V`` by
    starting it at ``V_0 = dΣ``. With ``IN_PLACE`` (one program a head, ``BC = BK``: it alone reads and writes its
    rows' columns, each row last read at its own step) ``dx̂ Pᵀ`` and ``dk̂ Sᵀ`` overwrite ``dxh`` and ``dkh`` instead
    of adding into ``dx`` and ``dkt``, and ``dA`` is stored, not added (``da`` may come uninitialised). With ``LOW``
    the carries of ``S``, ``U``, ``P`` and ``V`` take operands rounded to ``DT`` (:data:`TERMS_CARRY_LOW`)."""
    i_w, i_b, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = r0 + i_w  # the superblock's row in the per-superblock arrays
    if IS_VARLEN:
        i_n, i_s = locate_block(sb_offsets, row, N, LOG_N)
        if i_n >= N:
            return
    else:
        i_n, i_s = row // NSB, row % NSB
    G: tl.constexpr = HQ // H
    NB: tl.constexpr = BK // BC
    bos, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    c_lo = i_s * SPAN
    n_chunks = tl.cdiv(L, BT)
    if c_lo >= n_chunks:
        return
    R = tl.minimum(c_lo + SPAN, n_chunks) - c_lo
    chunk0 = first_chunk(chunk_offsets, i_n, NC, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_c = i_b * BC + tl.arange(0, BC)
    m_c = (o_c < K)[None, :]
    eye = tl.where(o_k[:, None] == o_c[None, :], 1.0, 0.0)  # [BK, BC]: these columns of the identity
    p_su = su + ((i_w * H + i_h) * NB + i_b).to(tl.int64) * (SPAN * 2 * BK * BC)
    o_su = o_k[:, None] * BC + tl.arange(0, BC)[None, :]
    # Right to left: S_{R−1} = I, U_{R−1} = 0; S_{j−1} = A_jᵀ S_j, U_{j−1} = A_jᵀ U_j + D_j (D_j = Σ_heads x_jᵀ dx̂_j).
    b_s = eye
    b_u = tl.zeros([BK, BC], dtype=tl.float32)
    for i_back in range(0, R):
        j = R - 1 - i_back
        tl.store(p_su + (2 * j) * (BK * BC) + o_su, b_s)
        tl.store(p_su + (2 * j + 1) * (BK * BC) + o_su, b_u)
        if j > 0:
            o_r = (c_lo + j) * BT + o_t
            m_r = o_r < L
            p_r = bos + o_r.to(tl.int64)
            b_u = carry_columns(b_u, w, mw, p_r, m_r, i_h, o_k, H, K, True, PRECISION, LOW, DT)
            b_s = carry_columns(b_s, w, mw, p_r, m_r, i_h, o_k, H, K, True, PRECISION, LOW, DT)
            for i_g in range(G):
                p_q = p_r[:, None] * (HQ * K) + (i_h * G + i_g) * K
                b_x = tl.load(x + p_q + o_k[None, :], mask=m_r[:, None] & (o_k < K)[None, :], other=0.0).to(tl.float32)
                b_dxh = tl.load(dxh + p_q + o_c[None, :], mask=m_r[:, None] & m_c, other=0.0)
                b_u += tl.dot(tl.trans(b_x), b_dxh, input_precision=PRECISION)
    tl.debug_barrier()  # the left-to-right pass reads what every thread of the program wrote
    # Left to right: P_0 = I, V_0 = dΣ; P_{j+1} = A_j P_j, V_{j+1} = A_j V_j + k̃_jᵀ dk̂_j.
    b_p = eye
    b_v = tl.load(dsig + (row * H + i_h) * (BK * BK) + o_k[:, None] * BK + o_c[None, :])
    for j in range(0, R):
        b_s = tl.load(p_su + (2 * j) * (BK * BC) + o_su)
        b_u = tl.load(p_su + (2 * j + 1) * (BK * BC) + o_su)
        o_j = (c_lo + j) * BT + o_t
        m_j = o_j < L
        p_j = bos + o_j.to(tl.int64)
        m_jk = m_j[:, None] & (o_k < K)[None, :]
        i_chunk = chunk0 + c_lo + j
        if PROJECT:  # this program's share dA = U Pᵀ + S Vᵀ, taken through A = I − Wᵀ Z (Z = M W) at once
            p_wk = p_j[:, None] * (H * K) + i_h * K + o_k[None, :]
            b_w = tl.load(w + p_wk, mask=m_jk, other=0.0).to(tl.float32)
            b_z = tl.load(mw + p_wk, mask=m_jk, other=0.0).to(tl.float32)
            b_wda = tl.dot(tl.dot(b_w, b_u, input_precision=PRECISION), tl.trans(b_p), input_precision=PRECISION)
            b_wda += tl.dot(tl.dot(b_w, b_s, input_precision=PRECISION), tl.trans(b_v), input_precision=PRECISION)
            b_dw = tl.dot(tl.dot(b_z, b_p, input_precision=PRECISION), tl.trans(b_u), input_precision=PRECISION)
            b_dw += tl.dot(tl.dot(b_z, b_v, input_precision=PRECISION), tl.trans(b_s), input_precision=PRECISION)
            b_mt = tl.load(m + (i_chunk * H + i_h) * (BT * BT) + o_t[None, :] * BT + o_t[:, None])  # Mᵀ
            b_dw += tl.dot(b_mt, b_wda, input_precision=PRECISION)
            tl.atomic_add(dw + p_wk, -b_dw, mask=m_jk, sem="relaxed")
            b_dm = tl.dot(b_wda, tl.trans(b_w), input_precision=PRECISION)
            tl.atomic_add(dm + (i_chunk * H + i_h) * (BT * BT) + o_t[:, None] * BT + o_t[None, :], -b_dm, sem="relaxed")
        else:
            b_da = tl.dot(b_u, tl.trans(b_p), input_precision=PRECISION)
            b_da += tl.dot(b_s, tl.trans(b_v), input_precision=PRECISION)
            p_da = da + (i_chunk * H + i_h) * (BK * BK) + o_k[:, None] * BK + o_k[None, :]
            if IN_PLACE:  # the chunk's one program, and dA's first writer: stored, no zeros before
                tl.store(p_da, b_da)
            else:
                tl.atomic_add(p_da, b_da, sem="relaxed")
        for i_g in range(G):
            p_q = p_j[:, None] * (HQ * K) + (i_h * G + i_g) * K
            b_dxh = tl.load(dxh + p_q + o_c[None, :], mask=m_j[:, None] & m_c, other=0.0)
            b_dx = tl.dot(b_dxh, tl.trans(b_p), input_precision=PRECISION)
            if IN_PLACE:
                tl.store(dxh + p_q + o_k[None, :], b_dx, mask=m_jk)
            else:
                tl.atomic_add(dx + p_q + o_k[None, :], b_dx, mask=m_jk, sem="relaxed")
        p_kv = p_j[:, None] * (H * K) + i_h * K
        b_dkh = tl.load(dkh + p_kv + o_c[None, :], mask=m_j[:, None] & m_c, other=0.0)
        b_dkt = tl.dot(b_dkh, tl.trans(b_s), input_precision=PRECISION)
        if IN_PLACE:
            tl.store(dkh + p_kv + o_k[None, :], b_dkt, mask=m_jk)
        else:
            tl.atomic_add(dkt + p_kv + o_k[None, :], b_dkt, mask=m_jk, sem="relaxed")
        b_kt = tl.load(kt + p_kv + o_k[None, :], mask=m_jk, other=0.0).to(tl.float32)
        b_v = carry_columns(b_v, w, mw, p_j, m_j, i_h, o_k, H, K, False, PRECISION, LOW, DT)
        b_v += tl.dot(tl.trans(b_kt), b_dkh, input_precision=PRECISION)  # V ← A_j V + k̃_jᵀ dk̂_j
        b_p = carry_columns(b_p, w, mw, p_j, m_j, i_h, o_k, H, K, False, PRECISION, LOW, DT)


@triton.jit
def unit_upper_solve(b_gram, b_beta, b_rhs, BT: tl.constexpr):
    """``Q = L⁻ᵀ R`` with ``L = I + diag(β) strict_tril(G)`` (``b_gram`` = ``W Wᵀ``) by back substitution: row ``i``
    is ``R_i − Σ_{k>i} β_k G_ki Q_k``, ``BT`` steps on the ``[BT, BT]`` tiles."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    b_q = b_rhs
    for i_back in range(1, BT):
        i = BT - 1 - i_back
        b_coef = tl.sum(tl.where((cols == i) & (rows > i), b_gram, 0.0), 1) * b_beta
        b_row = tl.sum(b_coef[:, None] * b_q, 0)
        b_q = tl.where(rows == i, b_q - b_row[None, :], b_q)
    return b_q


@triton.jit
def mm(a, b, PRECISION: tl.constexpr):
    """``a @ b`` with float32 accumulation: ``PRECISION`` "bf16" rounds both operands to bfloat16 (one tensor-core
    pass on 16-bit operands, half the shared memory of float32 ones), anything else is ``tl.dot``'s
    ``input_precision``."""
    if PRECISION == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def load_rows(t, p_t, i_h, o_d, m_t, HD: tl.constexpr, D: tl.constexpr):
    """Rows ``p_t`` of head ``i_h`` of ``t [*, heads, D]`` (``HD`` = heads · D) as float32, zeros where masked.
    The kernel below loads its operands again where each phase uses them: one value would keep its shared-memory
    copy for a dot alive from the first use to the last."""
    return tl.load(t + p_t[:, None] * HD + i_h * D + o_d[None, :], mask=m_t[:, None] & (o_d < D)[None, :], other=0.0)


@triton.jit
def path_local_bwd_kernel(
    q, k, v, w, beta, m, gcum, do, lse, delta, dx, dkt, da, dm, dw_in, dq, dk, dw, dbeta, dv, dv_out, dgcum,
    cu_seqlens, chunk_offsets, T, NC, scale,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr, DA: tl.constexpr, DM: tl.constexpr,
    PRECISION: tl.constexpr, GRAD_PRECISION: tl.constexpr, SOLVE: tl.constexpr = "substitution",
):  # fmt: skip
    """Each chunk's diagonal block and the adjoint of its local terms (module docstring). Inputs ``q, do [*, HQ, ·]``,
    ``k, v, w [*, H, ·]``, ``beta [*, H]``, the prepare kernel's ``m [chunks, H, BT, BT]``, ``gcum, lse, delta
    [*, HQ]`` float32, the gradients of the local terms (float32): ``dx [*, HQ, K]``, ``dkt [*, H, K]``, with ``DA``
    ``da [chunks, H, BK, BK]`` (the carries') and with ``DM`` ``dm [chunks, H, BT, BT]`` and ``dw_in [*, H, K]`` (the
    carries' gradient as its projections). Writes ``dq [*, HQ, K]``, ``dk, dw [*, H, K]``, ``dbeta [*, H]`` (float32)
    and adds the diagonal blocks' ``dV`` to ``dv [*, H, V]`` (float32) into ``dv_out`` (in its own dtype) and, with
    ``USE_G``, their row and column sums of ``dS`` into ``dgcum [*, HQ]``. ``SOLVE``: ``L⁻ᵀ dM`` by back
    substitution, or by two products in that precision (``LOCAL_SOLVE``). Grid ``(chunks, N * H)``."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    G: tl.constexpr = HQ // H
    bos, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    start = i_c * BT
    if start >= L:
        return
    i_chunk = first_chunk(chunk_offsets, i_n, NC, IS_VARLEN) + i_c
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_t = start + o_t < L
    p_t = bos + (start + o_t).to(tl.int64)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    rows = o_t[:, None]
    cols = o_t[None, :]
    p_kv = p_t[:, None] * (H * K) + i_h * K + o_k[None, :]
    p_mm = m + (i_chunk * H + i_h) * (BT * BT) + rows * BT + cols
    p_mmt = m + (i_chunk * H + i_h) * (BT * BT) + cols * BT + rows  # Mᵀ
    b_beta = tl.load(beta + p_t * H + i_h, mask=m_t, other=0.0).to(tl.float32)

    # K̃ = K − Zᵀ W (Z = M Vk, Vk = strict_tril(W Kᵀ)) and the carry A = I − Wᵀ M W.
    b_w = load_rows(w, p_t, i_h, o_k, m_t, H * K, K).to(tl.float32)
    b_k = load_rows(k, p_t, i_h, o_k, m_t, H * K, K).to(tl.float32)
    b_m = tl.load(p_mm)
    b_vk = tl.where(rows > cols, mm(b_w, tl.trans(b_k), PRECISION), 0.0)
    b_z = mm(b_m, b_vk, PRECISION)
    b_dkt = tl.load(dkt + p_kv, mask=m_tk, other=0.0)
    b_dk = b_dkt
    b_dw = -mm(b_z, b_dkt, GRAD_PRECISION)
    b_dz = -mm(b_w, tl.trans(b_dkt), GRAD_PRECISION)
    b_dvk = mm(tl.trans(b_m), b_dz, GRAD_PRECISION)
    b_dm = mm(b_dz, tl.trans(b_vk), GRAD_PRECISION)
    if DA:
        b_w = load_rows(w, p_t, i_h, o_k, m_t, H * K, K).to(tl.float32)
        b_m = tl.load(p_mm)
        b_da = tl.load(da + (i_chunk * H + i_h) * (BK * BK) + o_k[:, None] * BK + o_k[None, :])
        b_wda = mm(b_w, b_da, GRAD_PRECISION)
        b_dm -= mm(b_wda, tl.trans(b_w), GRAD_PRECISION)
        b_dw -= mm(mm(b_m, b_w, GRAD_PRECISION), tl.trans(b_da), GRAD_PRECISION)
        b_dw -= mm(tl.trans(b_m), b_wda, GRAD_PRECISION)
    if DM:
        b_dm += tl.load(dm + (i_chunk * H + i_h) * (BT * BT) + rows * BT + cols)
        b_dw += tl.load(dw_in + p_kv, mask=m_tk, other=0.0)

    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    causal = (rows >= cols) & m_t[:, None]
    for i_g in tl.static_range(G):
        i_hq = i_h * G + i_g
        p_q = p_t[:, None] * (HQ * K) + i_hq * K + o_k[None, :]
        b_w = load_rows(w, p_t, i_h, o_k, m_t, H * K, K).to(tl.float32)
        b_k = load_rows(k, p_t, i_h, o_k, m_t, H * K, K).to(tl.float32)
        b_m = tl.load(p_mm)
        b_q = tl.load(q + p_q, mask=m_tk, other=0.0).to(tl.float32)
        b_dx = tl.load(dx + p_q, mask=m_tk, other=0.0)
        b_lse = tl.load(lse + p_t * HQ + i_hq, mask=m_t, other=0.0)
        b_delta = tl.load(delta + p_t * HQ + i_hq, mask=m_t, other=0.0)
        # The diagonal block: S = scale (Q Kᵀ − U Z) (+ G_i − G_j), U = tril(Q Wᵀ).
        b_u = tl.where(rows >= cols, mm(b_q, tl.trans(b_w), PRECISION), 0.0)
        b_s = mm(b_q, tl.trans(b_k), PRECISION) - mm(b_u, b_z, PRECISION)
        b_s = b_s * scale
        if USE_G:
            b_g = tl.load(gcum + p_t * HQ + i_hq, mask=m_t, other=0.0)
            b_s += b_g[:, None] - b_g[None, :]
        b_p = tl.where(causal, tl.exp(b_s - b_lse[:, None]), 0.0)
        b_do = load_rows(do, p_t, i_hq, o_v, m_t, HQ * V, V)
        b_vv = load_rows(v, p_t, i_h, o_v, m_t, H * V, V)
        b_ds = b_p * (tl.dot(b_do, tl.trans(b_vv), input_precision=PRECISION).to(tl.float32) - b_delta[:, None])
        b_dv += tl.dot(tl.trans(b_p).to(b_do.dtype), b_do, input_precision=PRECISION)  # the logits' precision
        if USE_G:
            p_g = dgcum + p_t * HQ + i_hq
            tl.store(p_g, tl.load(p_g, mask=m_t, other=0.0) + tl.sum(b_ds, 1) - tl.sum(b_ds, 0), mask=m_t)
        # x = Q − U M W and the logits' U M Vk: R = dx Wᵀ + scale dS Vkᵀ carries both to U and M.
        b_r = mm(b_dx, tl.trans(b_w), GRAD_PRECISION)
        b_r += mm(b_ds, tl.trans(b_vk), GRAD_PRECISION) * scale
        b_dm -= mm(tl.trans(b_u), b_r, GRAD_PRECISION)
        b_du = tl.where(rows >= cols, -mm(b_r, tl.trans(b_m), GRAD_PRECISION), 0.0)
        b_mu = mm(tl.trans(b_m), tl.trans(b_u), GRAD_PRECISION)  # Mᵀ Uᵀ
        b_dw += mm(tl.trans(b_du), b_q, GRAD_PRECISION)
        b_dw -= mm(b_mu, b_dx, GRAD_PRECISION)
        b_dvk -= mm(b_mu, b_ds, GRAD_PRECISION) * scale
        b_dq = b_dx + mm(b_ds, b_k, GRAD_PRECISION) * scale
        b_dq += mm(b_du, b_w, GRAD_PRECISION)
        tl.store(dq + p_q, b_dq.to(dq.dtype.element_ty), mask=m_tk)
        b_dk += mm(tl.trans(b_ds), b_q, GRAD_PRECISION) * scale

    b_w = load_rows(w, p_t, i_h, o_k, m_t, H * K, K).to(tl.float32)
    b_k = load_rows(k, p_t, i_h, o_k, m_t, H * K, K).to(tl.float32)
    b_dvk = tl.where(rows > cols, b_dvk, 0.0)
    b_dw += mm(b_dvk, b_k, GRAD_PRECISION)
    b_dk += mm(tl.trans(b_dvk), b_w, GRAD_PRECISION)
    # The UT transform M = L⁻¹ diag(β), L = I + diag(β) N, N = strict_tril(W Wᵀ): with Q = L⁻ᵀ dM,
    # dN = −strict_tril(diag(β) Q Mᵀ) and dβ_i = Σ_j ((I − N M) ∘ Q)_ij.
    if SOLVE == "substitution":
        b_gram = mm(b_w, tl.trans(b_w), PRECISION)
        b_qm = unit_upper_solve(b_gram, b_beta, b_dm, BT)
    else:  # L⁻¹ = I − M N: Q = dM − Nᵀ (Mᵀ dM) (LOCAL_SOLVE)
        b_mdm = mm(tl.load(p_mmt), b_dm, SOLVE)  # Mᵀ dM, M loaded transposed
        b_gram = mm(b_w, tl.trans(b_w), PRECISION)
        b_qm = b_dm - mm(tl.trans(tl.where(rows > cols, b_gram, 0.0)), b_mdm, SOLVE)
    b_m = tl.load(p_mm)
    b_dn = tl.where(rows > cols, -b_beta[:, None] * mm(b_qm, tl.trans(b_m), PRECISION), 0.0)
    b_n = tl.where(rows > cols, b_gram, 0.0)
    b_inm = tl.where(rows == cols, 1.0, 0.0) - mm(b_n, b_m, PRECISION)
    b_dbeta = tl.sum(b_inm * b_qm, 1)
    b_w = load_rows(w, p_t, i_h, o_k, m_t, H * K, K).to(tl.float32)
    b_dw += mm(b_dn + tl.trans(b_dn), b_w, PRECISION)
    tl.store(dk + p_kv, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dw + p_kv, b_dw.to(dw.dtype.element_ty), mask=m_tk)
    tl.store(dbeta + p_t * H + i_h, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)
    p_dv = p_t[:, None] * (H * V) + i_h * V + o_v[None, :]
    b_dv += tl.load(dv + p_dv, mask=m_tv, other=0.0)
    tl.store(dv_out + p_dv, b_dv.to(dv_out.dtype.element_ty), mask=m_tv)


def query_terms_fn(
    q: torch.Tensor,
    w: torch.Tensor,
    mw: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    chunk: int,
    span: int | None,
    precision: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, xh)`` ``[B, T, HQ, K]`` of contiguous ``q``, ``w`` and the prepare kernel's ``mw``: ``x`` in ``dtype``
    (``prepare.buffer_dtype``), ``xh`` in ``q``'s dtype (None without superblocks, ``span`` None: the sweep between
    superblocks, its only reader, takes it as 16-bit operands, half the bytes it reads a pair). ``precision``: the
    carries' (default ``precisions(q.dtype, K)[1]``). No host sync: the grid covers ``T`` for every sequence."""
    B, T, HQ, K = q.shape
    H = w.shape[2]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    x = torch.empty(q.shape, dtype=dtype, device=q.device)
    xh = None if span is None else torch.empty_like(q)
    path_query_terms_kernel[(triton.cdiv(T, chunk), N * HQ)](
        q, w, mw, x, xh, cu_seqlens, T, 1 if span is None else span, HQ=HQ, H=H, K=K, BK=block_dim(K), BT=chunk,
        IS_VARLEN=cu_seqlens is not None, PRECISION=precision or precisions(q.dtype, K)[1], WRITE_XH=span is not None,
        LOW=terms_low(q.dtype, K), DT=low_dtype(q.dtype), **launch_config(K),
    )  # fmt: skip
    return x, xh


def superblock_wave(rows: int, heads: int, BK: int, BC: int, span: int) -> int:
    """Superblock rows a launch of :func:`path_super_terms_bwd_kernel` takes (of ``rows``): as many as their scratch
    (``heads · span`` chunks of two ``BK × BC`` float32 matrices a program, ``BK / BC`` programs a head) fits in
    ``SCRATCH_BYTES``, but at least enough for ``SCRATCH_MIN_PROGRAMS`` programs, and one at least."""
    per_row = heads * BK * BK * span * 2 * 4  # the scratch of one superblock row, every head, bytes
    return max(1, min(rows, max(SCRATCH_BYTES // per_row, triton.cdiv(SCRATCH_MIN_PROGRAMS, heads * (BK // BC)))))


def super_terms_bwd_fn(
    x: torch.Tensor,
    kt: torch.Tensor,
    w: torch.Tensor,
    mw: torch.Tensor,
    dxh: torch.Tensor,
    dkh: torch.Tensor,
    dsig: torch.Tensor,
    dx: torch.Tensor,
    dkt: torch.Tensor,
    da: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk: int,
    span: int,
    dtype: torch.dtype,
    offsets: torch.Tensor | None,
    sb_offsets: torch.Tensor | None,
    precision: str | None = None,
    m: torch.Tensor | None = None,
    dm: torch.Tensor | None = None,
    dw: torch.Tensor | None = None,
    in_place: bool = False,
) -> None:
    """Adds the superblock-local terms' adjoint into ``dx``, ``dkt`` and ``da`` (in place; shapes as
    :func:`path_super_terms_bwd_kernel`), or with ``da`` None each chunk's ``dA`` projected onto ``dm`` and ``dw``
    through ``A = I − Wᵀ M W`` (``m``: each chunk's ``M``, ``mw`` its ``M W``), where the kernels between chunks
    leave theirs. ``dtype``: the inputs' dtype, which picks the carries' precision unless ``precision`` names one;
    ``offsets``, ``sb_offsets``: ``chunk_offsets`` of ``cu_seqlens`` by chunks and by superblocks. The superblocks go
    in waves whose scratch (``S_j`` and ``U_j``, two ``K × K`` float32 matrices a chunk) fits ``SCRATCH_BYTES``, of
    at least ``SCRATCH_MIN_PROGRAMS`` programs: one wave at T = 32k, K = 64, 16 heads; four at K = 128, 8 heads,
    however many sequences a packed batch holds. With ``in_place`` (where :func:`terms_in_place`) ``dx`` and ``dkt``
    are ``dxh`` and ``dkh``, which their shares overwrite, and every chunk's ``dA`` is stored into ``da`` (which
    needs no zeros before)."""
    B, T, HQ, K = x.shape
    H = kt.shape[2]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    BK = block_dim(K)
    BC = min(BK, 64)
    rows = dsig.shape[0]  # every sequence's superblocks (a bound when packed)
    project = da is None
    if project and (m is None or dm is None or dw is None):
        raise ValueError("super_terms_bwd_fn: without da, m, dm and dw are all needed")
    if in_place and (BC != BK or dx is not dxh or dkt is not dkh):
        raise ValueError("super_terms_bwd_fn: in place takes dx = dxh and dkt = dkh, and one program a head")
    wave = superblock_wave(rows, H, BK, BC, span)
    su = torch.empty(wave, H, BK // BC, span, 2, BK, BC, dtype=torch.float32, device=x.device)
    for r0 in range(0, rows, wave):
        path_super_terms_bwd_kernel[(min(wave, rows - r0), BK // BC, H)](
            x, kt, w, mw, m if project else dsig, dxh, dkh, dsig, dx, dkt, dsig if project else da,
            dm if project else dsig, dw if project else dsig, su, cu_seqlens, offsets, sb_offsets, T,
            triton.cdiv(T, chunk), triton.cdiv(T, chunk * span), span, r0, N,
            HQ=HQ, H=H, K=K, BK=BK, BC=BC, BT=chunk, IS_VARLEN=cu_seqlens is not None,
            LOG_N=max(1, N.bit_length()) if cu_seqlens is not None else 1,
            PRECISION=precision or precisions(dtype, K)[1], PROJECT=project, IN_PLACE=in_place, LOW=terms_low(dtype, K),
            DT=low_dtype(dtype), **launch_config(K),
        )  # fmt: skip


def local_precisions(dtype: torch.dtype, key_dim: int, value_dim: int = 0) -> tuple[str, str]:
    """``(logits, gradients)``: the chunk-local adjoint's products' precisions for inputs of ``dtype`` (module
    comment of ``LOCAL_GRADS_16BIT``). ``prepare.precisions``' for float32 inputs; exact under the interpreter, whose
    bf16 dot is wrong."""
    precision = precisions(dtype, key_dim, value_dim)[0]
    return precision, (LOCAL_GRADS_16BIT or precision) if measured_16bit(dtype, key_dim) else precision


def value_block(value_dim: int, dtype: torch.dtype) -> int:
    """The chunk-local adjoint's block of value columns: at least 64 for 16-bit inputs. Compiled by Triton 3.6 for
    sm_90a with a block of 16 or 32 value columns against 64 key columns, bf16 products and one query head a key
    head, the kernel read shared memory out of bounds (compute-sanitizer: "Invalid __shared__ read of size 512 bytes"
    in the store of dβ) and faulted: bf16 PaTH at K = 16 (padded to 64) and V = 16, at K = 32, V = 32 and at
    K = 64, V = 16, at T = 24, 64 and 77, with and without gates (run_gpu.sh pathsmall, twenty-third session). Float16
    inputs at K = V = 16 unpadded, two query heads a key head, faulted the same way on an H100 (the gate-gradient
    test, twenty-fourth session) and pass with 64 columns. The extra columns are masked: zeros in, nothing out."""
    return max(block_dim(value_dim), 64) if dtype != torch.float32 else block_dim(value_dim)


def local_solve(dtype: torch.dtype, precision: str) -> str:
    """The precision of the local adjoint's two products for ``L⁻ᵀ dM`` where ``LOCAL_SOLVE`` sets one: the attention
    products' ``precision`` for float32 inputs (``prepare.FLOAT32_PRECISIONS``), exact under the interpreter, which
    knows no bf16x3, else ``LOCAL_SOLVE``."""
    return "ieee" if interpreting() else precision if dtype == torch.float32 else LOCAL_SOLVE


def local_bwd_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    m: torch.Tensor,
    gcum: torch.Tensor | None,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dx: torch.Tensor,
    dkt: torch.Tensor,
    da: torch.Tensor | None,
    dm: torch.Tensor | None,
    dw_in: torch.Tensor | None,
    dv: torch.Tensor,
    dgcum: torch.Tensor | None,
    scale: float,
    cu_seqlens: torch.Tensor | None,
    chunk: int,
    offsets: torch.Tensor | None,
    dv_out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dw, dbeta)`` in the dtypes of ``q, k, w, beta`` from the local terms' gradients
    (:func:`path_local_bwd_kernel`; ``m``: the prepare kernel's UT matrices; ``da`` or ``dm`` with ``dw_in`` may be
    None; ``offsets``: ``chunk_offsets(cu_seqlens, chunk)``); adds the diagonal blocks into ``dgcum`` in place, and
    to the float32 ``dv`` into ``dv_out`` (``dv``'s shape, in any dtype: the last writer of ``dV`` rounds it once).
    ``dw`` is ``dkt`` itself, overwritten, where their dtypes, shapes and strides agree: the caller reads ``dkt`` no
    more.

    The kernel's products take :func:`local_precisions`: the attention products' precision (one TF32 pass for
    16-bit inputs, ``prepare.FLOAT32_PRECISIONS`` for float32 ones), and for bfloat16 inputs at ``K <= 64`` bf16
    operands in the gradients' products. Nothing here accumulates across chunks, unlike the carries (3×TF32), and
    the 3×TF32 form spilled 7.9 KB of registers a thread at K = C = 64 and 66 KB at K = 128 (1.5 and 2.7 KB in one
    pass; Triton 3.6, sm_90a). On the H200 a whole step with every carry in one TF32 pass stayed within 3.9e-3 of
    3×TF32 at 4k (``benchmarks/results/path_h200.md``, "Carry precision")."""
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dq, dk, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(beta)
    # dw takes dK̃'s storage where their layouts agree (float32 w, as the layers hand it): a program reads its rows of
    # dK̃ before anything else and writes the same rows of dw last, and no other program touches them.
    reuse = w.dtype == dkt.dtype and w.shape == dkt.shape and w.stride() == dkt.stride()
    dw = dkt if reuse else torch.empty_like(w)
    precision, grads = local_precisions(q.dtype, K, V)
    solve = "substitution" if LOCAL_SOLVE is None else local_solve(q.dtype, precision)
    path_local_bwd_kernel[(triton.cdiv(T, chunk), N * H)](
        q, k, v, w, beta, m, gcum, do, lse, delta, dx, dkt, da, dm, dw_in, dq, dk, dw, dbeta, dv, dv_out, dgcum,
        cu_seqlens, offsets, T, triton.cdiv(T, chunk), scale,
        HQ=HQ, H=H, K=K, V=V, BK=block_dim(K), BV=value_block(V, v.dtype), BT=chunk, USE_G=gcum is not None,
        IS_VARLEN=cu_seqlens is not None, DA=da is not None, DM=dm is not None, PRECISION=precision,
        GRAD_PRECISION=grads, SOLVE=solve, **launch_config(K),
    )  # fmt: skip
    return dq, dk, dw, dbeta
