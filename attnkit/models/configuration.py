"""``AttnKitConfig``: one Hugging Face config for every mixer and for hybrid stacks."""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig

# mixer name -> (layer class, fixed arguments, whether it takes num_kv_heads)
MIXER_LAYERS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "path": ("PaTHAttention", {}, True),
    "path_fox": ("PaTHAttention", {"use_forget_gate": True}, True),
    "tapa": ("TAPAAttention", {}, True),
    "vla": ("VLAAttention", {}, False),
    "rope": ("RoPEAttention", {}, True),
    "nope": ("NoPEAttention", {}, True),
    "fox": ("FoXAttention", {}, True),
    "linear": ("LinearAttention", {}, True),
    "deltanet": ("DeltaNetAttention", {}, False),
    "stickbreaking": ("StickBreakingAttention", {}, True),
}
MIXERS = tuple(MIXER_LAYERS)


def _finite(value: object) -> bool:
    """A real number (not a bool), finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# Layer arguments the model sets itself: the shapes from the config's fields, and the layer's place and backend.
_SET_BY_MODEL = {
    "hidden_size": "hidden_size",
    "num_heads": "num_heads",
    "num_kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "layer_idx": "the layer's index",
    "backend": "backend",
}


def mixer_options(mixer: str) -> list[str]:
    """The ``mixer_kwargs`` keys ``mixer`` accepts: its layer's constructor arguments, less those the model sets
    (``_SET_BY_MODEL``) and those the mixer's name fixes (``use_forget_gate``: ``"path"`` or ``"path_fox"``)."""
    import inspect

    from .. import layers

    cls_name = MIXER_LAYERS[mixer][0]
    fixed = {key for _, keys, _ in MIXER_LAYERS.values() for key in keys}
    params = inspect.signature(getattr(layers, cls_name)).parameters
    return sorted(set(params) - set(_SET_BY_MODEL) - fixed)


def _check_mixer_kwargs(mixer_kwargs: object) -> dict[str, dict[str, Any]]:
    """``{mixer name: {option: value}}`` with every option one the mixer's layer takes (values are the layer's to
    check, when the model is built)."""
    if mixer_kwargs is None:
        return {}
    if not isinstance(mixer_kwargs, dict):
        raise ValueError(f"mixer_kwargs: expected {{mixer name: dict}}, got {mixer_kwargs!r}")
    for name, extra in mixer_kwargs.items():
        if name not in MIXERS or not isinstance(extra, dict):
            raise ValueError(f"mixer_kwargs: expected {{mixer name: dict}}, got {name!r}: {extra!r}")
        accepted = mixer_options(name)
        for key in extra:
            if key in _SET_BY_MODEL:
                raise ValueError(f"mixer_kwargs: {name!r} option {key!r} is set by the model ({_SET_BY_MODEL[key]})")
            if key not in accepted:
                raise ValueError(f"mixer_kwargs: {name!r} has no option {key!r}; accepted: {accepted}")
    return dict(mixer_kwargs)


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return value


class AttnKitConfig(PretrainedConfig):
    """A decoder-only language model whose token mixer is chosen per layer.

    Args:
        vocab_size, hidden_size, num_hidden_layers: the usual sizes.
        num_heads: query heads per layer; ``num_kv_heads`` key/value heads (GQA, defaults to ``num_heads``;
            VLA and DeltaNet layers use ``num_heads`` for both); ``head_dim`` defaults to
            ``hidden_size // num_heads``.
        mixer: one of ``"path"``, ``"path_fox"``, ``"tapa"``, ``"vla"``, ``"rope"``, ``"nope"``, ``"fox"``,
            ``"linear"``, ``"deltanet"``, or a list with one name per layer (hybrid stacks).
        mixer_kwargs: extra constructor arguments per mixer name, e.g.
            ``{"rope": {"rope_theta": 500000.0}, "tapa": {"alpha": 0.2}, "path": {"beta_max": 1.999}}``; a key the
            mixer's layer does not take (:func:`mixer_options` lists those it does) is a ``ValueError``.
        intermediate_size: width of the gated MLP (defaults to ``8/3 · hidden_size`` rounded up to 32).
        rms_norm_eps, initializer_range, tie_word_embeddings: as in Llama.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``, passed to every op.
    """

    model_type = "attnkit"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_heads: int = 4,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        mixer: str | list[str] = "path",
        mixer_kwargs: dict[str, dict[str, Any]] | None = None,
        intermediate_size: int | None = None,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 2048,
        backend: str = "auto",
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = _positive_int("vocab_size", vocab_size)
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.num_hidden_layers = _positive_int("num_hidden_layers", num_hidden_layers)
        self.num_heads = _positive_int("num_heads", num_heads)
        self.num_kv_heads = num_heads if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"num_heads: {num_heads} does not divide hidden_size={hidden_size}; set head_dim")
            head_dim = hidden_size // num_heads
        self.head_dim = _positive_int("head_dim", head_dim)
        if not isinstance(mixer, str) and not (
            isinstance(mixer, (list, tuple)) and all(isinstance(m, str) for m in mixer)
        ):
            raise ValueError(f"mixer: expected a mixer name or a list of them (one per layer), got {mixer!r}")
        layers = [mixer] * num_hidden_layers if isinstance(mixer, str) else list(mixer)
        if len(layers) != num_hidden_layers:
            raise ValueError(f"mixer: expected {num_hidden_layers} names (one per layer), got {len(layers)}")
        unknown = [m for m in layers if m not in MIXERS]
        if unknown:
            raise ValueError(f"mixer: unknown mixer {unknown[0]!r}; expected one of {MIXERS}")
        self.mixer = mixer if isinstance(mixer, str) else layers
        self.mixer_kwargs = _check_mixer_kwargs(mixer_kwargs)
        if intermediate_size is None:
            intermediate_size = -(-8 * hidden_size // 3 // 32) * 32
        self.intermediate_size = _positive_int("intermediate_size", intermediate_size)
        if not _finite(rms_norm_eps) or not rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: expected a positive finite number, got {rms_norm_eps!r}")
        self.rms_norm_eps = rms_norm_eps
        if not _finite(initializer_range) or initializer_range < 0:
            raise ValueError(f"initializer_range: expected a non-negative finite number, got {initializer_range!r}")
        self.initializer_range = initializer_range
        self.max_position_embeddings = _positive_int("max_position_embeddings", max_position_embeddings)
        special = {"pad_token_id": pad_token_id, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
        for name, token in special.items():
            ids = token if isinstance(token, (list, tuple)) and name == "eos_token_id" else [token]
            valid = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids)
            if token is not None and not valid:
                raise ValueError(f"{name}: expected a token id in [0, vocab_size={vocab_size}) or None, got {token!r}")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
        self.backend = backend
        self.use_cache = use_cache
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            **kwargs,
        )

    @property
    def layer_mixers(self) -> list[str]:
        """The mixer of every layer."""
        return [self.mixer] * self.num_hidden_layers if isinstance(self.mixer, str) else list(self.mixer)
