"""attnkit: attention beyond RoPE — PaTH, TAPA and VLA, with layers and Hugging Face models.

``attnkit.ops`` holds the functional ops, ``attnkit.layers`` the ``nn.Module`` layers and, when
transformers is installed (the ``hf`` extra), ``attnkit.models`` the Hugging Face models, registered with
``AutoConfig`` / ``AutoModelForCausalLM`` on import.
"""

import importlib.util

__version__ = "0.1.0"

if importlib.util.find_spec("transformers") is not None:
    from . import models  # noqa: F401  (registers the "attnkit" model type)
