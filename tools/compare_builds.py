"""Bitwise before/after check of the engine: every output of two source trees, compared byte
for byte on the same .colibri files.

    python tools/compare_builds.py --base 1676ff9 MODEL.colibri [MODEL ...]
    python tools/compare_builds.py --base main --threads 1,2 --kernels best,avx2,ref m.colibri
    python tools/compare_builds.py --base main --precision exact,fast m.colibri

For a change that must not change behaviour (a refactor, a file move, a new seam), this
builds the engine of the base revision (a temporary git worktree) and of the working tree
(CMake, Release, portable as `pip install .` builds it), then runs each tree's own Python
package with its own library over every model x thread count x kernel table and compares:
the logits of a full forward, of `last_only`, of decode steps after a prefill, every array
of a trace (router probabilities, top-k ids and weights, shared gates, group sizes), every
tensor of a stage-by-stage run, and a greedy and a sampled generation. It prints one line
per case and exits 1 if any array differs in any bit (or a case fails to run).

Each tree is imported from its own folder (an editable install's import hook is set aside),
so the two sides may differ in ABI version or Python code. Nothing is timed here: speed is
compared with colibri_bench, alternating the two builds (docs/performance.md).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

# Runs inside a subprocess with argv: TREE MODEL OUT THREADS N_TOKENS PRECISION.
DUMP = r'''
import sys
tree, model, out, threads, n, precision = (sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                          int(sys.argv[5]), sys.argv[6])
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable")]
sys.path.insert(0, tree)
import numpy as np
from colibri_lab import Engine

res = {}
with Engine(model, num_threads=threads, precision=precision) as eng:
    ids = np.random.default_rng(0).integers(3, eng.vocab_size, size=n).astype(np.int32)
    with eng.trace() as tr:
        res["full"] = eng.forward(ids)
    for k in ("token_ids", "positions", "router_probs", "topk_ids", "topk_weights",
              "shared_gate", "group_sizes", "padded_group_sizes", "layer_is_moe"):
        res["trace." + k] = np.asarray(getattr(tr, k))
    res["last_only"] = eng.forward(ids, last_only=True)
    m = n * 3 // 4
    eng.forward(ids[:m])
    res["decode"] = np.concatenate([eng.forward([int(t)], start_pos=m + i)
                                    for i, t in enumerate(ids[m:])])
    run = eng.stages(ids[: min(n, 37)])
    for k, v in run.embedding().items():
        res["stage.embedding." + k] = np.array(v, copy=True)
    for layer in range(eng.config.n_layers):
        for st in ("attention", "router", "grouping", "expert_ffn", "combine"):
            for k, v in getattr(run, st)().items():
                res[f"stage.{layer}.{st}.{k}"] = np.array(v, copy=True)
    res["stage.logits"] = run.finish()
    prompt = [int(t) for t in ids[:12]]
    res["greedy"] = np.array([t.id for t in eng.generate(prompt, 24, stop_at_eos=False)])
    res["sampled"] = np.array([t.id for t in eng.generate(prompt, 24, temperature=0.8, top_k=40,
                                                          top_p=0.9, seed=7, stop_at_eos=False)])
    kernels = eng.config.kernels
np.savez(out, **res)
print(kernels)
'''


def build(tree: Path, out: Path) -> Path:
    """libcolibri.so of `tree`, built into `out` (incrementally)."""
    subprocess.run(["cmake", "-S", str(tree / "native"), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release"],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(out), "-j", str(os.cpu_count() or 2), "--target", "colibri_shared"],
                   check=True, capture_output=True)
    return out / "libcolibri.so"


def dump(tree: Path, lib: Path, model: Path, out: Path, threads: int, kernels: str, n: int, precision: str):
    env = dict(os.environ, COLIBRI_LIB=str(lib))
    env.pop("COLIBRI_KERNELS", None)
    if kernels != "best":
        env["COLIBRI_KERNELS"] = kernels
    r = subprocess.run([sys.executable, "-c", DUMP, str(tree), str(model), str(out), str(threads), str(n), precision],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{tree}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    return r.stdout.strip()


def differing(a: Path, b: Path) -> list[str]:
    x, y = np.load(a), np.load(b)
    names = sorted(set(x.files) | set(y.files))
    return [k for k in names if k not in x.files or k not in y.files
            or x[k].dtype != y[k].dtype or x[k].shape != y[k].shape or x[k].tobytes() != y[k].tobytes()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path, help=".colibri files")
    ap.add_argument("--base", required=True, help="git revision to compare the working tree with")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--kernels", default="best",
                    help="comma-separated kernel tables: best, avx512, avx2, ref (default best)")
    ap.add_argument("--precision", default="exact",
                    help="comma-separated numeric modes: exact, fast (default exact)")
    ap.add_argument("--tokens", type=int, default=200, help="prompt length (default 200)")
    ap.add_argument("--work", type=Path, default=REPO / "build" / "compare",
                    help="build folders and dumps (default build/compare)")
    args = ap.parse_args(argv)

    args.work.mkdir(parents=True, exist_ok=True)
    base_tree = Path(tempfile.mkdtemp(prefix="colibri-base-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_tree), args.base],
                   check=True, capture_output=True)
    failures = 0
    try:
        shutil.rmtree(args.work / "base", ignore_errors=True)  # its source folder is new each run
        libs = {"base": build(base_tree, args.work / "base"), "new": build(REPO, args.work / "new")}
        trees = {"base": base_tree, "new": REPO}
        for model in args.models:
            for threads in (int(t) for t in args.threads.split(",")):
                for kernels, precision in itertools.product(args.kernels.split(","), args.precision.split(",")):
                    case = f"{model.name} threads={threads} kernels={kernels} precision={precision}"
                    outs = {side: args.work / f"{side}.npz" for side in trees}
                    try:
                        used = {side: dump(trees[side], libs[side], model, outs[side], threads,
                                           kernels, args.tokens, precision) for side in trees}
                        bad = differing(outs["base"], outs["new"])
                    except RuntimeError as e:
                        print(f"FAILED    {case}: {e}")
                        failures += 1
                        continue
                    n = len(np.load(outs["base"]).files)
                    if bad:
                        failures += 1
                        print(f"DIFFERENT {case} [{used['new']}]: {', '.join(bad[:8])}"
                              + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else ""))
                    else:
                        print(f"identical {case} [{used['new']}]: {n} arrays")
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)],
                       capture_output=True)
        shutil.rmtree(base_tree, ignore_errors=True)
    print(f"{'no difference' if not failures else f'{failures} case(s) differ or failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
