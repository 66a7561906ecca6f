#!/usr/bin/env python3
"""Colibri's CUDA backend against transformers on one GPU, on a random Mixtral-8x7B shape.

    python3 tools/gpu_bench.py --layers 4 --out $OUT --budget-s 200

The shape is Mixtral-8x7B's (hidden 4096, intermediate 14336, 8 experts top-2, 32 query / 8 KV
heads, vocab 32000) in bf16 with the first --layers of its 32 layers: the full model is 93 GB,
more than the lent machine's disk and time box; 4 layers are about 12 GB. Random weights (the
HF default init, normal(0, 0.02), made on the GPU), saved as safetensors under /dev/shm when it
has room (else --workdir), converted with colibri_lab.convert (bf16), then measured with the
two engines alternating, each figure the median of --reps runs after a warm-up:

- decode tok/s at batch 1 (one sequence, one token a step) and batch 16 (16 sequences, one
  step = one Engine.batch of 16 tokens / one transformers forward of [16, 1] with
  past_key_values), after a --context token prompt;
- prefill of --prefill tokens (tok/s, last-token logits only for Colibri);
- transformers: eager PyTorch (no torch.compile, no CUDA graphs), its default attention and
  experts implementation, torch.cuda.synchronize() around every timing;
- the HBM roofline: bytes a decode step must read (the dense weights but the embedding table,
  one embedding row, plus the routed experts the step touches: top_k per layer at batch 1,
  min(E, top_k x batch) per layer at batch 16, the expected distinct count for uniform routing)
  over the device's bandwidth, and each engine's share of it. The bandwidth is the device's
  own: measured here (a device-to-device copy of 1 GiB, bytes read + written, median of 10,
  torch.cuda events) and, beside it, the peak the driver reports (memory clock x bus width x 2,
  from cudaDeviceGetAttribute through torch's bundled runtime or cupy, where either answers);
  the roofline uses the measured figure (what a streaming kernel can reach on this device);
- the figures scaled to 32 layers: bandwidth-bound decode time grows with the bytes read, so
  tok/s(32) ~ tok/s(N) x bytes(N) / bytes(32). An estimate, stated as such in the JSON;
- parity of the big shape: one prompt, the CUDA backend's last-token top-1 = transformers'
  (bf16 on the GPU), with max |Δ| over the logit range.

Colibri runs in each of --precisions (default exact,fast: f32 activations on CUDA cores, or
bf16 weights on the tensor cores from bf16-rounded activations), one engine each, every
engine and transformers alternating in each repetition.

Everything goes to --out/gpu_bench.json (written after every phase, so a run cut short
still leaves what it measured) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

SHAPE = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
             num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, head_dim=128)  # fmt: skip
FULL_LAYERS = 32


def log(msg: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Report:
    def __init__(self, out: Path):
        self.path = out / "gpu_bench.json"
        self.data: dict = {"tool": "tools/gpu_bench.py", "shape": dict(SHAPE), "phases": {}}

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2, default=str))


def bytes_per_layer(dtype_bytes: int = 2) -> dict:
    H, I, E = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_local_experts"]
    D, Hq, Hkv = SHAPE["head_dim"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    attn = H * Hq * D * 2 + H * Hkv * D * 2  # q, o; k, v
    norms_router = 2 * H + H * E
    expert = 3 * H * I
    return {"dense": (attn + norms_router) * dtype_bytes, "expert": expert * dtype_bytes}


def step_bytes(layers: int, batch: int) -> float:
    """Bytes one decode step must read: dense weights of every layer, the final norm, the LM
    head, one embedding row per token, and the routed experts the step touches."""
    b = bytes_per_layer()
    H, V, E, K = SHAPE["hidden_size"], SHAPE["vocab_size"], SHAPE["num_local_experts"], SHAPE["num_experts_per_tok"]
    # expected distinct experts per layer when batch tokens each pick K of E uniformly
    distinct = K if batch == 1 else E * (1 - (1 - K / E) ** batch)
    return layers * (b["dense"] + distinct * b["expert"]) + (H + V * H + batch * H) * 2


def pick_workdir(requested: str | None, need: int) -> Path:
    cands = [requested] if requested else ["/dev/shm", "/tmp"]
    for c in cands:
        try:
            free = shutil.disk_usage(c).free
        except OSError:
            continue
        if free > need:
            d = Path(c) / "colibri_gpu_bench"
            d.mkdir(parents=True, exist_ok=True)
            return d
    d = Path(cands[-1]) / "colibri_gpu_bench"
    d.mkdir(parents=True, exist_ok=True)
    return d


def device_bandwidth(torch, nbytes: int = 1 << 30, reps: int = 10) -> dict:
    """The device's memory bandwidth in B/s: `measured` (a device-to-device copy, bytes read
    plus written, median of `reps`) and `peak_reported` (2 x memory clock x bus width, from the
    device attributes, or None where the runtime does not say)."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    y = torch.empty_like(x)
    y.copy_(x)   # warm-up
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    del x, y
    out = {"measured": 2 * nbytes / median(times), "peak_reported": None, "copy_bytes": nbytes}
    try:   # cudaDevAttrMemoryClockRate = 36 (kHz), cudaDevAttrGlobalMemoryBusWidth = 37 (bits)
        import cupy

        clock = cupy.cuda.runtime.deviceGetAttribute(36, 0) * 1e3
        width = cupy.cuda.runtime.deviceGetAttribute(37, 0)
        out["peak_reported"] = 2 * clock * width / 8 if clock and width else None
    except Exception:
        props = torch.cuda.get_device_properties(0)
        clock_khz, width = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
        if clock_khz and width:
            out["peak_reported"] = 2 * clock_khz * 1e3 * width / 8
    return out


