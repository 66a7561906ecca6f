"""The full ablation sweep of a model: every expert of every MoE layer excluded in turn
(Engine.intervene(ablate=...)), the mean next-token loss on held-out tokens for each, timed;
and the same sweep through StageRun (the ablation done from Python between the router and
the grouping stages: the routing recomputed in numpy from the router's logits and written
into the stage tensors), timed, with the losses of both compared. Times are wall-clock
seconds of the whole sweep; run on a quiet machine, or say that the figures were taken
under load.

    python tools/ablation_sweep.py --model tiny.colibri [--tokens 2000] [--threads 2]

Without --model it converts data/tiny-mixtral into a temporary folder. The held-out text is
the tiny model's held-out split (data/README.md: the standard library's .py files whose
path hash falls in the held-out 3 %), read in file order up to --tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def heldout_ids(tok, n: int, permille: int = 30) -> np.ndarray:
    sys.path.insert(0, str(REPO / "data"))
    import train_tiny_moe as T

    root, ids = T.stdlib_root(), []
    for rel in T.list_sources(root):
        if not T.is_heldout(rel, permille):
            continue
        text = T.read_text(os.path.join(root, rel))
        if text and text.strip():
            ids += tok.encode(text)
        if len(ids) >= n:
            break
    return np.array(ids[:n], dtype=np.int32)


def losses(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Next-token cross-entropy of each position but the last (float32 softmax, float64 sums)."""
    lg = logits[:-1]
    m = lg.max(-1, keepdims=True)
    lse = m[:, 0].astype(np.float64) + np.log(np.exp(lg - m).sum(-1, dtype=np.float64))
    return lse - lg[np.arange(len(ids) - 1), ids[1:]]


def forward_chunks(eng, ids: np.ndarray, chunk: int) -> np.ndarray:
    """Logits of independent windows of `chunk` tokens (each a new sequence)."""
    return np.concatenate([eng.forward(ids[i:i + chunk]) for i in range(0, len(ids), chunk)])


def ablated_losses_engine(eng, ids, chunk, layer, e):
    """Mean loss with expert e of `layer` excluded by the engine, and the forwards' seconds."""
    t0 = time.perf_counter()
    with eng.intervene(ablate={layer: [e]}):
        logits = forward_chunks(eng, ids, chunk)
    secs = time.perf_counter() - t0
    return float(losses(logits, ids).mean()), secs


def generate_engine(eng, prompt, n_new, layer, e):
    with eng.intervene(ablate={layer: [e]}):
        return [t.id for t in eng.generate(prompt, max_new_tokens=n_new, stop_at_eos=False)]


def _route_ablated(logits: np.ndarray, e: int, k: int, renorm: bool):
    """Mixtral's routing (softmax, top-k, renormalised) with expert e's logit at -inf."""
    lg = logits.astype(np.float32).copy()
    lg[:, e] = -np.inf
    p = np.exp(lg - lg.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=-1)
    if renorm:
        w = w / w.sum(-1, keepdims=True)
    return ids.astype(np.int32), w.astype(np.float32)


def _stage_forward(eng, ids, start, layer, e):
    """One chunk through a stage run with expert e of `layer` excluded from Python."""
    cfg = eng.config
    run = eng.stages(ids, start)
    run.embedding()
    run.run_to(layer)
    run.attention()
    r = run.router()
    tk, tw = _route_ablated(r["router_logits"], e, cfg.top_k, cfg.norm_topk_prob)
    r["topk_ids"][:] = tk
    r["topk_weights"][:] = tw
    return run.finish()


def ablated_losses_stagerun(eng, ids, chunk, layer, e):
    """The same through stage runs, the exclusion done from Python."""
    t0 = time.perf_counter()
    logits = np.concatenate([_stage_forward(eng, ids[i:i + chunk], 0, layer, e)
                             for i in range(0, len(ids), chunk)])  # fmt: skip
    secs = time.perf_counter() - t0
    return float(losses(logits, ids).mean()), secs


