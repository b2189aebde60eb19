"""Hugging Face config, model, cache and conversion. Importing this module registers ``"attnkit"`` with
``AutoConfig`` and ``AutoModelForCausalLM``."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import AttnKitCache, AttnKitCacheLayer
from .configuration import MIXERS, AttnKitConfig
from .conversion import from_llama
from .modeling import AttnKitForCausalLM, AttnKitModel, AttnKitPreTrainedModel

AutoConfig.register("attnkit", AttnKitConfig, exist_ok=True)
AutoModel.register(AttnKitConfig, AttnKitModel, exist_ok=True)
AutoModelForCausalLM.register(AttnKitConfig, AttnKitForCausalLM, exist_ok=True)

__all__ = [
    "MIXERS",
    "AttnKitCache",
    "AttnKitCacheLayer",
    "AttnKitConfig",
    "AttnKitForCausalLM",
    "AttnKitModel",
    "AttnKitPreTrainedModel",
    "from_llama",
]
