"""Serving benchmark: colibri_server and llama.cpp's llama-server under the same load.

    python -m colibri_lab.bench.serving --model-dir ~/.cache/colibri-lab/models/mixtral-791m \\
        --dtype bf16 --threads 2 --concurrency 1,4,8,16 --reps 2
    python -m colibri_lab.bench.serving --smoke            # tiny model, colibri only, seconds

The workload (``colibri_lab.runtime.serving.load``): C concurrent clients (threads), each sending requests one after another
(closed loop) to ``POST /v1/completions`` with ``stream: true``, for ``--duration`` seconds
or ``--requests`` requests per client, whichever ends first. Prompts are words drawn from a
fixed list by a seeded PRNG, of varied lengths (``--prompt-words``, uniform), the same
sequence of prompts for both servers; every request asks for ``--max-tokens`` tokens at
temperature 0.8 with a per-request seed, so a random-init model does not stop early on
EOS. The client is plain ``http.client`` parsing server-sent events (the same client code
for both servers; the official ``openai`` client's own overhead would be measured too).

Per server and concurrency: aggregate output tokens/s (completion tokens of the requests
that ended in the window / the window's wall time), time to first token (request sent ->
first token event) and inter-token latency (time between token events of one stream) as
P50 and P99, requests done and failed. The servers alternate per concurrency level
(colibri, llama.cpp, colibri, ...), each started fresh with room for C sequences and
stopped afterwards; the figures are medians over ``--reps`` repetitions. Only 127.0.0.1 is
used. Timings are printed, never judged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ..runtime.serving import Server, free_port, load, prompts as make_prompts, server_exe
from .common import _say, default_cache_dir

def start_colibri(path: Path, threads: int, concurrency: int, ctx_per_seq: int, log: Path) -> Server:
    exe = server_exe()
    if exe is None:
        raise RuntimeError("colibri_server not found (pip install . builds it when libmicrohttpd and "
                           "jansson are installed; or set COLIBRI_SERVER)")
    port = free_port()
    argv = [exe, "--model", str(path), "--host", f"127.0.0.1:{port}", "--num_threads", str(threads),
            "--parallel", str(concurrency), "--max_batch_size", str(concurrency),
            "--max_seq_len", str(ctx_per_seq), "--kv_tokens", str(ctx_per_seq * concurrency),
            "--alias", "model"]
    return Server("colibri_server", argv, port, log)


def start_llama(src: Path, gguf: Path, threads: int, concurrency: int, ctx_per_seq: int, log: Path) -> Server:
    from .llama_cpp import _llama_bin

    exe = _llama_bin(src, "llama-server")
    if not exe.is_file():
        raise RuntimeError(f"llama-server is not built in {src}")
    port = free_port()
    argv = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(concurrency), "-c", str(ctx_per_seq * concurrency),
            "--no-webui", "-a", "model"]
    return Server("llama-server", argv, port, log)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m colibri_lab.bench.serving",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, help="a Hugging Face Mixtral folder (e.g. --make-model's)")
    ap.add_argument("--make-model", action="store_true", help="the 791 M random Mixtral of docs/performance.md")
    ap.add_argument("--dtype", default="bf16", choices=("f32", "bf16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4,8,16", help="comma-separated client counts")
    ap.add_argument("--engines", default="colibri,llama.cpp")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per level and server")
    ap.add_argument("--requests", type=int, default=1000, help="most requests per client and level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", default="8,160", help="prompt length range in words: lo,hi")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--llama-cpp-dir", type=Path, default=None)
    ap.add_argument("--no-build", action="store_true", help="never build llama.cpp")
    ap.add_argument("--smoke", action="store_true",
                    help="colibri only, 1 and 4 clients for 3 s each (CI); the smoke model unless --model-dir")
    ap.add_argument("--json", nargs="?", const="-", default=None, help="write the raw result (PATH or -)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from . import models, tuning
    from .files import colibri_file

    cache = args.cache_dir or default_cache_dir()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.smoke:
        from .common import SMOKE_SHAPE

        model_dir = args.model_dir or models.make_model(cache / "models" / "smoke-mixtral", SMOKE_SHAPE)
        engines, levels, args.duration, args.reps, args.max_tokens = ["colibri"], [1, 4], 3.0, 1, 16
        args.prompt_words = "4,40"  # a context of 160 positions fits small test models
    elif args.make_model:
        model_dir = models.make_model(cache / "models" / "mixtral-791m")
    elif args.model_dir:
        model_dir = args.model_dir
    else:
        print("give --model-dir DIR, --make-model or --smoke", file=sys.stderr)
        return 2
    lo, hi = (int(x) for x in args.prompt_words.split(","))
    prompts = make_prompts(4096, lo, hi, args.seed)
    ctx_per_seq = 2 * hi + args.max_tokens + 64  # words -> at most ~2 tokens each, plus the answer
    files = {}
    if "colibri" in engines:
        files["colibri"] = colibri_file(model_dir, args.dtype, cache)
    src = None
    if "llama.cpp" in engines:
        from .llama_cpp import ensure_llama_cpp, gguf_file

        try:
            src = ensure_llama_cpp(args.llama_cpp_dir or cache / "llama.cpp", build=not args.no_build)
            files["llama.cpp"] = gguf_file(src, model_dir, args.dtype, cache)
        except Exception as e:  # the run goes on without the peer, and says why
            _say(f"llama.cpp not available: {e}")
            engines.remove("llama.cpp")
    logs = cache / "serving-logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict = {e: {c: [] for c in levels} for e in engines}
    for rep in range(args.reps):
        for c in levels:
            for e in engines:  # alternating: every level, the servers take turns
                log = logs / f"{e}-c{c}-r{rep}.log"
                srv = (start_colibri(files[e], args.threads, c, ctx_per_seq, log) if e == "colibri"
                       else start_llama(src, files[e], args.threads, c, ctx_per_seq, log))
                try:
                    srv.wait_healthy()
                    # warm-up: one request per client slot, not counted
                    load(srv.port, c, prompts[-c:], 8, 30.0, 1, 120.0)
                    r = load(srv.port, c, prompts, args.max_tokens, args.duration, args.requests, 300.0)
                finally:
                    srv.stop()
                runs[e][c].append(r)
                _say(f"{e} c={c} rep {rep + 1}: {r['output_tok_s']:.1f} tok/s, {r['requests']} requests, "
                     f"{r['failed']} failed")
    summary = {}
    for e in engines:
        for c in levels:
            rs = runs[e][c]

            def med(k):
                vals = [r[k] for r in rs if r[k] is not None]
                return statistics.median(vals) if vals else None

            summary[f"{e}@{c}"] = {k: med(k) for k in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
                                                       "itl_p50_ms", "itl_p99_ms")}
            summary[f"{e}@{c}"]["requests"] = sum(r["requests"] for r in rs)
            summary[f"{e}@{c}"]["failed"] = sum(r["failed"] for r in rs)
    print(render(summary, engines, levels, args))
    if args.json:
        out = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": tuning.machine_info(),
               "summary": summary, "runs": runs}
        text = json.dumps(out, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0


def render(summary: dict, engines: list[str], levels: list[int], args) -> str:
    def f(v, spec=".1f"):
        return "—" if v is None else format(v, spec)

    lines = [f"serving, {args.dtype}, {args.threads} threads, {args.max_tokens} tokens per request, "
             f"prompts of {args.prompt_words} words, medians of {args.reps}",
             "| server | clients | output tok/s | ÷ 1 client | TTFT P50 / P99 ms | ITL P50 / P99 ms | requests | failed |",
             "|---|---|---|---|---|---|---|---|"]
    for e in engines:
        base = summary.get(f"{e}@{levels[0]}", {}).get("output_tok_s")
        for c in levels:
            s = summary[f"{e}@{c}"]
            ratio = s["output_tok_s"] / base if base and s["output_tok_s"] else None
            lines.append(f"| {e} | {c} | {f(s['output_tok_s'])} | {f(ratio, '.2f')} | "
                         f"{f(s['ttft_p50_ms'], '.0f')} / {f(s['ttft_p99_ms'], '.0f')} | "
                         f"{f(s['itl_p50_ms'], '.1f')} / {f(s['itl_p99_ms'], '.1f')} | {s['requests']} | {s['failed']} |")
    if "colibri" in engines and "llama.cpp" in engines:
        for c in levels:
            a, b = summary[f"colibri@{c}"]["output_tok_s"], summary[f"llama.cpp@{c}"]["output_tok_s"]
            if a and b:
                lines.append(f"colibri ÷ llama-server at {c} clients: {a / b:.2f}x output tok/s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
