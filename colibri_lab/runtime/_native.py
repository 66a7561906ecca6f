"""The raw ctypes layer over libcolibri (native/include/colibri.h).

This module only loads the library, declares every function of the public C API with
its argument and result types, checks the ABI version, and turns a ``colibri_status``
into a Python exception (``check`` is the one place where that happens). The handle
classes in :mod:`colibri_lab.runtime.engine` are built on it.

The library is searched in this order:

1. ``$COLIBRI_LIB`` — a path to ``libcolibri.so`` or to a folder that holds it;
2. ``colibri_lab/_lib/``, the package's root folder (a regular ``pip install .``);
3. ``colibri_lab/_lib/`` in every folder of the package's ``__path__`` and in every
   site-packages folder (an editable install, where the Python sources stay in the
   work tree while the built library is installed into site-packages).
"""

from __future__ import annotations

import ctypes
import os
import site
import sys
import sysconfig
from ctypes import (
    POINTER,
    c_char,
    c_char_p,
    c_double,
    c_float,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path

from .errors import *  # noqa: F401,F403  (the statuses and exceptions, re-exported for the binding's callers)
from .errors import ERRORS, OK, ColibriError

ABI_VERSION = 11
LIB_NAME = "libcolibri.so" if sys.platform != "darwin" else "libcolibri.dylib"


# ---------------------------------------------------------------------------------------
# Opaque handles and the one struct of the API.


class ColibriCtx(ctypes.Structure):
    """``struct colibri_ctx`` — opaque, used only through pointers."""


class ColibriTokenizerStruct(ctypes.Structure):
    """``struct colibri_tokenizer`` — opaque, used only through pointers."""


class ColibriTraceStruct(ctypes.Structure):
    """``struct colibri_trace`` — opaque, used only through pointers."""


class ColibriSamplerStruct(ctypes.Structure):
    """``struct colibri_sampler`` — opaque, used only through pointers."""


class ColibriGrammarStruct(ctypes.Structure):
    """``struct colibri_grammar`` — opaque, used only through pointers."""


ctx_p = POINTER(ColibriCtx)
tok_p = POINTER(ColibriTokenizerStruct)
trace_p = POINTER(ColibriTraceStruct)
sampler_p = POINTER(ColibriSamplerStruct)
grammar_p = POINTER(ColibriGrammarStruct)


class ColibriSamplingParams(ctypes.Structure):
    """``colibri_sampling_params`` (``struct_size`` checked by ``colibri_sampler_create``)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("temperature", c_float),
        ("top_k", c_int32),
        ("top_p", c_float),
        ("min_p", c_float),
        ("presence_penalty", c_float),
        ("frequency_penalty", c_float),
        ("repetition_penalty", c_float),
        ("repetition_last_n", c_int32),
        ("ignore_eos", c_int32),
    ]


class ColibriOptions(ctypes.Structure):
    """``colibri_options``; its layout is checked against the library at import
    (``struct_size`` written by ``colibri_options_init``)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("num_threads", c_int32),
        ("max_seq_len", c_int64),
        ("max_batch", c_int64),
        ("populate", c_int32),
        ("group_pad", c_int32),
        ("verify_checksums", c_int32),
        ("max_seqs", c_int32),
        ("kv_block_tokens", c_int32),
        ("kv_tokens", c_int64),
        ("precision", c_int32),
        ("expert_cache_policy", c_int32),
        ("expert_cache_mb", c_int64),
        ("expert_cache_slots", c_int32),
        ("backend", c_int32),
        ("gpu_device", c_int32),
        ("gpu_memory_fraction", ctypes.c_double),
        ("prefix_cache", c_int32),
    ]


class ColibriBatchEntry(ctypes.Structure):
    """``colibri_batch_entry``: one token of one sequence in a batch."""

    _fields_ = [
        ("token", c_int32),
        ("seq", c_int32),
        ("pos", c_int64),
        ("logits", c_int32),
        ("reserved", c_int32),
    ]


