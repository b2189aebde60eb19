"""Training: ``TrainConfig`` and ``train(config) -> TrainResult`` (single process, DDP or FSDP2 under torchrun)."""

from .checkpoint import load_checkpoint, save_atomic
from .distributed import DistInfo, setup_distributed
from .trainer import CHECKPOINT_NAME, NonFiniteLossError, TrainConfig, TrainResult, build_model, lr_at, train

__all__ = [
    "CHECKPOINT_NAME",
    "DistInfo",
    "NonFiniteLossError",
    "TrainConfig",
    "TrainResult",
    "build_model",
    "load_checkpoint",
    "lr_at",
    "save_atomic",
    "setup_distributed",
    "train",
]
