"""Blockwise PyTorch backend of TAPA: the CPU implementation and the oracle for kernels.

Query rows are processed in blocks of ``BT``; a block only ever sees its causal key prefix, so the
largest intermediate is ``[B*H, G*BT, T]`` (``G = HQ // H`` query heads share one key/value head and are
stacked along the rows, which makes GQA free). The backward recomputes each block from the saved
log-sum-exp, FlashAttention style. Derivation: ``README.md`` beside this file.
"""

from __future__ import annotations

import math

import torch

from attnkit.ops.common.utils import compute_dtype
from attnkit.ops.common.validation import check_scalar

# Measured on a 2-core CPU (B=4, T=1024, H=4, D=64, forward+backward): 32 to 256 rows per block are within
# noise of each other (1.6-2.0x SDPA+RoPE); 64 keeps the five [B*H, G*BT, T] work buffers of the backward
# small, which is what matters at long T.
BLOCK_T = 64


def tapa_split(theta: float, head_dim: int) -> tuple[int, int]:
    """``(dA, dP)``: ``dA = round(theta * D)`` with Python's (banker's) ``round``, as SPEC §3 writes it."""
    amp_dim = round(theta * head_dim)
    return amp_dim, head_dim - amp_dim


def check_theta(theta: object, head_dim: int) -> float:
    """``theta`` in ``(0, 1)`` leaving both the amplitude and the phase part of a ``head_dim`` head non-empty."""
    theta = check_scalar("theta", theta, low=0.0, high=1.0)
    amp_dim, phase_dim = tapa_split(theta, head_dim)
    if amp_dim < 1 or phase_dim < 1:
        raise ValueError(
            f"theta: round(theta * D) = {amp_dim} amplitude and {phase_dim} phase channels for D={head_dim}; "
            "both must be at least 1"
        )
    return theta


# The largest distance power d^alpha a call may need: 2^16. The phase d^alpha·(q_P·k_P)/sqrt(dP) (in cycles) is
# ill-conditioned in d^alpha, whatever the formulation: its float32 rounding, 2^-24 of the phase, turns into
# 2^-24·d^alpha cycles of error per unit of (q_P·k_P)/sqrt(dP). At the bound float32 is ~1e-3 (output) and ~1e-1
# (gradients) from float64 for unit-variance inputs (alpha = 16 at T = 3, alpha = 8 at T = 5); the kernels reduce the
# phase exactly up to 2^22 cycles, phase products up to 64·sqrt(dP); past the bound the cosine is rounding noise,
# and NaN once d^alpha overflows float32 (alpha = 50 from d = 6: the NaN this bound turns into a ValueError).
MAX_DISTANCE_POWER_LOG2 = 16


def check_alpha(alpha: object, max_distance: int) -> float:
    """``alpha >= 0``, finite, with ``max_distance^alpha <= 2^16`` (``MAX_DISTANCE_POWER_LOG2``): alpha = 1 reaches
    distances of 65536, alpha = 0.5 of 4·10^9, alpha = 50 of 1 (two tokens)."""
    alpha = check_scalar("alpha", alpha, low=0.0, strict=False)
    if max_distance > 1 and alpha * math.log2(max_distance) > MAX_DISTANCE_POWER_LOG2:
        reach = 2 ** (MAX_DISTANCE_POWER_LOG2 / alpha)
        raise ValueError(
            f"alpha: distance {max_distance} to the power {alpha} exceeds 2^{MAX_DISTANCE_POWER_LOG2}, past which a "
            f"float32 phase is rounding noise (or NaN); alpha = {alpha} reaches distances up to {int(reach)}"
        )
    return alpha


# The phase functions: ``"quadratic"`` is the paper's bilinear form ``φ = (q_P·k_P)/sqrt(dP)``; ``"linear"`` our
# analog of its linear-phase ablation, ``φ = (Σ q_P − Σ k_P)/sqrt(2·dP)`` (README: Phase functions).
PHASES = ("quadratic", "linear")


def check_phase(phase: object) -> str:
    """``phase`` one of :data:`PHASES`."""
    if not isinstance(phase, str) or phase not in PHASES:
        raise ValueError(f"phase: expected one of {PHASES}, got {phase!r}")
    return phase


