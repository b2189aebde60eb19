"""PaTH backward: the gradients of the logits between chunks, with O(T) memory.

They take the chunk-local terms (the UT matrices ``M``, the keys carried to their chunk's end ``K̃``, the queries
carried to their chunk's start ``x``) from the prepare and query-terms kernels and give the gradients of what lies
between chunks; ``local.py`` takes those back through the chunk-local terms. With
``A_m = I − W_mᵀ M_m W_m`` the carry across chunk ``m``, query chunk ``c`` meets key chunk ``m < c`` with the
logits ``S_cm = scale · L_{c,m} K̃_mᵀ`` where ``L_{c,m} = x_c A_{c−1} ··· A_{m+1}`` (``README.md`` beside the op):

- ``path_bwd_q_kernel``, one program per (query chunk ``c``, query head), runs the carried query right to left
  once, checkpointing ``L_{c,m}`` at the right end of every segment of ``⌈√c⌉`` key chunks, then walks the
  segments left to right: each segment's ``L`` recomputed from its checkpoint into scratch, then the gradient
  ``Γ`` of the carried query (``Γ ← Γ A_mᵀ + scale · dS_cm K̃_m``): ``dA_m += L_{c,m}ᵀ Γ`` by atomic adds, either
  as itself (:func:`sums_carry_gradient`; the local adjoint takes it back through ``A_m − I = −W_mᵀ M_m W_m``) or as
  ``dM_m = −Uᵀ V`` and ``dW_m = −(M_m Vᵀ L + M_mᵀ Uᵀ Γ)`` (``U = L W_mᵀ``, ``V = Γ W_mᵀ``), and ``dx_c = Γ`` at the
  end. Scratch: ``2√N`` tiles a program, for one extra pass of carries; the launcher runs
  the query chunks in waves that fit a fixed budget (linear in ``T`` however long the sequence). Inside
  superblocks (:data:`INNER_RECOMPUTE`) it recomputes each ``L_{c,m}`` from ``x_c`` in registers instead, in one
  launch without scratch. Up to K = 128 it also adds the key chunk's side of each pair (``dK̃_m``, ``dV_m``, the
  gates' key side) by float32 atomics, so that each pair's logits and ``dS`` are computed once (FLA 0.6.0's
  in-superblock backward is one such kernel).
- ``path_bwd_kv_tile_kernel`` takes the key side above K = 128 (:func:`carries_key_tile`), one program per (key
  chunk ``m``, key/value head) for the query heads of its group: it carries the key chunk ``y = K̃_m Πᵀ``
  (``Π = A_{c−1} ··· A_{m+1}``, whose ``K × K`` float32 would outgrow shared memory) to the right, checkpointed and
  walked back with its gradient as the query kernel does with ``L``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_seq import seq_bounds
from attnkit.ops.common.triton_utils import block_dim, interpreting
from attnkit.ops.path.triton.prepare import JIT_LOG2E, chunk_offsets, first_chunk, pair_dot, precisions

SCRATCH_BYTES = 1 << 28  # the query kernel's carried-query slots, per wave of query chunks
# The kernels between chunks inside superblocks take their logits' and gradients' products (x yᵀ, dSᵀ x, dS K̃) on
# operands rounded to the inputs' 16-bit dtype, as the sweep between superblocks does and as the forward rounds its
# logits (path_fwd_fn: x and K̃ in the keys' dtype); False: float32 operands in the products' precision (one TF32 pass);
# None: True where prepare.measured_16bit. On the H200 (T = 4k, D = 64, PaTH-FoX, 32768 tokens): 20.13 -> 19.40 ms
# forward+backward alone, 19.0 with prepare.INNER_CARRY_16BIT (benchmarks/results/path_h200.md, ninth session).
INNER_LOW_GRAD: bool | None = None
# Key chunks per checkpoint segment of the query kernel inside superblocks (None: checkpoint_every's rule, 3 for the
# 8 chunks of a superblock at K = 64). 1 keeps every carried query (9 scratch tiles a program instead of 6) and
# recomputes none: ~2 carries a chunk pair instead of ~2.7. Timed on the H200 (T = 4k, D = 64): 20.06 ms against the
# default's 20.13, within noise, so the default keeps the smaller scratch.
INNER_EVERY: int | None = None
# num_stages of the kernels between chunks (software pipelining of their loops' loads): 1 since they were written;
# FLA's inner kernel runs Triton's default, 3. The query kernel with the key side takes 104 KB of shared memory at
# 2 stages (K = 64) and 92 KB (K = 128); path_tune.py's LOCAL rows time 2 and 3: slower on the H200 (sixteenth
# session, D = 64, 4k, fwd+bwd: 17.34 ms on 2 stages against 16.86 at 1).
INNER_STAGES = 1
# The query kernel inside superblocks recomputes each pair's carried query L_{c,m} from x_c in registers (c − 1 − m
# carries, the order of FLA 0.6.0's parallel_path_bwd_intra_chunk_kernel) instead of checkpointing carried queries in
# float32 scratch: one launch, no scratch and no waves, for about as many carries as the checkpoints' two passes at 8
# chunks a superblock (c(c−1)/2 against about 2c for query chunk c). Only where the longest sequence the kernels take
# has at most RECOMPUTE_MAX_CHUNKS chunks (superblocks: 8 chunks at K = 64, 16 at K = 128): the carries grow as the
# square of the chunks, so without superblocks (K > 128, prepare.NO_SUPERBLOCKS) the checkpoints stay. The profile that
# asked for it (H200, PaTH, D = 64, T = 4k, B = 8, eighteenth session): the checkpointed query kernel 2.44 ms over 4
# waves, FLA's in-superblock kernel 1.11 ms on the same pairs. Timed there (PaTH-FoX fwd+bwd, path_tune.py's LOCAL
# rows): 16.17 ms checkpointed, 15.73 recomputed, 14.86 with INNER_CARRY_LOW; at D = 128 37.50 -> 35.20; the errors
# from the PyTorch backend unchanged (benchmarks/results/path_h200.md, eighteenth session).
INNER_RECOMPUTE = True
RECOMPUTE_MAX_CHUNKS = 16
# With INNER_RECOMPUTE and 16-bit products (INNER_LOW_GRAD): the carries of the query kernel inside superblocks (the
# carried query's, and its gradient's where the kernel sums dA_m, sums_carry_gradient) on operands rounded to dO's
# dtype, one 16-bit pass with float32 accumulation as FLA's kernel carries them, instead of prepare.inner_carry's
# precision (one TF32 pass) on float32 operands. The carried query and its gradient stay float32 between carries, and
# no carry chain is longer than a superblock's. Measured with INNER_RECOMPUTE above: -0.87 ms at D = 64, the largest
# error from the PyTorch backend 4.7e-3 either way.
INNER_CARRY_LOW = True


def checkpoint_every(chunks: int) -> int:
    """Key chunks per segment of the query kernel's checkpoints: ``⌈√chunks⌉`` balances the checkpoints
    (``chunks / every`` tiles) against one segment's tiles (``every``), for one extra carry pass."""
    return math.isqrt(max(chunks, 1) - 1) + 1


