"""FSDP2 checkpoints through torch.distributed.checkpoint (``attnkit.train.sharded``), on two gloo ranks."""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp

from attnkit.train.sharded import load_sharded, remove_stale_shards, save_sharded, shards_folder
from tests.helpers import leave_process_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_and_optimizer(seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.GELU(), torch.nn.Linear(20, 6))
    for layer in model[::2]:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full(state: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in state.items()}


def _round_trip(rank: int, world: int, port: int, folder: str, result: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    model, optimizer = _model_and_optimizer(0)
    for _ in range(2):
        model(torch.randn(5, 12)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    groups = save_sharded(model, optimizer, folder)
    saved_model, saved_optim = get_state_dict(model, optimizer)

    fresh, fresh_optimizer = _model_and_optimizer(1)  # other values, and an optimizer that never stepped
    load_sharded(fresh, fresh_optimizer, folder, groups)
    got_model, got_optim = get_state_dict(fresh, fresh_optimizer)
    same = all(torch.equal(a, b) for a, b in zip(_full(saved_model).values(), _full(got_model).values()))
    for fqn, state in saved_optim["state"].items():
        same &= all(torch.equal(a, b) for a, b in zip(_full(state).values(), _full(got_optim["state"][fqn]).values()))
    # and the loaded pair trains on exactly as the saved one
    x = torch.randn(5, 12)
    for m, opt in ((model, optimizer), (fresh, fresh_optimizer)):
        m(x).square().mean().backward()
        opt.step()
    same &= all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters()))
    if rank == 0:
        torch.save({"same": same, "files": sorted(os.listdir(folder))}, result)
    leave_process_group()


def test_round_trip_restores_every_tensor_exactly(tmp_path):
    folder = shards_folder(str(tmp_path / "checkpoint.pt"), 2)
    result = str(tmp_path / "result.pt")
    mp.spawn(_round_trip, args=(2, _free_port(), folder, result), nprocs=2, join=True)
    got = torch.load(result, weights_only=True)
    assert got["same"], "a saved tensor came back different"
    assert got["files"] and all(f.endswith(".safetensors") for f in got["files"]), "safetensors only: no pickle"


def test_remove_stale_shards_keeps_the_named_folder(tmp_path):
    path = str(tmp_path / "checkpoint.pt")
    for step in (10, 20, 30):
        os.makedirs(shards_folder(path, step))
    (tmp_path / "other.5.shards").mkdir()
    removed = remove_stale_shards(path, keep=shards_folder(path, 20))
    assert sorted(os.path.basename(d) for d in removed) == ["checkpoint.pt.10.shards", "checkpoint.pt.30.shards"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt.20.shards", "other.5.shards"]
    assert len(remove_stale_shards(path, keep=None)) == 1 and os.listdir(tmp_path) == ["other.5.shards"]
