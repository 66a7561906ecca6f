"""The expert cache (colibri_options.expert_cache_mb / expert_cache_slots; docs/expert_cache.md):
routed experts in a fixed number of slots per MoE layer, read from the file on a miss by an
I/O thread, with the LRU, LFU, pinned and predict policies.

What must hold: with any budget (1 slot, a few, all) and any policy, every logit is bitwise
the fully mapped run's, for prefill chunks, decode steps, batches of sequences and
stage-by-stage runs; the counters add up (hits + misses = uses, prefetch hits <= prefetches);
and the engine's measured hits and misses at decode equal colibri_lab.analysis.cachesim's simulation
of the same routing trace, exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import colibri_lab
from colibri_lab import ColibriInvalidArgError, ColibriUnsupportedError, Engine

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("lru", "lfu", "pinned", "predict")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Mixtral (packed bf16 experts; split q4_k_m experts in a version-2 file), a
    Qwen2-MoE with a dense layer and a shared expert (f32), a gpt-oss (MXFP4) and a
    DeepSeek-V3 (bf16, MLA, grouped routing)."""
    out = tmp_path_factory.mktemp("ecache")
    files = {dt: colibri_lab.convert(REPO / "data" / "tiny-mixtral", out / f"tiny-{dt}.colibri", dtype=dt,
                                     progress=False) for dt in ("bf16", "q4_k_m")}
    pytest.importorskip("torch")
    from colibri_lab.bench.models import FamilyShape, build_model, save_checkpoint

    shape = FamilyShape("qwen2_moe", layers=3, mlp_only_layers=(1,), seed=7)
    files["qwen2"] = colibri_lab.convert(save_checkpoint(build_model(shape), out / "hf-q2"),
                                         out / "q2.colibri", dtype="f32", progress=False)
    # gpt-oss: MXFP4 experts with biases through the clamped SwiGLU; DeepSeek-V3: grouped
    # sigmoid routing with a correction bias, a dense first layer, a shared expert
    gpt = FamilyShape("gpt_oss", vocab=301, hidden=64, inter=32, layers=2, heads=4, kv_heads=2, head_dim=16,
                      experts=4, top_k=2, sliding_window=5, swiglu_limit=1.0, seed=5)
    files["gptoss"] = colibri_lab.convert(save_checkpoint(build_model(gpt), out / "hf-gpt"),
                                          out / "gpt.colibri", dtype="mxfp4", progress=False)
    from colibri_lab.bench.models import DeepseekShape, build_model

    ds = DeepseekShape("deepseek_v3", n_group=4, topk_group=2, topk_method="noaux_tc", seed=3)
    files["deepseek"] = colibri_lab.convert(save_checkpoint(build_model(ds), out / "hf-ds"),
                                            out / "ds.colibri", dtype="bf16", progress=False)
    from colibri_lab.bench.models import MixtralShape, build_model

    # experts of 1.5 MiB (f32, 128 x 1024): a 1 MiB budget holds none
    wide = build_model(MixtralShape(hidden=128, inter=1024, layers=2, experts=4, top_k=2, heads=4, kv_heads=4))
    files["wide"] = colibri_lab.convert(save_checkpoint(wide, out / "hf-wide"), out / "wide.colibri",
                                        dtype="f32", progress=False)
    return files


def _run(eng, prompt, steps):
    """Prefill `prompt`, then `steps` greedy decode steps: every logit row, stacked."""
    rows = [eng.forward(prompt)]
    tok = int(np.argmax(rows[-1][-1]))
    for i in range(steps):
        rows.append(eng.forward([tok], start_pos=len(prompt) + i))
        tok = int(np.argmax(rows[-1][-1]))
    return np.concatenate(rows)


def _prompt(vocab, n, seed=0):
    return np.random.default_rng(seed).integers(3, vocab, size=n).astype(np.int32)


