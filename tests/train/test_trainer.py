"""The trainer: bit-exact resume, the NaN guard, atomic checkpoints, DDP against one process."""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import attnkit.train.trainer as trainer
from attnkit.train import NonFiniteLossError, RunFolderError, TrainConfig, load_checkpoint, lr_at, train
from attnkit.train.checkpoint import write_text_atomic
from attnkit.train.config import RESUMABLE_FIELDS, RUN_FIELDS
from tests.helpers import leave_process_group


def tiny(tmp_path, name: str, **overrides) -> TrainConfig:
    options = dict(
        task="flipflop",
        task_options={"seq_len": 16, "test_sizes": {"in_distribution": 8, "sparse": 8, "dense": 8}},
        mixer="path",
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        steps=6,
        batch_size=4,
        lr=1e-2,
        warmup_steps=2,
        log_every=1,
        device="cpu",
        out=str(tmp_path / name),
        quiet=True,
    )
    options.update(overrides)
    return TrainConfig(**options)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_lr_schedule():
    config = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, config) == pytest.approx(0.1)
    assert lr_at(9, config) == pytest.approx(1.0)
    assert lr_at(100, config) == pytest.approx(0.1)


def test_resume_is_bit_exact(tmp_path):
    straight = train(tiny(tmp_path, "straight"))
    first = train(tiny(tmp_path, "resumed", stop_at=3))
    assert first.step == 3
    resumed = train(tiny(tmp_path, "resumed", resume=True))
    assert resumed.step == 6
    assert resumed.loss == straight.loss
    a, b = params(straight.model), params(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    events = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert json.load(open(tmp_path / "resumed" / "final.json"))["step"] == 6


def _tree(folder) -> dict[str, bytes | str]:
    """Every entry below ``folder``: a file's bytes, a link's target."""
    tree: dict[str, bytes | str] = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.islink(path):
            tree[name] = os.readlink(path)
        elif os.path.isdir(path):
            tree.update({f"{name}/{k}": v for k, v in _tree(path).items()})
        else:
            tree[name] = open(path, "rb").read()
    return tree


def test_fresh_run_in_an_old_run_folder_is_refused(tmp_path):
    train(tiny(tmp_path, "again", steps=4, checkpoint_every=2))
    before = _tree(tmp_path / "again")
    with pytest.raises(RunFolderError, match=r"already holds a run.*--resume.*--overwrite.*another --out"):
        train(tiny(tmp_path, "again", steps=2))
    assert _tree(tmp_path / "again") == before
    assert load_checkpoint(str(tmp_path / "again" / "checkpoint.pt"))["step"] == 4


def test_overwrite_moves_the_old_run_aside(tmp_path):
    train(tiny(tmp_path, "again", steps=4))
    before = _tree(tmp_path / "again")
    train(tiny(tmp_path, "again", steps=2, overwrite=True))
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("again.old-")]
    assert _tree(aside) == before
    events = [json.loads(line) for line in open(tmp_path / "again" / "metrics.jsonl")]
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 2]
    train(tiny(tmp_path, "again", steps=2, overwrite=True))
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("again.old-")]) == 2


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(RunFolderError, match="no checkpoint to resume"):
        train(tiny(tmp_path, "empty", resume=True))
    assert not os.path.exists(tmp_path / "empty" / "metrics.jsonl")


def test_every_config_field_is_classified_for_resume():
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not RUN_FIELDS & RESUMABLE_FIELDS
    assert RUN_FIELDS | RESUMABLE_FIELDS == names, "classify a new TrainConfig field in RUN_FIELDS or RESUMABLE_FIELDS"


@pytest.mark.parametrize(
    "changed",
    [{"lr": 0.03}, {"weight_decay": 0.5}, {"seed": 7}, {"hidden_size": 32}, {"steps": 8}, {"lr": 0.03, "seed": 7}],
    ids=lambda d: "-".join(d),
)
def test_resume_refuses_a_changed_run_setting(tmp_path, changed):
    train(tiny(tmp_path, "run", stop_at=3))
    before = _tree(tmp_path / "run")
    with pytest.raises(RunFolderError, match="may not change") as err:
        train(tiny(tmp_path, "run", resume=True, **changed))
    for name, value in changed.items():
        assert f"{name}: saved {getattr(tiny(tmp_path, 'run'), name)!r}, new {value!r}" in str(err.value)
    assert _tree(tmp_path / "run") == before


def test_resume_may_change_how_the_run_is_watched(tmp_path):
    straight = train(tiny(tmp_path, "straight"))
    train(tiny(tmp_path, "run", stop_at=3))
    watch = dict(log_every=2, eval_every=2, eval_batch_size=3, checkpoint_every=1, profile=True, quiet=False)
    resumed = train(tiny(tmp_path, "run", resume=True, **watch))
    assert resumed.step == 6 and resumed.loss == straight.loss