def sums_carry_gradient(key_dim: int, chunk: int) -> bool:
    """Whether the query kernel sums each chunk's carry gradient ``dA_m`` (``BK × BK``: one product and ``BK²``
    atomic adds a chunk pair), which the local adjoint then takes back through ``A = I − Wᵀ M W``, rather than its
    projections ``dM_m``, ``dW_m`` (seven products, ``C² + C·K`` atomics): when ``BK <= chunk``, where it is the
    cheaper."""
    return block_dim(key_dim) <= chunk


def carries_key_tile(key_dim: int) -> bool:
    """Whether the key side runs :func:`path_bwd_kv_tile_kernel` (the key chunk carried, checkpointed): above
    K = 128; up to it the query kernel adds the key side by atomics (built and timed there)."""
    return block_dim(key_dim) > 128


def backward_config(key_dim: int) -> tuple[int, int]:
    """``(chunk, warps)`` of the backward kernels, whose chunking is independent of the forward's (they recompute
    the chunk-local terms, and the log-sum-exp does not depend on it). The chunks were chosen when a key-major
    kernel took the key side up to K = 128: compiled for sm_90a with Triton 3.6, its shared memory was 112 KB at
    ``K = 64`` with 64-position chunks, but 288 KB (over the 227 KB an H200 block may have) at ``K = 128``; with
    32-position chunks 208 KB there. Four warps at ``K <= 64``, eight at K = 128 (half the spills); above K = 128
    (the key-tile kernel) 16 positions and eight warps (at K = 256: spills of 15 KB a thread in the query kernel,
    0.8 KB in the key-tile kernel, against 22 and 1.5 with four). Timed on an H200 at K = 64 and 128 only
    (``benchmarks/results/path_h200.md``). Under the interpreter: 16 positions, one warp."""
    if interpreting():
        return 16, 1
    if key_dim > 128:
        return 16, 8
    return (64, 4) if key_dim <= 64 else (32, 8)


@triton.jit
def base2_logits(b_s, scale, b_lse, b_gq, b_gk, USE_G: tl.constexpr):
    """``log2(e) · (scale · b_s + G_i − G_j − lse_i)`` for the raw products ``b_s`` of a query tile (rows: the natural
    ``b_lse`` and, with gates, the cumulative gates ``b_gq``) and a key tile (``b_gk``): the argument of ``exp2`` that
    gives ``P``. The row terms are scaled once a row, so that a logit costs one FMA into ``exp2`` (and, with gates, a
    second FMA, into which ptxas folds the key gates' scaling)."""
    if USE_G:
        b_row = (b_lse - b_gq) * JIT_LOG2E
        return b_s * (scale * JIT_LOG2E) - b_row[:, None] - (b_gk * JIT_LOG2E)[None, :]
    return b_s * (scale * JIT_LOG2E) - (b_lse * JIT_LOG2E)[:, None]