def phase_variance(phase: str, phase_dim: int) -> int:
    """The variance of the phase's product for independent unit-variance ``q_P``, ``k_P``: ``dP`` for ``q_P·k_P``,
    ``2·dP`` for ``Σ q_P − Σ k_P``. The phase is divided by its square root, so both phases have unit variance."""
    return phase_dim if phase == "quadratic" else 2 * phase_dim


def _reversed_phase_table(
    seq_len: int, block: int, alpha: float, variance: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``r[j] = 2π·d^alpha/sqrt(variance)`` at distance ``d = seq_len - 1 - j``, zero for ``d <= 0``; ``variance``
    from :func:`phase_variance`.

    Built in float64 and rounded once to ``dtype``; ``d`` runs down to ``-(block - 1)`` so that the
    strided view in :func:`_block_phase_scale` also covers the masked upper triangle of a diagonal block.
    ``0 ** alpha`` is 0 by the spec, also for ``alpha = 0`` (where torch would give 1).
    """
    dist = (seq_len - 1) - torch.arange(seq_len + block - 1, device=device, dtype=torch.float64)
    power = torch.where(dist > 0, dist.clamp_min(1.0).pow(alpha), torch.zeros_like(dist))
    return (power * (2 * math.pi / math.sqrt(variance))).to(dtype)


def _block_phase_scale(table: torch.Tensor, table_len: int, start: int, rows: int) -> torch.Tensor:
    """``[rows, start + rows]``: the phase scale of query ``start + i`` against key ``n``.

    It depends on ``start + i - n`` only, so it is a Toeplitz view of the 1-D table; read bottom row
    first it has positive strides, and one flip materialises it (shared by every head of the block).
    """
    offset = table_len - start - rows
    return table.as_strided((rows, start + rows), (1, 1), offset).flip(0)


def _split(x: torch.Tensor, amp_dim: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return x[..., :amp_dim] * scale, x[..., amp_dim:].contiguous()


def _phase_products(
    qp: torch.Tensor, k_phase: torch.Tensor, k_sums: torch.Tensor | None, end: int, out: torch.Tensor
) -> torch.Tensor:
    """The phase before its distance factor, ``[B*H, G*rows, end]`` into ``out``: ``q_P·k_P`` (``k_sums`` None),
    or ``Σ q_P − Σ k_P`` for the linear phase (``k_sums [B*H, T]``, the keys' channel sums)."""
    if k_sums is None:
        return torch.bmm(qp, k_phase[:, :end].transpose(1, 2), out=out)
    return torch.sub(qp.sum(-1, keepdim=True), k_sums[:, None, :end], out=out)


def _workspace(count: int, numel: int, like: torch.Tensor) -> list[torch.Tensor]:
    """Flat buffers for the per-block ``[B*H, G*BT, S]`` intermediates, written with ``out=``: allocating
    them afresh every block costs more than the elementwise work (page faults on each large malloc)."""
    return [torch.empty(numel, dtype=like.dtype, device=like.device) for _ in range(count)]


def _tapa_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    amp_dim: int,
    table: torch.Tensor,
    table_len: int,
    o: torch.Tensor,
    lse: torch.Tensor,
    block: int,
    linear: bool,
) -> None:
    """One dense segment. ``q [B,H,G,T,D]``, ``k [B,H,T,D]``, ``v [B,H,T,V]`` in the compute dtype;
    ``table`` from :func:`_reversed_phase_table` with ``table_len >= T``; ``linear`` picks the linear phase.
    Writes ``o [B,H,G,T,V]`` and ``lse [B,H,G,T]``."""
    B, H, G, T, _ = q.shape
    q_amp, q_phase = _split(q, amp_dim, amp_dim**-0.5)
    k_amp, k_phase = (x.reshape(B * H, T, -1).contiguous() for x in (k[..., :amp_dim], k[..., amp_dim:]))
    k_sums = k_phase.sum(-1) if linear else None
    v = v.reshape(B * H, T, -1)
    causal = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1)
    buffers = _workspace(2, B * H * G * min(block, T) * T, q)
    for start in range(0, T, block):
        end = min(start + block, T)
        rows = end - start
        logits, phase = (x[: B * H * G * rows * end].view(B * H, G * rows, end) for x in buffers)
        qa = q_amp[:, :, :, start:end].reshape(B * H, G * rows, -1)
        qp = q_phase[:, :, :, start:end].reshape(B * H, G * rows, -1)
        torch.bmm(qa, k_amp[:, :end].transpose(1, 2), out=logits)
        _phase_products(qp, k_phase, k_sums, end, phase)
        phase.view(B * H, G, rows, end).mul_(_block_phase_scale(table, table_len, start, rows))
        logits.mul_(phase.cos_())
        logits.view(B * H, G, rows, end)[..., start:].masked_fill_(causal[:rows, :rows], -math.inf)
        row_max = logits.amax(-1, keepdim=True)
        probs = logits.sub_(row_max).exp_()
        row_sum = probs.sum(-1, keepdim=True)
        out = torch.bmm(probs, v[:, :end]).div_(row_sum)
        o[:, :, :, start:end] = out.view(B, H, G, rows, -1)
        lse[:, :, :, start:end] = (row_max + row_sum.log()).view(B, H, G, rows)


