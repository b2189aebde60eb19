"""The trainer: one loop a reader can follow top to bottom (nanoGPT style).

Data: step ``s`` draws its global batch from a generator seeded by ``(seed, s)``, so a resumed run, or a run on
any number of ranks, sees exactly the same batches; rank ``r`` keeps rows ``[r·b, (r+1)·b)`` of it. The loss is
the sum over a rank's scored tokens divided by the scored tokens of the *global* batch (times the world size,
which DDP's gradient averaging divides back out), so N ranks compute the same gradient as one process.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from ..tasks import IGNORE_INDEX, get_task, make_generator
from .checkpoint import (
    CHECKPOINT_FORMAT,
    SHARDED_FORMAT,
    SNAPSHOT,
    CheckpointError,
    load_checkpoint,
    new_snapshot,
    remove_stale_snapshots,
    remove_stale_temporaries,
    write_text_atomic,
)
from .config import TrainConfig, resume_mismatches
from .distributed import setup_distributed, world_size_from_env
from .graphed import graphed_loss_sum, token_loss_sum
from .hf_folder import RUN_CONFIG_NAME, load_saved_model, saved_model_config, write_hf_config, write_hf_model
from .progress import RunProgress, format_profile
from .sharded import load_sharded, save_sharded

CHECKPOINT_NAME = "checkpoint.pt"


@dataclass
class TrainResult:
    step: int
    loss: float  # training loss of the last step
    metrics: dict[str, dict[str, float]]  # the task's test-set metrics at the end
    wall_time_s: float
    tokens_per_s: float
    profile: dict[str, float] | None
    model: torch.nn.Module | None = field(default=None, repr=False)
    validation_metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # the validation split's, at the end
    precision: str = "float32"  # the arithmetic: "float32", "bfloat16 autocast", and under FSDP2 its parameters

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or inf; the last good checkpoint was left as it was."""


class RunFolderError(ValueError):
    """The run folder does not fit the request: an earlier run is in the way, or there is nothing to resume."""


RUN_FILES = (CHECKPOINT_NAME, "metrics.jsonl", "final.json")


def open_run_folder(config: TrainConfig, is_main: bool = True) -> dict[str, Any] | None:
    """Check ``config.out`` against ``resume`` and ``overwrite``; the checkpoint to resume from, or ``None``.

    A folder holding an earlier run (any of ``RUN_FILES``) is refused unless the run is resumed or ``overwrite``
    moves the folder aside to ``<out>.old-<UTC time>``; nothing is ever deleted. A resume needs a checkpoint that
    loads (``CheckpointError`` otherwise) and was saved with the same ``RUN_FIELDS``. Only ``is_main`` changes
    the folder (the move, and removing the temporary files of interrupted writes); with it off this is a check.
    """
    out = config.out
    if not out:
        return None
    ckpt_path = os.path.join(out, CHECKPOINT_NAME)
    has_checkpoint = os.path.isfile(ckpt_path)
    found = [name for name in RUN_FILES if os.path.exists(os.path.join(out, name))]
    ckpt = None
    if config.resume:
        if not has_checkpoint:
            raise RunFolderError(f"--resume: there is no checkpoint to resume at {ckpt_path}")
        ckpt = load_checkpoint(ckpt_path)
        changed = resume_mismatches(ckpt["config"], config)
        if changed:
            raise RunFolderError(
                f"--resume: these settings define the run and may not change: {'; '.join(changed)} "
                "(start a new run with another --out)"
            )
    elif found and not config.overwrite:
        hint = "pass --resume to continue it, " if has_checkpoint else ""
        raise RunFolderError(
            f"{out} already holds a run ({', '.join(found)}): {hint}pass --overwrite to move it aside, "
            "or choose another --out"
        )
    elif found and is_main:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        aside, n = f"{os.path.normpath(out)}.old-{stamp}", 1
        while os.path.exists(aside):
            aside, n = f"{os.path.normpath(out)}.old-{stamp}-{n}", n + 1
        os.rename(out, aside)
    if is_main and os.path.isdir(out):
        remove_stale_temporaries(out, RUN_FILES)
        remove_stale_snapshots(out)
    return ckpt


