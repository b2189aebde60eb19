"""``TrainConfig``: every knob of a run, its validation, and which fields a resume may change.

This module imports neither torch nor the tasks nor the models at its top (its checks import them when a config is
built), so the command line builds ``attnkit train --help`` from its defaults without them.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class TrainConfig:
    """Every knob of a run, with its default. ``attnkit train --help`` lists the same names."""

    task: str = "flipflop"
    task_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"seq_len": 128}
    mixer: str | list[str] = "path"  # one name, or one per layer
    hidden_size: int = 64
    num_layers: int = 1
    num_heads: int = 2
    model_options: dict[str, Any] = field(default_factory=dict)  # extra AttnKitConfig keywords
    steps: int = 1000
    batch_size: int = 32  # global batch, split over ranks
    grad_accum: int = 1  # micro-batches per optimizer step; the global batch stays batch_size
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int | None = None  # linear warmup; None: min(100, steps // 10)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0  # 0: no clipping
    seed: int = 0
    device: str = "auto"  # "auto", "cpu" or "cuda"
    bf16: bool = True  # on GPU only: bf16 autocast; under FSDP2 also bf16 parameters, float32 gradient reduction
    distributed: str = "ddp"  # "ddp" or "fsdp" when launched by torchrun
    init_from: str | None = None  # start from this saved attnkit model folder (a run folder, a from_llama save)
    compile: bool = False  # torch.compile the model for the training steps
    cuda_graph: bool = False  # on GPU: forward+backward replayed as CUDA graphs (fixed shapes; not under torchrun)
    grad_checkpointing: bool = False  # recompute activations in the backward pass (less memory, same gradients)
    eval_every: int = 0  # 0: evaluate at the end only
    eval_batch_size: int = 64
    log_every: int = 50
    checkpoint_every: int = 0  # 0: checkpoint at the end only
    out: str | None = None  # run folder: metrics.jsonl, final.json, checkpoint.pt and the Hugging Face model
    resume: bool = False  # continue from <out>/checkpoint.pt (an error when there is none)
    overwrite: bool = False  # move an earlier run in <out> aside to <out>.old-<time> and start afresh
    stop_at: int = 0  # stop after this step (the schedule still spans `steps`); 0: run to `steps`
    profile: bool = False  # time forward+backward against the rest of the step
    quiet: bool = False  # no progress lines on stderr
    tensorboard: bool = False  # also log to <out>/tensorboard (pip install 'attnkit[tensorboard]')

    def __post_init__(self) -> None:
        if self.warmup_steps is None and isinstance(self.steps, int) and not isinstance(self.steps, bool):
            self.warmup_steps = min(100, self.steps // 10)
        _validate(self)


# Every TrainConfig field is in exactly one of these (a test holds them to the dataclass). A resume may change
# only RESUMABLE_FIELDS: how the run is watched, where and how fast it runs. RUN_FIELDS define the run: a
# resume that changes one of them would silently train something else, so it is refused.
RUN_FIELDS = frozenset(
    {
        "task",
        "task_options",
        "mixer",
        "hidden_size",
        "num_layers",
        "num_heads",
        "model_options",
        "steps",
        "batch_size",  # global, so the world size may change
        "lr",
        "weight_decay",
        "warmup_steps",
        "min_lr_ratio",
        "grad_clip",
        "seed",
        "bf16",  # the precision of the run's arithmetic
        "init_from",
    }
)
RESUMABLE_FIELDS = frozenset(
    {
        "device",
        "distributed",
        "eval_every",
        "eval_batch_size",
        "log_every",
        "checkpoint_every",
        "out",
        "resume",
        "overwrite",
        "stop_at",
        "profile",
        "quiet",
        "grad_accum",  # the global batch, and so the gradient, stays the same
        "compile",
        "cuda_graph",  # replays the same kernels
        "grad_checkpointing",  # recomputes the same activations
        "tensorboard",
    }
)


def resume_mismatches(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """``"name: saved X, new Y"`` for every field of ``RUN_FIELDS`` where ``config`` differs from ``saved``.

    A field that ``saved`` lacks (one added after the run started) counts as its default, the behaviour before it.
    """
    new = asdict(config)
    default = {f.name: f.default for f in fields(TrainConfig)}
    return [
        f"{name}: saved {saved.get(name, default[name])!r}, new {new[name]!r}"
        for name in sorted(RUN_FIELDS)
        if saved.get(name, default[name]) != new[name]
    ]


def _int(name: str, value: Any, low: int, high: int | None = None, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name}: expected an integer {bound}{note}, got {value!r}")


def _number(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False, note: str = "") -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        bound = f"> {low}" if low_open else f">= {low}" if high == math.inf else f"in [{low}, {high}]"
        raise ValueError(f"{name}: expected a finite number {bound}{note}, got {value!r}")


def _choice(name: str, value: Any, choices: Any) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {sorted(choices)}, got {value!r}")


# AttnKitConfig keywords that TrainConfig sets itself, and the field that does.
_MODEL_FIELDS = {"vocab_size": "task", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers"}
_MODEL_FIELDS.update(num_heads="num_heads", mixer="mixer")


def _validate(c: TrainConfig) -> None:
    """Raise ``ValueError`` naming the first field that is out of range, of the wrong type, or unknown to its
    task or model; nothing is built but the model's config."""
    from ..models.configuration import MIXERS, AttnKitConfig
    from ..tasks import TASKS

    _choice("task", c.task, TASKS)
    if not isinstance(c.task_options, dict) or not all(isinstance(k, str) for k in c.task_options):
        raise ValueError(f"task_options: expected a dict of keyword arguments, got {c.task_options!r}")
    known = set(inspect.signature(TASKS[c.task]).parameters) - {"seed"}
    unknown = sorted(set(c.task_options) - known)
    if unknown:
        note = " (the seed is the field seed)" if "seed" in unknown else ""
        raise ValueError(f"task_options: {c.task!r} has no option {unknown[0]!r}{note}; known: {sorted(known)}")
    _int("num_layers", c.num_layers, 1)
    if isinstance(c.mixer, str):
        _choice("mixer", c.mixer, MIXERS)
    elif isinstance(c.mixer, (list, tuple)) and len(c.mixer) == c.num_layers:
        for name in c.mixer:
            _choice("mixer", name, MIXERS)
    else:
        raise ValueError(f"mixer: expected a mixer name or {c.num_layers} of them (one per layer), got {c.mixer!r}")
    _int("hidden_size", c.hidden_size, 1)
    _int("num_heads", c.num_heads, 1)
    if not isinstance(c.model_options, dict) or not all(isinstance(k, str) for k in c.model_options):
        raise ValueError(f"model_options: expected a dict of AttnKitConfig keywords, got {c.model_options!r}")
    known = set(inspect.signature(AttnKitConfig).parameters) - {"kwargs"} - set(_MODEL_FIELDS)
    for key in c.model_options:
        if key in _MODEL_FIELDS:
            raise ValueError(f"model_options: {key!r} is set by the field {_MODEL_FIELDS[key]}")
        if key not in known:
            raise ValueError(f"model_options: unknown AttnKitConfig keyword {key!r}; known: {sorted(known)}")
    if c.init_from is not None:
        if not isinstance(c.init_from, str) or not c.init_from:
            raise ValueError(f"init_from: expected a saved model folder or None, got {c.init_from!r}")
        if c.resume is not True:  # a resume builds its model from the run folder: init_from may be gone by then
            _check_init_from(c)
    else:
        try:  # the model config's own checks; the vocabulary is the task's, unknown here
            AttnKitConfig(
                vocab_size=2**31 - 1,
                hidden_size=c.hidden_size,
                num_hidden_layers=c.num_layers,
                num_heads=c.num_heads,
                mixer=c.mixer,
                **c.model_options,
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"model_options: {err}") from None
    _int("steps", c.steps, 1)
    _int("batch_size", c.batch_size, 1)
    _int("grad_accum", c.grad_accum, 1)
    if c.batch_size % c.grad_accum:
        raise ValueError(f"grad_accum: {c.grad_accum} micro-batches do not divide batch_size={c.batch_size}")
    _number("lr", c.lr, 0.0, low_open=True)
    _number("weight_decay", c.weight_decay, 0.0)
    _int("warmup_steps", c.warmup_steps, 0)
    _number("min_lr_ratio", c.min_lr_ratio, 0.0, 1.0)
    _number("grad_clip", c.grad_clip, 0.0, note=" (0: no clipping)")
    _int("seed", c.seed, 0, 2**32 - 1)
    _choice("device", c.device, ("auto", "cpu", "cuda"))
    if c.device == "cuda" and not _cuda_available():
        raise ValueError("device: 'cuda' was asked for, but torch sees no CUDA GPU; use 'cpu' or 'auto'")
    _choice("distributed", c.distributed, ("ddp", "fsdp"))
    _int("eval_every", c.eval_every, 0, note=" (0: at the end only)")
    _int("eval_batch_size", c.eval_batch_size, 1)
    _int("log_every", c.log_every, 1)
    _int("checkpoint_every", c.checkpoint_every, 0, note=" (0: at the end only)")
    _int("stop_at", c.stop_at, 0, c.steps, note=" (0: run to steps)")
    flags = ("bf16", "resume", "overwrite", "profile", "quiet", "compile", "cuda_graph", "grad_checkpointing")
    for name in (*flags, "tensorboard"):
        if not isinstance(getattr(c, name), bool):
            raise ValueError(f"{name}: expected True or False, got {getattr(c, name)!r}")
    if c.out is not None and (not isinstance(c.out, str) or not c.out):
        raise ValueError(f"out: expected a folder path or None, got {c.out!r}")
    if c.grad_checkpointing:
        from ..models import AttnKitForCausalLM

        if not AttnKitForCausalLM.supports_gradient_checkpointing:
            raise ValueError("grad_checkpointing: this version of the attnkit model does not support it")
    other = cuda_graph_conflict(vars(c))
    if c.cuda_graph and other:
        raise ValueError(f"cuda_graph: not with {other} (a graphed step is one micro-batch, captured eagerly)")
    if c.tensorboard and c.out is None:
        raise ValueError("tensorboard: needs a run folder (out) to write its event files into")
    if c.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("tensorboard: the tensorboard package is missing: pip install 'attnkit[tensorboard]'")
    if (c.resume or c.overwrite) and c.out is None:
        raise ValueError(f"{'resume' if c.resume else 'overwrite'}: needs a run folder (out)")
    if c.resume and c.overwrite:
        raise ValueError("resume, overwrite: pass one of them, not both")


