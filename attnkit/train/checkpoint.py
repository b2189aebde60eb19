"""Atomic checkpoints: write a temporary file in the same folder, fsync it, then ``os.replace`` it into place.

A crash mid-write leaves the previous checkpoint untouched and no partial file behind. Checkpoints hold only
tensors, numbers, strings and containers of them, so they load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch


def save_atomic(obj: Any, path: str) -> None:
    """``torch.save(obj)`` to ``path`` atomically (readers see the old file or the new one, never a partial one)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
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


def load_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint written by the trainer: ``{"model", "optimizer", "scheduler", "step", "rng", "config"}``."""
    return torch.load(path, map_location=map_location, weights_only=True)
