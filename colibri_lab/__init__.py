"""Colibri Lab: the Python package around the Colibri MoE inference engine.

- :class:`Engine` runs a ``.colibri`` model (forward, generate, tokenizer);
- :func:`convert` turns a Hugging Face checkpoint into a ``.colibri`` file, :func:`convert_gguf`
  a llama.cpp GGUF (one file, or a split one by any of its shards);
- :func:`inspect` reads a ``.colibri`` file's header, metadata and tensor directory.

Errors from the engine are :class:`ColibriError` subclasses carrying the C message.
"""

# Pure Python: none of these needs the compiled library, so converting and inspecting
# files works before (or without) it is built. The engine, its tokenizer and the native
# version load the library on first use (below).
from .conversion.hf import convert
from .runtime.errors import (
    ColibriBufferTooSmallError,
    ColibriChecksumError,
    ColibriClosedError,
    ColibriError,
    ColibriFormatError,
    ColibriInternalError,
    ColibriInvalidArgError,
    ColibriIOError,
    ColibriNoMemoryError,
    ColibriNumericError,
    ColibriSeqTooLongError,
    ColibriTokenRangeError,
    ColibriUnsupportedError,
    ColibriVersionError,
)
from .format.reader import inspect
from .runtime.trace import Trace

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "ColibriBufferTooSmallError",
    "ColibriChecksumError",
    "ColibriClosedError",
    "ColibriError",
    "ColibriFormatError",
    "ColibriIOError",
    "ColibriInternalError",
    "ColibriInvalidArgError",
    "ColibriNoMemoryError",
    "ColibriNumericError",
    "ColibriSeqTooLongError",
    "ColibriTokenRangeError",
    "ColibriUnsupportedError",
    "ColibriVersionError",
    "Engine",
    "EngineConfig",
    "Sequence",
    "Token",
    "Tokenizer",
    "Trace",
    "convert",
    "convert_gguf",
    "inspect",
    "native_version",
]

# The workbench modules load on first use, so `import colibri_lab` does not import plotly:
# `from colibri_lab import viz` is `colibri_lab.analysis.viz`, and so on (the short names a
# notebook uses). The engine's names load the native library (runtime/_native.py) on first
# use, so `import colibri_lab` does not need it.
_LAZY_MODULES = {
    "cachesim": "analysis.cachesim",
    "diagnostics": "analysis.diagnostics",
    "quality": "analysis.quality",
    "serving": "runtime.serving",
    "tuning": "bench.tuning",
    "viz": "analysis.viz",
    "widgets": "analysis.widgets",
}
_ENGINE_NAMES = ("BACKENDS", "Engine", "EngineConfig", "Sequence", "Token", "Tokenizer")


def __getattr__(name: str):
    import importlib

    if name in _LAZY_MODULES:
        return importlib.import_module(f".{_LAZY_MODULES[name]}", __name__)
    if name in _ENGINE_NAMES:
        return getattr(importlib.import_module(".runtime.engine", __name__), name)
    if name == "native_version":
        return importlib.import_module(".runtime._native", __name__).version
    if name == "convert_gguf":   # on first use: the GGUF importers' imports take a while
        return importlib.import_module(".conversion.gguf", __name__).convert_gguf
    raise AttributeError(f"module 'colibri_lab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_MODULES) | set(_ENGINE_NAMES) | {"native_version", "convert_gguf"})
