"""A run folder is a Hugging Face model: from_pretrained, extrapolate and --init-from accept it; the trainer's
conventions (gradient accumulation, compile, TensorBoard) keep the training it does."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import attnkit  # noqa: F401  (registers the attnkit model type)
import attnkit.train.config as train_config
import attnkit.train.trainer as trainer
from attnkit.cli import main
from attnkit.models import from_llama
from attnkit.tasks import get_task, make_generator
from attnkit.train import TrainConfig, load_checkpoint, train
from attnkit.train.checkpoint import SNAPSHOT, write_snapshot
from attnkit.train.trainer import build_model, forward_backward

from .test_trainer import params, tiny

TINY_CLI = "--seq-len 16 --steps 2 --batch-size 4 --device cpu --quiet".split()
TINY_CLI += ["--task-option", 'test_sizes={"in_distribution": 8, "sparse": 8, "dense": 8}']


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits


def test_a_run_folder_is_a_hugging_face_model(tmp_path, capsys):
    result = train(tiny(tmp_path, "run", steps=2))
    run = str(tmp_path / "run")
    loaded = AutoModelForCausalLM.from_pretrained(run)
    x = get_task("flipflop", seq_len=16).sample(3, make_generator(5))[0]
    torch.testing.assert_close(_logits(loaded, x), _logits(result.model, x), rtol=0, atol=0)
    tok = AutoTokenizer.from_pretrained(run)
    assert tok(tok.decode(x[0].tolist()), add_special_tokens=False)["input_ids"] == x[0].tolist()
    ckpt = load_checkpoint(os.path.join(run, "checkpoint.pt"))
    assert ckpt["step"] == 2 and all(torch.equal(ckpt["model"][k], v) for k, v in loaded.state_dict().items())

    capsys.readouterr()
    assert main(["extrapolate", run, "--lengths", "16", "32", "--out", str(tmp_path / "ex.json")]) == 0
    out = capsys.readouterr().out
    assert "flipflop, trained at 16" in out and "read_error" in out

    # a run folder starts another run: the same weights, the shape read from the folder
    assert main(["train", "--init-from", run, "--out", str(tmp_path / "next"), *TINY_CLI]) == 0
    assert load_checkpoint(str(tmp_path / "next" / "checkpoint.pt"))["config"]["init_from"] == run
    first = build_model(tiny(tmp_path, "unused", init_from=run), vocab_size=5, max_len=16)
    assert all(torch.equal(first.state_dict()[k], v) for k, v in loaded.state_dict().items())


def _train_losses(folder) -> list[tuple[int, float]]:
    events = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    return [(e["step"], e["loss"]) for e in events if e["event"] == "train"]


def test_a_resume_never_reads_init_from(tmp_path, capsys):
    """A run started from a saved model resumes from its own folder after that model is gone: the same losses and
    weights as the uninterrupted run, through train() and through the command line (which reads the model's shape
    from the run folder then)."""
    train(tiny(tmp_path, "base", steps=2))
    init = str(tmp_path / "base")
    straight = train(tiny(tmp_path, "straight", init_from=init))
    train(tiny(tmp_path, "run", init_from=init, stop_at=3))
    cli = ["train", "--init-from", init, "--out", str(tmp_path / "cli"), *TINY_CLI]
    assert main([*cli, "--stop-at", "1"]) == 0
    os.rename(init, init + ".gone")

    resumed = train(tiny(tmp_path, "run", init_from=init, resume=True))
    assert _train_losses(tmp_path / "run") == _train_losses(tmp_path / "straight")
    a, b = params(straight.model), params(resumed.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main([*cli, "--resume"]) == 0, capsys.readouterr().err
    assert [step for step, _ in _train_losses(tmp_path / "cli")] == [1, 2]
    assert load_checkpoint(str(tmp_path / "cli" / "checkpoint.pt"))["config"]["init_from"] == init
    with pytest.raises(ValueError, match="init_from: .* is not a folder"):  # a fresh run still needs it
        tiny(tmp_path, "fresh", init_from=init)


def test_checkpoint_every_step_keeps_one_snapshot(tmp_path):
    train(tiny(tmp_path, "run", steps=4, checkpoint_every=1))
    snapshots = [p for p in os.listdir(tmp_path / "run") if p.startswith(f"{SNAPSHOT}-")]
    assert snapshots == [os.readlink(tmp_path / "run" / SNAPSHOT)] and "00000004" in snapshots[0]


def test_a_failed_snapshot_write_keeps_the_last_one(tmp_path):
    folder = str(tmp_path / "run")

    def write(step: int):
        def fill(path: str) -> None:
            for name in ("checkpoint.pt", "config.json"):
                with open(os.path.join(path, name), "w") as f:
                    f.write(f"{name} {step}")
            if step == 2:
                raise OSError("disk full")

        return fill

    write_snapshot(folder, "1", write(1))
    with pytest.raises(OSError, match="disk full"):
        write_snapshot(folder, "2", write(2))
    assert sorted(os.listdir(folder)) == sorted(
        ["checkpoint.pt", "config.json", SNAPSHOT, os.readlink(f"{folder}/snapshot")]
    )
    assert open(os.path.join(folder, "checkpoint.pt")).read() == "checkpoint.pt 1"
    write_snapshot(folder, "3", write(3))
    assert open(os.path.join(folder, "config.json")).read() == "config.json 3"
    assert len([p for p in os.listdir(folder) if p.startswith(f"{SNAPSHOT}-")]) == 1


def test_init_from_a_llama_conversion(tmp_path):
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        )
    )
    converted = from_llama(llama, mixer="path")
    converted.save_pretrained(tmp_path / "converted")
    config = tiny(tmp_path, "run", init_from=str(tmp_path / "converted"), num_layers=2, steps=2)
    start = build_model(config, vocab_size=5, max_len=16)
    assert all(torch.equal(start.state_dict()[k], v) for k, v in converted.state_dict().items())
    result = train(config)
    assert result.step == 2 and result.model.config.vocab_size == 32
    moved = params(result.model)
    assert any(not torch.equal(moved[k], v) for k, v in converted.state_dict().items())
    with pytest.raises(ValueError, match="hidden_size: 64, but the model at init_from has 16"):
        TrainConfig(init_from=str(tmp_path / "converted"), num_layers=2)
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="init_from: .* holds a 'llama' model"):
        TrainConfig(init_from=str(tmp_path / "llama"))


@pytest.mark.parametrize("mixer", ["path", "rope"])
def test_grad_accum_matches_one_full_batch(mixer):
    model = build_model(TrainConfig(mixer=mixer, hidden_size=16), vocab_size=5, max_len=16)
    x, y = get_task("flipflop", seq_len=16).sample(8, make_generator(0))
    scale = 1 / int((y != -100).sum())
    grads = {}
    for accum in (1, 2, 4):
        model.zero_grad(set_to_none=True)
        loss = forward_backward(model, x, y, scale, accum)
        grads[accum] = (loss, {k: p.grad.clone() for k, p in model.named_parameters()})
    for accum in (2, 4):
        torch.testing.assert_close(grads[accum][0], grads[1][0], rtol=1e-6, atol=0)
        for k, g in grads[1][1].items():
            torch.testing.assert_close(grads[accum][1][k], g, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="grad_accum: 3 micro-batches"):
        forward_backward(model, x, y, scale, 3)


def test_grad_accum_run_matches(tmp_path):
    one = train(tiny(tmp_path, "one", steps=3))
    two = train(tiny(tmp_path, "two", steps=3, grad_accum=2))
    assert two.loss == pytest.approx(one.loss, rel=1e-6)
    a, b = params(one.model), params(two.model)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)


def test_compile_trains_the_same(tmp_path, monkeypatch):
    calls = []
    real = torch.compile

    def eager_compile(model, **kwargs):  # dynamo traces the step; inductor's code generation is not tested here
        calls.append(model)
        return real(model, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", eager_compile)
    eager = train(tiny(tmp_path, "eager", steps=3, mixer="rope"))
    compiled = train(tiny(tmp_path, "compiled", steps=3, mixer="rope", compile=True))
    assert len(calls) == 1
    assert compiled.loss == pytest.approx(eager.loss, rel=1e-6)


def test_tensorboard_event_files(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(tiny(tmp_path, "run", steps=3, tensorboard=True))
    (events,) = glob.glob(str(tmp_path / "run" / "tensorboard" / "events.out.tfevents.*"))
    acc = EventAccumulator(events)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/test/sparse/read_error", "eval/validation/validation/read_error"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]

    real = train_config.importlib.util.find_spec
    monkeypatch.setattr(train_config.importlib.util, "find_spec", lambda n: None if n == "tensorboard" else real(n))
    with pytest.raises(ValueError, match=r"tensorboard: .*pip install 'attnkit\[tensorboard\]'"):
        tiny(tmp_path, "other", tensorboard=True)


def test_warmup_default_fits_the_run():
    assert [TrainConfig(steps=s).warmup_steps for s in (3, 100, 999, 5000)] == [0, 10, 99, 100]
    assert TrainConfig(steps=100, warmup_steps=7).warmup_steps == 7
    config = TrainConfig(steps=100)
    assert trainer.lr_at(99, config) < 0.2  # --steps 100 ends near the floor, not at the peak


def test_extrapolate_a_bpe_language_model_run(tmp_path, capsys):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    rng = torch.Generator().manual_seed(0)
    text = " ".join(words[i] for i in torch.randint(0, len(words), (20000,), generator=rng).tolist())
    (tmp_path / "corpus.txt").write_text(text)
    options = {"corpus": str(tmp_path / "corpus.txt"), "tokenizer": "bpe", "bpe_vocab_size": 300, "seq_len": 16}
    result = train(tiny(tmp_path, "run", task="lm", task_options={**options, "eval_tokens": 256}, steps=2))
    run = str(tmp_path / "run")
    tok = AutoTokenizer.from_pretrained(run)
    assert len(tok) == result.model.config.vocab_size  # 300 asked for; the BPE ran out of merges first
    task = get_task("lm", **options)
    assert tok("gamma delta", add_special_tokens=False)["input_ids"] == task.tokenizer.encode("gamma delta")
    capsys.readouterr()
    assert main(["extrapolate", run, "--lengths", "16", "32", "--eval-tokens", "128"]) == 0
    out = capsys.readouterr().out
    assert "lm, trained at 16" in out and "non-overlapping" in out


def test_grad_checkpointing_trains_the_same(tmp_path, monkeypatch):
    calls = []
    real = trainer.build_model

    def watched_build(*args, **kwargs):
        model = real(*args, **kwargs)
        enable = model.gradient_checkpointing_enable
        model.gradient_checkpointing_enable = lambda **kw: (calls.append(kw), enable(**kw))[1]
        return model

    monkeypatch.setattr(trainer, "build_model", watched_build)
    plain = train(tiny(tmp_path, "plain", steps=3, num_layers=2))
    checkpointed = train(tiny(tmp_path, "checkpointed", steps=3, num_layers=2, grad_checkpointing=True))
    assert len(calls) == 1 and checkpointed.model.is_activation_checkpointing
    assert checkpointed.loss == pytest.approx(plain.loss, rel=1e-6)
    a, b = params(plain.model), params(checkpointed.model)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
