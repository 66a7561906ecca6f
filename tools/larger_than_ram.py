"""A model larger than memory, by hand (not in CI): Colibri's expert cache against plain mmap
(Colibri's and llama.cpp's) on a random Mixtral-shaped bf16 model about twice the memory
the run is given.

The memory limit is a cgroup (v1 ``memory`` controller, as root): ``memory.limit_in_bytes``
counts the page cache a process brings in, so a file mapped inside the group is evicted and
faulted again exactly as on a machine with that much RAM. Each run starts with the page
cache dropped (``/proc/sys/vm/drop_caches``).

    python tools/larger_than_ram.py make   DIR            # checkpoint + .colibri + GGUF
    python tools/larger_than_ram.py disk   DIR            # the disk's sequential read (O_DIRECT)
    python tools/larger_than_ram.py bench  DIR --limit-gib 8 --cache-mib 6400 --tokens 12
    python tools/larger_than_ram.py one    FILE [--cache-mib N --policy P]   # one run, JSON

``bench`` prints one table: decode tok/s and hit rates for each policy, plain mmap, and
llama.cpp's llama-bench on the same weights, plus the simulator's hit rate on the cached
runs' own routing traces (colibri_lab.analysis.cachesim) and the disk roofline (missed expert bytes
per token / the disk's read bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CGROUP = Path("/sys/fs/cgroup/memory/colibri_larger_than_ram")

#: The shape: Mixtral's proportions at hidden 2048 (each expert 69 MB in bf16), 24 layers of
#: 8 experts, top-2: 14.1 GB, of which 13.3 GB routed experts.
SHAPE = dict(hidden=2048, inter=5632, layers=24, experts=8, top_k=2, heads=16, kv_heads=4, vocab=32000)


def _config(s: dict) -> dict:
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": s["hidden"],
        "intermediate_size": s["inter"], "num_hidden_layers": s["layers"], "num_local_experts": s["experts"],
        "num_experts_per_tok": s["top_k"], "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
        "head_dim": s["hidden"] // s["heads"], "vocab_size": s["vocab"], "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "sliding_window": None, "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }  # fmt: skip


def _tensors(s: dict):
    """(name, shape, std) of every tensor, in the file's order."""
    H, I, E, V = s["hidden"], s["inter"], s["experts"], s["vocab"]
    D = H // s["heads"]
    out = [("model.embed_tokens.weight", (V, H), 0.02)]
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (H,), 0.0), (p + "post_attention_layernorm.weight", (H,), 0.0),
                (p + "self_attn.q_proj.weight", (s["heads"] * D, H), 0.02),
                (p + "self_attn.k_proj.weight", (s["kv_heads"] * D, H), 0.02),
                (p + "self_attn.v_proj.weight", (s["kv_heads"] * D, H), 0.02),
                (p + "self_attn.o_proj.weight", (H, s["heads"] * D), 0.02),
                (p + "block_sparse_moe.gate.weight", (E, H), 0.5)]  # fmt: skip
        for e in range(E):
            q = f"{p}block_sparse_moe.experts.{e}."
            out += [(q + "w1.weight", (I, H), 0.02), (q + "w2.weight", (H, I), 0.02), (q + "w3.weight", (I, H), 0.02)]
    out += [("model.norm.weight", (H,), 0.0), ("lm_head.weight", (V, H), 0.02)]
    return out


