"""Prefill of Colibri against transformers in many short alternating rounds.

``python -m colibri_lab.bench`` times one 512-token prefill per engine and repetition; on a
VM whose neighbours move its speed within seconds, five such repetitions can land in
different conditions for each engine (seen here: one engine's repetition at 560 tok/s
between two at 900). This tool keeps both engines loaded in their own processes (the
bench's workers, the same calls: ``Engine.forward(last_only=True)`` and transformers'
forward with a fresh cache and ``logits_to_keep=1``), alternates single prefills of fresh
random ids, swapping the order every round, and prints each round's ratio (the two runs a
second or two apart) and the median of the ratios beside each engine's median.

    python tools/prefill_rounds.py --model M.colibri --hf-dir HF_DIR --rounds 20 \\
        --precision fast --threads 2 --tokens 512

Every loop is bounded (--rounds); nothing is sent anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from colibri_lab.bench.side_by_side import Worker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help=".colibri file")
    p.add_argument("--hf-dir", required=True, help="the same weights as a Hugging Face folder")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", default="fast", choices=("exact", "fast"))
    p.add_argument("--dtype", default="bf16", choices=("bf16", "f32"), help="transformers' dtype")
    p.add_argument("--json", help="write the rounds here")
    a = p.parse_args()
    if a.rounds < 1 or a.tokens < 1 or a.threads < 1:
        p.error("--rounds, --tokens and --threads must be >= 1")
    with open(f"{a.hf_dir}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    engines = {"colibri": Worker("colibri", a.model, a.threads, a.tokens + 8, a.precision),
               "transformers": Worker("transformers", a.hf_dir, a.dtype, a.threads)}
    rng = np.random.default_rng(0)
    rounds = []
    try:
        warm = rng.integers(3, vocab, size=a.tokens).astype(np.int32)
        for w in engines.values():  # one untimed prefill each
            w.run(warm, np.zeros(0, np.int32))
        for r in range(a.rounds):
            ids = rng.integers(3, vocab, size=a.tokens).astype(np.int32)
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            got = {k: engines[k].run(ids, np.zeros(0, np.int32))["prefill_tok_s"] for k in order}
            got["ratio"] = got["colibri"] / got["transformers"]
            rounds.append(got)
            print(f"round {r + 1}: colibri {got['colibri']:.1f} tok/s, transformers "
                  f"{got['transformers']:.1f} tok/s, ratio {got['ratio']:.3f}", flush=True)  # fmt: skip
    finally:
        for w in engines.values():
            w.close()
    med = {k: statistics.median(x[k] for x in rounds) for k in ("colibri", "transformers", "ratio")}
    q1, q3 = np.percentile([x["ratio"] for x in rounds], [25, 75])
    print(f"median of {len(rounds)} rounds: colibri {med['colibri']:.1f} tok/s, transformers "
          f"{med['transformers']:.1f} tok/s; median ratio {med['ratio']:.3f} (quartiles {q1:.3f}-{q3:.3f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rounds": rounds, "medians": med}, f, indent=1)


if __name__ == "__main__":
    main()