@triton.jit
def key_chunk_grads(
    x, do, lse, delta, gcum, dgcum, dx, b_y, b_v, b_dv, b_dg, bos, L, i_c, p_m, i_h, scale, o_t, o_k, o_v, o_g, m_k,
    m_v, HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    USE_G: tl.constexpr, PRECISION: tl.constexpr, LOW_GRAD: tl.constexpr = False, ADD_DX: tl.constexpr = False,
):  # fmt: skip
    """Query chunk ``i_c`` of every query head of key head ``i_h``'s group against key chunk ``m`` carried to it
    (``b_y``; values ``b_v``, rows ``p_m``), with ``P = exp(S − lse)`` and ``dS = P (dO Vᵀ − Δ)``: returns
    ``(Σ_heads dSᵀ x, b_dv + Σ Pᵀ dO, b_dg − colsum(dS) per head)``, and with gates the query rows' side
    ``rowsum(dS)`` added to ``dgcum [*, HQ]`` (atomic adds: every key-major program meets these rows). With
    ``LOW_GRAD`` every product takes its operands in ``dO``'s dtype: ``dSᵀ x`` and ``dS y`` as FlashAttention rounds
    its gradient products, and the logits ``x yᵀ`` as the forward's between superblocks (queries and keys carried in
    float32, rounded for the product); else they run in ``PRECISION``. With ``ADD_DX`` the queries' gradient
    ``scale · dS y`` is added to ``dx [*, HQ, K]`` float32 by atomic adds (FlashAttention-2's ``dQ``; ``dx`` unused
    otherwise).

    The gate's two sides come from the same ``dS``: a query's row sum is zero only for the exact ``Δ = Σ_j P dP``,
    and ``Δ = dO · O`` from the rounded output is off by ``dO · (O − round(O))`` a row. Kept from one tile, that
    error cancels between the row and the columns, so the suffix sums that turn ``dG`` into ``dg`` meet only the
    pairs across each cut, as autograd's do; the columns alone took it into every suffix (``dg`` 1.3e-1 from the
    PyTorch backend at T = 32k in bf16 on the H200, against 2.7e-3 for the other gradients)."""
    G: tl.constexpr = HQ // H
    o_i = i_c * BT + o_t
    m_i = o_i < L
    p_i = bos + o_i.to(tl.int64)
    b_dy = tl.zeros([BT, BK], dtype=tl.float32)
    for j in tl.static_range(G):
        i_hq = i_h * G + j
        b_x = tl.load(x + p_i[:, None] * (HQ * K) + i_hq * K + o_k[None, :], mask=m_i[:, None] & m_k, other=0.0)
        b_x = b_x.to(tl.float32)
        b_do = tl.load(do + p_i[:, None] * (HQ * V) + i_hq * V + o_v[None, :], mask=m_i[:, None] & m_v, other=0.0)
        b_lse = tl.load(lse + p_i * HQ + i_hq, mask=m_i, other=0.0)
        b_delta = tl.load(delta + p_i * HQ + i_hq, mask=m_i, other=0.0)
        if USE_G:  # read with the other operands (unpipelined kernels: a load at its first use waits for itself)
            b_gq = tl.load(gcum + p_i * HQ + i_hq, mask=m_i, other=0.0)
            b_gk = tl.load(gcum + p_m * HQ + i_hq)
        else:  # unused
            b_gq, b_gk = b_lse, b_lse
        if LOW_GRAD:
            b_s = tl.dot(b_x.to(b_do.dtype), tl.trans(b_y.to(b_do.dtype)), input_precision=PRECISION)
        else:
            b_s = tl.dot(b_x, tl.trans(b_y), input_precision=PRECISION)
        b_p = tl.where(m_i[:, None], tl.exp2(base2_logits(b_s, scale, b_lse, b_gq, b_gk, USE_G)), 0.0)
        b_ds = b_p * (tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION) - b_delta[:, None])
        b_dv += tl.dot(tl.trans(b_p).to(b_do.dtype), b_do, input_precision=PRECISION)
        if LOW_GRAD:
            b_dy += tl.dot(tl.trans(b_ds).to(b_do.dtype), b_x.to(b_do.dtype), input_precision=PRECISION)
        else:
            b_dy += tl.dot(tl.trans(b_ds), b_x, input_precision=PRECISION)
        if ADD_DX:
            if LOW_GRAD:
                b_dx = tl.dot(b_ds.to(b_do.dtype), b_y.to(b_do.dtype), input_precision=PRECISION)
            else:
                b_dx = tl.dot(b_ds, b_y, input_precision=PRECISION)
            p_dx = dx + p_i[:, None] * (HQ * K) + i_hq * K + o_k[None, :]
            tl.atomic_add(p_dx, b_dx * scale, mask=m_i[:, None] & m_k, sem="relaxed")
        if USE_G:  # without gates no sums: a column sum is a reduction across the warps every query tile
            tl.atomic_add(dgcum + p_i * HQ + i_hq, tl.sum(b_ds, 1), mask=m_i, sem="relaxed")
            b_dg -= tl.where(o_g[:, None] == j, tl.sum(b_ds, 0)[None, :], 0.0)
    return b_dy, b_dv, b_dg


