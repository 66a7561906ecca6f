"""The full ablation sweep of a model: every expert of every MoE layer excluded in turn, the
mean next-token loss on held-out tokens for each, three ways, timed:

- readout: the engine does everything: the ablations run as separate sequences of one batched
  forward per window (each sequence carries its own Engine.intervene(ablate=..., seq=q)), and
  the engine reduces each position's logits to the next token's log-probability
  (Engine.logprobs, colibri_batch_logprobs): no logits row comes to Python;
- logits: one ablation at a time through Engine.intervene, the logits of every position
  copied to numpy and the loss computed there (log-softmax over the vocabulary);
- stagerun: the same through StageRun (the ablation done from Python between the router and
  the grouping stages: the routing recomputed in numpy from the router's logits and written
  into the stage tensors), the loss in numpy.

The losses of the three are compared. With --reps R the three sweeps run R times in rotation
(the order shifted each time, so that a loaded machine's drift falls on all of them) and the
medians are reported. Times are wall-clock seconds of a whole sweep; run on a quiet machine,
or say that the figures were taken under load. Then greedy generation under each ablation,
through intervene and through StageRun (a stage run per token), timed once and compared.

    python tools/ablation_sweep.py --model tiny.colibri [--tokens 2000] [--threads 2] [--reps 3]

Without --model it converts data/tiny-mixtral into a temporary folder. The held-out text is
the tiny model's held-out split (data/README.md: the standard library's .py files whose
path hash falls in the held-out 3 %), read in file order up to --tokens tokens.
"""

from __future__ import annotations

import argparse
import contextlib
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
    """Mean loss with expert e of `layer` excluded by the engine, the logits to numpy."""
    with eng.intervene(ablate={layer: [e]}):
        logits = forward_chunks(eng, ids, chunk)
    return float(losses(logits, ids).mean())


def sweep_readout(eng, ids, chunk, pairs) -> dict:
    """Every ablation's mean loss, the engine doing it all: per window of `chunk` tokens one
    batched forward whose sequence q carries ablation pairs[q], each position's next-token
    log-probability read out by the engine (the last token of the text has no target)."""
    targets = np.append(ids[1:], -1)
    total = np.zeros(len(pairs))
    for q in range(len(pairs)):
        eng.sequence(q).clear()
    with contextlib.ExitStack() as stack:
        for q, (layer, e) in enumerate(pairs):
            stack.enter_context(eng.intervene(ablate={layer: [e]}, seq=q))
        for i in range(0, len(ids), chunk):
            w, t = ids[i:i + chunk], targets[i:i + chunk]
            lps = eng.logprobs([(q, w, t) for q in range(len(pairs))])
            for q, lp in enumerate(lps):
                total[q] -= lp[t >= 0].astype(np.float64).sum()
                eng.sequence(q).clear()
    return {pair: float(v) / (len(ids) - 1) for pair, v in zip(pairs, total)}


def sweep_logits(eng, ids, chunk, pairs) -> dict:
    return {(layer, e): ablated_losses_engine(eng, ids, chunk, layer, e) for layer, e in pairs}


def sweep_stagerun(eng, ids, chunk, pairs) -> dict:
    return {(layer, e): ablated_losses_stagerun(eng, ids, chunk, layer, e) for layer, e in pairs}


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
    logits = np.concatenate([_stage_forward(eng, ids[i:i + chunk], 0, layer, e)
                             for i in range(0, len(ids), chunk)])  # fmt: skip
    return float(losses(logits, ids).mean())


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


