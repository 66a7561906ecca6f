"""`python -m colibri_lab quality`: a (quantized) `.colibri` file against a reference as
``llama-perplexity --kl-divergence`` measures it, optionally beside llama.cpp's own run
(``--llama-base`` / ``--llama-test``), or a file's fast numeric mode against its exact mode
(``--precision-agreement``). The statistics are :mod:`colibri_lab.analysis.quality`'s."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .quality import (compare, format_agreement, format_table, held_out_text, precision_agreement,
                      random_tokens, text_tokens)

# --------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m colibri_lab quality",
        description="Measure a (quantized) .colibri model against a reference as llama-perplexity "
                    "--kl-divergence does: PPL, KL divergence, top-1 agreement, Δp and MoE "
                    "routing flips.")
    p.add_argument("--ref", help="the reference .colibri (normally the f32 conversion)")
    p.add_argument("--test", help="the .colibri measured against it")
    p.add_argument("--precision-agreement", action="append", default=[], metavar="FILE",
                   help="instead: the engine's fast numeric mode against its exact mode on FILE "
                        "(repeatable); tokens from --text, --random-tokens, else the tiny model's "
                        "held-out text; --ctx is the chunk length (default 256 here), every position scored")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", help="a text file, tokenized as llama-perplexity -f does (BOS + text)")
    src.add_argument("--random-tokens", type=int, metavar="N",
                     help="N uniformly random ids instead (no llama.cpp counterpart)")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-tokens (default 0)")
    p.add_argument("--ctx", type=int, default=None, help="tokens per chunk (default 512; 256 with "
                   "--precision-agreement)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks")
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: physical cores)")
    p.add_argument("--no-routing", action="store_true", help="skip the routing comparison")
    p.add_argument("--llama-base", help="also run llama-perplexity: the f32 GGUF (needs --text)")
    p.add_argument("--llama-test", action="append", default=[],
                   help="a quantized GGUF for llama-perplexity --kl-divergence (repeatable)")
    p.add_argument("--llama-perplexity", help="the llama-perplexity program (default: the bench's build)")
    p.add_argument("--json", help='write {"colibri": report, "llama.cpp": {name: report}} here')
    p.add_argument("--quiet", action="store_true", help="no per-chunk progress")
    a = p.parse_args(argv)
    if a.precision_agreement:
        if a.ref or a.test or a.llama_base or a.llama_test:
            p.error("--precision-agreement measures one file's two numeric modes: leave out --ref, --test "
                    "and the llama.cpp options")
        return _precision_main(a)
    if not (a.ref and a.test):
        p.error("the arguments --ref and --test are required (or --precision-agreement FILE)")
    if not (a.text or a.random_tokens is not None):
        p.error("one of the arguments --text --random-tokens is required")
    a.ctx = 512 if a.ctx is None else a.ctx
    if (a.llama_base or a.llama_test) and not (a.text and a.llama_base and a.llama_test):
        p.error("the llama.cpp comparison needs --text, --llama-base and at least one --llama-test")
    try:
        from ..runtime.engine import Engine

        with Engine(a.ref, num_threads=a.threads, max_seq_len=a.ctx) as ref:
            if a.text:
                tokens = text_tokens(ref, Path(a.text).read_text(encoding="utf-8"))
            else:
                tokens = random_tokens(a.random_tokens, ref.vocab_size, seed=a.seed)
            rep = compare(ref, a.test, tokens, ctx=a.ctx, n_chunks=a.chunks, threads=a.threads,
                          routing=not a.no_routing, progress=not a.quiet)
        print(rep.summary())
        out: dict[str, Any] = {"colibri": rep.to_dict()}
        if a.llama_base:
            from ..bench.llama_quality import llama_compare

            res = llama_compare(a.llama_base, a.llama_test, a.text, ctx=a.ctx, n_chunks=rep.n_chunks,
                                threads=a.threads, exe=a.llama_perplexity)
            n = min(len(res["tokens"]), len(tokens))
            same = bool(np.array_equal(res["tokens"][:n], tokens[:n]))
            print(f"\nllama.cpp scored {len(res['tokens'])} ids; the same as ours: {same}")
            for r in res["reports"].values():
                print(r.summary())
            print()
            print(format_table({f"colibri {rep.test}": rep,
                                **{f"llama.cpp {k}": v for k, v in res["reports"].items()}}))
            out["llama.cpp"] = {k: v.to_dict() for k, v in res["reports"].items()}
            out["same_tokens"] = same
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _precision_main(a) -> int:
    """--precision-agreement FILE ...: fast against exact on each file, a table, --json."""
    chunk = 256 if a.ctx is None else a.ctx
    results: dict[str, dict[str, Any]] = {}
    try:
        text = None
        if a.text:
            text = Path(a.text).read_text(encoding="utf-8")
        elif a.random_tokens is None:
            text = held_out_text()
        for f in a.precision_agreement:
            if text is not None:
                tokens = text_tokens(f, text)
            else:
                from ..runtime.engine import Engine

                with Engine(f, max_seq_len=2) as eng:
                    tokens = random_tokens(a.random_tokens, eng.vocab_size, seed=a.seed)
            r = precision_agreement(f, tokens, num_threads=a.threads, chunk=chunk, max_chunks=a.chunks,
                                    progress=not a.quiet)
            results[f] = r
            print(f"{f}: {r['weight_dtype']}, kernels {r['kernels']}: fast against exact over {r['n_tokens']} "
                  f"positions ({r['n_chunks']} chunks of <= {chunk}): KL mean {r['kl_mean']:.3g}, max "
                  f"{r['kl_max']:.3g}; same top-1 {100 * r['top1']:.3f} %; routing flips "
                  f"{100 * r['routing_flips']:.3f} % of {r['n_routing_decisions']} decisions")
        print()
        print(format_agreement({os.path.basename(k): v for k, v in results.items()}))
        if a.json:
            Path(a.json).write_text(json.dumps({"precision_agreement": results}, indent=2) + "\n")
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
