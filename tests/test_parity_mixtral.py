"""Parity of the Colibri engine with Hugging Face transformers (Mixtral family).

Correct means: logits within 1e-4 of transformers on the same weights, incremental
decoding equal to one full forward, greedy generation equal token for token.
"""

from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri_lab  # noqa: E402

from colibri_lab.bench.models import MixtralShape  # noqa: E402
from helpers import (  # noqa: E402
    ModelCache, check_bf16_checkpoint, compare_logits, hf_logits, random_ids,
)

TOL = 1e-4

SHAPES = {
    # GQA ratio 1, 4 experts top-1, odd vocab/intermediate, hidden not a multiple of 8.
    "gqa1-e4k1": MixtralShape(vocab=1003, hidden=90, inter=100, layers=2, heads=6, kv_heads=6, head_dim=16,
                       experts=4, top_k=1, seed=1),
    # GQA ratio 2, 16 experts top-3, explicit head_dim unrelated to hidden, all sizes odd.
    "gqa2-e16k3": MixtralShape(vocab=777, hidden=67, inter=45, layers=3, heads=4, kv_heads=2,
                        head_dim=10, experts=16, top_k=3, seed=2),
    # GQA ratio 4, 8 experts top-2, the real Mixtral vocabulary, odd intermediate.
    "gqa4-e8k2-v32000": MixtralShape(vocab=32000, hidden=96, inter=131, layers=2, heads=8,
                              kv_heads=2, head_dim=12, experts=8, top_k=2, seed=3),
    # Sliding-window attention shorter than the test sequences; tied embeddings.
    "window-tied": MixtralShape(vocab=515, hidden=48, inter=33, layers=2, heads=4, kv_heads=1,
                         experts=5, top_k=2, sliding_window=9, tie=True, seed=4),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ModelCache(tmp_path_factory, SHAPES)


def compare(ref, got, router_logits, top_k, what):
    return compare_logits(ref, got, router_logits, top_k, what, tol=TOL)


@pytest.mark.parametrize("key", list(SHAPES))
@pytest.mark.parametrize("seq_len", [1, 7, 64, 300])
def test_logits_f32(models, key, seq_len):
    model, path = models(key)
    shape = SHAPES[key]
    ids = random_ids(shape.vocab, seq_len, seed=seq_len)
    ref, router_logits = hf_logits(model, ids)
    # Logits of a meaningful size: a parity test on near-zero logits proves little.
    assert float(np.std(ref)) > 0.05
    with colibri_lab.Engine(path) as eng:
        got = eng.forward(ids)
    compare(ref, got, router_logits, shape.top_k, f"{key} seq {seq_len}")


@pytest.mark.parametrize("key", ["gqa2-e16k3", "gqa4-e8k2-v32000"])
def test_logits_bf16_checkpoint(models, key, tmp_path):
    """--dtype bf16 equals an f32 transformers model loaded from the bf16 checkpoint."""
    from transformers import MixtralForCausalLM

    def load(folder):
        ref = MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ref.set_experts_implementation("eager")
        return ref

    model, _ = models(key)
    shape = SHAPES[key]
    check_bf16_checkpoint(model, load, shape.vocab, shape.top_k, tmp_path, f"{key} bf16")


def test_logits_f16_weights(models):
    """--dtype f16 from an f32 checkpoint equals transformers with the matrices rounded
    to f16 (norm weights stay f32 in the file, as the format says)."""
    import copy

    key = "gqa1-e4k1"
    model, path = models(key, "f16")
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref_model.parameters():
            if p.ndim >= 2:
                p.copy_(p.half().float())
    ids = random_ids(SHAPES[key].vocab, 40, seed=6)
    ref, router_logits = hf_logits(ref_model, ids)
    with colibri_lab.Engine(path) as eng:
        got = eng.forward(ids)
    compare(ref, got, router_logits, SHAPES[key].top_k, f"{key} f16")


@pytest.mark.parametrize("key", ["gqa2-e16k3", "window-tied"])
def test_incremental_equals_full(models, key):
    model, path = models(key)
    ids = random_ids(SHAPES[key].vocab, 41, seed=7)
    with colibri_lab.Engine(path) as eng:
        full = eng.forward(ids)
        pieces = []
        cuts = [0, 1, 2, 9, 10, 25, 41]  # a first token alone, single steps, chunks
        for a, b in zip(cuts, cuts[1:]):
            pieces.append(eng.forward(ids[a:b], start_pos=a))
        inc = np.concatenate(pieces)
        # start_pos 0 starts over, whatever the cache holds.
        again = eng.forward(ids[:5])
    assert np.max(np.abs(full - inc)) <= 1e-5
    assert np.max(np.abs(full[:5] - again)) <= 1e-5


def test_prefill_in_chunks_equals_one_chunk(models):
    """An engine whose internal batch is smaller than the prompt gives the same logits."""
    _, path = models("gqa1-e4k1")
    ids = random_ids(SHAPES["gqa1-e4k1"].vocab, 100, seed=8)
    with colibri_lab.Engine(path) as eng:
        a = eng.forward(ids)
    with colibri_lab.Engine(path, max_batch=7) as eng:
        b = eng.forward(ids)
    assert np.max(np.abs(a - b)) <= 1e-5


@pytest.mark.parametrize("key", ["gqa4-e8k2-v32000", "window-tied"])
def test_greedy_generation_equals_transformers(models, key):
    model, path = models(key)
    shape = SHAPES[key]
    prompt = random_ids(shape.vocab, 12, seed=9)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    ref = out[0, len(prompt):].tolist()
    with colibri_lab.Engine(path) as eng:
        got = [t.id for t in eng.generate(prompt, max_new_tokens=32, stop_at_eos=False)]
    assert got == ref


def test_group_padding_does_not_change_logits(models):
    _, path = models("gqa2-e16k3")
    ids = random_ids(SHAPES["gqa2-e16k3"].vocab, 33, seed=10)
    with colibri_lab.Engine(path) as eng:
        a = eng.forward(ids)
    with colibri_lab.Engine(path, group_pad=8) as eng:
        b = eng.forward(ids)
    assert np.array_equal(a, b)


def test_int8_router_runs_and_mostly_agrees(models, tmp_path):
    """The int8 router is lossy by design; it must still give finite logits whose argmax
    agrees with the float router on most positions."""
    model, path = models("gqa4-e8k2-v32000")
    out = tmp_path / "int8.colibri"
    colibri_lab.convert(models.folder("gqa4-e8k2-v32000"), out, dtype="f32", quantize_router="int8", progress=False)
    ids = random_ids(32000, 64, seed=11)
    with colibri_lab.Engine(path) as eng:
        a = eng.forward(ids)
    with colibri_lab.Engine(out) as eng:
        assert eng.config.router_dtype == "int8"
        b = eng.forward(ids)
    assert np.isfinite(b).all()
    agree = np.mean(a.argmax(-1) == b.argmax(-1))
    assert agree >= 0.8, f"int8 router: argmax agreement {agree:.2f}"