SIDES = {"readout": sweep_readout, "logits": sweep_logits, "stagerun": sweep_stagerun}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help=".colibri file (default: data/tiny-mixtral converted)")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=512, help="tokens per window (each window a new sequence)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=1, help="sweeps per way, in rotation; medians reported")
    ap.add_argument("--sides", default="readout,logits,stagerun", help="which ways to run (comma-separated)")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens generated under each ablation (0: none)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    sides = [x for x in a.sides.split(",") if x]
    if not sides or any(x not in SIDES for x in sides):
        ap.error(f"--sides takes some of {', '.join(SIDES)}")
    import colibri_lab

    tmp = None
    model = a.model
    if not model:
        tmp = tempfile.TemporaryDirectory()
        model = os.path.join(tmp.name, "tiny.colibri")
        colibri_lab.convert(REPO / "data" / "tiny-mixtral", model, progress=False)
    with colibri_lab.Engine(model, num_threads=a.threads or None) as probe:
        moe = probe._layer_is_moe()
        n_layers, n_experts = probe.config.n_layers, probe.config.n_experts
    pairs = [(l, e) for l in range(n_layers) if moe[l] for e in range(n_experts)]
    chunk = a.chunk
    # one sequence per ablation, each as long as a window; prefix_cache off: a stage run whose
    # tensors were edited from Python would offer its KV blocks to the prefix cache as if
    # computed plainly (the engine's own interventions never do)
    with colibri_lab.Engine(model, num_threads=a.threads or None, prefix_cache=False, max_seqs=len(pairs),
                            max_seq_len=max(chunk, a.new + 64), max_batch=chunk) as eng:  # fmt: skip
        ids = heldout_ids(eng.tokenizer, a.tokens)
        base = float(losses(forward_chunks(eng, ids, chunk), ids).mean())
        secs = {x: [] for x in sides}
        loss = {}
        for r in range(a.reps):
            for x in sides[r % len(sides):] + sides[:r % len(sides)]:
                t0 = time.perf_counter()
                loss[x] = SIDES[x](eng, ids, chunk, pairs)
                secs[x].append(time.perf_counter() - t0)
        t_gen_engine = t_gen_stage = 0.0
        same = True
        prompt = [int(t) for t in ids[:64]]
        for n, (layer, e) in enumerate(pairs if a.new > 0 else []):
            for side in ((0, 1) if n % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                if side == 0:
                    g1 = generate_engine(eng, prompt, a.new, layer, e)
                    t_gen_engine += time.perf_counter() - t0
                else:
                    g2 = generate_stagerun(eng, prompt, a.new, layer, e)
                    t_gen_stage += time.perf_counter() - t0
            same &= g1 == g2
        kernels = eng.config.kernels
        threads = eng.config.num_threads
        lp_rows = eng._get_int("logprob_rows")
    med = {x: float(np.median(v)) for x, v in secs.items()}
    ref = loss[sides[0]]
    diff = {x: max(abs(loss[x][k] - ref[k]) for k in ref) for x in sides[1:]}
    res = {
        "model": str(model), "tokens": len(ids), "window": chunk, "ablations": len(pairs), "reps": a.reps,
        "baseline_loss": base, "seconds": secs, "median_s": med, "logprob_rows": lp_rows,
        "max_loss_difference_vs_" + sides[0]: diff, "generate_tokens": a.new, "generate_engine_s": t_gen_engine,
        "generate_stagerun_s": t_gen_stage, "generations_equal": same, "threads": threads, "kernels": kernels,
        "machine": platform.processor() or platform.machine(),
        "loss": {f"{l}/{e}": v for (l, e), v in ref.items()},
    }  # fmt: skip
    print(f"{len(ids)} held-out tokens in windows of {chunk}, {len(pairs)} ablations, {threads} threads, "
          f"kernels {kernels}, {a.reps} sweep(s) per way in rotation")  # fmt: skip
    print(f"baseline loss {base:.4f}; median seconds of a whole sweep: "
          + ", ".join(f"{x} {med[x]:.2f} s" for x in sides))  # fmt: skip
    for x in sides[1:]:
        print(f"  {x} / {sides[0]}: {med[x] / med[sides[0]]:.1f}x; max |loss difference| {diff[x]:.2e}")
    if a.new > 0:
        print(f"greedy generation of {a.new} tokens after a 64-token prompt under each ablation: intervene "
              f"{t_gen_engine:.2f} s, StageRun {t_gen_stage:.2f} s ({t_gen_stage / t_gen_engine:.1f}x); "
              f"same tokens: {same}")  # fmt: skip
    worst = sorted(ref.items(), key=lambda kv: -kv[1])[:5]
    print("largest loss increases: " + ", ".join(f"layer {l} expert {e}: +{v - base:.3f}" for (l, e), v in worst))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
