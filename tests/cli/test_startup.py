"""Start-up: ``attnkit --help`` and ``import attnkit`` import only what they need, and the Auto classes still know
the "attnkit" model type whichever of attnkit and transformers is imported first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import attnkit.experiments.demo as demo
from attnkit.cli import COMMANDS, EXPERIMENTS, build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAVY = ("torch", "triton", "transformers", "attnkit.ops", "attnkit.layers", "attnkit.models", "attnkit.tasks")

# Runs `python -m attnkit ARGS` in-process (runpy, as -m does) and prints the imported modules afterwards.
RUN_AND_LIST = """
import json, runpy, sys
sys.argv = ["attnkit", *json.loads(sys.argv[1])]
try:
    runpy.run_module("attnkit", run_name="__main__", alter_sys=True)
except SystemExit as exit_:
    code = exit_.code
print("MODULES=" + json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )


def _modules_after(argv: list[str]) -> tuple[int, set[str], str]:
    out = _python(RUN_AND_LIST, json.dumps(argv))
    line = next(line for line in out.stdout.splitlines() if line.startswith("MODULES="))
    report = json.loads(line.removeprefix("MODULES="))
    return report["code"], set(report["modules"]), out.stdout


def _heavy(modules: set[str], names=HEAVY) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


def test_help_imports_no_torch_model_task_or_kernel_module():
    code, modules, stdout = _modules_after(["--help"])
    assert code == 0 and "compare" in stdout and "demo" in stdout
    assert _heavy(modules) == []


@pytest.mark.parametrize("command", ["demo", "table", "compare", "train"])
def test_command_help_imports_no_torch_model_or_kernel_module(command):
    """train's and compare's flags are TrainConfig's, read off attnkit.train.config, which imports no torch."""
    code, modules, stdout = _modules_after([command, "--help"])
    assert code == 0 and "--json" in stdout
    assert _heavy(modules) == []
    if command in ("train", "compare"):
        assert "--batch-size" in stdout and "attnkit.train.config" in modules and "attnkit.train.trainer" not in modules


def test_import_attnkit_is_light_and_registers_with_transformers_on_its_import():
    code = """
import sys, attnkit
light = [m for m in ("torch", "triton", "transformers", "attnkit.models") if m in sys.modules]
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.for_model("attnkit", vocab_size=11, hidden_size=16, num_hidden_layers=1, num_heads=2)
model = AutoModelForCausalLM.from_config(config)
print(light, type(config).__name__, type(model).__name__, attnkit.models.MIXERS[0])
"""
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "AttnKitConfig", "AttnKitForCausalLM", "path"]


@pytest.mark.parametrize("first", ["import transformers", "import attnkit.models"])
def test_registration_in_any_import_order(first):
    code = f"""
{first}
import attnkit
from transformers import AutoConfig
print(type(AutoConfig.for_model("attnkit")).__name__)
"""
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "AttnKitConfig"


def test_the_default_command_takes_its_own_flags(monkeypatch):
    seen = {}

    def run(args):
        seen["args"] = args
        return 0

    monkeypatch.setattr(demo, "run", run)
    assert main(["--out", "somewhere", "--tiny"]) == 0
    assert seen["args"].command == "demo" and seen["args"].out == "somewhere" and seen["args"].tiny


def test_an_unknown_command_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bogus"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", "--mixers", "path", "bogus"],
        ["compare", "--task", "bogus"],
        ["demo", "--mixers", "bogus"],
        ["--mixers", "bogus"],
    ],
    ids=" ".join,
)
def test_unknown_task_or_mixer_is_a_one_line_argparse_error(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "error:" in line] == [err.splitlines()[-1]]
    assert "invalid choice: 'bogus'" in err and "Traceback" not in err


def test_a_command_gets_only_its_own_arguments():
    parser = build_parser(["table"])
    sub = parser._subparsers._group_actions[0].choices
    assert set(sub) == set(COMMANDS) and set(EXPERIMENTS) <= set(COMMANDS)
    assert "--heads" in sub["table"].format_help() and "--mixer" not in sub["train"].format_help()
