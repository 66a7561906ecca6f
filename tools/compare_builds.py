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

    python tools/compare_builds.py --aarch64 --base main --threads 1,2 m-f32.colibri m-q8_0.colibri

`--aarch64` checks the AArch64 tables instead, under qemu-user: both trees' libraries are
cross-built (native/cmake/aarch64-linux-gnu.cmake, Release), the working tree's
native/tools/colibri_dump.c is compiled against each tree's own colibri.h and static library
(it uses only calls both have), and it runs under qemu-aarch64 (whose default CPU has
DotProd, I8MM and BF16) for every AArch64 kernel table the working tree's registry lists:
the exact tables (ref, neon) in exact mode, and in fast mode every fast table (reference,
neon, neon-dotprod, neon-i8mm, neon-bf16) over the neon exact table, plus the reference
over the reference; each chosen with COLIBRI_KERNELS / COLIBRI_FAST_KERNELS as the x86 mode
chooses its tables. Compared byte for byte: the logits of a full forward, of the last row, of
decode steps, the trace arrays, every stage tensor and a greedy and a sampled generation,
and the "kernels" line both sides report (a table one side cannot run is a failure, not a
fallback). Needs gcc-aarch64-linux-gnu and qemu-user.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
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


# ---- AArch64 under qemu ----------------------------------------------------------------

TOOLCHAIN = REPO / "native" / "cmake" / "aarch64-linux-gnu.cmake"
CROSS_CC = "aarch64-linux-gnu-gcc"


def qemu() -> list[str]:
    """qemu-aarch64 as the toolchain file runs it: with the cross root (-L) only where Debian's
    multiarch arm64 libc is not installed (with both, qemu pairs the cross root's loader with the
    multiarch libc and hangs in pthread_create)."""
    q = shutil.which("qemu-aarch64")
    if not q:
        raise SystemExit("compare_builds: --aarch64 needs qemu-aarch64 (apt-get install qemu-user)")
    return [q] if Path("/lib/ld-linux-aarch64.so.1").exists() else [q, "-L", "/usr/aarch64-linux-gnu"]


def aarch64_tables(tree: Path) -> tuple[list[str], list[str]]:
    """The exact and fast tables `tree`'s registry (native/src/cpu/registry.c) lists that an
    AArch64 CPU can have: rows needing nothing or CB_CPU_NEON."""
    exact, fast = [], []
    rows = re.findall(r'\{"([\w-]+)",\s*(?:"[\w-]+"|NULL),\s*\d+,\s*([^,]+),\s*[^,]+,\s*([^,]+),\s*([^}]+)\}',
                      (tree / "native" / "src" / "cpu" / "registry.c").read_text())
    for name, needs, ex, fa in rows:
        if needs.strip() != "0" and "CB_CPU_NEON" not in needs:
            continue
        (exact if ex.strip() != "NULL" else fast).append(name)
    if not exact or not fast:
        raise SystemExit(f"compare_builds: no AArch64 tables found in {tree}/native/src/cpu/registry.c")
    return exact, fast


def aarch64_cases(exact: list[str], fast: list[str], precisions: list[str]) -> list[tuple[str, str, str]]:
    """(precision, COLIBRI_KERNELS, COLIBRI_FAST_KERNELS or "") for every table."""
    ref_exact = next(t for t in exact if t == "ref")
    simd = [t for t in exact if t != "ref"] or [ref_exact]
    ref_fast = next(t for t in fast if t in ("reference", "ref"))
    cases = []
    if "exact" in precisions:
        cases += [("exact", t, "") for t in exact]
    if "fast" in precisions:
        cases += [("fast", simd[-1], t) for t in fast] + [("fast", ref_exact, ref_fast)]
    return cases


def build_aarch64(tree: Path, out: Path, dump_src: Path) -> Path:
    """`tree`'s static library cross-built into `out`, and colibri_dump (`dump_src`) linked
    against it with `tree`'s colibri.h."""
    subprocess.run(["cmake", "-S", str(tree / "native"), "-B", str(out), f"-DCMAKE_TOOLCHAIN_FILE={TOOLCHAIN}",
                    "-DCMAKE_BUILD_TYPE=Release"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(out), "-j", str(os.cpu_count() or 2), "--target", "colibri_static"],
                   check=True, capture_output=True)
    exe = out / "colibri_dump_cmp"
    subprocess.run([CROSS_CC, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{tree / 'native' / 'include'}",
                    str(dump_src), str(out / "libcolibri.a"), "-lm", "-lpthread", "-o", str(exe)],
                   check=True, capture_output=True)
    return exe


def read_dump(path: Path) -> dict[str, tuple[int, bytes]]:
    """colibri_dump's records: name -> (dtype, bytes)."""
    raw, out, i = path.read_bytes(), {}, 0
    while i < len(raw):
        n = int.from_bytes(raw[i:i + 4], "little")
        name = raw[i + 4:i + 4 + n].decode()
        i += 4 + n
        dtype = int.from_bytes(raw[i:i + 4], "little", signed=True)
        size = int.from_bytes(raw[i + 4:i + 12], "little")
        out[name] = (dtype, raw[i + 12:i + 12 + size])
        i += 12 + size
    return out


