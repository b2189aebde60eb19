"""The Hugging Face side of a run folder: ``save_pretrained``'s files, written from a full state dict.

``write_hf_model(path, config, state, tokenizer)`` writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer's files, so that ``AutoModelForCausalLM.from_pretrained(path)`` and
``AutoTokenizer.from_pretrained(path)`` load them (after ``import attnkit``). The state dict is the one the
checkpoint holds, so the two always agree; under FSDP2 ``model.safetensors`` is consolidated from the checkpoint's
shards instead (``attnkit.train.sharded``) and ``write_hf_config`` writes the rest.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch

MODEL_FILES = ("config.json", "model.safetensors", "generation_config.json")
RUN_CONFIG_NAME = "train_config.json"  # the TrainConfig of the run that wrote the model


def read_run_config(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The training settings (``TrainConfig`` as a dict) saved beside the model in ``folder``; None if none."""
    path = os.path.join(folder, RUN_CONFIG_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_hf_model(path: str, config: Any, state: dict[str, torch.Tensor], tokenizer: Any | None = None) -> None:
    """Write ``state`` (``AttnKitForCausalLM.state_dict()`` keys) and ``config`` (its ``AttnKitConfig``) into
    the folder ``path`` as ``save_pretrained`` would; ``tokenizer`` (a ``PreTrainedTokenizerFast``) beside them."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the embedding's, tied again on load
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    write_hf_config(path, config, tokenizer)


def write_hf_config(path: str, config: Any, tokenizer: Any | None = None) -> None:
    """``config.json``, ``generation_config.json`` and ``tokenizer``'s files of the model whose weights are (or will
    be) in ``path/model.safetensors``."""
    from transformers import GenerationConfig

    config = copy.deepcopy(config)
    config.architectures = ["AttnKitForCausalLM"]
    config.save_pretrained(path)
    generation = GenerationConfig.from_model_config(config)
    if tokenizer is not None:
        generation.eos_token_id = tokenizer.eos_token_id
        generation.pad_token_id = tokenizer.pad_token_id
        tokenizer.save_pretrained(path)
    generation.save_pretrained(path)


def saved_model_config(path: str, **overrides: Any):
    """The ``AttnKitConfig`` of the attnkit model saved in the folder ``path``, with ``overrides`` (config fields)
    in place of the saved values; ``ValueError`` naming ``init_from`` when there is none (nothing is looked up
    online), or naming the field that an override makes invalid."""
    import inspect

    from ..models import AttnKitConfig

    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"init_from: {path} is not a saved model folder (no readable config.json: {err})") from None
    if model_type != AttnKitConfig.model_type:
        raise ValueError(
            f"init_from: {path} holds a {model_type!r} model, not an attnkit one "
            "(convert a Llama model with attnkit.models.from_llama and save_pretrained it first)"
        )
    saved = AttnKitConfig.from_pretrained(path, local_files_only=True).to_dict()
    fields = set(inspect.signature(AttnKitConfig).parameters) - {"kwargs"}
    return AttnKitConfig(**{**{k: v for k, v in saved.items() if k in fields}, **overrides})


def load_saved_model(path: str, **overrides: Any) -> torch.nn.Module:
    """The attnkit model saved in the folder ``path``, in float32, with ``overrides`` of its config fields."""
    from ..models import AttnKitForCausalLM

    config = saved_model_config(path, **overrides)
    return AttnKitForCausalLM.from_pretrained(path, config=config, dtype=torch.float32, local_files_only=True)
