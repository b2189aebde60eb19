"""VLA's Triton kernels as PyTorch operators, each with an autograd registration: ``attnkit::vla_unit_keys``
(``k̂``), ``attnkit::vla_write_fwd`` / ``_bwd`` (the write directions ``α̂`` with the chunks' penalties;
``attnkit::vla_gates_fwd`` / ``_bwd`` are its per-chunk kernels alone), ``attnkit::vla_normalize_fwd`` / ``_bwd``
(the output's normaliser); and ``attnkit::vla_decode``. The ``S`` update is the shared generalised delta rule,
``attnkit/ops/common/delta_parallel.py``; :func:`vla_triton` chains them."""

from __future__ import annotations

import torch

from attnkit.ops.common import delta_parallel
from attnkit.ops.common.triton_utils import float32_dots, interpreting
from attnkit.ops.common.utils import autocast_off, compute_dtype
from attnkit.ops.vla.triton.decode import vla_decode_fn
from attnkit.ops.vla.triton.gates import vla_gates_bwd_fn, vla_gates_fwd_fn, vla_write_bwd_fn, vla_write_fwd_fn
from attnkit.ops.vla.triton.keys import unit_rows_bwd_fn, unit_rows_fwd_fn
from attnkit.ops.vla.triton.normalize import normalize_bwd_fn, normalize_fwd_fn


def gates_chunk_size() -> int:
    """Tokens per chunk of the gate kernels (and of the normaliser): 64 on the GPU; 32 under the interpreter, so
    that small tests cross chunks and each chunk still has two 16-row downdate blocks."""
    return 32 if interpreting() else 64


def _precision() -> str:
    """The gates are float32 whatever the inputs (``A0`` carries ``1/lam0``): 3xTF32 dots on the tensor cores."""
    return float32_dots(torch.float32)