# For every TrainConfig field, values it must refuse (with the other fields at their defaults).
BAD_VALUES = {
    "task": ["nope", None],
    "task_options": [{"bogus": 1}, {"seed": 3}, [("seq_len", 16)]],
    "mixer": ["bogus", None, ["path", "rope"], []],
    "hidden_size": [0, -64, 64.0],
    "num_layers": [0, True],
    "num_heads": [0, 3],
    "model_options": [{"bogus": 1}, {"vocab_size": 3}, {"rms_norm_eps": -1.0}, {"backend": "cuda"}, None],
    "steps": [-5, 0, 1.5],
    "batch_size": [0, -1],
    "grad_accum": [0, -1, 1.5, 3],  # 3 does not divide the default batch of 32
    "lr": [0.0, -1e-3, float("nan"), float("inf"), "3e-3"],
    "weight_decay": [-1.0, float("nan")],
    "warmup_steps": [-1],
    "min_lr_ratio": [-1.0, 1.5, float("nan")],
    "grad_clip": [float("nan"), float("inf"), -1.0],
    "seed": [-1, 1.5, 2**40],
    "device": ["tpu", "cuda"],
    "bf16": ["yes", 1],
    "distributed": ["deepspeed"],
    "init_from": ["", 3, "/no/such/folder", "."],  # "." holds no config.json
    "compile": ["yes"],
    "cuda_graph": ["yes", 1],
    "grad_checkpointing": [1],
    "eval_every": [-1],
    "eval_batch_size": [0, -1],
    "log_every": [0, -1, 1.5, True],
    "checkpoint_every": [-1],
    "out": ["", 3],
    "resume": ["yes"],
    "overwrite": [1],
    "stop_at": [-1, 2000],
    "profile": [None],
    "quiet": ["no"],
    "tensorboard": ["no", True],  # True without a run folder (out)
}


def test_every_config_field_has_bad_values():
    assert set(BAD_VALUES) == {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize(
    "name,value", [(k, v) for k, vs in BAD_VALUES.items() for v in vs], ids=lambda x: str(x)[:20].replace(" ", "")
)
def test_config_refuses_a_bad_field(monkeypatch, name, value):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=name):
        TrainConfig(**{name: value})


def test_config_refuses_bad_combinations():
    with pytest.raises(ValueError, match="resume: needs a run folder"):
        TrainConfig(resume=True)
    with pytest.raises(ValueError, match="resume, overwrite"):
        TrainConfig(resume=True, overwrite=True, out="x")
    TrainConfig(num_heads=3, model_options={"head_dim": 16}, mixer=["path", "rope"], num_layers=2, grad_clip=0.0)


def test_nan_guard_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    build = trainer.build_model

    def poisoned_build(*args, **kwargs):
        model = build(*args, **kwargs)
        calls = {"n": 0}

        def hook(module, inputs, output):
            calls["n"] += 1
            return output * float("nan") if calls["n"] >= 5 else output

        model.lm_head.register_forward_hook(hook)
        return model

    monkeypatch.setattr(trainer, "build_model", poisoned_build)
    config = tiny(tmp_path, "nan", steps=10, checkpoint_every=2)
    with pytest.raises(NonFiniteLossError, match=r"step 5: non-finite loss.*Last good checkpoint: step 4"):
        train(config)
    ckpt = load_checkpoint(os.path.join(config.out, "checkpoint.pt"))
    assert ckpt["step"] == 4
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert not os.path.exists(os.path.join(config.out, "final.json"))
    assert [f for f in os.listdir(config.out) if f.endswith(".tmp")] == []


@pytest.mark.parametrize("nan_from, checkpoint_every, last_good", [(5, 3, "step 3"), (2, 0, "none written yet")])
def test_quiet_run_reads_losses_where_needed_and_still_stops_at_the_first_non_finite_step(
    tmp_path, monkeypatch, nan_from, checkpoint_every, last_good
):
    """A quiet run reads its losses on the host only at the steps that log, checkpoint or evaluate (and the last):
    the steps between are checked there, so the error names the first non-finite step and no checkpoint holds it."""
    build, reads = trainer.build_model, []
    real_tolist = torch.Tensor.tolist

    def poisoned_build(*args, **kwargs):
        model = build(*args, **kwargs)
        calls = {"n": 0}

        def hook(module, inputs, output):
            calls["n"] += 1
            return output * float("nan") if calls["n"] >= nan_from else output

        model.lm_head.register_forward_hook(hook)
        return model

    def counting_tolist(self):
        reads.append(self.shape)
        return real_tolist(self)

    monkeypatch.setattr(trainer, "build_model", poisoned_build)
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    config = tiny(tmp_path, "nan_quiet", steps=10, log_every=7, checkpoint_every=checkpoint_every, quiet=True)
    expected = rf"step {nan_from}: non-finite loss.*Last good checkpoint: {last_good}"
    with pytest.raises(NonFiniteLossError, match=expected):
        train(config)
    # read at step 3 (checkpoint) and 6 (checkpoint: steps 4-6 at once), or once at step 7 (log: steps 1-7 at once)
    assert [shape[0] for shape in reads if len(shape) == 2] == ([3, 3] if checkpoint_every else [7])
    if checkpoint_every:
        ckpt = load_checkpoint(os.path.join(config.out, "checkpoint.pt"))
        assert ckpt["step"] == 3 and all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert not os.path.exists(os.path.join(config.out, "final.json"))


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    real_save, saves = torch.save, []

    def save_then_fail(obj, f, *args, **kwargs):
        saves.append(obj["step"])
        if len(saves) == 2:
            f.write(b"partial")
            raise OSError("disk full")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_then_fail)
    with pytest.raises(OSError, match="disk full"):
        train(tiny(tmp_path, "run", steps=4, checkpoint_every=2))
    monkeypatch.setattr(torch, "save", real_save)
    assert saves == [2, 4]
    assert load_checkpoint(str(tmp_path / "run" / "checkpoint.pt"))["step"] == 2
    assert not [f for f in os.listdir(tmp_path / "run") if f.endswith(".tmp")]
    path = str(tmp_path / "notes.txt")
    write_text_atomic("one", path)
    with pytest.raises(AttributeError):
        write_text_atomic(None, path)  # fails inside the write
    assert open(path).read() == "one"
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "run"]


