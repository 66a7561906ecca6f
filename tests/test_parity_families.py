"""Parity of the Colibri engine with Hugging Face transformers for the other MoE families:
Qwen2-MoE, Qwen3-MoE and OLMoE (docs/format.md, "Family options").

As for Mixtral (test_parity_mixtral.py): logits within 1e-4 of transformers on the same
weights (f32 and a bf16 checkpoint), incremental decoding equal to one full forward,
greedy generation equal token for token. The shapes mix dense and MoE layers, shared
expert on and off, GQA ratios, biases, q/k norms, clipping that bites and per-layer
sliding windows, at sizes that are not multiples of 8.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri_lab  # noqa: E402
from colibri_lab import ColibriError  # noqa: E402
from colibri_lab.conversion.spec import ConversionError  # noqa: E402
from colibri_lab.format.reader import inspect  # noqa: E402

from colibri_lab.bench.models import FamilyShape, build_model, load_model, save_checkpoint  # noqa: E402
from helpers import (  # noqa: E402
    ModelCache, check_bf16_checkpoint, compare_logits, hf_logits, patch_metadata, random_ids,
)

TOL = 1e-4

SHAPES = {
    # Qwen2-MoE: shared expert (gated), a dense layer among MoE layers, q/k/v biases,
    # GQA 5, sliding window on layers 0 and 2 only (layer_types from max_window_layers).
    "q2-shared-dense-window": FamilyShape(
        "qwen2_moe", vocab=1001, hidden=70, inter=38, dense_inter=90, shared_inter=54, layers=4,
        heads=5, kv_heads=1, experts=6, top_k=2, mlp_only_layers=(2,), sliding_window=7,
        max_window_layers=3, seed=11),
    # Qwen2-MoE without a shared expert (shared_expert_intermediate_size 0: transformers
    # keeps empty tensors), decoder_sparse_step 2 (layers 0 and 2 dense), top-k
    # renormalised, no biases, tied embeddings, GQA 1.
    "q2-noshared-step2": FamilyShape(
        "qwen2_moe", vocab=517, hidden=60, inter=27, dense_inter=41, shared_inter=0, layers=4,
        heads=5, kv_heads=5, experts=5, top_k=2, norm_topk=True, sparse_step=2, bias=False,
        tie=True, seed=12),
    # Qwen3-MoE: explicit head_dim, per-head q/k norms, q/k/v and o biases, a dense layer,
    # 8 experts top-3 renormalised, GQA 3.
    "q3-bias-dense": FamilyShape(
        "qwen3_moe", vocab=777, hidden=67, inter=29, dense_inter=51, layers=3, heads=6,
        kv_heads=2, head_dim=10, experts=8, top_k=3, norm_topk=True, mlp_only_layers=(1,),
        bias=True, seed=13),
    # Qwen3-MoE: no biases, one window for every layer, GQA 4, no renormalisation.
    "q3-window": FamilyShape(
        "qwen3_moe", vocab=515, hidden=44, inter=33, layers=2, heads=4, kv_heads=1,
        head_dim=16, experts=5, top_k=2, bias=False, sliding_window=9, seed=14),
    # Qwen3-MoE with YaRN RoPE (factor 4 over an original context of 24 positions, so the
    # 90-token runs are past it; transformers' attention factor on cos and sin).
    "q3-yarn": FamilyShape(
        "qwen3_moe", vocab=401, hidden=48, inter=21, layers=2, heads=4, kv_heads=2,
        head_dim=12, experts=5, top_k=2, bias=False, seed=17,
        extra=(("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 24}),)),
    # OLMoE: full-projection q/k norms, clip_qkv that bites, q/k/v/o biases, GQA 2.
    "ol-clip": FamilyShape(
        "olmoe", vocab=1003, hidden=84, inter=37, layers=2, heads=6, kv_heads=3, experts=8,
        top_k=2, bias=True, clip_qkv=0.6, seed=15),
    # OLMoE: no clipping, no biases, top-1 without renormalisation, GQA 1.
    "ol-noclip": FamilyShape(
        "olmoe", vocab=333, hidden=50, inter=23, layers=2, heads=5, kv_heads=5, experts=4,
        top_k=1, bias=False, seed=16),
}

BF16_KEYS = ["q2-shared-dense-window", "q3-bias-dense", "ol-clip"]
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ModelCache(tmp_path_factory, SHAPES, build_model)


def compare(ref, got, router_logits, top_k, what):
    delta = compare_logits(ref, got, router_logits, top_k, what, tol=TOL)
    MEASURED[what] = max(MEASURED.get(what, 0.0), delta)
    return delta


# ------------------------------------------------------------------------ conversion

def test_family_options_in_metadata(models):
    """The converter writes the family options of docs/format.md; inspect shows them."""
    _, path = models("q2-shared-dense-window")
    info = inspect(path)
    m = info.metadata
    assert m["general.architecture"] == "qwen2_moe"
    assert m["model.layer_ffn"] == [1, 1, 0, 1]
    assert m["model.dense_intermediate_size"] == 90
    assert m["model.shared_expert_intermediate_size"] == 54
    assert m["model.shared_expert_gate"] is True and m["model.attn_qkv_bias"] is True
    assert m["model.attn_output_bias"] is False and m["model.attn_qk_norm"] == "none"
    assert m["model.layer_sliding_window"] == [7, 0, 7, 0]
    assert m["model.norm_topk_prob"] is False
    assert info.tensor("blk.2.ffn_dense").shape == (1, 270, 70)
    assert info.tensor("blk.0.ffn_shared").shape == (1, 162, 70)
    assert info.tensor("blk.0.ffn_shared_gate.weight").shape == (1, 70)
    names = {t.name for t in info.tensors}
    assert "blk.2.ffn_gate_inp.weight" not in names and "blk.2.ffn_experts" not in names
    assert "model.layer_ffn" in str(info)

    info = inspect(models("q2-noshared-step2")[1])
    assert info.metadata["model.layer_ffn"] == [0, 1, 0, 1]
    assert info.metadata["model.shared_expert_intermediate_size"] == 0
    assert not any("shared" in t.name for t in info.tensors)
    assert "model.layer_sliding_window" not in info.metadata

    info = inspect(models("q3-bias-dense")[1])
    assert info.metadata["model.attn_qk_norm"] == "head"
    assert info.tensor("blk.0.attn_q_norm.weight").shape == (10,)
    assert info.tensor("blk.0.attn_output.bias").shape == (67,)
    assert (m["model.attention"], m["model.routing"], m["model.activation"]) == \
        ("gqa", "softmax_topk", "silu_glu")
    assert info.metadata["model.rope_type"] == "default"
    assert "model.rope_inv_freq" not in info.metadata

    # YaRN: the frequencies and attention factor transformers computes, in the file
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    yarn = inspect(models("q3-yarn")[1]).metadata
    assert yarn["model.rope_type"] == "yarn"
    inv, af = ROPE_INIT_FUNCTIONS["yarn"](SHAPES["q3-yarn"].config(), "cpu")
    np.testing.assert_array_equal(np.array(yarn["model.rope_inv_freq"], np.float32), inv.numpy())
    assert yarn["model.rope_attention_factor"] == pytest.approx(af, rel=1e-12) and af > 1

    info = inspect(models("ol-clip")[1])
    assert info.metadata["model.attn_qk_norm"] == "full"
    assert info.metadata["model.clip_qkv"] == pytest.approx(0.6)
    assert info.tensor("blk.0.attn_k_norm.weight").shape == (42,)


@pytest.mark.parametrize("model_type", ["dbrx", "llama"])
def test_converter_refuses_other_families(tmp_path, model_type):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 8}))
    with pytest.raises(ConversionError) as e:
        colibri_lab.convert(d, tmp_path / "m.colibri", progress=False)
    msg = str(e.value)
    assert f"unsupported architecture '{model_type}'" in msg
    for fam in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        assert fam in msg
    assert not list(tmp_path.glob("*.colibri*"))



def test_engine_refuses_other_architectures_and_options(models, tmp_path):
    _, path = models("ol-noclip")
    bad = patch_metadata(path, tmp_path / "llama.colibri", b"olmoe", b"llama")
    with pytest.raises(ColibriError) as e:
        colibri_lab.Engine(bad)
    msg = str(e.value)
    assert "'llama' is not supported" in msg
    assert "mixtral, qwen2_moe, qwen3_moe, olmoe" in msg
    bad = patch_metadata(path, tmp_path / "norm.colibri", b"full", b"fuzz")
    with pytest.raises(ColibriError, match="attn_qk_norm 'fuzz'.*none, head, full"):
        colibri_lab.Engine(bad)
    # a choice no family has, and one the file's family does not make
    bad = patch_metadata(path, tmp_path / "act.colibri", b"silu_glu", b"tanh_glu")
    with pytest.raises(ColibriError, match="model.activation 'tanh_glu' is not supported.*silu_glu"):
        colibri_lab.Engine(bad)
    bad = patch_metadata(path, tmp_path / "route.colibri", b"softmax_topk", b"sigmoid_topk")
    with pytest.raises(ColibriError, match="model.routing 'sigmoid_topk'"):
        colibri_lab.Engine(bad)
    # All layers dense: not an MoE, and nothing would bound n_experts (which sizes the arena).
    ffn = inspect(path).metadata["model.layer_ffn"]
    key = b"model.layer_ffn" + struct.pack("<IIQ", 8, 0, len(ffn))
    bad = patch_metadata(path, tmp_path / "dense.colibri",
                          key + struct.pack(f"<{len(ffn)}I", *ffn),
                          key + bytes(4 * len(ffn)))
    with pytest.raises(ColibriError, match="all .* layers dense"):
        colibri_lab.Engine(bad)


# ------------------------------------------------------------------------ parity

@pytest.mark.parametrize("key", list(SHAPES))
@pytest.mark.parametrize("seq_len", [1, 13, 90])
def test_logits_f32(models, key, seq_len):
    model, path = models(key)
    shape = SHAPES[key]
    ids = random_ids(shape.vocab, seq_len, seed=seq_len)
    ref, router_logits = hf_logits(model, ids)
    assert float(np.std(ref)) > 0.05   # logits of a meaningful size
    with colibri_lab.Engine(path) as eng:
        got = eng.forward(ids)
    compare(ref, got, router_logits, shape.top_k, f"{key} f32 seq {seq_len}")


@pytest.mark.parametrize("key", BF16_KEYS)
def test_logits_bf16_checkpoint(models, key, tmp_path):
    """--dtype bf16 equals an f32 transformers model loaded from the bf16 checkpoint."""
    model, _ = models(key)
    shape = SHAPES[key]
    what = f"{key} bf16"
    delta = check_bf16_checkpoint(model, lambda f: load_model(shape.family, f),
                                  shape.vocab, shape.top_k, tmp_path, what)
    MEASURED[what] = max(MEASURED.get(what, 0.0), delta)


def test_clip_qkv_bites(models):
    """The OLMoE clip in SHAPES changes transformers' logits: the parity above tests it."""
    model, _ = models("ol-clip")
    ids = random_ids(SHAPES["ol-clip"].vocab, 20, seed=3)
    ref, _ = hf_logits(model, ids)
    model.config.clip_qkv = None
    try:
        unclipped, _ = hf_logits(model, ids)
    finally:
        model.config.clip_qkv = SHAPES["ol-clip"].clip_qkv
    assert float(np.max(np.abs(ref - unclipped))) > 1e-2


