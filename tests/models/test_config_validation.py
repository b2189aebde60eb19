"""AttnKitConfig's mixer_kwargs (issue 18): a key a mixer's layer does not take fails when the config is built, with a
ValueError that names the key and lists the accepted ones (it failed only when the model was built, with a raw
TypeError)."""

from __future__ import annotations

import inspect

import pytest

from attnkit import layers
from attnkit.models import MIXERS, AttnKitConfig, AttnKitForCausalLM
from attnkit.models.configuration import MIXER_LAYERS, mixer_options

SMALL = dict(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_heads=2)


def test_unknown_key_names_it_and_lists_the_accepted():
    match = r"^mixer_kwargs: 'tapa' has no option 'alpah'; accepted: \['alpha', 'phase', 'theta'\]"
    with pytest.raises(ValueError, match=match):
        AttnKitConfig(mixer="tapa", mixer_kwargs={"tapa": {"alpah": 0.2}})


def test_a_key_for_another_layer_is_refused_even_when_unused():
    """Options of a mixer no layer uses are checked too: a config is a file that may be read for another stack."""
    with pytest.raises(ValueError, match="^mixer_kwargs: 'vla' has no option 'rope_theta'"):
        AttnKitConfig(mixer="rope", mixer_kwargs={"vla": {"rope_theta": 1e4}})


@pytest.mark.parametrize("key", ["hidden_size", "num_heads", "num_kv_heads", "head_dim", "layer_idx", "backend"])
def test_keys_the_model_sets_are_refused(key):
    with pytest.raises(ValueError, match=f"^mixer_kwargs: 'rope' option '{key}' is set by the model"):
        AttnKitConfig(mixer="rope", mixer_kwargs={"rope": {key: 1}})


@pytest.mark.parametrize("mixer", ["path", "path_fox"])
def test_the_forget_gate_is_the_mixers_name(mixer):
    """``use_forget_gate`` would turn ``path`` into ``path_fox`` and back: the mixer's name chooses it."""
    with pytest.raises(ValueError, match=f"^mixer_kwargs: '{mixer}' has no option 'use_forget_gate'"):
        AttnKitConfig(mixer=mixer, mixer_kwargs={mixer: {"use_forget_gate": True}})


@pytest.mark.parametrize("mixer", MIXERS)
def test_every_accepted_option_builds_the_model(mixer):
    """The accepted list is not too wide: each option, at its layer's default, builds the model."""
    params = inspect.signature(getattr(layers, MIXER_LAYERS[mixer][0])).parameters
    options = {key: params[key].default for key in mixer_options(mixer)}
    config = AttnKitConfig(**SMALL, mixer=mixer, mixer_kwargs={mixer: options})
    assert config.mixer_kwargs == {mixer: options}
    AttnKitForCausalLM(config)


def test_mixer_kwargs_must_be_a_dict():
    with pytest.raises(ValueError, match="^mixer_kwargs:"):
        AttnKitConfig(mixer_kwargs=[("tapa", {"alpha": 0.2})])
