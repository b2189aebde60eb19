"""VLA's Triton kernels as PyTorch operators: ``attnkit::vla_gates_fwd`` / ``_bwd`` (the write directions
``α̂``), ``attnkit::vla_normalize_fwd`` / ``_bwd`` (the output's normaliser), each with an autograd registration,
and ``attnkit::vla_decode``. The ``S`` update is the shared generalised
delta rule, ``attnkit/ops/common/delta_parallel.py``."""

from __future__ import annotations

import torch

from attnkit.ops.common.triton_utils import interpreting
from attnkit.ops.common.utils import autocast_off
from attnkit.ops.vla.triton.decode import vla_decode_fn
from attnkit.ops.vla.triton.gates import vla_gates_bwd_fn, vla_gates_fwd_fn
from attnkit.ops.vla.triton.normalize import normalize_bwd_fn, normalize_fwd_fn


def gates_chunk_size() -> int:
    """Tokens per chunk of the gate kernels (and of the normaliser): 64 on the GPU; 32 under the interpreter, so
    that small tests cross chunks and each chunk still has two 16-row downdate blocks."""
    return 32 if interpreting() else 64


def _precision() -> str:
    """The gates are float32 whatever the inputs (``A0`` carries ``1/lam0``): 3xTF32 dots on the tensor cores."""
    return "ieee" if interpreting() else "tf32x3"


