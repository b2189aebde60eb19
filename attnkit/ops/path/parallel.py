"""PaTH's Triton kernels as PyTorch operators: ``attnkit::path_fwd`` (the fused forward, with an autograd
registration), ``attnkit::path_bwd_between`` (the backward kernels) and ``attnkit::path_decode_`` (the in-place
fused decode step).

``torch.library.custom_op`` with fake (meta) implementations, so that ``torch.compile`` traces through the kernels
and ``torch.library.opcheck`` can hold the registrations to them. The backward formula of ``attnkit::path_fwd``
recomputes the chunk-local terms with autograd (``T·C`` numbers a head), takes the gradients between chunks from
``attnkit::path_bwd_between`` and the diagonal blocks from PyTorch, and runs autograd back through the chunk-local
terms (``triton/backward.py``, ``README.md``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnkit.ops.common.triton_utils import block_dim
from attnkit.ops.common.utils import repeat_kv, segment_bounds
from attnkit.ops.path.torch_impl import _chunk, chunk_local_terms, superblock_terms
from attnkit.ops.path.triton import backward, prepare
from attnkit.ops.path.triton.backward_super import path_bwd_super_fn
from attnkit.ops.path.triton.decode import path_decode_fn
from attnkit.ops.path.triton.forward import path_fwd_fn


@torch.library.custom_op("attnkit::path_decode_", mutates_args=("k_cache",), device_types=("cuda", "cpu"))
def path_decode_op(
    q: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    t: int,
    g_cache: torch.Tensor | None,
    cache_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One fused step on validated inputs (see :func:`attnkit.ops.path.path_decode_step_`); carries
    ``k_cache[:, :t]`` in place and returns ``o [B, 1, HQ, V]``. Inference only (no autograd formula)."""
    return path_decode_fn(q, w, beta, k_cache, v_cache, t, g_cache, cache_mask, scale)


@path_decode_op.register_fake
def _(q, w, beta, k_cache, v_cache, t, g_cache, cache_mask, scale):
    B, _, HQ, _ = q.shape
    return q.new_empty(B, 1, HQ, v_cache.shape[-1], dtype=v_cache.dtype)


