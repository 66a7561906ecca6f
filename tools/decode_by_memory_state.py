"""Decode of Colibri against llama.cpp, binned by the memory state each run had.

Some machines' memory bandwidth moves with their neighbours within seconds (a 2-vCPU Zen 4
EPYC here flips between about 35 and 65 GB/s of streaming reads), so the medians of a
side-by-side run (``python -m colibri_lab.bench``) compare whichever states each engine
happened to get. This tool alternates short decode runs of the two engines (the order
swapped every round), measures the read bandwidth (``colibri_read_bandwidth``, 256 MiB,
once) just before and just after each run, keeps the runs whose two measures agree (both
above --fast-gbs, or both below --slow-gbs), and prints, per state, each engine's median
decode, their ratio, and each run's decode as a fraction of the read roofline at the mean
of its two measures (the weight bytes per token from the .colibri file's tensor
directory, as the bench counts them).

    python tools/decode_by_memory_state.py --model M.colibri --gguf M.gguf \\
        --llama-bench PATH/llama-bench --rounds 14 --precision fast --threads 2

Every loop is bounded (--rounds); nothing is sent anywhere.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
from pathlib import Path

from colibri_lab import tuning

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help=".colibri file")
    p.add_argument("--gguf", required=True, help="the same weights as a GGUF, for llama-bench")
    p.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench executable")
    p.add_argument("--colibri-bench", default=str(REPO / "build" / "rel" / "colibri_bench"))
    p.add_argument("--rounds", type=int, default=14)
    p.add_argument("--tokens", type=int, default=64, help="decode steps per run, after a prompt of 16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="fast", choices=("exact", "fast"))
    p.add_argument("--fast-gbs", type=float, default=50.0)
    p.add_argument("--slow-gbs", type=float, default=44.0)
    a = p.parse_args()
    if a.rounds < 1 or a.tokens < 1 or a.threads < 1:
        p.error("--rounds, --tokens and --threads must be >= 1")
    bytes_per_token = tuning.file_decode_roofline(a.model, 1.0)["bytes_per_token"]

    def bandwidth() -> float:
        return tuning.measure_read_bandwidth(a.threads, 256 << 20, reps=1, variants=("nt_prefetch",))["gbs"]

    def colibri() -> float:
        out = subprocess.run([a.colibri_bench, "--model", a.model, "--seq_len", "16", "--max_new_tokens",
                              str(a.tokens), "--precision", a.precision, "--num_threads", str(a.threads),
                              "--num_requests", "1", "--warmup", "0"],
                             capture_output=True, text=True, check=True, timeout=300).stdout  # fmt: skip
        return float(re.search(r"^decode .* ([0-9.]+) tok/s", out, re.M).group(1))

    def llama() -> float:
        out = subprocess.run([a.llama_bench, "-m", a.gguf, "-t", str(a.threads), "-r", "1", "-o", "json",
                              "-p", "0", "-n", str(a.tokens), "-d", "16"],
                             capture_output=True, text=True, check=True, timeout=300).stdout  # fmt: skip
        return float(json.loads(out)[0]["avg_ts"])

    runs: dict[str, list[tuple[float, float, float]]] = {"colibri": [], "llama.cpp": []}
    for i in range(a.rounds):
        order = (("colibri", colibri), ("llama.cpp", llama))
        for name, run in order if i % 2 == 0 else order[::-1]:
            before = bandwidth()
            tok_s = run()
            after = bandwidth()
            runs[name].append((before, tok_s, after))
            print(f"round {i + 1} {name}: {before:.1f} GB/s, {tok_s:.1f} tok/s, {after:.1f} GB/s", flush=True)
    states = {"fast": lambda b0, b1: min(b0, b1) > a.fast_gbs, "slow": lambda b0, b1: max(b0, b1) < a.slow_gbs}
    for state, keep in states.items():
        med = {}
        for name, rs in runs.items():
            kept = [(v, v * bytes_per_token / ((b0 + b1) / 2 * 1e9)) for b0, v, b1 in rs if keep(b0, b1)]
            if not kept:
                print(f"{state}: {name}: no run in this state")
                continue
            med[name] = statistics.median(v for v, _ in kept)
            frac = statistics.median(f for _, f in kept)
            print(f"{state}: {name}: {len(kept)} runs, median {med[name]:.1f} tok/s, "
                  f"{frac:.0%} of the read roofline at its bandwidth")
        if len(med) == 2:
            print(f"{state}: colibri / llama.cpp = {med['colibri'] / med['llama.cpp']:.3f}")


if __name__ == "__main__":
    main()
