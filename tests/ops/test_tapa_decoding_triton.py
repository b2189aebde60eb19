"""tapa_decode_step's Triton kernel (split-KV decode) against its PyTorch path.

On CPU the kernel runs under Triton's interpreter (tiny shapes); on CUDA the same cases run natively, and
the real-size cases (32k caches) run as well.
"""

from __future__ import annotations

import pytest
import torch

from attnkit.ops.tapa import tapa_decode_step
from attnkit.ops.tapa.torch_impl import tapa_split
from attnkit.ops.tapa.triton.decode import tapa_decode_fn
from tests.helpers import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-3}


def make_cache(B, L, HQ, H, D, V, dtype, pad=0, future=False):
    """A decode step's inputs: row ``b`` has ``b·pad`` left-padding slots (junk keys, values and positions,
    masked out), then real slots at positions ``0, 1, ...``; the last slot is the query's own token. With
    ``future`` slot 0 of row 0 (never padding) stays unmasked but sits past the query's position."""
    q = torch.randn(B, 1, HQ, D, device=DEVICE).to(dtype)
    k = (torch.randn(B, L, H, D, device=DEVICE) * 2).to(dtype)
    v = torch.randn(B, L, H, V, device=DEVICE).to(dtype)
    mask = torch.ones(B, L, dtype=torch.bool, device=DEVICE)
    positions = torch.randint(-50, 50, (B, L), device=DEVICE)
    for b in range(B):
        n_pad = min(b * pad, L - 1)
        mask[b, :n_pad] = False
        positions[b, n_pad:] = torch.arange(L - n_pad, device=DEVICE)
    q_position = positions[:, -1].clone()
    if future:
        positions[0, 0] = q_position[0] + 1
    return q, k, v, q_position, positions, mask


def run_both(inputs, theta, alpha, split_size=None):
    q, k, v, q_position, positions, mask = inputs
    expected = tapa_decode_step(q, k, v, q_position, positions, mask, theta=theta, alpha=alpha, backend="torch")
    if split_size is None:
        actual = tapa_decode_step(q, k, v, q_position, positions, mask, theta=theta, alpha=alpha, backend="triton")
    else:
        amp_dim, _ = tapa_split(theta, q.shape[-1])
        actual = tapa_decode_fn(q, k, v, q_position, positions, mask, amp_dim, alpha, split_size=split_size)
    return actual, expected


# B, L, HQ, H, D, V, theta, alpha, pad, split_size (None: the launcher's choice; 64 slots is the smallest
# split, so L > 64 with split_size=1 runs several splits and the merge).
CASES = [
    (2, 37, 4, 2, 16, 16, 0.5, 0.1, 0, None),  # GQA, one partial tile
    (1, 1, 2, 2, 16, 16, 0.5, 0.1, 0, None),  # the query's own token only: 0^alpha = 0
    (2, 30, 2, 2, 16, 24, 0.5, 0.1, 0, None),  # G = 1, V not a power of two
    (2, 40, 4, 1, 16, 8, 0.5, 0.1, 0, None),  # MQA
    (1, 50, 2, 1, 12, 8, 0.25, 0.1, 0, None),  # dA = 3, dP = 9
    (2, 100, 4, 2, 16, 16, 0.5, 0.1, 9, None),  # left padding; L not a multiple of the tile
    (2, 100, 4, 2, 16, 16, 0.5, 0.1, 70, 1),  # two splits; row 1's first split is all padding
    (1, 150, 2, 1, 12, 16, 0.25, 0.3, 5, 64),  # three splits, the last one partial
    (2, 60, 4, 2, 16, 16, 0.5, 0.0, 3, None),  # alpha = 0
]


def case_id(case):
    B, L, HQ, H, D, V, theta, alpha, pad, split = case
    return f"B{B}-L{L}-HQ{HQ}-H{H}-D{D}-V{V}-theta{theta}-alpha{alpha}-pad{pad}-split{split}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_torch(case, dtype):
    B, L, HQ, H, D, V, theta, alpha, pad, split_size = case
    inputs = make_cache(B, L, HQ, H, D, V, dtype, pad)
    actual, expected = run_both(inputs, theta, alpha, split_size)
    assert actual.dtype == dtype
    assert_close("o", actual, expected, TOL[dtype])


@pytest.mark.parametrize("split_size", [None, 1], ids=["one-split", "two-splits"])
def test_future_slot_excluded(split_size):
    """An unmasked slot whose position is past the query's is left out, as the PyTorch path leaves it out."""
    inputs = make_cache(2, 80, 2, 1, 16, 16, torch.float32, pad=4, future=True)
    actual, expected = run_both(inputs, 0.5, 0.1, split_size)
    assert_close("o", actual, expected, 1e-5)
    q, k, v, q_position, positions, mask = inputs
    positions = positions.clone()
    positions[0, 0] = 0  # the same slot made visible must change the output
    moved = tapa_decode_step(q, k, v, q_position, positions, mask, alpha=0.1, backend="triton")
    assert (moved - actual).abs().max() > 1e-4


def test_strided_inputs():
    """A query sliced from a fused projection and a cache sliced from a preallocated buffer: no copies needed."""
    B, L, HQ, H, D, V = 2, 45, 4, 2, 16, 16
    qkv = torch.randn(B, 1, HQ + 2 * H, D, device=DEVICE)
    k_buffer, v_buffer = torch.randn(B, 64, H, D, device=DEVICE), torch.randn(B, 64, H, V, device=DEVICE)
    q, k, v = qkv[:, :, :HQ], k_buffer[:, :L], v_buffer[:, :L]
    _, _, _, q_position, positions, mask = make_cache(B, L, HQ, H, D, V, torch.float32, pad=6)
    actual, expected = run_both((q, k, v, q_position, positions.int(), mask), 0.5, 0.3)
    assert_close("o", actual, expected, 1e-5)


def test_float64_refused():
    q, k, v, q_position, positions, mask = make_cache(1, 8, 2, 1, 16, 16, torch.float64)
    with pytest.raises(ValueError, match="^backend"):
        tapa_decode_step(q, k, v, q_position, positions, mask, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU")
@pytest.mark.parametrize(
    "shape",
    [(4, 32768, 16, 16, 64, 64), (8, 32768, 16, 16, 64, 64), (2, 8191, 32, 8, 128, 128), (1, 65536, 8, 1, 64, 64)],
    ids=lambda s: "B{}-L{}-HQ{}-H{}-D{}-V{}".format(*s),
)
def test_real_sizes(shape):
    B, L, HQ, H, D, V = shape
    inputs = make_cache(B, L, HQ, H, D, V, torch.bfloat16, pad=100)
    actual, expected = run_both(inputs, 0.5, 0.1)
    assert_close("o", actual, expected, 5e-3)


def test_decode_op_opcheck_and_compile():
    from attnkit.ops.tapa.parallel import tapa_decode_op

    q, k, v, q_position, positions, mask = make_cache(2, 37, 4, 2, 16, 16, torch.float32, pad=3)
    torch.library.opcheck(tapa_decode_op, (q, k, v, q_position, positions, mask, 8, 0.1))

    def step(q, k, v):
        return tapa_decode_step(q, k, v, q_position, positions, mask, backend="triton") + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert_close("o", compiled(q, k, v), step(q, k, v), 1e-6)
