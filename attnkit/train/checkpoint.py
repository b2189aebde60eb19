"""Atomic writes: a temporary file (or folder) in the same folder, fsynced, then renamed into place.

A crash mid-write leaves the previous file untouched; a write that fails removes its temporary file, and one
that a SIGKILL interrupts leaves it to ``remove_stale_temporaries``, which a run calls when it starts. Files get
the mode the umask gives (as ``open`` would), not ``mkstemp``'s 0600. Checkpoints hold only tensors, numbers,
strings and containers of them, so they load with ``torch.load(weights_only=True)``.

Snapshots: files that must change together (the checkpoint and the Hugging Face model beside it, and under FSDP2
the folders of every rank's shards) are written into a fresh folder ``<folder>/snapshot-<step>-<id>``; one
``os.replace`` of the symbolic link ``<folder>/snapshot`` then switches all of them at once, and
``<folder>/<name>`` is a link to ``snapshot/<name>`` for each file at the snapshot's top. A reader of the folder
sees the old snapshot or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

import torch

# Bumped when the layout of a checkpoint changes; a checkpoint without the key predates it and is format 1.
CHECKPOINT_FORMAT = 1  # the model and optimizer tensors in the file
SHARDED_FORMAT = 2  # FSDP2: the tensors in the snapshot's shard folders (attnkit.train.sharded), "sharded" says so
READ_FORMATS = (CHECKPOINT_FORMAT, SHARDED_FORMAT)
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's archive


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message is one line naming the file and what is wrong."""


@contextlib.contextmanager
def _atomic_file(path: str) -> Iterator[IO[bytes]]:
    """A binary file that replaces ``path`` when the block ends without an error (and is removed when not)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f"{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    # 0o666 & ~umask, as a plain open() gives; O_EXCL so two writers never share a temporary file.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
    """Make the renames and new entries of ``folder`` durable."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_text_atomic(text: str, path: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with _atomic_file(path) as f:
        f.write(text.encode())


def remove_stale_temporaries(folder: str, names: Iterable[str]) -> list[str]:
    """Remove the temporary files that interrupted atomic writes of ``folder/<name>`` left; returns their paths."""
    stale = [p for name in names for p in glob.glob(os.path.join(glob.escape(folder), glob.escape(name) + ".*.tmp"))]
    for p in stale:
        os.remove(p)
    return stale


SNAPSHOT = "snapshot"


