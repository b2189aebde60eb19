"""Proposition 2 of the VLA paper, measured: the radius of ``I − α̂ k̂ᵀ`` is 1, its norm is 1 only when α̂ = k̂."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnkit.experiments.vla_proposition import check_proposition2, model_gates, transition_stats, vla_gates
from attnkit.models import AttnKitConfig, AttnKitForCausalLM


def closed_form(c: float) -> float:
    """``‖I − α̂ k̂ᵀ‖₂`` for unit vectors with ``α̂ᵀk̂ = c``."""
    return math.sqrt((3 - 2 * c + math.sqrt(5 - 4 * c)) / 2)


def test_random_inputs_radius_one_norm_above_one():
    """The gates of the op on random layer-shaped inputs (T = 70 crosses a chunk boundary): every radius is 1, and
    every norm exceeds 1, as the closed form says."""
    stats = check_proposition2(batch=2, seq_len=70, num_heads=2, head_dim=16)
    assert stats["model"] is None
    r = stats["random"]
    assert r["count"] == 2 * 70 * 2
    assert r["radius_is_one"] and r["frac_radius_off_1"] == 0.0
    assert abs(r["radius_max"] - 1) < 1e-9 and abs(r["radius_min"] - 1) < 1e-9
    assert not r["norm_is_one"] and r["norm_max"] > 1 + 1e-3 and r["frac_norm_above_1"] > 0.9
    assert r["norm_min"] >= 1 - 1e-12  # the closed form is >= 1 for every c in (0, 1]
    assert r["closed_form_error"] < 1e-9
    assert 0 < r["cos_min"] <= r["cos_median"] <= 1


def test_constructed_not_parallel_and_parallel():
    """α̂ at 45° to k̂: norm sqrt((3 − √2 + sqrt(5 − 2√2)) / 2) ≈ 1.2368 > 1, radius 1 (eigenvalues 1 − 1/√2 and 1).
    α̂ = k̂ (a projector): both are 1."""
    k_hat = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    alpha = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64) / math.sqrt(2)
    s = transition_stats(k_hat, alpha)
    assert abs(s["norm_max"] - closed_form(1 / math.sqrt(2))) < 1e-12 and s["norm_max"] > 1.23
    assert abs(s["radius_max"] - 1) < 1e-12
    assert s["radius_is_one"] and not s["norm_is_one"] and s["frac_norm_above_1"] == 1.0

    unit = F.normalize(torch.randn(50, 8, dtype=torch.float64), dim=-1)
    s = transition_stats(unit, unit)
    assert s["norm_is_one"] and s["radius_is_one"] and s["frac_norm_above_1"] == 0.0
    assert abs(s["norm_max"] - 1) < 1e-12 and abs(s["cos_min"] - 1) < 1e-12


def test_through_the_op():
    """No penalty direction (u = 0): A = I / lam0, so the op writes along α̂ = k̂ and the norm is 1. A penalty that
    is not along k̂ turns α̂ away from it, and the norm exceeds 1."""
    k = torch.tensor([1.0, 1.0]).view(1, 1, 1, 2)
    q, v = torch.ones_like(k), torch.ones_like(k)
    k_hat, alpha = vla_gates(q, k, v, torch.zeros_like(k), lam0=0.1)
    assert torch.allclose(alpha, k_hat, atol=1e-15)
    assert transition_stats(k_hat, alpha)["norm_is_one"]

    u = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)  # A_1 = (0.1 I + u uᵀ)⁻¹ = diag(1 / 1.1, 10)
    k_hat, alpha = vla_gates(q, k, v, u, lam0=0.1)
    a = torch.tensor([1 / 1.1, 10.0], dtype=torch.float64)
    assert torch.allclose(alpha.flatten(), a / a.norm(), atol=1e-14)
    s = transition_stats(k_hat, alpha)
    c = (a / a.norm()).sum().item() / math.sqrt(2)
    assert s["radius_is_one"] and abs(s["norm_max"] - closed_form(c)) < 1e-12 and s["norm_max"] > 1.1


def test_model_states():
    """The inputs a model's VLA layer sees on a batch (a hybrid stack: only its VLA layer counts)."""
    torch.manual_seed(0)
    config = AttnKitConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_heads=2, mixer=["vla", "rope"], backend="torch"
    )
    model = AttnKitForCausalLM(config).eval()
    ids = torch.randint(0, 50, (3, 40))
    k_hat, alpha = model_gates(model, ids)
    assert k_hat.shape == alpha.shape == (3 * 40 * 2, 16)
    stats = check_proposition2(model, ids, batch=1, seq_len=8, num_heads=1, head_dim=4)
    m = stats["model"]
    assert m["count"] == 3 * 40 * 2
    assert m["radius_is_one"] and m["norm_min"] >= 1 - 1e-12 and m["closed_form_error"] < 1e-9


def test_bad_arguments():
    rope = AttnKitForCausalLM(AttnKitConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_heads=2,
                                            mixer="rope", backend="torch"))  # fmt: skip
    ids = torch.randint(0, 50, (1, 5))
    with pytest.raises(ValueError, match="^model"):
        check_proposition2(rope, ids)
    with pytest.raises(ValueError, match="^input_ids"):
        check_proposition2(rope)
    with pytest.raises(ValueError, match="^tol"):
        check_proposition2(tol=-1.0)
    with pytest.raises(ValueError, match="^batch"):
        check_proposition2(batch=0)
    with pytest.raises(ValueError, match="^lam0"):
        check_proposition2(lam0=0.0)
    with pytest.raises(ValueError, match="^alpha"):
        transition_stats(torch.ones(3, 4), torch.ones(3, 5))
    with pytest.raises(ValueError, match="^k_hat"):
        transition_stats(torch.ones(0, 4), torch.ones(0, 4))
