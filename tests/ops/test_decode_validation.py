"""Every public decode step checks its inputs as the ops do (issue 18): shapes (a shape that would broadcast is
refused), dtypes, devices and ranges, and the preconditions on data (a cache_mask row with no real slot, negative
TAPA positions), each a ``ValueError`` that names the argument."""

from __future__ import annotations

import pytest
import torch

from attnkit.ops.baselines.delta_rule import delta_rule_step
from attnkit.ops.baselines.linear import linear_attention_step
from attnkit.ops.baselines.softmax import softmax_decode_step
from attnkit.ops.path import path_decode_step, path_decode_step_
from attnkit.ops.tapa import tapa_decode_step
from attnkit.ops.vla import vla_decode_step

B, HQ, H, K, V, L = 2, 4, 2, 8, 4, 5
# Another device than the inputs': meta tensors carry shape and dtype, so only the device check can refuse them.
ELSEWHERE = "meta"


def softmax_args():
    return dict(
        q=torch.randn(B, 1, HQ, K), k_cache=torch.randn(B, L, H, K), v_cache=torch.randn(B, L, H, V),
        cache_mask=torch.ones(B, L, dtype=torch.bool), g_cache=torch.zeros(B, L, HQ), g_t=torch.zeros(B, HQ),
    )  # fmt: skip


def tapa_args():
    return dict(
        q=torch.randn(B, 1, HQ, K), k_cache=torch.randn(B, L, H, K), v_cache=torch.randn(B, L, H, V),
        q_position=torch.tensor([L - 1, L - 1]), k_positions=torch.arange(L).expand(B, L),
        cache_mask=torch.ones(B, L, dtype=torch.bool),
    )  # fmt: skip


def recurrent_args(heads=H):
    return dict(q=torch.randn(B, 1, heads, K), k=torch.randn(B, 1, H, K), v=torch.randn(B, 1, H, V))


def vla_args():
    return dict(**recurrent_args(), u=torch.randn(B, 1, H, K))


def delta_args():
    return dict(**recurrent_args(), beta=torch.rand(B, 1, H), S=torch.zeros(B, H, V, K), scale=K**-0.5)


def linear_args():
    return dict(**recurrent_args(HQ), S=torch.zeros(B, H, V, K), n=torch.zeros(B, H, K), eps=1e-4)


STEPS = {
    "softmax": (softmax_decode_step, softmax_args),
    "tapa": (tapa_decode_step, tapa_args),
    "vla": (vla_decode_step, vla_args),
    "delta_rule": (delta_rule_step, delta_args),
    "linear": (linear_attention_step, linear_args),
}

# (step, argument, how it is spoiled): every step's tensors made to broadcast, integer, on another device
BAD = [
    ("softmax", "k_cache", lambda x: x[:1]),  # one sequence would broadcast over the batch
    ("softmax", "v_cache", lambda x: x.long()),
    ("softmax", "k_cache", lambda x: x.to(ELSEWHERE)),
    ("softmax", "g_cache", lambda x: x[:, :, :1]),
    ("softmax", "g_t", lambda x: x.long()),
    ("softmax", "g_t", lambda x: x.to(ELSEWHERE)),
    ("softmax", "cache_mask", lambda x: x[:1]),
    ("softmax", "cache_mask", lambda x: x.to(ELSEWHERE)),
    ("softmax", "q", lambda x: x[:, :, :0]),  # HQ = 0
    ("softmax", "scale", lambda x: -1.0),
    ("tapa", "k_cache", lambda x: x.long()),
    ("tapa", "v_cache", lambda x: x.to(ELSEWHERE)),
    ("tapa", "q_position", lambda x: x[:1]),  # [1] would broadcast over the batch
    ("tapa", "q_position", lambda x: x.float()),
    ("tapa", "q_position", lambda x: x.to(ELSEWHERE)),
    ("tapa", "k_positions", lambda x: x[:1]),
    ("tapa", "k_positions", lambda x: x.to(ELSEWHERE)),
    ("tapa", "cache_mask", lambda x: x.int()),
    ("tapa", "q", lambda x: x[:, :, :0]),
    ("vla", "u", lambda x: x[:, :, :1]),
    ("vla", "u", lambda x: x.long()),
    ("vla", "u", lambda x: x.to(ELSEWHERE)),
    ("vla", "v", lambda x: x.long()),
    ("vla", "k", lambda x: x.to(ELSEWHERE)),
    ("delta_rule", "beta", lambda x: x[:, :, :1]),
    ("delta_rule", "beta", lambda x: x.long()),
    ("delta_rule", "beta", lambda x: x.to(ELSEWHERE)),
    ("delta_rule", "S", lambda x: x[:1]),
    ("delta_rule", "S", lambda x: x.half()),
    ("delta_rule", "S", lambda x: x.to(ELSEWHERE)),
    ("delta_rule", "v", lambda x: x.long()),
    ("delta_rule", "k", lambda x: x[:1]),
    ("delta_rule", "scale", lambda x: 0.0),
    ("linear", "n", lambda x: x[:1]),
    ("linear", "n", lambda x: x.to(ELSEWHERE)),
    ("linear", "S", lambda x: x[:, :1]),
    ("linear", "S", lambda x: x.long()),
    ("linear", "v", lambda x: x.long()),
    ("linear", "v", lambda x: x.double()),  # not q's dtype
    ("linear", "k", lambda x: x.to(ELSEWHERE)),
    ("linear", "q", lambda x: x[:, :, :0]),
    ("linear", "q", lambda x: x[:, :, :3]),  # 3 query heads over 2 key/value heads
    ("linear", "eps", lambda x: float("nan")),
]