def _bf16(x: np.ndarray) -> bytes:
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def make_checkpoint(folder: Path, s: dict = SHAPE, seed: int = 0) -> None:
    """A safetensors checkpoint written tensor by tensor (never all in memory): norms are 1,
    the other weights normal with the std above, each expert's matrices drawn from a pool of
    random blocks (distinct per tensor by a rotation), so making 14 GB takes a minute."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(_config(s), indent=2))
    for f in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(REPO / "data" / "tiny-mixtral" / f, folder / f)
    rng = np.random.default_rng(seed)
    names = _tensors(s)
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in names:
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    pool = [_bf16(rng.standard_normal(s["inter"] * s["hidden"], np.float32) * 0.02) for _ in range(4)]
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for i, (name, shape, std) in enumerate(names):
            n = int(np.prod(shape))
            if ".experts." in name:
                b = pool[i % 4]
                r = (i * 7919 * 2) % len(b)
                f.write(b[r:] + b[:r])
            elif std == 0.0:
                f.write(_bf16(np.ones(n, np.float32)))
            else:
                f.write(_bf16(rng.standard_normal(n, np.float32) * std))
    print(f"checkpoint: {folder} ({off / 1e9:.1f} GB of weights)")


def cmd_make(a) -> None:
    d = Path(a.dir)
    ck = d / "hf"
    if not (ck / "model.safetensors").is_file():
        make_checkpoint(ck)
    import colibri_lab

    col = d / "model-bf16.colibri"
    if not col.is_file():
        t = time.time()
        colibri_lab.convert(ck, col, dtype="bf16", progress=False)
        print(f"converted: {col} ({col.stat().st_size / 1e9:.1f} GB, {time.time() - t:.0f} s)")
    from colibri_lab.bench.llama_cpp import ensure_llama_cpp, gguf_file

    src = ensure_llama_cpp(Path("~/.cache/colibri-lab/llama.cpp"), True)
    g = gguf_file(src, ck, "bf16", d)
    print(f"gguf: {g} ({g.stat().st_size / 1e9:.1f} GB)")


def disk_bandwidth(path: Path, nbytes: int = 4 << 30, block: int = 64 << 20, readers: int = 1) -> float:
    """GB/s of `readers` threads each reading its own contiguous part of the first `nbytes`
    of `path` with O_DIRECT reads of `block` bytes (the expert cache's I/O threads read
    whole experts, 69 MB here, four at a time)."""
    import mmap
    import threading

    part = nbytes // readers // block * block
    done = [0] * readers

    def read(i):
        buf = mmap.mmap(-1, block)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            off = i * part
            while done[i] < part:
                n = os.preadv(fd, [buf], off + done[i])
                if n <= 0:
                    break
                done[i] += n
        finally:
            os.close(fd)

    subprocess.run(["sync"], check=True)
    t = time.perf_counter()
    th = [threading.Thread(target=read, args=(i,)) for i in range(readers)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    return sum(done) / (time.perf_counter() - t) / 1e9


def cmd_disk(a) -> None:
    f = Path(a.dir) / "model-bf16.colibri"
    print(json.dumps({"disk_read_gbs_1": round(disk_bandwidth(f), 3),
                      "disk_read_gbs_4": round(disk_bandwidth(f, readers=4), 3), "file": str(f)}))


def cmd_one(a) -> None:
    """One decode run in this process (bench runs it inside the cgroup): JSON on stdout."""
    from colibri_lab import Engine

    kw = {}
    if a.cache_mib:
        kw = {"expert_cache_mb": a.cache_mib, "expert_cache_policy": a.policy}
    t0 = time.perf_counter()
    eng = Engine(a.file, num_threads=a.threads, max_seq_len=512, **kw)
    load_s = time.perf_counter() - t0
    if a.policy == "pinned" and a.cache_mib and a.pinned:
        pins = np.load(a.pinned)
        for layer in range(pins.shape[0]):
            eng.pin_experts(layer, [int(e) for e in pins[layer] if e >= 0])
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, eng.vocab_size, size=a.prompt).astype(np.int32)
    with eng.trace(capacity=a.prompt + a.tokens + 1) as tr:
        for i, t in enumerate(prompt):  # one step per token: the simulator's steps exactly
            lg = eng.forward([int(t)], start_pos=i)
        tok, times = int(np.argmax(lg[-1])), []
        for i in range(a.tokens):
            t = time.perf_counter()
            lg = eng.forward([tok], start_pos=a.prompt + i)
            times.append(time.perf_counter() - t)
            tok = int(np.argmax(lg[-1]))
    st = eng.expert_cache_stats()
    out = {"load_s": load_s, "decode_tok_s": 1.0 / float(np.median(times)), "step_s": times,
           "slots": eng.config.expert_cache_slots, "policy": eng.config.expert_cache_policy,
           "direct": eng.config.expert_cache_direct, "slot_bytes": eng.config.expert_cache_slot_bytes,
           "last_token": tok}  # fmt: skip
    out["cache"] = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in st.items()}
    eng.close()
    if a.trace_out:
        tr.save(a.trace_out)
    print(json.dumps(out))


def _in_cgroup(argv: list[str], limit: int) -> subprocess.CompletedProcess:
    """Run argv inside the memory cgroup (created with `limit` bytes), page cache dropped first."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(limit))
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3")
    wrapped = ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh", *argv]
    return subprocess.run(wrapped, capture_output=True, text=True, timeout=3600)


