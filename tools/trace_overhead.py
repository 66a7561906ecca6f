"""Tracing overhead: forward time with tracing never enabled, enabled-then-detached (off),
and on, measured in one process, interleaved, medians over repetitions.

    python tools/trace_overhead.py [--model M.colibri] [--tokens 64] [--reps 30]

Without --model it converts a small random Mixtral (vocab 32000, hidden 256, 4 layers,
8 experts, top-2) into a temporary folder (needs torch and transformers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _make_model(folder: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from colibri_lab.bench.models import MixtralShape, build_model  # noqa: E402

    import colibri_lab

    shape = MixtralShape(vocab=32000, hidden=256, inter=512, layers=4, heads=8, kv_heads=2, experts=8,
                  top_k=2, seed=1)  # fmt: skip
    build_model(shape).save_pretrained(folder / "hf")
    out = folder / "m.colibri"
    colibri_lab.convert(folder / "hf", out, dtype="bf16", progress=False)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)

    from colibri_lab import Engine

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(a.model) if a.model else _make_model(Path(tmp))
        kw = dict(num_threads=a.threads or None)
        engines = {name: Engine(path, **kw) for name in ("never", "off", "on")}
        with engines["off"].trace(capacity=8):  # enabled once, then detached: the "off" state
            engines["off"].forward([1, 2, 3])
        never = engines["never"]
        ids = np.random.default_rng(0).integers(3, never.vocab_size, a.tokens).tolist()
        times = {"never": [], "off": [], "on": []}
        rng = np.random.default_rng(1)
        # "on": one trace stays attached for the whole run (sized for every forward)
        with engines["on"].trace(capacity=(a.reps + 1) * a.tokens):
            for eng in engines.values():
                eng.forward(ids)  # warm-up
            for _ in range(a.reps):
                for name in rng.permutation(list(times)):  # a new order each repetition
                    eng = engines[name]
                    t0 = time.perf_counter()
                    eng.forward(ids)
                    times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"model {path.name}: {a.tokens} tokens per forward, {a.reps} interleaved reps, "
              f"threads used {never.config.threads_used}")
        for k in ("never", "off", "on"):
            print(f"  {k:5s} median {med[k] * 1e3:8.3f} ms")
        print(f"  off / never = {med['off'] / med['never']:.4f}   on / never = {med['on'] / med['never']:.4f}")
        for eng in engines.values():
            eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
