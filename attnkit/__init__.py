"""attnkit: attention beyond RoPE — PaTH, TAPA and VLA, with layers and Hugging Face models.

``attnkit.ops`` holds the functional ops, ``attnkit.layers`` the ``nn.Module`` layers and ``attnkit.models`` the
Hugging Face models; ``attnkit.<name>`` imports a subpackage on first use.

``import attnkit`` imports neither torch nor transformers (the command line starts without them). The model type
``"attnkit"`` is registered with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM`` as soon as
transformers is imported, in whichever order the two are imported, so ``import attnkit`` followed by
``AutoModelForCausalLM.from_pretrained(run_folder)`` works.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
from types import ModuleType

__version__ = "0.1.0"

_SUBPACKAGES = ("cli", "experiments", "layers", "models", "ops", "registry", "tasks", "train")


def __getattr__(name: str) -> ModuleType:
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register_models() -> None:
    importlib.import_module(".models", __name__)  # its import registers "attnkit" with the Auto classes


class _RegisterAfterExec(importlib.abc.Loader):
    """transformers' own loader, followed by the registration of the attnkit models."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if _HOOK in sys.meta_path:
            sys.meta_path.remove(_HOOK)
        _register_models()

    def __getattr__(self, name: str):  # resource and source access go to the real loader
        return getattr(self._loader, name)


class _RegisterWhenTransformersLoads(importlib.abc.MetaPathFinder):
    """Finds transformers as the other finders do, with a loader that registers the models once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        for finder in sys.meta_path:  # the path finder, or an editable install's finder
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfterExec(spec.loader)
                return spec
        return None


_HOOK = _RegisterWhenTransformersLoads()
if sys.modules.get("transformers") is not None:  # None: made unimportable on purpose
    _register_models()
else:
    sys.meta_path.insert(0, _HOOK)