def median(xs):
    return float(statistics.median(xs)) if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="layers of the 32 to build (default 4, about 12 GB)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_bench_out"))
    ap.add_argument("--workdir", default=None, help="where the checkpoint and .colibri go (default /dev/shm)")
    ap.add_argument("--budget-s", type=float, default=240, help="skip the phases that would start after this")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--context", type=int, default=64, help="prompt tokens before the decode steps")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per measured run")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and .colibri file")
    ap.add_argument("--precisions", default="exact,fast", help="Colibri's numeric modes to measure")
    ap.add_argument("--profile", action="store_true", help="write the CUDA kernels' times (torch.profiler) to "
                    "--out/profile.txt")  # fmt: skip
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out)
    rep.data["settings"] = vars(a)

    def left() -> float:
        return a.budget_s - (time.monotonic() - t_start)

    import numpy as np
    import torch
    import transformers
    from transformers import MixtralConfig, MixtralForCausalLM

    import colibri_lab
    from colibri_lab import Engine

    rep.data["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "colibri_lib": str(colibri_lab.runtime._native.lib_path), "colibri": colibri_lab.native_version(),
                            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}  # fmt: skip
    if not torch.cuda.is_available():
        log("torch sees no CUDA device")
        rep.data["error"] = "no CUDA device"
        rep.save()
        return 1

    bw = device_bandwidth(torch)
    hbm_bps = bw["measured"]
    rep.data["device_bandwidth"] = bw
    log(f"device bandwidth: measured {bw['measured'] / 1e12:.2f} TB/s (copy), reported peak "
        + (f"{bw['peak_reported'] / 1e12:.2f} TB/s" if bw["peak_reported"] else "not reported"))
    rep.save()

    L = a.layers
    per_layer = bytes_per_layer()
    size = L * (per_layer["dense"] + SHAPE["num_local_experts"] * per_layer["expert"]) + 2 * 2 * 32000 * 4096
    work = pick_workdir(a.workdir, int(2.3 * size))
    rep.data["workdir"] = str(work)
    rep.data["model_bytes"] = size
    hf_dir, cb_path = work / f"mixtral-{L}l-hf", work / f"mixtral-{L}l-bf16.colibri"

    # ---- 1. the HF model, on the GPU, saved -------------------------------------------
    t = time.monotonic()
    cfg = MixtralConfig(**SHAPE, num_hidden_layers=L, max_position_embeddings=4096, rope_theta=1e6,
                        initializer_range=0.02, tie_word_embeddings=False, sliding_window=None)  # fmt: skip
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = MixtralForCausalLM(cfg)
    torch.set_default_dtype(prev)
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():  # RMSNorm weights away from 1, so a misplaced norm would show
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    torch.cuda.synchronize()
    t_build = time.monotonic() - t
    if not (cb_path.is_file() and a.keep):
        model.save_pretrained(hf_dir, max_shard_size="4GB")
    t_save = time.monotonic() - t - t_build
    log(f"built {L}-layer model on the GPU in {t_build:.1f} s, saved in {t_save:.1f} s ({size / 1e9:.1f} GB) to {hf_dir}")

    # ---- 2. convert ----------------------------------------------------------------------
    t = time.monotonic()
    if not (cb_path.is_file() and a.keep):
        colibri_lab.convert(hf_dir, cb_path, dtype="bf16", progress=False, tokenizer="none")
    t_conv = time.monotonic() - t
    if not a.keep:
        shutil.rmtree(hf_dir, ignore_errors=True)
    log(f"converted in {t_conv:.1f} s: {cb_path} ({cb_path.stat().st_size / 1e9:.1f} GB)")
    rep.data["phases"]["prepare"] = {"build_s": t_build, "save_s": t_save, "convert_s": t_conv}
    rep.save()

    # ---- 3. Colibri CUDA engine -----------------------------------------------------------
    max_len = max(a.prefill, a.context + a.steps * (a.reps + 1)) + 16
    precisions = [p for p in a.precisions.split(",") if p]
    engines = {}
    rep.data["colibri"] = {}
    for prec in precisions:
        t = time.monotonic()
        eng = Engine(cb_path, backend="cuda", max_seqs=a.batch, max_seq_len=max_len,
                     max_batch=max(a.prefill, a.batch), precision=prec)  # fmt: skip
        engines[prec] = eng
        c = eng.config
        t_load = time.monotonic() - t
        rep.data["colibri"][prec] = {"load_s": t_load, "backend_device": c.backend_device,
                                     "device_bytes": c.backend_device_bytes, "weight_bytes": c.backend_weight_bytes,
                                     "experts_resident": c.backend_experts_resident,
                                     "experts_host": c.backend_experts_host}  # fmt: skip
        log(f"Colibri ({prec}) loaded in {t_load:.1f} s on {c.backend_device}: {c.backend_device_bytes / 2**30:.1f} "
            f"GiB, {c.backend_experts_resident} experts resident, {c.backend_experts_host} on the host")
        rep.save()

    rng = np.random.default_rng(1)
    V = SHAPE["vocab_size"]

    def ids(n):
        return rng.integers(3, V, size=n).tolist()

    # Colibri measurements (forward returns the logits on the host: every step is synchronous)
    def cb_prefill(eng):
        p = ids(a.prefill)
        t0 = time.perf_counter()
        eng.forward(p, last_only=True)
        return a.prefill / (time.perf_counter() - t0)

    def cb_decode1(eng):
        eng.forward(ids(a.context), last_only=True)
        toks = ids(a.steps)
        t0 = time.perf_counter()
        for k, tok in enumerate(toks):
            eng.forward([tok], a.context + k)
        return a.steps / (time.perf_counter() - t0)

    def cb_decodeB(eng):
        B = a.batch
        for s in range(B):
            eng.sequence(s).clear()
        eng.batch([(s, ids(a.context)) for s in range(B)])
        t0 = time.perf_counter()
        for _ in range(a.steps):
            eng.batch([(s, ids(1)) for s in range(B)])
        return B * a.steps / (time.perf_counter() - t0)

    # transformers measurements
    def sync():
        torch.cuda.synchronize()

    def hf_prefill():
        x = torch.tensor([ids(a.prefill)], device="cuda")
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            model(x, use_cache=False, logits_to_keep=1)
        sync()
        return a.prefill / (time.perf_counter() - t0)

    def hf_decode(B):
        x = torch.tensor([ids(a.context) for _ in range(B)], device="cuda")
        with torch.no_grad():
            o = model(x, use_cache=True, logits_to_keep=1)
            past = o.past_key_values
            steps = [torch.tensor([ids(1) for _ in range(B)], device="cuda") for _ in range(a.steps)]
            sync()
            t0 = time.perf_counter()
            for s in steps:
                o = model(s, past_key_values=past, use_cache=True)
                past = o.past_key_values
            sync()
        return B * a.steps / (time.perf_counter() - t0)

    cases = {
        "decode_b1": (cb_decode1, lambda: hf_decode(1)),
        f"decode_b{a.batch}": (cb_decodeB, lambda: hf_decode(a.batch)),
        f"prefill_{a.prefill}": (cb_prefill, hf_prefill),
    }
    results = rep.data.setdefault("results", {})
    keys = [f"colibri_{p}" for p in precisions] + ["transformers"]
    for name, (cb_fn, hf_fn) in cases.items():
        if left() < 20:
            log(f"budget spent: {name} skipped")
            results[name] = {"skipped": "time budget"}
            continue
        fns = {f"colibri_{p}": (lambda fn=cb_fn, e=engines[p]: fn(e)) for p in precisions}
        fns["transformers"] = hf_fn
        r = {}
        for key in keys:
            r[key + "_tok_s"], r[key + "_errors"] = [], []
        for key in keys:  # warm-up (graph capture, cuBLAS)
            try:
                fns[key]()
            except Exception as e:  # noqa: BLE001 - a failing engine is reported, the others still measured
                r[key + "_errors"].append(f"warm-up: {type(e).__name__}: {e}")
        for i in range(a.reps):
            order = keys[i % len(keys):] + keys[:i % len(keys)]  # each engine first in turn
            for key in order:
                try:
                    r[key + "_tok_s"].append(fns[key]())
                except Exception as e:  # noqa: BLE001
                    r[key + "_errors"].append(f"{type(e).__name__}: {e}")
        for key in keys:
            r[key + "_median"] = median(r[key + "_tok_s"])
        for key in keys[:-1]:
            if r[key + "_median"] and r["transformers_median"]:
                r[f"ratio_{key}_over_transformers"] = r[key + "_median"] / r["transformers_median"]
        if name.startswith("prefill"):  # the weight products' rate (2 x active parameters a token)
            b = bytes_per_layer()
            flop = 2 * L * (b["dense"] / 2 + SHAPE["num_experts_per_tok"] * b["expert"] / 2)
            for key in keys:
                if r[key + "_median"]:
                    r[key + "_weight_tflop_s"] = r[key + "_median"] * flop / 1e12
        if name.startswith("decode"):
            B = 1 if name == "decode_b1" else a.batch
            nb = step_bytes(L, B)
            roof = B * hbm_bps / nb
            r["step_bytes"] = nb
            r["roofline_tok_s"] = roof
            for key in keys:
                if r[key + "_median"]:
                    r[key + "_roofline_share"] = r[key + "_median"] / roof
                    r[key + "_tok_s_32_layers_est"] = r[key + "_median"] * nb / step_bytes(FULL_LAYERS, B)
        results[name] = r
        log(f"{name}: " + ", ".join(f"{k} {r[k + '_median']}" for k in keys)
            + (f" tok/s; roofline {r['roofline_tok_s']:.1f} tok/s" if name.startswith("decode") else " tok/s"))
        for p in precisions:
            rep.data["colibri"][p]["backend_stats_after"] = engines[p].backend_stats()
        rep.save()

    # ---- 4. parity of the big shape --------------------------------------------------------
    if left() > 10:
        p = ids(48)
        with torch.no_grad():
            ref = model(torch.tensor([p], device="cuda")).logits[0, -1].float().cpu().numpy()
        top2 = np.sort(ref)[-2:]
        rng_ = float(ref.max() - ref.min())
        rep.data["parity"] = {}
        for prec in precisions:
            got = engines[prec].forward(p)[-1]
            engines[prec].sequence(0).clear()
            rep.data["parity"][prec] = {
                "top1_colibri": int(got.argmax()), "top1_transformers": int(ref.argmax()),
                "top1_equal": bool(got.argmax() == ref.argmax()), "transformers_top1_margin": float(top2[1] - top2[0]),
                "max_abs_delta": float(np.abs(got - ref).max()), "logit_range": rng_,
                "max_abs_delta_over_range": float(np.abs(got - ref).max()) / rng_ if rng_ else None,
                "note": "transformers bf16 activations vs Colibri's; a top-1 margin under the delta is a tie "
                        "either may break"}  # fmt: skip
            log(f"parity ({prec}): {rep.data['parity'][prec]}")
    # ---- 5. where the time goes: CUDA kernels of one prefill and 16 decode steps -------------
    if a.profile and left() > 15:
        prof_path = out / "profile.txt"
        with prof_path.open("w") as fh:
            for prec, eng in engines.items():
                for what, fn in ((f"prefill {a.prefill}", lambda: eng.forward(ids(a.prefill), last_only=True)),
                                 ("decode b1, 16 steps", lambda: [eng.forward([t], a.prefill + k)
                                                                   for k, t in enumerate(ids(16))])):  # fmt: skip
                    fn()
                    torch.cuda.synchronize()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        fn()
                        torch.cuda.synchronize()
                    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
                    fh.write(f"==== colibri {prec}: {what}\n{table}\n")
        log(f"kernel profile in {prof_path}")
    rep.data["elapsed_s"] = time.monotonic() - t_start
    rep.save()
    for eng in engines.values():
        eng.close()
    if not a.keep:
        cb_path.unlink(missing_ok=True)

    # the table
    print(f"\n{'case':<14} {'engine':<16} {'tok/s':>10} {'÷ transformers':>15} {'roof tok/s':>11} {'share':>7}")
    f = lambda v, w=10, p=1: f"{v:>{w}.{p}f}" if isinstance(v, float) else f"{'-':>{w}}"  # noqa: E731
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<14} skipped")
            continue
        for key in keys:
            print(f"{name:<14} {key:<16} {f(r[key + '_median'])} "
                  f"{f(r.get(f'ratio_{key}_over_transformers'), 15, 2)} {f(r.get('roofline_tok_s'), 11)} "
                  f"{f(r.get(key + '_roofline_share'), 7, 2)}")
    print(f"({L} of {FULL_LAYERS} layers; 32-layer decode estimates in {rep.path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