@pytest.mark.parametrize("step, name, spoil", BAD, ids=[f"{s}-{n}-{i}" for i, (s, n, _) in enumerate(BAD)])
def test_bad_input_is_named(step, name, spoil):
    fn, make = STEPS[step]
    args = make()
    args[name] = spoil(args.get(name))
    with pytest.raises(ValueError, match=f"^{name}:"):
        fn(**args)


@pytest.mark.parametrize("step", sorted(STEPS))
def test_good_input_runs(step):
    """The inputs the bad cases spoil are good as they are (each case fails for its one change)."""
    fn, make = STEPS[step]
    out = fn(**make())
    o = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(o).all()


def no_real_slot_mask(length):
    mask = torch.ones(B, length, dtype=torch.bool)
    mask[1] = False
    return mask


def test_softmax_step_refuses_a_row_without_a_real_slot():
    """Before: the row's output was zeros."""
    with pytest.raises(ValueError, match="^cache_mask: 1 row"):
        softmax_decode_step(**{**softmax_args(), "cache_mask": no_real_slot_mask(L)})
    args = softmax_args()
    empty = args["k_cache"][:, :0], args["v_cache"][:, :0]  # an empty cache has no slot at all
    with pytest.raises(ValueError, match="^cache_mask: 2 row"):
        softmax_decode_step(args["q"], *empty, torch.ones(B, 0, dtype=torch.bool))
    with pytest.raises(ValueError, match="^k_cache: an empty cache"):
        softmax_decode_step(args["q"], *empty, None)


def path_token():
    return dict(
        q=torch.randn(B, 1, HQ, K), k=torch.randn(B, 1, H, K), v=torch.randn(B, 1, H, V),
        w=torch.nn.functional.normalize(torch.randn(B, 1, H, K), dim=-1), beta=torch.rand(B, 1, H) + 1,
    )  # fmt: skip


def test_path_steps_refuse_a_row_without_a_real_slot():
    """Both PaTH steps; the in-place one looks at the slots up to the new token's only (later ones are unused)."""
    x = path_token()
    caches = torch.zeros(B, L - 1, H, K), torch.zeros(B, L - 1, H, V)
    with pytest.raises(ValueError, match="^cache_mask: 1 row"):
        path_decode_step(**x, k_cache=caches[0], v_cache=caches[1], cache_mask=no_real_slot_mask(L), backend="torch")
    t, capacity = 2, 6
    k_buf, v_buf = torch.zeros(B, capacity, H, K), torch.zeros(B, capacity, H, V)
    mask = no_real_slot_mask(capacity)
    mask[1, t + 1 :] = True  # real slots after the new token's do not count
    with pytest.raises(ValueError, match="^cache_mask: 1 row"):
        path_decode_step_(**x, k_cache=k_buf, v_cache=v_buf, t=t, cache_mask=mask)
    assert not k_buf.any() and not v_buf.any(), "the cache was written before the check"
    mask[1, t] = True
    o = path_decode_step_(**x, k_cache=k_buf, v_cache=v_buf, t=t, cache_mask=mask)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(cache_mask=no_real_slot_mask(L)), "^cache_mask: 1 row"),  # before: NaN
        (dict(q_position=torch.tensor([L - 1, -1])), "^q_position:"),  # before: NaN
        (dict(k_positions=torch.arange(L).expand(B, L) - 2), "^k_positions:"),  # before: accepted
        (dict(k_positions=torch.arange(L).expand(B, L) + L), "^k_positions: 2 row"),  # every slot after the query
    ],
    ids=["mask-row-empty", "negative-q-position", "negative-k-position", "no-slot-at-or-before-query"],
)
def test_tapa_step_preconditions(change, match):
    with pytest.raises(ValueError, match=match):
        tapa_decode_step(**{**tapa_args(), **change})


def test_tapa_step_ignores_masked_slots_positions():
    """Masked (padding) slots may hold any position, negative ones included: only real slots are checked."""
    args = tapa_args()
    args["k_positions"] = args["k_positions"].clone()
    args["k_positions"][:, 0] = -7
    args["cache_mask"] = args["cache_mask"].clone()
    args["cache_mask"][:, 0] = False
    assert torch.isfinite(tapa_decode_step(**args)).all()


def test_tapa_step_checks_are_one_device_read(monkeypatch):
    """The data preconditions cost one host read a step (``.tolist()`` of a handful of numbers), not one each."""
    reads = []
    original = torch.Tensor.tolist

    def counting(self):
        reads.append(self.numel())
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    tapa_decode_step(**tapa_args())
    assert reads == [5]
