"""PaTH per-chunk preparation: the UT transform ``M`` of each chunk and its keys carried to the chunk's end.

For a chunk of ``BT`` positions with directions ``W`` and strengths ``beta``:
``M = (I + diag(beta) strict_tril(W Wᵀ))⁻¹ diag(beta)`` (so that ``H_1 ··· H_BT = I − Wᵀ Mᵀ W``), by forward
substitution, row by row; and ``k̃_j = H_BT ··· H_{j+1} k_j = k_j − ((M strict_tril(W Kᵀ))ᵀ W)_j``. Both are
linear in ``T`` in memory: ``M`` is ``BT`` floats per position, ``k̃`` one key per position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.tril_inverse import tril_inverse
from attnkit.ops.common.triton_seq import block_offsets, seq_bounds
from attnkit.ops.common.triton_utils import LOG2E, block_dim, interpreting

# log2(e) and ln(2) for the kernels: the forward's and the key-major sweeps' softmax runs on exp2, which compiles to one
# MUFU.EX2 (tl.exp adds a multiply by log2(e) and the range fix-up of a non-flushing ex2, four more instructions a
# logit), with the logit scale, the gates and the natural log-sum-exp scaled into base 2 as they are read. The local
# adjoint (one diagonal tile a chunk, no loop) keeps tl.exp: exp2 there made ptxas spill 532 more bytes a thread.
JIT_LOG2E = tl.constexpr(LOG2E)
JIT_LN2 = tl.constexpr(1 / LOG2E)


@triton.jit
def pair_dot(a, b, PRECISION: tl.constexpr, dtype: tl.constexpr):
    """``a @ b`` with float32 accumulation: ``PRECISION`` "16bit" rounds both operands to ``dtype`` (a 16-bit dtype),
    anything else is ``tl.dot``'s ``input_precision`` (the kernels' carries and products that can take either)."""
    if PRECISION == "16bit":
        return tl.dot(a.to(dtype), b.to(dtype))
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def first_chunk(chunk_offsets, i_n, NC, IS_VARLEN: tl.constexpr):
    """The row of sequence ``i_n``'s first chunk in the per-chunk arrays (``M``), int64: ``chunk_offsets[i_n]``
    for packed sequences, ``i_n * NC`` for a dense batch."""
    if IS_VARLEN:
        return tl.load(chunk_offsets + i_n).to(tl.int64)
    return i_n.to(tl.int64) * NC


@triton.jit
def unit_lower_inverse(b_gram, b_beta, BT: tl.constexpr):
    """``Y = L⁻¹`` with ``L = I + diag(β) strict_tril(G)`` (``b_gram`` = ``W Wᵀ``, ``[BT, BT]``) by forward
    substitution: row ``i`` is ``e_i − β_i Σ_{j<i} G_ij Y_j``, ``BT`` steps on the tile. The UT matrix is
    ``M = Y diag(β)``."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    b_y = tl.where(rows == cols, 1.0, 0.0)
    # The Gram matrix is symmetric, so its column i gives the coefficients indexed along the rows of Y without a
    # transpose.
    for i in range(1, BT):
        b_beta_i = tl.sum(tl.where(tl.arange(0, BT) == i, b_beta, 0.0), 0)
        b_coef = tl.sum(tl.where((cols == i) & (rows < i), b_gram, 0.0), 1) * b_beta_i
        b_row = tl.sum(b_coef[:, None] * b_y, 0)
        b_y = tl.where(rows == i, b_y - b_row[None, :], b_y)
    return b_y


@triton.jit
def ut_solve(b_w, b_beta, BT: tl.constexpr, PRECISION: tl.constexpr):
    """``M = (I + diag(β) strict_tril(W Wᵀ))⁻¹ diag(β)`` of one chunk (``b_w [BT, BK]`` float32, ``b_beta [BT]``):
    :func:`unit_lower_inverse` of the Gram matrix, its columns scaled by ``β``."""
    b_gram = tl.dot(b_w, tl.trans(b_w), input_precision=PRECISION)
    return unit_lower_inverse(b_gram, b_beta, BT) * b_beta[None, :]