@torch.library.custom_op("attnkit::vla_gates_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def vla_gates_fwd_op(
    k_hat: torch.Tensor, u: torch.Tensor, lam: torch.Tensor, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k_hat [B, NC·C, H, K]`` float32, ``u [B, NC·C, H, K]``, ``lam [B, H, NC, K, K]`` (each chunk's penalty
    ``Λ_c``) -> ``(alpha, A0, R, ‖a‖)``: the write directions (unit, or ``a = A k̂`` itself without ``normalize``)
    and what the backward reuses."""
    chunk = k_hat.shape[1] // lam.shape[2]
    k_hat, u, lam = (x.contiguous() for x in (k_hat, u, lam))
    return vla_gates_fwd_fn(k_hat, u, lam, chunk, _precision(), normalize=normalize)


@vla_gates_fwd_op.register_fake
def _(k_hat, u, lam, normalize=True):
    B, T, H, K = k_hat.shape
    f32 = dict(dtype=torch.float32)
    return (
        k_hat.new_empty(B, T, H, K, **f32),
        lam.new_empty(lam.shape, **f32),
        k_hat.new_empty(B, T, H, K, **f32),
        k_hat.new_empty(B, T, H, **f32),
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
    chunk = u.shape[1] // a0.shape[2]
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


@torch.library.custom_op("attnkit::vla_unit_keys", mutates_args=(), device_types=("cuda", "cpu"))
def vla_unit_keys_op(k: torch.Tensor, eps: float = 0.0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [B, T, H, K]`` (any strides with adjacent channels) -> ``(k / ‖k‖, ‖k‖)`` in float32, contiguous, row by
    row in one kernel; with ``eps`` and ``scale``, ``scale · k / max(‖k‖, eps)`` (``F.normalize(k, eps=eps) ·
    scale``: the VLA layer's directions ``u``) in place of ``k / ‖k‖``."""
    return unit_rows_fwd_fn(k if k.stride(-1) == 1 else k.contiguous(), eps, scale)


@vla_unit_keys_op.register_fake
def _(k, eps=0.0, scale=1.0):
    return k.new_empty(k.shape, dtype=torch.float32), k.new_empty(k.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("attnkit::vla_unit_keys_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def vla_unit_keys_bwd_op(
    k_hat: torch.Tensor, norm: torch.Tensor, dk_hat: torch.Tensor, dtype: torch.dtype, eps: float = 0.0,
    scale: float = 1.0,
) -> torch.Tensor:  # fmt: skip
    """``dk = (dk̂ − k̂ (k̂·dk̂)) / ‖k‖`` in ``dtype`` (``k``'s); with ``eps`` and ``scale`` the forward's gradient
    (:func:`attnkit.ops.vla.triton.keys.unit_rows_bwd_fn`)."""
    return unit_rows_bwd_fn(k_hat, norm, dk_hat.contiguous(), dtype, eps, scale)


@vla_unit_keys_bwd_op.register_fake
def _(k_hat, norm, dk_hat, dtype, eps=0.0, scale=1.0):
    return k_hat.new_empty(k_hat.shape, dtype=dtype)


def _setup_keys(ctx, inputs, output):
    k, ctx.eps, ctx.scale = inputs
    k_hat, norm = output
    ctx.mark_non_differentiable(norm)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(k_hat, norm)
    ctx.dtype = k.dtype


def _keys_backward(ctx, dk_hat, _):
    if dk_hat is None:
        return None, None, None
    k_hat, norm = ctx.saved_tensors
    return vla_unit_keys_bwd_op(k_hat, norm, dk_hat, ctx.dtype, ctx.eps, ctx.scale), None, None


vla_unit_keys_op.register_autograd(_keys_backward, setup_context=_setup_keys)


@torch.library.custom_op("attnkit::vla_write_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def vla_write_fwd_op(
    k_hat: torch.Tensor,
    u: torch.Tensor,
    lam_init: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    lam0: float,
    chunk_size: int,
    normalize: bool,
    final: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate stage in kernels alone: ``k_hat [B, T, H, K]`` float32, ``u [B, T, H, K]`` (any strides with
    adjacent channels, any float dtype), ``lam_init [N, H, K, K]`` (``A_init⁻¹``) or None (``lam0·I``) ->
    ``(alpha, A_end, A0, R, ‖a‖)``; packed sequences in the same launches. Without ``final`` (the caller wants no
    final state) ``A_end`` is empty and its inversion is not run."""
    k_hat = k_hat.contiguous()
    u = u if u.stride(-1) == 1 else u.contiguous()
    lam_init = None if lam_init is None else lam_init.contiguous()
    return vla_write_fwd_fn(k_hat, u, lam_init, cu_seqlens, lam0, chunk_size, _precision(), normalize, final)


@vla_write_fwd_op.register_fake
def _(k_hat, u, lam_init, cu_seqlens, lam0, chunk_size, normalize, final=True):
    B, T, H, K = k_hat.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    NC = -(-T // chunk_size) + (0 if cu_seqlens is None else N)
    return (
        k_hat.new_empty(B, T, H, K),
        k_hat.new_empty(N, H, K, K) if final else k_hat.new_empty(0),
        k_hat.new_empty(B, H, NC, K, K),
        k_hat.new_empty(B, T, H, K),
        k_hat.new_empty(B, T, H),
    )


@torch.library.custom_op("attnkit::vla_write_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def vla_write_bwd_op(
    u: torch.Tensor,
    alpha: torch.Tensor,
    a0: torch.Tensor,
    r: torch.Tensor,
    anorm: torch.Tensor,
    a_end: torch.Tensor,
    dalpha: torch.Tensor,
    da_end: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dk_hat, du, dlam_init)``: every path, within and across chunks; ``du`` in ``u``'s dtype."""
    u = u if u.stride(-1) == 1 else u.contiguous()
    dalpha = dalpha.contiguous()
    da_end = None if da_end is None else da_end.contiguous()
    return vla_write_bwd_fn(
        u, alpha, a0, r, anorm, a_end, dalpha, da_end, cu_seqlens, chunk_size, _precision(), normalize
    )


@vla_write_bwd_op.register_fake
def _(u, alpha, a0, r, anorm, a_end, dalpha, da_end, cu_seqlens, chunk_size, normalize):
    B, _, H, K = u.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return alpha.new_empty(alpha.shape), u.new_empty(u.shape), alpha.new_empty(N, H, K, K)


def _setup_write(ctx, inputs, output):
    _, u, lam_init, cu_seqlens, _, chunk_size, normalize, *_ = inputs
    ctx.has_init = lam_init is not None
    alpha, a_end, a0, r, anorm = output
    ctx.mark_non_differentiable(a0, r, anorm)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(u, alpha, a0, r, anorm, a_end)
    ctx.cu_seqlens, ctx.chunk_size, ctx.normalize = cu_seqlens, chunk_size, normalize


def _write_backward(ctx, dalpha, da_end, *_):
    if dalpha is None and da_end is None:
        return (None,) * 8
    u, alpha, a0, r, anorm, a_end = ctx.saved_tensors
    dalpha = torch.zeros_like(alpha) if dalpha is None else dalpha
    dk_hat, du, dlam_init = vla_write_bwd_op(
        u, alpha, a0, r, anorm, a_end, dalpha, da_end, ctx.cu_seqlens, ctx.chunk_size, ctx.normalize
    )
    return dk_hat, du, dlam_init if ctx.has_init else None, None, None, None, None, None


vla_write_fwd_op.register_autograd(_write_backward, setup_context=_setup_write)


@autocast_off
def vla_gates_triton(
    k_hat: torch.Tensor,
    u: torch.Tensor,
    lam0: float,
    A_init: torch.Tensor | None,
    chunk_size: int,
    normalize_write: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    final: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attnkit.ops.vla.torch_impl.vla_chunk_gates` through the kernels (same results, in the ``[B, T, H, K]``
    layout: ``k_hat`` float32, ``u`` any strides and float dtype; ``T`` need not fill whole chunks), ``cu_seqlens``:
    packed sequences (``B == 1``, ``A_init`` and the final ``A`` one
    per sequence), all in the same launches.

    The penalty at every chunk's start, ``Λ_c = A_init⁻¹ + Σ_{chunks before c} UᵀU``, and the final
    ``A = Λ_end⁻¹`` come from one kernel walking each sequence's chunks; the backward's kernel walks them back,
    carrying ``dΛ`` to the earlier chunks' ``u`` and to ``A_init``. ``A_init⁻¹`` is inverted in float64, in
    PyTorch (one ``K×K`` matrix per sequence and head). Autocast does not apply: the Gram sums are the penalties
    inverted.
    """
    lam_init = None
    if A_init is not None:
        lam_init = torch.linalg.inv_ex(0.5 * (A_init + A_init.transpose(-1, -2)).double())[0].float()
    alpha, A_end, *_ = vla_write_fwd_op(k_hat, u, lam_init, cu_seqlens, lam0, chunk_size, normalize_write, final)
    return alpha, A_end


@torch.library.custom_op("attnkit::vla_normalize_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def vla_normalize_fwd_op(
    r: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    n0: torch.Tensor,
    eps: float,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``r [B, T, H, V]`` (``S_t q_t``), ``q, k [B, T, H, K]`` (any strides with adjacent channels), ``n0 [N, H, K]``
    -> ``(o [B, T, H, V], n_T, den, starts)``: the normalised output in ``r.dtype`` and ``n`` after the last token
    (float32), then what the backward reuses. ``cu_seqlens``: packed sequences in the same launches."""
    r = r.contiguous()
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    return normalize_fwd_fn(r, q, k, n0, eps, gates_chunk_size(), cu_seqlens)


@vla_normalize_fwd_op.register_fake
def _(r, q, k, n0, eps, cu_seqlens=None):
    B, T, H, K = k.shape
    NC = -(-T // gates_chunk_size()) + (0 if cu_seqlens is None else cu_seqlens.shape[0] - 1)
    f32 = dict(dtype=torch.float32)
    return (
        r.new_empty(r.shape),
        k.new_empty(n0.shape, **f32),
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
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dr, dq, dk, dn0)``, the first three in the dtypes of ``r``, ``q``, ``k``."""
    r = r.contiguous()
    q, k, do = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, do))
    return normalize_bwd_fn(r, q, k, den, starts, do, dn_end, eps, gates_chunk_size(), cu_seqlens)


@vla_normalize_bwd_op.register_fake
def _(r, q, k, den, starts, do, dn_end, eps, cu_seqlens=None):
    B, _, H, K = k.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return r.new_empty(r.shape), q.new_empty(q.shape), k.new_empty(k.shape), k.new_empty(N, H, K, dtype=torch.float32)


def _setup_normalize(ctx, inputs, output):
    r, q, k, n0, eps, *rest = inputs
    ctx.cu_seqlens = rest[0] if rest else None
    _, _, den, starts = output
    ctx.mark_non_differentiable(den, starts)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(r, q, k, den, starts)
    ctx.eps, ctx.n0_dtype = eps, n0.dtype


def _normalize_backward(ctx, do, dn_end, *_):
    if do is None and dn_end is None:
        return (None,) * 6
    r, q, k, den, starts = ctx.saved_tensors
    do = r.new_zeros(r.shape) if do is None else do
    dr, dq, dk, dn0 = vla_normalize_bwd_op(r, q, k, den, starts, do, dn_end, ctx.eps, ctx.cu_seqlens)
    return dr, dq, dk, dn0.to(ctx.n0_dtype), None, None


vla_normalize_fwd_op.register_autograd(_normalize_backward, setup_context=_setup_normalize)


def vla_normalize_triton(
    o: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    n0: torch.Tensor,
    eps: float,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``o [B, T, H, V]`` (``S_t q_t``) divided by ``max(q_t·n_t, eps)``, ``n_t = n0 + Σ_{s≤t} k_s``: returns the
    result as ``[B, T, H, V]`` in ``o.dtype`` and ``n_T`` in ``n0``'s dtype; ``cu_seqlens``: packed sequences
    (``n0`` one per sequence)."""
    out, n_end, *_ = vla_normalize_fwd_op(o, q, k, n0, eps, cu_seqlens)
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


def vla_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    lam0: float,
    eps: float,
    normalize_output: bool,
    normalize_write: bool,
    initial_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    cu_seqlens: torch.Tensor | None,
    final_state: bool = True,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """VLA through the kernels (inputs trusted, ``T > 0``; see ``vla_attention``): the gates, the ``S`` update and
    the normaliser, each one launch per kernel for a whole batch or all packed sequences (``cu_seqlens``, no host
    sync). Returns ``o [B, T, H, V]`` in ``v.dtype`` and the final ``(S, A, n)``, one per sequence, or None without
    ``final_state`` (then the final ``A``'s inversion, ``K`` sweep steps a sequence and head, is not run)."""
    dtype = compute_dtype(q, k, v, u, *(initial_state or ()))
    B, T, H, K = k.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    # Every kernel reads q, k, v and u as given ([B, T, H, ·], through their strides, in their dtypes) and writes
    # [B, T, H, ·]: no copy, cast or transpose of them here, forward or backward.
    if initial_state is None:
        S0, A_init, n0 = None, None, k.new_zeros(N, H, K, dtype=torch.float32)
    else:
        S0, A_init, n0 = initial_state
    k_hat = vla_unit_keys_op(k)[0]
    alpha, A_end = vla_gates_triton(
        k_hat, u, lam0, A_init, gates_chunk_size(), normalize_write, cu_seqlens, final_state
    )
    # 16-bit inputs: one TF32 pass per dot of the S update (its float32 operands carry 16-bit information).
    o, S_end = delta_parallel.delta_rule_triton(q, k_hat, v, alpha, S0, v.dtype.itemsize == 2, cu_seqlens)
    out, n_end = vla_normalize_triton(o, q, k, n0, eps, cu_seqlens)
    out = out if normalize_output else o
    if not final_state:
        return out, None
    # The final states are [N, H, ·] (float64 when the caller's state is).
    return out, tuple(x.to(dtype) for x in (S_end, A_end, n_end))
