"""Observation in the engine: traces (``Engine.trace``) and stage-by-stage execution
(``Engine.stages``), checked against the fused forward and against transformers.

- Running every stage in order gives exactly (bit for bit) the fused forward's logits,
  and leaves the KV cache so that decoding continues equal to a full forward.
- Per-layer hidden states equal transformers' ``output_hidden_states`` and router logits
  its ``output_router_logits`` (tolerance of the core parity tests); the shared-expert
  gate equals sigmoid of Qwen2-MoE's ``shared_expert_gate`` output.
- Trace arrays are consistent: ids in range, group sizes sum to tokens × k, padding is
  group sizes rounded up, weights sum to 1 where the family renormalises, top-k equal to
  transformers' choice, tokens appended across forwards, capacity respected.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri_lab  # noqa: E402
from colibri_lab import ColibriInvalidArgError  # noqa: E402
from colibri_lab.runtime.trace import ALL_STAGES, STAGES, Trace  # noqa: E402

from colibri_lab.bench.models import FamilyShape, MixtralShape, build_model  # noqa: E402
from helpers import ModelCache, first_near_tie, random_ids  # noqa: E402

TOL = 1e-4

MIXTRAL = MixtralShape(vocab=1003, hidden=67, inter=45, layers=3, heads=4, kv_heads=2, head_dim=10,
                experts=6, top_k=2, seed=21)  # fmt: skip
QWEN2 = FamilyShape("qwen2_moe", vocab=1001, hidden=70, inter=38, dense_inter=90, shared_inter=54,
                    layers=4, heads=5, kv_heads=1, experts=6, top_k=2, norm_topk=True,
                    mlp_only_layers=(2,), seed=22)  # fmt: skip


def _build(shape):
    return build_model(shape) if isinstance(shape, MixtralShape) else build_model(shape)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ModelCache(tmp_path_factory, {"mixtral": MIXTRAL, "qwen2": QWEN2}, _build)


def _stagewise(eng, ids, start_pos=0):
    run = eng.stages(ids, start_pos)
    assert run.next_stage == "embedding" and run.layer == -1
    run.embedding()
    for layer in range(eng.config.n_layers):
        for st in STAGES:
            assert (run.next_stage, run.layer) == (st, layer)
            run.run(st)
    assert run.next_stage == "lm_head"
    logits = run.lm_head()
    assert run.done and run.next_stage is None
    return logits


@pytest.mark.parametrize("key", ["mixtral", "qwen2"])
def test_stages_equal_fused_forward(models, key):
    _, path = models(key)
    ids = random_ids(1000, 23, seed=1)
    with colibri_lab.Engine(path, max_batch=32) as eng:
        fused = eng.forward(ids)
        staged = _stagewise(eng, ids)
        assert np.array_equal(fused, staged), "stage by stage must compute exactly the fused forward"
        assert eng.cached_len == len(ids)
        # continue from the staged prefix: decode equals the full forward
        more = random_ids(1000, 5, seed=2)
        step = _stagewise(eng, more, start_pos=len(ids))
        full = eng.forward(ids + more)
        assert float(np.max(np.abs(step - full[len(ids):]))) <= 1e-5
        # run_to / run_layer / finish reach the same logits
        run = eng.stages(ids)
        run.embedding()
        run.run_to(2)
        assert (run.next_stage, run.layer) == ("attention", 2)
        run.run_layer()
        assert run.layer == 3 or run.next_stage == "lm_head"
        assert np.array_equal(run.finish(), fused)


def test_hidden_states_and_router_logits_match_transformers(models):
    model, path = models("mixtral")
    ids = random_ids(1003, 40, seed=3)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True, output_router_logits=True)
    hs = [h[0].numpy() for h in out.hidden_states]
    rl = [r.numpy() for r in out.router_logits]
    cut = first_near_tie(out.router_logits, MIXTRAL.top_k) or len(ids)
    with colibri_lab.Engine(path) as eng:
        run = eng.stages(ids)
        x = run.embedding()["x"]
        assert float(np.max(np.abs(x - hs[0]))) <= TOL
        for layer in range(MIXTRAL.layers):
            run.attention()
            r = run.router()
            d = float(np.max(np.abs(r["router_logits"][:cut] - rl[layer][:cut])))
            assert d <= TOL, f"layer {layer}: router logits differ by {d:.3g}"
            run.grouping()
            run.expert_ffn()
            x = run.combine()["x"]
            if layer < MIXTRAL.layers - 1:  # transformers' last entry is after the final norm
                d = float(np.max(np.abs(x[:cut] - hs[layer + 1][:cut])))
                assert d <= TOL, f"hidden state after layer {layer} differs by {d:.3g}"
        run.lm_head()
        d = float(np.max(np.abs(run.tensor("xn")[:cut] - hs[-1][:cut])))
        assert d <= TOL, f"final normed hidden state differs by {d:.3g}"


def test_stage_tensors_describe_the_grouping(models):
    _, path = models("mixtral")
    ids = random_ids(1003, 19, seed=4)
    with colibri_lab.Engine(path, group_pad=4) as eng:
        run = eng.stages(ids)
        run.embedding()
        run.attention()
        r = {k: v.copy() for k, v in run.router().items()}
        g = run.grouping()
        counts = np.bincount(r["topk_ids"].ravel(), minlength=MIXTRAL.experts)
        assert np.array_equal(g["expert_count"], counts)
        padded = -(-counts // 4) * 4
        assert np.array_equal(np.diff(g["expert_offset"]), padded)
        rows = g["row_token"]
        assert len(rows) == padded.sum() and (rows == -1).sum() == (padded - counts).sum()
        # each grouped row holds its token's normed input; padding rows are zero
        xn = run.tensor("xn")
        real = rows >= 0
        assert np.array_equal(g["ex_in"][real], xn[rows[real]])
        assert not g["ex_in"][~real].any()
        # an intervention: zeroing the FFN input of the run changes the result
        out = run.expert_ffn()
        assert out["ex_out"].shape == (len(rows), MIXTRAL.hidden)


def test_stage_errors(models):
    _, path = models("mixtral")
    with colibri_lab.Engine(path, max_batch=8) as eng:
        run = eng.stages([1, 2, 3])
        with pytest.raises(ColibriInvalidArgError, match="runs next"):
            run.attention()
        run.embedding()
        eng.forward([4, 5])  # a forward abandons the stage run
        assert run.done
        with pytest.raises(ColibriInvalidArgError, match="finished"):
            run.attention()
        with pytest.raises(ColibriInvalidArgError, match="max_batch"):
            eng.stages(list(range(9)))
        with pytest.raises(colibri_lab.ColibriTokenRangeError):
            eng.stages([5000])
        with pytest.raises(ColibriInvalidArgError, match="unknown name"):
            eng.stages([1]).tensor("nope")


@pytest.mark.parametrize("key,norm", [("mixtral", True), ("qwen2", True)])
def test_trace_is_consistent_and_matches_transformers(models, key, norm):
    model, path = models(key)
    shape = MIXTRAL if key == "mixtral" else QWEN2
    ids = random_ids(1000, 30, seed=5)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    with colibri_lab.Engine(path, group_pad=8, max_batch=16) as eng:
        with eng.trace() as tr:
            eng.forward(ids)
    assert isinstance(tr, Trace)
    tr.check()
    L, T, E, K = shape.layers, len(ids), shape.experts, shape.top_k
    assert tr.router_probs.shape == (L, T, E) and tr.topk_ids.shape == (L, T, K)
    assert tr.n_forwards == 2 and tr.dropped == 0  # 30 tokens in chunks of 16
    assert np.array_equal(tr.token_ids, ids) and np.array_equal(tr.positions, np.arange(T))
    moe = tr.layer_is_moe
    if key == "qwen2":
        assert moe.tolist() == [True, True, False, True]
        assert np.isnan(tr.router_probs[2]).all() and (tr.topk_ids[2] == -1).all()
        assert np.isnan(tr.shared_gate[2]).all()
    else:
        assert moe.all() and np.isnan(tr.shared_gate).all()
    assert np.allclose(tr.topk_weights[moe].sum(-1), 1.0, atol=1e-6)
    assert (tr.padded_group_sizes % 8 == 0).all()
    cut = first_near_tie(out.router_logits, K) or T
    for m, layer in enumerate(np.flatnonzero(moe)):
        probs = torch.softmax(out.router_logits[m].float(), -1).numpy()
        assert float(np.max(np.abs(tr.router_probs[layer][:cut] - probs[:cut]))) <= TOL
        ref = np.sort(np.argsort(-probs, axis=-1, kind="stable")[:, :K], axis=-1)
        assert np.array_equal(np.sort(tr.topk_ids[layer][:cut], axis=-1), ref[:cut])
    assert (tr.timings_ns[moe] > 0).all() and tr.embedding_ns > 0 and tr.lm_head_ns > 0
    assert set(tr.stage_totals()) == set(ALL_STAGES)


def test_trace_shared_gate_matches_transformers(models):
    model, path = models("qwen2")
    ids = random_ids(1000, 17, seed=6)
    gates = {}
    hooks = [
        layer.mlp.shared_expert_gate.register_forward_hook(
            lambda mod, inp, out, i=i: gates.__setitem__(i, torch.sigmoid(out.reshape(-1)).numpy()))
        for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "shared_expert_gate")
    ]  # fmt: skip
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    assert sorted(gates) == [0, 1, 3]
    with colibri_lab.Engine(path) as eng:
        with eng.trace() as tr:
            eng.forward(ids)
    for i, g in gates.items():
        assert float(np.max(np.abs(tr.shared_gate[i] - g))) <= TOL


def test_trace_across_generate_capacity_and_save(models, tmp_path):
    _, path = models("mixtral")
    prompt = random_ids(1003, 6, seed=7)
    with colibri_lab.Engine(path) as eng:
        with eng.trace() as tr:
            got = [t.id for t in eng.generate(prompt, max_new_tokens=5, stop_at_eos=False)]
        # 6 prompt tokens + 4 fed back (the 5th token is sampled, never fed)
        assert tr.n_tokens == 10 and tr.n_forwards == 5
        assert tr.token_ids.tolist() == prompt + got[:4]
        assert tr.positions.tolist() == list(range(10))
        assert tr.token_texts == [str(i) for i in tr.token_ids]  # no tokenizer in this file
        with eng.trace(capacity=4) as small:
            eng.forward(prompt)
        assert small.n_tokens == 4 and small.dropped == 2
        assert np.array_equal(small.topk_ids, tr.topk_ids[:, :4])
        # group sizes still count every token seen (they are per chunk, not per row)
        assert small.group_sizes.sum() == MIXTRAL.layers * 6 * MIXTRAL.top_k
        # no trace attached now: a forward records nothing anywhere
        eng.forward(prompt)
    tr.save(tmp_path / "t.npz")
    back = Trace.load(tmp_path / "t.npz")
    for k, v in tr.to_dict().items():
        if isinstance(v, np.ndarray):
            assert np.array_equal(v, getattr(back, k), equal_nan=v.dtype.kind == "f"), k
        else:
            assert v == getattr(back, k), k
    assert "tokens" in tr._repr_html_() and "expert_ffn" in tr._repr_html_()


def test_trace_token_texts_from_tokenizer(make_model):
    _, path = make_model()
    with colibri_lab.Engine(path) as eng:
        ids = eng.tokenizer.encode("def f(x):\n    return x")
        with eng.trace() as tr:
            eng.forward(ids)
    assert tr.token_texts[0] == "<s>" and "▁def" in tr.token_texts
    assert len(tr.token_texts) == len(ids)
