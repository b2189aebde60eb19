"""PaTH forward: one program per (query chunk, query head), scanning key chunks right to left.

Within its own chunk a query sees ``s_ij = q_iᵀ k_j − (tril(Q Wᵀ) M strict_tril(W Kᵀ))_ij``; the query is then
carried to the chunk's start, ``x = Q − tril(Q Wᵀ) M W``. For each earlier chunk ``j`` of its superblock (right to
left) the logits are ``x k̃_jᵀ`` with the keys carried to the end of chunk ``j`` (``prepare.py``), and the query is
carried across the chunk, ``x ← x − (x W_jᵀ)(M_j W_j)`` (two products: the prepare kernel writes ``M_j W_j``).
Past its superblock's start the scan goes a superblock at a time: the logits are ``x k̂_jᵀ`` with the keys carried
to their superblock's end (``carry.py``), for every chunk of the superblock with no carry between them, and then
the query crosses the whole superblock with one dense product, ``x ← x Σᵀ``. FlashAttention's online softmax runs
along the scan, in base 2 (``exp2`` of logits scaled by ``log2(e)``, the gates' cumulative sums too; the stored
log-sum-exp is natural); the FoX gate subtracts ``G_j`` (the row's own ``G_i``, which the softmax ignores, goes to
the log-sum-exp). Derivation: ``README.md`` of the op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.scan import segment_cumsum
from attnkit.ops.common.triton_seq import seq_bounds
from attnkit.ops.common.triton_utils import LOG2E, block_dim, interpreting
from attnkit.ops.path.triton import prepare
from attnkit.ops.path.triton.carry import carry_keys_fn
from attnkit.ops.path.triton.prepare import (
    JIT_LN2,
    JIT_LOG2E,
    chunk_offsets,
    chunk_size,
    first_chunk,
    launch_config,
    path_prepare_kernel,
    precisions,
    solve_batched,
    solve_rows,
)

# The forward kernel's carries inside its query's superblock (x ← x − (x W_jᵀ)(M_j W_j), a chunk at a time, at most a
# superblock's chunks) in one pass on operands rounded to the inputs' 16-bit dtype, float32 accumulation (the carried
# query stays float32), instead of the carries' precision (three bf16 passes for bf16 at K = 64 and 128); the carries
# across superblocks (Σ, which accumulate over T) and the chunk-local terms keep theirs. The backward's carries inside
# superblocks take one 16-bit pass (backward.INNER_CARRY_LOW) with every error from the PyTorch backend unchanged on
# the H200. None (the default): where prepare.measured_16bit; True: for every 16-bit input (tests); False: the carries'
# precision. On the H200 at T = 4k (PaTH-FoX, bf16, 32768 tokens; path_tune.py's LOCAL row "forward inner carries
# 16-bit") forward+backward took 14.67 ms against 14.85 at D = 64 and 35.09 against 35.57 at D = 128, every error from
# the PyTorch backend unchanged (path_local_session20_h200_d{64,128}.json).
INNER_CARRY_LOW: bool | None = None


@triton.jit
def key_gates(gcum, o_g, p_j, BT: tl.constexpr, USE_G: tl.constexpr):
    """A key chunk's cumulative gates for one query head (rows ``p_j`` of ``gcum + o_g``), or zeros without gates.
    Read next to the chunk's keys and values: the kernels run unpipelined, and a load left where its value is first
    used, after the logits' product, waits out its own memory latency on every chunk."""
    b_g = tl.zeros([BT], dtype=tl.float32)
    if USE_G:
        b_g = tl.load(gcum + o_g + p_j)
    return b_g