@triton.jit
def load_key_chunk(
    k, v, bos, i_m, i_h, o_t, o_k, o_v, m_k, m_v,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    BG: tl.constexpr,
):  # fmt: skip
    """A key-major program's start for its key chunk ``i_m`` (complete: every row real): its rows ``p_m``, keys
    (from ``k [*, H, K]``) and values, and zeroed gradients of the keys, the values and (row ``j`` for query head
    ``i_h · G + j``) the gates' key side, as :func:`store_key_chunk_grads` takes them."""
    p_m = bos + (i_m * BT + o_t).to(tl.int64)
    b_k = tl.load(k + p_m[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + p_m[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_v, other=0.0)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    b_dg = tl.zeros([BG, BT], dtype=tl.float32)
    return p_m, b_k, b_v, b_dk, b_dv, b_dg


@triton.jit
def store_key_chunk_grads(
    dk, dv, dgcum, b_dk, b_dv, b_dg, p_m, i_h, o_k, o_v, o_g, m_k, m_v,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, USE_G: tl.constexpr,
    FRESH: tl.constexpr = False,
):  # fmt: skip
    """A key-major program's results for its key chunk (rows ``p_m``, key/value head ``i_h``): the keys' and values'
    gradients, added to what earlier launches left there (the program owns these rows in its own launch), or stored
    where the launch is their first writer (``FRESH``), and, per query head of the group (rows of ``b_dg``), the
    gates' key side (added: other programs add the same rows' query side)."""
    G: tl.constexpr = HQ // H
    p_dk = dk + p_m[:, None] * (H * K) + i_h * K + o_k[None, :]
    p_dv = dv + p_m[:, None] * (H * V) + i_h * V + o_v[None, :]
    if FRESH:
        tl.store(p_dk, b_dk, mask=m_k)
        tl.store(p_dv, b_dv, mask=m_v)
    else:
        tl.store(p_dk, tl.load(p_dk, mask=m_k, other=0.0) + b_dk, mask=m_k)
        tl.store(p_dv, tl.load(p_dv, mask=m_v, other=0.0) + b_dv, mask=m_v)
    if USE_G:
        tl.atomic_add(dgcum + p_m[None, :] * HQ + i_h * G + o_g[:, None], b_dg, mask=(o_g < G)[:, None], sem="relaxed")


@triton.jit
def path_bwd_kv_tile_kernel(
    x, kt, v, w, mw, gcum, do, lse, delta, dkt, dv, dgcum, scratch, cu_seqlens, T, m_base, EVERY, SLOTS, scale,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, BG: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    CARRY_PRECISION: tl.constexpr, LOW_GRAD: tl.constexpr = False,
):  # fmt: skip
    """Inputs as :func:`path_bwd_q_kernel`'s (``m`` aside) -> ``dkt [*, H, K]``, ``dv [*, H, V]``, ``dgcum [*, HQ]``
    float32 (both sides of the pairs with later chunks, added to; zero-initialised), the key side above K = 128
    (:func:`carries_key_tile`). A program takes a key chunk and every query head of its group (``BG``: the group size
    rounded up to a power of two) and carries its key chunk ``y = K̃_m Πᵀ`` (``BT × BK``) to the right,
    ``y ← y A_cᵀ = y − (y (M_c W_c)ᵀ) W_c``, checkpointing it at the start of every segment of ``EVERY`` query
    chunks, then walks the segments right to left, each recomputed from its checkpoint into scratch, with the
    gradient ``Γ`` of ``y`` (``Γ ← Γ A_c + scale · Σ_heads dS_cmᵀ x_c``): ``dK̃_m = Γ`` at ``c = m + 1``. Grid
    ``(key chunks of this wave, N * H)``; program ``(j, ·)`` takes key chunk ``m_base + j`` and ``SLOTS`` scratch
    tiles of ``[BT, BK]`` float32, as :func:`path_bwd_q_kernel` does for its query chunk."""
    i_j, i_nh = tl.program_id(0), tl.program_id(1)
    i_m = m_base + i_j
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    n_steps = tl.cdiv(L, BT) - 1 - i_m  # query chunks after key chunk m
    if n_steps <= 0:
        return
    o_t = tl.arange(0, BT)
    o_k, o_v, o_g = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BG)
    m_k, m_v = (o_k < K)[None, :], (o_v < V)[None, :]
    p_slot = scratch + ((i_j * tl.num_programs(1) + i_nh).to(tl.int64) * SLOTS) * (BT * BK)
    p_slot += o_t[:, None] * BK + o_k[None, :]
    p_seg = p_slot + (SLOTS - EVERY) * (BT * BK)  # the segment's tiles follow the checkpoints

    p_m = bos + (i_m * BT + o_t).to(tl.int64)
    b_y = tl.load(kt + p_m[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + p_m[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_v, other=0.0)
    # Left to right: y at query chunk m + 1 + s; checkpoint it at each segment's start. Chunks crossed here are
    # never a sequence's last, so their rows are all real.
    for s in range(0, n_steps):
        if s % EVERY == 0:
            tl.store(p_slot + (s // EVERY) * (BT * BK), b_y)
        if s + 1 < n_steps:
            b_y = carry_across(b_y, w, mw, bos, i_m + 1 + s, i_h, o_t, o_k, m_k, H, K, BT, CARRY_PRECISION, True)
    tl.debug_barrier()

    b_gam = tl.zeros([BT, BK], dtype=tl.float32)
    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    b_dg = tl.zeros([BG, BT], dtype=tl.float32)  # row j: query head i_h * G + j
    n_seg = tl.cdiv(n_steps, EVERY)
    for i_back in range(0, n_seg):
        lo = (n_seg - 1 - i_back) * EVERY
        top = tl.minimum(lo + EVERY - 1, n_steps - 1)
        b_y = tl.load(p_slot + (lo // EVERY) * (BT * BK))
        tl.store(p_seg, b_y)
        for s in range(lo, top):
            b_y = carry_across(b_y, w, mw, bos, i_m + 1 + s, i_h, o_t, o_k, m_k, H, K, BT, CARRY_PRECISION, True)
            tl.store(p_seg + (s + 1 - lo) * (BT * BK), b_y)
        tl.debug_barrier()
        for s_back in range(0, top - lo + 1):
            s = top - s_back
            i_c = i_m + 1 + s
            b_y = tl.load(p_seg + (s - lo) * (BT * BK))
            if s + 1 < n_steps:  # Γ of y at chunk c + 1, back across chunk c (a complete one)
                b_gam = carry_across(b_gam, w, mw, bos, i_c, i_h, o_t, o_k, m_k, H, K, BT, CARRY_PRECISION, False)
            b_dy, b_dv, b_dg = key_chunk_grads(
                x, do, lse, delta, gcum, dgcum, None, b_y, b_v, b_dv, b_dg, bos, L, i_c, p_m, i_h, scale, o_t, o_k, o_v,
                o_g, m_k, m_v, HQ, H, K, V, BK, BT, USE_G, PRECISION, LOW_GRAD,
            )  # fmt: skip
            b_gam += b_dy * scale
    store_key_chunk_grads(dkt, dv, dgcum, b_gam, b_dv, b_dg, p_m, i_h, o_k, o_v, o_g, m_k, m_v, HQ, H, K, V, USE_G)


@triton.jit
def carry_across(
    b_r, w, mw, bos, i_m, i_h, o_t, o_k, m_k,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr, TRANSPOSED: tl.constexpr,
    LOW: tl.constexpr = False, DT: tl.constexpr = tl.float32,
):  # fmt: skip
    """Rows ``R`` moved across chunk ``i_m``'s carry ``A = I − Wᵀ M W`` (a complete chunk): ``R A = R − (R Wᵀ)(M W)``
    (carried queries, right to left; the gradient of carried keys), or with ``TRANSPOSED``
    ``R Aᵀ = R − (R (M W)ᵀ) W`` (carried keys, left to right; the gradient of carried queries). With ``LOW`` both
    products take operands rounded to ``DT`` (16-bit, float32 accumulation; ``R`` stays float32)."""
    p_mk = (bos + (i_m * BT + o_t).to(tl.int64))[:, None] * (H * K) + i_h * K + o_k[None, :]
    P: tl.constexpr = "16bit" if LOW else PRECISION
    b_w = tl.load(w + p_mk, mask=m_k, other=0.0).to(tl.float32)
    b_mw = tl.load(mw + p_mk, mask=m_k, other=0.0).to(tl.float32)
    if TRANSPOSED:
        return b_r - pair_dot(pair_dot(b_r, tl.trans(b_mw), P, DT), b_w, P, DT)
    return b_r - pair_dot(pair_dot(b_r, tl.trans(b_w), P, DT), b_mw, P, DT)


@triton.jit
def query_pair_grads(
    b_l, b_gam, b_dgq, b_do, b_lse, b_delta, b_gq, kt, v, w, m, mw, gcum, dw, dm, da, dkt, dv, dgcum, bos, chunk0,
    i_m, i_h, i_hq, m_i, scale, o_t, o_k, o_v, m_k, m_v,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    USE_G: tl.constexpr, PRECISION: tl.constexpr, CARRY_PRECISION: tl.constexpr, DA: tl.constexpr,
    LOW_GRAD: tl.constexpr, KV: tl.constexpr, CARRY_LOW: tl.constexpr,
):  # fmt: skip
    """One pair of :func:`path_bwd_q_kernel`: its query chunk (rows ``m_i``, carried to key chunk ``i_m``'s end:
    ``b_l = L_{c,m}``) against key chunk ``i_m``. ``b_gam`` enters as the gradient of ``L_{c,m−1}`` (the pairs with
    earlier key chunks) and leaves as that of ``L_{c,m}``; crossing chunk ``m`` adds ``L_{c,m}ᵀ Γ`` to ``dA_m``
    (``DA``) or its projections to ``dM_m``, ``dW_m``. With ``KV`` the key chunk's side of the pair goes out by
    atomics, and the query rows' gate side is summed into ``b_dgq``. Returns ``(b_gam, b_dgq)``."""
    LT: tl.constexpr = b_do.dtype
    rows, cols = o_t[:, None], o_t[None, :]
    p_m = bos + (i_m * BT + o_t).to(tl.int64)
    p_mk = p_m[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_kt = tl.load(kt + p_mk, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + p_m[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_v, other=0.0)
    if USE_G:  # read with the key chunk, not at its first use
        b_gk = tl.load(gcum + p_m * HQ + i_hq)
    if i_m > 0:
        if DA:  # dA_m += L_{c,m}ᵀ Γ, then Γ ← Γ A_mᵀ
            b_da = tl.dot(tl.trans(b_l), b_gam, input_precision=CARRY_PRECISION)
            tl.atomic_add(da + ((chunk0 + i_m) * H + i_h) * (BK * BK) + o_k[:, None] * BK + o_k[None, :], b_da)
            b_gam = carry_across(
                b_gam, w, mw, bos, i_m, i_h, o_t, o_k, m_k, H, K, BT, CARRY_PRECISION, True, CARRY_LOW, LT
            )
        else:  # dA_m's projections dM_m, dW_m directly (fewer atomics when BK > BT)
            b_w = tl.load(w + p_mk, mask=m_k, other=0.0).to(tl.float32)
            b_mm = tl.load(m + ((chunk0 + i_m) * H + i_h) * (BT * BT) + rows * BT + cols)
            b_u = tl.dot(b_l, tl.trans(b_w), input_precision=CARRY_PRECISION)
            b_vg = tl.dot(b_gam, tl.trans(b_w), input_precision=CARRY_PRECISION)
            b_dmm = -tl.dot(tl.trans(b_u), b_vg, input_precision=CARRY_PRECISION)
            b_mv = tl.dot(b_mm, tl.trans(b_vg), input_precision=CARRY_PRECISION)  # M Vᵀ
            b_mu = tl.dot(tl.trans(b_mm), tl.trans(b_u), input_precision=CARRY_PRECISION)  # Mᵀ Uᵀ
            b_dw = tl.dot(b_mv, b_l, input_precision=CARRY_PRECISION)
            b_dw = -(b_dw + tl.dot(b_mu, b_gam, input_precision=CARRY_PRECISION))
            tl.atomic_add(dm + ((chunk0 + i_m) * H + i_h) * (BT * BT) + rows * BT + cols, b_dmm)
            tl.atomic_add(dw + p_mk, b_dw, mask=m_k)
            b_gam -= tl.dot(tl.dot(b_vg, tl.trans(b_mm), input_precision=CARRY_PRECISION), b_w,
                            input_precision=CARRY_PRECISION)  # fmt: skip
    if LOW_GRAD:  # the logits and dS K̃ on 16-bit operands, as key_chunk_grads's LOW_GRAD
        b_s = tl.dot(b_l.to(LT), tl.trans(b_kt.to(LT)), input_precision=PRECISION)
    else:
        b_s = tl.dot(b_l, tl.trans(b_kt), input_precision=PRECISION)
    if not USE_G:  # unused
        b_gk = b_gq
    b_p = tl.where(m_i[:, None], tl.exp2(base2_logits(b_s, scale, b_lse, b_gq, b_gk, USE_G)), 0.0)
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION)
    b_ds = b_p * (b_dp - b_delta[:, None])
    if KV:  # the key chunk's side of the pair, by atomics (above K = 128 the key-tile kernel's key_chunk_grads)
        if LOW_GRAD:
            b_dkm = tl.dot(tl.trans(b_ds).to(LT), b_l.to(LT), input_precision=PRECISION)
        else:
            b_dkm = tl.dot(tl.trans(b_ds), b_l, input_precision=PRECISION)
        tl.atomic_add(dkt + p_mk, b_dkm * scale, mask=m_k, sem="relaxed")
        b_dvm = tl.dot(tl.trans(b_p).to(LT), b_do, input_precision=PRECISION)
        p_dv = dv + p_m[:, None] * (H * V) + i_h * V + o_v[None, :]
        tl.atomic_add(p_dv, b_dvm, mask=m_v, sem="relaxed")
        if USE_G:
            tl.atomic_add(dgcum + p_m * HQ + i_hq, -tl.sum(b_ds, 0), sem="relaxed")
            b_dgq += tl.sum(b_ds, 1)
    if LOW_GRAD:
        b_gam += tl.dot(b_ds.to(LT), b_kt.to(LT), input_precision=PRECISION) * scale
    else:
        b_gam += tl.dot(b_ds, b_kt, input_precision=PRECISION) * scale
    return b_gam, b_dgq


@triton.jit
def path_bwd_q_kernel(
    x, kt, v, w, m, mw, gcum, do, lse, delta, dx, dw, dm, da, dkt, dv, dgcum, scratch, cu_seqlens, chunk_offsets, T,
    NC, c_base, EVERY, SLOTS, scale,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, USE_G: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    CARRY_PRECISION: tl.constexpr, DA: tl.constexpr, LOW_GRAD: tl.constexpr = False, KV: tl.constexpr = False,
    RECOMPUTE: tl.constexpr = False, CARRY_LOW: tl.constexpr = False, ADD_DX: tl.constexpr = False,
):  # fmt: skip
    """``x [*, HQ, K]`` (queries carried to their chunk's start), ``kt [*, H, K]`` (both in ``prepare.buffer_dtype``),
    ``v [*, H, V]``, ``w [*, H, K]``, ``m [chunks, H, BT, BT]``, ``mw [*, H, K]`` float32 (``M W`` per chunk),
    ``gcum [*, HQ]``, ``do [*, HQ, V]``, ``lse, delta [*, HQ]`` float32 -> ``dx [*, HQ, K]`` (stored; with ``ADD_DX``
    added to what it holds) and, by atomic adds,
    either (``DA``) ``da [chunks, H, BK, BK]``, the gradient of each chunk's carry ``A_m``, or ``dw [*, H, K]`` and
    ``dm [chunks, H, BT, BT]``, all float32 and zero-initialised. Grid ``(chunks of this wave, N * HQ)``: program
    ``(j, ·)`` takes query chunk ``c_base + j`` and ``SLOTS`` scratch tiles of ``[BT, BK]`` float32: the carried
    query at the right end of every segment of ``EVERY`` key chunks (checkpoints), then one segment's worth,
    recomputed from its checkpoint before the segment is walked left to right. With ``RECOMPUTE``
    (:data:`INNER_RECOMPUTE`) there is no scratch (``SLOTS``, ``EVERY`` unused): each key chunk's carried query is
    recomputed from ``x_c`` in registers, ``c − 1 − m`` carries (with ``CARRY_LOW`` on 16-bit operands, as the
    carries of ``Γ``). With ``KV`` (up to K = 128, :func:`carries_key_tile`) it also adds each pair's
    ``dK̃_m = scale · dSᵀ L_{c,m}``, ``dV_m = Pᵀ dO`` (``dkt [*, H, K]``, ``dv [*, H, V]``) and both sides of the
    gates' gradient (``dgcum [*, HQ]``: the key rows' ``−colsum(dS)`` at each pair, the query rows' ``rowsum(dS)``
    summed over the pairs) by float32 atomics: :func:`path_bwd_kv_tile_kernel`'s outputs, which is then not
    launched."""
    i_j, i_nh = tl.program_id(0), tl.program_id(1)
    i_c = c_base + i_j
    i_n, i_hq = i_nh // HQ, i_nh % HQ
    i_h = i_hq // (HQ // H)
    bos, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    if i_c == 0 or i_c * BT >= L:
        return
    chunk0 = first_chunk(chunk_offsets, i_n, NC, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = (o_k < K)[None, :], (o_v < V)[None, :]
    o_i = i_c * BT + o_t
    m_i = o_i < L
    p_i = bos + o_i.to(tl.int64)
    LT: tl.constexpr = do.dtype.element_ty
    b_x = tl.load(x + p_i[:, None] * (HQ * K) + i_hq * K + o_k[None, :], mask=m_i[:, None] & m_k, other=0.0)
    b_x = b_x.to(tl.float32)
    b_do = tl.load(do + p_i[:, None] * (HQ * V) + i_hq * V + o_v[None, :], mask=m_i[:, None] & m_v, other=0.0)
    b_lse = tl.load(lse + p_i * HQ + i_hq, mask=m_i, other=0.0)
    b_delta = tl.load(delta + p_i * HQ + i_hq, mask=m_i, other=0.0)
    if USE_G:
        b_gq = tl.load(gcum + p_i * HQ + i_hq, mask=m_i, other=0.0)
    else:
        b_gq = tl.zeros([BT], dtype=tl.float32)
    b_gam = tl.zeros([BT, BK], dtype=tl.float32)
    b_dgq = tl.zeros([BT], dtype=tl.float32)  # with KV and gates: the query rows' side, summed over the pairs
    if RECOMPUTE:
        # Left to right over the key chunks; L_{c,m} = x_c A_{c−1} ··· A_{m+1} recomputed for each.
        for i_m in range(0, i_c):
            b_l = b_x
            for i_back in range(0, i_c - 1 - i_m):
                b_l = carry_across(
                    b_l, w, mw, bos, i_c - 1 - i_back, i_h, o_t, o_k, m_k, H, K, BT, CARRY_PRECISION, False, CARRY_LOW,
                    LT,
                )  # fmt: skip
            b_gam, b_dgq = query_pair_grads(
                b_l, b_gam, b_dgq, b_do, b_lse, b_delta, b_gq, kt, v, w, m, mw, gcum, dw, dm, da, dkt, dv, dgcum,
                bos, chunk0, i_m, i_h, i_hq, m_i, scale, o_t, o_k, o_v, m_k, m_v, HQ, H, K, V, BK, BT, USE_G,
                PRECISION, CARRY_PRECISION, DA, LOW_GRAD, KV, CARRY_LOW,
            )  # fmt: skip
    else:
        rows = o_t[:, None]
        p_slot = scratch + ((i_j * tl.num_programs(1) + i_nh).to(tl.int64) * SLOTS) * (BT * BK) + rows * BK
        p_slot += o_k[None, :]
        p_seg = p_slot + (SLOTS - EVERY) * (BT * BK)  # the segment's tiles follow the checkpoints
        # Right to left: L_{c,c-1} = x_c, then L_{c,m-1} = L_{c,m} A_m; checkpoint L_{c,m} at each segment's right end.
        b_l = b_x
        for i_back in range(0, i_c):
            i_m = i_c - 1 - i_back
            if (i_m == i_c - 1) or (i_m % EVERY == EVERY - 1):
                tl.store(p_slot + (i_m // EVERY) * (BT * BK), b_l)
            if i_m > 0:
                b_l = carry_across(b_l, w, mw, bos, i_m, i_h, o_t, o_k, m_k, H, K, BT, CARRY_PRECISION, False)
        tl.debug_barrier()
        # Left to right, a segment at a time: Γ is the gradient of L_{c,m-1}; crossing chunk m adds L_{c,m}ᵀ Γ to dA_m.
        for i_s in range(0, tl.cdiv(i_c, EVERY)):
            lo = i_s * EVERY
            top = tl.minimum(lo + EVERY - 1, i_c - 1)
            b_l = tl.load(p_slot + i_s * (BT * BK))
            tl.store(p_seg + (top - lo) * (BT * BK), b_l)
            for i_back in range(0, top - lo):
                b_l = carry_across(b_l, w, mw, bos, top - i_back, i_h, o_t, o_k, m_k, H, K, BT, CARRY_PRECISION, False)
                tl.store(p_seg + (top - i_back - 1 - lo) * (BT * BK), b_l)
            tl.debug_barrier()
            for i_m in range(lo, top + 1):
                b_l = tl.load(p_seg + (i_m - lo) * (BT * BK))
                b_gam, b_dgq = query_pair_grads(
                    b_l, b_gam, b_dgq, b_do, b_lse, b_delta, b_gq, kt, v, w, m, mw, gcum, dw, dm, da, dkt, dv, dgcum,
                    bos, chunk0, i_m, i_h, i_hq, m_i, scale, o_t, o_k, o_v, m_k, m_v, HQ, H, K, V, BK, BT, USE_G,
                    PRECISION, CARRY_PRECISION, DA, LOW_GRAD, KV, False,
                )  # fmt: skip
    p_dx = dx + p_i[:, None] * (HQ * K) + i_hq * K + o_k[None, :]
    if ADD_DX:  # added to what an earlier kernel left there
        b_gam += tl.load(p_dx, mask=m_i[:, None] & m_k, other=0.0)
    tl.store(p_dx, b_gam, mask=m_i[:, None] & m_k)
    if KV and USE_G:
        tl.atomic_add(dgcum + p_i * HQ + i_hq, b_dgq, mask=m_i, sem="relaxed")


def path_bwd_between_fn(
    x: torch.Tensor,
    kt: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    m: torch.Tensor,
    mw: torch.Tensor,
    gcum: torch.Tensor | None,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None,
    chunk: int,
    longest: int,
    offsets: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    dgcum: torch.Tensor | None = None,
    carry_precision: str | None = None,
    low_grad: bool = False,
    every: int | None = None,
    dkt: torch.Tensor | None = None,
    dx: torch.Tensor | None = None,
    da: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """The gradients of the logits between chunks (``longest``: the longest sequence's length, known to the caller,
    so that the launch reads nothing back from the device; ``offsets``: ``chunk_offsets(cu_seqlens, chunk)`` where
    the caller has it; ``dv``, ``dgcum``: float32 buffers to add into, else new zeros (``dgcum`` empty without
    gates); ``carry_precision``: the carries' ``input_precision``, default ``precisions(v.dtype, K)[1]``;
    ``low_grad``: the logits' and gradients' products on operands rounded to ``do``'s dtype, as the sweep between
    superblocks takes them; ``every``: the query kernel's key chunks per checkpoint segment, default
    :func:`checkpoint_every`'s; ``dkt``, ``dx``, ``da``: float32 buffers to add into, ``da`` only where
    :func:`sums_carry_gradient`). ``x [B,T,HQ,K]``,
    ``kt [B,T,H,K]`` (both in ``prepare.buffer_dtype``), ``v [B,T,H,V]``,
    ``w [B,T,H,K]``, ``m [chunks,H,BT,BT]``, ``mw [B,T,H,K]`` (``M W`` per chunk) float32, ``gcum``, ``lse``,
    ``delta [B,T,HQ]`` float32 (or ``gcum`` None), ``do [B,T,HQ,V]``, all contiguous. Returns float32
    ``(dkt [B,T,H,K], dv [B,T,H,V], dx [B,T,HQ,K], dw [B,T,H,K], dm [chunks,H,BT,BT], da [chunks,H,BK,BK],
    dg [B,T,HQ])`` (``dg`` the gradient of ``gcum``, both sides): the carries' gradient either as ``da`` (the
    gradient of ``A = I − Wᵀ M W`` per chunk, :func:`sums_carry_gradient`) with ``dw``, ``dm`` empty, or as ``dw``,
    ``dm`` with ``da`` empty."""
    B, T, HQ, K = x.shape
    H, V = kt.shape[2], v.shape[-1]
    BT, BK, BV = chunk, block_dim(K), block_dim(V)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if offsets is None:
        offsets = chunk_offsets(cu_seqlens, BT)
    NC = triton.cdiv(T, BT)
    f32 = dict(dtype=torch.float32, device=x.device)
    add_dx = dx is not None
    dkt = torch.zeros(B, T, H, K, **f32) if dkt is None else dkt
    dx = torch.zeros(B, T, HQ, K, **f32) if dx is None else dx
    dv = torch.zeros(B, T, H, V, **f32) if dv is None else dv
    if dgcum is None:  # the gates' atomic adds; nothing without gates
        dgcum = torch.empty(0, **f32) if gcum is None else torch.zeros(B, T, HQ, **f32)
    sums_da = sums_carry_gradient(K, BT)
    if da is not None and not sums_da:
        raise ValueError("da: the kernels between chunks take dA's projections at this key dim, not dA")
    if sums_da:  # the op's outputs may not alias one another: separate empty tensors
        da = torch.zeros(m.shape[0], H, BK, BK, **f32) if da is None else da
        dw, dm = torch.empty(0, **f32), torch.empty(0, **f32)
    else:
        dw, dm, da = torch.zeros(B, T, H, K, **f32), torch.zeros_like(m), torch.empty(0, **f32)
    n_long = triton.cdiv(longest, BT)
    if n_long < 2:
        return dkt, dv, dx, dw, dm, da, dgcum
    precision, carry = precisions(v.dtype, K, V)
    carry = carry_precision or carry
    launch = dict(num_warps=backward_config(K)[1], num_stages=INNER_STAGES)
    common = dict(HQ=HQ, H=H, K=K, V=V, BK=BK, BV=BV, BT=BT, USE_G=gcum is not None, IS_VARLEN=cu_seqlens is not None,
                  PRECISION=precision, CARRY_PRECISION=carry, LOW_GRAD=low_grad, **launch)  # fmt: skip
    # Chunks in waves: a program keeps its carried tile at every segment's end plus one segment.
    every = every or checkpoint_every(n_long)
    slots = triton.cdiv(n_long, every) + every
    BG = triton.next_power_of_2(HQ // H)

    def waves(heads: int) -> tuple[int, torch.Tensor]:
        """Chunks a launch takes (at least one, at most all ``n_long − 1``) and their scratch, within
        ``SCRATCH_BYTES``, for programs over ``N * heads``."""
        per_chunk = slots * BT * BK * N * heads  # float32 numbers
        wave = max(1, min(n_long - 1, SCRATCH_BYTES // (per_chunk * 4)))
        return wave, torch.empty(wave * per_chunk, **f32)

    if carries_key_tile(K):  # else the query kernel adds the key side too
        wave, scratch = waves(H)
        for m_base in range(0, n_long - 1, wave):
            path_bwd_kv_tile_kernel[(min(wave, n_long - 1 - m_base), N * H)](
                x, kt, v, w, mw, gcum, do, lse, delta, dkt, dv, dgcum, scratch, cu_seqlens, T, m_base, every, slots,
                scale, BG=BG, **common,
            )  # fmt: skip
    recompute = INNER_RECOMPUTE and n_long <= RECOMPUTE_MAX_CHUNKS
    if recompute:  # one launch, no scratch: every carried query recomputed in registers
        wave, scratch, every, slots = n_long - 1, torch.empty(0, **f32), 1, 0
    else:
        wave, scratch = waves(HQ)
    for c_base in range(1, n_long, wave):
        path_bwd_q_kernel[(min(wave, n_long - c_base), N * HQ)](
            x, kt, v, w, m, mw, gcum, do, lse, delta, dx, dw, dm, da, dkt, dv, dgcum, scratch, cu_seqlens, offsets, T,
            NC, c_base, every, slots, scale, DA=sums_da, KV=not carries_key_tile(K), RECOMPUTE=recompute,
            CARRY_LOW=recompute and INNER_CARRY_LOW and low_grad, ADD_DX=add_dx, **common,
        )  # fmt: skip
    return dkt, dv, dx, dw, dm, da, dgcum
