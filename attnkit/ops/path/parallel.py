"""PaTH's Triton kernels as PyTorch operators: ``attnkit::path_fwd`` (the fused forward, with an autograd
registration), ``attnkit::path_bwd`` (the fused backward, its formula) and ``attnkit::path_decode_`` (the in-place
fused decode step).

``torch.library.custom_op`` with fake (meta) implementations, so that ``torch.compile`` traces through the kernels
and ``torch.library.opcheck`` can hold the registrations to them. The backward is kernels only (no autograd inside,
no loop over heads, no host sync): :func:`path_bwd_fn` says which, ``README.md`` beside the op derives them.
"""

from __future__ import annotations

import torch
import triton

from attnkit.ops.common.triton.rowdot import output_delta
from attnkit.ops.common.triton.scan import segment_cumsum
from attnkit.ops.common.triton_utils import block_dim
from attnkit.ops.path.triton import backward, local, prepare
from attnkit.ops.path.triton.backward_super import path_bwd_super_fn
from attnkit.ops.path.triton.carry import carry_keys_fn
from attnkit.ops.path.triton.decode import path_decode_fn
from attnkit.ops.path.triton.forward import keeps_carried, path_fwd_fn

# 16-bit inputs whose padded key dim is below this take the backward with q, k and w zero-padded to this key dim
# (exact: a zero coordinate of w leaves the transitions the identity there, and zero coordinates of q and k add
# nothing to a logit; the gradients are cut back). On the H200 (Triton 3.6) the bf16 backward at K = 16 and 32 gave
# non-finite dv and dq, or an illegal memory access, where bf16 at K = 48 and 64 held to the PyTorch backend
# (test_bf16_small_head_dims_on_gpu). compute-sanitizer put an out-of-bounds shared-memory read inside
# path_local_bwd_kernel's one-pass TF32 tl.dot at BK = 16: the compiler's layout, not the kernel's indexing. The tenth
# session's fallback, the backward in float32, compiled the local adjoint's exact (ieee, FMA-unrolled) products at
# K = 32 for over 170 s (eleventh session); padded, the step runs the K = 64 kernels a D = 64 model already compiled
# (benchmarks/results/path_h200.md). 0 turns the padding off.
PAD_BELOW = 64
# The forward's prepare kernel (the UT solve: M, K̃, M W per chunk) kept for the backward, which then skips its own,
# where both chunk alike and the backward does not pad (:func:`keeps_prepared`: K <= 64 on the GPU): M W and M are the
# same numbers, and K̃ is written in float32 (the forward rounds it to k's dtype for its logits). Costs 768 bytes a
# position and key/value head of saved float32 tensors between the forward and the backward. False: the backward
# prepares again (benchmarks/path_tune.py's LOCAL row "prepare again in the backward").
KEEP_PREPARED = True


def keeps_prepared(dtype: torch.dtype, key_dim: int) -> bool:
    """Whether the forward of inputs of ``dtype`` at head dim ``key_dim`` keeps its prepare kernel's outputs for the
    backward (:data:`KEEP_PREPARED`): the backward's chunk is the forward's and it runs on the unpadded inputs."""
    padded = dtype != torch.float32 and block_dim(key_dim) < PAD_BELOW
    return KEEP_PREPARED and not padded and prepare.chunk_size(key_dim) == backward.backward_config(key_dim)[0]


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
    keep: bool = False,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """``(o [B,T,HQ,V] in v.dtype, lse [B,T,HQ] float32, m, kt, mw, kh, sig, x, xh)`` through the fused forward
    (validated inputs; CPU tensors run through Triton's interpreter). With ``keep`` (the caller will differentiate) and
    where :func:`keeps_prepared`, ``m, kt, mw`` are the prepare kernel's outputs for the backward (``kt`` in
    ``prepare.buffer_dtype``, ``m`` and ``mw`` float32), ``x`` the queries carried to their chunk's start (in
    ``prepare.buffer_dtype``), and ``kh, sig, xh`` the keys carried to their superblock's end, the superblocks'
    transitions and the queries carried to their superblock's start, where the forward carried them as the backward
    would (``forward.keeps_carried``); else empty."""
    q, k, v, w, beta = (x.contiguous() for x in (q, k, v, w, beta))
    g = None if g is None else g.contiguous()
    if keep and keeps_prepared(q.dtype, q.shape[-1]):
        return path_fwd_fn(q, k, v, w, beta, g, scale, cu_seqlens, keep=True)
    o, lse = path_fwd_fn(q, k, v, w, beta, g, scale, cu_seqlens)
    return o, lse, *(lse.new_empty(0) for _ in range(7))


