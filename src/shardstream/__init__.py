"""shardstream: run and train large language models on hardware too small for them.

The public names load on first use, so `import shardstream` (and `shardstream --help`) does not
pay for torch and transformers.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

# OpenMP threads (torch's and the quantized kernel's, one libgomp) sleep at a barrier instead of spinning
# for it. Spinning wins only on cores nothing else wants; beside other work (another rank or agent on the
# same machine, a server's threads, any other process) a spinning thread burns the time slice its peer
# needs (docs/BENCHMARKS.md, "Real shapes").
# It takes effect only if torch is first imported after this (libgomp reads it once, when loaded);
# set OMP_WAIT_POLICY yourself to choose otherwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
