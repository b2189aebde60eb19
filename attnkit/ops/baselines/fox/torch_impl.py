"""Blockwise PyTorch backend of FoX: the CPU implementation and the oracle for the kernels.

Query blocks × key blocks with FlashAttention's online softmax: the largest intermediate is one tile of logits,
``[B*H, G*BT, BT]`` (the ``G = HQ // H`` query heads of a key/value head stacked along the rows, so that GQA is a
plain ``bmm``). The backward recomputes every tile from the saved log-sum-exp; the gate's gradient needs only the
tiles' column sums of ``dS`` (``README.md``).
"""

from __future__ import annotations

import math

import torch

from attnkit.ops.common.utils import autocast_off, compute_dtype

# Rows and columns of a tile. Larger tiles mean fewer Python-level steps (each a handful of bmm and elementwise
# ops); on CPU 128 keeps one [B*H, G*128, 128] tile and its work buffers in cache at B*H = 32. On CUDA each step is
# a dozen kernel launches, so the tiles are larger (the memory is still bounded by the tile, not by T).
BLOCK_T = 128
BLOCK_T_CUDA = 512


def _tile_logits(q, k, gq, gk, G, start, causal):
    """``[BH, G*rows, cols]`` logits of one tile: ``q`` scaled ``[BH, G*rows, K]``, ``k [BH, cols, K]``, the
    gates ``gq [BH, G, rows, 1]`` and ``gk [BH, G, 1, cols]`` (or None); the causal mask when ``causal`` (the
    tile's first key is ``start`` positions before its first query)."""
    s = torch.bmm(q, k.transpose(1, 2))
    BH, rows, cols = s.shape
    s4 = s.view(BH, G, rows // G, cols)
    if gq is not None:
        s4 += gq - gk
    if causal:
        above = torch.ones(rows // G, cols, dtype=torch.bool, device=s.device).triu_(start + 1)
        s4.masked_fill_(above, -math.inf)
    return s


# Autocast off: the tiles are computed in the dtype chosen here (float32), whatever autocast is on around the op.
@autocast_off
def _fox_fwd(q, k, v, gc, o, lse, scale, block):
    """One dense segment. ``q [B,H,G,L,K]``, ``k [B,H,L,K]``, ``v [B,H,L,V]``, ``gc [B,H,G,L]`` (the gate's
    cumulative sum, or None) in the compute dtype; writes ``o [B,H,G,L,V]`` and ``lse [B,H,G,L]``."""
    B, H, G, L, K = q.shape
    BH = B * H
    k, v = k.reshape(BH, L, K), v.reshape(BH, L, -1)
    gc = None if gc is None else gc.reshape(BH, G, L)
    for start in range(0, L, block):
        end = min(start + block, L)
        rows = end - start
        qb = q[:, :, :, start:end].reshape(BH, G * rows, K) * scale
        gq = None if gc is None else gc[:, :, start:end, None]
        acc = q.new_zeros(BH, G * rows, v.shape[-1])
        row_max = q.new_full((BH, G * rows, 1), -math.inf)
        row_sum = q.new_zeros(BH, G * rows, 1)
        for ks in range(0, end, block):
            ke = min(ks + block, end)
            gk = None if gc is None else gc[:, :, None, ks:ke]
            s = _tile_logits(qb, k[:, ks:ke], gq, gk, G, start - ks, ke > start)
            new_max = torch.maximum(row_max, s.amax(-1, keepdim=True))
            p = s.sub_(new_max).exp_()
            rescale = (row_max - new_max).exp_()
            row_sum = row_sum * rescale + p.sum(-1, keepdim=True)
            acc = torch.baddbmm(acc * rescale, p, v[:, ks:ke])
            row_max = new_max
        o[:, :, :, start:end] = (acc / row_sum).view(B, H, G, rows, -1)
        lse[:, :, :, start:end] = (row_max + row_sum.log()).view(B, H, G, rows)


@autocast_off
def _fox_bwd(q, k, v, gc, do, lse, delta, scale, block):
    """One dense segment; shapes as in :func:`_fox_fwd`, ``do`` like ``o``, ``delta = rowsum(dO ⊙ O)``.
    Returns ``dq [B,H,G,L,K]``, ``dk [B,H,L,K]``, ``dv [B,H,L,V]`` and ``dG [B,H,G,L]`` (the gradient of the
    cumulative gate, None without a gate) in the compute dtype."""
    B, H, G, L, K = q.shape
    BH = B * H
    k, v = k.reshape(BH, L, K), v.reshape(BH, L, -1)
    gc = None if gc is None else gc.reshape(BH, G, L)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dgc = None if gc is None else torch.zeros_like(gc)
    for start in range(0, L, block):
        end = min(start + block, L)
        rows = end - start
        qb = q[:, :, :, start:end].reshape(BH, G * rows, K)
        qs = qb * scale
        b_do = do[:, :, :, start:end].reshape(BH, G * rows, -1)
        b_lse = lse[:, :, :, start:end].reshape(BH, G * rows, 1)
        b_delta = delta[:, :, :, start:end].reshape(BH, G * rows, 1)
        gq = None if gc is None else gc[:, :, start:end, None]
        dqb = torch.zeros_like(qb)
        for ks in range(0, end, block):
            ke = min(ks + block, end)
            gk = None if gc is None else gc[:, :, None, ks:ke]
            p = _tile_logits(qs, k[:, ks:ke], gq, gk, G, start - ks, ke > start).sub_(b_lse).exp_()
            dv[:, ks:ke].baddbmm_(p.transpose(1, 2), b_do)
            # dS = P ⊙ (dO Vᵀ − delta): the shift by delta is the matmul's initial value.
            ds = torch.baddbmm(-b_delta, b_do, v[:, ks:ke].transpose(1, 2)).mul_(p)
            dqb.baddbmm_(ds, k[:, ks:ke])
            dk[:, ks:ke].baddbmm_(ds.transpose(1, 2), qb)
            if dgc is not None:
                # The rows of dS sum to zero, so G_i's own term vanishes: dG_j = −Σ_i dS_ij (README.md).
                dgc[:, :, ks:ke] -= ds.view(BH, G, rows, ke - ks).sum(2)
        dq[:, :, :, start:end] = (dqb * scale).view(B, H, G, rows, K)
    dgc = None if dgc is None else dgc.view(B, H, G, L)
    return dq, dk.mul_(scale).view(B, H, L, K), dv.view(B, H, L, -1), dgc


class FoxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, scale, bounds, block):
        B, T, HQ, K = q.shape
        H = k.shape[2]
        G = HQ // H
        dtype = compute_dtype(q, k, v)
        # [B,H,G,T,K]: the G query heads of one key/value head side by side, so a tile is one bmm.
        bq = q.to(dtype).view(B, T, H, G, K).permute(0, 2, 3, 1, 4).contiguous()
        bk = k.to(dtype).transpose(1, 2).contiguous()
        bv = v.to(dtype).transpose(1, 2).contiguous()
        # The gate is accumulated in the compute dtype: its cumulative sums grow with T.
        bg = None if g is None else g.to(dtype).view(B, T, H, G).permute(0, 2, 3, 1)
        gc = None if g is None else torch.empty_like(bg)
        o = torch.empty(B, H, G, T, v.shape[-1], dtype=dtype, device=q.device)
        lse = torch.empty(B, H, G, T, dtype=dtype, device=q.device)
        for bos, eos in bounds:
            if eos > bos:
                if gc is not None:
                    gc[..., bos:eos] = bg[..., bos:eos].cumsum(-1)
                qs, ks = (slice(None),) * 3 + (slice(bos, eos),), (slice(None),) * 2 + (slice(bos, eos),)
                _fox_fwd(bq[qs], bk[ks], bv[ks], None if gc is None else gc[qs], o[qs], lse[qs], scale, block)
        ctx.save_for_backward(bq, bk, bv, gc, o, lse)
        ctx.scale, ctx.bounds, ctx.block = scale, bounds, block
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, None if g is None else g.dtype)
        return o.permute(0, 3, 1, 2, 4).reshape(B, T, HQ, v.shape[-1]).to(v.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        bq, bk, bv, gc, o, lse = ctx.saved_tensors
        B, H, G, T, K = bq.shape
        bdo = do.to(o.dtype).reshape(B, T, H, G, o.shape[-1]).permute(0, 2, 3, 1, 4).contiguous()
        delta = (bdo * o).sum(-1)
        dq, dk, dv = torch.empty_like(bq), torch.empty_like(bk), torch.empty_like(bv)
        dg = None if gc is None else torch.empty_like(gc)
        for bos, eos in ctx.bounds:
            if eos > bos:
                # T is dim 3 of the query-side tensors and dim 2 of the key-side ones.
                qs, ks = (slice(None),) * 3 + (slice(bos, eos),), (slice(None),) * 2 + (slice(bos, eos),)
                gs = None if gc is None else gc[qs]
                dq[qs], dk[ks], dv[ks], dgc = _fox_bwd(
                    bq[qs], bk[ks], bv[ks], gs, bdo[qs], lse[qs], delta[qs], ctx.scale, ctx.block
                )
                if dg is not None:
                    # G is a cumulative sum: g_t's gradient sums dG from t to the end of its sequence.
                    dg[qs] = dgc.flip(-1).cumsum(-1).flip(-1)
        q_dtype, k_dtype, v_dtype, g_dtype = ctx.dtypes
        dq = dq.permute(0, 3, 1, 2, 4).reshape(B, T, H * G, K).to(q_dtype)
        dk, dv = dk.transpose(1, 2).to(k_dtype), dv.transpose(1, 2).to(v_dtype)
        dg = None if dg is None else dg.permute(0, 3, 1, 2).reshape(B, T, H * G).to(g_dtype)
        return dq, dk, dv, dg, None, None, None


def fox_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    scale: float,
    bounds: list[tuple[int, int]],
) -> torch.Tensor:
    """FoX (softmax attention without ``g``) on trusted inputs: ``q [B,T,HQ,K]``, ``k [B,T,H,K]``,
    ``v [B,T,H,V]``, ``g [B,T,HQ]`` or None; ``bounds`` are the ``(bos, eos)`` of the independent sequences along
    ``T``; tiles of ``BLOCK_T`` (``BLOCK_T_CUDA`` on CUDA). Returns ``o [B,T,HQ,V]`` in ``v.dtype``, computed in
    float32 (float64 for float64 inputs)."""
    return FoxFunction.apply(q, k, v, g, scale, bounds, BLOCK_T_CUDA if q.is_cuda else BLOCK_T)
