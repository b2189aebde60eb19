"""Linear attention's feature map ``φ(x) = elu(x) + 1`` (``x + 1`` for ``x > 0``, ``exp(x)`` otherwise) of the
queries and the keys in one launch, and its gradient ``dx = dy`` where ``x > 0``, ``dy · exp(x)`` otherwise, from the
saved ``x``, in one launch: in float32 inside, rounded once to ``x``'s dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements a program


@triton.jit
def elu_plus_one_block(x, y, n, o):
    """``y = φ(x)`` at the offsets ``o`` below ``n``."""
    m = o < n
    b_x = tl.load(x + o, mask=m, other=0.0).to(tl.float32)
    b_pos = b_x > 0
    b_y = tl.where(b_pos, b_x + 1, tl.exp(tl.where(b_pos, 0.0, b_x)))  # no overflow off the branch taken; NaN stays
    tl.store(y + o, b_y.to(y.dtype.element_ty), mask=m)


@triton.jit
def elu_plus_one_grad_block(x, dy, dx, n, o):
    """``dx = dy · φ'(x)`` at the offsets ``o`` below ``n``."""
    m = o < n
    b_x = tl.load(x + o, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + o, mask=m, other=0.0).to(tl.float32)
    b_pos = b_x > 0
    b_dx = tl.where(b_pos, b_dy, b_dy * tl.exp(tl.where(b_pos, 0.0, b_x)))
    tl.store(dx + o, b_dx.to(dx.dtype.element_ty), mask=m)


@triton.jit
def elu_plus_one_fwd_kernel(q, k, fq, fk, NQ, NK, BLOCK: tl.constexpr):
    """``fq = φ(q)``, ``fk = φ(k)``: ``NQ`` and ``NK`` elements, every tensor contiguous. Grid
    ``(⌈max(NQ, NK) / BLOCK⌉, 2)``: axis 1 picks ``q`` or ``k``."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if tl.program_id(1) == 0:
        elu_plus_one_block(q, fq, NQ, o)
    else:
        elu_plus_one_block(k, fk, NK, o)


@triton.jit
def elu_plus_one_bwd_kernel(q, k, dfq, dfk, dq, dk, NQ, NK, BLOCK: tl.constexpr):
    """``dq = dfq · φ'(q)``, ``dk = dfk · φ'(k)``, every tensor contiguous. Grid as the forward's."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if tl.program_id(1) == 0:
        elu_plus_one_grad_block(q, dfq, dq, NQ, o)
    else:
        elu_plus_one_grad_block(k, dfk, dk, NK, o)


def elu_plus_one_fwd_fn(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(φ(q), φ(k))`` of contiguous ``q`` and ``k`` (any shapes and float dtypes), each in its input's shape and
    dtype."""
    fq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    fk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    n = max(q.numel(), k.numel())
    if n > 0:
        elu_plus_one_fwd_kernel[(triton.cdiv(n, BLOCK), 2)](q, k, fq, fk, q.numel(), k.numel(), BLOCK=BLOCK)
    return fq, fk


def elu_plus_one_bwd_fn(
    q: torch.Tensor, k: torch.Tensor, dfq: torch.Tensor, dfk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)`` in the dtypes of ``q`` and ``k`` from the forward's inputs and the outputs' gradients (all
    contiguous)."""
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    n = max(q.numel(), k.numel())
    if n > 0:
        elu_plus_one_bwd_kernel[(triton.cdiv(n, BLOCK), 2)](
            q, k, dfq, dfk, dq, dk, q.numel(), k.numel(), BLOCK=BLOCK
        )  # fmt: skip
    return dq, dk