@triton.jit
def softmax_step(
    b_x, b_k, b_v, b_gk, b_max, b_sum, b_acc, scale, USE_G: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One key chunk (``b_k`` carried to where the query ``b_x`` stands; ``b_gk`` its cumulative gates for the query
    head, read with the keys, when ``USE_G``) into the online softmax: returns the new ``(max, sum, acc)``. The logits
    leave out the query's own gate ``G_i``, a shift of the whole row that the softmax ignores (the log-sum-exp adds it
    back)."""
    b_s = tl.dot(b_x.to(b_k.dtype), tl.trans(b_k), input_precision=PRECISION) * (scale * JIT_LOG2E)
    if USE_G:
        b_s = b_s - b_gk[None, :]
    b_max_new = tl.maximum(b_max, tl.max(b_s, 1))
    b_rescale = tl.exp2(b_max - b_max_new)
    b_p = tl.exp2(b_s - b_max_new[:, None])
    b_sum = b_sum * b_rescale + tl.sum(b_p, 1)
    b_acc = b_acc * b_rescale[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
    return b_max_new, b_sum, b_acc


@triton.jit
def path_fwd_kernel(
    q, k, v, w, kt, m, mw, kh, sig, gcum, o, lse, x_out, xh_out, cu_seqlens, chunk_offsets, sb_offsets, T, NT, NC, NSB,
    R, scale,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    USE_G: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, CARRY_PRECISION: tl.constexpr,
    INNER_LOW: tl.constexpr = False, WRITE_X: tl.constexpr = False, WRITE_XH: tl.constexpr = False,
):  # fmt: skip
    """``q [*, HQ, K]``, ``k, w, kt [*, H, K]``, ``v [*, H, V]``, ``m [chunks, H, BT, BT]`` float32, ``mw [*, H, K]``
    float32 (``M W`` per chunk), ``kh [*, H, K]`` (keys carried to their superblock's end) and ``sig [superblocks,
    H, BK, BK]`` float32 (each superblock's transitions, ``carry.py``; superblocks of ``R`` chunks), ``gcum [HQ, *]``
    float32 cumulative gates times ``log2(e)``, head-major (``NT`` tokens a head; when ``USE_G``) -> ``o [*, HQ,
    V]`` and ``lse [*, HQ]`` float32 (the natural log-sum-exp of each query's logits, for the backward). Grid
    ``(chunks of the longest sequence, N * HQ)``. The carried query stays float32 (``CARRY_PRECISION`` dots): it
    accumulates one rank-``BT`` update per chunk of history; with ``INNER_LOW`` (:data:`INNER_CARRY_LOW`) its carries
    inside its superblock take operands rounded to ``k``'s dtype. With ``WRITE_X`` it stores the carried query at its
    chunk's start into ``x_out [*, HQ, K]``, with ``WRITE_XH`` at its superblock's start into ``xh_out`` (each in its
    own dtype), which the backward then reads instead of carrying the queries again."""
    LT: tl.constexpr = k.dtype.element_ty
    i_c = tl.num_programs(0) - 1 - tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n, i_hq = i_nh // HQ, i_nh % HQ
    i_h = i_hq // (HQ // H)
    bos, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    start = i_c * BT
    if start >= L:
        return
    chunk0 = first_chunk(chunk_offsets, i_n, NC, IS_VARLEN)
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    o_t = tl.arange(0, BT)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = (o_k < K)[None, :], (o_v < V)[None, :]

    # The query chunk and its own keys.
    o_i = start + o_t
    m_i = o_i < L
    p_i = bos + o_i.to(tl.int64)
    b_q = tl.load(q + p_i[:, None] * (HQ * K) + i_hq * K + o_k[None, :], mask=m_i[:, None] & m_k, other=0.0)
    p_kv = p_i[:, None] * (H * K) + i_h * K + o_k[None, :]
    b_k = tl.load(k + p_kv, mask=m_i[:, None] & m_k, other=0.0)
    b_w = tl.load(w + p_kv, mask=m_i[:, None] & m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + p_i[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_i[:, None] & m_v, other=0.0)
    b_m = tl.load(m + ((chunk0 + i_c) * H + i_h) * (BT * BT) + rows * BT + cols)
    b_qf = b_q.to(tl.float32)
    b_u = tl.where(rows >= cols, tl.dot(b_qf, tl.trans(b_w), input_precision=CARRY_PRECISION), 0.0)  # tril(Q Wᵀ)
    b_qwm = tl.dot(b_u, b_m, input_precision=CARRY_PRECISION)
    b_wk = tl.where(rows > cols, tl.dot(b_w, tl.trans(b_k.to(tl.float32)), input_precision=CARRY_PRECISION), 0.0)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
    b_s = (b_s - tl.dot(b_qwm, b_wk, input_precision=CARRY_PRECISION)) * (scale * JIT_LOG2E)
    # x = Q − tril(Q Wᵀ) (M W), with the prepare kernel's M W: the backward's query terms' own formula, so that the
    # queries the forward keeps for it are the numbers it would carry itself.
    b_mw = tl.load(mw + p_kv, mask=m_i[:, None] & m_k, other=0.0).to(tl.float32)
    b_x = b_qf - tl.dot(b_u, b_mw, input_precision=CARRY_PRECISION)
    p_x = p_i[:, None] * (HQ * K) + i_hq * K + o_k[None, :]
    if WRITE_X:
        tl.store(x_out + p_x, b_x.to(x_out.dtype.element_ty), mask=m_i[:, None] & m_k)
    o_g = i_hq.to(tl.int64) * NT  # this query head's gates
    b_gq = tl.zeros([BT], dtype=tl.float32)
    if USE_G:
        b_gq = tl.load(gcum + o_g + p_i, mask=m_i, other=0.0)
        b_s = b_s - b_gq[None, :]
    b_s = tl.where((rows >= cols) & m_i[None, :], b_s, float("-inf"))
    b_max = tl.max(b_s, 1)
    b_p = tl.exp2(b_s - b_max[:, None])
    b_sum = tl.sum(b_p, 1)
    b_acc = tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)

    # The earlier chunks of the query's superblock, one carry a chunk (the last one takes x to the superblock's
    # start).
    lo = (i_c // R) * R
    for i_back in range(0, i_c - lo):
        j = i_c - 1 - i_back
        p_j = bos + (j * BT + o_t).to(tl.int64)
        p_kvj = p_j[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_kt = tl.load(kt + p_kvj, mask=m_k, other=0.0).to(k.dtype.element_ty)  # float32 when kept for the backward
        b_vj = tl.load(v + p_j[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_v, other=0.0)
        b_gk = key_gates(gcum, o_g, p_j, BT, USE_G)
        b_max, b_sum, b_acc = softmax_step(b_x, b_kt, b_vj, b_gk, b_max, b_sum, b_acc, scale, USE_G, PRECISION)
        b_wj = tl.load(w + p_kvj, mask=m_k, other=0.0).to(tl.float32)
        b_mwj = tl.load(mw + p_kvj, mask=m_k, other=0.0).to(tl.float32)
        if INNER_LOW:
            b_xw = tl.dot(b_x.to(LT), tl.trans(b_wj.to(LT)))
            b_x = b_x - tl.dot(b_xw.to(LT), b_mwj.to(LT))
        else:
            b_xw = tl.dot(b_x, tl.trans(b_wj), input_precision=CARRY_PRECISION)
            b_x = b_x - tl.dot(b_xw, b_mwj, input_precision=CARRY_PRECISION)
    if WRITE_XH:
        tl.store(xh_out + p_x, b_x.to(xh_out.dtype.element_ty), mask=m_i[:, None] & m_k)

    # The earlier superblocks (all their chunks complete), right to left: their keys carried to the superblock's
    # end, then one dense carry across the superblock.
    sb0 = first_chunk(sb_offsets, i_n, NSB, IS_VARLEN)
    for i_sb in range(0, i_c // R):
        sb = i_c // R - 1 - i_sb
        for jj in range(0, R):
            p_j = bos + ((sb * R + jj) * BT + o_t).to(tl.int64)
            # in k's dtype for the logits (a float16 buffer where the forward keeps it for the backward)
            b_kh = tl.load(kh + p_j[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_k, other=0.0).to(LT)
            b_vj = tl.load(v + p_j[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_v, other=0.0)
            b_gk = key_gates(gcum, o_g, p_j, BT, USE_G)
            b_max, b_sum, b_acc = softmax_step(b_x, b_kh, b_vj, b_gk, b_max, b_sum, b_acc, scale, USE_G, PRECISION)
        if sb > 0:
            b_sig = tl.load(sig + ((sb0 + sb) * H + i_h) * (BK * BK) + o_k[:, None] * BK + o_k[None, :])
            b_x = tl.dot(b_x, tl.trans(b_sig), input_precision=CARRY_PRECISION)

    b_o = b_acc / b_sum[:, None]
    tl.store(o + p_i[:, None] * (HQ * V) + i_hq * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_i[:, None] & m_v)
    # The natural log-sum-exp, the row's gate G_i back in.
    tl.store(lse + p_i * HQ + i_hq, (b_max + tl.log2(b_sum) + b_gq) * JIT_LN2, mask=m_i)


def path_fwd_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    scale: float,
    cu_seqlens: torch.Tensor | None,
    config: dict[str, int] | None = None,
    keep: bool = False,
) -> tuple[torch.Tensor, ...]:
    """PaTH(-FoX) forward through the kernels. ``q [B,T,HQ,K]``, ``k, w [B,T,H,K]``, ``v [B,T,H,V]``,
    ``beta [B,T,H]``, ``g [B,T,HQ]`` or None, contiguous; ``q, k, v`` share one float dtype (not float64).
    Returns ``o [B,T,HQ,V]`` in ``v.dtype`` and ``lse [B,T,HQ]`` float32. ``config``: ``num_warps`` and
    ``num_stages`` of both kernels instead of the defaults, and optionally ``carry_precision`` (the carries' and
    the UT solve's ``input_precision``; ``benchmarks/path_tune.py``'s sweep). ``keep``: also return the prepare
    kernel's ``m [chunks, H, BT, BT]``, ``kt [B,T,H,K]`` and ``mw [B,T,H,K]``, ``kt`` in ``prepare.buffer_dtype``
    (float32 by default; rounded to ``k``'s dtype where the forward's logits read it) and the others float32, for a
    backward that chunks as the forward does (``parallel.keeps_prepared``): it skips its own UT solve; and, where some
    chunk has an earlier superblock and :func:`keeps_carried`, ``kh [B,T,H,K]`` (the keys carried to their
    superblock's end, in ``prepare.buffer_dtype``) and ``sig`` (each superblock's transitions, float32), which the
    backward then reads instead of carrying again (else both empty); and ``x [B,T,HQ,K]``, the queries carried to
    their chunk's start (in ``prepare.buffer_dtype``), and where ``kh`` is kept ``xh``, to their superblock's start
    (in ``q``'s dtype, else empty), which the backward reads instead of its query terms kernel."""
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    BT = chunk_size(K)
    BK, BV = block_dim(K), block_dim(V)
    # No host sync: T bounds every packed sequence's length (programs past a sequence's end return at once), and the
    # per-chunk arrays have rows for every chunk that bound allows.
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    longest = T if N else 0
    offsets = chunk_offsets(cu_seqlens, BT)
    NC = triton.cdiv(T, BT)
    chunks = B * NC if cu_seqlens is None else NC + N
    precision, carry = precisions(q.dtype, K, V)
    o = torch.empty(B, T, HQ, V, dtype=v.dtype, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    # Packed, m has a row for every chunk T allows and the sequences use fewer: zeros there when it is returned.
    m = (torch.zeros if keep and cu_seqlens is not None else torch.empty)(
        chunks, H, BT, BT, dtype=torch.float32, device=q.device
    )
    kt = torch.empty(k.shape, dtype=prepare.buffer_dtype(q.dtype, K) if keep else k.dtype, device=q.device)
    # The queries carried to their chunk's start (x, in the backward's buffer dtype) and to their superblock's (xh, in
    # q's dtype, where kh is kept), kept for the backward as its query_terms_fn would give them.
    x = torch.empty(q.shape, dtype=prepare.buffer_dtype(q.dtype, K), device=q.device) if keep else None

    def empty() -> torch.Tensor:  # a new one each time: an op's outputs may not alias one another
        return kt.new_empty(0, dtype=torch.float32)

    if longest == 0:
        mw = kt.new_empty(k.shape, dtype=torch.float32)
        return (o, lse, m, kt, mw, empty(), empty(), x, empty()) if keep else (o, lse)
    mw = torch.empty(k.shape, dtype=torch.float32, device=q.device)
    is_varlen = cu_seqlens is not None
    grid_chunks = triton.cdiv(longest, BT)
    launch = dict(config or launch_config())
    requested = launch.pop("carry_precision", carry)
    carry = carry if interpreting() else requested  # the interpreter's dots are exact, and it knows no bf16x3
    path_prepare_kernel[(grid_chunks, N * H)](
        k, w, beta, m, kt, mw, cu_seqlens, offsets, T, NC, H=H, K=K, BK=BK, BT=BT, IS_VARLEN=is_varlen,
        PRECISION=carry, WRITE_MW=True, SB=solve_rows(BT), BATCHED=solve_batched(), **launch,
    )  # fmt: skip
    R = prepare.superblock_chunks(K, BT)
    carried = R < grid_chunks  # some query chunk has an earlier superblock
    # Kept for the backward where it would carry alike (keeps_carried), in its buffer dtype (the logits round to k's).
    kept = keep and carried and keeps_carried(q.dtype, K, V, carry)
    if carried:
        dtype = prepare.buffer_dtype(q.dtype, K) if kept else k.dtype
        kh, sig, sb_offsets = carry_keys_fn(
            w, kt, m, cu_seqlens, R, dtype, True, carry, launch, T, offsets, returned=kept
        )  # fmt: skip
    else:
        kh, sig, sb_offsets = kt, m, offsets  # never read
    xh = torch.empty_like(q) if kept else None
    # Gates enter as differences within a sequence (and lse as G_i plus them): each sequence's own cumulative sum, one
    # scan kernel (torch's cumsum along T took 0.7 ms at [4, 4096, 16] on the H200), as the backward takes it.
    # Head-major ([HQ, B·T]), so that a chunk's gates are one contiguous load.
    gcum = None
    if g is not None:
        gcum = segment_cumsum(g, cu_seqlens, LOG2E, False, torch.float32).permute(2, 0, 1).contiguous()
    path_fwd_kernel[(grid_chunks, N * HQ)](
        q, k, v, w, kt, m, mw, kh, sig, gcum, o, lse, x, xh, cu_seqlens, offsets, sb_offsets, T, B * T, NC,
        triton.cdiv(T, BT * R), R, scale,
        HQ=HQ, H=H, K=K, V=V, BK=BK, BV=BV, BT=BT, USE_G=g is not None, IS_VARLEN=is_varlen,
        PRECISION=precision, CARRY_PRECISION=wide_carry(carry, BK), INNER_LOW=inner_low(q.dtype, K),
        WRITE_X=keep, WRITE_XH=kept, **launch,
    )  # fmt: skip
    if not keep:
        return o, lse
    return (o, lse, m, kt, mw, kh, sig, x, xh) if kept else (o, lse, m, kt, mw, empty(), empty(), x, empty())


def keeps_carried(dtype: torch.dtype, key_dim: int, value_dim: int, carry: str | None = None) -> bool:
    """Whether a forward that keeps its prepared tensors (``keep``) keeps its carried keys and superblock transitions
    too: where its carries' precision (``carry``, by default :func:`prepare.precisions`' with ``value_dim``) is the
    backward's, which asks without the value dim. Float32 at a value dim above 128 carries exactly in the forward and
    may not in the backward: there the backward carries again."""
    carry = precisions(dtype, key_dim, value_dim)[1] if carry is None else carry
    return carry == precisions(dtype, key_dim)[1]


def inner_low(dtype: torch.dtype, key_dim: int) -> bool:
    """Whether the forward kernel's carries inside superblocks take 16-bit operands (:data:`INNER_CARRY_LOW`)."""
    return prepare.applies_16bit(INNER_CARRY_LOW, dtype, key_dim)


def wide_carry(carry: str, BK: int) -> str:
    """The forward kernel's carry precision: ``carry``, but three TF32 passes for exact (float32) carries above
    ``K = 128`` on a GPU. Compiled for sm_90a (Triton 3.6, seventeenth session), the kernel's float32 FMA carries need
    272 KB of shared memory at ``K = 256`` (their operands' layout conversions), over the 227 KB an H200 block may
    have: the likely cause of the float32 ``K = 256`` gradient test's failure on the H200 that session (its traceback
    was lost to the step's time limit). With 3×TF32 carries it needs 48 KB; the logits stay exact. The interpreter
    keeps ``ieee``: it has no TF32."""
    return "tf32x3" if carry == "ieee" and BK > 128 and not interpreting() else carry