def cmd_bench(a) -> None:
    d = Path(a.dir)
    col, ck = d / "model-bf16.colibri", d / "hf"
    limit = int(a.limit_gib * (1 << 30))
    rows = []
    disk1 = disk_bandwidth(col)
    disk = disk_bandwidth(col, readers=4)
    print(f"disk: {disk1:.2f} GB/s sequential O_DIRECT read by one reader, {disk:.2f} GB/s by four (the cache's "
          f"I/O threads; the roofline uses it); file {col.stat().st_size / 1e9:.1f} GB; memory limit "
          f"{a.limit_gib} GiB (cgroup)", flush=True)
    from colibri_lab import cachesim
    from colibri_lab.runtime.trace import Trace

    def one(label, extra):
        trace = d / f"trace-{label}.npz"
        r = _in_cgroup([sys.executable, __file__, "one", str(col), "--tokens", str(a.tokens), "--prompt",
                        str(a.prompt), "--threads", str(a.threads), "--trace-out", str(trace), *extra], limit)
        if r.returncode != 0:
            print(f"{label}: failed: {r.stderr.strip().splitlines()[-3:]}", flush=True)
            return None
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["label"], res["trace"] = label, trace
        rows.append(res)
        print(f"{label}: {res['decode_tok_s']:.3f} tok/s", flush=True)
        return res

    one("mmap", [])
    pinned = d / "pinned.npy"
    for pol in a.policies.split(","):
        extra = ["--cache-mib", str(a.cache_mib), "--policy", pol]
        if pol == "pinned":
            # the pinned set: each layer's most used experts in the mmap run's routing trace
            tr = Trace.load(d / "trace-mmap.npz")
            P = max(1, rows[-1]["slots"] // 2) if rows and rows[-1].get("slots") else 2
            pins = np.full((tr.n_layers, P), -1, np.int32)
            for layer in tr.moe_layers:
                cnt = np.bincount(tr.topk_ids[layer].ravel(), minlength=tr.n_experts)
                pins[layer] = np.argsort(-cnt, kind="stable")[:P]
            np.save(pinned, pins)
            extra += ["--pinned", str(pinned)]
        one(pol, extra)
    # llama.cpp: llama-bench's decode (tg) on the same weights, mmap, same cgroup
    from colibri_lab.bench.llama_cpp import _llama_bin, ensure_llama_cpp, gguf_file

    src = ensure_llama_cpp(Path("~/.cache/colibri-lab/llama.cpp"), False)
    g = gguf_file(src, ck, "bf16", d)
    r = _in_cgroup([str(_llama_bin(src, "llama-bench")), "-m", str(g), "-t", str(a.threads), "-r", "1", "-o", "json",
                    "-p", "0", "-n", str(a.tokens), "-d", str(a.prompt)], limit)
    llama = json.loads(r.stdout)[0]["avg_ts"] if r.returncode == 0 else None
    print(f"llama.cpp mmap: {llama} tok/s" if llama else f"llama.cpp failed: {r.stderr[-300:]}", flush=True)

    # the table; memory bandwidth for the simulator's tok/s model: the C streaming read
    from colibri_lab.bench.tuning import file_active_bytes, measure_read_bandwidth

    mem_bw = float(measure_read_bandwidth(threads=a.threads, nbytes=1 << 30, reps=3, variants=("plain",))["gbs"]) * 1e9
    active = file_active_bytes(col)
    expert_bytes = next((x["slot_bytes"] for x in rows if x.get("slot_bytes")), 0)
    base = rows[0]["decode_tok_s"] if rows else float("nan")
    print(f"memory read bandwidth {mem_bw / 1e9:.1f} GB/s; active bytes per token {active['bytes_per_token'] / 1e9:.2f} GB")
    print("\n| run | decode tok/s | x mmap | hit rate, all steps: engine | simulator | Belady | decode hit rate "
          "| read MB per decode token | disk roofline tok/s | simulator-predicted tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    P = a.prompt
    for x in rows:
        cells = ["", "", "", "", "", "", ""]
        if x.get("slots"):
            tr = Trace.load(x["trace"])
            c = x["cache"]
            kw = {"pinned": np.load(pinned)} if x["policy"] == "pinned" else {}
            full = cachesim.simulate(tr, x["slots"], x["policy"], **kw)
            # the prompt's steps alone (the same cache from the start): decode = full - prompt
            pre = cachesim.simulate(tr.topk_ids[:, :P], x["slots"], x["policy"], predicted=tr.predicted_ids[:, :P],
                                    **kw)
            eng_hits, eng_miss = int(np.sum(c["layer_hits"])), int(np.sum(c["layer_misses"]))
            d_hits = int(full.hits.sum() - pre.hits.sum())
            d_miss = int(full.misses.sum() - pre.misses.sum())
            d_reads = d_miss + int(full.prefetches.sum() - pre.prefetches.sum())
            n_dec = tr.n_tokens - P
            read_b = d_reads * expert_bytes / n_dec
            t_model = read_b / (disk * 1e9) + active["bytes_per_token"] / mem_bw
            cells = [f"{eng_hits / max(1, eng_hits + eng_miss):.3f}", f"{full.hit_rate:.3f}",
                     f"{cachesim.simulate(tr, x['slots'], 'belady').hit_rate:.3f}",
                     f"{d_hits / max(1, d_hits + d_miss):.3f}", f"{read_b / 1e6:.0f}",
                     f"{disk * 1e9 / max(1.0, read_b):.2f}", f"{1.0 / t_model:.2f}"]
        print(f"| {x['label']} | {x['decode_tok_s']:.3f} | {x['decode_tok_s'] / base:.2f} | " + " | ".join(cells) + " |")
        x["table"] = dict(zip(("hit_rate", "sim_hit_rate", "belady", "decode_hit_rate", "read_mb_per_token",
                               "disk_roofline_tok_s", "sim_predicted_tok_s"), cells))
    if llama:
        print(f"| llama.cpp (mmap) | {llama:.3f} | {llama / base:.2f} |" + " |" * 7)
    with open(d / "bench.json", "w") as f:
        json.dump({"disk_gbs": disk, "disk_gbs_one_reader": disk1, "mem_gbs": mem_bw / 1e9,
                   "machine": __import__("colibri_lab.bench.tuning", fromlist=["machine_info"]).machine_info(),
                   "limit_gib": a.limit_gib, "cache_mib": a.cache_mib, "llama_tok_s": llama,
                   "rows": [{k: v for k, v in x.items() if k != "trace"} for x in rows]}, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m = sub.add_parser("disk")
    m.add_argument("dir")
    b = sub.add_parser("bench")
    b.add_argument("dir")
    b.add_argument("--limit-gib", type=float, default=8.0)
    b.add_argument("--cache-mib", type=int, default=6400)
    b.add_argument("--tokens", type=int, default=12)
    b.add_argument("--prompt", type=int, default=8)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--policies", default="lru,lfu,pinned,predict")
    o = sub.add_parser("one")
    o.add_argument("file")
    o.add_argument("--cache-mib", type=int, default=0)
    o.add_argument("--policy", default="lru")
    o.add_argument("--pinned")
    o.add_argument("--tokens", type=int, default=12)
    o.add_argument("--prompt", type=int, default=8)
    o.add_argument("--threads", type=int, default=2)
    o.add_argument("--trace-out")
    a = p.parse_args()
    {"make": cmd_make, "disk": cmd_disk, "bench": cmd_bench, "one": cmd_one}[a.cmd](a)


if __name__ == "__main__":
    main()
