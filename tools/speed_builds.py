"""Speed of two builds of the engine, alternating: that a change moved no speed.

    python tools/speed_builds.py --base BASE/colibri_bench --new NEW/colibri_bench \
        --model M.colibri [--rounds 6] [--threads 2] [--precision exact,fast]

Build each revision's colibri_bench first (e.g. `git worktree add /tmp/base REV` and
`cmake -S /tmp/base/native -B /tmp/b-base -DCMAKE_BUILD_TYPE=Release -DCOLIBRI_BUILD_TESTS=OFF
&& cmake --build /tmp/b-base --target colibri_bench`). Each round runs both builds once per
numeric mode, the order swapped every round (base first in even rounds), each a fresh process:
a 128-token prefill and 128 decoded tokens, 3 requests after a warm-up (colibri_bench --json).
Printed per mode: every run, each build's median prefill and decode tokens/s, the ratio
new / base of every round and the median of those ratios (paired ratios survive slow drifts of
the machine better than the ratio of medians). Timings are printed, never judged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess


def run(bench: str, model: str, threads: int, precision: str) -> tuple[float, float]:
    out = subprocess.run([bench, "--model", model, "--seq_len", "128", "--max_new_tokens", "128",
                          "--num_requests", "3", "--warmup", "1", "--num_threads", str(threads),
                          "--precision", precision, "--json"], capture_output=True, text=True, check=True).stdout
    j = json.loads(out)
    return j["prefill"]["tokens_per_s"], j["decode"]["tokens_per_s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the base build's colibri_bench")
    ap.add_argument("--new", required=True, help="the new build's colibri_bench")
    ap.add_argument("--model", required=True, help=".colibri file")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="exact,fast")
    a = ap.parse_args(argv)
    modes = [m for m in a.precision.split(",") if m]
    builds = {"base": a.base, "new": a.new}
    res: dict = {}
    for r in range(a.rounds):
        for prec in modes:
            for name in (("base", "new") if r % 2 == 0 else ("new", "base")):
                res[r, prec, name] = run(builds[name], a.model, a.threads, prec)
                p, d = res[r, prec, name]
                print(f"round {r} {name:4s} {prec:5s} prefill {p:8.1f} decode {d:7.2f} tok/s", flush=True)
    for prec in modes:
        for k, what in ((0, "prefill"), (1, "decode")):
            b = [res[r, prec, "base"][k] for r in range(a.rounds)]
            n = [res[r, prec, "new"][k] for r in range(a.rounds)]
            ratios = [y / x for x, y in zip(b, n)]
            print(f"{prec} {what}: base {statistics.median(b):.1f}, new {statistics.median(n):.1f} tok/s; "
                  f"new/base per round {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