@pytest.mark.parametrize("model", ["bf16", "q4_k_m", "qwen2", "gptoss", "deepseek"])
@pytest.mark.parametrize("policy", POLICIES)
def test_logits_bitwise_equal_any_budget(models, model, policy):
    path = models[model]
    with Engine(path, num_threads=2) as ref:
        E = ref.config.n_experts
        prompt = _prompt(ref.vocab_size, 23)
        want = _run(ref, prompt, 12)
    for slots in sorted({1, 2, 3, E}):
        with Engine(path, num_threads=2, expert_cache_slots=slots, expert_cache_policy=policy) as eng:
            assert eng.config.expert_cache_slots == slots
            assert eng.config.expert_cache_policy == policy
            if policy == "pinned" and slots > 1:
                for layer in np.flatnonzero(eng._layer_is_moe()):
                    eng.pin_experts(int(layer), range(slots - 1))
            got = _run(eng, prompt, 12)
            assert np.array_equal(got, want), f"{model} {policy} slots={slots}: logits differ"
            st = eng.expert_cache_stats()
            assert st["misses"] + st["prefetches"] > 0 and st["bytes_read"] > 0
            if slots == E:  # nothing is ever evicted: each expert is read at most once
                assert st["misses"] <= int(eng._layer_is_moe().sum()) * E


def test_batches_and_stages_bitwise(models):
    """Several sequences in one batch and a stage-by-stage run, through a 1-slot cache."""
    path = models["qwen2"]
    prompts = [_prompt(1003, n, seed=n) for n in (9, 4, 13)]
    with Engine(path, max_seqs=3) as ref, Engine(path, max_seqs=3, expert_cache_slots=1,
                                                   expert_cache_policy="predict") as eng:
        for e in (ref, eng):
            e._want = e.batch([(i, p) for i, p in enumerate(prompts)], logits="all")
        for a, b in zip(ref._want, eng._want):
            assert np.array_equal(a, b)
        want = ref.forward(prompts[0])
        st = eng.stages(prompts[0])
        st.run_to(1)
        st.expert_ffn() if st.next_stage == "expert_ffn" else None
        got = st.finish()
        assert np.array_equal(got, want)
        # an abandoned stage run leaves the cache consistent: the next forward still agrees
        st = eng.stages(prompts[1])
        st.run_to(1)
        st.attention(), st.router(), st.grouping()
        assert np.array_equal(eng.forward(prompts[2]), ref.forward(prompts[2]))


@pytest.mark.parametrize("policy", POLICIES)
def test_counters_add_up(models, policy):
    path = models["bf16"]
    with Engine(path, expert_cache_slots=2, expert_cache_policy=policy) as eng:
        prompt = _prompt(eng.vocab_size, 17, seed=3)
        with eng.trace() as tr:
            _run(eng, prompt, 20)
        moe = tr.layer_is_moe
        uses = (tr.topk_ids[moe] >= 0).sum()
        assert tr.cache_hits.sum() + tr.cache_misses.sum() == uses
        assert (tr.cache_prefetch_hits <= tr.cache_prefetches).all()
        st = eng.expert_cache_stats()
        assert st["hits"] == tr.cache_hits.sum() and st["misses"] == tr.cache_misses.sum()
        assert np.array_equal(st["layer_hits"], tr.cache_hits)
        if policy == "predict":
            assert tr.cache_prefetches.sum() > 0
        else:
            assert tr.cache_prefetches.sum() == 0 and tr.cache_wasted_prefetches.sum() == 0


def test_predicted_ids_are_the_next_routers_choice(models):
    """The trace's predicted_ids for layer l are layer l's router applied to layer l-1's FFN
    input: recorded with or without a cache, -1 at layer 0, and mostly right on this model."""
    path = models["bf16"]
    with Engine(path) as eng:
        with eng.trace() as tr:
            eng.forward(_prompt(eng.vocab_size, 40, seed=1))
    p, t = tr.predicted_ids, tr.topk_ids
    assert (p[0] == -1).all() and (p[1:] >= 0).all()
    hit = np.mean([len(set(p[l, i]) & set(t[l, i])) / t.shape[2] for l in range(1, p.shape[0])
                   for i in range(p.shape[1])])
    assert hit > 1.0 / 4  # random guessing of 2 of 8 experts gives 1/4


