"""Training: ``TrainConfig`` and ``train(config) -> TrainResult`` (single process, DDP or FSDP2 under torchrun)."""

from .checkpoint import (
    CHECKPOINT_FORMAT,
    CheckpointError,
    load_checkpoint,
    remove_stale_snapshots,
    remove_stale_temporaries,
    write_snapshot,
    write_text_atomic,
)
from .distributed import DistInfo, setup_distributed
from .trainer import (
    CHECKPOINT_NAME,
    NonFiniteLossError,
    RunFolderError,
    TrainConfig,
    TrainResult,
    build_model,
    lr_at,
    open_run_folder,
    train,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "CHECKPOINT_NAME",
    "DistInfo",
    "NonFiniteLossError",
    "RunFolderError",
    "TrainConfig",
    "TrainResult",
    "build_model",
    "load_checkpoint",
    "lr_at",
    "open_run_folder",
    "remove_stale_snapshots",
    "remove_stale_temporaries",
    "setup_distributed",
    "train",
    "write_snapshot",
    "write_text_atomic",
]
