"""Constants and small helpers shared by the modules of the side-by-side benchmark."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENGINES = ("colibri", "llama.cpp", "transformers")
DTYPES = ("f32", "bf16")

# The smoke model: the real vocabulary (so the tokenizer is the real one), tiny elsewhere;
# sizes are multiples of 4 so transformers' grouped_mm experts work on the CPU.
SMOKE_SHAPE = dict(vocab=32000, hidden=64, inter=96, layers=2, heads=4, kv_heads=2,
                   experts=4, top_k=2, max_pos=1024)  # fmt: skip


def default_cache_dir() -> Path:
    """Models, converted files and llama.cpp: $COLIBRI_LAB_CACHE, else ~/.cache/colibri-lab."""
    return Path(os.environ.get("COLIBRI_LAB_CACHE", "~/.cache/colibri-lab")).expanduser()


def _say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)
