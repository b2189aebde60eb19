"""Fault injection: a run SIGKILLed at random moments, and once in the middle of a checkpoint write, then resumed,
ends exactly where an uninterrupted run ends (bit for bit on CPU) and leaves nothing behind. After every kill the
Hugging Face model in the run folder is complete and holds the checkpoint's weights, or neither is there."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from attnkit.train import CHECKPOINT_NAME, TrainConfig, load_checkpoint
from attnkit.train.checkpoint import SNAPSHOT
from attnkit.train.trainer import RUN_FILES
from tests.train.test_trainer import tiny

KILLS = 12


def _config(folder: str, **overrides) -> TrainConfig:
    """:func:`tests.train.test_trainer.tiny`'s run, longer and with a checkpoint every step, in ``folder``."""
    return tiny(Path(folder).parent, Path(folder).name, steps=40, checkpoint_every=1, **overrides)


def _train_child(config: TrainConfig, in_write=None) -> None:
    from attnkit.train import train

    torch.set_num_threads(1)
    if in_write is not None:  # hang inside a snapshot write, its checkpoint written but not yet switched to
        real_save = torch.save

        def save_then_hang(obj, f, *args, **kwargs):
            real_save(obj, f, *args, **kwargs)
            f.flush()
            in_write.set()
            time.sleep(600)

        torch.save = save_then_hang
    train(config)


HF_FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
HF_FILES |= {"train_config.json"}


def _check_model_matches_checkpoint(folder: str) -> int | None:
    """The step of ``folder``'s checkpoint (None: none yet), after checking that the Hugging Face files are there
    exactly when it is, and hold its weights."""
    present = {name for name in HF_FILES | {CHECKPOINT_NAME} if os.path.exists(os.path.join(folder, name))}
    assert present in (set(), HF_FILES | {CHECKPOINT_NAME}), present
    if not present:
        return None
    ckpt = load_checkpoint(os.path.join(folder, CHECKPOINT_NAME))
    weights = load_file(os.path.join(folder, "model.safetensors"))
    assert weights.keys() == ckpt["model"].keys()
    assert all(torch.equal(weights[k], ckpt["model"][k]) for k in weights)
    assert AutoConfig.from_pretrained(folder).model_type == "attnkit"
    assert len(AutoTokenizer.from_pretrained(folder)) == 5
    return ckpt["step"]


def _losses(folder: str) -> list[tuple[int, float]]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [(e["step"], e["loss"]) for e in map(json.loads, f) if e["event"] == "train"]


def test_sigkill_at_random_moments_then_resume_matches_an_uninterrupted_run(tmp_path):
    # A fork server imports torch once; each run is a fork of it, so a kill costs no interpreter start.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "attnkit.models", "attnkit.train", __name__])

    def run(config: TrainConfig, in_write=None):
        p = ctx.Process(target=_train_child, args=(config, in_write))
        p.start()
        return p

    straight = str(tmp_path / "straight")
    run(_config(straight)).join()  # warms the fork server up
    os.rename(straight, straight + ".warm")
    t0 = time.perf_counter()
    p = run(_config(straight))
    p.join()
    assert p.exitcode == 0
    duration = time.perf_counter() - t0

    folder = str(tmp_path / "killed")
    ckpt_path = os.path.join(folder, CHECKPOINT_NAME)
    rng = random.Random(0)
    killed, stale_seen, steps_seen = 0, 0, set()
    for attempt in range(KILLS + 1):
        has_run = os.path.isdir(folder) and any(os.path.exists(os.path.join(folder, n)) for n in RUN_FILES)
        resume = os.path.exists(ckpt_path)
        config = _config(folder, resume=resume, overwrite=has_run and not resume)
        if attempt == 0:  # the first save of a fresh run: killed with the temporary file written, not renamed
            in_write = ctx.Event()
            p = run(config, in_write)
            assert in_write.wait(timeout=120)
        elif attempt < KILLS:  # a random moment: setting up, in a step, logging, writing a checkpoint
            p = run(config)
            time.sleep(rng.uniform(0, duration / 3))
        else:
            p = run(config)
            p.join(timeout=120)
        p.kill()
        p.join()
        if p.exitcode == 0:
            break
        killed += 1
        step = _check_model_matches_checkpoint(folder)
        if step is not None:
            steps_seen.add(step)
        stale_seen += os.path.isdir(folder) and any(f.endswith(".tmp") for f in os.listdir(folder))
    assert p.exitcode == 0
    # most kills came before the run could finish, in different steps, and some while a checkpoint was written
    assert killed >= KILLS // 2 and len(steps_seen) >= 3 and stale_seen >= 1

    want, got = load_checkpoint(os.path.join(straight, CHECKPOINT_NAME)), load_checkpoint(ckpt_path)
    assert got["step"] == want["step"] == 40
    assert want["model"].keys() == got["model"].keys()
    assert all(torch.equal(want["model"][k], got["model"][k]) for k in want["model"])
    assert _losses(folder) == _losses(straight)
    assert _check_model_matches_checkpoint(folder) == 40
    snapshot = os.readlink(os.path.join(folder, SNAPSHOT))
    assert set(os.listdir(os.path.join(folder, snapshot))) == HF_FILES | {CHECKPOINT_NAME}
    assert set(os.listdir(folder)) == set(RUN_FILES) | HF_FILES | {SNAPSHOT, snapshot}
