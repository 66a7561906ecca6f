"""Side-by-side benchmark: Colibri, llama.cpp and transformers on one model, in one run.

    python -m colibri_lab.bench --make-model                 # the 791 M random Mixtral
    python -m colibri_lab.bench --model-dir DIR --dtype f32,bf16 --threads 2,1 --reps 3
    python -m colibri_lab.bench --smoke --engines colibri,transformers   # CI: seconds

How it measures (engines alternating, medians, token ids, cold loads, bandwidth and
roofline, llama.cpp's build) is in :mod:`colibri_lab.bench.side_by_side` and
``docs/performance.md``.

A developer tool, not part of the runtime package: ``import colibri_lab`` does not import
it, and this ``__init__`` imports none of its modules:

- ``side_by_side``: the run (:func:`run`) with Colibri and transformers in spawned child
  processes (``Worker``), the table (:func:`render_table`), the command line
  (:func:`build_parser`, :func:`main`);
- ``llama_cpp``: building llama.cpp, its GGUF conversion, ``llama-bench``;
- ``files``: the conversion cache, the checkout measured, the page-cache helpers;
- ``common``: engine and dtype names, the smoke model's shape, the cache folder.

The model making, machine facts, memory bandwidth and roofline it reports come from
:mod:`colibri_lab.bench.tuning`.
"""

from __future__ import annotations

# what `from colibri_lab import bench; bench.main([...])` reaches, imported on first use
_LAZY = {
    "main": "side_by_side",
    "build_parser": "side_by_side",
    "run": "side_by_side",
    "render_table": "side_by_side",
    "default_cache_dir": "common",
    "ENGINES": "common",
    "DTYPES": "common",
    "SMOKE_SHAPE": "common",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