def generate_stagerun(eng, prompt, n_new, layer, e):
    """Greedy decoding, every step a stage run of one token with the ablation done from Python."""
    seq = list(prompt)
    logits = _stage_forward(eng, np.array(seq, np.int32), 0, layer, e)
    for _ in range(n_new):
        seq.append(int(np.argmax(logits[-1])))
        if len(seq) - len(prompt) == n_new:
            break
        logits = _stage_forward(eng, np.array(seq[-1:], np.int32), len(seq) - 1, layer, e)
    return seq[len(prompt):]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help=".colibri file (default: data/tiny-mixtral converted)")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=0, help="tokens per window (default: max_batch)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--new", type=int, default=32, help="greedy tokens generated under each ablation")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    import colibri_lab

    tmp = None
    model = a.model
    if not model:
        tmp = tempfile.TemporaryDirectory()
        model = os.path.join(tmp.name, "tiny.colibri")
        colibri_lab.convert(REPO / "data" / "tiny-mixtral", model, progress=False)
    # prefix_cache off: a stage run whose tensors were edited from Python would offer its KV
    # blocks to the prefix cache as if computed plainly (the engine's own interventions never do)
    with colibri_lab.Engine(model, num_threads=a.threads or None, prefix_cache=False) as eng:
        chunk = a.chunk or eng.config.max_batch
        ids = heldout_ids(eng.tokenizer, a.tokens)
        base = float(losses(forward_chunks(eng, ids, chunk), ids).mean())
        # the two ways alternate, ablation by ablation, the order swapped each time (a loaded
        # machine's drift then falls on both): whole-step and forward-only seconds per side
        moe = eng._layer_is_moe()
        pairs = [(l, e) for l in range(eng.config.n_layers) if moe[l] for e in range(eng.config.n_experts)]
        fast, slow = {}, {}
        t_engine = t_stage = fast_fw = slow_fw = 0.0
        t_gen_engine = t_gen_stage = 0.0
        prompt = [int(t) for t in ids[:64]]
        same = True
        for n, (layer, e) in enumerate(pairs):
            for side in ((0, 1) if n % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                if side == 0:
                    fast[layer, e], s = ablated_losses_engine(eng, ids, chunk, layer, e)
                    t_engine += time.perf_counter() - t0
                    fast_fw += s
                    t0 = time.perf_counter()
                    g1 = generate_engine(eng, prompt, a.new, layer, e)
                    t_gen_engine += time.perf_counter() - t0
                else:
                    slow[layer, e], s = ablated_losses_stagerun(eng, ids, chunk, layer, e)
                    t_stage += time.perf_counter() - t0
                    slow_fw += s
                    t0 = time.perf_counter()
                    g2 = generate_stagerun(eng, prompt, a.new, layer, e)
                    t_gen_stage += time.perf_counter() - t0
            same &= g1 == g2
        kernels = eng.config.kernels
        threads = eng.config.num_threads
    diff = max(abs(fast[k] - slow[k]) for k in fast)
    res = {
        "model": str(model), "tokens": len(ids), "window": chunk, "ablations": len(fast),
        "baseline_loss": base, "engine_s": t_engine, "stagerun_s": t_stage, "engine_forward_s": fast_fw,
        "stagerun_forward_s": slow_fw, "generate_tokens": a.new, "generate_engine_s": t_gen_engine,
        "generate_stagerun_s": t_gen_stage, "generations_equal": same,
        "max_loss_difference": diff, "threads": threads, "kernels": kernels, "machine": platform.processor()
        or platform.machine(), "loss": {f"{l}/{e}": v for (l, e), v in fast.items()},
    }  # fmt: skip
    print(f"{len(ids)} held-out tokens in windows of {chunk}, {len(fast)} ablations, {threads} threads, "
          f"kernels {kernels}")  # fmt: skip
    print(f"baseline loss {base:.4f}; sweep through intervene {t_engine:.2f} s (forwards {fast_fw:.2f} s), "
          f"through StageRun {t_stage:.2f} s (forwards {slow_fw:.2f} s): {slow_fw / fast_fw:.2f}x in the "
          f"forwards; max |loss difference| {diff:.2e}")  # fmt: skip
    print(f"greedy generation of {a.new} tokens after a 64-token prompt under each ablation: intervene "
          f"{t_gen_engine:.2f} s, StageRun {t_gen_stage:.2f} s ({t_gen_stage / t_gen_engine:.1f}x); "
          f"same tokens: {same}")  # fmt: skip
    worst = sorted(fast.items(), key=lambda kv: -kv[1])[:5]
    print("largest loss increases: " + ", ".join(f"layer {l} expert {e}: +{v - base:.3f}" for (l, e), v in worst))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