@path_fwd_op.register_fake
def _(q, k, v, w, beta, g, cu_seqlens, scale, keep=False):
    B, T, HQ, K = q.shape
    o, lse = q.new_empty(B, T, HQ, v.shape[-1], dtype=v.dtype), q.new_empty(B, T, HQ, dtype=torch.float32)
    if not (keep and keeps_prepared(q.dtype, K)):
        return o, lse, *(lse.new_empty(0) for _ in range(7))
    BT, NC, H = prepare.chunk_size(K), triton.cdiv(T, prepare.chunk_size(K)), k.shape[2]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    rows = B * NC if cu_seqlens is None else NC + N
    kt, mw = q.new_empty(k.shape, dtype=prepare.buffer_dtype(q.dtype, K)), q.new_empty(k.shape, dtype=torch.float32)
    m = q.new_empty(rows, H, BT, BT, dtype=torch.float32)
    x = q.new_empty(q.shape, dtype=prepare.buffer_dtype(q.dtype, K))
    R = prepare.superblock_chunks(K, BT)
    if T == 0 or N == 0 or R >= NC or not keeps_carried(q.dtype, K, v.shape[-1]):
        return o, lse, m, kt, mw, lse.new_empty(0), lse.new_empty(0), x, lse.new_empty(0)
    NSB = triton.cdiv(T, BT * R)
    spans = B * NSB if cu_seqlens is None else NSB + N
    kh = q.new_empty(k.shape, dtype=prepare.buffer_dtype(q.dtype, K))
    sig = q.new_empty(spans, H, block_dim(K), block_dim(K), dtype=torch.float32)
    return o, lse, m, kt, mw, kh, sig, x, q.new_empty(q.shape)


def _setup_fwd(ctx, inputs, output):
    q, k, v, w, beta, g, cu_seqlens, scale, _ = inputs
    o, lse, *kept = output  # m, kt, mw, kh, sig, x, xh
    ctx.mark_non_differentiable(lse, *kept)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, w, beta, g, cu_seqlens, o, lse, *kept)
    ctx.scale = scale


