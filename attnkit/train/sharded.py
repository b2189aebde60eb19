"""FSDP2 checkpoints saved and loaded sharded through ``torch.distributed.checkpoint`` (issue 21).

Every rank writes its own shards of the model and optimizer tensors, as safetensors files (DCP's
``HuggingFaceStorageWriter``: no pickle anywhere, so loading runs no code), into a folder of its own per
checkpoint, ``<name>.<step>.shards``. The rest of the checkpoint (step, config, scheduler, RNG, the optimizer's
hyperparameters) stays in ``checkpoint.pt``, written by rank 0 after every rank has finished its shards and
naming their folder: the folder a ``checkpoint.pt`` names is always complete. A kill before ``checkpoint.pt`` is
replaced leaves the previous checkpoint in force and an orphan folder that :func:`remove_stale_shards` clears
when the next run starts; after the replacement, the folders it superseded are removed.

A round trip restores every tensor exactly, at any world size: DCP reshards on load.
"""

from __future__ import annotations

import glob
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

SHARDS_SUFFIX = ".shards"
MODEL, OPTIM = "model.", "optim."


def shards_folder(path: str, step: int) -> str:
    """The folder of the shards of the checkpoint ``path`` at ``step``."""
    return f"{path}.{step}{SHARDS_SUFFIX}"


def _flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], list[dict]]:
    """The sharded (DTensor) model and optimizer state as one flat ``{key: tensor}`` dict, and the optimizer's
    ``param_groups`` (hyperparameters and parameter names: no tensors)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    flat = {MODEL + k: v for k, v in model_state.items()}
    for fqn, state in optim_state["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"optimizer: state {key!r} of {fqn} is a {type(value).__name__}, not a tensor")
            flat[f"{OPTIM}{fqn}.{key}"] = value
    return flat, optim_state["param_groups"]


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str) -> list[dict]:
    """Every rank writes its shards of ``model`` and ``optimizer`` (FSDP2) into ``folder`` (created; it must not
    exist). Collective. Returns the optimizer's ``param_groups``, which the caller keeps in ``checkpoint.pt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    flat, groups = _flat_state(model, optimizer)
    dcp.save(flat, storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True))
    dist.barrier()  # every rank's files are on disk before anyone names the folder
    return groups


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str, groups: list[dict]) -> None:
    """Load what :func:`save_sharded` wrote into ``model`` and ``optimizer`` (FSDP2, the saved run's shapes; an
    optimizer that has not stepped gets its state built first, as ``get_state_dict`` does). Collective. Raises
    ``ValueError`` naming the folder when the shards are missing or do not fit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not os.path.isdir(folder):
        raise ValueError(f"{folder}: the checkpoint's shard folder is missing")
    flat, _ = _flat_state(model, optimizer)
    try:
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(folder))
    except (RuntimeError, KeyError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{folder}: the shards do not fit this model ({reason})") from None
    model_state = {k[len(MODEL) :]: v for k, v in flat.items() if k.startswith(MODEL)}
    optim_state: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith(OPTIM):
            fqn, name = key[len(OPTIM) :].rsplit(".", 1)
            optim_state.setdefault(fqn, {})[name] = value
    set_state_dict(
        model, optimizer, model_state_dict=model_state, optim_state_dict={"state": optim_state, "param_groups": groups}
    )


def remove_stale_shards(path: str, keep: str | None) -> list[str]:
    """Remove the shard folders of checkpoint ``path`` other than ``keep`` (the one ``checkpoint.pt`` names, or
    None when there is none): orphans of an interrupted save, or folders a later checkpoint superseded."""
    stale = [d for d in glob.glob(glob.escape(path) + ".*" + SHARDS_SUFFIX) if keep is None or not _same(d, keep)]
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    return stale


def _same(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)