# name: (restype, argtypes) for every function in colibri.h.
_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "colibri_abi_version": (c_int, []),
    "colibri_version_string": (c_char_p, []),
    "colibri_status_string": (c_char_p, [c_int]),
    "colibri_options_init": (None, [c_void_p]),
    "colibri_init": (c_int, [c_char_p, POINTER(ctx_p)]),
    "colibri_init_ex": (
        c_int,
        [c_char_p, POINTER(ColibriOptions), POINTER(ctx_p), c_char_p, c_size_t],
    ),
    "colibri_free": (None, [ctx_p]),
    "colibri_expert_cache_pin": (c_int, [ctx_p, c_int32, POINTER(c_int32), c_int32]),
    "colibri_last_error": (c_char_p, [ctx_p]),
    "colibri_forward": (c_int, [ctx_p, POINTER(c_int32), c_int64, POINTER(c_float)]),
    "colibri_forward_at": (
        c_int,
        [ctx_p, POINTER(c_int32), c_int64, c_int64, POINTER(c_float)],
    ),
    "colibri_forward_last": (
        c_int,
        [ctx_p, POINTER(c_int32), c_int64, c_int64, POINTER(c_float)],
    ),
    "colibri_cached_len": (c_int64, [ctx_p]),
    "colibri_batch": (c_int, [ctx_p, c_void_p, c_int64, POINTER(c_float)]),
    "colibri_batch_logprobs": (c_int, [ctx_p, c_void_p, c_int64, POINTER(c_int32), POINTER(c_float)]),
    "colibri_seq_len": (c_int64, [ctx_p, c_int32]),
    "colibri_seq_clear": (c_int, [ctx_p, c_int32]),
    "colibri_seq_truncate": (c_int, [ctx_p, c_int32, c_int64]),
    "colibri_seq_fork": (c_int, [ctx_p, c_int32, c_int32]),
    "colibri_seq_reuse_prefix": (c_int, [ctx_p, c_int32, POINTER(c_int32), c_int64, POINTER(c_int64)]),
    "colibri_get_int": (c_int, [ctx_p, c_char_p, POINTER(c_int64)]),
    "colibri_get_float": (c_int, [ctx_p, c_char_p, POINTER(c_double)]),
    "colibri_get_layer_int": (c_int, [ctx_p, c_int32, c_char_p, POINTER(c_int64)]),
    "colibri_get_string": (c_int, [ctx_p, c_char_p, POINTER(c_char_p)]),
    "colibri_get_end_ids": (c_int, [ctx_p, POINTER(POINTER(c_int32)), POINTER(c_int32)]),
    "colibri_verify": (c_int, [ctx_p]),
    "colibri_verify_router": (c_int, [ctx_p]),
    "colibri_dequantize": (c_int, [c_int, c_void_p, c_int64, POINTER(c_float)]),
    "colibri_dequantize_sumsq": (c_int, [c_int, c_void_p, c_int64, POINTER(c_double)]),
    "colibri_install_codebook": (c_int, [c_int, c_void_p, c_int64]),
    "colibri_read_bandwidth": (
        c_int,
        [c_int32, c_int64, c_int32, c_int32, POINTER(c_double), POINTER(c_double), c_char_p, c_size_t],
    ),
    "colibri_sample": (
        c_int,
        [ctx_p, POINTER(c_float), c_float, c_int32, c_float, POINTER(c_uint64), POINTER(c_int32)],
    ),
    "colibri_sampling_params_init": (None, [POINTER(ColibriSamplingParams)]),
    "colibri_sampler_create": (
        c_int,
        [c_int32, c_int32, POINTER(ColibriSamplingParams), POINTER(sampler_p), c_char_p, c_size_t],
    ),
    "colibri_sampler_free": (None, [sampler_p]),
    "colibri_sampler_last_error": (c_char_p, [sampler_p]),
    "colibri_sampler_set_logit_bias": (c_int, [sampler_p, POINTER(c_int32), POINTER(c_float), c_int32]),
    "colibri_sampler_set_stop_ids": (c_int, [sampler_p, POINTER(c_int32), c_int32]),
    "colibri_sampler_set_end_ids": (c_int, [sampler_p, POINTER(c_int32), c_int32]),
    "colibri_sampler_set_grammar": (c_int, [sampler_p, grammar_p]),
    "colibri_sampler_add_prompt": (c_int, [sampler_p, POINTER(c_int32), c_int64]),
    "colibri_sampler_accept": (c_int, [sampler_p, c_int32]),
    "colibri_sampler_sample": (c_int, [sampler_p, POINTER(c_float), POINTER(c_uint64), POINTER(c_int32)]),
    "colibri_sampler_finished": (c_int32, [sampler_p]),
    "colibri_sampler_grammar_complete": (c_int32, [sampler_p]),
    "colibri_sampler_grammar_mask": (c_int, [sampler_p, c_void_p]),
    "colibri_grammar_compile": (
        c_int,
        [tok_p, c_char_p, c_char_p, c_char_p, POINTER(grammar_p), c_char_p, c_size_t],
    ),
    "colibri_grammar_free": (None, [grammar_p]),
    "colibri_trace_create": (c_int, [ctx_p, c_int64, POINTER(trace_p), c_char_p, c_size_t]),
    "colibri_trace_free": (None, [trace_p]),
    "colibri_trace_attach": (c_int, [ctx_p, trace_p]),
    "colibri_trace_reset": (None, [trace_p]),
    "colibri_trace_get_int": (c_int, [trace_p, c_char_p, POINTER(c_int64)]),
    "colibri_trace_array": (
        c_int,
        [trace_p, c_char_p, POINTER(c_void_p), POINTER(c_int32), POINTER(c_int32), POINTER(c_int64)],
    ),
    "colibri_stage_begin": (c_int, [ctx_p, POINTER(c_int32), c_int64, c_int64]),
    "colibri_stage_next": (c_int, [ctx_p, POINTER(c_int32), POINTER(c_int32)]),
    "colibri_stage_run": (c_int, [ctx_p, c_int32, POINTER(c_float)]),
    "colibri_stage_tensor_device": (c_int, [ctx_p, c_char_p, POINTER(c_void_p)]),
    "colibri_stage_tensor": (
        c_int,
        [ctx_p, c_char_p, POINTER(c_void_p), POINTER(c_int32), POINTER(c_int32), POINTER(c_int64)],
    ),
    "colibri_iv_mask": (c_int, [ctx_p, c_int32, c_int32, POINTER(c_int32), c_int32, c_int32]),
    "colibri_iv_router_bias": (c_int, [ctx_p, c_int32, c_int32, POINTER(c_float)]),
    "colibri_iv_force": (
        c_int,
        [ctx_p, c_int32, c_int32, c_int64, POINTER(c_int32), POINTER(c_float), c_int32],
    ),
    "colibri_iv_patch": (
        c_int,
        [ctx_p, c_int32, c_int32, c_int32, c_int32, c_int64, c_int32, POINTER(c_float)],
    ),
    "colibri_iv_clear": (c_int, [ctx_p, c_int32]),
    "colibri_lens": (c_int, [ctx_p, POINTER(c_float), c_int64, POINTER(c_float)]),
    "colibri_unembedding": (c_int, [ctx_p, c_int32, POINTER(c_float)]),
    "colibri_get_tokenizer": (tok_p, [ctx_p]),
    "colibri_tokenizer_from_memory": (
        c_int,
        [c_void_p, c_uint64, POINTER(tok_p), c_char_p, c_size_t],
    ),
    "colibri_tokenizer_free": (None, [tok_p]),
    "colibri_tokenizer_last_error": (c_char_p, [tok_p]),
    "colibri_tokenizer_vocab_size": (c_int32, [tok_p]),
    "colibri_tokenizer_bos_id": (c_int32, [tok_p]),
    "colibri_tokenizer_eos_id": (c_int32, [tok_p]),
    "colibri_tokenize": (
        c_int,
        [tok_p, c_char_p, c_uint64, c_int, POINTER(c_int32), c_int64, POINTER(c_int64)],
    ),
    "colibri_detokenize": (
        c_int,
        [tok_p, POINTER(c_int32), c_int64, POINTER(c_char), c_uint64, POINTER(c_uint64)],
    ),
    "colibri_token_piece": (
        c_int,
        [tok_p, c_int32, POINTER(POINTER(c_char)), POINTER(c_uint64)],
    ),
}


