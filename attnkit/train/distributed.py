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


class LaunchError(ValueError):
    """torchrun's environment, or the batch, does not fit this launch; the message is one line naming the setting
    (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``batch_size`` or ``grad_accum``)."""


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
        raise LaunchError(f"{name}: expected an integer >= {low} in the environment, got {raw!r}")
    return value


def world_size_from_env() -> int:
    """torchrun's ``WORLD_SIZE`` (1 when unset; ``LaunchError`` when it is no integer >= 1)."""
    return _env_int("WORLD_SIZE", 1, 1)


def local_batch_size(batch_size: int, world_size: int, grad_accum: int = 1) -> int:
    """The rows of the global batch ``batch_size`` that each of ``world_size`` ranks takes; a world size that does
    not divide the global batch is refused (the ranks would train on a different batch than one process does), as
    is a rank's batch that ``grad_accum`` micro-batches do not divide (``LaunchError``)."""
    if batch_size % world_size:
        raise LaunchError(
            f"batch_size: the global batch of {batch_size} does not split evenly over {world_size} ranks; "
            f"choose a multiple of {world_size} or another number of ranks"
        )
    local = batch_size // world_size
    if local % grad_accum:
        raise LaunchError(
            f"grad_accum: {grad_accum} micro-batches do not divide a rank's batch of {local} "
            f"(the global batch of {batch_size} over {world_size} ranks)"
        )
    return local


def setup_distributed(device: str, batch_size: int, grad_accum: int = 1) -> DistInfo:
    """Join the process group torchrun describes (gloo on CPU, nccl on GPU); a single process without it.

    ``batch_size`` is the global batch: it must split evenly over the ranks, and each rank's share over
    ``grad_accum`` micro-batches (:func:`local_batch_size`), which is checked, with torchrun's variables, before
    any process group is joined: ``LaunchError`` (a ``ValueError``) otherwise."""
    kind = resolve_device(device)
    world_size = world_size_from_env()
    rank = _env_int("RANK", 0, 0)
    local_rank = _env_int("LOCAL_RANK", 0, 0)
    if rank >= world_size:
        raise LaunchError(f"RANK: expected a rank below WORLD_SIZE={world_size}, got {rank}")
    local_batch = local_batch_size(batch_size, world_size, grad_accum)
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
