"""Parity of the Colibri engine with Hugging Face transformers for DeepSeek-V2 and -V3:
multi-head latent attention (q LoRA on and off, YaRN RoPE with its softmax mscale,
interleaved RoPE pairs), the latent-only KV cache, dense first layers, shared experts and
the grouped routers (V2 greedy / group_limited_greedy softmax, V3 noaux_tc sigmoid with a
correction bias, routed scaling, renormalisation) — docs/format.md, "Family options".

As for the other families (test_parity_families.py): logits within 1e-4 of transformers
(eager attention, f32), incremental decoding and the batched API equal to one full
forward, greedy generation equal token for token. Tiny odd shapes: seconds in all.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri_lab  # noqa: E402
from colibri_lab import ColibriError  # noqa: E402
from colibri_lab.format.reader import inspect  # noqa: E402

from colibri_lab.bench.models import DeepseekShape, build_model, load_model  # noqa: E402
from helpers import (  # noqa: E402
    ModelCache, check_bf16_checkpoint, hf_logits, patch_metadata, random_ids,
)

TOL = 1e-4

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
            original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
            mscale=1.0, mscale_all_dim=0.8)

SHAPES = {
    # V2: no q LoRA, greedy softmax top-2, no renormalisation, one dense layer, 1 shared expert.
    "v2-greedy": DeepseekShape(
        "deepseek_v2", vocab=509, hidden=54, inter=22, dense_inter=46, layers=3, heads=3,
        kv_lora=20, nope=10, rope=6, v_dim=9, experts=8, top_k=2, shared=1, first_dense=1,
        seed=21),
    # V2 (its complex RoPE needs an even qk_head_dim): q LoRA, group_limited_greedy (4 groups, 2 kept), routed scaling, 2 shared experts,
    # YaRN (mscale_all_dim: the softmax scale changes too).
    "v2-group-yarn": DeepseekShape(
        "deepseek_v2", vocab=611, hidden=60, inter=18, dense_inter=38, layers=3, heads=4,
        q_lora=17, kv_lora=14, nope=6, rope=8, v_dim=11, experts=12, top_k=3, shared=2,
        first_dense=1, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        scale=1.7, yarn=YARN, max_pos=256, seed=22),
    # V3: q LoRA, noaux_tc with 4 groups (2 kept), correction bias, renormalised, scaled.
    "v3-groups": DeepseekShape(
        "deepseek_v3", vocab=523, hidden=50, inter=19, dense_inter=41, layers=3, heads=5,
        q_lora=13, kv_lora=18, nope=9, rope=6, v_dim=7, experts=8, top_k=3, shared=1,
        first_dense=1, n_group=4, topk_group=2, norm_topk=True, scale=2.5, seed=23),
    # V3: no q LoRA, one group, no renormalisation, YaRN, RoPE not interleaved, tied.
    "v3-1group-yarn": DeepseekShape(
        "deepseek_v3", vocab=401, hidden=44, inter=23, dense_inter=35, layers=2, heads=2,
        kv_lora=22, nope=12, rope=10, v_dim=13, experts=6, top_k=2, shared=1, first_dense=1,
        n_group=1, topk_group=1, norm_topk=False, scale=1.0, interleave=False, yarn=YARN,
        tie=True, max_pos=256, seed=24),
    # V3: q LoRA, 2 groups (1 kept), interleaved RoPE, YaRN, two shared experts.
    "v3-yarn-interleave": DeepseekShape(
        "deepseek_v3", vocab=389, hidden=36, inter=15, dense_inter=29, layers=3, heads=3,
        q_lora=11, kv_lora=10, nope=5, rope=4, v_dim=6, experts=6, top_k=2, shared=2,
        first_dense=1, n_group=2, topk_group=1, norm_topk=True, scale=1.5, yarn=YARN,
        max_pos=256, seed=25),
}
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ModelCache(tmp_path_factory, SHAPES, build_model)


def _deepseek_choice_ties(model, ids, gap=1e-5):
    """Position of the first token whose top-k choice in some MoE layer is decided by
    float rounding (the k-th and (k+1)-th choice values of the kept groups within `gap`),
    or None. As hf_models.first_near_tie, for DeepSeek's routers (softmax/sigmoid,
    correction bias, groups): the router modules' choices are recomputed from their inputs."""
    inputs = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None:
            continue
        hooks.append(gate.register_forward_hook(
            lambda mod, args, out, i=i: inputs.__setitem__(i, (mod, args[0].detach()))))
    try:
        with torch.no_grad():
            model(torch.tensor([list(ids)]))
    finally:
        for h in hooks:
            h.remove()
    first = None
    for mod, x in inputs.values():
        x = x.reshape(-1, x.shape[-1]).float()
        logits = x @ mod.weight.float().T
        E, K = logits.shape[-1], mod.top_k
        if hasattr(mod, "e_score_correction_bias"):
            choice = logits.sigmoid() + mod.e_score_correction_bias
        else:
            choice = logits.softmax(-1)
        G = mod.num_group or 1
        if G > 1 and getattr(mod, "topk_method", "noaux_tc") != "greedy":
            per = choice.view(-1, G, E // G)
            gs = per.topk(2, -1)[0].sum(-1) if hasattr(mod, "e_score_correction_bias") \
                else per.max(-1).values
            top = gs.topk(min(mod.topk_group + 1, G), -1).values
            if G > mod.topk_group:
                tied = (top[:, mod.topk_group - 1] - top[:, mod.topk_group]).abs() < gap
                idx = torch.nonzero(tied).flatten()
                if len(idx):
                    first = int(idx[0]) if first is None else min(first, int(idx[0]))
            keep = torch.zeros_like(gs).scatter_(1, gs.topk(mod.topk_group, -1)[1], 1)
            choice = choice.masked_fill(~keep.repeat_interleave(E // G, -1).bool(), -1e30)
        top = choice.topk(K + 1, -1).values
        tied = (top[:, K - 1] - top[:, K]).abs() < gap
        idx = torch.nonzero(tied).flatten()
        if len(idx):
            first = int(idx[0]) if first is None else min(first, int(idx[0]))
    return first


def compare(model, ids, ref, got, what):
    cut = _deepseek_choice_ties(model, ids)
    if cut is not None:
        if cut == 0:
            pytest.skip(f"{what}: first token has a router near-tie")
        ref, got = ref[:cut], got[:cut]
    assert got.shape == ref.shape and got.dtype == np.float32
    delta = float(np.max(np.abs(ref - got)))
    assert delta <= TOL, f"{what}: max |Δ logits| = {delta:.3g}"
    print(f"{what}: max |Δ logits| = {delta:.3g}")
    MEASURED[what] = max(MEASURED.get(what, 0.0), delta)
    return delta


# ------------------------------------------------------------------------ conversion

def test_deepseek_options_in_metadata(models):
    _, path = models("v2-group-yarn")
    info = inspect(path)
    m = info.metadata
    assert m["general.architecture"] == "deepseek_v2"
    assert m["model.attention"] == "mla"
    assert m["model.q_lora_rank"] == 17 and m["model.kv_lora_rank"] == 14
    assert m["model.qk_nope_head_dim"] == 6 and m["model.v_head_dim"] == 11
    assert m["model.head_dim"] == 8          # the RoPE width, as transformers' head_dim
    assert m["model.routing"] == "softmax_topk"
    assert m["model.n_group"] == 4 and m["model.topk_group"] == 2
    assert m["model.routed_scaling_factor"] == pytest.approx(1.7)
    assert m["model.norm_topk_prob"] is False   # transformers' V2 never renormalises
    assert m["model.layer_ffn"] == [0, 1, 1]
    assert m["model.dense_intermediate_size"] == 38
    assert m["model.shared_expert_intermediate_size"] == 36
    assert m["model.shared_expert_gate"] is False
    assert m["model.rope_type"] == "yarn"
    assert info.tensor("blk.0.attn_q_a.weight").shape == (17, 60)
    assert info.tensor("blk.0.attn_q_a_norm.weight").shape == (17,)
    assert info.tensor("blk.0.attn_q_b.weight").shape == (4 * 14, 17)
    assert info.tensor("blk.0.attn_kv_a_mqa.weight").shape == (22, 60)
    assert info.tensor("blk.0.attn_kv_a_norm.weight").shape == (14,)
    assert info.tensor("blk.0.attn_kv_b.weight").shape == (4 * 17, 14)
    assert info.tensor("blk.0.attn_output.weight").shape == (60, 44)
    names = {t.name for t in info.tensors}
    assert "blk.0.attn_q.weight" not in names and "blk.1.exp_probs_b.bias" not in names

    m = inspect(models("v3-groups")[1]).metadata
    assert m["general.architecture"] == "deepseek_v3"
    assert m["model.routing"] == "sigmoid_topk" and m["model.router_bias"] is True and m["model.norm_topk_prob"] is True
    assert inspect(models("v3-groups")[1]).tensor("blk.1.exp_probs_b.bias").shape == (8,)
    m = inspect(models("v2-greedy")[1]).metadata
    assert m["model.routing"] == "softmax_topk" and m["model.q_lora_rank"] == 0
    assert m["model.n_group"] == 1 and m["model.router_bias"] is False


def test_kv_cache_holds_the_latent_only(models):
    """Bytes per cached token: (kv_lora_rank + qk_rope_head_dim) * 4 * n_layers, against
    transformers' expanded cache, n_heads * (qk_head_dim + v_head_dim) * 4 * n_layers."""
    rows = []
    for key, s in SHAPES.items():
        _, path = models(key)
        with colibri_lab.Engine(path) as eng:
            got = eng.config.kv_bytes_per_token
        ours = (s.kv_lora + s.rope) * 4 * s.layers
        expanded = s.heads * (s.nope + s.rope + s.v_dim) * 4 * s.layers
        assert got == ours
        rows.append((key, got, expanded))
        print(f"{key}: {got} bytes per cached token (transformers' expanded cache: {expanded}, "
              f"{expanded / got:.2f}x)")
    # the full-size DeepSeek-V3 config, from the same formulas
    print("DeepSeek-V3 671B: %d vs %d bytes per token" % ((512 + 64) * 4 * 61,
                                                           128 * (192 + 128) * 4 * 61))



def test_engine_refuses_unknown_options(models, tmp_path):
    _, path = models("v3-groups")
    bad = patch_metadata(path, tmp_path / "r.colibri", b"sigmoid_topk", b"sigmoid_tapk")
    with pytest.raises(ColibriError, match="model.routing 'sigmoid_tapk'"):
        colibri_lab.Engine(bad)
    bad = patch_metadata(path, tmp_path / "a.colibri", b"\x03\x00\x00\x00\x00\x00\x00\x00mla",
                          b"\x03\x00\x00\x00\x00\x00\x00\x00mlb")
    with pytest.raises(ColibriError, match="model.attention 'mlb'"):
        colibri_lab.Engine(bad)
    # a choice another family makes: V2's router is softmax, V3's sigmoid
    v2 = models("v2-greedy")[1]
    bad = patch_metadata(v2, tmp_path / "v2.colibri", b"softmax_topk", b"sigmoid_topk")
    with pytest.raises(ColibriError, match="model.routing 'sigmoid_topk' is not a choice of the deepseek_v2"):
        colibri_lab.Engine(bad)
    # groups that cannot hold top_k experts
    bad = patch_metadata(path, tmp_path / "g.colibri", b"model.topk_group" + struct.pack("<II", 0, 2),
                          b"model.topk_group" + struct.pack("<II", 0, 0))
    with pytest.raises(ColibriError, match="model.topk_group = 0"):
        colibri_lab.Engine(bad)


# ------------------------------------------------------------------------ parity

@pytest.mark.parametrize("key", list(SHAPES))
@pytest.mark.parametrize("seq_len", [1, 11, 70])
def test_logits_f32(models, key, seq_len):
    model, path = models(key)
    shape = SHAPES[key]
    ids = random_ids(shape.vocab, seq_len, seed=seq_len)
    ref, _ = hf_logits(model, ids)
    assert float(np.std(ref)) > 0.05
    with colibri_lab.Engine(path) as eng:
        got = eng.forward(ids)
    compare(model, ids, ref, got, f"{key} f32 seq {seq_len}")


def test_yarn_bites(models):
    """The YaRN of SHAPES changes transformers' logits (its parity is tested above)."""
    from dataclasses import replace

    model, _ = models("v3-1group-yarn")
    plain = build_model(replace(SHAPES["v3-1group-yarn"], yarn=None))
    ids = random_ids(SHAPES["v3-1group-yarn"].vocab, 40, seed=3)
    a, _ = hf_logits(model, ids)
    b, _ = hf_logits(plain, ids)
    assert float(np.max(np.abs(a - b))) > 1e-2


def test_logits_bf16_checkpoint(models, tmp_path):
    key = "v3-groups"
    model, _ = models(key)
    shape = SHAPES[key]
    delta = check_bf16_checkpoint(model, lambda f: load_model(shape.family, f),
                                  shape.vocab, 1, tmp_path, f"{key} bf16")
    MEASURED[f"{key} bf16"] = delta


@pytest.mark.parametrize("key", ["v2-group-yarn", "v3-groups", "v3-1group-yarn"])
def test_incremental_and_batched_equal_full(models, key):
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
    # several sequences in one chunk (the paged cache; rows of sequences interleaved)
    other = random_ids(SHAPES[key].vocab, 17, seed=8)
    with colibri_lab.Engine(path) as eng:
        ref_other = eng.forward(other)
    with colibri_lab.Engine(path, max_seqs=2, max_batch=16) as eng:
        la, lb = [], []
        n = max(len(ids), len(other))
        for i in range(0, n, 5):
            work = [(seq, x[i:i + 5]) for seq, x in ((0, ids), (1, other)) if i < len(x)]
            out = eng.batch(work, logits="all")
            for (seq, _), rows in zip(work, out):
                (la if seq == 0 else lb).append(rows)
    assert np.max(np.abs(np.concatenate(la) - full)) <= 1e-5
    assert np.max(np.abs(np.concatenate(lb) - ref_other)) <= 1e-5


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


def test_threads_do_not_change_results(models):
    _, path = models("v3-groups")
    ids = random_ids(SHAPES["v3-groups"].vocab, 70, seed=4)
    with colibri_lab.Engine(path, num_threads=1) as eng:
        one = eng.forward(ids)
    with colibri_lab.Engine(path, num_threads=2) as eng:
        two = eng.forward(ids)
    assert np.array_equal(one, two)


def test_no_allocation_in_forward_deepseek(native_tests, tmp_path):
    """test_noalloc on a small DeepSeek-V3 (MLA with q LoRA, grouped sigmoid router, a
    dense layer, shared expert): the latent cache and the MLA buffers are the arena's."""
    from test_native import run_ok

    from colibri_lab.bench.models import save_checkpoint

    shape = DeepseekShape("deepseek_v3", vocab=300, hidden=36, inter=20, dense_inter=30,
                          layers=2, heads=3, q_lora=10, kv_lora=12, nope=6, rope=4, v_dim=5,
                          experts=4, top_k=2, n_group=2, topk_group=1, seed=3)
    folder = save_checkpoint(build_model(shape), tmp_path / "hf")
    out = tmp_path / "ds.colibri"
    colibri_lab.convert(folder, out, dtype="bf16", progress=False)
    run_ok(native_tests / "test_noalloc", out)


def test_router_options_bite(models, tmp_path):
    """The groups, the correction bias and the scaling of the V3 shape each change the
    engine's logits: the parity above tests them (the file says them, the engine uses them)."""
    _, path = models("v3-groups")
    ids = random_ids(SHAPES["v3-groups"].vocab, 40, seed=6)
    with colibri_lab.Engine(path) as eng:
        ref = eng.forward(ids)
    u32 = lambda key, v: key + struct.pack("<II", 0, v)  # noqa: E731
    f64 = lambda key, v: key + struct.pack("<Id", 7, v)  # noqa: E731
    variants = {
        "no groups": [(u32(b"model.n_group", 4), u32(b"model.n_group", 1)),
                      (u32(b"model.topk_group", 2), u32(b"model.topk_group", 1))],
        "no bias": [(b"model.router_bias\x03\x00\x00\x00\x01", b"model.router_bias\x03\x00\x00\x00\x00")],
        "no scale": [(f64(b"model.routed_scaling_factor", 2.5), f64(b"model.routed_scaling_factor", 1.0))],
    }
    for what, patches in variants.items():
        src = path
        for i, (old, new) in enumerate(patches):
            src = patch_metadata(src, tmp_path / f"{what}-{i}.colibri".replace(" ", "_"), old, new)
        with colibri_lab.Engine(src) as eng:
            got = eng.forward(ids)
        assert float(np.max(np.abs(got - ref))) > 1e-3, what


def test_quantized_mix_runs(tmp_path):
    """A q8_0 mix quantizes the MLA matrices too (kv_b's W_UK rows go through dequant_row,
    W_UV through matmul): the logits stay close to transformers' f32 ones."""
    from colibri_lab.bench.models import save_checkpoint

    shape = DeepseekShape("deepseek_v3", vocab=300, hidden=64, inter=32, dense_inter=64,
                          layers=2, heads=2, q_lora=32, kv_lora=32, nope=16, rope=16, v_dim=16,
                          experts=8, top_k=2, n_group=2, topk_group=1, seed=5)
    model = build_model(shape)
    folder = save_checkpoint(model, tmp_path / "hf")
    out = tmp_path / "q8.colibri"
    colibri_lab.convert(folder, out, dtype="q8_0", progress=False)
    assert inspect(out).tensor("blk.0.attn_kv_b.weight").dtype == "q8_0"
    ids = random_ids(shape.vocab, 30, seed=1)
    ref, _ = hf_logits(model, ids)
    with colibri_lab.Engine(out) as eng:
        got = eng.forward(ids)
    assert float(np.max(np.abs(got - ref))) < 0.3
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.8


def test_stage_run_equals_forward(models):
    """colibri_stage_*: an MLA layer's attention stage shows q, the latent rows as k, an
    empty v and att; running every stage gives the fused forward's logits."""
    _, path = models("v3-groups")
    s = SHAPES["v3-groups"]
    ids = random_ids(s.vocab, 9, seed=2)
    with colibri_lab.Engine(path) as eng:
        full = eng.forward(ids)
        run = eng.stages(ids)
        run.embedding()
        att = run.attention()
        assert att["q"].shape == (9, s.heads * (s.nope + s.rope))
        assert att["k"].shape == (9, s.kv_lora + s.rope) and att["v"].shape == (9, 0)
        assert att["att"].shape == (9, s.heads * s.v_dim)
        while not run.done:
            run.run()
        assert np.array_equal(run.logits, full)


def test_kv_bytes_per_token_gqa(tmp_path):
    """The same fact for a grouped-query file: keys and values of every KV head."""
    from colibri_lab.bench.models import FamilyShape, build_model, save_checkpoint

    shape = FamilyShape("qwen3_moe", vocab=300, hidden=32, inter=16, layers=2, heads=4,
                        kv_heads=2, head_dim=8, experts=4, top_k=2, seed=1)
    folder = save_checkpoint(build_model(shape), tmp_path / "hf")
    out = tmp_path / "q3.colibri"
    colibri_lab.convert(folder, out, dtype="f32", progress=False)
    with colibri_lab.Engine(out) as eng:
        assert eng.config.kv_bytes_per_token == 2 * 2 * 8 * 4 * 2


def test_fork_copy_on_write_latent_cache(models):
    """A forked sequence shares the latent blocks; writing past the fork point copies the
    partly filled block (keys only: the latent cache has no values), and both branches
    continue exactly as if run alone."""
    _, path = models("v2-group-yarn")
    v = SHAPES["v2-group-yarn"].vocab
    prompt, a, b = random_ids(v, 13, 1), random_ids(v, 6, 2), random_ids(v, 6, 3)
    with colibri_lab.Engine(path) as eng:
        ref_a = eng.forward(prompt + a)[-1]
        ref_b = eng.forward(prompt + b)[-1]
    with colibri_lab.Engine(path, max_seqs=2, kv_block_tokens=8) as eng:
        s0 = eng.sequence(0)
        s0.append(prompt)
        s1 = s0.fork(1)
        got_a = s0.append(a)[-1]
        got_b = s1.append(b)[-1]
    assert np.max(np.abs(got_a - ref_a)) <= 1e-5 and np.max(np.abs(got_b - ref_b)) <= 1e-5


def test_fast_precision_runs(models):
    """precision="fast" (bf16 activations into bf16 matmuls) stays close to exact (a
    token whose expert choice flips differs more: the median over tokens is compared)."""
    _, path = models("v3-groups", dtype="bf16")
    ids = random_ids(SHAPES["v3-groups"].vocab, 40, seed=12)
    with colibri_lab.Engine(path) as eng:
        exact = eng.forward(ids)
    with colibri_lab.Engine(path, precision="fast") as eng:
        fast = eng.forward(ids)
    assert np.isfinite(fast).all()
    assert float(np.median(np.abs(fast - exact).max(-1))) < 0.05
    assert np.mean(fast.argmax(-1) == exact.argmax(-1)) >= 0.9