def dump_aarch64(exe: Path, model: Path, out: Path, threads: int, n: int, precision: str,
                 kernels: str, fast: str) -> str:
    env = dict(os.environ, COLIBRI_KERNELS=kernels)
    env.pop("COLIBRI_FAST_KERNELS", None)
    if fast:
        env["COLIBRI_FAST_KERNELS"] = fast
    r = subprocess.run([*qemu(), str(exe), str(model), str(out), str(threads), str(n), precision],
                       env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{exe}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    return r.stdout.strip()


def main_aarch64(args) -> int:
    if not shutil.which(CROSS_CC):
        raise SystemExit(f"compare_builds: --aarch64 needs {CROSS_CC} (apt-get install gcc-aarch64-linux-gnu)")
    qemu()
    exact, fast = aarch64_tables(REPO)
    cases = aarch64_cases(exact, fast, args.precision.split(","))
    args.work.mkdir(parents=True, exist_ok=True)
    bases = args.base.split(",")
    base_trees = {}
    failures = total = 0
    lines: dict[str, set[str]] = {}  # the "kernels" line -> the tables forced when it was reported
    try:
        for rev in bases:
            base_trees[rev] = Path(tempfile.mkdtemp(prefix="colibri-base-"))
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_trees[rev]), rev],
                           check=True, capture_output=True)
        dump_src = REPO / "native" / "tools" / "colibri_dump.c"
        exes = {"new": build_aarch64(REPO, args.work / "aarch64-new", dump_src)}
        for i, rev in enumerate(bases):
            out = args.work / f"aarch64-base{i}"
            shutil.rmtree(out, ignore_errors=True)  # its source folder is new each run
            exes[rev] = build_aarch64(base_trees[rev], out, dump_src)
        for model in args.models:
            for threads in (int(t) for t in args.threads.split(",")):
                for precision, kernels, fast_table in cases:
                    tables = f"kernels={kernels}" + (f" fast={fast_table}" if fast_table else "")
                    case = f"{model.name} threads={threads} {tables} precision={precision}"
                    outs = {side: args.work / f"aarch64-{i}.dump" for i, side in enumerate(exes)}
                    used = {}
                    for side, exe in exes.items():
                        try:
                            used[side] = dump_aarch64(exe, model.resolve(), outs[side], threads, args.tokens,
                                                      precision, kernels, fast_table)
                        except RuntimeError as e:
                            used[side] = e
                    if isinstance(used["new"], RuntimeError):
                        total += len(bases)
                        failures += len(bases)
                        print(f"FAILED    {case}: {used['new']}", flush=True)
                        continue
                    y = read_dump(outs["new"])
                    lines.setdefault(used["new"], set()).add(tables)
                    for rev in bases:
                        total += 1
                        label = f"{case} base={rev}" if len(bases) > 1 else case
                        if isinstance(used[rev], RuntimeError):
                            failures += 1
                            print(f"FAILED    {label}: {used[rev]}", flush=True)
                            continue
                        x = read_dump(outs[rev])
                        bad = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
                        if used[rev] != used["new"]:
                            bad.insert(0, f"kernels: base '{used[rev]}', new '{used['new']}'")
                        if bad:
                            failures += 1
                            print(f"DIFFERENT {label} [{used['new']}]: {', '.join(bad[:8])}"
                                  + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else ""), flush=True)
                        else:
                            print(f"identical {label} [{used['new']}]: {len(x)} arrays", flush=True)
    finally:
        for tree in base_trees.values():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                           capture_output=True, check=False)
            shutil.rmtree(tree, ignore_errors=True)
    # a forced table the build or CPU cannot run falls back to another: two forcings, one line
    for line, forced in lines.items():
        if len(forced) > 1:
            failures += 1
            print(f"FAILED    the tables {', '.join(sorted(forced))} all ran as '{line}'")
    print(f"{total} case(s): " + ("no difference" if not failures else f"{failures} differ or failed"))
    return 1 if failures else 0


def differing(a: Path, b: Path) -> list[str]:
    x, y = np.load(a), np.load(b)
    names = sorted(set(x.files) | set(y.files))
    return [k for k in names if k not in x.files or k not in y.files
            or x[k].dtype != y[k].dtype or x[k].shape != y[k].shape or x[k].tobytes() != y[k].tobytes()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path, help=".colibri files")
    ap.add_argument("--base", required=True,
                    help="git revision to compare the working tree with (--aarch64: several, comma-separated, "
                         "each compared with the same dumps of the working tree)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--kernels", default="best",
                    help="comma-separated kernel tables: best, avx512, avx2, ref (default best)")
    ap.add_argument("--precision", default="exact",
                    help="comma-separated numeric modes: exact, fast (default exact)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="prompt length (default 200; 64 with --aarch64)")
    ap.add_argument("--aarch64", action="store_true",
                    help="cross-build both trees for AArch64 and compare every AArch64 table under qemu "
                         "(--kernels is not used: the registry's tables are)")
    ap.add_argument("--work", type=Path, default=REPO / "build" / "compare",
                    help="build folders and dumps (default build/compare)")
    args = ap.parse_args(argv)
    if args.tokens is None:
        args.tokens = 64 if args.aarch64 else 200
    if args.aarch64:
        return main_aarch64(args)
    if "," in args.base:
        ap.error("one --base revision at a time (several only with --aarch64)")

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