@triton.jit
def ut_solve_blocked(
    w, beta, p_m, bos, start, L, i_h, o_k,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, SB: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """:func:`ut_solve` by blocks of ``SB`` rows, written to ``p_m`` (the chunk's ``M``, ``[BT, BT]`` row-major
    from the chunk's tile pointers) and read back as the tile. Block ``I`` of ``L M = diag(β)``
    (``L = I + diag(β) strict_tril(W Wᵀ)``) reads ``M_I = L_II⁻¹ (D_I − β_I ∘ (W_I S_I))`` with
    ``S_I = Σ_{J<I} W_Jᵀ M_J``: the diagonal block's inverse by ``SB`` steps on an ``[SB, SB]`` tile and the rest
    products, instead of ``BT`` steps on the ``[BT, BT]`` tile."""
    r_b = tl.arange(0, SB)[:, None]
    c_b = tl.arange(0, SB)[None, :]
    cols = tl.arange(0, BT)[None, :]
    b_s = tl.zeros([BK, BT], dtype=tl.float32)  # S = Σ_{J<I} W_Jᵀ M_J
    for I in tl.static_range(BT // SB):
        o_r = I * SB + tl.arange(0, SB)  # the block's rows in the chunk
        m_r = start + o_r < L
        p_r = bos + (start + o_r).to(tl.int64)
        m_rk = m_r[:, None] & (o_k < K)[None, :]
        b_wi = tl.load(w + p_r[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
        b_bi = tl.load(beta + p_r * H + i_h, mask=m_r, other=0.0).to(tl.float32)
        b_g = tl.dot(b_wi, tl.trans(b_wi), input_precision=PRECISION)
        b_li = tl.where(r_b == c_b, 1.0, 0.0)  # L_II⁻¹, row by row: e_i − β_i Σ_{c<i} G_ic L_II⁻¹[c]
        for i in range(1, SB):
            b_beta_i = tl.sum(tl.where(tl.arange(0, SB) == i, b_bi, 0.0), 0)
            b_coef = tl.sum(tl.where((c_b == i) & (r_b < i), b_g, 0.0), 1) * b_beta_i
            b_row = tl.sum(b_coef[:, None] * b_li, 0)
            b_li = tl.where(r_b == i, b_li - b_row[None, :], b_li)
        b_rhs = tl.where(o_r[:, None] == cols, b_bi[:, None], 0.0)
        b_rhs -= b_bi[:, None] * tl.dot(b_wi, b_s, input_precision=PRECISION)
        b_mi = tl.dot(b_li, b_rhs, input_precision=PRECISION)
        tl.store(p_m + I * SB * BT + r_b * BT + cols, b_mi)
        b_s += tl.dot(tl.trans(b_wi), b_mi, input_precision=PRECISION)
    tl.debug_barrier()
    rows = tl.arange(0, BT)[:, None]
    return tl.load(p_m + rows * BT + cols)


@triton.jit
def ut_solve_batched(
    w, beta, bos, start, L, i_h, o_k,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, SB: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``Y = L⁻¹``, ``L = I + diag(β) strict_tril(W Wᵀ)`` of the chunk starting at ``start``, in registers
    (:func:`~attnkit.ops.common.triton.tril_inverse.tril_inverse` with ``K = diag(β) W``, ``A = W``): every
    ``SB``-row diagonal block's inverse at once (``SB − 1`` dependent steps, where :func:`ut_solve_blocked` takes
    ``SB`` a block, one block after another), then a ``[BT, BT]`` product a block row; no round trip through
    ``M`` in memory. The UT matrix is ``M = Y diag(β)``."""
    o_r = start + tl.arange(0, BT // SB)[:, None, None] * SB + tl.arange(0, SB)[None, :, None]  # [NB, SB, 1]
    m_r = o_r < L
    p_r = bos + o_r.to(tl.int64)
    b_w3 = tl.load(w + p_r * (H * K) + i_h * K + o_k[None, None, :], mask=m_r & (o_k < K)[None, None, :], other=0.0)
    b_w3 = b_w3.to(tl.float32)
    b_beta3 = tl.load(beta + p_r * H + i_h, mask=m_r, other=0.0).to(tl.float32)
    return tril_inverse(b_beta3 * b_w3, b_w3, BT, SB, BK, PRECISION)


@triton.jit
def path_prepare_kernel(
    k, w, beta, m_out, kt_out, mw_out, cu_seqlens, chunk_offsets, T, NC,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr, WRITE_MW: tl.constexpr, SB: tl.constexpr = 1 << 20, BATCHED: tl.constexpr = False,
):  # fmt: skip
    """``k, w [*, H, K]``, ``beta [*, H]`` (``*`` the packed tokens) -> ``m_out [chunks, H, BT, BT]`` float32
    and ``kt_out [*, H, K]``. Grid ``(chunks of the longest sequence, N * H)``; chunk ``c`` of sequence ``n``
    is row ``chunk_offsets[n] + c`` of ``m_out`` (``n * NC + c`` for a dense batch). With ``WRITE_MW`` also
    ``mw_out [*, H, K]`` float32, ``M W`` of each chunk (the carry across it is then ``x − (x Wᵀ)(M W)``). ``SB``
    below ``BT``: the UT solve by blocks of ``SB`` rows (:func:`ut_solve_blocked`, or with ``BATCHED``
    :func:`ut_solve_batched`), else row by row."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    start = i_c * BT
    if start >= L:
        return
    i_chunk = first_chunk(chunk_offsets, i_n, NC, IS_VARLEN) + i_c
    o_t = start + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_t = o_t < L
    p_t = bos + o_t.to(tl.int64)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    # Padding rows load w = 0, beta = 0: identity transitions that leave M and the real keys unchanged.
    b_w = tl.load(w + p_t[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_k = tl.load(k + p_t[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0)
    b_beta = tl.load(beta + p_t * H + i_h, mask=m_t, other=0.0).to(tl.float32)

    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    p_m = m_out + (i_chunk * H + i_h) * (BT * BT)
    if SB < BT and BATCHED:
        b_m = ut_solve_batched(w, beta, bos, start, L, i_h, o_k, H, K, BK, BT, SB, PRECISION) * b_beta[None, :]
        tl.store(p_m + rows * BT + cols, b_m)
    elif SB < BT:
        b_m = ut_solve_blocked(w, beta, p_m, bos, start, L, i_h, o_k, H, K, BK, BT, SB, PRECISION)
    else:
        b_m = ut_solve(b_w, b_beta, BT, PRECISION)
        tl.store(p_m + rows * BT + cols, b_m)
    if WRITE_MW:
        b_mw = tl.dot(b_m, b_w, input_precision=PRECISION)
        tl.store(mw_out + p_t[:, None] * (H * K) + i_h * K + o_k[None, :], b_mw, mask=m_tk)

    b_wk = tl.dot(b_w, tl.trans(b_k.to(tl.float32)), input_precision=PRECISION)  # (w_s · k_j)
    b_z = tl.dot(b_m, tl.where(rows > cols, b_wk, 0.0), input_precision=PRECISION)
    b_kt = b_k.to(tl.float32) - tl.dot(tl.trans(b_z), b_w, input_precision=PRECISION)
    tl.store(kt_out + p_t[:, None] * (H * K) + i_h * K + o_k[None, :], b_kt.to(kt_out.dtype.element_ty), mask=m_tk)


def chunk_size(K: int) -> int:
    """Positions per chunk: 64 on the GPU (the UT solve is ``BT`` steps), 16 above K = 128 (compiled for sm_90a with
    Triton 3.6 at K = 256, four warps: the prepare kernel needs 256 KB of shared memory with 64 positions, over the
    227 KB a block may have, and 18 KB with 16; the forward 32 KB) and under the interpreter."""
    return 16 if interpreting() or K > 128 else 64


def launch_config() -> dict[str, int]:
    """Warps and stages of the prepare and forward kernels (and of the carried-key pass). Not tuned yet
    (``benchmarks/path_tune.py``). Compiled for sm_90a with Triton 3.6 they fit shared memory at K = 128 only
    without software pipelining, and spill registers (the float32 carried query and its 3xTF32 dots). Four warps:
    on the H200 (Triton 3.6), eight gave illegal memory accesses and wrong outputs for float16 at K = 16/32 (the
    float32 and the bf16 K = 64/128 cases were right); four pass every GPU test that ran."""
    return dict(num_warps=1, num_stages=1) if interpreting() else dict(num_warps=4, num_stages=1)


def superblock_chunks(K: int, chunk: int) -> int:
    """Chunks per superblock, ``R``: the kernels carry a query across a whole earlier superblock with one dense
    ``K × K`` product (its transitions' product ``Σ``) and meet its keys carried to the superblock's end, so
    between superblocks a chunk pair costs what FlashAttention's does; the chunk-by-chunk carries stay inside a
    superblock. 512 positions on the GPU (FLA's backward uses the same span), 2 chunks under the interpreter (so
    that tests cross several), and no superblocks (a span longer than any sequence) above K = 128, where ``Σ``
    (256 KB of float32 at K = 256) outgrows a program's registers and shared memory."""
    if block_dim(K) > 128:
        return NO_SUPERBLOCKS
    return 2 if interpreting() else max(1, SUPERBLOCK // chunk)


SUPERBLOCK = 512  # the superblocks' span in positions on the GPU (benchmarks/path_tune.py --span-only times others)


NO_SUPERBLOCKS = 1 << 30  # a span no sequence reaches: every chunk pair is carried chunk by chunk


SOLVE_ROWS: int | None = 16  # rows per block of the prepare kernel's UT solve; None: row by row


# The UT solve's diagonal blocks all at once (ut_solve_batched, the delta rule's blocked inverse) instead of one after
# another (ut_solve_blocked, SOLVE_ROWS at a time). On the H200 (fifteenth session, T = 4096, bf16) it took the forward
# from 3.53 to 3.30 ms at D = 64 and from 3.48 to 3.14 at D = 128, forward+backward from 17.36 to 16.90 and from 37.22
# to 36.75 ms (path_solve_session15_h200.json): the default. False solves block after block; None takes the batched
# solve under the interpreter only (the tests run both).
SOLVE_BATCHED: bool | None = True


def solve_batched() -> bool:
    """``BATCHED`` of :func:`path_prepare_kernel` (:data:`SOLVE_BATCHED`; None: under the interpreter)."""
    return interpreting() if SOLVE_BATCHED is None else SOLVE_BATCHED


def solve_rows(chunk: int) -> int:
    """``SB`` of :func:`path_prepare_kernel`: ``SOLVE_ROWS`` where it is set and smaller than the chunk (the solve
    by blocks, :func:`ut_solve_batched` or with ``SOLVE_BATCHED`` False :func:`ut_solve_blocked`; 16 rows blocked:
    1.2× faster forward than row by row on the H200, ``path_tune.py --solve-only``), else the chunk (row by row)."""
    return chunk if SOLVE_ROWS is None else min(SOLVE_ROWS, chunk)


CARRY_16BIT = "bf16x3"  # the carries' precision for bfloat16 inputs (benchmarks/path_tune.py --carry-only times others)


# The dots' precisions for float32 inputs on a GPU, ``(products, carries)``: 3xTF32 (three TF32 passes of a hi/lo
# split, on the tensor cores). Exact "ieee", the default before the twenty-fourth session, Triton emits as unrolled
# FMAs: no tensor-core instruction in the PTX, and at K = 64 a local adjoint that took 442 s to compile for sm_90a on a
# 2-core host and spilled 222 KB a thread (44 s and 8.8 KB in 3xTF32; Triton 3.6). On an H100 (T = 4k, D = 64, 32768
# tokens, PaTH-FoX) forward+backward in 3xTF32 took 73.6 ms (bf16: 15.3) and stayed 2.0e-5 from the PyTorch backend in
# float32 (o 1.2e-5 from float64, as the PyTorch backend's own), 1.6e-4 at 32k; the exact kernels did not compile and
# time within 239 s; the products in one TF32 pass ("tf32", 37.4 ms) were 5.2e-3 off, over float32's 1e-3 bar
# (benchmarks/results/path_float32_session24_h100.log). At a padded K or V of at most 128: on 64-row tiles 3xTF32 wanted
# more shared memory than the 227 KB a Hopper block may have in the sweep's path_bwd_super_kv_kernel at K = 128 (352
# KB) and at K = 64 with V = 128 (256 KB), so float32 inputs there take 32-row tiles in the sweep (192 KB;
# backward_super.launch_config); exact products there did not compile within 150 s on an H100 (thirtieth session).
# Above 128 exact. The dots need 16 rows: chunks of at least 16 positions, as every GPU launcher picks. The
# interpreter stays exact. `path_tune.py --local-only --dtype float32` times the settings.
FLOAT32_PRECISIONS: tuple[str, str] = ("tf32x3", "tf32x3")


def precisions(dtype: torch.dtype, key_dim: int, value_dim: int = 0) -> tuple[str, str]:
    """``input_precision`` of the PaTH kernels' dots for inputs of ``dtype`` and head dims ``key_dim``, ``value_dim``
    (0 for a kernel without value tiles): ``(products, carries)``. The attention products run in the inputs'
    precision (one TF32 pass for float32 operands holding 16-bit values); the carries and the UT solve of bfloat16
    inputs at ``K`` of 64 and 128 use ``CARRY_16BIT`` (three bf16 passes of a hi/lo split: 3e-4 from 3×TF32 at
    T = 32k with ``beta ∈ (1.5, 2)`` on the H200, 1.3× faster forward+backward); other 16-bit inputs 3×TF32: with
    three bf16 passes a float16 forward at T = 70, K = 32 (two chunks, the first case that carries) missed by 0.21
    on the H200, its cause not yet found, and the bf16 passes have been measured at K = 64 and 128 only. Float32
    inputs take ``FLOAT32_PRECISIONS`` on a GPU at padded ``K`` and ``V`` of at most 128 (the sweep between
    superblocks then takes 32-row tiles where either is above 64, ``backward_super.launch_config``), else exact
    ``ieee``: exact products compile to unrolled FMAs, which at K = 128 took ptxas over 150 s for the forward on an
    H100 and spilled 85 KB a thread in the prepare kernel (thirtieth session). The interpreter, which has no TF32,
    takes ``ieee`` for float32 inputs and carries."""
    if dtype == torch.float32:
        exact = interpreting() or block_dim(key_dim) > 128 or (value_dim > 0 and block_dim(value_dim) > 128)
        return ("ieee", "ieee") if exact else FLOAT32_PRECISIONS
    carry = CARRY_16BIT if dtype == torch.bfloat16 and block_dim(key_dim) in (64, 128) else "tf32x3"
    return "tf32", ("ieee" if interpreting() else carry)


# The backward's carries inside a superblock (at most SUPERBLOCK positions, so their rounding does not accumulate over
# T as the carries between superblocks' does): the queries carried to their superblock's start, the chunk-by-chunk
# kernels and the superblock-local adjoint. None: as every other carry (precisions); "tf32" one TF32 pass, where
# measured_16bit. With backward.INNER_LOW_GRAD, PaTH-FoX forward+backward went from 20.13 to 19.0 ms on the H200 (T =
# 4k, D = 64, 32768 tokens) and the largest error from the PyTorch backend (beta in (1.5, 2), unit float32 w) from
# 4.6e-3 to 4.7e-3 (benchmarks/results/path_h200.md, ninth session).
INNER_CARRY_16BIT: str | None = "tf32"
# The (padded) key dims at which the backward's 16-bit settings (this, backward.INNER_LOW_GRAD, local.LOCAL_GRADS_16BIT)
# were measured for bfloat16 inputs on the H200. Applied at K = 16 and 32 too, bf16 backwards hit an illegal memory
# access there in the local adjoint (Triton 3.6, ninth session). At K = 128 (twelfth session, PaTH-FoX, T = 4k,
# 32768 tokens) they took forward+backward from 59.05 to 40.13 ms with float32 w, beta and g as the layers pass them
# (41.67 to 36.67 with every input bf16), the largest gradient error from the PyTorch backend (beta in (1.5, 2), unit
# float32 w) from 3.6e-3 to 4.5e-3 (benchmarks/results/path_h200.md).
MEASURED_DIMS = (64, 128)


def measured_16bit(dtype: torch.dtype, key_dim: int) -> bool:
    """Whether the backward's 16-bit settings apply: bfloat16 inputs at a padded key dim in ``MEASURED_DIMS``, on a
    GPU (the interpreter's bf16 dot is wrong)."""
    return dtype == torch.bfloat16 and block_dim(key_dim) in MEASURED_DIMS and not interpreting()


# The dtype of the backward's per-token working copies of carried vectors: the keys at their chunk's end K̃ (the
# prepare kernel's, or the forward's kept for the backward), the queries at their chunk's start x and the keys at
# their superblock's end k̂. False: float32. True: float16 for 16-bit inputs (float32 ones keep float32); None: where
# measured_16bit. Every reader loads them into float32 registers, so the products keep their precisions and only the
# stored values round. Float16, not bfloat16: its 10-bit mantissa, and these vectors are bounded by the inputs'
# (each transition I − β w wᵀ, β in [0, 2], unit w, is a contraction), far inside float16's range. The chunks' M W
# stays float32: it meets cancellation in A = I − Wᵀ (M W) for nearly parallel w. Measured under the interpreter
# (float32 inputs, exact products, beta in (1.9, 2), K = 16, T = 1300, superblocks of 3 chunks; float64 PyTorch
# backend): the largest gradient error went from 5.5e-6 to 2.5e-4 with float16 copies, to 7.1e-3 with bfloat16 ones,
# and to 9.9e-3 with bfloat16 M W as well, against a 1e-2 bar. At T = 32k, D = 64, PaTH-FoX it takes the backward's
# peak from 25.4 to 23.4 bf16 [B, T, H·D] tensors (benchmarks/path_memory.py). The forward that keeps K̃ for the
# backward then reads it for its logits rounded twice (float16, then the inputs' dtype), so its output may differ in
# the last bit from a forward without gradients. On the H200 at T = 4k (PaTH-FoX, bf16, 32768 tokens; path_tune.py's
# LOCAL row "16-bit working buffers") forward+backward took 14.72 ms against 14.85 at D = 64 (peak 1820 MiB against
# 1948) and 34.13 against 35.57 at D = 128 (1766 against 1894), every error from the PyTorch backend unchanged
# (path_local_session20_h200_d{64,128}.json): None, the default.
BUFFERS_16BIT: bool | None = None


def applies_16bit(option: bool | None, dtype: torch.dtype, key_dim: int) -> bool:
    """Whether a 16-bit option (True, False, or None: where :func:`measured_16bit`) applies to inputs of ``dtype`` at
    ``key_dim``: never to float32 inputs."""
    if option is None:
        return measured_16bit(dtype, key_dim)
    return option and dtype in (torch.bfloat16, torch.float16)


def buffer_dtype(dtype: torch.dtype, key_dim: int) -> torch.dtype:
    """The dtype the backward's ``K̃``, ``x`` and ``k̂`` are stored in for inputs of ``dtype`` (:data:`BUFFERS_16BIT`)."""
    return torch.float16 if applies_16bit(BUFFERS_16BIT, dtype, key_dim) else torch.float32


def inner_carry(dtype: torch.dtype, key_dim: int) -> str:
    """``input_precision`` of the backward's carries inside superblocks (``INNER_CARRY_16BIT`` where
    :func:`measured_16bit`, else the carries' own)."""
    carry = precisions(dtype, key_dim)[1]
    return INNER_CARRY_16BIT if INNER_CARRY_16BIT and measured_16bit(dtype, key_dim) else carry


def chunk_offsets(cu_seqlens: torch.Tensor | None, chunk: int) -> torch.Tensor | None:
    """The first chunk of each packed sequence cut into chunks of ``chunk`` positions, ``[N+1]`` int32 (the last
    entry the total), computed on the device (no host sync); None without ``cu_seqlens``."""
    return None if cu_seqlens is None else block_offsets(cu_seqlens, chunk)


def chunk_offsets_of(cu_seqlens: torch.Tensor | None, chunk: int) -> tuple[torch.Tensor | None, int]:
    """``(offsets [N+1] int32, total chunks)`` of packed sequences cut into chunks of ``chunk`` positions (the
    total reads the device: a host sync)."""
    offsets = chunk_offsets(cu_seqlens, chunk)
    return offsets, 0 if offsets is None else int(offsets[-1].item())
