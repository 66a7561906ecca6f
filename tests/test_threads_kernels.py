"""The kernel tables and the thread pool change speed, never results.

- Any thread count gives bit-identical logits: the pool splits output rows/columns and
  every output element is summed in the same order whatever the split (docs/kernels.md).
  This is the one test of it for the fused forward (prefill and decode steps): f32, bf16,
  q8_0, q4_k_m, q5_1 and q2_k weights, exact and fast precision, a Mixtral of odd sizes (tails in every
  kernel) and of even ones (full vector panels), gpt-oss (fast mode's own attention) and a
  Qwen2-MoE with a shared expert and a dense layer. The batch API's is
  tests/test_batch.py's test_batch_invariance.
- threads_used reports the pool's real size.
- COLIBRI_KERNELS=ref forces the plain reference kernels, and the SIMD table the engine
  picks by default agrees with them within float reassociation (and with transformers,
  which the parity suites check with the default table).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri_lab  # noqa: E402

from colibri_lab.bench.models import FamilyShape, MixtralShape  # noqa: E402
from helpers import ModelCache, random_ids  # noqa: E402

SHAPES = {
    # Odd sizes everywhere (tails in every kernel), GQA 2, 6 experts top-2.
    "odd": MixtralShape(vocab=531, hidden=67, inter=45, layers=2, heads=4, kv_heads=2, head_dim=10,
                 experts=6, top_k=2, seed=21),
    # Sizes that split evenly into vector panels, so the full-panel paths run too (and whole
    # Q8_0 blocks).
    "even": MixtralShape(vocab=640, hidden=128, inter=96, layers=2, heads=4, kv_heads=1, experts=4,
                  top_k=2, seed=22),
    # 256 wide: q4_k_m stores Q4_K, Q5_K, Q6_K and Q8_0 tensors (narrower rows fall back to Q8_0)
    "kquant": MixtralShape(vocab=1024, hidden=256, inter=256, layers=2, heads=4, kv_heads=2, experts=8,
                    top_k=2, seed=3),
    # gpt-oss with heads of 16 (fast mode's attention where a table has one), sinks, windows of
    # 6 under the 37-token prompt
    "gptoss": FamilyShape("gpt_oss", vocab=301, hidden=64, inter=32, layers=2, heads=4, kv_heads=2,
                          head_dim=16, experts=4, top_k=2, sliding_window=6, seed=31),
    # a gated shared expert and a dense-MLP layer (layer 1)
    "qwen2": FamilyShape("qwen2_moe", vocab=301, hidden=48, inter=20, dense_inter=30, shared_inter=24,
                         layers=3, heads=4, kv_heads=2, experts=6, top_k=2, mlp_only_layers=(1,), seed=1),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ModelCache(tmp_path_factory, SHAPES)


@pytest.mark.parametrize("key, dtype, precision", [
    ("odd", "f32", "exact"), ("odd", "bf16", "exact"), ("even", "f32", "exact"), ("even", "bf16", "exact"),
    ("odd", "bf16", "fast"), ("even", "bf16", "fast"), ("even", "q8_0", "fast"), ("kquant", "q4_k_m", "fast"),
    ("even", "q5_1", "fast"), ("kquant", "q2_k", "fast"),
    ("gptoss", "bf16", "exact"), ("gptoss", "bf16", "fast"), ("qwen2", "f32", "exact"),
])  # fmt: skip
def test_thread_count_changes_no_bit(models, key, dtype, precision):
    _, path = models(key, dtype)
    if dtype == "q4_k_m":  # else the K-quant kernels would go untested
        from colibri_lab.format import reader

        assert {"q4_k", "q5_k", "q6_k"} <= {t.dtype for t in reader.inspect(path).tensors}
    if dtype == "q2_k":  # the int8 path's sub-blocks of 16 of the K types it adds
        from colibri_lab.format import reader

        assert {"q2_k", "q3_k"} <= {t.dtype for t in reader.inspect(path).tensors}
    ids = random_ids(SHAPES[key].vocab, 37, seed=5)
    got = {}
    for n in (1, 2, 3):
        with colibri_lab.Engine(path, num_threads=n, precision=precision) as eng:
            assert eng.config.threads_used == n and eng.config.precision == precision
            full = eng.forward(ids)
            # decode steps (one token: the row-split GEMV path) after a prefill
            eng.forward(ids[:30])
            steps = np.stack([eng.forward([t], start_pos=30 + i)[0] for i, t in enumerate(ids[30:])])
        got[n] = (full, steps)
    assert np.isfinite(got[1][0]).all()
    for n in (2, 3):
        assert np.array_equal(got[1][0], got[n][0]), f"prefill logits differ with {n} threads"
        assert np.array_equal(got[1][1], got[n][1]), f"decode logits differ with {n} threads"
    # decode equals the prefill's last rows bit for bit: a token's result does not depend
    # on the batch it is computed in
    assert np.array_equal(got[1][0][30:], got[1][1])


def test_default_threads_is_at_least_one(models):
    _, path = models("even")
    with colibri_lab.Engine(path) as eng:
        assert eng.config.threads_used >= 1


@pytest.mark.parametrize("key", ["odd", "even"])
def test_forced_reference_table_agrees(models, key, monkeypatch):
    _, path = models(key)
    ids = random_ids(SHAPES[key].vocab, 40, seed=6)
    with colibri_lab.Engine(path, num_threads=2) as eng:
        default_name = eng._get_string("kernels")
        fast = eng.forward(ids)
    monkeypatch.setenv("COLIBRI_KERNELS", "ref")
    with colibri_lab.Engine(path, num_threads=2) as eng:
        assert eng._get_string("kernels") == "reference"
        ref = eng.forward(ids)
    # the table, and " panels" where it reads panel copies of BF16 weights (cpu/panel.h)
    assert default_name.split()[0] in ("reference", "avx2", "avx512", "neon")
    assert float(np.max(np.abs(fast - ref))) <= 1e-4
    # an unknown name falls back to the best table instead of failing
    monkeypatch.setenv("COLIBRI_KERNELS", "no-such-table")
    with colibri_lab.Engine(path) as eng:
        assert eng._get_string("kernels") == default_name
