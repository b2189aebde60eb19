"""Process-group set-up from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'auto', 'cpu' or 'cuda', got {device!r}")
    return device


def setup_distributed(device: str) -> DistInfo:
    """Join the process group torchrun describes (gloo on CPU, nccl on GPU); a single process without it."""
    kind = resolve_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if kind == "cuda" else "gloo", device_id=dev if kind == "cuda" else None)
    return DistInfo(rank, world_size, local_rank, dev)


def teardown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
