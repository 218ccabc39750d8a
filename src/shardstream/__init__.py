"""shardstream: run and train large language models on hardware too small for them.

The public names load on first use, so `import shardstream` (and `shardstream --help`) does not
pay for torch and transformers.
"""

from __future__ import annotations

import importlib
import sys
import types

from . import openmp

openmp.choose()   # OMP_WAIT_POLICY, before torch loads

__version__ = "0.1.0"
__all__ = ["AutoModel", "ConversionOptions", "EngineOptions", "convert", "open_store", "sepweight"]

# public name -> (module, attribute in it; None for the module itself)
_LAZY = {"AutoModel": (".front.auto", "AutoModel"), "ConversionOptions": (".options", "ConversionOptions"),
         "EngineOptions": (".stream", "EngineOptions"), "convert": (".convert", "convert"),
         "open_store": (".store", "open_store"), "sepweight": (".sepweight", None)}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'shardstream' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name, __name__)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """Keeps `shardstream.convert` the function: importing the submodule of the same name would rebind it."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "convert" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