def lr_at(step: int, config: TrainConfig) -> float:
    """Multiplier of ``config.lr`` at ``step`` (0-based): linear warmup, then cosine to ``min_lr_ratio``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def batch_generator(seed: int, step: int) -> torch.Generator:
    """The generator of step ``step``'s global batch: the same in every process and after a resume."""
    return make_generator(seed * 1_000_003 + step)


def build_model(config: TrainConfig, vocab_size: int, max_len: int, resume_from: str | None = None) -> torch.nn.Module:
    """The model ``config`` asks for: fresh (seeded by ``config.seed``) or loaded from ``config.init_from``.

    ``resume_from`` (a resume: the folder of its checkpoint) builds the model of an ``init_from`` run from the
    model config saved beside the checkpoint, whose weights replace these: a resume never reads ``init_from``,
    which may be gone by then."""
    from ..models import AttnKitConfig, AttnKitForCausalLM

    if config.init_from is not None and resume_from is not None:
        torch.manual_seed(config.seed)
        return AttnKitForCausalLM(saved_model_config(resume_from))
    if config.init_from is not None:
        model = load_saved_model(config.init_from, **config.model_options)
        if model.config.vocab_size < vocab_size:
            raise ValueError(
                f"init_from: the model's vocabulary has {model.config.vocab_size} tokens, the task {vocab_size}"
            )
        return model
    options = {"max_position_embeddings": max(max_len, 2048), **config.model_options}
    model_config = AttnKitConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_heads=config.num_heads,
        mixer=config.mixer,
        **options,
    )
    torch.manual_seed(config.seed)
    return AttnKitForCausalLM(model_config)


def _checkpoint_folder(out: str) -> str:
    """The folder of ``out``'s checkpoint, where its shards and model config lie: the snapshot (or the copy of it
    that a copy following the links made), or ``out`` itself in the layout before snapshots."""
    snapshot = os.path.join(out, SNAPSHOT)
    return os.path.realpath(snapshot if os.path.isdir(snapshot) else out)


def uses_bf16(config: TrainConfig, device: torch.device) -> bool:
    """Whether the run computes in bfloat16: ``config.bf16`` on a GPU (autocast, and under FSDP2 the parameters
    its blocks gather too: :func:`shard_model`)."""
    return config.bf16 and device.type == "cuda"