def cuda_graph_conflict(config: dict[str, Any]) -> str | None:
    """The setting of a config (TrainConfig's fields, or some of them) that ``cuda_graph`` cannot take, if any."""
    if config.get("compile"):
        return "compile"
    if config.get("grad_checkpointing"):
        return "grad_checkpointing"
    return "grad_accum > 1" if config.get("grad_accum", 1) != 1 else None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_init_from(c: TrainConfig) -> None:
    """``init_from`` names a saved attnkit model whose shape is the one ``c`` asks for."""
    from .hf_folder import saved_model_config

    if not os.path.isdir(c.init_from):
        raise ValueError(f"init_from: {c.init_from} is not a folder (a save_pretrained or run folder)")
    saved = saved_model_config(c.init_from)
    for name, key in (("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers"), ("num_heads", "num_heads")):
        if getattr(c, name) != getattr(saved, key):
            raise ValueError(f"{name}: {getattr(c, name)!r}, but the model at init_from has {getattr(saved, key)!r}")
    if saved.layer_mixers != ([c.mixer] * c.num_layers if isinstance(c.mixer, str) else list(c.mixer)):
        raise ValueError(f"mixer: {c.mixer!r}, but the model at init_from has {saved.mixer!r}")
    try:
        saved_model_config(c.init_from, **c.model_options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"model_options: {err}") from None
