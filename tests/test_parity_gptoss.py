"""Parity of the Colibri engine with Hugging Face transformers for gpt-oss
(transformers' GptOssForCausalLM, eager attention and eager experts; docs/format.md,
"Family options").

What gpt-oss adds to the decoder, each exercised here at odd tiny sizes: attention sinks
(one logit per query head in the softmax denominator), alternating sliding/full layers
with windows shorter than the sequences, q/k/v/o biases, an explicit head_dim, a router
with a bias that takes top-k of its logits then a softmax over those k, and experts with
biases and the clamped SwiGLU (a swiglu_limit small enough to bite). As for the other
families: logits within 1e-4 of transformers in f32, incremental decoding equal to one
full forward, greedy generation equal token for token.
"""

from __future__ import annotations


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
    # the default layer_types (sliding, full, sliding), GQA 3, head_dim 10, a limit that
    # clamps most gates, 5 experts top-2
    "go-gqa3-limit": FamilyShape(
        "gpt_oss", vocab=301, hidden=44, inter=27, layers=3, heads=6, kv_heads=2, head_dim=10,
        experts=5, top_k=2, sliding_window=5, swiglu_limit=0.8, seed=21),
    # explicit layer_types (full, sliding), GQA 5 (one KV head), 7 experts top-3, window 3,
    # the default limit 7
    "go-gqa5-top3": FamilyShape(
        "gpt_oss", vocab=517, hidden=60, inter=33, layers=2, heads=5, kv_heads=1, head_dim=12,
        experts=7, top_k=3, sliding_window=3, layer_types=("full_attention", "sliding_attention"),
        swiglu_limit=7.0, seed=22),
    # no attention biases, tied embeddings, top-1 of 3, MHA, every layer sliding (one window)
    "go-tied-top1": FamilyShape(
        "gpt_oss", vocab=333, hidden=36, inter=19, layers=2, heads=4, kv_heads=4, head_dim=8,
        experts=3, top_k=1, bias=False, tie=True, sliding_window=6,
        layer_types=("sliding_attention", "sliding_attention"), swiglu_limit=1.5, seed=23),
}

# gpt-oss's own RoPE: YaRN (transformers' _compute_yarn_parameters: inv_freq blended
# between interpolation and extrapolation, cos and sin times the attention factor)
YARN = FamilyShape(
    "gpt_oss", vocab=301, hidden=40, inter=23, layers=2, heads=4, kv_heads=2, head_dim=16,
    experts=4, top_k=2, sliding_window=6, swiglu_limit=1.2, max_pos=512,
    rope=(("rope_type", "yarn"), ("factor", 8.0), ("beta_fast", 32.0), ("beta_slow", 1.0),
          ("original_max_position_embeddings", 64), ("truncate", False),
          ("rope_theta", 150000.0)), seed=24)

MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ModelCache(tmp_path_factory, SHAPES, build_model)


def compare(ref, got, router_logits, top_k, what):
    delta = compare_logits(ref, got, router_logits, top_k, what, tol=TOL)
    MEASURED[what] = max(MEASURED.get(what, 0.0), delta)
    return delta


# ------------------------------------------------------------------------ conversion

def test_gptoss_options_in_metadata(models):
    _, path = models("go-gqa3-limit")
    info = inspect(path)
    m = info.metadata
    assert m["general.architecture"] == "gpt_oss"
    assert m["model.head_dim"] == 10
    assert m["model.layer_sliding_window"] == [5, 0, 5]
    assert m["model.activation"] == "clamped_swiglu"
    assert m["model.swiglu_limit"] == pytest.approx(0.8)
    assert m["model.swiglu_alpha"] == pytest.approx(1.702)
    assert m["model.routing"] == "topk_softmax"
    assert m["model.router_logit_bias"] is True and m["model.attn_sinks"] is True
    assert m["model.expert_bias"] is True
    assert m["model.attn_qkv_bias"] is True and m["model.attn_output_bias"] is True
    assert info.version == 2   # the experts are stored split
    assert info.tensor("blk.0.attn_sinks").shape == (6,)
    assert info.tensor("blk.0.ffn_gate_inp.bias").shape == (5,)
    assert info.tensor("blk.1.ffn_gate_exps").shape == (5, 27, 44)
    assert info.tensor("blk.1.ffn_up_exps").shape == (5, 27, 44)
    assert info.tensor("blk.1.ffn_down_exps").shape == (5, 44, 27)
    assert info.tensor("blk.1.ffn_gate_exps.bias").shape == (5, 27)
    assert info.tensor("blk.1.ffn_down_exps.bias").shape == (5, 44)

    m = inspect(models("go-tied-top1")[1]).metadata
    assert m["model.sliding_window"] == 6 and "model.layer_sliding_window" not in m
    assert m["model.attn_qkv_bias"] is False


