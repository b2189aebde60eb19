"""Atomic checkpoints: write a temporary file in the same folder, fsync it, then ``os.replace`` it into place.

A crash mid-write leaves the previous checkpoint untouched; a write that fails removes its temporary file, and
one that a SIGKILL interrupts leaves it to ``remove_stale_temporaries``, which a run calls when it starts.
Files get the mode the umask gives (as ``open`` would), not ``mkstemp``'s 0600. Checkpoints hold only tensors,
numbers, strings and containers of them, so they load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
from collections.abc import Iterable, Iterator
from typing import IO, Any

import torch


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
    # Make the rename itself durable.
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_atomic(obj: Any, path: str) -> None:
    """``torch.save(obj)`` to ``path`` atomically (readers see the old file or the new one, never a partial one)."""
    with _atomic_file(path) as f:
        torch.save(obj, f)


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


def load_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint written by the trainer: ``{"model", "optimizer", "scheduler", "step", "rng", "config"}``."""
    return torch.load(path, map_location=map_location, weights_only=True)
