"""FSDP2 checkpoints written by every rank through ``torch.distributed.checkpoint`` (issue 21).

Under FSDP2 the trainer's snapshot folder (``checkpoint.write_snapshot``) gets, besides ``checkpoint.pt``:

- ``sharded/``: the model's shards, one safetensors file per rank, written by DCP's ``HuggingFaceStorageWriter``
  (which names the folder), and ``model.safetensors``, the full model, which the same writer consolidates from
  those files on rank 0 (``enable_consolidation``): it reads the shards back from disk, so no rank ever holds the
  whole state in memory. Tied weights are saved once, under their first name, as ``save_pretrained`` does.
- ``optimizer/``: the optimizer state's shards, one safetensors file per rank.

Safetensors only, so loading runs no code. ``checkpoint.pt`` keeps the rest, with the optimizer's ``param_groups``
(hyperparameters and parameter names, no tensors). The snapshot is switched to after all of it is written, so a
kill leaves the previous checkpoint or this one. Every rank must see the same folder (one host, or a shared file
system).

Loading reshards: DCP reads every tensor's slices by their offsets in the full tensor, so the shards load into
FSDP2 at any world size and into a plain model (one process, or DDP); a round trip restores every tensor exactly.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

MODEL_SHARDS = "sharded"  # HuggingFaceStorageWriter's folder for the shards it consolidates
OPTIMIZER_SHARDS = "optimizer"
CONSOLIDATED = "model.safetensors"
_INDEX = "model.safetensors.index.json"  # the consolidation's map of tensors to files; one file here


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{name: first name}`` for every parameter name of ``model`` that names a parameter an earlier name already
    names (tied weights: ``lm_head.weight`` of a model with tied embeddings)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, list[dict]]:
    """The model state without tied aliases, the optimizer state as one flat ``{"<name>.<key>": tensor}`` dict,
    and the optimizer's ``param_groups``: DTensors under FSDP2, plain tensors otherwise. An optimizer that has not
    stepped gets its state built first (``get_state_dict`` does that)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    aliases = _aliases(model)
    model_state = {k: v for k, v in model_state.items() if k not in aliases}
    flat = {}
    for fqn, state in optim_state["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"optimizer: state {key!r} of {fqn} is a {type(value).__name__}, not a tensor")
            flat[f"{fqn}.{key}"] = value
    return model_state, flat, optim_state["param_groups"]


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str) -> list[dict]:
    """Every rank writes its shards of ``model`` and ``optimizer`` into ``folder`` (an existing, empty folder,
    the same on every rank), and rank 0 consolidates the model into ``folder/model.safetensors``. Collective;
    every rank returns once all files are on disk. Returns the optimizer's ``param_groups``, which the caller keeps
    in ``checkpoint.pt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    model_state, optim_state, groups = _states(model, optimizer)
    # The consolidation runs on the coordinator (rank 0) in the writer's finish step, inside this collective save.
    dcp.save(
        model_state, storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True, enable_consolidation=True)
    )
    optimizer_folder = os.path.join(folder, OPTIMIZER_SHARDS)
    dcp.save(optim_state, storage_writer=HuggingFaceStorageWriter(optimizer_folder, save_distributed=True))
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.path.join(folder, _INDEX)) as f:
            (name,) = set(json.load(f)["weight_map"].values())
        os.replace(os.path.join(folder, name), os.path.join(folder, CONSOLIDATED))
        os.remove(os.path.join(folder, _INDEX))
    if dist.is_initialized():
        dist.barrier()  # every file is in place before any rank goes on
    return groups


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: str, groups: list[dict]) -> None:
    """Load what :func:`save_sharded` wrote into ``folder`` into ``model`` and ``optimizer`` (FSDP2 at any world
    size, or plain), with the saved ``param_groups``. Collective under a process group. Raises ``ValueError``
    naming the folder when the shards are missing or do not fit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    for sub in (MODEL_SHARDS, OPTIMIZER_SHARDS):
        if not os.path.isdir(os.path.join(folder, sub)):
            raise ValueError(f"{folder}: the checkpoint's shard folder {sub}/ is missing")
    model_state, optim_flat, _ = _states(model, optimizer)  # the tensors DCP loads into, in place
    try:
        with warnings.catch_warnings():  # one process loading is what we mean: DCP warns that it assumes so
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            for state, sub in ((model_state, MODEL_SHARDS), (optim_flat, OPTIMIZER_SHARDS)):
                reader = HuggingFaceStorageReader(os.path.join(folder, sub))
                dcp.load(state, storage_reader=reader, no_dist=not dist.is_initialized())
    except (CheckpointException, RuntimeError, KeyError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{folder}: the shards do not fit this model ({reason})") from None
    for alias, name in _aliases(model).items():
        model_state[alias] = model_state[name]
    optim_state: dict[str, dict[str, Any]] = {}
    for key, value in optim_flat.items():
        fqn, name = key.rsplit(".", 1)
        optim_state.setdefault(fqn, {})[name] = value
    set_state_dict(
        model, optimizer, model_state_dict=model_state, optim_state_dict={"state": optim_state, "param_groups": groups}
    )