def test_experts_deinterleaved_and_transposed(models):
    """The split tensors are transformers' interleaved gate_up_proj columns, transposed."""
    model, path = models("go-gqa3-limit")
    info = inspect(path)
    ex = model.model.layers[2].mlp.experts
    gu = ex.gate_up_proj.detach().numpy()
    rd = info.read_tensor
    np.testing.assert_array_equal(rd("blk.2.ffn_gate_exps"), gu[:, :, 0::2].transpose(0, 2, 1))
    np.testing.assert_array_equal(rd("blk.2.ffn_up_exps"), gu[:, :, 1::2].transpose(0, 2, 1))
    np.testing.assert_array_equal(rd("blk.2.ffn_down_exps"),
                                  ex.down_proj.detach().numpy().transpose(0, 2, 1))
    b = ex.gate_up_proj_bias.detach().numpy()
    np.testing.assert_array_equal(rd("blk.2.ffn_gate_exps.bias"), b[:, 0::2])
    np.testing.assert_array_equal(rd("blk.2.ffn_up_exps.bias"), b[:, 1::2])
    np.testing.assert_array_equal(rd("blk.2.attn_sinks"),
                                  model.model.layers[2].self_attn.sinks.detach().numpy())


def test_converter_refuses_malformed_mxfp4_checkpoints(models, tmp_path):
    """MXFP4 experts whose blocks do not have the shape config.json implies: a clear
    refusal naming the tensor, and no output left behind."""
    from safetensors.torch import load_file, save_file

    src = models.folder("go-tied-top1")
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    for k in [k for k in sd if k.endswith("experts.gate_up_proj")]:
        sd[k + "_blocks"] = sd.pop(k).to(torch.uint8)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ConversionError, match="MXFP4 experts need|gate_up_proj_blocks"):
        colibri_lab.convert(d, tmp_path / "m.colibri", progress=False)
    assert not list(tmp_path.glob("*.colibri*"))