@torch.library.custom_op("attnkit::vla_gates_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def vla_gates_fwd_op(
    k_hat: torch.Tensor, u: torch.Tensor, lam: torch.Tensor, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k_hat, u [B, H, NC·C, K]`` float32, ``lam [B, H, NC, K, K]`` (each chunk's penalty ``Λ_c``) ->
    ``(alpha, A0, R, ‖a‖)``: the write directions (unit, or ``a = A k̂`` itself without ``normalize``) and what
    the backward reuses."""
    chunk = k_hat.shape[2] // lam.shape[2]
    k_hat, u, lam = (x.contiguous() for x in (k_hat, u, lam))
    return vla_gates_fwd_fn(k_hat, u, lam, chunk, _precision(), normalize=normalize)


@vla_gates_fwd_op.register_fake
def _(k_hat, u, lam, normalize=True):
    B, H, T, K = k_hat.shape
    f32 = dict(dtype=torch.float32)
    return (
        k_hat.new_empty(B, H, T, K, **f32),
        lam.new_empty(lam.shape, **f32),
        k_hat.new_empty(B, H, T, K, **f32),
        k_hat.new_empty(B, H, T, **f32),
    )


@torch.library.custom_op("attnkit::vla_gates_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def vla_gates_bwd_op(
    u: torch.Tensor,
    alpha: torch.Tensor,
    a0: torch.Tensor,
    r: torch.Tensor,
    anorm: torch.Tensor,
    dalpha: torch.Tensor,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dk_hat, du, dlam)``: ``du`` holds the paths within each chunk; ``dlam`` carries the rest."""
    chunk = u.shape[2] // a0.shape[2]
    u, dalpha = u.contiguous(), dalpha.contiguous()
    return vla_gates_bwd_fn(u, alpha, a0, r, anorm, dalpha, chunk, _precision(), normalize=normalize)


@vla_gates_bwd_op.register_fake
def _(u, alpha, a0, r, anorm, dalpha, normalize=True):
    return alpha.new_empty(alpha.shape), alpha.new_empty(alpha.shape), a0.new_empty(a0.shape)


def _setup_context(ctx, inputs, output):
    _, u, _, *rest = inputs
    ctx.normalize = bool(rest[0]) if rest else True
    alpha, a0, r, anorm = output
    ctx.mark_non_differentiable(a0, r, anorm)
    ctx.set_materialize_grads(False)  # no zero fills for the saved tensors' gradients
    ctx.save_for_backward(u, alpha, a0, r, anorm)
    ctx.dtypes = tuple(x.dtype for x in inputs[:3])


def _backward(ctx, dalpha, *_):
    if dalpha is None:
        return None, None, None, None
    u, alpha, a0, r, anorm = ctx.saved_tensors
    grads = vla_gates_bwd_op(u, alpha, a0, r, anorm, dalpha, ctx.normalize)
    return (*(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)), None)


vla_gates_fwd_op.register_autograd(_backward, setup_context=_setup_context)


@autocast_off
def vla_gates_triton(
    k_hat: torch.Tensor,
    u: torch.Tensor,
    lam0: float,
    A_init: torch.Tensor | None,
    chunk_size: int,
    normalize_write: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attnkit.ops.vla.torch_impl.vla_chunk_gates` through the kernels (same arguments and results).

    The penalty at every chunk's start, ``Λ_c = A_init⁻¹ + Σ_{chunks before c} UᵀU``, is a cumulative sum of
    Gram matrices computed here, in PyTorch, so that autograd takes ``dΛ_c`` from the backward kernel back to the
    earlier chunks' ``u`` and to ``A_init``; ``A_init⁻¹`` and the final ``A`` are inverted in float64 (one
    ``K×K`` matrix per sequence and head). Autocast does not apply: the Gram sums are the penalties inverted.
    """
    B, H, TP, K = k_hat.shape
    NC = TP // chunk_size
    U = u.reshape(B, H, NC, chunk_size, K)
    gram = U.transpose(-1, -2) @ U
    through = gram.cumsum(2)  # the Gram sums up to each chunk's end; up to its start is `through - gram`
    if A_init is None:
        lam_init = torch.eye(K, dtype=u.dtype, device=u.device) * lam0
    else:
        lam_init = torch.linalg.inv(0.5 * (A_init + A_init.transpose(-1, -2)).double()).to(u.dtype)
    alpha, *_ = vla_gates_fwd_op(k_hat, u, lam_init.unsqueeze(-3) + (through - gram), normalize_write)
    lam_end = (lam_init + through[:, :, -1]).double()
    A_end = torch.linalg.inv(0.5 * (lam_end + lam_end.transpose(-1, -2))).to(u.dtype)
    return alpha, A_end


@torch.library.custom_op("attnkit::vla_normalize_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def vla_normalize_fwd_op(
    r: torch.Tensor, q: torch.Tensor, k: torch.Tensor, n0: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``r [B, H, T, V]`` (``S_t q_t``), ``q, k [B, H, T, K]``, ``n0 [B, H, K]`` -> ``(o [B, T, H, V], n_T, den,
    starts)``: the normalised output in ``r.dtype`` and ``n`` after the last token (float32), then what the
    backward reuses."""
    r, q, k = (x.contiguous() for x in (r, q, k))
    return normalize_fwd_fn(r, q, k, n0, eps, gates_chunk_size())


@vla_normalize_fwd_op.register_fake
def _(r, q, k, n0, eps):
    B, H, T, K = k.shape
    NC = -(-T // gates_chunk_size())
    f32 = dict(dtype=torch.float32)
    return (
        r.new_empty(B, T, H, r.shape[-1]),
        k.new_empty(B, H, K, **f32),
        k.new_empty(B, H, T, **f32),
        k.new_empty(B, H, NC, K, **f32),
    )


@torch.library.custom_op("attnkit::vla_normalize_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def vla_normalize_bwd_op(
    r: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    den: torch.Tensor,
    starts: torch.Tensor,
    do: torch.Tensor,
    dn_end: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dr, dq, dk, dn0)``."""
    r, q, k, do = (x.contiguous() for x in (r, q, k, do))
    return normalize_bwd_fn(r, q, k, den, starts, do, dn_end, eps, gates_chunk_size())


@vla_normalize_bwd_op.register_fake
def _(r, q, k, den, starts, do, dn_end, eps):
    B, H, _, K = k.shape
    f32 = dict(dtype=torch.float32)
    return r.new_empty(r.shape), q.new_empty(q.shape), k.new_empty(k.shape, **f32), k.new_empty(B, H, K, **f32)


def _setup_normalize(ctx, inputs, output):
    r, q, k, n0, eps = inputs
    _, _, den, starts = output
    ctx.mark_non_differentiable(den, starts)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(r, q, k, den, starts)
    ctx.eps, ctx.dtypes = eps, (k.dtype, n0.dtype)


def _normalize_backward(ctx, do, dn_end, *_):
    if do is None and dn_end is None:
        return (None,) * 5
    r, q, k, den, starts = ctx.saved_tensors
    if do is None:
        B, H, T, V = r.shape
        do = r.new_zeros(B, T, H, V)
    dr, dq, dk, dn0 = vla_normalize_bwd_op(r, q, k, den, starts, do, dn_end, ctx.eps)
    return dr, dq, dk.to(ctx.dtypes[0]), dn0.to(ctx.dtypes[1]), None


vla_normalize_fwd_op.register_autograd(_normalize_backward, setup_context=_setup_normalize)


def vla_normalize_triton(
    o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, n0: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``o [B, H, T, V]`` (``S_t q_t``) divided by ``max(q_t·n_t, eps)``, ``n_t = n0 + Σ_{s≤t} k_s``: returns the
    result as ``[B, T, H, V]`` in ``o.dtype`` and ``n_T`` in ``n0``'s dtype."""
    out, n_end, *_ = vla_normalize_fwd_op(o, q, k, n0, eps)
    return out, n_end.to(n0.dtype)


@torch.library.custom_op("attnkit::vla_decode", mutates_args=(), device_types=("cuda", "cpu"))
def vla_decode_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    S: torch.Tensor,
    A: torch.Tensor,
    n: torch.Tensor,
    eps: float,
    normalize_output: bool,
    normalize_write: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoding step on validated inputs (see :func:`attnkit.ops.vla.vla_decode_step`); float32 states.
    Inference only: no autograd formula is registered (the PyTorch step has one)."""
    return vla_decode_fn(q, k, v, u, S, A, n, eps, normalize_output, normalize_write)


@vla_decode_op.register_fake
def _(q, k, v, u, S, A, n, eps, normalize_output, normalize_write=True):
    B, _, H, _ = k.shape
    return v.new_empty(B, 1, H, v.shape[-1]), S.new_empty(S.shape), A.new_empty(A.shape), n.new_empty(n.shape)
