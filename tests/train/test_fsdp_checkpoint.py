"""The trainer under FSDP2 on two gloo ranks (issue 21): every rank writes its shards into the snapshot, the
snapshot is a Hugging Face model, a stopped or killed run resumes to exactly the uninterrupted run's losses (in two
processes, or resharded into one), and bf16 runs gather bfloat16 parameters and reduce in float32."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import attnkit  # noqa: F401  (registers the attnkit model type)
import attnkit.train.trainer as trainer
from attnkit.train import CHECKPOINT_NAME, TrainConfig, load_checkpoint, train
from attnkit.train.checkpoint import SHARDED_FORMAT, SNAPSHOT
from attnkit.train.sharded import CONSOLIDATED, MODEL_SHARDS, OPTIMIZER_SHARDS, load_sharded
from tests.helpers import leave_process_group
from tests.train.test_faults import HF_FILES
from tests.train.test_trainer import params, tiny

FSDP = dict(steps=6, batch_size=8, mixer="rope", distributed="fsdp", checkpoint_every=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, config: TrainConfig, result: str, options: dict) -> None:
    """One rank of a run of ``config``. ``options``: ``hang`` = (n, path): after the n-th save's shards are written,
    touch ``path.<rank>`` and sleep (to be killed); ``bf16_on_cpu``: the trainer's bf16 decision holds on CPU, and
    the dtypes of the first block's weights during the forward pass are recorded."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    if "hang" in options:
        real_save, saves = trainer.save_sharded, []

        def save_then_hang(*args):
            groups = real_save(*args)
            saves.append(1)
            if len(saves) == options["hang"][0]:
                open(f"{options['hang'][1]}.{rank}", "w").close()
                time.sleep(600)
            return groups

        trainer.save_sharded = save_then_hang
    seen: set[str] = set()
    if options.get("bf16_on_cpu"):
        trainer.uses_bf16 = lambda config, device: config.bf16
        real_build = trainer.build_model

        def watched_build(*args, **kwargs):
            model = real_build(*args, **kwargs)
            for module in model.model.layers[0].modules():
                if isinstance(module, torch.nn.Linear):
                    module.register_forward_pre_hook(lambda m, _: seen.add(str(m.weight.dtype)))
            return model

        trainer.build_model = watched_build
    torch.distributed.init_process_group("gloo")
    out = train(config)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(out.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    dtypes = sorted({str(p.dtype) for p in out.model.parameters()})
    if rank == 0:
        torch.save({"loss": out.loss, "params": state, "forward_dtypes": sorted(seen), "dtypes": dtypes}, result)
    leave_process_group()


def _run(config: TrainConfig, **options) -> dict:
    """A two-rank run of ``config``: its final loss, full parameters and dtypes."""
    result = os.path.join(os.path.dirname(config.out), f"{os.path.basename(config.out)}.result.pt")
    mp.spawn(_worker, args=(2, _free_port(), config, result, options), nprocs=2, join=True)
    return torch.load(result, weights_only=True)


def _losses(folder: str) -> list[tuple[int, float]]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [(e["step"], e["loss"]) for e in map(json.loads, f) if e["event"] == "train"]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted FSDP2 run of six steps, a checkpoint every two."""
    config = tiny(tmp_path_factory.mktemp("fsdp"), "straight", **FSDP)
    return config, _run(config)


def test_the_snapshot_holds_every_ranks_shards_and_a_hugging_face_model(straight):
    config, got = straight
    folder = config.out
    ckpt = load_checkpoint(os.path.join(folder, CHECKPOINT_NAME))
    assert ckpt["format"] == SHARDED_FORMAT and ckpt["sharded"] == {"world_size": 2} and ckpt["step"] == 6
    assert "model" not in ckpt and set(ckpt["optimizer"]) == {"param_groups"}, "no tensors gathered into the file"
    snapshot = os.readlink(os.path.join(folder, SNAPSHOT))
    assert set(os.listdir(os.path.join(folder, snapshot))) == HF_FILES | {
        CHECKPOINT_NAME,
        MODEL_SHARDS,
        OPTIMIZER_SHARDS,
    }
    for sub in (MODEL_SHARDS, OPTIMIZER_SHARDS):
        assert len(os.listdir(os.path.join(folder, snapshot, sub))) == 2, "one file per rank"
    assert set(os.listdir(folder)) == set(trainer.RUN_FILES) | HF_FILES | {SNAPSHOT, snapshot}
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert _same(params(loaded), got["params"])


def test_a_stopped_run_resumes_to_the_same_losses(straight, tmp_path):
    config, want = straight
    run = tiny(tmp_path, "run", **FSDP, stop_at=3)  # checkpoints at step 2, and at 3 where it stops
    _run(run)
    assert load_checkpoint(os.path.join(run.out, CHECKPOINT_NAME))["step"] == 3
    got = _run(tiny(tmp_path, "run", **FSDP, resume=True))
    assert _losses(run.out) == _losses(config.out)
    assert got["loss"] == want["loss"] and _same(got["params"], want["params"])


def test_a_sharded_checkpoint_resumes_in_one_process(straight, tmp_path):
    """Two ranks' shards load into one process's plain model (DCP reshards), here from a copy of the run folder
    that followed its links; the continued losses are the two-rank run's within float32 rounding (one process
    sums the batch in another order)."""
    config, want = straight
    _run(tiny(tmp_path, "original", **FSDP, stop_at=4))
    shutil.copytree(tmp_path / "original", tmp_path / "run")
    result = train(tiny(tmp_path, "run", **FSDP, resume=True))
    got, ref = _losses(os.path.join(tmp_path, "run")), _losses(config.out)
    assert got[:4] == ref[:4] and [s for s, _ in got] == [s for s, _ in ref]
    assert [loss for _, loss in got[4:]] == pytest.approx([loss for _, loss in ref[4:]], rel=1e-5)
    for k, v in params(result.model).items():
        torch.testing.assert_close(v, want["params"][k], rtol=1e-4, atol=1e-5)
    ckpt = load_checkpoint(os.path.join(tmp_path, "run", CHECKPOINT_NAME))
    assert ckpt["format"] == 1 and ckpt["step"] == 6, "one process saves the full state again"


def test_a_kill_while_the_shards_are_written_keeps_the_last_snapshot(straight, tmp_path):
    config, want = straight
    run = tiny(tmp_path, "run", **FSDP)
    marker = str(tmp_path / "hung")
    ctx = mp.get_context("spawn")
    port, result = _free_port(), str(tmp_path / "killed.pt")
    ranks = [ctx.Process(target=_worker, args=(r, 2, port, run, result, {"hang": (2, marker)})) for r in range(2)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + 300
    while not all(os.path.exists(f"{marker}.{r}") for r in range(2)) and time.monotonic() < deadline:
        assert all(p.is_alive() for p in ranks), "a rank ended before the second checkpoint"
        time.sleep(0.2)
    for p in ranks:
        p.kill()
        p.join()
    assert all(os.path.exists(f"{marker}.{r}") for r in range(2)), "the ranks never reached the second checkpoint"

    # the step-4 snapshot was being written (every rank's shards and the full model in place): step 2 stays
    folder = run.out
    (building,) = [name for name in os.listdir(folder) if name.endswith(".tmp")]
    assert building.startswith(f"{SNAPSHOT}-00000004-")
    assert {CONSOLIDATED, MODEL_SHARDS, OPTIMIZER_SHARDS} <= set(os.listdir(os.path.join(folder, building)))
    ckpt = load_checkpoint(os.path.join(folder, CHECKPOINT_NAME))
    assert ckpt["step"] == 2
    snapshot = os.path.realpath(os.path.join(folder, SNAPSHOT))
    model = trainer.build_model(run, vocab_size=5, max_len=16)
    optimizer = torch.optim.AdamW(model.parameters())
    load_sharded(model, optimizer, snapshot, ckpt["optimizer"]["param_groups"])
    assert _same(load_file(os.path.join(folder, CONSOLIDATED)), params(model)), "the Hugging Face model is step 2's"

    got = _run(tiny(tmp_path, "run", **FSDP, resume=True))
    assert _losses(folder) == _losses(config.out)
    assert got["loss"] == want["loss"] and _same(got["params"], want["params"])
    assert not [name for name in os.listdir(folder) if name.endswith(".tmp")]


def test_bf16_gathers_bfloat16_parameters_and_keeps_float32_state(tmp_path):
    """gloo all-gathers bfloat16, so the policy runs on CPU once the trainer's bf16 decision (GPU only) is forced:
    the first block computes with bfloat16 weights, the sharded parameters and the saved model stay float32, and
    the losses are the float32 single process's within bf16 noise (the issue's bar, 1e-2)."""
    config = tiny(tmp_path, "bf16", **FSDP)
    got = _run(config, bf16_on_cpu=True)
    assert got["forward_dtypes"] == ["torch.bfloat16"] and got["dtypes"] == ["torch.float32"]
    weights = load_file(os.path.join(config.out, CONSOLIDATED))
    assert {v.dtype for v in weights.values()} == {torch.float32}
    train(tiny(tmp_path, "single", **FSDP))
    got, ref = _losses(config.out), _losses(str(tmp_path / "single"))
    assert [s for s, _ in got] == [s for s, _ in ref] and got != ref, "bf16 rounding changes the losses"
    for (_, a), (_, b) in zip(got, ref):
        assert abs(a - b) <= 1e-2 * abs(b)


def test_bf16_is_the_gpus(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert trainer.uses_bf16(TrainConfig(), cuda) and not trainer.uses_bf16(TrainConfig(bf16=False), cuda)
    assert not trainer.uses_bf16(TrainConfig(), cpu)