@pytest.mark.parametrize("key", ["q2-shared-dense-window", "q3-window", "ol-clip"])
def test_incremental_equals_full(models, key):
    _, path = models(key)
    ids = random_ids(SHAPES[key].vocab, 41, seed=7)
    with colibri_lab.Engine(path) as eng:
        full = eng.forward(ids)
        pieces = []
        cuts = [0, 1, 2, 9, 10, 25, 41]   # a first token alone, single steps, chunks
        for a, b in zip(cuts, cuts[1:]):
            pieces.append(eng.forward(ids[a:b], start_pos=a))
        inc = np.concatenate(pieces)
    with colibri_lab.Engine(path, max_batch=6) as eng:
        chunked = eng.forward(ids)
    assert np.max(np.abs(full - inc)) <= 1e-5
    assert np.max(np.abs(full - chunked)) <= 1e-5


@pytest.mark.parametrize("key", ["q2-shared-dense-window", "q2-noshared-step2", "q3-window",
                                 "ol-clip"])
def test_greedy_generation_equals_transformers(models, key):
    model, path = models(key)
    shape = SHAPES[key]
    prompt = random_ids(shape.vocab, 12, seed=9)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    ref = out[0, len(prompt):].tolist()
    with colibri_lab.Engine(path) as eng:
        got = [t.id for t in eng.generate(prompt, max_new_tokens=32, stop_at_eos=False)]
    assert got == ref


