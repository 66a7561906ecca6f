"""Colibri Lab: the Python package around the Colibri MoE inference engine.

- :class:`Engine` runs a ``.colibri`` model (forward, generate, tokenizer);
- :func:`convert` turns a Hugging Face checkpoint into a ``.colibri`` file;
- :func:`inspect` reads a ``.colibri`` file's header, metadata and tensor directory.

Errors from the engine are :class:`ColibriError` subclasses carrying the C message.
"""

from ._native import (
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
from ._native import version as native_version
from .convert import convert
from .engine import Engine, EngineConfig, Token, Tokenizer
from .format import inspect
from .trace import Trace

__version__ = "0.1.0"

__all__ = [
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
    "Token",
    "Tokenizer",
    "Trace",
    "convert",
    "inspect",
    "native_version",
]

# The workbench modules load on first use, so `import colibri_lab` does not import plotly.
_LAZY_MODULES = ("diagnostics", "viz", "widgets")


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'colibri_lab' has no attribute {name!r}")