@torch.library.custom_op("attnkit::path_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def path_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B,T,HQ,V] in v.dtype, lse [B,T,HQ] float32)`` through the fused forward (validated inputs; CPU
    tensors run through Triton's interpreter)."""
    q, k, v, w, beta = (x.contiguous() for x in (q, k, v, w, beta))
    return path_fwd_fn(q, k, v, w, beta, None if g is None else g.contiguous(), scale, cu_seqlens)


@path_fwd_op.register_fake
def _(q, k, v, w, beta, g, cu_seqlens, scale):
    B, T, HQ, _ = q.shape
    return q.new_empty(B, T, HQ, v.shape[-1], dtype=v.dtype), q.new_empty(B, T, HQ, dtype=torch.float32)


@torch.library.custom_op("attnkit::path_bwd_between", mutates_args=(), device_types=("cuda", "cpu"))
def path_bwd_between_op(
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
    cu_seqlens: torch.Tensor | None,
    scale: float,
    chunk: int,
    longest: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernels (:func:`attnkit.ops.path.triton.backward.path_bwd_between_fn`): float32
    ``(dkt, dv, dx, dw, dm, da, dgcum)`` of the logits between chunks (``dw``, ``dm`` or ``da`` empty)."""
    x, kt, v, w, m, mw, do = (t.contiguous() for t in (x, kt, v, w, m, mw, do))
    return backward.path_bwd_between_fn(x, kt, v, w, m, mw, gcum, do, lse, delta, scale, cu_seqlens, chunk, longest)


@path_bwd_between_op.register_fake
def _(x, kt, v, w, m, mw, gcum, do, lse, delta, cu_seqlens, scale, chunk, longest):
    B, T, HQ, K = x.shape
    f32 = dict(dtype=torch.float32)
    if backward.sums_carry_gradient(K, chunk):
        BK = block_dim(K)
        dw, dm, da = x.new_empty(0, **f32), x.new_empty(0, **f32), x.new_empty(m.shape[0], kt.shape[2], BK, BK, **f32)
    else:
        dw, dm, da = x.new_empty(w.shape, **f32), x.new_empty(m.shape, **f32), x.new_empty(0, **f32)
    return (x.new_empty(kt.shape, **f32), x.new_empty(v.shape, **f32), x.new_empty(B, T, HQ, K, **f32),
            dw, dm, da, x.new_empty(B, T, HQ, **f32))  # fmt: skip


@torch.library.custom_op("attnkit::path_bwd_super", mutates_args=(), device_types=("cuda", "cpu"))
def path_bwd_super_op(
    xh: torch.Tensor,
    kh: torch.Tensor,
    v: torch.Tensor,
    sig: torch.Tensor,
    gcum: torch.Tensor | None,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    chunk: int,
    span: int,
    longest: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernels between superblocks (:func:`attnkit.ops.path.triton.backward_super.path_bwd_super_fn`):
    float32 ``(dxh, dkh, dv, dsig, dgcum)``."""
    xh, kh, v, sig, do = (t.contiguous() for t in (xh, kh, v, sig, do))
    kh_low = kh.to(v.dtype)
    return path_bwd_super_fn(xh, kh, kh_low, v, sig, gcum, do, lse, delta, scale, cu_seqlens, chunk, span, longest)


@path_bwd_super_op.register_fake
def _(xh, kh, v, sig, gcum, do, lse, delta, cu_seqlens, scale, chunk, span, longest):
    f32 = dict(dtype=torch.float32)
    return (xh.new_empty(xh.shape, **f32), xh.new_empty(kh.shape, **f32), xh.new_empty(v.shape, **f32),
            xh.new_empty(sig.shape, **f32), xh.new_empty(lse.shape, **f32))  # fmt: skip


def _setup_fwd(ctx, inputs, output):
    q, k, v, w, beta, g, cu_seqlens, scale = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, w, beta, g, cu_seqlens, o, lse)
    ctx.scale = scale


class Chunking(NamedTuple):
    """Packed sequences laid out chunk-aligned, so that the chunk-local terms of all of them are one batch: each
    sequence padded to whole chunks. ``gather [N·C]``: the token of each aligned position (``T``, a zero row, for
    padding); ``scatter [T]``: the aligned position of each token; with superblocks, ``table [S, R]``: the chunks of
    each superblock of each sequence (``N``, an identity carry, past a sequence's end) and ``slot [N]``: each
    chunk's place in ``table``, flattened."""

    gather: torch.Tensor
    scatter: torch.Tensor
    table: torch.Tensor | None
    slot: torch.Tensor | None


def _chunking(segments, seq_len: int, chunk: int, span: int | None, device: torch.device) -> Chunking:
    """:class:`Chunking` of the packed sequences ``segments`` (host offsets, non-empty) of ``seq_len`` tokens."""
    gather, scatter, table, n = [], [], [], 0
    for bos, eos in segments:
        length, chunks = eos - bos, -(-(eos - bos) // chunk)
        aligned = torch.arange(bos, bos + chunks * chunk)
        gather.append(torch.where(aligned < eos, aligned, seq_len))
        scatter.append(torch.arange(n * chunk, n * chunk + length))
        if span is not None:
            sb = torch.arange(n, n + -(-chunks // span) * span).view(-1, span)
            table.append(torch.where(sb < n + chunks, sb, -1))
        n += chunks
    slot = None
    if span is not None:
        table = torch.cat(table)
        flat = table.flatten()
        slot = torch.empty(n, dtype=torch.int64)
        slot[flat[flat >= 0]] = torch.nonzero(flat >= 0).flatten()
        table = torch.where(table >= 0, table, n)
    on = dict(device=device)
    return Chunking(
        torch.cat(gather).to(**on), torch.cat(scatter).to(**on),
        None if span is None else table.to(**on), None if span is None else slot.to(**on),
    )  # fmt: skip


def _tokens(t: torch.Tensor, length: int, chunking: Chunking | None) -> torch.Tensor:
    """``[B, H, N, C, *D]`` chunked (chunk-aligned with ``chunking``) -> ``[B, length, H, *D]`` tokens."""
    B, H, N, C = t.shape[:4]
    t = t.movedim(1, 3).reshape(B, N * C, H, *t.shape[4:])
    return t[:, :length] if chunking is None else t[:, chunking.scatter]


def _aligned(x: torch.Tensor | None, chunking: Chunking | None) -> torch.Tensor | None:
    """``[1, T, ...]`` packed tokens -> ``[1, N·C, ...]`` chunk-aligned (zeros in the padding); as is without
    ``chunking`` (a dense batch)."""
    if x is None or chunking is None:
        return x
    return torch.cat([x, x.new_zeros(1, 1, *x.shape[2:])], 1)[:, chunking.gather]


def _chunk_terms(q, k, w, beta, g, scale, chunk, span, with_carries, chunking):
    """The chunk-local terms, differentiable, in the kernels' layouts: ``x [B,T,HQ,K]``, ``kt [B,T,H,K]``,
    ``m [chunks,H,C,C]``, each chunk's ``Wᵀ M W = I − A`` ``[chunks,H,K,K]`` (with ``with_carries``, else None),
    float32, the intra-chunk logits ``[B,HQ,N,C,C]``, and ``M W`` per chunk ``[B,T,H,K]`` (detached: the kernels'
    shortcut for the carries); with ``span`` (chunks per superblock, or None) also the superblock-local terms
    (:func:`attnkit.ops.path.torch_impl.superblock_terms`): ``xh [B,T,HQ,K]``, ``kh [B,T,H,K]`` and
    ``sig [superblocks,H,BK,BK]`` (zero-padded to the kernels' block), else None for each. Packed sequences
    (``chunking``) go as one chunk-aligned batch."""
    B, T, HQ, K = q.shape
    H = k.shape[2]
    BK = block_dim(K)
    q, k, w, beta, g = (_aligned(t, chunking) for t in (q, k, w, beta, g))
    terms = chunk_local_terms(q, k, w, beta, g, scale, chunk, torch.float32)
    n = terms["M"].shape[2]

    def tokens(t: torch.Tensor) -> torch.Tensor:
        return _tokens(t, T, chunking)

    x, kt = tokens(terms["x"]), tokens(terms["kt"])
    m = terms["M"].transpose(1, 2).reshape(B * n, H, chunk, chunk)
    mw = tokens(terms["M"].detach() @ terms["w"].detach())
    carries = xh = kh = sig = None
    if with_carries or span is not None:
        carry = terms["w"].transpose(-1, -2) @ (terms["M"] @ terms["w"])  # I − A: Wᵀ M W per chunk
    if with_carries:
        carries = carry.transpose(1, 2).reshape(B * n, H, K, K)
    if span is not None:
        eye = torch.eye(K, dtype=torch.float32, device=q.device)
        table = None if chunking is None else (chunking.table, chunking.slot)
        xh, kh, sig = superblock_terms(terms["x"], terms["kt"], eye - carry, span, table)
        xh, kh = tokens(xh), tokens(kh)
        sig = F.pad(sig, (0, BK - K, 0, BK - K))
        sig = sig.transpose(1, 2).reshape(B * sig.shape[2], H, BK, BK)
    return x, kt, m, carries, terms["s"], mw, xh, kh, sig


def _superblock_cuts(segments, batch: int, seq_len: int, length: int, device: torch.device) -> torch.Tensor:
    """Offsets ``[M+1]`` (int32) that cut the ``batch * seq_len`` tokens of the flattened batch into runs of at most
    ``length`` within each sequence: the chunk-by-chunk kernels, run on these runs as on packed sequences, meet the
    chunk pairs inside a superblock only."""
    cuts = [b * seq_len + t for b in range(batch) for bos, eos in segments for t in range(bos, eos, length)]
    return torch.tensor(cuts + [batch * seq_len], dtype=torch.int32, device=device)


def _diagonal_grads(logits, lse, do, v, delta, chunk, chunking):
    """Within each chunk, in PyTorch: ``dS = P (dO Vᵀ − Δ)`` with ``P = exp(S − lse)`` (``logits [B,HQ,N,C,C]``,
    chunk-aligned as :func:`_chunk_terms` gives them), and ``dV = Pᵀ dO`` (per query head, ``[B,T,HQ,V]``
    float32)."""
    B, T, HQ = lse.shape
    groups = HQ // v.shape[2]
    do, v, lse, delta = (_aligned(t, chunking) for t in (do, repeat_kv(v, groups), lse, delta))
    doc, vc = _chunk(do, chunk, torch.float32), _chunk(v, chunk, torch.float32)
    p = torch.exp(logits - _chunk(lse, chunk, torch.float32)[..., None])
    ds = p * (doc @ vc.transpose(-1, -2) - _chunk(delta, chunk, torch.float32)[..., None])
    return ds, _tokens(p.transpose(-1, -2) @ doc, T, chunking)


BACKWARD_BUDGET_BYTES = 1 << 29  # the backward's working set per slice of heads (the kernels' scratch aside)


def heads_per_slice(B: int, T: int, HQ: int, H: int, K: int, V: int, chunk: int) -> int:
    """Key/value heads (with their query heads) the backward takes at a time: as many as keep its float32 working
    set — the chunk-local terms and their autograd graph, the kernels' inputs and gradients, about
    ``20·max(K, V) + 15·C`` numbers a token and query head (peak memory measured on an H200 at 9d16e14, 32768
    tokens: 4552 MiB with K = C = 64 and 16 heads, 3172 MiB with K = 128, C = 32 and 8 heads) — within
    ``BACKWARD_BUDGET_BYTES``, and at least one. Slicing bounds the peak however many heads a layer has; it costs a
    pass of launches per slice."""
    per_head = B * T * (HQ // H) * (20 * max(K, V) + 15 * chunk) * 4
    return max(1, min(H, BACKWARD_BUDGET_BYTES // max(per_head, 1)))


def _fwd_backward(ctx, do, dlse):
    """The fused backward, one slice of heads at a time (:func:`heads_per_slice`): see :func:`_slice_backward`. It
    runs in the autograd engine rather than inside an operator because autograd does not record inside an
    operator's kernel."""
    if do is None:
        return (None,) * 8
    q, k, v, w, beta, g, cu_seqlens, o, lse = ctx.saved_tensors
    B, T, HQ, K = q.shape
    H = k.shape[2]
    groups = HQ // H
    chunk = backward.backward_config(K)[0]
    segments = [(bos, eos) for bos, eos in segment_bounds(cu_seqlens, T) if eos > bos]  # one host sync
    longest = max((eos - bos for bos, eos in segments), default=0)
    span, cuts = prepare.superblock_chunks(K, chunk), None
    if span < -(-longest // chunk):  # some query meets an earlier superblock
        cuts = _superblock_cuts(segments, B, T, span * chunk, q.device)
    # Packed sequences: their chunk-local terms as one chunk-aligned batch (one host-to-device copy a backward).
    chunking = None if cu_seqlens is None else _chunking(segments, T, chunk, None if cuts is None else span, q.device)
    plan = (cu_seqlens, ctx.scale, chunking, chunk, longest, span, cuts)
    step = heads_per_slice(B, T, HQ, H, K, v.shape[-1], chunk)
    if step == H:
        grads = _slice_backward(q, k, v, w, beta, g, o, lse, do.contiguous(), *plan)
        return *grads, None, None
    grads = [torch.empty_like(t) for t in (q, k, v, w, beta)] + [None if g is None else torch.empty_like(g)]
    for h0 in range(0, H, step):
        kv, qh = slice(h0, min(H, h0 + step)), slice(h0 * groups, min(H, h0 + step) * groups)
        which = (qh, kv, kv, kv, kv, qh, qh, qh, qh)  # the heads of q, k, v, w, beta, g, o, lse, do
        tensors = (q, k, v, w, beta, g, o, lse, do)
        sliced = [None if t is None else t[:, :, heads].contiguous() for t, heads in zip(tensors, which)]
        part = _slice_backward(*sliced, *plan)
        for full, grad, heads in zip(grads, part, which):  # dq, dk, dv, dw, dbeta, dg: the first six
            if full is not None:
                full[:, :, heads] = grad
    return *grads, None, None


def _suffix_sums(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """``x [B,T,H]`` summed from each token to the end of its sequence (along ``T``; packed sequences restart at
    ``cu_seqlens``), on the device."""
    total = x.flip(1).cumsum(1).flip(1)
    if cu_seqlens is None:
        return total
    T = x.shape[1]
    positions = torch.arange(T, device=x.device)
    ends = cu_seqlens[torch.searchsorted(cu_seqlens[1:], positions, right=True) + 1].long()
    return total - F.pad(total, (0, 0, 0, 1))[:, ends]


def _slice_backward(q, k, v, w, beta, g, o, lse, do, cu_seqlens, scale, chunking, chunk, longest, span, cuts):
    """The fused backward of one slice of heads (contiguous tensors): the chunk-local and superblock-local terms
    recomputed with autograd (``T·C`` numbers a head), the gradients between chunks of a superblock and between
    superblocks from the kernels (O(T) memory), the diagonal blocks in PyTorch, and autograd back through the
    local terms. ``longest``: the longest sequence; ``span``: chunks per superblock; ``cuts``: the flattened batch
    cut at superblock boundaries (:func:`_superblock_cuts`), or None where no query meets an earlier superblock
    (chunk by chunk throughout). Nothing here reads the device back. Returns ``(dq, dk, dv, dw, dbeta, dg)`` in
    the inputs' dtypes (``dg`` None without gates)."""
    B, T, HQ, K = q.shape
    H = k.shape[2]
    groups = HQ // H
    if cuts is None:
        span = None
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, w, beta)]
        gate = None if g is None else g.detach()  # its gradient comes from the sums of dS below, not autograd
        sums_da = backward.sums_carry_gradient(K, chunk)  # the kernels sum dA (else dM, dW)
        x, kt, m, carry, logits, mw, xh, kh, sig = _chunk_terms(*leaves, gate, scale, chunk, span, sums_da, chunking)
    delta = (do.float() * o.float()).sum(-1)
    gcum = None if g is None else g.float().cumsum(1).contiguous()
    inputs = (x.detach(), kt.detach(), v, w, m.detach(), mw, gcum, do, lse, delta)
    if span is None:
        dkt, dv, dx, dw_between, dm, da, dgcum = path_bwd_between_op(*inputs, cu_seqlens, scale, chunk, longest)
    else:
        # Within superblocks: the chunk-by-chunk kernels on the flattened batch cut at superblock boundaries.
        flat = [t if t is None or i == 4 else t.reshape(1, B * T, *t.shape[2:]) for i, t in enumerate(inputs)]  # m: 4
        dkt, dv, dx, dw_between, dm, da, dgcum = path_bwd_between_op(*flat, cuts, scale, chunk, span * chunk)
        dkt, dv, dx, dgcum = (t.view(B, T, *t.shape[2:]) for t in (dkt, dv, dx, dgcum))
        dxh, dkh, dv_super, dsig, dg_super = path_bwd_super_op(
            xh.detach(), kh.detach(), v, sig.detach(), gcum, do, lse, delta, cu_seqlens, scale, chunk, span, longest
        )
        dv, dgcum = dv + dv_super, dgcum + dg_super
    ds, dv_diag = _diagonal_grads(logits.detach(), lse, do, v, delta, chunk, chunking)
    outputs, grad_outputs = [x, kt, logits], [dx, dkt, ds]
    if sums_da:  # the carries' gradient dA_m, taken back by autograd through A_m − I = −W_mᵀ M_m W_m
        outputs, grad_outputs = outputs + [carry], grad_outputs + [-da[..., :K, :K]]
    else:
        outputs, grad_outputs = outputs + [m], grad_outputs + [dm]
    if span is not None:
        outputs, grad_outputs = outputs + [xh, kh, sig], grad_outputs + [dxh, dkh, dsig]
    grads = torch.autograd.grad(outputs, leaves, grad_outputs, allow_unused=True)
    dq, dk, dw, dbeta = (torch.zeros_like(t) if d is None else d for t, d in zip(leaves, grads))
    if not sums_da:
        dw = dw + dw_between.view(dw.shape)
    dv = dv + (dv_diag if groups == 1 else dv_diag.view(B, T, H, groups, -1).sum(3))
    dg = None
    if g is not None:
        # dgcum holds the kernels' row and column sums of dS (both from the same tiles: key_chunk_grads says why);
        # the diagonal blocks add theirs. gcum is a cumulative sum, so its gradient sums from each token to the end
        # of its sequence (restarting at each: a sequence's sums are zero only up to rounding).
        dgcum = dgcum + _tokens(ds.sum(-1) - ds.sum(-2), T, chunking)
        dg = _suffix_sums(dgcum, cu_seqlens).to(g.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dw.to(w.dtype), dbeta.to(beta.dtype), dg


path_fwd_op.register_autograd(_fwd_backward, setup_context=_setup_fwd)