# ---------------------------------------------------------------------------------------
# Loading.


def _candidates() -> list[Path]:
    """Where to look for the library, in order (see the module docstring)."""
    out: list[Path] = []
    env = os.environ.get("COLIBRI_LIB")
    if env:
        p = Path(env)
        out.append(p / LIB_NAME if p.is_dir() else p)
    root = Path(__file__).resolve().parents[1]   # colibri_lab/
    out.append(root / "_lib" / LIB_NAME)
    pkg = sys.modules.get("colibri_lab")
    for d in getattr(pkg, "__path__", []) or []:
        out.append(Path(d) / "_lib" / LIB_NAME)
    dirs: list[str] = []
    for key in ("platlib", "purelib"):
        try:
            dirs.append(sysconfig.get_paths()[key])
        except KeyError:
            pass
    try:
        dirs.extend(site.getsitepackages())
    except AttributeError:  # old virtualenv's site module
        pass
    user = getattr(site, "getusersitepackages", lambda: None)()
    if user:
        dirs.append(user)
    dirs.extend(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    for d in dirs:
        out.append(Path(d) / "colibri_lab" / "_lib" / LIB_NAME)
    seen: set[str] = set()
    unique = []
    for p in out:
        if str(p) not in seen:
            seen.add(str(p))
            unique.append(p)
    return unique


def _load() -> tuple[ctypes.CDLL, Path]:
    env = os.environ.get("COLIBRI_LIB")
    if env and not _candidates()[0].is_file():
        raise ImportError(
            f"colibri_lab: COLIBRI_LIB={env!r} does not name {LIB_NAME} or a folder holding "
            "it; unset it to use the library installed with the package"
        )
    tried = _candidates()
    for path in tried:
        if path.is_file():
            try:
                return ctypes.CDLL(str(path)), path
            except OSError as e:
                raise ImportError(f"colibri_lab: found {path} but could not load it: {e}") from e
    where = "\n  ".join(str(p) for p in tried)
    raise ImportError(
        "colibri_lab: the native library libcolibri.so was not found. It is built and "
        "installed by `pip install .` (or `pip install -e .`) from the repository root; "
        "or set COLIBRI_LIB to a libcolibri.so built with "
        "`cmake -S native -B build && cmake --build build`. Looked in:\n  " + where
    )


def _declare(lib: ctypes.CDLL) -> None:
    missing = []
    for name, (restype, argtypes) in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.restype = restype
        fn.argtypes = argtypes
    if missing:
        raise ImportError(
            f"colibri_lab: {lib._name} lacks {', '.join(missing)}: it is not a complete "
            f"Colibri library of ABI version {ABI_VERSION}; rebuild it with `pip install .`"
        )


def _check_abi(lib: ctypes.CDLL, path: Path) -> None:
    got = lib.colibri_abi_version()
    if got != ABI_VERSION:
        raise ImportError(
            f"colibri_lab: {path} has ABI version {got}, this package needs {ABI_VERSION}; "
            "reinstall the package so that the library and the binding match"
        )
    # colibri_options_init writes sizeof(colibri_options) into struct_size. Give it a
    # generous zeroed buffer so that a larger struct cannot overrun ours, then compare.
    buf = (ctypes.c_uint8 * 1024)()
    lib.colibri_options_init(ctypes.cast(buf, c_void_p))
    size = ctypes.cast(buf, POINTER(c_uint32))[0]
    if size != ctypes.sizeof(ColibriOptions):
        raise ImportError(
            f"colibri_lab: {path} has a colibri_options of {size} bytes, the binding "
            f"declares {ctypes.sizeof(ColibriOptions)}; reinstall the package"
        )


lib, lib_path = _load()
_declare(lib)
_check_abi(lib, lib_path)


_installed_codebooks: set[str] = set()


def install_codebook(dtype: int) -> None:
    """Install the codebook a grid type (IQ2_XXS ... IQ1_M) reads, from the `gguf` package's
    copy of ggml's grids, so that colibri_dequantize takes its blocks without a model (an
    engine installs its file's own when it opens it). Once per codebook and process (a
    converter asks for every chunk); a no-op for other dtypes."""
    from ..format import spec as fmt
    name = fmt.CODEBOOK_OF.get(dtype)
    if name is None or name in _installed_codebooks:
        return
    import numpy as np

    from ..format import blocks
    grid = np.ascontiguousarray(blocks.codebook(name))
    check(lib.colibri_install_codebook(dtype, grid.ctypes.data_as(c_void_p), grid.nbytes))
    _installed_codebooks.add(name)


def version() -> str:
    """The library's version string."""
    return lib.colibri_version_string().decode("utf-8", "replace")


#: Native files whose change changes the library (under native/ of a source checkout).
_NATIVE_SOURCES = ("src", "include", "CMakeLists.txt")


def library_facts() -> dict:
    """Which library this process loaded: ``path``, ``built_utc`` (the file's modification
    time) and ``version``. Where the package sits in a source checkout (``native/`` beside
    it), ``stale`` names the newest native source file when it changed after the library
    was built, else it is None: an editable install (``pip install -e .``) is not rebuilt
    when ``native/`` changes, so such a library is not the code of the checkout, and figures
    measured with it are not the checkout's."""
    import time

    built = lib_path.stat().st_mtime
    facts = {"path": str(lib_path), "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(built)),
             "version": version(), "stale": None}  # fmt: skip
    native = Path(__file__).resolve().parents[2] / "native"
    newest, newest_t = None, built
    for name in _NATIVE_SOURCES:
        p = native / name
        for f in [p] if p.is_file() else (p.rglob("*") if p.is_dir() else []):
            try:
                t = f.stat().st_mtime
            except OSError:
                continue
            if f.is_file() and t > newest_t:
                newest, newest_t = f, t
    if newest is not None:
        facts["stale"] = (f"{newest.relative_to(native.parent)} changed after {lib_path} was built "
                          f"({facts['built_utc']}): rebuild it (pip install -e ., or point "
                          "COLIBRI_LIB at a fresh build)")  # fmt: skip
    return facts


def status_string(status: int) -> str:
    s = lib.colibri_status_string(status)
    return s.decode("utf-8", "replace") if s else f"status {status}"


# ---------------------------------------------------------------------------------------
# The one place where a status becomes an exception.


def _text(b: bytes | None) -> str:
    return b.decode("utf-8", "replace") if b else ""


def error_for(status: int, message: str = "") -> ColibriError:
    """The exception for ``status`` with ``message`` (the status name if empty)."""
    cls = ERRORS.get(status, ColibriError)
    msg = message or status_string(status)
    return cls(msg, status)


def check(status: int, *, ctx=None, tok=None, err: ctypes.Array | None = None) -> None:
    """Raise the ColibriError subclass for ``status`` unless it is OK.

    The message is taken from the error buffer ``err`` (init calls), the tokenizer
    ``tok`` or the context ``ctx``, whichever is given, else the status name.
    """
    if status == OK:
        return
    msg = ""
    if err is not None:
        msg = _text(err.value)
    elif tok is not None:
        msg = _text(lib.colibri_tokenizer_last_error(tok))
    elif ctx is not None:
        msg = _text(lib.colibri_last_error(ctx))
    raise error_for(status, msg)


__all__ = [name for name in globals() if name.startswith("Colibri")] + [
    "ABI_VERSION",
    "ERRORS",
    "check",
    "error_for",
    "install_codebook",
    "lib",
    "lib_path",
    "status_string",
    "version",
]
