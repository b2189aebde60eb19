"""TAPA: token-aware phase attention (arXiv 2509.12635), SPEC §3."""

from __future__ import annotations

import torch

from attnkit.ops.common.utils import segment_bounds
from attnkit.ops.common.validation import check_cu_seqlens, check_qkv, resolve_backend
from attnkit.ops.tapa.decoding import tapa_decode_step
from attnkit.ops.tapa.torch_impl import check_alpha, check_phase, check_theta, tapa_split, tapa_torch

__all__ = ["tapa_attention", "tapa_decode_step"]

# The widest heads the kernels are built for: a [64, 32] tile of logits beside [BM, D] and [BN, D] operand
# tiles stays in registers up to D = 256 (``fwd_config``).
MAX_HEAD_DIM = 256


def _checked_alpha(
    alpha: object, T: int, cu_seqlens: torch.Tensor | None, bounds: list[tuple[int, int]] | None
) -> float:
    """``alpha`` checked against the longest sequence's largest distance (:func:`check_alpha`). ``T`` bounds it, so
    packed offsets are read from the device only when that bound fails the check and ``bounds`` are not known. A
    longest sequence of at most two tokens has distances 0 and 1 only, whose powers (0 and 1) do not depend on
    alpha: 1 computes the same function and keeps the kernels' padding rows finite (64^alpha overflows float32 from
    alpha = 22 on); with the bound ``T`` instead, ``(T − 1)^alpha <= 2^16`` keeps them finite too."""
    if bounds is not None and cu_seqlens is not None:
        longest = max(eos - bos for bos, eos in bounds)
    else:
        longest = T
    try:
        checked = check_alpha(alpha, longest - 1)
    except ValueError:
        if cu_seqlens is None or bounds is not None:
            raise
        longest = max(eos - bos for bos, eos in segment_bounds(cu_seqlens, T))
        checked = check_alpha(alpha, longest - 1)
    return 1.0 if longest <= 2 else checked


def tapa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    theta: float = 0.5,
    alpha: float = 0.1,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    phase: str = "quadratic",
) -> torch.Tensor:
    """Causal token-aware phase attention.

    For query position ``m`` and key position ``n <= m`` of the same sequence the logit is
    ``l_mn = (q_A·k_A)/sqrt(dA) · cos(2π · (m−n)^alpha · φ_mn)`` with ``0^alpha = 0`` (also for ``alpha = 0``),
    where the first ``dA = round(theta·D)`` channels of a head (Python's ``round``, which rounds halves to even)
    are the amplitude part and the other ``dP = D − dA`` the phase part. ``o_m = Σ_n softmax_n(l_mn) v_n``.

    The phase function ``φ`` (``phase``):

    - ``"quadratic"`` (the paper's TAPA): ``φ_mn = (q_P,m·k_P,n)/sqrt(dP)``, a bilinear form of the two tokens.
    - ``"linear"``: ``φ_mn = (Σ_c q_P,m,c − Σ_c k_P,n,c)/sqrt(2·dP)``, a sum of one linear function of each token,
      no product of ``q`` and ``k``. It is our analog of the linear phase of the paper's ablation, whose exact
      form the sources at hand do not give: a general linear phase ``aᵀq_P + bᵀk_P`` loses nothing with
      ``a = 1, b = −1``, since the projections in front of the op learn any linear functional of a token (and
      its sign); ``sqrt(2·dP)`` gives it unit variance for unit-variance inputs, as ``sqrt(dP)`` gives the
      quadratic one, so that ``alpha`` means the same in both (README: Phase functions).

    Args:
        q: ``[B, T, HQ, D]``, float32 / float16 / bfloat16 (float64 is accepted for tests).
        k: ``[B, T, H, D]`` with ``HQ % H == 0``; query head ``h`` reads key head ``h // (HQ // H)``.
        v: ``[B, T, H, V]``.
        theta: fraction of each head used for the amplitude; both parts must be non-empty.
        alpha: exponent of the distance, finite and ``>= 0``, with ``(L − 1)^alpha <= 2^16`` for the longest
            sequence ``L`` (alpha = 1 up to 65537 tokens, alpha = 0.5 up to 4·10^9; alpha = 50 two tokens): past it
            the float32 phase ``d^alpha·(q_P·k_P)/sqrt(dP)`` is rounding noise, or NaN once ``d^alpha`` overflows.
        cu_seqlens: ``[N+1]`` int32/int64 offsets of packed sequences (``B == 1``); positions restart at 0
            in each sequence.
        backend: ``"auto"`` (the Triton kernels for CUDA tensors of float16 / bfloat16 / float32 with head
            dims up to 256, the PyTorch backend otherwise), ``"torch"`` or ``"triton"`` (CUDA tensors, or CPU
            tensors under ``TRITON_INTERPRET=1``; not float64).
        phase: ``"quadratic"`` or ``"linear"``, the phase function above.

    Returns:
        ``o [B, T, HQ, V]`` in ``v.dtype``; computed in float32 (float64 for float64 inputs).
    """
    check_qkv(q, k, v)
    B, T, _, D = q.shape
    theta = check_theta(theta, D)
    phase = check_phase(phase)
    amp_dim, _ = tapa_split(theta, D)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T, q.device)
    dims = dict(head_dims=(D, v.shape[-1]), max_head_dim=MAX_HEAD_DIM)
    use = resolve_backend(backend, "tapa_attention", q.device, has_triton=True, dtype=q.dtype, **dims)
    # The PyTorch backend walks the sequences on the host; the kernels find them on the device.
    bounds = None if use == "triton" else segment_bounds(cu_seqlens, T)
    alpha = _checked_alpha(alpha, T, cu_seqlens, bounds)
    if B == 0 or T == 0:  # empty, but on the inputs' graph, so that a backward through it gives empty gradients
        return v.new_zeros(B, T, q.shape[2], v.shape[-1]) + (q.sum() + k.sum() + v.sum()).to(v.dtype)
    if use == "triton":
        # Imported here: Triton is a Linux-only dependency, and the PyTorch backend must import without it.
        from attnkit.ops.tapa.parallel import tapa_triton

        return tapa_triton(q, k, v, amp_dim, alpha, cu_seqlens, phase)
    return tapa_torch(q, k, v, amp_dim, alpha, bounds, phase)
