"""The kernel tables and the thread pool change speed, never results.

- Any thread count gives bit-identical logits: the pool splits output rows/columns and
  every output element is summed in the same order whatever the split (docs/kernels.md).
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

from colibri_lab.bench.models import MixtralShape  # noqa: E402
from helpers import ModelCache, random_ids  # noqa: E402

SHAPES = {
    # Odd sizes everywhere (tails in every kernel), GQA 2, 6 experts top-2.
    "odd": MixtralShape(vocab=531, hidden=67, inter=45, layers=2, heads=4, kv_heads=2, head_dim=10,
                 experts=6, top_k=2, seed=21),
    # Sizes that split evenly into vector panels, so the full-panel paths run too.
    "even": MixtralShape(vocab=640, hidden=128, inter=96, layers=2, heads=4, kv_heads=1, experts=4,
                  top_k=2, seed=22),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ModelCache(tmp_path_factory, SHAPES)


@pytest.mark.parametrize("key", list(SHAPES))
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_thread_count_changes_no_bit(models, key, dtype):
    _, path = models(key, dtype)
    ids = random_ids(SHAPES[key].vocab, 37, seed=5)
    got = {}
    for n in (1, 2, 3):
        with colibri_lab.Engine(path, num_threads=n) as eng:
            assert eng.config.threads_used == n
            full = eng.forward(ids)
            # decode steps (one token: the row-split GEMV path) after a prefill
            eng.forward(ids[:30])
            steps = np.stack([eng.forward([t], start_pos=30 + i)[0] for i, t in enumerate(ids[30:])])
        got[n] = (full, steps)
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


@pytest.mark.parametrize("key", list(SHAPES))
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