def shard_model(model: torch.nn.Module, bf16: bool) -> None:
    """FSDP2: every block of ``model``, then the rest, sharded over the ranks (``fully_shard``). With ``bf16`` the
    blocks compute with bfloat16 copies of the parameters they gather and reduce their gradients in float32 (a
    ``MixedPrecisionPolicy``); the sharded parameters, the optimizer state and the checkpoints stay float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in model.model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def _nonfinite_parameter(model: torch.nn.Module, fsdp: bool) -> str | None:
    """The name of the first parameter of ``model`` holding a NaN or inf, or None. Under FSDP2 every rank checks
    its own shards and the ranks agree (collective); nothing is gathered."""
    from torch.distributed.tensor import DTensor

    params = list(model.named_parameters())
    local = [p.detach().to_local() if isinstance(p, DTensor) else p.detach() for _, p in params]
    bad = torch.stack([~torch.isfinite(t).all() for t in local]).to(torch.int32)
    if fsdp:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    first = int(bad.argmax())
    return params[first][0] if bad[first] else None


def _load_model_state(model, optimizer, ckpt: dict, fsdp: bool) -> None:
    """A checkpoint holding the full state (format 1) into ``model`` and ``optimizer``, sharded or not."""
    if not fsdp:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        model,
        optimizer,
        model_state_dict=ckpt["model"],
        optim_state_dict=ckpt["optimizer"],
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False),
    )


def _gradient_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """A context in which a backward pass all-reduces the gradients (``sync``) or only accumulates them."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if hasattr(model, "no_sync") and not sync:  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def forward_backward(
    forward: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_scale: float,
    grad_accum: int = 1,
    autocast: contextlib.AbstractContextManager | None = None,
    sync_model: torch.nn.Module | None = None,
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Forward and backward of one rank's batch ``x, y [b, T]`` in ``grad_accum`` equal micro-batches.

    The loss of a micro-batch is ``loss_scale`` times the sum of its token losses, so the accumulated
    gradient is the one of the whole batch. Under DDP or FSDP (``sync_model``, the wrapped model; ``forward``
    may be its compiled form) only the last backward all-reduces. ``loss_sum`` (``graphed.graphed_loss_sum``)
    replaces the forward and the summed loss of a micro-batch. Returns the detached total loss (float32).
    """
    if x.shape[0] % grad_accum:
        raise ValueError(f"grad_accum: {grad_accum} micro-batches do not divide a rank's batch of {x.shape[0]}")
    micro = x.shape[0] // grad_accum
    total = torch.zeros((), device=x.device)
    for i in range(grad_accum):
        rows = slice(i * micro, (i + 1) * micro)
        with _gradient_sync(sync_model or forward, i == grad_accum - 1):
            with autocast or contextlib.nullcontext():
                if loss_sum is not None:
                    summed = loss_sum(x[rows], y[rows])
                else:
                    summed = token_loss_sum(forward, x[rows], y[rows])
            loss = summed * loss_scale
            loss.backward()
        total += loss.detach()
    return total


def _tensorboard_writer(out: str, start_step: int):
    from torch.utils.tensorboard import SummaryWriter

    # A resumed run drops what the killed one logged after its checkpoint, as metrics.jsonl does.
    return SummaryWriter(os.path.join(out, "tensorboard"), purge_step=start_step or None)


def _logged_by(line: str, step: int) -> bool:
    """Whether ``line`` of metrics.jsonl is a whole event of a step up to ``step``."""
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return False
    return line.endswith("\n") and isinstance(event, dict) and event.get("step", 0) <= step


def train(config: TrainConfig) -> TrainResult:
    """Train ``config.mixer`` on ``config.task``; see ``TrainConfig`` for every option.

    Writes ``<out>/metrics.jsonl`` (one JSON object per log or eval event), ``<out>/final.json`` and, at every
    checkpoint and at the end, ``<out>/checkpoint.pt`` with the Hugging Face model beside it (``config.json``,
    ``model.safetensors``, ``generation_config.json``, the task's tokenizer and ``train_config.json``), all
    switched in at once (see ``checkpoint.new_snapshot``), so ``AutoModelForCausalLM.from_pretrained(out)``
    loads the run. Under FSDP2 every rank writes its shards of the model and optimizer into the snapshot
    (``sharded``) and ``model.safetensors`` is consolidated from them; ``checkpoint.pt`` then holds the rest and
    the world size. A resume loads either kind at any world size (the shards are resharded) and never reads
    ``init_from``. Raises ``NonFiniteLossError`` naming the step when the loss or the gradient norm turns NaN/inf;
    the checkpoint on disk then is the last good one. ``LaunchError`` (before anything is built) when torchrun's
    ranks do not split the batch.
    """
    # --- set-up: processes, device, task, model, optimizer -------------------------------------------------
    if config.cuda_graph and (dist.is_initialized() or world_size_from_env() > 1):
        raise ValueError("cuda_graph: not under torchrun (DDP and FSDP2 all-reduce inside the backward)")
    owns_group = not dist.is_initialized()
    info = setup_distributed(config.device, config.batch_size, config.grad_accum)
    device, world, rank, local_batch = info.device, info.world_size, info.rank, info.local_batch
    ckpt = open_run_folder(config, info.is_main)
    ckpt_path = os.path.join(config.out, CHECKPOINT_NAME) if config.out else None
    ckpt_folder = _checkpoint_folder(config.out) if ckpt is not None else None
    if info.enabled:
        dist.barrier()  # the folder is in its final state before any rank writes to it
    task = get_task(config.task, seed=config.seed, **config.task_options)
    raw_model = build_model(config, task.vocab_size, task.seq_len, ckpt_folder).to(device)
    if config.grad_checkpointing:
        raw_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fsdp = info.enabled and config.distributed == "fsdp"
    bf16 = uses_bf16(config, device)
    model: torch.nn.Module = raw_model
    if fsdp:
        shard_model(raw_model, bf16)
    elif info.enabled:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(raw_model, device_ids=[info.local_rank] if device.type == "cuda" else None)
    forward = torch.compile(model) if config.compile else model
    decay = [p for p in raw_model.parameters() if p.dim() >= 2]
    no_decay = [p for p in raw_model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, config))
    graphs = config.cuda_graph and device.type == "cuda"
    # make_graphed_callables captures under autocast only without its cache of cast weights
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16, cache_enabled=not graphs)
    loss_sum = None  # the graphed forward and loss (graphed.py), captured at the first step's batch

    out = config.out
    if out and info.is_main:
        os.makedirs(out, exist_ok=True)
    start_step = 0
    if ckpt is not None:
        try:
            if ckpt.get("format") == SHARDED_FORMAT:  # at any world size: DCP reshards
                load_sharded(raw_model, optimizer, ckpt_folder, ckpt["optimizer"]["param_groups"])
            else:
                _load_model_state(raw_model, optimizer, ckpt, fsdp)
            scheduler.load_state_dict(ckpt["scheduler"])
            torch.set_rng_state(ckpt["rng"]["torch"])
            if device.type == "cuda" and "cuda" in ckpt["rng"]:
                torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
        except (RuntimeError, KeyError, ValueError, TypeError) as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(
                f"{ckpt_path}: saved by an incompatible version (its state does not fit this model: {reason})"
            ) from None
        start_step = int(ckpt["step"])
    last_good = start_step if start_step else None
    if out and info.is_main:
        # a fresh run starts a fresh log; a resumed one drops what was logged after its checkpoint, and the
        # line a kill cut short
        metrics_path = os.path.join(out, "metrics.jsonl")
        kept = []
        if start_step and os.path.exists(metrics_path):
            with open(metrics_path) as f:
                kept = [line for line in f if _logged_by(line, start_step)]
        write_text_atomic("".join(kept), metrics_path)
    writer = _tensorboard_writer(out, start_step) if config.tensorboard and info.is_main else None
    tokenizer = None
    if out and info.is_main:
        from ..tasks.hf_tokenizer import to_hf_tokenizer

        tokenizer = to_hf_tokenizer(task)

    def log(event: dict[str, Any]) -> None:
        if out and info.is_main:
            with open(os.path.join(out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(event) + "\n")
        if writer is not None:
            # eval/<split>/<set>/<metric> (the split of an eval event is part of its tag, not a value)
            tag = "/".join(str(event[k]) for k in ("event", "split") if k in event)
            for key, value in event.items():
                if isinstance(value, dict):
                    for name, number in value.items():
                        writer.add_scalar(f"{tag}/{key}/{name}", number, event["step"])
                elif key not in ("event", "step", "split"):
                    writer.add_scalar(f"{tag}/{key}", value, event["step"])

    def evaluate(step: int, split: str) -> dict[str, dict[str, float]]:
        raw_model.eval()
        sets = task.validation_sets() if split == "validation" else task.test_sets()
        batches = sum(-(-len(ids) // config.eval_batch_size) for ids, _ in sets.values())
        with progress.evaluation(batches) as tick:

            def logits_fn(x: torch.Tensor) -> torch.Tensor:
                tick()
                with autocast:
                    return raw_model(input_ids=x.to(device), use_cache=False).logits

            metrics = task.evaluate_model(logits_fn, batch_size=config.eval_batch_size, split=split)
        progress.evaluated(step, metrics, split)
        raw_model.train()
        return metrics

    def save(step: int) -> None:
        nonlocal last_good
        bad = _nonfinite_parameter(raw_model, fsdp)
        if bad is not None:  # never replace a good checkpoint with a bad state
            raise NonFiniteLossError(
                f"step {step}: parameter {bad} is not finite; kept the last good checkpoint "
                f"({'step ' + str(last_good) if last_good is not None else 'none written'}) at {ckpt_path}"
            )
        rng = {"torch": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        state = {"scheduler": scheduler.state_dict(), "step": step, "rng": rng, "config": asdict(config)}

        def write_rest(folder: str) -> None:
            with open(os.path.join(folder, CHECKPOINT_NAME), "wb") as f:
                torch.save(state, f)
            with open(os.path.join(folder, RUN_CONFIG_NAME), "w") as f:
                json.dump(asdict(config), f, indent=2)

        # The checkpoint and the Hugging Face model beside it change together, in one rename (new_snapshot).
        if fsdp:  # every rank writes its shards into the snapshot folder rank 0 makes
            with new_snapshot(out, f"{step:08d}") if info.is_main else contextlib.nullcontext() as folder:
                shared = [folder]
                dist.broadcast_object_list(shared, src=0)
                groups = save_sharded(raw_model, optimizer, shared[0])  # model.safetensors included
                if info.is_main:
                    state.update(
                        format=SHARDED_FORMAT, sharded={"world_size": world}, optimizer={"param_groups": groups}
                    )
                    write_rest(folder)
                    write_hf_config(folder, raw_model.config, tokenizer)
            dist.barrier()  # the new snapshot is in place when every rank goes on
        elif info.is_main:
            model_state = raw_model.state_dict()
            state.update(format=CHECKPOINT_FORMAT, model=model_state, optimizer=optimizer.state_dict())
            with new_snapshot(out, f"{step:08d}") as folder:
                write_rest(folder)
                write_hf_model(folder, raw_model.config, model_state, tokenizer)
        last_good = step

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    # --- the loop ----------------------------------------------------------------------------------------------
    end = min(config.stop_at, config.steps) if config.stop_at else config.steps
    progress = RunProgress(config, start_step, end, enabled=info.is_main and not config.quiet)
    precision = "float32"
    if bf16:
        fsdp_note = ", FSDP2 bfloat16 parameters with float32 gradient reduction" if fsdp else ""
        precision = "bfloat16 autocast" + fsdp_note
    progress.header(task, raw_model, device, precision)
    timings = {"data": 0.0, "forward_backward": 0.0, "optimizer": 0.0, "log_checkpoint": 0.0, "eval": 0.0}
    tokens_since, t_log = 0, time.perf_counter()
    t_start = time.perf_counter()
    loss_value = norm_value = float("nan")
    unread: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, gradient norm) not yet on the host

    def read_unread() -> tuple[float, float]:
        """The last unread step's loss and gradient norm, after checking every unread step's (one sync)."""
        losses, norms = (torch.stack([entry[i] for entry in unread]).float() for i in (1, 2))
        values = torch.stack([losses, norms], 1).tolist()
        steps = [s for s, _, _ in unread]
        unread.clear()
        for done, (loss_at, norm_at) in zip(steps, values):
            if not (math.isfinite(loss_at) and math.isfinite(norm_at)):
                kept = f"step {last_good} at {ckpt_path}" if last_good is not None else "none written yet"
                what = "loss" if not math.isfinite(loss_at) else "gradient norm"
                raise NonFiniteLossError(
                    f"step {done}: non-finite {what} (loss={loss_at}, grad_norm={norm_at}); "
                    f"stopped without saving. Last good checkpoint: {kept}"
                )
        return values[-1][0], values[-1][1]

    raw_model.train()
    for step in range(start_step, end):
        t0 = time.perf_counter()
        input_ids, labels = task.sample(config.batch_size, batch_generator(config.seed, step))
        n_scored = int((labels != IGNORE_INDEX).sum())
        rows = slice(rank * local_batch, (rank + 1) * local_batch)
        x, y = input_ids[rows], labels[rows]
        if device.type == "cuda":  # a copy from pageable memory would first wait for the GPU's queued work
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if config.profile:
            sync()
        t1 = time.perf_counter()

        if graphs and loss_sum is None:
            loss_sum = graphed_loss_sum(raw_model, x, y, autocast)
        loss = forward_backward(
            forward, x, y, world / max(n_scored, 1), config.grad_accum, autocast, model, loss_sum=loss_sum
        )
        if config.profile:
            sync()
        t2 = time.perf_counter()

        clip = config.grad_clip if config.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        step_loss = loss / world
        if info.enabled:
            dist.all_reduce(step_loss)
        done = step + 1
        logs = done % config.log_every == 0 or done == end
        saves = bool(ckpt_path) and bool(config.checkpoint_every) and done % config.checkpoint_every == 0
        evaluates = bool(config.eval_every) and done % config.eval_every == 0 and done != end
        # The loss and the gradient norm are read on the host (a sync) only where a step needs them: at every step
        # while progress shows on stderr, else at the steps that log (the last among them), checkpoint or evaluate.
        # The steps between are checked there, so a non-finite one still stops the run before anything is saved.
        unread.append((done, step_loss.detach(), grad_norm.detach()))
        if not config.quiet or logs or saves or evaluates:
            loss_value, norm_value = read_unread()
        lr_now = scheduler.get_last_lr()[0]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if config.profile:
            sync()
        t3 = time.perf_counter()

        progress.step(done, loss_value, lr_now)
        tokens_since += int(input_ids.numel())
        if logs:
            now = time.perf_counter()
            tps = tokens_since / max(now - t_log, 1e-9)
            tokens_since, t_log = 0, now
            log(
                {
                    "event": "train",
                    "step": done,
                    "loss": loss_value,
                    "lr": lr_now,
                    "grad_norm": norm_value,
                    "tokens_per_s": tps,
                }
            )
            progress.log(done, loss_value, lr_now, tps)
        if saves:
            save(done)
        t4 = time.perf_counter()
        if evaluates:
            # during training only the validation split is scored: the test sets are for the end
            log({"event": "eval", "split": "validation", "step": done, **evaluate(done, "validation")})
        t5 = time.perf_counter()
        timings["data"] += t1 - t0
        timings["forward_backward"] += t2 - t1
        timings["optimizer"] += t3 - t2
        timings["log_checkpoint"] += t4 - t3
        timings["eval"] += t5 - t4

    wall = time.perf_counter() - t_start
    progress.close()
    # --- the end: final checkpoint, evaluation, summary ----------------------------------------------------------
    done = max(end, start_step)
    if ckpt_path and done > start_step and last_good != done:  # not twice at one step
        save(done)
    t_eval = time.perf_counter()
    validation_metrics, metrics = evaluate(done, "validation"), evaluate(done, "test")
    timings["eval"] += time.perf_counter() - t_eval
    log({"event": "eval", "split": "validation", "step": done, **validation_metrics})
    log({"event": "eval", "split": "test", "step": done, **metrics})
    steps_run = max(end - start_step, 0)
    tokens_per_s = steps_run * config.batch_size * task.seq_len / max(wall, 1e-9)
    profile = None
    if config.profile:
        step_time = sum(v for k, v in timings.items() if k != "eval")
        profile = {k + "_s": v for k, v in timings.items()}
        profile["outside_forward_backward"] = 1 - timings["forward_backward"] / max(step_time, 1e-9)
        profile["data_log_checkpoint"] = (timings["data"] + timings["log_checkpoint"]) / max(step_time, 1e-9)
        if info.is_main:
            print(format_profile(profile, timings, steps_run), file=sys.stderr, flush=True)
    result = TrainResult(
        done, loss_value, metrics, wall, tokens_per_s, profile, raw_model, validation_metrics, precision
    )
    if out and info.is_main:
        write_text_atomic(
            json.dumps({"config": asdict(config), **result.to_json()}, indent=2), os.path.join(out, "final.json")
        )
    if writer is not None:
        writer.close()
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()
    return result