def test_a_run_removes_stale_temporary_files(tmp_path):
    train(tiny(tmp_path, "run", stop_at=3))
    stale = [tmp_path / "run" / "checkpoint.pt.1a2b3c.tmp", tmp_path / "run" / "final.json.x.tmp"]
    for p in stale:
        p.write_bytes(b"partial")
    keep = tmp_path / "run" / "notes.tmp"
    keep.write_bytes(b"not ours")
    current = os.readlink(tmp_path / "run" / "snapshot")
    for name in ("snapshot-00000009-dead.tmp", "snapshot-00000002-beef"):  # a write cut short, one not switched to
        os.mkdir(tmp_path / "run" / name)
        (tmp_path / "run" / name / "checkpoint.pt").write_bytes(b"partial")
        stale.append(tmp_path / "run" / name)
    os.symlink("snapshot-00000002-beef", tmp_path / "run" / "snapshot.0123456789ab.tmp")  # a switch cut short
    stale.append(tmp_path / "run" / "snapshot.0123456789ab.tmp")
    train(tiny(tmp_path, "run", resume=True))
    assert not any(os.path.lexists(p) for p in stale) and keep.exists()
    assert os.readlink(tmp_path / "run" / "snapshot") != current
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "checkpoint.pt.dead.tmp").write_bytes(b"partial")
    train(tiny(tmp_path, "fresh", steps=2))
    assert not [f for f in os.listdir(tmp_path / "fresh") if f.endswith(".tmp")]


def test_resume_drops_a_log_line_a_kill_cut_short(tmp_path):
    train(tiny(tmp_path, "run", stop_at=3))
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"event": "train", "step": 4, "lo')
    train(tiny(tmp_path, "run", resume=True))
    events = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 2, 3, 4, 5, 6]


def test_run_files_get_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        train(tiny(tmp_path, "run", steps=2))
    finally:
        os.umask(old)
    folder = tmp_path / "run"
    snapshot = folder / os.readlink(folder / "snapshot")
    files = [*(folder / name for name in trainer.RUN_FILES), *snapshot.iterdir()]
    assert len(files) > len(trainer.RUN_FILES) + 5
    for path in files:
        assert os.stat(path).st_mode & 0o777 == 0o640, path
    assert os.stat(snapshot).st_mode & 0o777 == 0o750


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, config: TrainConfig, result_path: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    # The group outlives train() (which then leaves it alone) so the FSDP shards can be gathered afterwards.
    torch.distributed.init_process_group("gloo")
    result = train(config)
    state = params(result.model)
    if config.distributed == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(result.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"loss": result.loss, "params": state}, result_path)
    leave_process_group()


@pytest.mark.parametrize("mode,accum", [("ddp", 1), ("fsdp", 1), ("ddp", 2), ("fsdp", 2)])
def test_distributed_matches_single_process(tmp_path, mode, accum):
    """Two gloo ranks, each with half of the global batch (in ``accum`` micro-batches, all-reduced once), reach
    the single process's loss and parameters."""
    config = tiny(tmp_path, "single", steps=3, batch_size=8, mixer="rope", distributed=mode)
    single = train(config)
    ddp_config = tiny(tmp_path, "ddp", steps=3, batch_size=8, mixer="rope", distributed=mode, grad_accum=accum)
    result_path = str(tmp_path / "ddp_result.pt")
    mp.spawn(_ddp_worker, args=(2, _free_port(), ddp_config, result_path), nprocs=2, join=True)
    got = torch.load(result_path, weights_only=True)
    assert got["loss"] == pytest.approx(single.loss, rel=1e-5)
    ref = params(single.model)
    for k, v in got["params"].items():
        torch.testing.assert_close(v, ref[k], rtol=1e-4, atol=1e-5)