@pytest.mark.parametrize("policy", ["lru", "lfu", "predict", "pinned"])
@pytest.mark.parametrize("slots", [1, 2, 5])
def test_engine_equals_simulator_at_decode(models, policy, slots):
    """Decode with one sequence is one step per token: the engine's hits and misses per layer
    equal the simulator's on the engine's own routing trace, exactly."""
    cachesim = pytest.importorskip("colibri_lab.analysis.cachesim")
    path = models["bf16"]
    with Engine(path, expert_cache_slots=slots, expert_cache_policy=policy) as eng:
        moe = np.flatnonzero(eng._layer_is_moe())
        pinned = None
        if policy == "pinned":
            pinned = np.full((eng.config.n_layers, slots // 2), -1, np.int32)
            for layer in moe:
                pinned[layer] = np.arange(slots // 2)[::-1] + 1
                eng.pin_experts(int(layer), pinned[layer])
        tok = 5
        with eng.trace() as tr:
            for i in range(60):  # token by token: every step is one token; greedy, with a jump now and then
                tok = int(np.argmax(eng.forward([tok], start_pos=i)[-1]))
                if i % 7 == 0:
                    tok = (i * 37) % 1000 + 3
    kw = {"pinned": pinned} if pinned is not None else {}
    sim = cachesim.simulate(tr, slots, policy, **kw)
    assert np.array_equal(sim.hits[moe], tr.cache_hits[moe]), (sim.hits, tr.cache_hits)
    assert np.array_equal(sim.misses[moe], tr.cache_misses[moe]), (sim.misses, tr.cache_misses)
    if policy == "predict":
        assert np.array_equal(sim.prefetch_hits[moe], tr.cache_prefetch_hits[moe])
        assert np.array_equal(sim.wasted_prefetches[moe], tr.cache_wasted_prefetches[moe])


def test_errors(models, tmp_path):
    path = models["bf16"]
    with pytest.raises(ColibriInvalidArgError, match="expert_cache_policy"):
        Engine(path, expert_cache_mb=64, expert_cache_policy="fifo")
    with pytest.raises(ColibriInvalidArgError, match="expert_cache_mb"):
        Engine(path, expert_cache_mb=-1)
    with pytest.raises(ColibriInvalidArgError, match="not both"):
        Engine(path, expert_cache_mb=64, expert_cache_slots=2)
    with Engine(path, expert_cache_slots=3, expert_cache_policy="pinned") as eng:
        with pytest.raises(ColibriInvalidArgError, match="leave at least one"):
            eng.pin_experts(0, [0, 1, 2])
        with pytest.raises(ColibriInvalidArgError, match="not in"):
            eng.pin_experts(0, [9])
        with pytest.raises(ColibriInvalidArgError, match="twice"):
            eng.pin_experts(0, [1, 1])
        with pytest.raises(ColibriInvalidArgError, match="not a MoE layer|not in"):
            eng.pin_experts(99, [1])
        eng.pin_experts(0, [])
    with Engine(path) as eng:
        with pytest.raises(ColibriUnsupportedError, match="no expert cache"):
            eng.pin_experts(0, [1])
        assert eng.config.expert_cache_slots == 0 and eng.config.expert_cache_policy == ""
    # a budget under one slot per layer names the least that works, and that budget works
    with pytest.raises(ColibriInvalidArgError, match=r"less than one expert per MoE layer.*at least (\d+) MiB") as ex:
        Engine(models["wide"], expert_cache_mb=1)
    need = int(__import__("re").search(r"at least (\d+) MiB", str(ex.value)).group(1))
    with Engine(models["wide"], expert_cache_mb=need) as eng:
        assert eng.config.expert_cache_slots >= 1
        assert eng.config.expert_cache_slot_bytes * eng.config.expert_cache_slots * 2 <= need << 20
