"""Structured output benchmark: the grammar mask's cost per step and decode speed with and
without a JSON schema (docs/serving.md, "Structured output").

    python -m colibri_lab.bench.structured --model m.colibri [--tokenizer tokenizer.json ...]

Mask: for each tokenizer (the model's, and each tokenizer.json / tekken.json given, converted
to a tokenizer section in memory) and each schema, a sampler with the grammar walks one
valid output (random logits, seeded, with a bias toward closing quotes and brackets so that
strings end), timing ``colibri_sampler_grammar_mask`` at every step: the median and the max
in ms, with the states visited. Decode: ``Engine.generate`` on the model with and without the
schema, alternated (A B A B ...): the median ms between two generated tokens (prefill left
out); the ratio is what to compare (absolute figures move with the machine's load).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import statistics
import time
from pathlib import Path

import numpy as np

from ..runtime._native import lib
from ..runtime.engine import Engine, Tokenizer
from ..runtime.sampling import FINISH_EOS, Grammar, Sampler

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                                "tags": {"type": "array", "items": {"type": "string"}}},
               "required": ["name", "age", "tags"]},
    "math_reasoning": json.loads(
        '{"type":"object","properties":{"steps":{"type":"array","items":{"type":"object","properties":'
        '{"explanation":{"type":"string"},"output":{"type":"string"}},"required":["explanation","output"],'
        '"additionalProperties":false}},"final_answer":{"type":"string"}},"required":["steps","final_answer"],'
        '"additionalProperties":false}'),
    "any_object": True,
}


def _piece_text(tok: Tokenizer, i: int) -> str:
    return tok.piece_bytes(i).decode("utf-8", "replace").replace("\u2581", " ").replace("\u0120", " ")


def mask_timing(tok: Tokenizer, schema, steps: int = 96, seed: int = 0) -> dict:
    """Median / max ms of one mask over up to `steps` steps of one valid output."""
    V = tok.vocab_size
    closing = np.zeros(V, dtype=np.float32)
    for i in range(V):
        t = _piece_text(tok, i).lstrip()
        if t[:1] in ('"', "]", "}"):
            closing[i] = 6.0
    g = Grammar(tok, schema)
    s = Sampler(V, tok.eos_id, temperature=1.0, grammar=g)
    rng_np = np.random.default_rng(seed)
    rng = ctypes.c_uint64(seed + 1)
    buf = np.zeros(V, dtype=np.uint8)
    ptr = buf.ctypes.data_as(ctypes.c_void_p)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        lib.colibri_sampler_grammar_mask(s._handle, ptr)
        times.append((time.perf_counter() - t0) * 1e3)
        s.sample(rng_np.standard_normal(V).astype(np.float32) + closing, rng)
        if s.finished == FINISH_EOS:
            break
    s.close()
    g.close()
    return {"vocab": V, "steps": len(times), "median_ms": statistics.median(times), "max_ms": max(times)}


def decode_timing(model: Path, schema, tokens: int = 64, reps: int = 3, seed: int = 0) -> dict:
    """Median ms between two generated tokens (the prefill left out) with and without the
    schema, the runs alternated."""
    with Engine(model) as eng:
        tok = eng.tokenizer
        bias = {i: 6.0 for i in range(tok.vocab_size) if _piece_text(tok, i).lstrip()[:1] in ('"', "]", "}")}
        res = {"plain": [], "schema": []}
        list(eng.generate("warm up", 4))
        for r in range(reps):
            for kind in ("plain", "schema"):
                kw = {"json_schema": schema, "logit_bias": bias} if kind == "schema" else {"ignore_eos": True}
                stamps = [time.perf_counter()]
                for _ in eng.generate("Hello", tokens, temperature=1.0, seed=seed + r, **kw):
                    stamps.append(time.perf_counter())
                res[kind] += [(b - a) * 1e3 for a, b in itertools.pairwise(stamps[1:])]
        plain, sch = statistics.median(res["plain"]), statistics.median(res["schema"])
        return {"plain_ms_per_token": plain, "schema_ms_per_token": sch, "ratio": sch / plain,
                "tokens": {k: len(v) for k, v in res.items()}}


def _tokenizer_from_json(path: Path) -> Tokenizer:
    from ..conversion.bpe import build_bpe_tokenizer_section

    section, _ = build_bpe_tokenizer_section(path)
    return Tokenizer.from_section_bytes(section)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, action="append", default=[], help=".colibri file (mask and decode)")
    ap.add_argument("--tokenizer", type=Path, action="append", default=[], help="tokenizer.json / tekken.json")
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    rows = []
    for m in args.model:
        with Engine(m) as eng:
            for name, schema in SCHEMAS.items():
                rows.append({"tokenizer": m.name, "schema": name, **mask_timing(eng.tokenizer, schema, args.steps)})
        for name in ("person",):
            print(json.dumps({"model": m.name, "schema": name, **decode_timing(m, SCHEMAS[name], args.tokens)}))
    for t in args.tokenizer:
        tok = _tokenizer_from_json(t)
        for name, schema in SCHEMAS.items():
            rows.append({"tokenizer": t.name, "schema": name, **mask_timing(tok, schema, args.steps)})
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
