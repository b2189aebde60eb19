"""PaTH's backward between superblocks: the key-major sweep's formulas in float64 against autograd, then the kernels
(``attnkit/ops/path/triton/backward_super.py``) against the same autograd.

The terms are the ones :func:`attnkit.ops.path.triton.backward_super.path_bwd_super_fn` receives: ``q̂`` (the queries
carried to their superblock's start), ``k̂`` (the keys carried to their superblock's end) and each superblock's
``Σ``. A query of superblock ``s`` meets a key of superblock ``n < s`` with the logit
``scale · q̂ Π_{n,s} k̂ᵀ (+ G_i − G_j)``, ``Π_{n,s} = Σ_{s−1}ᵀ ··· Σ_{n+1}ᵀ``; with ``P = exp(S − lse)`` and ``lse``,
``Δ`` held constant, ``ℒ = Σ P ∘ (dO Vᵀ − Δ)`` has the gradients the backward takes from these pairs
(``dS = P ∘ (dO Vᵀ − Δ)``, ``dV = Pᵀ dO``).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def products(sig):
    """``Π[n][s] = Σ_{s−1}ᵀ ··· Σ_{n+1}ᵀ`` for ``n < s`` (``sig [nsb, H, K, K]``), the identity at ``s = n + 1``."""
    nsb = sig.shape[0]
    eye = torch.eye(sig.shape[-1], dtype=sig.dtype).expand(sig.shape[1], -1, -1)
    pi = [[None] * nsb for _ in range(nsb)]
    for n in range(nsb):
        pi[n][n + 1 if n + 1 < nsb else n] = eye
        for s in range(n + 1, nsb - 1):
            pi[n][s + 1] = sig[s].transpose(-1, -2) @ pi[n][s]
    return pi


def pair_logits(xh, kh, sig, gcum, scale, S):
    """``{(n, s): logits [HQ, rows of s, S]}`` between every query superblock ``s`` and key superblock ``n < s`` of
    one sequence (``xh [L, HQ, K]``, ``kh [L, H, K]``, ``gcum [L, HQ]`` or None)."""
    L, HQ, _ = xh.shape
    group = HQ // kh.shape[1]
    pi = products(sig)
    out = {}
    for s in range(1, -(-L // S)):
        q = xh[s * S : (s + 1) * S].transpose(0, 1)  # [HQ, rows, K]
        for n in range(s):
            k = kh[n * S : (n + 1) * S].transpose(0, 1).repeat_interleave(group, 0)
            logits = scale * q @ pi[n][s].repeat_interleave(group, 0) @ k.transpose(-1, -2)
            if gcum is not None:
                gq, gk = gcum[s * S : (s + 1) * S].T, gcum[n * S : (n + 1) * S].T
                logits = logits + gq[:, :, None] - gk[:, None, :]
            out[n, s] = logits
    return out


def between_loss(xh, kh, v, sig, gcum, do, lse, delta, scale, S):
    """``ℒ = Σ_pairs P ∘ (dO Vᵀ − Δ)`` of one sequence (``v [L, H, V]``, ``do [L, HQ, V]``, ``lse, delta [L, HQ]``)."""
    group = xh.shape[1] // kh.shape[1]
    loss = 0.0
    for (n, s), logits in pair_logits(xh, kh, sig, gcum, scale, S).items():
        rows = slice(s * S, (s + 1) * S)
        vk = v[n * S : (n + 1) * S].transpose(0, 1).repeat_interleave(group, 0)
        dp = do[rows].transpose(0, 1) @ vk.transpose(-1, -2) - delta[rows].T[:, :, None]
        loss = loss + (torch.exp(logits - lse[rows].T[:, :, None]) * dp).sum()
    return loss


def sequence_inputs(L, HQ, H, K, V, S, gen, gate=True):
    """Random superblock terms of one sequence in float64, with ``lse`` each row's log-sum-exp over its pairs (so
    that ``P`` stays a probability) and ``Σ`` near the identity (products of transitions of norm about one)."""

    def rand(*shape, s=1.0):
        return s * torch.randn(*shape, generator=gen, dtype=torch.float64)

    nsb = -(-L // S)
    xh, kh, v, do = rand(L, HQ, K), rand(L, H, K), rand(L, H, V), rand(L, HQ, V)
    sig = torch.linalg.matrix_exp(rand(nsb, H, K, K, s=0.3 / K**0.5))
    gcum = rand(L, HQ, s=0.3).cumsum(0) if gate else None
    scale = K**-0.5
    lse = torch.zeros(L, HQ, dtype=torch.float64)
    for (_, s), logits in pair_logits(xh, kh, sig, gcum, scale, S).items():
        rows = slice(s * S, (s + 1) * S)
        lse[rows] = torch.logaddexp(lse[rows], torch.logsumexp(logits, -1).T)
    delta = rand(L, HQ)
    return xh, kh, v, sig, gcum, do, lse, delta, scale


def sweep_reference(xh, kh, v, sig, gcum, do, lse, delta, scale, S):
    """The key-major sweep in PyTorch (the formulas of ``README.md`` § "Between superblocks"): per key superblock
    ``n``, left to right over ``s > n`` carrying ``Π_{n,s}`` (``Π ← Σ_sᵀ Π``): ``dq̂_s += scale · dS k̂ Πᵀ``,
    ``dk̂_n += scale · dSᵀ q̂ Π``, ``dV_n += Pᵀ dO``, ``E_{n,s} = scale · Σ_heads q̂ᵀ dS k̂`` (the gradient of
    ``Π_{n,s}``); then right to left over the row, ``F ← E_{n,p+1}ᵀ + F Σ_{p+1}ᵀ`` and ``dΣ_p += Π_{n,p} F``."""
    L, HQ, K = xh.shape
    H = kh.shape[1]
    group = HQ // H
    nsb = -(-L // S)
    pi = products(sig)
    dxh, dkh, dv, dsig = (torch.zeros_like(t) for t in (xh, kh, v, sig))
    for n in range(nsb - 1):
        keys = slice(n * S, (n + 1) * S)
        k = kh[keys].transpose(0, 1).repeat_interleave(group, 0)  # [HQ, S, K]
        vk = v[keys].transpose(0, 1).repeat_interleave(group, 0)
        e = {}
        for s in range(n + 1, nsb):
            rows = slice(s * S, (s + 1) * S)
            q = xh[rows].transpose(0, 1)
            p_ns = pi[n][s].repeat_interleave(group, 0)
            logits = scale * q @ p_ns @ k.transpose(-1, -2)
            if gcum is not None:
                logits = logits + gcum[rows].T[:, :, None] - gcum[keys].T[:, None, :]
            p = torch.exp(logits - lse[rows].T[:, :, None])
            g = do[rows].transpose(0, 1)
            ds = p * (g @ vk.transpose(-1, -2) - delta[rows].T[:, :, None])
            dxh[rows] += (scale * ds @ k @ p_ns.transpose(-1, -2)).transpose(0, 1)
            dkh[keys] += (scale * ds.transpose(-1, -2) @ q @ p_ns).view(H, group, S, K).sum(1).transpose(0, 1)
            dv[keys] += (p.transpose(-1, -2) @ g).view(H, group, S, -1).sum(1).transpose(0, 1)
            e[s] = (scale * q.transpose(-1, -2) @ ds @ k).view(H, group, K, K).sum(1)
        f = torch.zeros_like(sig[0])
        for p in range(nsb - 2, n, -1):
            f = e[p + 1].transpose(-1, -2) + f @ sig[p + 1].transpose(-1, -2)
            dsig[p] += pi[n][p] @ f
    return dxh, dkh, dv, dsig


@pytest.mark.parametrize("L, HQ, H, S, gate", [(45, 2, 1, 8, True), (64, 4, 2, 16, False), (23, 1, 1, 4, True)])
def test_sweep_formulas_float64(L, HQ, H, S, gate):
    """The sweep's formulas, in float64, against autograd through the pairs' logits written out: ``dq̂``, ``dk̂``,
    ``dV`` and every superblock's ``dΣ`` (six, four and six superblocks, partial last ones, GQA)."""
    gen = torch.Generator().manual_seed(L)
    xh, kh, v, sig, gcum, do, lse, delta, scale = sequence_inputs(L, HQ, H, 8, 6, S, gen, gate)
    leaves = [t.clone().requires_grad_() for t in (xh, kh, v, sig)]
    loss = between_loss(*leaves[:4], gcum, do, lse, delta, scale, S)
    expected = torch.autograd.grad(loss, leaves)
    actual = sweep_reference(xh, kh, v, sig, gcum, do, lse, delta, scale, S)
    for name, a, e in zip(("dxh", "dkh", "dv", "dsig"), actual, expected):
        assert e.abs().max() > 0, name
        assert_close(name, a, e, 1e-12)


