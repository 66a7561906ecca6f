"""The converter streams: its peak RSS stays near a few conversion chunks plus one expert
matrix, not the model size and not even the largest tensor.

A synthetic Mixtral checkpoint (f32, about 250 MB; the slow variant about 1 GB) is
written with numpy straight into a safetensors file, one tensor at a time. The
conversion runs in a child process that reports its own peak RSS
(VmHWM from /proc/self/status, see CHILD); a baseline child only imports the converter. The difference must stay under a bound that does not grow with the model.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss units are Linux's")

# ~250 MB f32: embedding / lm_head 32000 x 384 (49 MB each, the largest tensors),
# 4 layers x 8 experts x 3 x (1024 x 384).
SMALL = dict(vocab=32000, hidden=384, inter=1024, layers=4, experts=8, heads=6, kv_heads=2)
# ~1.1 GB f32: embedding 32000 x 1024 (131 MB), 4 layers x 8 experts x 3 x (1792 x 1024)
LARGE = dict(vocab=32000, hidden=1024, inter=1792, layers=4, experts=8, heads=8, kv_heads=2)


def write_synthetic_mixtral(folder: Path, vocab, hidden, inter, layers, experts, heads,
                            kv_heads, seed=0) -> tuple[int, int]:
    """config.json + model.safetensors (f32), written tensor by tensor.
    Returns (total tensor bytes, largest tensor bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    hd = hidden // heads
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
           "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": hd, "num_local_experts": experts,
           "num_experts_per_tok": 2, "max_position_embeddings": 4096,
           "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
           "rms_norm_eps": 1e-5, "hidden_act": "silu", "sliding_window": None,
           "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(cfg))
    shapes = [("model.embed_tokens.weight", (vocab, hidden)), ("model.norm.weight", (hidden,)),
              ("lm_head.weight", (vocab, hidden))]
    for n in range(layers):
        p = f"model.layers.{n}"
        shapes += [(f"{p}.input_layernorm.weight", (hidden,)),
                   (f"{p}.post_attention_layernorm.weight", (hidden,)),
                   (f"{p}.self_attn.q_proj.weight", (heads * hd, hidden)),
                   (f"{p}.self_attn.k_proj.weight", (kv_heads * hd, hidden)),
                   (f"{p}.self_attn.v_proj.weight", (kv_heads * hd, hidden)),
                   (f"{p}.self_attn.o_proj.weight", (hidden, heads * hd)),
                   (f"{p}.block_sparse_moe.gate.weight", (experts, hidden))]
        for e in range(experts):
            q = f"{p}.block_sparse_moe.experts.{e}"
            shapes += [(f"{q}.w1.weight", (inter, hidden)), (f"{q}.w2.weight", (hidden, inter)),
                       (f"{q}.w3.weight", (inter, hidden))]
    header, off = {}, 0
    for name, shape in shapes:
        nb = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    hj = json.dumps(header).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    rng = np.random.default_rng(seed)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj)
        for name, shape in shapes:
            a = rng.standard_normal(shape, dtype=np.float32)
            a *= np.float32(0.02)
            f.write(a.tobytes())
            del a
    return off, max(int(np.prod(s)) * 4 for _, s in shapes)


# The child reports VmHWM (peak RSS of its own address space, kB). getrusage's ru_maxrss
# is not usable here: Linux carries the pre-exec high-water mark across execve, so a child
# spawned by a pytest process that has torch loaded starts with the parent's ~160 MB.
CHILD = textwrap.dedent("""
    import sys
    from colibri_lab.conversion.hf import convert
    if sys.argv[1] != "-":
        convert(sys.argv[1], sys.argv[2], dtype=sys.argv[3], progress=False)
    with open("/proc/self/status") as f:
        print(next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")))
""")


def child_peak_kb(*args: str) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    r = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True,
                       env=env, timeout=1800)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().splitlines()[-1])


def measure(tmp_path: Path, shape: dict, dtype: str):
    hf = tmp_path / "hf"
    total, largest = write_synthetic_mixtral(hf, **shape)
    out = tmp_path / "m.colibri"
    base = child_peak_kb("-")
    peak = child_peak_kb(str(hf), str(out), dtype)
    delta = (peak - base) * 1024
    print(f"\nmodel {total / MB:.0f} MiB f32 -> {dtype} {out.stat().st_size / MB:.0f} MiB; "
          f"largest tensor {largest / MB:.1f} MiB; baseline RSS {base / 1024:.0f} MiB; "
          f"peak RSS {peak / 1024:.0f} MiB; converter's own {delta / MB:.1f} MiB")
    return total, largest, delta, out


def check_output(out: Path, shape: dict, dtype: str):
    from colibri_lab.format.reader import inspect

    info = inspect(out)
    assert info.header["vocab_size"] == shape["vocab"]
    assert info.tensor("blk.0.ffn_experts").shape == (shape["experts"], 3 * shape["inter"],
                                                       shape["hidden"])
    assert info.metadata["model.weight_dtype"] == dtype


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_peak_rss_is_bounded(tmp_path, dtype):
    total, largest, delta, out = measure(tmp_path, SMALL, dtype)
    assert total > 200 * MB
    # The bound: one expert's down projection (read whole for the transpose) plus a few
    # conversion chunks and allocator slack; it does not grow with the model's size.
    # Measured: about 25-35 MiB here, against a 49 MiB largest tensor and a 250 MB model.
    assert delta <= largest + 32 * MB, f"converter used {delta / MB:.0f} MiB"
    assert delta <= 3 * largest + 64 * MB
    check_output(out, SMALL, dtype)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("COLIBRI_SLOW"), reason="set COLIBRI_SLOW=1 (1 GB model)")
def test_peak_rss_is_bounded_1gb(tmp_path):
    total, largest, delta, out = measure(tmp_path, LARGE, "bf16")
    assert total > 900 * MB
    assert delta <= largest + 32 * MB, f"converter used {delta / MB:.0f} MiB"
    check_output(out, LARGE, "bf16")
