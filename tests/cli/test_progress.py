"""What a run shows while it trains (attnkit.train.progress) and the results tables of the command line."""

from __future__ import annotations

import io
from types import SimpleNamespace

import torch

from attnkit.experiments.output import metrics_table
from attnkit.train.progress import RunProgress, format_metric, headline_values, run_label, summarize_metrics

CONFIG = SimpleNamespace(task="flipflop", mixer="path", lr=3e-3, seed=7, steps=10)
TASK = SimpleNamespace(name="flipflop", seq_len=64)
METRICS = {"in_distribution": {"read_error": 0.0, "sequence_error": 0.0}, "sparse": {"read_error": 0.125}}


class Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _run(stream, enabled=True, start=0, end=10):
    progress = RunProgress(CONFIG, start, end, enabled=enabled, stream=stream)
    progress.header(TASK, torch.nn.Linear(3, 4), torch.device("cpu"), "float32")
    for done in range(start + 1, end + 1):
        progress.step(done, 0.5, 1e-3)
        if done % 5 == 0:
            progress.log(done, 0.5, 1e-3, 1234.0)
            with progress.evaluation(batches=3) as tick:
                for _ in range(3):
                    tick()
            progress.evaluated(done, METRICS)
    progress.close()
    return stream.getvalue()


def test_label_and_metric_formats():
    assert run_label(CONFIG) == "flipflop path lr=0.003 seed=7"
    assert run_label(SimpleNamespace(**{**vars(CONFIG), "mixer": ["path", "rope"]})).startswith("flipflop path+rope ")
    assert format_metric("read_error", 0.296) == "29.60%" and format_metric("perplexity", 12.3456) == "12.3456"
    assert summarize_metrics(METRICS) == "read_error in_distribution 0.00%, sparse 12.50%"
    many = {f"L{i}": {"exact_match": i / 10} for i in range(6)}
    assert headline_values(many) == ("exact_match", {"mean of 6 sets": 0.25})


def test_plain_lines_off_a_terminal():
    text = _run(Stream(tty=False))
    lines = text.splitlines()
    assert "\r" not in text and all(line.startswith("[flipflop path lr=0.003 seed=7] ") for line in lines)
    header = lines[0]
    for part in ("task flipflop", "T=64", "16 parameters", "cpu (", "backend auto (PyTorch on CPU)", "float32"):
        assert part in header, header
    steps = [line for line in lines if "] step " in line]
    assert len(steps) == 2 and steps[0].split("] ")[1].split()[:2] == ["step", "5/10"]
    assert all(" eta " in line and "tok/s 1,234" in line for line in steps)
    assert steps[-1].endswith("eta 00:00")
    evals = [line for line in lines if " eval at step " in line]
    assert len(evals) == 2 and evals[1].endswith("read_error in_distribution 0.00%, sparse 12.50%")


def test_the_eta_leaves_out_evaluations(monkeypatch):
    import attnkit.train.progress as progress_module

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: clock.now)
    stream = Stream(tty=False)
    progress = RunProgress(CONFIG, 2, 10, stream=stream)
    progress.header(TASK, torch.nn.Linear(3, 4), torch.device("cpu"), "float32")
    with progress.evaluation(batches=1):
        clock.now = 100.0  # an evaluation of 100 s
    clock.now = 130.0  # 30 s of training for steps 3 and 4: 6 steps left take 90 s
    progress.log(4, 0.5, 1e-3, 10.0)
    assert stream.getvalue().splitlines()[-1].endswith("eta 01:30")


def test_bars_on_a_terminal():
    text = _run(Stream(tty=True))
    assert "flipflop path lr=0.003 seed=7:" in text and "10/10" in text  # the steps' bar, with its label
    assert "flipflop path lr=0.003 seed=7 eval:" in text  # the evaluation's bar
    assert "eval at step 10" in text and " step      5/10" not in text  # evaluations print; steps do not


def test_quiet_and_other_ranks_show_nothing():
    assert _run(Stream(tty=True), enabled=False) == "" and _run(Stream(tty=False), enabled=False) == ""


def test_metrics_table():
    lines = metrics_table(METRICS).splitlines()
    assert lines[0].split() == ["test", "set", "read_error", "sequence_error"]
    assert lines[1].split() == ["in_distribution", "0.00%", "0.00%"]
    assert lines[2].split() == ["sparse", "12.50%", "-"]