def _superblock_cuts(
    cu_seqlens: torch.Tensor | None,
    offsets: torch.Tensor | None,
    batch: int,
    seq_len: int,
    chunk: int,
    span: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cuts, their chunk offsets)`` (int32), computed on the device: ``cuts`` cut the ``batch * seq_len`` tokens of
    the flattened batch into runs of ``span`` chunks (superblocks) within each sequence, ``⌈seq_len / (span·chunk)⌉``
    runs a sequence, those past its end empty; the chunk-by-chunk kernels, run on these runs as on packed sequences,
    meet the chunk pairs inside a superblock only. A run starts on a chunk of its sequence, so the chunks keep their
    rows in the per-chunk arrays (``offsets``: each sequence's first row, ``chunk_offsets(cu_seqlens, chunk)``)."""
    steps = torch.arange(0, triton.cdiv(seq_len, chunk * span), device=device)
    if cu_seqlens is None:
        starts = torch.arange(batch + 1, device=device)
        bounds, first = starts * seq_len, starts * triton.cdiv(seq_len, chunk)
    else:
        bounds, first = cu_seqlens.to(torch.int64), offsets.to(torch.int64)
    cuts = torch.minimum(bounds[:-1, None] + steps * (span * chunk), bounds[1:, None]).flatten()
    rows = torch.minimum(first[:-1, None] + steps * span, first[1:, None]).flatten()
    return torch.cat([cuts, bounds[-1:]]).to(torch.int32), torch.cat([rows, first[-1:]]).to(torch.int32)


def path_bwd_fn(q, k, v, w, beta, g, cu_seqlens, o, lse, do, scale, prepared=None):
    """The fused backward of ``attnkit::path_fwd`` (contiguous inputs): ``(dq, dk, dv, dw, dbeta)`` in the inputs'
    dtypes (``dv`` summed in float32 across the kernels, rounded once by the last) and ``dg`` in ``g``'s dtype (empty
    without gates). Kernels only, a fixed number of launches besides the waves of the kernels between chunks and
    superblocks (each a function of the shapes and a memory budget), and no host sync:

    1. the prepare kernel (``M``, ``K̃``, ``M W`` per chunk; or ``prepared``, the forward's, :func:`keeps_prepared`,
       when it holds them), the queries carried to their chunk's and superblock's
       start (:func:`local.query_terms_fn`), the keys carried to their superblock's end and each superblock's ``Σ``
       (:func:`carry.carry_keys_fn`); or those the forward kept (``prepared``: ``x`` always, ``kh``, ``Σ`` and ``x̂``
       where ``forward.keeps_carried``);
    2. the gradients between superblocks (``backward_super.py``: one key-major sweep, ``E``'s rows in waves) and
       between chunks inside each superblock (``backward.py``, on the flattened batch cut at superblock boundaries);
    3. the superblock-local terms' adjoint and the chunk-local terms' adjoint with the diagonal blocks
       (``local.py``), which give ``dq, dk, dw, dbeta``; where :func:`local.terms_in_place`, the superblock-local
       terms' adjoint runs before the kernels between chunks, in place of ``dx̂`` and ``dk̂``.

    16-bit inputs at a padded key dim below ``PAD_BELOW`` take it with ``q, k, w`` zero-padded to ``PAD_BELOW``.
    Buffers are dropped as soon as the last kernel that reads them has run.
    """
    B, T, HQ, K = q.shape
    if q.dtype != torch.float32 and block_dim(K) < PAD_BELOW:
        q, k, w = (torch.nn.functional.pad(t, (0, PAD_BELOW - K)) for t in (q, k, w))
        dq, dk, dv, dw, dbeta, dg = path_bwd_fn(q, k, v, w, beta, g, cu_seqlens, o, lse, do, scale)
        return dq[..., :K].contiguous(), dk[..., :K].contiguous(), dv, dw[..., :K].contiguous(), dbeta, dg
    H, V = k.shape[2], v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    chunk = backward.backward_config(K)[0]
    span = prepare.superblock_chunks(K, chunk)
    supers = span < triton.cdiv(T, chunk)  # some query may meet an earlier superblock (T bounds every sequence)
    offsets = prepare.chunk_offsets(cu_seqlens, chunk)
    NC = triton.cdiv(T, chunk)
    rows = B * NC if cu_seqlens is None else NC + N  # every sequence's chunks (an upper bound when packed)
    f32 = dict(dtype=torch.float32, device=q.device)
    carry = prepare.precisions(q.dtype, K)[1]
    config = prepare.launch_config()  # the prepare and carry kernels as the forward launches them
    work = prepare.buffer_dtype(q.dtype, K)  # K̃, x and k̂: float32, or float16 for 16-bit inputs
    carried, queries = None, None  # the forward's carried keys and transitions, and its carried queries, if kept
    if prepared is not None and prepared[0].numel() > 0:
        m, kt, mw, kh, sig, x, xh = prepared
        carried = (kh, sig) if kh.numel() > 0 else None
        queries = (x, xh if xh.numel() > 0 else None) if x.numel() > 0 else None
    else:
        m = torch.empty(rows, H, chunk, chunk, **f32)
        kt, mw = torch.empty(k.shape, dtype=work, device=q.device), torch.empty(k.shape, **f32)
        prepare.path_prepare_kernel[(NC, N * H)](
            k, w, beta, m, kt, mw, cu_seqlens, offsets, T, NC, H=H, K=K, BK=block_dim(K), BT=chunk,
            IS_VARLEN=cu_seqlens is not None, PRECISION=carry, WRITE_MW=True, SB=prepare.solve_rows(chunk),
            BATCHED=prepare.solve_batched(), **config,
        )  # fmt: skip
    del prepared
    inner = prepare.inner_carry(q.dtype, K) if supers else None  # the carries inside superblocks
    low_grad = prepare.measured_16bit(q.dtype, K) if backward.INNER_LOW_GRAD is None else backward.INNER_LOW_GRAD
    if queries is None or (supers and queries[1] is None):
        x, xh = local.query_terms_fn(q, w, mw, cu_seqlens, chunk, span if supers else None, inner, work)
    else:
        x, xh = queries
    del queries
    delta = output_delta(o, do)
    gcum = None if g is None else segment_cumsum(g, cu_seqlens, 1.0, False, torch.float32)  # as the forward's
    dgcum = None if g is None else torch.zeros(B, T, HQ, **f32)  # atomic adds: zeroed
    if supers:
        sb_offsets = prepare.chunk_offsets(cu_seqlens, chunk * span)
        if carried is not None:
            kh, sig = carried
        else:
            kh, sig, _ = carry_keys_fn(
                w, kt, m, cu_seqlens, span, work, True, carry, config, longest=T, offsets=offsets,
                sb_offsets=sb_offsets,
            )  # fmt: skip
        del carried
        # The sweep stores dk̂, dV and dΣ first (no zeros before it), and zeroes dx̂ for its atomic adds.
        dxh, dkh, dv, dsig, _ = path_bwd_super_fn(
            xh, kh, v, sig, gcum, do, lse, delta, scale, cu_seqlens, chunk, span, T, sb_offsets, None, dgcum
        )  # fmt: skip
        del xh, kh, sig
        # Within superblocks: the chunk-by-chunk kernels on the flattened batch cut at superblock boundaries.
        cuts, cut_offsets = _superblock_cuts(cu_seqlens, offsets, B, T, chunk, span, q.device)
        inputs = (x, kt, v, w, m, mw, gcum, do, lse, delta)
        flat = [t if t is None or i == 4 else t.reshape(1, B * T, *t.shape[2:]) for i, t in enumerate(inputs)]
        between = (*flat, scale, cuts, chunk, span * chunk, cut_offsets, dv.view(1, B * T, H, V),
                   None if g is None else dgcum.view(1, B * T, HQ), inner, low_grad, backward.INNER_EVERY)  # fmt: skip
        if local.terms_in_place(K, chunk):
            # The superblock terms first: dx̂ and dk̂ become dx's and dK̃'s shares, which the kernels between chunks
            # then add theirs to (local.SUPER_TERMS_IN_PLACE); the terms store every chunk's dA first.
            da = torch.empty(rows, H, block_dim(K), block_dim(K), **f32)
            local.super_terms_bwd_fn(
                x, kt, w, mw, dxh, dkh, dsig, dxh, dkh, da, cu_seqlens, chunk, span, q.dtype, offsets, sb_offsets,
                inner, in_place=True,
            )  # fmt: skip
            del dsig
            dkt, _, dx, dw_in, dm, da, _ = backward.path_bwd_between_fn(
                *between, dkt=dkh.view(1, B * T, H, K), dx=dxh.view(1, B * T, HQ, K), da=da
            )
            del dxh, dkh
            dkt, dx = dkt.view(B, T, H, K), dx.view(B, T, HQ, K)
        else:
            dkt, _, dx, dw_in, dm, da, _ = backward.path_bwd_between_fn(*between)
            dkt, dx = dkt.view(B, T, H, K), dx.view(B, T, HQ, K)
            # Where the kernels between chunks gave dM, dW, the superblocks' dA goes onto them too (or on its own).
            project = da.numel() == 0 and local.SUPER_DA_PROJECT
            if da.numel() == 0 and not project:
                da = torch.zeros(rows, H, block_dim(K), block_dim(K), **f32)
            dw_in = dw_in.view(B, T, H, K) if project else dw_in
            local.super_terms_bwd_fn(
                x, kt, w, mw, dxh, dkh, dsig, dx, dkt, None if project else da, cu_seqlens, chunk, span, q.dtype,
                offsets, sb_offsets, inner, m, dm, dw_in,
            )  # fmt: skip
            del dxh, dkh, dsig
        del inputs, flat, between  # they hold x, K̃ and M W, which the local adjoint does not read
    else:
        dkt, dv, dx, dw_in, dm, da, dgcum = backward.path_bwd_between_fn(
            x, kt, v, w, m, mw, gcum, do, lse, delta, scale, cu_seqlens, chunk, T, offsets, None, dgcum
        )
    del x, kt, mw
    has_da, has_dm = da.numel() > 0, dm.numel() > 0
    dv_out = torch.empty_like(v)  # the local adjoint, dV's last writer, rounds the float32 sum into v's dtype
    dq, dk, dw, dbeta = local.local_bwd_fn(
        q, k, v, w, beta, m, gcum, do, lse, delta, dx, dkt, da if has_da else None, dm if has_dm else None,
        dw_in if has_dm else None, dv, dgcum if g is not None else None, scale, cu_seqlens, chunk, offsets, dv_out,
    )  # fmt: skip
    # gcum is a cumulative sum: its gradient sums from each token to the end of its sequence.
    dg = q.new_empty(0) if g is None else segment_cumsum(dgcum, cu_seqlens, 1.0, True, g.dtype)
    return dq, dk, dv_out, dw, dbeta, dg


@torch.library.custom_op("attnkit::path_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def path_bwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    scale: float,
    m: torch.Tensor | None = None,
    kt: torch.Tensor | None = None,
    mw: torch.Tensor | None = None,
    kh: torch.Tensor | None = None,
    sig: torch.Tensor | None = None,
    x: torch.Tensor | None = None,
    xh: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused backward (:func:`path_bwd_fn`) as one operator: ``(dq, dk, dv, dw, dbeta)`` in the inputs' dtypes
    and ``dg`` (empty without gates). ``m, kt, mw``: the forward's prepared tensors, ``kh, sig, x, xh``
    its carried keys, superblock transitions and carried queries (``path_fwd_op(keep=True)``), or None / empty to
    compute them here."""
    q, k, v, w, beta, o, do = (t.contiguous() for t in (q, k, v, w, beta, o, do))
    empty = q.new_empty(0)
    prepared = None if m is None else tuple(empty if t is None else t for t in (m, kt, mw, kh, sig, x, xh))
    g = None if g is None else g.contiguous()
    return path_bwd_fn(q, k, v, w, beta, g, cu_seqlens, o, lse, do, scale, prepared)


@path_bwd_op.register_fake
def _(q, k, v, w, beta, g, cu_seqlens, o, lse, do, scale, m=None, kt=None, mw=None, kh=None, sig=None, x=None, xh=None):
    dg = q.new_empty(0) if g is None else g.new_empty(g.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), w.new_empty(w.shape), beta.new_empty(
        beta.shape), dg  # fmt: skip


def _fwd_backward(ctx, do, *_):
    """The backward formula of ``attnkit::path_fwd``: one call of ``attnkit::path_bwd`` (with the forward's prepared
    tensors, carried keys and queries where it kept them)."""
    if do is None:
        return (None,) * 9
    q, k, v, w, beta, g, cu_seqlens, o, lse, *kept = ctx.saved_tensors  # m, kt, mw, kh, sig, x, xh
    dq, dk, dv, dw, dbeta, dg = path_bwd_op(q, k, v, w, beta, g, cu_seqlens, o, lse, do, ctx.scale, *kept)
    return dq, dk, dv, dw, dbeta, None if g is None else dg, None, None, None


path_fwd_op.register_autograd(_fwd_backward, setup_context=_setup_fwd)
