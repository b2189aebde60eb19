"""``(I + Z)⁻¹`` of a chunk's strictly lower-triangular ``Z = strict_tril(K Aᵀ)``, by blocks, in registers: the delta
rule's ``T`` (``delta_fwd.delta_prepare_kernel``) and PaTH's UT transform (``K = diag(β) W``, ``A = W``:
``path/triton/prepare.py``).

The diagonal ``SB × SB`` blocks' inverses ``D`` all at once (:func:`block_diagonal_inverse`: ``SB − 1`` dependent
steps on ``[BT / SB, SB, SB]`` tiles, where one block after another takes ``BT − BT / SB``), then block row by block
row ``T_i = D_ii E_i − N_i T`` with ``N = D Z_o`` (``Z_o`` the blocks below the diagonal, so ``N_i T`` reads the
finished rows ``k < i`` only): one ``[BT, BT]`` product a block row, the rows outside block ``i`` masked to zero.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_diagonal_inverse(b_zd, SB: tl.constexpr):
    """``(I + Z_b)⁻¹`` of every block of ``b_zd [NB, SB, SB]``, block ``b``'s strictly lower-triangular ``Z_b``.

    Forward substitution, one row of every block a step (``SB − 1`` dependent steps for all the blocks together):
    row ``i`` of a block is ``e_i − Σ_{j<i} Z[i, j] X[j, :]``.
    """
    o_s = tl.arange(0, SB)
    rows = o_s[None, :, None]
    b_x = tl.where(rows == o_s[None, None, :], 1.0, 0.0) + tl.zeros_like(b_zd)
    for i in range(1, SB):
        b_coef = tl.sum(tl.where(rows == i, b_zd, 0.0), 1)  # [NB, SB]: Z[i, j] of every block
        b_row = tl.sum(b_coef[:, :, None] * b_x, 1)  # [NB, SB]: Σ_j Z[i, j] X[j, :]
        b_x = tl.where(rows == i, b_x - b_row[:, None, :], b_x)
    return b_x


@triton.jit
def tril_inverse(b_k3, b_a3, BT: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    """``T = (I + strict_tril(K Aᵀ))⁻¹`` (``[BT, BT]`` float32) of a chunk whose rows ``K``, ``A`` come as
    ``[BT / SB, SB, BK]`` float32 tiles (the blocks' own products batched, the chunk's as their ``[BT, BK]``
    reshapes); every product in ``PRECISION``."""
    b_z = tl.dot(tl.reshape(b_k3, (BT, BK)), tl.trans(tl.reshape(b_a3, (BT, BK))), input_precision=PRECISION)
    b_zd = tl.dot(b_k3, tl.trans(b_a3, (0, 2, 1)), input_precision=PRECISION)
    return tril_inverse_of(b_z, b_zd, BT, SB, PRECISION)


@triton.jit
def tril_inverse_of(b_z, b_zd, BT: tl.constexpr, SB: tl.constexpr, PRECISION: tl.constexpr):
    """:func:`tril_inverse` from the products themselves: ``b_z = K Aᵀ`` (``[BT, BT]``) and its diagonal blocks
    ``b_zd [BT / SB, SB, SB]`` (float32; entries on and above the diagonal ignored)."""
    NB: tl.constexpr = BT // SB
    o_t, o_s = tl.arange(0, BT), tl.arange(0, SB)
    block_r, block_c = (o_t // SB)[:, None], (o_t // SB)[None, :]
    b_zo = tl.reshape(tl.where(block_r > block_c, b_z, 0.0), (NB, SB, BT))  # Z_rc = k_r · a_c below the blocks
    b_d = block_diagonal_inverse(tl.where(o_s[None, :, None] > o_s[None, None, :], b_zd, 0.0), SB)
    b_n = tl.reshape(tl.dot(b_d, b_zo, input_precision=PRECISION), (BT, BT))  # N = D Z_o
    b_e = tl.reshape(tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0), (NB, SB, BT))
    b_t = tl.reshape(tl.dot(b_d, b_e, input_precision=PRECISION), (BT, BT))  # D as [BT, BT]
    for bi in tl.static_range(1, NB):  # block row bi: D_ii E_i − N_i T, the rows k < bi of T finished
        b_t -= tl.dot(tl.where(block_r == bi, b_n, 0.0), b_t, input_precision=PRECISION)
    return b_t
