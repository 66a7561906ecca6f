"""Side-by-side benchmark: Colibri, llama.cpp and transformers on one model, in one run.

    python -m colibri_lab.bench --make-model                 # the 791 M random Mixtral
    python -m colibri_lab.bench --model-dir DIR --dtype f32,bf16 --threads 2,1 --reps 3
    python -m colibri_lab.bench --smoke --engines colibri,transformers   # CI: seconds

How it measures (engines alternating, medians, token ids, cold loads, bandwidth and
roofline, llama.cpp's build) is in :mod:`colibri_lab.bench.side_by_side` and
``docs/performance.md``.

The developer tools, not part of the runtime: ``import colibri_lab`` does not import them,
and this ``__init__`` imports none of its modules:

- ``models``: the one random-model factory (tests, benchmarks and notebooks);
- ``tuning``: machine facts, memory bandwidth, the decode roofline, timed runs and sweeps;
- ``side_by_side``: the run (:func:`run`) with Colibri and transformers in spawned child
  processes (``Worker``), the tables (:func:`render_table`, :func:`render_summary`), the
  command line (:func:`build_parser`, :func:`main`);
- ``serving``: the serving benchmark against llama-server and vLLM (``python -m
  colibri_lab.bench.serving``);
- ``llama_cpp``: building llama.cpp, its GGUF conversion, ``llama-bench``;
- ``llama_quality``: llama.cpp's ``llama-perplexity`` side of the quality measure;
- ``files``: the conversion cache, the checkout measured, the page-cache helpers;
- ``common``: engine and dtype names, the smoke model's shape, the cache folder.
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