def test_int8_router_with_shared_expert(models, tmp_path):
    """int8 routers (the shared-expert gate stays in the weight dtype) run and mostly agree."""
    key = "q2-shared-dense-window"
    _, path = models(key)
    out = tmp_path / "int8.colibri"
    colibri_lab.convert(models.folder(key), out, dtype="f32", quantize_router="int8",
                        progress=False)
    assert inspect(out).tensor("blk.0.ffn_shared_gate.weight").dtype == "f32"
    ids = random_ids(SHAPES[key].vocab, 40, seed=11)
    with colibri_lab.Engine(path) as eng:
        a = eng.forward(ids)
    with colibri_lab.Engine(out) as eng:
        eng.verify_router()
        b = eng.forward(ids)
    assert np.isfinite(b).all()
    assert np.mean(a.argmax(-1) == b.argmax(-1)) >= 0.8


# ------------------------------------------------------------------------ no allocation

def test_no_allocation_in_forward_qwen2_moe(native_tests, tmp_path):
    """test_noalloc on a small Qwen2-MoE with dense, MoE and shared-expert layers, biases
    and a per-layer window: the new buffers come from the arena too."""
    from test_native import run_ok

    shape = FamilyShape("qwen2_moe", vocab=300, hidden=36, inter=20, dense_inter=30,
                        shared_inter=26, layers=3, heads=3, kv_heads=1, experts=4, top_k=2,
                        mlp_only_layers=(1,), sliding_window=5, max_window_layers=1, seed=3)
    folder = save_checkpoint(build_model(shape), tmp_path / "hf")
    out = tmp_path / "q2.colibri"
    colibri_lab.convert(folder, out, dtype="bf16", quantize_router="int8", progress=False)
    run_ok(native_tests / "test_noalloc", out)
