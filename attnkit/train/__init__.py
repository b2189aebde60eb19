"""Training: ``TrainConfig`` and ``train(config) -> TrainResult`` (single process, DDP or FSDP2 under torchrun).

The names below are imported from their modules on first use: ``from attnkit.train.config import TrainConfig``
(what ``attnkit train --help`` needs) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of attnkit.train that defines it
_EXPORTS = {
    "CHECKPOINT_FORMAT": "checkpoint",
    "CheckpointError": "checkpoint",
    "load_checkpoint": "checkpoint",
    "remove_stale_snapshots": "checkpoint",
    "remove_stale_temporaries": "checkpoint",
    "write_snapshot": "checkpoint",
    "write_text_atomic": "checkpoint",
    "TrainConfig": "config",
    "DistInfo": "distributed",
    "LaunchError": "distributed",
    "setup_distributed": "distributed",
    "CHECKPOINT_NAME": "trainer",
    "NonFiniteLossError": "trainer",
    "RunFolderError": "trainer",
    "TrainResult": "trainer",
    "build_model": "trainer",
    "lr_at": "trainer",
    "open_run_folder": "trainer",
    "train": "trainer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
