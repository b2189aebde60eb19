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
    local_batch: int = 1  # the rows of the global batch this rank takes

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


def _env_int(name: str, default: int, low: int) -> int:
    """An integer >= ``low`` from torchrun's environment variable ``name`` (``default`` when unset)."""
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        raise ValueError(f"{name}: expected an integer >= {low} in the environment, got {raw!r}")
    return value


def local_batch_size(batch_size: int, world_size: int) -> int:
    """The rows of the global batch ``batch_size`` that each of ``world_size`` ranks takes; a world size that does
    not divide the global batch is refused (the ranks would train on a different batch than one process does)."""
    if batch_size % world_size:
        raise ValueError(
            f"batch_size: the global batch of {batch_size} does not split evenly over {world_size} ranks; "
            f"choose a multiple of {world_size} or another number of ranks"
        )
    return batch_size // world_size


def setup_distributed(device: str, batch_size: int) -> DistInfo:
    """Join the process group torchrun describes (gloo on CPU, nccl on GPU); a single process without it.

    ``batch_size`` is the global batch: it must split evenly over the ranks (:func:`local_batch_size`), which is
    checked before any process group is joined."""
    kind = resolve_device(device)
    world_size = _env_int("WORLD_SIZE", 1, 1)
    rank = _env_int("RANK", 0, 0)
    local_rank = _env_int("LOCAL_RANK", 0, 0)
    if rank >= world_size:
        raise ValueError(f"RANK: expected a rank below WORLD_SIZE={world_size}, got {rank}")
    local_batch = local_batch_size(batch_size, world_size)
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if kind == "cuda" else "gloo", device_id=dev if kind == "cuda" else None)
    return DistInfo(rank, world_size, local_rank, dev, local_batch)


def teardown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
