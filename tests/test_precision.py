"""The fast numeric mode (Engine(precision="fast"), colibri_options.precision): chosen per
engine, reported by the engine, refused when unknown; and, like the exact mode,
deterministic and incremental == full, BIT FOR BIT, for BF16 files (bf16 activations), Q8_0
files and K-quant files (int8 activation blocks). The SIMD tables of the int8 path must give
the reference table's bits (cpu/fast.h). Fast mode's thread-count invariance is tested with
the exact mode's in tests/test_threads_kernels.py, its batch invariance in
tests/test_batch.py.

Files: data/tiny-mixtral in bf16 and q8_0 (trained weights), and a random Mixtral 256 wide
with 8 experts in q4_k_m, so that its tensors really are Q4_K, Q5_K, Q6_K and Q8_0 (the tiny
model's rows, 96 and 192 wide, fall back to Q8_0 everywhere). Accuracy against the exact
mode is measured in tests/test_quality.py (precision_agreement).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri_lab
from colibri_lab import ColibriInvalidArgError, Engine
from colibri_lab.format import reader as fmt_reader
from colibri_lab.runtime.engine import PRECISIONS

REPO = Path(__file__).resolve().parents[1]

# A prompt of real text (the tiny model's held-out kind: Python source) and random ids.
TEXT = "import heapq\n\ndef merge(*iterables, key=None):\n    h = []\n    for it in map(iter, iterables):\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory, make_model):
    d = tmp_path_factory.mktemp("precision")
    out = {dt: colibri_lab.convert(REPO / "data" / "tiny-mixtral", d / f"tiny-{dt}.colibri", dtype=dt,
                                   progress=False) for dt in ("f32", "bf16", "q8_0")}
    out["q4_k_m"] = make_model(vocab=1024, hidden=256, inter=256, experts=8, top_k=2, heads=4, kv_heads=2,
                               seed=3, dtype="q4_k_m")[1]
    # gpt-oss (attention sinks, windows of 6 under prompts of up to 48) with heads of 16: the
    # attention of the fast tables that have their own (", attention " in config.kernels)
    from colibri_lab.bench.models import FamilyShape, build_model
    go = d / "hf-gpt-oss"
    build_model(FamilyShape("gpt_oss", vocab=301, hidden=64, inter=32, layers=2, heads=4, kv_heads=2,
                                   head_dim=16, experts=4, top_k=2, sliding_window=6, seed=31)).save_pretrained(go)
    out["gptoss_bf16"] = colibri_lab.convert(go, d / "gpt-oss-bf16.colibri", dtype="bf16", progress=False)
    out["gptoss_f32"] = colibri_lab.convert(go, d / "gpt-oss-f32.colibri", dtype="f32", progress=False)
    return out


def _ids(path, n, seed=0):
    with Engine(path, max_seq_len=16) as eng:
        if eng._has_tokenizer():
            ids = eng.tokenizer.encode(TEXT * 4)[:n]
        else:
            ids = [1]
        rng = np.random.default_rng(seed)
        more = rng.integers(3, eng.vocab_size, size=max(n - len(ids), 0))
    return np.concatenate([np.asarray(ids, np.int32), more.astype(np.int32)])[:n]


def test_the_q4_k_m_file_holds_k_quants(files):
    """Otherwise the K-quant fast path would go untested."""
    dtypes = {t.dtype for t in fmt_reader.inspect(files["q4_k_m"]).tensors}
    assert {"q4_k", "q5_k", "q6_k", "q8_0"} <= dtypes, dtypes


@pytest.mark.parametrize("bad", ["turbo", "FAST", "", None, 1, "exact "])
def test_unknown_precision_is_refused(files, bad):
    with pytest.raises(ColibriInvalidArgError, match="precision"):
        Engine(files["q8_0"], precision=bad)


def test_the_engine_reports_its_mode(files):
    assert PRECISIONS == ("exact", "fast")
    with Engine(files["q8_0"]) as ex, Engine(files["q8_0"], precision="fast") as fa:
        assert ex.config.precision == "exact" and "fast(" not in ex.config.kernels
        assert fa.config.precision == "fast"
        assert fa.config.kernels.startswith(ex.config.kernels + " fast(int8 "), fa.config.kernels


def test_fast_attention_is_reported(files):
    """The fast tables with an attention of their own (x86, native BF16 kernels) say so in
    config.kernels and run it where the head size is a multiple of 16 and the attention's
    projections are a type fast mode computes: the gpt-oss model here in bf16 (heads of 16),
    not the tiny model (24), not the same gpt-oss model in f32 (which computes the same bits
    in both modes), never in exact mode."""
    with (Engine(files["gptoss_bf16"], precision="fast") as go, Engine(files["bf16"], precision="fast") as tiny,
          Engine(files["gptoss_bf16"]) as ex, Engine(files["gptoss_f32"], precision="fast") as f32):
        for e in (tiny, ex, f32):
            assert ", attention " not in e.config.kernels, e.config.kernels
        if "bf16 avx512bf16" in go.config.kernels or "bf16 amx" in go.config.kernels:
            assert go.config.kernels.endswith(", attention avx512)"), go.config.kernels
        else:
            assert ", attention " not in go.config.kernels, go.config.kernels
        ids = _ids(files["gptoss_f32"], 40, seed=5)
    with (Engine(files["gptoss_f32"], precision="exact") as ex32,
          Engine(files["gptoss_f32"], precision="fast") as fa32):
        assert np.array_equal(ex32.forward(ids), fa32.forward(ids))


@pytest.mark.parametrize("dtype", ["bf16", "q8_0", "q4_k_m"])
def test_fast_is_another_computation_close_to_exact(files, dtype):
    """Fast mode changes the bits of a BF16 or block-type file (it is not silently the exact
    path) but stays close on the trained model (the random q4_k_m model's near-uniform
    routers turn a rounding into another expert now and then: there only "differs" is
    checked); an f32 file has no matmul input to round and computes the same."""
    ids = _ids(files[dtype], 40)
    with Engine(files[dtype], num_threads=2, precision="exact") as ex:
        a = ex.forward(ids)
    with Engine(files[dtype], num_threads=2, precision="fast") as fa:
        b = fa.forward(ids)
    assert not np.array_equal(a, b)
    if dtype != "q4_k_m":
        assert np.abs(a - b).max() < 0.05 * np.abs(a).max(), np.abs(a - b).max()
        assert (a.argmax(axis=1) == b.argmax(axis=1)).mean() >= 0.95
    ids = _ids(files["f32"], 40)
    with Engine(files["f32"], precision="exact") as ex, Engine(files["f32"], precision="fast") as fa:
        assert np.array_equal(ex.forward(ids), fa.forward(ids))


@pytest.mark.parametrize("dtype", ["bf16", "q8_0", "q4_k_m", "gptoss_bf16"])
def test_fast_is_deterministic(files, dtype):
    """The same logits from one engine twice and from a second engine."""
    ids = _ids(files[dtype], 48, seed=1)
    runs = []
    for _ in range(2):
        with Engine(files[dtype], num_threads=2, precision="fast") as eng:
            runs.append(eng.forward(ids))
            runs.append(eng.forward(ids))   # the same context again, its KV cache rewritten
    for r in runs[1:]:
        assert np.array_equal(r, runs[0])


@pytest.mark.parametrize("dtype", ["bf16", "q8_0", "q4_k_m", "gptoss_bf16"])
def test_fast_incremental_equals_full(files, dtype):
    """Decoding token by token, and a prefill cut into chunks, give the rows of one forward
    over the whole prompt, bit for bit (each token's activations are quantized on their
    own, and every dot product is one chain in a fixed order)."""
    ids = _ids(files[dtype], 33, seed=2)
    with Engine(files[dtype], num_threads=2, precision="fast", max_batch=8) as eng:
        full = eng.forward(ids)
        steps = np.concatenate([eng.forward(ids[i:i + 1], start_pos=i) for i in range(len(ids))])
        chunks = np.concatenate([eng.forward(ids[:5]), eng.forward(ids[5:21], start_pos=5),
                                 eng.forward(ids[21:], start_pos=21)])
        last = eng.forward(ids, last_only=True)
    assert np.array_equal(steps, full)
    assert np.array_equal(chunks, full)
    assert np.array_equal(last[0], full[-1])


def _populated_equals_lazy(path, ids, start, check_kernels, **opts):
    """A populated engine (with the copies its table reads) and a lazily mapped one
    (populate=False: none) give the same bits: the prompt's prefill and the decode steps from
    `start`, each step also equal to the prefill's row; check_kernels(config.kernels, populate)
    asserts what each says it runs."""
    out = {}
    for populate in (True, False):
        with Engine(path, num_threads=2, populate=populate, **opts) as eng:
            check_kernels(eng.config.kernels, populate)
            full = eng.forward(ids)
            steps = np.concatenate([eng.forward(ids[i:i + 1], start_pos=i) for i in range(start, len(ids))])
            out[populate] = (full, steps)
    for k, (full, steps) in out.items():
        assert np.array_equal(full, out[False][0]), k
        assert np.array_equal(steps, out[False][1]), k
        assert np.array_equal(steps, full[start:]), k


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("dtype", ["bf16", "gptoss_bf16"])
def test_panel_copies_give_the_same_bits(files, dtype, precision):
    """A table that reads a panel layout (cpu/panel.h: fast mode's avx512bf16 table, exact
    mode's avx512 table) gets a copy of the BF16 weights in it at load when the weights are
    populated ("panels" in config.kernels), and computes the row-major kernels' bits with it:
    prefill and decode steps equal an engine that maps the file lazily (populate=False: no
    copy)."""
    def check(kernels, populate):
        if precision == "fast":
            reads = "bf16 avx512bf16" in kernels
            assert (" panels" in kernels) == (populate and reads), kernels
            if populate and reads:
                assert "bf16 avx512bf16 panels" in kernels, kernels
        else:
            reads = kernels.split()[0] == "avx512"
            assert kernels == ("avx512 panels" if populate and reads else kernels.split()[0]), kernels

    _populated_equals_lazy(files[dtype], _ids(files[dtype], 37, seed=6), 20, check, precision=precision)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_k_m"])
def test_interleaved_int8_copies_give_the_same_bits(files, dtype):
    """A fast table that reads interleaved copies of block-type weights (cpu/qpanel.h: the
    x86 tables) gets them at load when the weights are populated ("int8 <table>
    panels" in config.kernels); prefill, chunked prefill (max_batch 16) and decode steps then
    equal an engine that maps the file lazily (populate=False: no copy) bit for bit. The
    q4_k_m file holds Q4_K, Q5_K, Q6_K and Q8_0 matrices (routed experts, attention, LM head)."""
    def check(kernels, populate):
        table = kernels.split("fast(int8 ")[1].split(",")[0].split()[0]
        reads = table in ("avx2", "avxvnni", "avx512vnni")
        assert (f"int8 {table} panels," in kernels) == (populate and reads), kernels

    _populated_equals_lazy(files[dtype], _ids(files[dtype], 41, seed=8), 24, check, precision="fast", max_batch=16)


_TABLE_SCRIPT = """
import json, sys
import numpy as np
from colibri_lab import Engine
path, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
with Engine(path, num_threads=2, precision="fast") as eng:
    np.save(out, eng.forward(np.asarray(ids, np.int32)))
    print(eng.config.kernels)
"""


@pytest.mark.parametrize("dtype", ["q8_0", "q4_k_m"])
def test_every_int8_table_gives_the_reference_bits(files, dtype, tmp_path):
    """The fast tables this CPU runs ($COLIBRI_FAST_KERNELS picks one; cpu/fast.c) compute
    the int8 path's logits bit for bit as the reference table does, over a whole forward of
    40 tokens (matmuls, the fused gate/up with its SiLU, the LM head)."""
    ids = _ids(files[dtype], 40, seed=4).tolist()
    got = {}
    for name in ("reference", "avx2", "avxvnni", "avx512vnni"):
        npy = tmp_path / f"{name}.npy"
        r = subprocess.run([sys.executable, "-c", _TABLE_SCRIPT, str(files[dtype]), json.dumps(ids), str(npy)],
                           env={**os.environ, "COLIBRI_FAST_KERNELS": name}, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        kernels = r.stdout.strip()
        if f"fast(int8 {name}," in kernels or f"fast(int8 {name} panels," in kernels:  # else this CPU lacks it
            got[name] = np.load(npy)
    assert "reference" in got
    for name, lg in got.items():
        assert np.array_equal(lg, got["reference"]), (
            f"fast table {name} differs from the reference: max |diff| {np.abs(lg - got['reference']).max():g}")