def _tapa_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    amp_dim: int,
    table: torch.Tensor,
    table_len: int,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    block: int,
    linear: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One dense segment; shapes as in :func:`_tapa_fwd`, ``delta = rowsum(dO ⊙ O)``. Returns
    ``dq [B,H,G,T,D]``, ``dk [B,H,T,D]``, ``dv [B,H,T,V]`` in the compute dtype."""
    B, H, G, T, D = q.shape
    amp_scale = amp_dim**-0.5
    q_amp, q_phase = _split(q, amp_dim, amp_scale)
    k_amp, k_phase = (x.reshape(B * H, T, -1).contiguous() for x in (k[..., :amp_dim], k[..., amp_dim:]))
    k_sums = k_phase.sum(-1) if linear else None
    v = v.reshape(B * H, T, -1)
    dq_amp, dq_phase = torch.empty_like(q_amp), torch.empty_like(q_phase)
    dk_amp, dk_phase, dv = torch.zeros_like(k_amp), torch.zeros_like(k_phase), torch.zeros_like(v)
    causal = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1)
    neg_table = -table
    buffers = _workspace(5, B * H * G * min(block, T) * T, q)
    for start in range(0, T, block):
        end = min(start + block, T)
        rows = end - start
        amp, phase, cos, probs, d_logits = (x[: B * H * G * rows * end].view(B * H, G * rows, end) for x in buffers)
        qa = q_amp[:, :, :, start:end].reshape(B * H, G * rows, -1)
        qp = q_phase[:, :, :, start:end].reshape(B * H, G * rows, -1)
        b_do = do[:, :, :, start:end].reshape(B * H, G * rows, -1)
        b_lse = lse[:, :, :, start:end].reshape(B * H, G * rows, 1)
        b_delta = delta[:, :, :, start:end].reshape(B * H, G * rows, 1)

        torch.bmm(qa, k_amp[:, :end].transpose(1, 2), out=amp)
        _phase_products(qp, k_phase, k_sums, end, phase)
        phase.view(B * H, G, rows, end).mul_(_block_phase_scale(table, table_len, start, rows))
        torch.cos(phase, out=cos)
        sin = phase.sin_()
        # P = exp(a·cos φ − lse): the subtraction rides along in the same pass as the product.
        torch.addcmul(-b_lse, amp, cos, out=probs)
        probs.view(B * H, G, rows, end)[..., start:].masked_fill_(causal[:rows, :rows], -math.inf)
        probs.exp_()
        # dS = P ⊙ (dO Vᵀ − delta): the shift by delta is the matmul's initial value.
        torch.baddbmm(-b_delta, b_do, v[:, :end].transpose(1, 2), out=d_logits).mul_(probs)
        dv[:, :end].baddbmm_(probs.transpose(1, 2), b_do)
        d_amp = cos.mul_(d_logits)
        # dl/dφ = −a·sin φ, and φ = (q_P·k_P)·table: the sign and the scale come with neg_table.
        d_phase = amp.mul_(d_logits).mul_(sin)
        d_phase.view(B * H, G, rows, end).mul_(_block_phase_scale(neg_table, table_len, start, rows))

        dq_amp[:, :, :, start:end] = torch.bmm(d_amp, k_amp[:, :end]).view(B, H, G, rows, -1)
        dk_amp[:, :end].baddbmm_(d_amp.transpose(1, 2), qa)
        if linear:
            # ∂(Σ q_P − Σ k_P)/∂q_P = 1 and /∂k_P = −1 in every channel: row and column sums, broadcast.
            dq_phase[:, :, :, start:end] = d_phase.sum(-1).view(B, H, G, rows, 1)
            dk_phase[:, :end].sub_(d_phase.sum(1)[..., None])
        else:
            dq_phase[:, :, :, start:end] = torch.bmm(d_phase, k_phase[:, :end]).view(B, H, G, rows, -1)
            dk_phase[:, :end].baddbmm_(d_phase.transpose(1, 2), qp)
    dq = torch.cat((dq_amp.mul_(amp_scale), dq_phase), dim=-1)
    dk = torch.cat((dk_amp, dk_phase), dim=-1).view(B, H, T, D)
    return dq, dk, dv.view(B, H, T, -1)


class TapaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, amp_dim, alpha, bounds, block, phase):
        B, T, HQ, D = q.shape
        H = k.shape[2]
        G = HQ // H
        dtype = compute_dtype(q, k, v)
        # [B,H,G,T,D]: the G query heads of one key/value head side by side, so a block is one bmm.
        bq = q.to(dtype).view(B, T, H, G, D).permute(0, 2, 3, 1, 4).contiguous()
        bk = k.to(dtype).transpose(1, 2).contiguous()
        bv = v.to(dtype).transpose(1, 2).contiguous()
        o = torch.empty(B, H, G, T, v.shape[-1], dtype=dtype, device=q.device)
        lse = torch.empty(B, H, G, T, dtype=dtype, device=q.device)
        longest = max((eos - bos for bos, eos in bounds), default=0)
        table = _reversed_phase_table(longest, block, alpha, phase_variance(phase, D - amp_dim), dtype, q.device)
        linear = phase == "linear"
        for bos, eos in bounds:
            if eos > bos:
                qs, ks = (slice(None),) * 3 + (slice(bos, eos),), (slice(None),) * 2 + (slice(bos, eos),)
                _tapa_fwd(bq[qs], bk[ks], bv[ks], amp_dim, table, longest, o[qs], lse[qs], block, linear)
        ctx.save_for_backward(bq, bk, bv, o, lse)
        ctx.amp_dim, ctx.table, ctx.longest, ctx.bounds, ctx.block = amp_dim, table, longest, bounds, block
        ctx.linear = linear
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return o.permute(0, 3, 1, 2, 4).reshape(B, T, HQ, v.shape[-1]).to(v.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        bq, bk, bv, o, lse = ctx.saved_tensors
        B, H, G, T, D = bq.shape
        bdo = do.to(o.dtype).reshape(B, T, H, G, o.shape[-1]).permute(0, 2, 3, 1, 4).contiguous()
        delta = (bdo * o).sum(-1)
        dq, dk, dv = torch.empty_like(bq), torch.empty_like(bk), torch.empty_like(bv)
        for bos, eos in ctx.bounds:
            if eos > bos:
                # T is dim 3 of the query-side tensors and dim 2 of the key-side ones.
                qs, ks = (slice(None),) * 3 + (slice(bos, eos),), (slice(None),) * 2 + (slice(bos, eos),)
                dq[qs], dk[ks], dv[ks] = _tapa_bwd(
                    bq[qs], bk[ks], bv[ks], ctx.amp_dim, ctx.table, ctx.longest, bdo[qs], lse[qs], delta[qs],
                    ctx.block, ctx.linear,
                )  # fmt: skip
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        dq = dq.permute(0, 3, 1, 2, 4).reshape(B, T, H * G, D).to(q_dtype)
        dk = dk.transpose(1, 2).to(k_dtype)
        dv = dv.transpose(1, 2).to(v_dtype)
        return dq, dk, dv, None, None, None, None, None


def tapa_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    amp_dim: int,
    alpha: float,
    bounds: list[tuple[int, int]],
    phase: str = "quadratic",
    block: int = BLOCK_T,
) -> torch.Tensor:
    """TAPA on trusted inputs: ``q [B,T,HQ,D]``, ``k [B,T,H,D]``, ``v [B,T,H,V]``; ``bounds`` are the
    ``(bos, eos)`` of the independent sequences along ``T``; ``phase`` one of :data:`PHASES`. Returns
    ``o [B,T,HQ,V]`` in ``v.dtype``."""
    return TapaFunction.apply(q, k, v, amp_dim, alpha, bounds, block, phase)