def test_program_groups_fill_one_wave(monkeypatch):
    """Left open, the programs a key superblock are the most (a power of two dividing its tiles) whose slots fit one
    wave: 2 at T = 4k, B = 8, 16 heads, D = 64 (28 pairs of 4 MiB), 4 with half the heads, 1 at 16k (496 pairs)."""
    from attnkit.ops.path.triton import backward_super

    assert backward_super.SCRATCH_BYTES == 1 << 28
    pair = 2 * 8 * 16 * 64 * 64 * 4  # E and Π, every head of B = 8, H = 16
    assert backward_super.program_groups(8, 8, pair) == 2
    assert backward_super.program_groups(8, 8, pair // 2) == 4
    assert backward_super.program_groups(8, 8, 1) == 8  # never more than the tiles
    assert backward_super.program_groups(6, 8, 1) == 2  # a power of two that divides them
    assert backward_super.program_groups(8, 32, pair // 8) == 1
    assert backward_super.program_groups(8, 1, pair) == 8  # one superblock: no pairs, nothing to store
    monkeypatch.setattr(backward_super, "SCRATCH_BYTES", 1)
    assert backward_super.program_groups(8, 8, pair) == 1


@pytest.mark.parametrize(
    "tiles_per_program", [0, 1, 2], ids=["groups-left-open", "program-a-tile", "program-a-superblock"]
)
@pytest.mark.parametrize("budget", [None, 1], ids=["one-wave", "a-row-a-wave"])
@pytest.mark.parametrize(
    "K, offsets",
    [(16, None), (24, None), (80, None), (16, [0, 5, 5, 40, 100])],
    ids=["K16", "K24-padded", "K80-split-products", "varlen"],
)
def test_sweep_kernels_match_autograd(monkeypatch, tiles_per_program, budget, K, offsets):
    """:func:`path_bwd_super_fn` (the three kernels, float32 under the interpreter) against autograd through the
    pairs' logits in float64: ``dq̂``, ``dk̂``, ``dV``, ``dΣ`` and both sides of the gates' gradient, over superblocks
    of two 8-row tiles (six superblocks in 100 tokens, partial last ones), GQA, a dense batch of two or packed
    sequences with an empty and a short one; one wave or a row a wave, one program a superblock or a tile, or as
    many as :func:`backward_super.program_groups` gives (a tile a program in one wave, a superblock a program in a row
    a wave)."""
    check_sweep(monkeypatch, tiles_per_program, budget, K, offsets)


@pytest.mark.parametrize(
    "tiles_per_program", [0, 1, 2], ids=["groups-left-open", "program-a-tile", "program-a-superblock"]
)
@pytest.mark.parametrize("budget", [None, 1, 96 << 10], ids=["one-wave", "a-row-a-wave", "rows-a-wave"])
@pytest.mark.parametrize(
    "K, offsets", [(16, None), (80, None), (16, [0, 5, 5, 40, 100])], ids=["K16", "K80-split-products", "varlen"]
)
def test_sweep_superblocks_outer(monkeypatch, tiles_per_program, budget, K, offsets):
    """The same gradients with the later superblocks in the sweep's outer loop (``SWEEP_ORDER = "superblocks"``:
    ``Π_{n,s}`` in one slot a program, the tiles' ``dk̂`` and ``dV`` added a pair at a time); a budget of 96 KiB puts
    two or three rows in some waves at K = 16 (12 to 24 slots of 4 or 8 KiB), whose programs keep separate ``Π``
    slots."""
    from attnkit.ops.path.triton import backward_super

    monkeypatch.setattr(backward_super, "SWEEP_ORDER", "superblocks")
    check_sweep(monkeypatch, tiles_per_program, budget, K, offsets)


def test_sweep_waves_count_the_superblocks_order_slots(monkeypatch):
    """Waves over 6 rows (entries 6, 5, …, 1): with a row's ``Π`` slot counted, the superblocks' order fits more rows
    a wave than the tiles' order, whose every entry holds ``E`` and ``Π``; an unknown order is refused."""
    from attnkit.ops.path.triton import backward_super

    monkeypatch.setattr(backward_super, "SCRATCH_BYTES", 16)
    assert backward_super.waves(6, 2) == [(0, 1, 6), (1, 2, 5), (2, 4, 7), (4, 6, 3)]  # the tiles' order
    assert backward_super.waves(6, 1, 1) == [(0, 2, 11), (2, 6, 10)]  # E 1 byte an entry, Π 1 byte a row
    monkeypatch.setattr(backward_super, "SWEEP_ORDER", "rows")
    with pytest.raises(ValueError, match="SWEEP_ORDER"):
        check_sweep(monkeypatch, 0, None, 16, None)


@pytest.mark.parametrize("K, offsets", [(80, None), (80, [0, 5, 5, 40, 100])], ids=["K80", "K80-varlen"])
def test_sweep_tiles_wider_than_the_chunk(monkeypatch, K, offsets):
    """Tiles of twice the chunk (here a whole superblock a tile), as the GPU's default at K = 128 takes 64-row tiles
    over 32-position chunks: the same gradients."""
    check_sweep(monkeypatch, 0, None, K, offsets, tile=16)


def test_sweep_launch_at_k128_takes_64_row_tiles(monkeypatch):
    """On a GPU the sweep at K = 65…128 takes 64-row tiles on eight warps and one stage (41.1 ms against 47.0 for the
    chunk's 32-row tiles on three stages, PaTH-FoX at T = 4k on the H200); other K keep the chunk's tile. Float32
    inputs (3xTF32 products, float32 operands in shared memory) at a padded K or V of 128 take 32-row tiles: 64-row
    ones wanted more shared memory than a Hopper block has."""
    from attnkit.ops.path.triton import backward, backward_super, prepare

    monkeypatch.setattr(backward_super, "interpreting", lambda: False)
    monkeypatch.setattr(backward, "interpreting", lambda: False)
    monkeypatch.setattr(prepare, "interpreting", lambda: False)  # the float32 precisions a GPU takes
    wide = dict(tile=64, tiles_per_program=0, num_warps=8, num_stages=1)
    assert backward_super.launch_config(128, 32) == wide and backward_super.launch_config(80, 32) == wide
    assert backward_super.launch_config(64, 64)["tile"] == 64 and backward_super.launch_config(64, 64)["num_warps"] == 4
    assert backward_super.launch_config(256, 16)["tile"] == 16
    narrow = dict(tile=32, tiles_per_program=0, num_warps=8, num_stages=1)
    assert backward_super.launch_config(128, 32, torch.float32, 128) == narrow
    assert backward_super.launch_config(64, 64, torch.float32, 128) == narrow
    assert backward_super.launch_config(64, 64, torch.float32, 64)["tile"] == 64
    assert backward_super.launch_config(128, 32, torch.bfloat16, 128) == wide


def check_sweep(monkeypatch, tiles_per_program, budget, K, offsets, tile=None):
    """The body of the sweep tests: the kernels' five gradients against autograd through the pairs' logits (tiles of
    ``tile`` rows, the chunk's by default)."""
    from attnkit.ops.common.triton_utils import block_dim
    from attnkit.ops.path.triton import backward_super
    from attnkit.ops.path.triton.prepare import chunk_offsets

    chunk, span, HQ, H, V = 8, 2, 4, 2, 8
    S = chunk * span
    config = dict(tile=tile or chunk, tiles_per_program=tiles_per_program, num_warps=1, num_stages=1)
    monkeypatch.setattr(backward_super, "launch_config", lambda key_dim, c, *_: config)
    if budget is not None:
        monkeypatch.setattr(backward_super, "SCRATCH_BYTES", budget)
    gen = torch.Generator().manual_seed(K)
    B, T = (2, 100) if offsets is None else (1, offsets[-1])
    seqs = [(b, 0, T) for b in range(B)] if offsets is None else [(0, a, e) for a, e in zip(offsets, offsets[1:])]
    BK = block_dim(K)
    names = ("xh", "kh", "v", "sig", "gcum", "do", "lse", "delta")
    full = dict(
        xh=torch.zeros(B, T, HQ, K), kh=torch.zeros(B, T, H, K), v=torch.zeros(B, T, H, V), do=torch.zeros(B, T, HQ, V),
        gcum=torch.zeros(B, T, HQ), lse=torch.zeros(B, T, HQ), delta=torch.zeros(B, T, HQ),
    )  # fmt: skip
    sigs, parts = [], []
    NSB = -(-T // S)
    for b, lo, hi in seqs:
        inputs = dict(zip(names, sequence_inputs(hi - lo, HQ, H, K, V, S, gen)))
        for name, t in inputs.items():
            if name != "sig":
                full[name][b, lo:hi] = t.float()
        sig = torch.zeros(-(-(hi - lo) // S) if offsets else NSB, H, BK, BK)
        sig[: inputs["sig"].shape[0], :, :K, :K] = inputs["sig"].float()
        sigs.append(sig)
        parts.append(inputs)
    sig = torch.cat(sigs)
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32)
    f = {name: t.to(DEVICE) for name, t in full.items()}
    dxh, dkh, dv, dsig, dg = backward_super.path_bwd_super_fn(
        f["xh"], f["kh"], f["v"], sig.to(DEVICE), f["gcum"], f["do"], f["lse"], f["delta"], K**-0.5,
        None if cu is None else cu.to(DEVICE), chunk, span, T, chunk_offsets(cu, S),
    )  # fmt: skip

    expected = dict(dxh=torch.zeros(B, T, HQ, K), dkh=torch.zeros(B, T, H, K), dv=torch.zeros(B, T, H, V),
                    dg=torch.zeros(B, T, HQ), dsig=torch.zeros_like(sig))  # fmt: skip
    row = 0
    for (b, lo, hi), inputs, part in zip(seqs, parts, sigs):
        leaves = {n: inputs[n].clone().requires_grad_() for n in ("xh", "kh", "v", "sig", "gcum")}
        args = [leaves.get(n, inputs.get(n)) for n in names]
        loss = between_loss(*args, K**-0.5, S)
        if not torch.is_tensor(loss):  # a sequence of one superblock or none: no pairs
            row += part.shape[0]
            continue
        grads = torch.autograd.grad(loss, list(leaves.values()))
        for name, gr in zip(("dxh", "dkh", "dv"), grads):
            expected[name][b, lo:hi] = gr.float()
        expected["dsig"][row : row + grads[3].shape[0], :, :K, :K] = grads[3].float()
        expected["dg"][b, lo:hi] = grads[4].float()
        row += part.shape[0]
    for name, actual in zip(("dxh", "dkh", "dv", "dsig", "dg"), (dxh, dkh, dv, dsig, dg)):
        assert expected[name].abs().max() > 0, name
        assert_close(name, actual.cpu(), expected[name], 1e-5)