def _replace_link(target: str, path: str) -> None:
    """Make ``path`` a symbolic link to ``target`` (relative to it) in one ``os.replace``."""
    tmp = f"{path}.{secrets.token_hex(6)}.tmp"
    os.symlink(target, tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise


def _link_snapshot_files(folder: str, only_missing: bool, names: Iterable[str]) -> None:
    for name in names:
        path = os.path.join(folder, name)
        if os.path.islink(path) and os.readlink(path) == os.path.join(SNAPSHOT, name):
            continue
        if not only_missing or not os.path.lexists(path):
            _replace_link(os.path.join(SNAPSHOT, name), path)


def _top_files(folder: str) -> list[str]:
    """The plain files at the top of ``folder``: the names the run folder links to."""
    return sorted(name for name in os.listdir(folder) if os.path.isfile(os.path.join(folder, name)))


def _finish_files(folder: str) -> None:
    """Give every file below ``folder`` the umask's mode and fsync it; fsync every folder below it too."""
    umask = os.umask(0)
    os.umask(umask)
    for root, _dirs, names in os.walk(folder, topdown=False):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                os.fchmod(f.fileno(), 0o666 & ~umask)  # some writers (safetensors) create their files 0600
                os.fsync(f.fileno())
        _fsync_folder(root)


@contextlib.contextmanager
def new_snapshot(folder: str, tag: str) -> Iterator[str]:
    """A new, empty folder to fill in the block; when the block ends without an error, it becomes ``folder``'s
    snapshot atomically (when not, it is removed).

    Every file left in it (subfolders' too) gets the umask's mode and is fsynced; ``folder/<name>`` becomes (or
    stays) a link to ``folder/snapshot/<name>`` for each plain file at its top (subfolders are reached through
    ``snapshot/``), and the snapshot it replaces is removed. ``tag`` (e.g. the step) names the folder.
    """
    os.makedirs(folder, exist_ok=True)
    name = f"{SNAPSHOT}-{tag}-{secrets.token_hex(4)}"
    tmp = os.path.join(folder, f"{name}.tmp")
    os.mkdir(tmp)  # 0o777 & ~umask
    try:
        yield tmp
        _finish_files(tmp)
        files = _top_files(tmp)
        os.rename(tmp, os.path.join(folder, name))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # New names get their links first (dangling until the switch), so the switch itself completes the set.
    _link_snapshot_files(folder, only_missing=True, names=files)
    link = os.path.join(folder, SNAPSHOT)
    old = os.readlink(link) if os.path.islink(link) else None
    if old is None and os.path.isdir(link):  # a copy that followed the links (shutil.copytree): move it aside
        old = f"{SNAPSHOT}-copied-{secrets.token_hex(4)}"
        os.rename(link, os.path.join(folder, old))
    _replace_link(name, link)
    _fsync_folder(folder)
    _link_snapshot_files(folder, only_missing=False, names=files)  # plain files of an older layout
    if old and old != name:
        shutil.rmtree(os.path.join(folder, old), ignore_errors=True)


def write_snapshot(folder: str, tag: str, write: Callable[[str], None]) -> None:
    """Let ``write(path)`` fill a new, empty folder ``path``, then make it ``folder``'s snapshot atomically
    (:func:`new_snapshot`)."""
    with new_snapshot(folder, tag) as path:
        write(path)


def remove_stale_snapshots(folder: str) -> list[str]:
    """Remove the snapshot folders that are not ``folder``'s current snapshot (interrupted writes, or an old one a
    kill left behind), and the temporary links of interrupted switches; relink the current snapshot's files.
    Returns the removed paths."""
    link = os.path.join(folder, SNAPSHOT)
    current = os.readlink(link) if os.path.islink(link) else None
    stale = [
        p
        for p in glob.glob(os.path.join(glob.escape(folder), f"{SNAPSHOT}-*"))
        if os.path.basename(p) != current and os.path.isdir(p) and not os.path.islink(p)
    ]
    links = glob.glob(os.path.join(glob.escape(folder), "*." + "?" * 12 + ".tmp"))
    stale += [p for p in links if os.path.islink(p)]
    for p in stale:
        shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    if current is not None and os.path.isdir(os.path.join(folder, current)):
        _link_snapshot_files(folder, only_missing=False, names=_top_files(os.path.join(folder, current)))
    return stale


def load_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint written by the trainer: ``{"format", "model", "optimizer", "scheduler", "step", "rng", "config"}``;
    a sharded one (format 2, FSDP2) has ``"sharded": {"world_size": N}`` instead of ``"model"``, its optimizer only
    the ``param_groups``, and its tensors in the shard folders beside it (``attnkit.train.sharded``).

    Raises ``CheckpointError`` (one line: the file, then "truncated or corrupt", "not an attnkit checkpoint" or
    "saved by an incompatible version") when the file cannot be read or its fields are not what the trainer
    writes; the file is only read.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(len(_ZIP_MAGIC))
    except OSError as err:
        raise CheckpointError(f"{path}: cannot be read ({err.strerror or err})") from None
    if not magic:
        raise CheckpointError(f"{path}: truncated or corrupt (the file is empty)")
    if magic != _ZIP_MAGIC:
        raise CheckpointError(f"{path}: not an attnkit checkpoint (not a file that torch.save wrote)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{path}: not an attnkit checkpoint (it holds objects other than tensors, numbers and containers)"
        ) from None
    except Exception as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{path}: truncated or corrupt ({reason})") from None
    _check_fields(path, ckpt)
    return ckpt


def _check_fields(path: str, ckpt: Any) -> None:
    version = ckpt.get("format", 1) if isinstance(ckpt, dict) else None
    tensors = "sharded" if version == SHARDED_FORMAT else "model"
    keys = (tensors, "optimizer", "scheduler", "step", "rng", "config")
    missing = [k for k in keys if k not in ckpt] if isinstance(ckpt, dict) else list(keys)
    if missing:
        raise CheckpointError(f"{path}: not an attnkit checkpoint (no {', '.join(map(repr, missing))})")
    if version not in READ_FORMATS:
        raise CheckpointError(
            f"{path}: saved by an incompatible version (format {version!r}; this attnkit reads "
            f"{' and '.join(map(str, READ_FORMATS))})"
        )

    def invalid(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: truncated or corrupt (invalid field: {what})")

    for k in (tensors, "optimizer", "scheduler", "config", "rng"):
        if not isinstance(ckpt[k], dict):
            raise invalid(f"{k} is a {type(ckpt[k]).__name__}, expected a dict")
    step, steps = ckpt["step"], ckpt["config"].get("steps")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise invalid(f"step = {step!r}, expected an integer >= 0")
    if isinstance(steps, int) and step > steps:
        raise invalid(f"step = {step} is past the run's {steps} steps")
    rng = ckpt["rng"].get("torch")
    if not (isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8 and rng.dim() == 1):
        raise invalid("rng['torch'] is not a generator state (a 1-d uint8 tensor)")
    if version == SHARDED_FORMAT:
        world = ckpt["sharded"].get("world_size")
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise invalid(f"sharded world_size = {world!r}, expected an integer >= 1")
        if not isinstance(ckpt["optimizer"].get("param_groups"), list):
            raise invalid("optimizer has no param_groups list")
