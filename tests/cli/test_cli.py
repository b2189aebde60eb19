"""The command line at tiny sizes: train, compare, demo, help."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from attnkit.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = [
    "--seq-len",
    "16",
    "--hidden-size",
    "16",
    "--num-heads",
    "2",
    "--num-layers",
    "1",
    "--steps",
    "3",
    "--batch-size",
    "4",
    "--warmup-steps",
    "1",
    "--log-every",
    "1",
    "--device",
    "cpu",
    "--quiet",
    "--task-option",
    'test_sizes={"in_distribution": 8, "sparse": 8, "dense": 8}',
]


def test_help_documents_defaults():
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices
    assert {"train", "compare", "demo", "table"} <= set(sub)
    text = " ".join(sub["train"].format_help().split())
    for option in ("--task", "--mixer", "--steps", "--out", "--lr", "--batch-size", "--seq-len", "--profile"):
        assert option in text
    assert "(default: 1000; on CPU: the demo's 600)" in text and "(default: min(100, steps // 10))" in text
    for option in ("--config", "--init-from", "--grad-accum", "--compile", "--tensorboard", "--grad-checkpointing"):
        assert option in text


def test_python_m_attnkit_help():
    out = subprocess.run(
        [sys.executable, "-m", "attnkit", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0 and "compare" in out.stdout


def test_train(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--mixer", "path", "--out", str(out), "--profile", *TINY]) == 0
    final = json.load(open(out / "final.json"))
    assert final["step"] == 3 and "in_distribution" in final["metrics"]
    assert 0 <= final["profile"]["outside_forward_backward"] <= 1
    events = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert {e["event"] for e in events} == {"train", "eval"}
    assert os.path.exists(out / "checkpoint.pt") and os.path.exists(out / "metrics.png")
    captured = capsys.readouterr()
    assert "profile:" in captured.err
    # stdout: a summary line, the results table (a row per test set), the files written
    lines = captured.out.splitlines()
    assert lines[0].startswith("flipflop path lr=0.003 seed=0: step 3, loss ")
    assert lines[1].split() == ["test", "set", "read_error", "sequence_error"]
    assert [line.split()[0] for line in lines[2:5]] == ["in_distribution", "sparse", "dense"]
    assert all(cell.endswith("%") for line in lines[2:5] for cell in line.split()[1:])
    assert lines[5] == f"wrote {out / 'final.json'}, {out / 'metrics.png'}" and len(lines) == 6


def test_train_json_prints_final_json(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--mixer", "rope", "--out", str(out), "--json", *TINY]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.load(open(out / "final.json")) and printed["step"] == 3


def test_train_refuses_an_old_run_folder(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--mixer", "rope", "--out", str(out), *TINY]) == 0
    capsys.readouterr()
    assert main(["train", "--mixer", "rope", "--out", str(out), *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--resume" in err and "another --out" in err
    assert main(["train", "--mixer", "rope", "--out", str(out), "--overwrite", *TINY]) == 0
    assert [p.name.startswith("run.old-") for p in tmp_path.iterdir()].count(True) == 1
    assert main(["train", "--mixer", "rope", "--out", str(tmp_path / "none"), "--resume", *TINY]) == 2
    assert "no checkpoint to resume" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [
        ["--min-lr-ratio", "-1"],
        ["--weight-decay", "-1"],
        ["--grad-clip", "nan"],
        ["--steps", "-5"],
        ["--stop-at", "-1"],
        ["--model-option", "bogus=1"],
        ["--task-option", "bogus=1"],
        ["--task-option", "bogus"],
        ["--eval-batch-size", "0"],
        ["--batch-size", "0"],
        ["--log-every", "0"],
        ["--device", "cuda"],
        ["--grad-accum", "3"],
        ["--init-from", "no/such/model"],
        ["--config", "no/such/file.yaml"],
    ],
    ids=lambda f: "".join(f),
)
def test_bad_flags_get_one_line_and_exit_2_before_anything_is_built(tmp_path, capsys, monkeypatch, flags):
    import attnkit.train.trainer as trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(trainer, "get_task", None)  # building data would fail loudly
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *TINY, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("attnkit train: "), err
    assert not out.exists()


def _config(argv: list[str]):
    from attnkit.cli import config_from_args

    return config_from_args(build_parser().parse_args(["train", *argv]))


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_under_explicit_flags(tmp_path, suffix):
    path = tmp_path / f"run{suffix}"
    settings = {"steps": 7, "lr": 0.01, "mixer": ["path", "rope"], "num_layers": 2, "task_options": {"seq_len": 32}}
    if suffix == ".json":
        path.write_text(json.dumps(settings))
    else:
        import yaml

        path.write_text(yaml.safe_dump(settings))
    config = _config(["--config", str(path), "--device", "cpu"])
    assert (config.steps, config.lr, config.mixer, config.num_layers) == (7, 0.01, ["path", "rope"], 2)
    assert config.task_options == {"seq_len": 32} and config.out == "runs/train"
    config = _config(["--config", str(path), "--lr", "0.02", "--seq-len", "48", "--steps", "600", "--out", "R"])
    assert (config.steps, config.lr, config.task_options, config.out) == (600, 0.02, {"seq_len": 48}, "R")
    assert config.warmup_steps == 60


def test_config_file_errors_name_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'stepz'" in err and str(bad) in err
    bad.write_text("steps: [1,\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_cpu_defaults_are_the_demos():
    from attnkit.experiments.demo import CPU_SETTING

    config = _config(["--device", "cpu"])
    assert (config.steps, config.batch_size, config.lr) == (CPU_SETTING["steps"], CPU_SETTING["batch_size"], 3e-3)
    assert config.task_options == {"seq_len": CPU_SETTING["seq_len"]} and config.warmup_steps == 60
    assert _config(["--device", "cpu", "--task", "passkey"]).task_options == {}
    assert _config(["--device", "cpu", "--steps", "1000", "--seq-len", "512"]).task_options == {"seq_len": 512}


@pytest.mark.parametrize("flags", [["--task", "bogus"], ["--mixer", "bogus"], ["--mixer", "path", "bogus"]])
def test_unknown_task_or_mixer_is_an_argparse_error(capsys, flags):
    with pytest.raises(SystemExit) as exit_:
        main(["train", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("good") / "run"
    assert main(["train", "--mixer", "rope", "--out", str(out), "--stop-at", "2", *TINY]) == 0
    return out


def _edited(path, **changes):
    ckpt = torch.load(path, weights_only=True)
    ckpt.update(changes)
    return ckpt


def _drop_a_weight(path):
    ckpt = torch.load(path, weights_only=True)
    ckpt["model"].pop(next(iter(ckpt["model"])))
    return ckpt


class NotATensor:
    pass


BAD_CHECKPOINTS = {
    "truncated": (lambda good: good.read_bytes()[: good.stat().st_size // 2], "truncated or corrupt"),
    "empty": (lambda good: b"", "truncated or corrupt"),
    "zeroed": (lambda good: good.read_bytes()[:64] + bytes(good.stat().st_size - 64), "truncated or corrupt"),
    "text": (lambda good: b"hello world\n" * 10, "not an attnkit checkpoint"),
    "object": (lambda good: {"model": NotATensor()}, "not an attnkit checkpoint"),
    "no-model": (lambda good: {"step": 1}, "not an attnkit checkpoint"),
    "format": (lambda good: _edited(good, format=99), "saved by an incompatible version"),
    "weights": (_drop_a_weight, "saved by an incompatible version"),
    "step-negative": (lambda good: _edited(good, step=-5), "step = -5"),
    "step-float": (lambda good: _edited(good, step=1.5), "step = 1.5"),
    "step-past-end": (lambda good: _edited(good, step=99), "past the run's 3 steps"),
    "rng": (lambda good: _edited(good, rng={}), "rng"),
    # a sharded (FSDP2) checkpoint: its world size recorded, its tensors in shard folders beside it
    "sharded-world": (lambda good: _sharded(good, world_size=0), "sharded world_size = 0"),
    "sharded-no-shards": (lambda good: _sharded(good, world_size=2), "shard folder sharded/ is missing"),
}


def _sharded(path, world_size: int):
    ckpt = torch.load(path, weights_only=True)
    ckpt.pop("model")
    ckpt.update(
        format=2, sharded={"world_size": world_size}, optimizer={"param_groups": ckpt["optimizer"]["param_groups"]}
    )
    return ckpt


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_an_unreadable_checkpoint_gets_one_line_and_exit_1(tmp_path, capsys, good_run, case):
    make, expected = BAD_CHECKPOINTS[case]
    out = tmp_path / "run"
    shutil.copytree(good_run, out)
    path = out / "checkpoint.pt"
    content = make(good_run / "checkpoint.pt")
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    before = path.read_bytes()
    capsys.readouterr()
    assert main(["train", "--mixer", "rope", "--out", str(out), "--resume", *TINY]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and expected in err, err
    assert "Traceback" not in err
    assert path.read_bytes() == before


def test_train_under_torchrun_with_a_batch_the_ranks_do_not_divide(tmp_path):
    """rank 0 of two as torchrun starts it (its variables set): the check comes before the process group is joined,
    so this rank alone ends with exit 2 and one line, and nothing is written."""
    env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    out = tmp_path / "run"
    argv = ["train", "--mixer", "rope", "--out", str(out), *TINY, "--batch-size", "3"]
    done = subprocess.run(
        [sys.executable, "-m", "attnkit", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 2, done.stderr
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert err == [
        "attnkit train: batch_size: the global batch of 3 does not split evenly over 2 ranks; "
        "choose a multiple of 2 or another number of ranks"
    ]
    assert not out.exists()


def test_resume_with_a_changed_setting_gets_one_line_and_exit_2(tmp_path, capsys, good_run):
    out = tmp_path / "run"
    shutil.copytree(good_run, out)
    assert main(["train", "--mixer", "rope", "--out", str(out), "--resume", "--lr", "0.03", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lr: saved 0.003, new 0.03" in err, err
    assert main(["train", "--mixer", "rope", "--out", str(out), "--resume", "--log-every", "2", *TINY]) == 0


def test_compare(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--mixers", "path", "rope", "--lrs", "1e-3", "3e-3", "--out", str(out), *TINY]) == 0
    rows = json.load(open(out / "compare.json"))["rows"]
    assert [(r["mixer"], r["lr"]) for r in rows] == [("path", 1e-3), ("path", 3e-3), ("rope", 1e-3), ("rope", 3e-3)]
    assert "in_distribution/read_error" in rows[0]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "read_error on the test sets"
    assert lines[1].split() == ["mixer", "lr", "loss", "in_distribution", "sparse", "dense", "train", "s"]
    assert [line.split()[:2] for line in lines[2:6]] == [
        ["path", "1e-03"],
        ["path", "3e-03"],
        ["rope", "1e-03"],
        ["rope", "3e-03"],
    ]
    for line, row in zip(lines[2:6], rows):
        assert line.split()[3:6] == [
            f"{100 * row[f'{s}/read_error']:.2f}%" for s in ("in_distribution", "sparse", "dense")
        ]
    assert lines[6] == f"wrote {out / 'compare.json'}, {out / 'compare.png'}"
    assert os.path.exists(out / "compare.png")
    assert main(["compare", "--mixers", "rope", "--out", str(tmp_path / "json"), "--json", *TINY]) == 0
    assert json.loads(capsys.readouterr().out) == json.load(open(tmp_path / "json" / "compare.json"))


def test_demo_tiny(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--tiny", "--device", "cpu", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "T=16" in text and "(6.9)" in text and "path" in text and "rope" in text
    assert text.splitlines()[-1] == f"wrote {out / 'demo.json'}, {out / 'demo.png'}"
    assert len(json.load(open(out / "demo.json"))["rows"]) == 2
    # the progress on stderr: labelled lines, an evaluation line per evaluation, no carriage returns
    err = captured.err.splitlines()
    assert err and all(line.startswith(("[flipflop path lr=0.003 seed=0] ", "[flipflop rope ")) for line in err)
    # per run: the validation split twice during training, then both splits at the end
    assert sum(" eval at step " in line for line in err) == 8 and "\r" not in captured.err
    assert sum(", test (" in line for line in err) == 2
    assert main(["demo", "--tiny", "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite" in err
    assert main(["demo", "--tiny", "--device", "cpu", "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name.split(".old-")[0] for p in out.iterdir() if ".old-" in p.name) == ["path", "rope"]