def test_yarn_logits_and_generation(tmp_path):
    """YaRN RoPE (rope_type yarn) against transformers at positions past
    original_max_position_embeddings."""
    model = build_model(YARN)
    folder = save_checkpoint(model, tmp_path / "hf")
    out = tmp_path / "yarn.colibri"
    colibri_lab.convert(folder, out, dtype="f32", progress=False)
    assert inspect(out).metadata["model.rope_type"] == "yarn"
    ids = random_ids(YARN.vocab, 150, seed=6)
    ref, router_logits = hf_logits(model, ids)
    with colibri_lab.Engine(out) as eng:
        got = eng.forward(ids)
        gen = [t.id for t in eng.generate(ids[:12], max_new_tokens=32, stop_at_eos=False)]
    compare(ref, got, router_logits, YARN.top_k, "yarn f32 seq 150")
    with torch.no_grad():
        want = model.generate(torch.tensor([ids[:12]]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
    assert gen == want



def test_engine_refuses_unknown_activation_and_routing(models, tmp_path):
    _, path = models("go-tied-top1")
    bad = patch_metadata(path, tmp_path / "act.colibri", b"clamped_swiglu", b"clamped_gelu__")
    with pytest.raises(ColibriError, match="activation 'clamped_gelu__'.*silu_glu, clamped_swiglu"):
        colibri_lab.Engine(bad)
    bad = patch_metadata(path, tmp_path / "route.colibri", b"topk_softmax", b"topk_sigmoid")
    with pytest.raises(ColibriError, match="routing 'topk_sigmoid'.*softmax_topk, topk_softmax"):
        colibri_lab.Engine(bad)
    # a choice the engine implements but the gpt_oss family does not make
    bad = patch_metadata(path, tmp_path / "fam.colibri", b"topk_softmax", b"softmax_topk")
    with pytest.raises(ColibriError, match="'softmax_topk' is not a choice of the gpt_oss family"):
        colibri_lab.Engine(bad)


# ------------------------------------------------------------------------ parity

@pytest.mark.parametrize("key", list(SHAPES))
@pytest.mark.parametrize("seq_len", [1, 13, 40])
def test_logits_f32(models, key, seq_len):
    model, path = models(key)
    shape = SHAPES[key]
    ids = random_ids(shape.vocab, seq_len, seed=seq_len)
    ref, router_logits = hf_logits(model, ids)
    assert float(np.std(ref)) > 0.05
    with colibri_lab.Engine(path) as eng:
        got = eng.forward(ids)
    compare(ref, got, router_logits, shape.top_k, f"{key} f32 seq {seq_len}")


def test_logits_bf16_checkpoint(models, tmp_path):
    key = "go-gqa3-limit"
    model, _ = models(key)
    shape = SHAPES[key]
    what = f"{key} bf16"
    delta = check_bf16_checkpoint(model, lambda f: load_model(shape.family, f),
                                  shape.vocab, shape.top_k, tmp_path, what)
    MEASURED[what] = max(MEASURED.get(what, 0.0), delta)


def _set_limit(model, limit):
    for layer in model.model.layers:
        layer.mlp.experts.limit = limit


def test_limit_and_sinks_bite(models):
    """The SHAPES' swiglu_limit and the sinks change transformers' logits: the parity above
    tests them."""
    model, _ = models("go-gqa3-limit")
    ids = random_ids(SHAPES["go-gqa3-limit"].vocab, 20, seed=3)
    ref, _ = hf_logits(model, ids)
    _set_limit(model, 1e4)
    try:
        unclamped, _ = hf_logits(model, ids)
    finally:
        _set_limit(model, SHAPES["go-gqa3-limit"].swiglu_limit)
    assert float(np.max(np.abs(ref - unclamped))) > 1e-2
    saved = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
    try:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
        nosink, _ = hf_logits(model, ids)
    finally:
        with torch.no_grad():
            for layer, s in zip(model.model.layers, saved):
                layer.self_attn.sinks.copy_(s)
    assert float(np.max(np.abs(ref - nosink))) > 1e-2


@pytest.mark.parametrize("key", list(SHAPES))
def test_incremental_equals_full(models, key):
    _, path = models(key)
    ids = random_ids(SHAPES[key].vocab, 41, seed=7)
    with colibri_lab.Engine(path) as eng:
        full = eng.forward(ids)
        pieces = []
        cuts = [0, 1, 2, 9, 10, 25, 41]
        for a, b in zip(cuts, cuts[1:]):
            pieces.append(eng.forward(ids[a:b], start_pos=a))
        inc = np.concatenate(pieces)
    with colibri_lab.Engine(path, max_batch=6) as eng:
        chunked = eng.forward(ids)
    assert np.max(np.abs(full - inc)) <= 1e-5
    assert np.max(np.abs(full - chunked)) <= 1e-5


@pytest.mark.parametrize("key", list(SHAPES))
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


def test_batch_api_equals_forward(models):
    """Two sequences through colibri_batch, in steps that interleave them, give each the
    logits it has alone (the paged cache, per-sequence windows and sinks)."""
    key = "go-gqa5-top3"
    _, path = models(key)
    a = random_ids(SHAPES[key].vocab, 17, seed=1)
    b = random_ids(SHAPES[key].vocab, 11, seed=2)
    with colibri_lab.Engine(path) as eng:
        fa = eng.forward(a)
    with colibri_lab.Engine(path) as eng:
        fb = eng.forward(b)
    with colibri_lab.Engine(path, max_seqs=2) as eng:
        a1, b1 = eng.batch([(0, a[:9]), (1, b[:4])], logits="all")
        b2, a2 = eng.batch([(1, b[4:]), (0, a[9:])], logits="all")
    assert np.max(np.abs(np.concatenate([a1, a2]) - fa)) <= 1e-5
    assert np.max(np.abs(np.concatenate([b1, b2]) - fb)) <= 1e-5


def test_no_allocation_in_forward_gptoss(native_tests, tmp_path):
    """test_noalloc on a small gpt-oss (sinks, clamped experts with biases, windows)."""
    from test_native import run_ok

    from colibri_lab.bench.models import save_checkpoint

    shape = FamilyShape("gpt_oss", vocab=300, hidden=36, inter=20, layers=2, heads=4,
                        kv_heads=2, head_dim=8, experts=4, top_k=2, sliding_window=5,
                        swiglu_limit=1.0, seed=3)
    folder = save_checkpoint(build_model(shape), tmp_path / "hf")
    out = tmp_path / "go.colibri"
    colibri_lab.convert(folder, out, dtype="bf16", quantize_router="int8", progress=False)
    run_ok(native_tests / "test_noalloc", out)


def test_sink_share_stage_tensor(models):
    """colibri_stage_tensor("sink_share") after a layer's attention: the sinks' share of
    each head's softmax, 1 - the sum of transformers' eager attention weights."""
    key = "go-gqa3-limit"
    model, path = models(key)
    ids = random_ids(SHAPES[key].vocab, 13, seed=4)
    with torch.no_grad():
        att = model(torch.tensor([ids]), output_attentions=True).attentions
    with colibri_lab.Engine(path) as eng:
        run = eng.stages(ids)
        run.embedding()
        for layer in range(SHAPES[key].layers):
            share = np.array(run.attention()["sink_share"])
            want = 1.0 - att[layer][0].sum(-1).numpy().T   # [T, Hq]
            assert share.shape == want.shape
            assert np.max(np.abs(share - want)) <= 1e-5
            assert float(share.min()) > 0.0
            for stage in ("router", "grouping", "expert_ffn", "combine"):
                run.run(stage)


@pytest.mark.parametrize("dtype,router,agree", [("q8_0", None, 0.9), ("bf16", "int8", 0.8)])
def test_quantized_and_int8_router(models, tmp_path, dtype, router, agree):
    """A quantized mix (split experts in q8_0, their biases f32) and an int8 router (its
    bias f32) run, in exact and fast precision, and mostly agree with the f32 file."""
    key = "go-gqa5-top3"
    _, path = models(key)
    out = tmp_path / f"{dtype}.colibri"
    colibri_lab.convert(models.folder(key), out, dtype=dtype, quantize_router=router,
                        progress=False)
    info = inspect(out)
    assert info.tensor("blk.0.ffn_gate_inp.bias").dtype == "f32"
    assert info.tensor("blk.0.ffn_down_exps.bias").dtype == "f32"
    ids = random_ids(SHAPES[key].vocab, 40, seed=11)
    with colibri_lab.Engine(path) as eng:
        a = eng.forward(ids)
    for precision in ("exact", "fast"):
        with colibri_lab.Engine(out, precision=precision) as eng:
            b = eng.forward(ids)
        assert np.isfinite(b).all()
        assert np.mean(a.argmax(-1) == b.argmax(-1)) >= agree
        assert float(np.median(np.abs(a - b))) < 0.05   # a flipped expert choice moves a few


def test_mxfp4_experts_parity(tmp_path):
    """The mxfp4 mix (routed experts MXFP4, as gpt-oss ships): the engine equals
    transformers run on the dequantized MXFP4 values of the file (put back interleaved and
    transposed), through the clamped SwiGLU with biases, in exact and fast precision."""
    shape = FamilyShape("gpt_oss", vocab=301, hidden=64, inter=32, layers=2, heads=4,
                        kv_heads=2, head_dim=16, experts=4, top_k=2, sliding_window=5,
                        swiglu_limit=1.0, seed=5)
    model = build_model(shape)
    folder = save_checkpoint(model, tmp_path / "hf")
    out = tmp_path / "mx.colibri"
    colibri_lab.convert(folder, out, dtype="mxfp4", progress=False)
    info = inspect(out)
    with torch.no_grad():
        # the mix's other weight matrices are BF16 (routers F32): round the reference's too
        for name, p in model.named_parameters():
            if p.ndim == 2 and "router" not in name and "experts" not in name:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
        for n, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            assert info.tensor(f"blk.{n}.ffn_gate_exps").dtype == "mxfp4"
            g = info.read_tensor(f"blk.{n}.ffn_gate_exps", as_float32=True)   # [E, I, H]
            u = info.read_tensor(f"blk.{n}.ffn_up_exps", as_float32=True)
            d = info.read_tensor(f"blk.{n}.ffn_down_exps", as_float32=True)   # [E, H, I]
            ex.gate_up_proj[:, :, 0::2] = torch.from_numpy(np.ascontiguousarray(g.transpose(0, 2, 1)))
            ex.gate_up_proj[:, :, 1::2] = torch.from_numpy(np.ascontiguousarray(u.transpose(0, 2, 1)))
            ex.down_proj.copy_(torch.from_numpy(np.ascontiguousarray(d.transpose(0, 2, 1))))
    ids = random_ids(shape.vocab, 30, seed=1)
    ref, router_logits = hf_logits(model, ids)
    for precision in ("exact", "fast"):
        with colibri_lab.Engine(out, precision=precision) as eng:
            got = eng.forward(ids)
        if precision == "exact":
            compare(ref, got, router_logits, shape.top_k, "mxfp4 experts")
        else:   # fast: BF16 attention/LM head inputs rounded
            assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.9


def _hf_mxfp4(rows_q: np.ndarray):
    """Our MXFP4 rows [..., rows, G*17] -> a transformers checkpoint's (*_blocks
    [..., rows, G, 16], *_scales [..., rows, G]): the inverse of quants.mxfp4_from_hf."""
    q = rows_q.reshape(*rows_q.shape[:-1], -1, 17)
    scales = np.ascontiguousarray(q[..., 0])
    qs = q[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)             # element j < 32
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(blocks), scales


@pytest.mark.parametrize("dtype", ["mxfp4", "f32"])
def test_hub_mxfp4_checkpoint(tmp_path, dtype):
    """A checkpoint as the hub ships gpt-oss (experts as gate_up_proj_blocks / _scales and
    down_proj_blocks / _scales, rows = outputs with gate/up interleaved): the mxfp4 mix keeps
    its bytes (a repack, no requantization), f32 dequantizes them; both run as transformers
    on the dequantized experts (transformers' own convert_moe_packed_tensors)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from colibri_lab.format import blocks as quants
    from colibri_lab.format.spec import DTYPE_MXFP4

    shape = FamilyShape("gpt_oss", vocab=301, hidden=64, inter=32, layers=2, heads=4,
                        kv_heads=2, head_dim=16, experts=3, top_k=2, sliding_window=4,
                        swiglu_limit=1.0, seed=6)
    model = build_model(shape)
    folder = save_checkpoint(model, tmp_path / "hf")
    sd = load_file(str(folder / "model.safetensors"))
    ours = {}
    for n, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        p = f"model.layers.{n}.mlp.experts"
        gu_rows = ex.gate_up_proj.detach().numpy().transpose(0, 2, 1)   # [E, 2I, H], interleaved
        dn_rows = ex.down_proj.detach().numpy().transpose(0, 2, 1)      # [E, H, I]
        for name, rows in (("gate_up_proj", gu_rows), ("down_proj", dn_rows)):
            q = quants.to_stored(np.ascontiguousarray(rows.reshape(-1, rows.shape[-1])), DTYPE_MXFP4)
            q = q.reshape(*rows.shape[:-1], -1)
            ours[(n, name)] = q
            b, s = _hf_mxfp4(q)
            del sd[f"{p}.{name}"]
            sd[f"{p}.{name}_blocks"] = torch.from_numpy(b)
            sd[f"{p}.{name}_scales"] = torch.from_numpy(s)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # the reference: transformers' dequantization of those blocks, in its [E, in, out] layout
    with torch.no_grad():
        for n, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            p = f"model.layers.{n}.mlp.experts"
            for name, param in (("gate_up_proj", ex.gate_up_proj), ("down_proj", ex.down_proj)):
                param.copy_(convert_moe_packed_tensors(sd[f"{p}.{name}_blocks"],
                                                       sd[f"{p}.{name}_scales"], dtype=torch.float32))
            if dtype == "mxfp4":   # the mix's other matrices are BF16
                for name, prm in layer.named_parameters():
                    if prm.ndim == 2 and "router" not in name and "experts" not in name:
                        prm.copy_(prm.to(torch.bfloat16).to(torch.float32))
        if dtype == "mxfp4":
            for prm in (model.model.embed_tokens.weight, model.lm_head.weight):
                prm.copy_(prm.to(torch.bfloat16).to(torch.float32))
    out = tmp_path / "m.colibri"
    colibri_lab.convert(folder, out, dtype=dtype, progress=False)
    info = inspect(out)
    if dtype == "mxfp4":   # byte for byte the checkpoint's blocks, gate/up rows apart
        for n in range(shape.layers):
            gu = ours[(n, "gate_up_proj")]
            np.testing.assert_array_equal(info.read_tensor(f"blk.{n}.ffn_gate_exps").reshape(gu[:, 0::2].shape),
                                          gu[:, 0::2])
            np.testing.assert_array_equal(info.read_tensor(f"blk.{n}.ffn_up_exps").reshape(gu[:, 1::2].shape),
                                          gu[:, 1::2])
            dn = ours[(n, "down_proj")]
            np.testing.assert_array_equal(info.read_tensor(f"blk.{n}.ffn_down_exps").reshape(dn.shape), dn)
    ids = random_ids(shape.vocab, 30, seed=2)
    ref, router_logits = hf_logits(model, ids)
    with colibri_lab.Engine(out) as eng:
        got = eng.forward(ids)
    compare(ref, got, router_logits, shape.top_k, f"hub mxfp4 checkpoint -> {dtype}")
