"""``TrainConfig.cuda_graph``: the forward and the summed loss replayed as CUDA graphs train what eager steps train.

On a CPU the option changes nothing (graphs are a GPU's); the graphed step's split of the loss (``loss_sum``) is held
to the trainer's own on any device, and the graphs themselves to eager steps on a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit.train import TrainConfig, train
from attnkit.train.config import cuda_graph_conflict
from attnkit.train.graphed import _LossSum, graphed_loss_sum
from attnkit.train.trainer import build_model, forward_backward

from .test_trainer import params, tiny


@pytest.mark.parametrize(
    "other,named", [({"compile": True}, "compile"), ({"grad_checkpointing": True}, "grad_checkpointing"),
                    ({"grad_accum": 2}, "grad_accum")],
)  # fmt: skip
def test_cuda_graph_refuses_what_a_graphed_step_cannot_hold(other, named):
    with pytest.raises(ValueError, match=f"cuda_graph: not with {named}"):
        TrainConfig(cuda_graph=True, **other)


def test_reproduce_graphs_only_the_configs_that_allow_it():
    assert cuda_graph_conflict({"lr": 1e-3, "grad_accum": 1}) is None
    assert cuda_graph_conflict({"grad_accum": 2}) and cuda_graph_conflict({"compile": True})
    assert cuda_graph_conflict({"grad_checkpointing": True})


def test_loss_sum_gives_the_trainers_loss_and_gradients():
    config = TrainConfig(task="flipflop", task_options={"seq_len": 16}, mixer="rope", hidden_size=16, num_heads=2)
    torch.manual_seed(0)
    model = build_model(config, vocab_size=8, max_len=16)
    x = torch.randint(0, 8, (4, 16))
    y = torch.where(torch.rand(4, 16) < 0.5, -100, torch.randint(0, 8, (4, 16)))
    loss = forward_backward(model, x, y, 0.25)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    split = forward_backward(model, x, y, 0.25, loss_sum=_LossSum(model))
    assert split.item() == pytest.approx(loss.item(), rel=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-6, atol=1e-7)


def test_cuda_graph_is_a_no_op_on_a_cpu(tmp_path):
    eager = train(tiny(tmp_path, "eager", steps=3))
    graphed = train(tiny(tmp_path, "graphed", steps=3, cuda_graph=True))
    assert graphed.loss == eager.loss
    for k, v in params(eager.model).items():
        assert torch.equal(params(graphed.model)[k], v)


def test_graphed_loss_sum_needs_a_gpu_batch():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="cuda_graph: the batch is on cpu"):
        graphed_loss_sum(model, torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), None)


MIXERS = pytest.mark.parametrize(
    "mixer,bf16", [("rope", True), ("rope", False), ("linear", True), ("deltanet", True), ("deltanet", False),
                   ("vla", True), ("vla", False), ("path", True), ("path_fox", True), ("fox", True), ("tapa", True),
                   ("stickbreaking", True), ("nope", True)],
)  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@MIXERS
def test_a_graph_replay_gives_the_eager_gradients(mixer, bf16):
    # captured on one batch, replayed on another: the replay's loss and gradients are the eager step's on that batch,
    # to rounding (eager steps repeat bit for bit; a graphed one differs from them at the rounding level, which
    # benchmarks/graph_noise.py found is not autocast's cache of cast weights, off here as the trainer has it)
    config = TrainConfig(mixer=mixer, hidden_size=64, num_layers=2, num_heads=4, bf16=bf16)
    torch.manual_seed(0)
    model = build_model(config, vocab_size=64, max_len=32).cuda()
    batches = [torch.randint(0, 64, (16, 32), device="cuda") for _ in range(2)]
    x, y = batches[1], torch.where(torch.rand(16, 32, device="cuda") < 0.5, -100, batches[0])
    scale = 1 / int((y != -100).sum())

    def autocast(cache: bool) -> torch.autocast:
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16, cache_enabled=cache)

    eager_loss = forward_backward(model, x, y, scale, autocast=autocast(True))
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss_sum = graphed_loss_sum(model, batches[0], batches[1], autocast(False))
    assert all(p.grad is None for p in model.parameters())  # the capture's warm-up leaves .grad alone
    graphed_loss = forward_backward(model, x, y, scale, autocast=autocast(False), loss_sum=loss_sum)
    assert graphed_loss.item() == pytest.approx(eager_loss.item(), rel=1e-5)
    for n, p in model.named_parameters():
        g = eager[n]
        torch.testing.assert_close(p.grad, g, rtol=2e-2, atol=1e-2 * g.abs().max().item(), msg=n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@MIXERS
def test_graphed_steps_train_what_eager_steps_train(tmp_path, mixer, bf16):
    # MQAR in the VLA form, the reproduction's cells at a tenth of their width. The graphed gradients are the eager
    # ones to rounding (test above), so the losses agree to rounding, step by step. So do the parameters, but for the
    # few elements whose gradient is near zero: AdamW moves an element by about ±lr a step whatever its gradient's
    # size, so a rounding-level difference of sign there becomes an lr-sized one (an H100, twenty-eighth session,
    # benchmarks/graph_noise.py: eager runs agree bit for bit; the graphed PaTH-FoX run differs by up to 2.4 lr, with
    # 21 elements past the tolerance in all, at most 6 in one tensor (of 8192); FoX up to 1.7 lr, 25, at most 9)
    def run(name: str, **graph):
        config = tiny(tmp_path, name, task="mqar_vla", task_options={"num_kv_pairs": 4, "test_size": 64,
                      "validation_size": 32}, mixer=mixer, hidden_size=64, num_layers=2, num_heads=4, steps=8,
                      batch_size=32, lr=3e-3, device="cuda", bf16=bf16, **graph)  # fmt: skip
        result = train(config)
        with open(tmp_path / name / "metrics.jsonl") as f:
            losses = [e["loss"] for e in map(json.loads, f) if e["event"] == "train"]
        return result, losses

    eager, eager_losses = run("eager")
    graphed, graphed_losses = run("graphed", cuda_graph=True)
    assert len(graphed_losses) == 8
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(eager_losses), rtol=2e-3, atol=0)
    lr, steps = 3e-3, 8
    for k, v in params(eager.model).items():
        diff = (params(graphed.model)[k] - v).abs()
        past = diff > 2e-3 + 2e-2 * v.abs()
        assert int(past.sum()) <= max(1, v.numel() // 1000), f"{k}: {int(past.sum())} of {v.numel()} elements differ"
        assert diff.max().item() <= steps * lr, k  # at most 8 steps of AdamW's ±lr apart


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphed_loss_sum_refuses_a_batch_of_another_shape():
    config = TrainConfig(task="flipflop", task_options={"seq_len": 16}, mixer="rope", hidden_size=16, num_heads=2)
    model = build_model(config, vocab_size=8, max_len=16).cuda()
    x = torch.randint(0, 8, (4, 16), device="cuda")
    loss_sum = graphed_loss_sum(model, x, x.clone(), torch.autocast("cuda", enabled=False, cache_enabled=False))
    assert torch.isfinite(loss_sum(x, x))
    with pytest.raises(ValueError, match=r"cuda_graph: a batch of shape \[2, 16\]"):
        loss_sum(x[:2], x[:2])


def test_cuda_graph_is_refused_under_torchrun_before_the_run_folder_is_touched(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="cuda_graph: not under torchrun"):
        train(tiny(tmp_path, "run", cuda_graph=True))
    assert not (tmp_path / "run").exists()
