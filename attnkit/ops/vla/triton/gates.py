"""VLA's gates in fused kernels: the write directions ``α̂_t = A_t k̂_t / ‖A_t k̂_t‖`` of every token, forward and
backward, one program per chunk (or per group of consecutive chunks in the forward).

The caller (``vla_gates_triton`` in ``attnkit/ops/vla/parallel.py``) hands each chunk its penalty
``Λ_c = A_init⁻¹ + Σ_{chunks before c} UᵀU`` (a cumulative sum of ``K×K`` Gram matrices, in PyTorch, so that
autograd carries ``dΛ_c`` back to earlier chunks' ``u`` and to ``A_init``). Per chunk, in registers:

- ``A0 = Λ_c⁻¹`` by the sweep operator (Gauss–Jordan without pivoting: ``Λ_c`` is symmetric positive definite),
  or, for the later chunks of a program's group, carried from the chunk before: ``A0 ← A0 − RᵀR``;
- the Sherman–Morrison vectors ``z_t = A_{t−1} u_t``, ``d_t = 1 + u_tᵀ z_t`` by rank-one downdates of
  ``Y = U A`` (row ``t`` is final once the rows before it have been applied), ``R = D^{−1/2} Z``, in blocks of
  ``SB`` rows with ``A ← A − R_bᵀ R_b`` between blocks;
- ``a = K̂ A − tril(K̂ Rᵀ) R`` per block (``a_t = A_t k̂_t``), ``α̂ = a / ‖a‖``.

Backward, from ``A_t = (Λ_c + Σ_{s≤t, s in c} u_s u_sᵀ)⁻¹`` directly (no differentiation through the
factorisation): with ``da_t = (dα̂_t − α̂_t (α̂_t·dα̂_t)) / ‖a_t‖`` and ``g_t = A_t da_t = A0 da_t − Σ_{s≤t}
(r_s·da_t) r_s``,

    dk̂_t = g_t,    dΛ_c = −Σ_{t in c} g_t a_tᵀ,    du_s = −Σ_{t≥s, t in c} (g_t (a_t·u_s) + a_t (g_t·u_s))

(the ``t`` in later chunks reach ``u_s`` through ``dΛ``). All float32, dots float32-accurate (``PRECISION``):
``A0`` carries ``1/lam0`` and ``a`` is a difference of nearby vectors when ``u`` aligns with ``k̂``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.delta_fwd import chunk_tiles
from attnkit.ops.common.triton_utils import block_dim


@triton.jit
def spd_inverse(b_m, BK: tl.constexpr):
    """``M⁻¹`` of a symmetric positive definite ``[BK, BK]`` tile by ``BK`` sweeps (padding rows and columns must
    hold the identity). After sweeping every pivot the tile holds ``−M⁻¹``."""
    rows = tl.arange(0, BK)[:, None]
    cols = tl.arange(0, BK)[None, :]
    o_k = tl.arange(0, BK)
    for j in range(0, BK):
        b_col = tl.sum(tl.where(cols == j, b_m, 0.0), 1)
        b_row = tl.sum(tl.where(rows == j, b_m, 0.0), 0)
        b_inv = 1.0 / tl.sum(tl.where(o_k == j, b_col, 0.0), 0)
        b_m -= (b_col * b_inv)[:, None] * b_row[None, :]
        b_m = tl.where(cols == j, (b_col * b_inv)[:, None], b_m)
        b_m = tl.where(rows == j, (b_row * b_inv)[None, :], b_m)
        b_m = tl.where((rows == j) & (cols == j), -b_inv, b_m)
    return -b_m


@triton.jit
def chunk_inverse(lam, i_c, i_bh, NC, K: tl.constexpr, BK: tl.constexpr):
    """``A0 = Λ_c⁻¹`` of chunk ``i_c`` of head ``i_bh`` from ``lam [BH, NC, K, K]``, and its offsets and mask."""
    o_k = tl.arange(0, BK)
    m_kk = (o_k < K)[:, None] & (o_k < K)[None, :]
    p_kk = (i_bh.to(tl.int64) * NC + i_c) * K * K + o_k[:, None] * K + o_k[None, :]
    b_lam = tl.load(lam + p_kk, mask=m_kk, other=0.0)
    b_lam = tl.where((o_k[:, None] == o_k[None, :]) & (o_k[:, None] >= K), 1.0, b_lam)
    return spd_inverse(b_lam, BK), p_kk, m_kk


@triton.jit
def vla_gates_fwd_kernel(
    k_hat, u, lam, alpha, a0_out, r_out, anorm_out, T, NC,
    K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, SB: tl.constexpr, GROUP: tl.constexpr,
    PRECISION: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    """``k_hat, u [BH, T, K]``, ``lam [BH, NC, K, K]`` float32 -> ``alpha [BH, T, K]`` and, for the backward,
    ``a0_out [BH, NC, K, K]`` (``A0``), ``r_out [BH, T, K]`` (``R``), ``anorm_out [BH, T]`` (``‖a_t‖``), all
    float32. Grid ``(⌈NC / GROUP⌉, BH)``. ``NORMALIZE`` false: ``alpha`` is ``a`` itself (``‖a‖`` stored all the
    same).

    A program takes ``GROUP`` consecutive chunks and sweeps only the first one's penalty. It then walks its
    tokens in blocks of ``SB`` rows carrying the current inverse ``A`` (``A ← A − R_bᵀ R_b`` after each block, one
    product): inside a block the ``SB`` rank-one downdates act on ``[SB, K]`` tiles, and ``a = K̂_b A −
    tril(K̂_b R_bᵀ) R_b``. ``A`` at each chunk's start is stored for the backward; ``lam`` of the other chunks
    of the group is not read (their ``A0`` is the same matrix)."""
    i_g, i_bh = tl.program_id(0), tl.program_id(1)
    NB: tl.constexpr = BT // SB
    o_k = tl.arange(0, BK)
    o_s = tl.arange(0, SB)
    rows = o_s[:, None]
    b_a0, p_kk, m_kk = chunk_inverse(lam, i_g * GROUP, i_bh, NC, K, BK)
    for j in range(0, GROUP):
        i_c = i_g * GROUP + j
        tl.store(a0_out + p_kk + j * K * K, b_a0, mask=m_kk & (o_k[None, :] * 0 + i_c < NC))
        for b in range(0, NB):
            i_b = i_c * NB + b
            p_k, m_k, _, _ = chunk_tiles(i_b, i_bh, T, o_k, o_k, K, K, SB)
            b_kh = tl.load(k_hat + p_k, mask=m_k, other=0.0).to(tl.float32)
            b_u = tl.load(u + p_k, mask=m_k, other=0.0).to(tl.float32)
            b_y = tl.dot(b_u, b_a0, input_precision=PRECISION)  # rows A u_t
            b_d = tl.zeros([SB], dtype=tl.float32)
            for t in range(0, SB):
                b_z = tl.sum(tl.where(rows == t, b_y, 0.0), 0)  # z_t = A_{t-1} u_t, final once rows < t applied
                b_uz = tl.sum(b_u * b_z[None, :], 1)  # u_i · z_t for every row i
                b_dt = 1.0 + tl.sum(tl.where(o_s == t, b_uz, 0.0), 0)
                b_d = tl.where(o_s == t, b_dt, b_d)
                b_y -= tl.where(o_s > t, b_uz / b_dt, 0.0)[:, None] * b_z[None, :]
            b_r = b_y / tl.sqrt(b_d)[:, None]
            tl.store(r_out + p_k, b_r, mask=m_k)

            b_kr = tl.where(rows >= o_s[None, :], tl.dot(b_kh, tl.trans(b_r), input_precision=PRECISION), 0.0)
            b_a = tl.dot(b_kh, b_a0, input_precision=PRECISION) - tl.dot(b_kr, b_r, input_precision=PRECISION)
            b_norm = tl.sqrt(tl.sum(b_a * b_a, 1))
            b_norm = tl.where(b_norm > 0, b_norm, 1.0)  # rows past T (zero k̂)
            if NORMALIZE:
                b_a = b_a / b_norm[:, None]
            tl.store(alpha + p_k, b_a, mask=m_k)
            o_tok = i_b * SB + o_s
            tl.store(anorm_out + i_bh.to(tl.int64) * T + o_tok, b_norm, mask=o_tok < T)
            # A after the block: A − Σ_t r_t r_tᵀ (rows past T are zero)
            b_a0 -= tl.dot(tl.trans(b_r), b_r, input_precision=PRECISION)


@triton.jit
def vla_gates_bwd_kernel(
    u, alpha, a0, r, anorm, dalpha, dk_hat, du, dlam, T, NC,
    K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    """``u [BH, T, K]``, the forward's ``alpha``, ``a0``, ``r``, ``anorm`` and ``dalpha [BH, T, K]`` ->
    ``dk_hat``, ``du [BH, T, K]`` (the within-chunk share) and ``dlam [BH, NC, K, K]``, float32. Grid
    ``(NC, BH)``. ``NORMALIZE`` as the forward's: without it ``da = dalpha`` and ``a = alpha``."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_t = tl.arange(0, BT)
    p_k, m_k, _, _ = chunk_tiles(i_c, i_bh, T, o_k, o_k, K, K, BT)
    o_tok = i_c * BT + o_t
    b_u = tl.load(u + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_al = tl.load(alpha + p_k, mask=m_k, other=0.0)
    b_r = tl.load(r + p_k, mask=m_k, other=0.0)
    b_dal = tl.load(dalpha + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_norm = tl.load(anorm + i_bh.to(tl.int64) * T + o_tok, mask=o_tok < T, other=1.0)
    m_kk = (o_k < K)[:, None] & (o_k < K)[None, :]
    p_kk = (i_bh.to(tl.int64) * NC + i_c) * K * K + o_k[:, None] * K + o_k[None, :]
    b_a0 = tl.load(a0 + p_kk, mask=m_kk, other=0.0)

    if NORMALIZE:
        b_da = (b_dal - b_al * tl.sum(b_al * b_dal, 1)[:, None]) / b_norm[:, None]
        b_a = b_al * b_norm[:, None]
    else:
        b_da = b_dal
        b_a = b_al
    rows = o_t[:, None]
    cols = o_t[None, :]
    b_dr = tl.where(rows >= cols, tl.dot(b_da, tl.trans(b_r), input_precision=PRECISION), 0.0)
    b_g = tl.dot(b_da, b_a0, input_precision=PRECISION) - tl.dot(b_dr, b_r, input_precision=PRECISION)
    tl.store(dk_hat + p_k, b_g, mask=m_k)
    # du_s = -Σ_{t>=s} g_t (a_t·u_s) + a_t (g_t·u_s): [s, t] tiles kept where t >= s
    b_ua = tl.where(rows <= cols, tl.dot(b_u, tl.trans(b_a), input_precision=PRECISION), 0.0)
    b_ug = tl.where(rows <= cols, tl.dot(b_u, tl.trans(b_g), input_precision=PRECISION), 0.0)
    b_du = -(tl.dot(b_ua, b_g, input_precision=PRECISION) + tl.dot(b_ug, b_a, input_precision=PRECISION))
    tl.store(du + p_k, b_du, mask=m_k)
    tl.store(dlam + p_kk, -tl.dot(tl.trans(b_g), b_a, input_precision=PRECISION), mask=m_kk)


def launch_config(key_dim: int, chunks: int = 1) -> dict[str, int]:
    """Warps, stages, ``GROUP`` (chunks per program) and ``SB`` (rows per downdate block) of the gate kernels.

    The ``[K, K]`` tiles live in registers through the sweeps, so eight warps from ``K = 128``; no loop to
    pipeline over loads. ``chunks`` (all heads' chunks together): the largest ``GROUP`` of 8, 4, 2 that still
    leaves 512 programs. The H200 sweep of ``benchmarks/vla_profile.py`` (``vla_profile_h200.txt``, T = 1k, 32768
    tokens) set it: the forward gate kernel took 1.50 ms with ``GROUP = 8`` against 1.71 (4) and 2.93 (1) at
    K = 64 (8192 chunks), and 4.07 ms against 5.20 (4) and 11.9 (1) at K = 128 (4096 chunks); ``SB = 16`` beat
    32 and 64 at both, and eight warps at K = 64 were 2.2× slower than four. The backward kernel ignores
    ``GROUP`` and ``SB``."""
    group = next((g for g in (8, 4, 2) if chunks // g >= 512), 1)
    return dict(num_warps=4 if key_dim <= 64 else 8, num_stages=1, GROUP=group, SB=16)


def vla_gates_fwd_fn(
    k_hat: torch.Tensor,
    u: torch.Tensor,
    lam: torch.Tensor,
    chunk_size: int,
    precision: str,
    config: dict[str, int] | None = None,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k_hat, u [B, H, T, K]`` contiguous, ``lam [B, H, NC, K, K]`` float32 contiguous (``NC = ⌈T / C⌉``) ->
    ``(alpha, A0, R, ‖a‖)``: ``alpha, R [B, H, T, K]``, ``A0 [B, H, NC, K, K]``, ``‖a‖ [B, H, T]``, float32.
    ``config``: warps, stages and ``GROUP`` instead of :func:`launch_config` (the benchmarks' sweep);
    ``normalize``: ``alpha = a / ‖a‖`` (else ``a``)."""
    B, H, T, K = k_hat.shape
    NC = lam.shape[2]
    f32 = dict(dtype=torch.float32, device=k_hat.device)
    alpha, r = torch.empty(B, H, T, K, **f32), torch.empty(B, H, T, K, **f32)
    a0, anorm = torch.empty(B, H, NC, K, K, **f32), torch.empty(B, H, T, **f32)
    config = config or launch_config(K, NC * B * H)
    vla_gates_fwd_kernel[(triton.cdiv(NC, config["GROUP"]), B * H)](
        k_hat, u, lam, alpha, a0, r, anorm, T, NC, K=K, BK=block_dim(K), BT=chunk_size, PRECISION=precision,
        NORMALIZE=normalize, **config,
    )  # fmt: skip
    return alpha, a0, r, anorm


def vla_gates_bwd_fn(
    u: torch.Tensor,
    alpha: torch.Tensor,
    a0: torch.Tensor,
    r: torch.Tensor,
    anorm: torch.Tensor,
    dalpha: torch.Tensor,
    chunk_size: int,
    precision: str,
    config: dict[str, int] | None = None,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dk_hat, du_within, dlam)`` float32 from the forward's saved tensors and ``dalpha`` (all contiguous);
    ``normalize`` as the forward's."""
    B, H, T, K = u.shape
    NC = a0.shape[2]
    dk_hat, du = torch.empty_like(alpha), torch.empty_like(alpha)
    dlam = torch.empty_like(a0)
    config = {n: x for n, x in (config or launch_config(K)).items() if n not in ("GROUP", "SB")}
    vla_gates_bwd_kernel[(NC, B * H)](
        u, alpha, a0, r, anorm, dalpha, dk_hat, du, dlam, T, NC, K=K, BK=block_dim(K), BT=chunk_size,
        PRECISION=precision, NORMALIZE=normalize, **config,
    )  # fmt: skip
    return dk_hat, du, dlam
