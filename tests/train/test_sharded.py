"""FSDP2 checkpoints through torch.distributed.checkpoint (``attnkit.train.sharded``), on two gloo ranks: a round
trip restores every tensor exactly, into FSDP2 at the same world size and into a plain model in one process
(DCP reshards), and the consolidated ``model.safetensors`` holds the full model, tied weights once."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from attnkit.train.sharded import CONSOLIDATED, MODEL_SHARDS, OPTIMIZER_SHARDS, load_sharded, save_sharded
from tests.helpers import leave_process_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tiny(torch.nn.Module):
    """An embedding, two blocks and a head, the head's weight optionally the embedding's (tied)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 12)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.GELU(), torch.nn.Linear(20, 12))
        self.head = torch.nn.Linear(12, 11, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def _model_and_optimizer(seed: int, tied: bool, shard: bool):
    torch.manual_seed(seed)
    model = Tiny(tied)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model.blocks[::2]:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _full(model, optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of ``model`` and ``optimizer``, gathered in full: ``model.<name>``, ``optim.<name>.<key>``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    full = {f"model.{k}": v.clone() for k, v in model_state.items()}
    for fqn, state in optim_state["state"].items():
        full.update({f"optim.{fqn}.{k}": v.clone() for k, v in state.items()})
    return full


def _step(model, optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _round_trip(rank: int, world: int, port: int, folder: str, tied: bool, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    model, optimizer = _model_and_optimizer(0, tied, shard=True)
    x = torch.randint(0, 11, (5, 3), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        _step(model, optimizer, x)
    if rank == 0:
        os.makedirs(folder)
    torch.distributed.barrier()
    groups = save_sharded(model, optimizer, folder)
    saved = _full(model, optimizer)

    fresh, fresh_optimizer = _model_and_optimizer(
        1, tied, shard=True
    )  # other values, and an optimizer that never stepped
    load_sharded(fresh, fresh_optimizer, folder, groups)
    loaded = _full(fresh, fresh_optimizer)
    same = saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    # and the loaded pair trains on exactly as the saved one
    _step(model, optimizer, x)
    _step(fresh, fresh_optimizer, x)
    same &= all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(model.parameters(), fresh.parameters()))
    if rank == 0:
        torch.save({"same": same, "saved": saved, "groups": groups}, result)
    leave_process_group()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_round_trip_restores_every_tensor_exactly(tmp_path, tied):
    folder = str(tmp_path / "snapshot")
    result = str(tmp_path / "result.pt")
    mp.spawn(_round_trip, args=(2, _free_port(), folder, tied, result), nprocs=2, join=True)
    got = torch.load(result, weights_only=True)
    assert got["same"], "a saved tensor came back different at the same world size"
    saved = got["saved"]

    # one file per rank for each state, the full model beside them, and nothing else: safetensors, no pickle
    assert sorted(os.listdir(folder)) == sorted([CONSOLIDATED, MODEL_SHARDS, OPTIMIZER_SHARDS])
    for sub in (MODEL_SHARDS, OPTIMIZER_SHARDS):
        files = os.listdir(os.path.join(folder, sub))
        assert len(files) == 2 and all(f.endswith(".safetensors") for f in files), files
    weights = load_file(os.path.join(folder, CONSOLIDATED))
    names = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    assert sorted(weights) == sorted(n for n in names if not (tied and n == "head.weight")), "tied weights once"
    assert all(torch.equal(weights[n], saved[f"model.{n}"]) for n in weights)

    # one process, no process group: the shards of two ranks load into a plain model and optimizer (resharded)
    plain, plain_optimizer = _model_and_optimizer(2, tied, shard=False)
    load_sharded(plain, plain_optimizer, folder, got["groups"])
    loaded = _full(plain, plain_optimizer)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved), "a tensor came back different in one process"
    assert (plain.head.weight is plain.embed.weight) == tied


def _load_at_three(rank: int, world: int, port: int, folder: str, saved: str, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    got = torch.load(saved, weights_only=True)
    model, optimizer = _model_and_optimizer(3, False, shard=True)
    load_sharded(model, optimizer, folder, got["groups"])
    loaded = _full(model, optimizer)
    if rank == 0:
        same = loaded.keys() == got["saved"].keys() and all(torch.equal(loaded[k], got["saved"][k]) for k in loaded)
        torch.save({"same": same}, result)
    leave_process_group()


def test_two_ranks_shards_load_into_three(tmp_path):
    """DCP reshards between FSDP2 layouts: 11, 12 and 20 rows split unevenly over three ranks."""
    folder, saved, result = str(tmp_path / "snapshot"), str(tmp_path / "saved.pt"), str(tmp_path / "result.pt")
    mp.spawn(_round_trip, args=(2, _free_port(), folder, False, saved), nprocs=2, join=True)
    mp.spawn(_load_at_three, args=(3, _free_port(), folder, saved, result), nprocs=3, join=True)
    assert torch.load(result, weights_only=True)["same"], "a tensor came back different at world size 3"


def test_missing_shards_are_a_value_error_naming_the_folder(tmp_path):
    model, optimizer = _model_and_optimizer(0, False, shard=False)
    (tmp_path / MODEL_SHARDS).mkdir()
    with pytest.raises(ValueError, match=f"{tmp_path}: the checkpoint's shard folder {OPTIMIZER_SHARDS}/ is missing"):
        load_sharded(model, optimizer, str(tmp_path), [])
    (tmp_path / OPTIMIZER_SHARDS).mkdir()
    with pytest.raises(ValueError, match=f"{tmp_path}: the shards do not fit this model"):
        load_sharded(model, optimizer, str(tmp_path), [])
