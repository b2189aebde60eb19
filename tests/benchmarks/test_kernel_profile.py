"""benchmarks/kernel_profile.py's --set: a module attribute changed for the profile, bad settings refused."""

import pytest

from attnkit.ops.path.triton import prepare
from benchmarks.kernel_profile import applied, apply_setting, main


def test_apply_setting_sets_a_literal(monkeypatch):
    monkeypatch.setattr(prepare, "SUPERBLOCK", prepare.SUPERBLOCK)  # put back after the test
    target, value = apply_setting(f"attnkit.ops.path.triton.prepare.SUPERBLOCK={prepare.NO_SUPERBLOCKS}")
    assert target == "attnkit.ops.path.triton.prepare.SUPERBLOCK" and value == prepare.NO_SUPERBLOCKS
    assert prepare.SUPERBLOCK == prepare.NO_SUPERBLOCKS


def test_applied_puts_every_attribute_back(monkeypatch):
    """``applied`` sets each setting in turn and restores all of them on exit, after an error inside too, and after
    a bad setting partway (the ones before it restored)."""
    monkeypatch.setattr(prepare, "SUPERBLOCK", prepare.SUPERBLOCK)
    saved = prepare.SUPERBLOCK
    good = f"attnkit.ops.path.triton.prepare.SUPERBLOCK={prepare.NO_SUPERBLOCKS}"
    with pytest.raises(RuntimeError), applied([good]):
        assert prepare.SUPERBLOCK == prepare.NO_SUPERBLOCKS
        raise RuntimeError
    assert prepare.SUPERBLOCK == saved
    with (
        pytest.raises(ValueError, match="not a Python literal"),
        applied([good, "attnkit.ops.path.triton.prepare.SUPERBLOCK=big"]),
    ):
        pass
    assert prepare.SUPERBLOCK == saved


@pytest.mark.parametrize(
    "text, message",
    [
        ("attnkit.ops.path.triton.prepare.SUPERBLOCK", "MODULE.NAME=VALUE"),
        ("SUPERBLOCK=1", "MODULE.NAME=VALUE"),
        ("attnkit.ops.path.triton.prepare.NO_SUCH=1", "no attribute 'NO_SUCH'"),
        ("attnkit.ops.path.triton.prepare.SUPERBLOCK=big", "not a Python literal"),
    ],
)
def test_bad_settings_are_refused(monkeypatch, text, message):
    monkeypatch.setattr(prepare, "SUPERBLOCK", prepare.SUPERBLOCK)
    saved = prepare.SUPERBLOCK
    with pytest.raises(ValueError, match=message):
        apply_setting(text)
    assert prepare.SUPERBLOCK == saved


def test_main_refuses_a_bad_setting_before_profiling(capsys):
    with pytest.raises(SystemExit) as error:
        main(["--op", "path", "--set", "attnkit.ops.path.triton.prepare.SUPERBLOCK=big"])
    assert error.value.code == 2 and "not a Python literal" in capsys.readouterr().err


def test_each_profiled_call_starts_from_empty_grads(monkeypatch):
    """kernel_table: every call's gradients are its own (no elementwise adds into the last call's ``.grad``, which
    no training step runs), and the leaves end with none."""
    import torch

    import benchmarks.kernel_profile as kernel_profile

    x, seen = torch.ones(3, requires_grad=True), []

    def profile(run, steps):
        run()
        seen.append(x.grad.clone())
        return []

    monkeypatch.setattr(kernel_profile.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(kernel_profile, "profile_kernels", profile)
    kernel_profile.kernel_table(lambda: x * 2, [x], torch.ones(3))
    assert torch.equal(seen[0], torch.full((3,), 2.0)) and x.grad is None
