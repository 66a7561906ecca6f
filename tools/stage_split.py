"""Where Colibri's time goes on the 791 M model: CPU ms/token and the share of each stage
(from a trace) for a 512-token prefill and 32 decode steps, one thread, f32 and bf16.

    COLIBRI_LIB=build/libcolibri.so PYTHONPATH=. python tools/stage_split.py \
        ~/.cache/colibri-lab/converted/mixtral-791m-*-f32.colibri ...-bf16.colibri

The .colibri files are the ones `python -m colibri_lab.bench --make-model` converts into
~/.cache/colibri-lab/converted/. Figures feed the gap analysis in docs/performance.md.
CPU time (time.process_time) leaves out time spent descheduled on a busy machine.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import colibri_lab


def split(path: str, threads: int = 1) -> None:
    with colibri_lab.Engine(path, num_threads=threads, max_seq_len=640) as eng:
        ids = np.random.default_rng(0).integers(3, eng.vocab_size, size=512).astype(np.int32)
        eng.forward(ids[:64])  # warm-up: page the weights in
        with eng.trace() as tr:
            c = time.process_time()
            eng.forward(ids, last_only=True)  # the last row's logits, as generation needs
            cpu_pre = time.process_time() - c
        pre = tr.stage_totals()
        with eng.trace() as tr:
            c = time.process_time()
            for i in range(32):
                eng.forward([int(ids[i])], start_pos=512 + i)
            cpu_dec = time.process_time() - c
        dec = tr.stage_totals()
        dtype = eng.config.weight_dtype
    for name, st, cpu, n in (("prefill 512", pre, cpu_pre, 512), ("decode x32", dec, cpu_dec, 32)):
        tot = sum(st.values())
        shares = ", ".join(f"{k} {v / tot:.0%}" for k, v in st.items() if v / tot >= 0.005)
        print(f"{dtype} {threads}t {name}: {cpu / n * 1e3:.1f} CPU ms/token; {shares}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        split(p)
