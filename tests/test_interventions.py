"""Interventions in the engine (colibri.h, "Interventions"; Engine.intervene) against
transformers with the same intervention done by hooks on the same weights: router logits
biased or masked (the router's own linear output changed), the experts' routing replaced or an
expert's weight zeroed (the experts module's inputs changed), a residual or attention output
replaced or shifted (a decoder layer's input, the attention module's output). f32 logits
within 1e-4, for Mixtral, Qwen2-MoE (shared expert), DeepSeek-V3 (grouped sigmoid routing:
an excluded expert is out before the group selection) and gpt-oss. Then what the engine adds:
batch independence, stage runs, generation, the logit lens, bits unchanged once cleared, and
bad arguments refused.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import colibri_lab  # noqa: E402
from colibri_lab import ColibriError  # noqa: E402
from colibri_lab.bench.models import DeepseekShape, FamilyShape, MixtralShape  # noqa: E402
from helpers import ModelCache, compare_logits, random_ids  # noqa: E402

TOL = 1e-4
F = torch.nn.functional

SHAPES = {
    "mixtral": MixtralShape(vocab=301, hidden=48, inter=40, layers=2, heads=4, kv_heads=2, experts=6, top_k=2,
                            seed=41),
    "qwen2_moe": FamilyShape("qwen2_moe", vocab=307, hidden=40, inter=24, dense_inter=50, shared_inter=36,
                             layers=3, heads=4, kv_heads=2, experts=6, top_k=2, mlp_only_layers=(1,), seed=42),
    "deepseek_v3": DeepseekShape("deepseek_v3", vocab=311, hidden=40, inter=18, dense_inter=36, layers=3, heads=3,
                                 q_lora=13, kv_lora=14, nope=8, rope=6, v_dim=7, experts=8, top_k=3, shared=1,
                                 first_dense=1, n_group=4, topk_group=2, norm_topk=True, scale=2.5, seed=43),
    "gpt_oss": FamilyShape("gpt_oss", vocab=313, hidden=44, inter=27, layers=2, heads=4, kv_heads=2, head_dim=10,
                           experts=5, top_k=2, sliding_window=6, swiglu_limit=1.2, seed=44),
}
N = 24  # tokens per test sequence


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ModelCache(tmp_path_factory, SHAPES)


@pytest.fixture(scope="module")
def engines(models):
    opened = {}

    def get(key):
        if key not in opened:
            _, path = models(key)
            opened[key] = colibri_lab.Engine(path, max_seqs=3)
        return opened[key]

    yield get
    for eng in opened.values():
        eng.close()


# ---- transformers with hooks --------------------------------------------------------


def _parts(model, layer):
    """(decoder layer, router, experts module or None) of layer `layer`."""
    dec = model.model.layers[layer]
    router = experts = None
    for _, m in dec.named_modules():
        name = type(m).__name__
        if "Router" in name:
            router = m
        elif name.endswith("Experts"):
            experts = m
    return dec, router, experts


@contextlib.contextmanager
def hf_intervene(model, ablate=None, zero=None, force=None, bias=None, patch=None, add=None, attn_add=None,
                 expert_add=None):
    """transformers' forward under the same interventions, by hooks. ablate/zero/bias by
    layer; force {(layer, pos): (ids, w)}; patch/add {(layer, pos): vec} on the residual
    entering the layer (layer = n_layers: entering the final norm); attn_add {(layer, pos):
    vec} on the attention output; expert_add {(layer, pos, e): vec} on expert e's output."""
    ablate, zero, force, bias = ablate or {}, zero or {}, force or {}, bias or {}
    patch, add, attn_add, expert_add = patch or {}, add or {}, attn_add or {}, expert_add or {}
    handles, n_layers = [], len(model.model.layers)
    layers = set(ablate) | set(zero) | set(bias) | {k[0] for k in force} | {k[0] for k in expert_add}
    for layer in layers:
        _, router, experts = _parts(model, layer)
        state = {}

        def pre(mod, args, layer=layer, state=state):
            real = F.linear
            state["real"] = real

            def lin(x, w, b=None):
                y = real(x, w, b)
                if w.data_ptr() == mod.weight.data_ptr():
                    if layer in bias:
                        y = y + torch.tensor(np.asarray(bias[layer], np.float32))
                    if layer in ablate:
                        y = y.clone()
                        y[:, ablate[layer]] = -torch.inf
                return y

            F.linear = lin
            cb = getattr(mod, "e_score_correction_bias", None)
            if cb is not None and layer in ablate:  # sigmoid choice: the excluded are never chosen
                state["cb"] = cb.clone()
                cb[ablate[layer]] = -torch.inf

        def post(mod, args, out, state=state):
            F.linear = state.pop("real")
            if "cb" in state:
                mod.e_score_correction_bias.copy_(state.pop("cb"))

        def ex_pre(mod, args, layer=layer):
            h, idx, w = args
            idx, w = idx.clone(), w.clone()
            for (fl, pos), (ids, ws) in force.items():
                if fl == layer:
                    idx[pos] = torch.tensor(ids)
                    w[pos] = torch.tensor(ws, dtype=w.dtype)
            for e in zero.get(layer, []):
                w[idx == e] = 0.0
            return (h, idx, w)

        def ex_post(mod, args, out, layer=layer):
            _, idx, w = args
            out = out.clone()
            for (fl, pos, e), vec in expert_add.items():
                if fl == layer:
                    hit = (idx[pos] == e).nonzero()
                    if len(hit):
                        out[pos] += w[pos, hit[0, 0]] * torch.tensor(np.asarray(vec, np.float32))
            return out

        handles += [router.register_forward_pre_hook(pre), router.register_forward_hook(post),
                    experts.register_forward_pre_hook(ex_pre), experts.register_forward_hook(ex_post)]
    for (layer, pos), vec in list(patch.items()) + list(add.items()):
        target = model.model.norm if layer == n_layers else model.model.layers[layer]
        replace = (layer, pos) in patch

        def rpre(mod, args, kwargs, pos=pos, vec=vec, replace=replace):
            h = (args[0] if args else kwargs["hidden_states"]).clone()
            v = torch.tensor(np.asarray(vec, np.float32))
            h[0, pos] = v if replace else h[0, pos] + v
            if args:
                return (h, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": h}

        handles.append(target.register_forward_pre_hook(rpre, with_kwargs=True))
    for (layer, pos), vec in attn_add.items():
        def apost(mod, args, out, pos=pos, vec=vec):
            o = out[0].clone()
            o[0, pos] += torch.tensor(np.asarray(vec, np.float32))
            return (o, *out[1:])

        handles.append(model.model.layers[layer].self_attn.register_forward_hook(apost))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def hf_run(model, ids, **iv):
    with hf_intervene(model, **iv), torch.no_grad():
        out = model(torch.tensor([list(ids)]), output_router_logits=True)
    return out.logits[0].float().numpy(), out.router_logits


def hf_capture(model, ids, layer):
    """The residual entering `layer` (n_layers: entering the final norm), [T, H]."""
    n = len(model.model.layers)
    target = model.model.norm if layer == n else model.model.layers[layer]
    got = {}

    def pre(mod, args, kwargs):
        got["h"] = (args[0] if args else kwargs["hidden_states"])[0].detach().clone()

    h = target.register_forward_pre_hook(pre, with_kwargs=True)
    with torch.no_grad():
        model(torch.tensor([list(ids)]))
    h.remove()
    return got["h"].numpy()


def moe_layers(key):
    s = SHAPES[key]
    if key == "qwen2_moe":
        return [0, 2]
    if key == "deepseek_v3":
        return list(range(1, s.layers))
    return list(range(s.layers))


def check(ref, router_logits, got, key, what):
    compare_logits(ref, got, router_logits, SHAPES[key].top_k, f"{key} {what}", tol=TOL)


# ---- parity with transformers -------------------------------------------------------

FAMILIES = list(SHAPES)


@pytest.mark.parametrize("key", FAMILIES)
def test_ablate_exclude(models, engines, key):
    model, _ = models(key)
    eng = engines(key)
    ls = moe_layers(key)
    ablate = {ls[0]: [1, 3], ls[-1]: [0]}
    ids = random_ids(SHAPES[key].vocab, N, seed=1)
    ref, rl = hf_run(model, ids, ablate=ablate)
    plain, _ = hf_run(model, ids)
    assert np.max(np.abs(ref - plain)) > 1e-3, "the ablation changes nothing: choose other experts"
    with eng.intervene(ablate=ablate), eng.trace() as tr:
        got = eng.forward(ids)
    check(ref, rl, got, key, "ablate")
    for layer, experts in ablate.items():  # never chosen
        assert not np.isin(tr.topk_ids[layer], experts).any()


@pytest.mark.parametrize("key", FAMILIES)
def test_zero_output(models, engines, key):
    model, _ = models(key)
    eng = engines(key)
    ls = moe_layers(key)
    zero = {ls[0]: [0, 2]}
    ids = random_ids(SHAPES[key].vocab, N, seed=2)
    ref, rl = hf_run(model, ids, zero=zero)
    with eng.trace() as plain_tr:
        plain = eng.forward(ids)
    assert np.max(np.abs(ref - plain)) > 1e-3
    with eng.intervene(zero=zero), eng.trace() as tr:
        got = eng.forward(ids)
    check(ref, rl, got, key, "zero")
    # chosen as usual at the layer: the routing there is the plain run's
    np.testing.assert_array_equal(tr.topk_ids[ls[0]], plain_tr.topk_ids[ls[0]])
    with eng.intervene(ablate=zero, mode="zero"):  # the same by mode=
        assert np.array_equal(eng.forward(ids), got)


@pytest.mark.parametrize("key", FAMILIES)
def test_router_bias(models, engines, key):
    model, _ = models(key)
    eng = engines(key)
    E = SHAPES[key].experts
    layer = moe_layers(key)[-1]
    b = np.linspace(-1.5, 1.5, E).astype(np.float32)
    ids = random_ids(SHAPES[key].vocab, N, seed=3)
    ref, rl = hf_run(model, ids, bias={layer: b})
    with eng.intervene(router_bias={layer: b}):
        got = eng.forward(ids)
    check(ref, rl, got, key, "router bias")


@pytest.mark.parametrize("key", FAMILIES)
def test_force(models, engines, key):
    model, _ = models(key)
    eng = engines(key)
    K = SHAPES[key].top_k
    layer = moe_layers(key)[0]
    force = {(layer, 3): (list(range(K)), [0.9 - 0.1 * i for i in range(K)]),
             (layer, 10): (list(range(K, 0, -1)), [0.5] * K)}
    ids = random_ids(SHAPES[key].vocab, N, seed=4)
    ref, rl = hf_run(model, ids, force=force)
    with eng.intervene(force=force), eng.trace() as tr:
        got = eng.forward(ids)
    check(ref, rl, got, key, "force")
    for (fl, pos), (fids, fw) in force.items():
        np.testing.assert_array_equal(tr.topk_ids[fl, pos], fids)
        np.testing.assert_array_equal(tr.topk_weights[fl, pos], np.float32(fw))


@pytest.mark.parametrize("key", FAMILIES)
def test_patch_and_steer_residual(models, engines, key):
    """Record the residual entering a layer in one prompt, put it at another position of
    another prompt; steer (add) at a second layer; both against transformers."""
    model, _ = models(key)
    eng = engines(key)
    L, H = SHAPES[key].layers, SHAPES[key].hidden
    a = random_ids(SHAPES[key].vocab, N, seed=5)
    b = random_ids(SHAPES[key].vocab, N, seed=6)
    with eng.intervene(record=[("resid", 1, 4), ("resid", L, 7)]) as rec:
        eng.forward(a)
    src = rec.recorded[("resid", 1, 4)]
    np.testing.assert_allclose(src, hf_capture(model, a, 1)[4], rtol=0, atol=TOL)
    np.testing.assert_allclose(rec.recorded[("resid", L, 7)], hf_capture(model, a, L)[7], rtol=0, atol=TOL)
    steer = np.random.default_rng(7).standard_normal(H).astype(np.float32) * 0.5
    ref, rl = hf_run(model, b, patch={(1, 9): src}, add={(0, 5): steer})
    with eng.intervene(patch={("resid", 1, 9): src}, add={("resid", 0, 5): steer}):
        got = eng.forward(b)
    check(ref, rl, got, key, "patch+steer")


@pytest.mark.parametrize("key", ["mixtral", "deepseek_v3"])
def test_attention_and_expert_output(models, engines, key):
    model, _ = models(key)
    eng = engines(key)
    H = SHAPES[key].hidden
    layer = moe_layers(key)[0]
    ids = random_ids(SHAPES[key].vocab, N, seed=8)
    rng = np.random.default_rng(9)
    va, ve = (rng.standard_normal(H).astype(np.float32) for _ in range(2))
    with eng.trace() as tr:
        eng.forward(ids)
    e = int(tr.topk_ids[layer, 6, 0])  # an expert position 6 chose
    ref, rl = hf_run(model, ids, attn_add={(layer, 2): va}, expert_add={(layer, 6, e): ve})
    with eng.intervene(add={("attn_out", layer, 2): va, ("expert_out", layer, 6, e): ve}):
        got = eng.forward(ids)
    check(ref, rl, got, key, "attn_out/expert_out")


# ---- what the engine promises beyond parity -----------------------------------------


def test_cleared_is_bitwise_plain(engines):
    eng = engines("mixtral")
    ids = random_ids(SHAPES["mixtral"].vocab, N, seed=10)
    before = eng.forward(ids)
    with eng.intervene(ablate={0: [1]}, router_bias={1: np.ones(6)}, record=[("resid", 1, 2)]):
        assert not np.array_equal(eng.forward(ids), before)
    assert np.array_equal(eng.forward(ids), before)


def test_batch_independence_per_sequence(engines):
    """Interventions belong to a sequence: in one batch, sequence 1 under an ablation and
    sequence 2 without get bitwise what each gets alone."""
    eng = engines("qwen2_moe")
    a = random_ids(SHAPES["qwen2_moe"].vocab, N, seed=11)
    b = random_ids(SHAPES["qwen2_moe"].vocab, N, seed=12)
    for q in (0, 1, 2):
        eng.sequence(q).clear()
    alone_b = eng.batch([(2, b)], logits="all")[0]
    eng.sequence(2).clear()
    with eng.intervene(ablate={0: [0, 1]}, force={(2, 5): ([3, 4], [0.6, 0.4])}, seq=1):
        alone_a = eng.batch([(1, a)], logits="all")[0]
        eng.sequence(1).clear()
        both = eng.batch([(1, a), (2, b)], logits="all")
    assert np.array_equal(both[0], alone_a)
    assert np.array_equal(both[1], alone_b)
    eng.sequence(0).clear()
    with eng.intervene(ablate={0: [0, 1]}, force={(2, 5): ([3, 4], [0.6, 0.4])}):
        assert np.array_equal(eng.forward(a), alone_a)  # the same settings for every sequence
    for q in (1, 2):
        eng.sequence(q).clear()


def test_stage_run_and_generation(engines):
    eng = engines("mixtral")
    ids = random_ids(SHAPES["mixtral"].vocab, 12, seed=13)
    iv = dict(ablate={1: [0, 2]}, force={(0, 4): ([5, 1], [0.7, 0.3])})
    with eng.intervene(**iv):
        fused = eng.forward(ids)
        run = eng.stages(ids)
        staged = run.finish()
        assert np.array_equal(staged, fused)
        toks = [t.id for t in eng.generate(ids, max_new_tokens=5, temperature=0.0, stop_at_eos=False)]
    # greedy decoding under the interventions, step by step with full forwards
    seq = list(ids)
    with eng.intervene(**iv):
        for _ in range(5):
            seq.append(int(np.argmax(eng.forward(seq)[-1])))
    assert toks == seq[len(ids):]


def test_logit_lens(models, engines):
    """The engine's lens (final norm + LM head on recorded residuals) equals transformers'
    norm and head on its own residuals, and numpy on the engine's."""
    model, _ = models("mixtral")
    eng = engines("mixtral")
    L = SHAPES["mixtral"].layers
    ids = random_ids(SHAPES["mixtral"].vocab, N, seed=14)
    keys = [("resid", layer, p) for layer in range(L + 1) for p in (3, N - 1)]
    with eng.intervene(record=keys) as rec:
        full = eng.forward(ids)
    rows = np.stack([rec.recorded[k] for k in keys])
    lens = eng.lens(rows)
    w_norm = model.model.norm.weight.detach().numpy()
    w_head = model.lm_head.weight.detach().numpy()
    x = rows.astype(np.float64)
    ref = (x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w_norm) @ w_head.T.astype(np.float64)
    np.testing.assert_allclose(lens, ref, rtol=0, atol=TOL)
    # the last layer's row of the lens is the forward's own logits, bit for bit
    for i, (_, layer, p) in enumerate(keys):
        if layer == L:
            assert np.array_equal(lens[i], full[p])


def test_prefix_cache_not_fed_by_interventions(models):
    _, path = models("mixtral")
    ids = random_ids(SHAPES["mixtral"].vocab, 40, seed=15)
    with colibri_lab.Engine(path, max_seqs=2, kv_block_tokens=16) as eng:
        plain = eng.forward(ids)
        eng.sequence(0).clear()
        with eng.intervene(ablate={0: [0, 1, 2]}):
            eng.forward(ids)
            eng.sequence(0).clear()
        s = eng.sequence(1)
        n = s.reuse_prefix(ids)
        got = s.append(ids[n:], logits="all")
        assert np.array_equal(got, plain[n:])


@pytest.mark.parametrize("kwargs, match", [
    (dict(ablate={7: [0]}), "layer 7"),
    (dict(ablate={0: [6]}), "expert 6"),
    (dict(ablate={0: [0, 1, 2, 3, 4]}), "fewer than top_k"),
    (dict(force={(0, 1): ([0], [1.0])}), "top_k"),
    (dict(force={(0, 1): ([2, 2], [0.5, 0.5])}), "twice"),
    (dict(router_bias={0: np.ones(5)}), "6 values"),
    (dict(patch={("resid", 0, 1): np.zeros(3)}), "48 values"),
    (dict(patch={("nowhere", 0, 1): np.zeros(48)}), "activation key"),
    (dict(add={("expert_out", 0, 1): np.zeros(48)}), "name an expert"),
    (dict(seq=5, ablate={0: [1]}), "sequence 5"),
])
def test_bad_arguments_change_nothing(engines, kwargs, match):
    eng = engines("mixtral")
    ids = random_ids(SHAPES["mixtral"].vocab, 8, seed=16)
    before = eng.forward(ids)
    with pytest.raises(ColibriError, match=match):
        with eng.intervene(**{"router_bias": {1: np.ones(6)}, **kwargs}):  # a good setting first
            pass
    assert np.array_equal(eng.forward(ids), before)


def test_dense_layer_refused(engines):
    eng = engines("qwen2_moe")
    with pytest.raises(ColibriError, match="dense layer"):
        with eng.intervene(ablate={1: [0]}):
            pass
    with pytest.raises(ColibriError, match="already active"):
        with eng.intervene(ablate={0: [0]}), eng.intervene(ablate={2: [0]}):
            pass


# ---- readouts -------------------------------------------------------------------------


def test_routing_margins_equal_numpy(engines):
    """The trace's routing margins are the k-th minus (k+1)-th router logit and probability
    of each token, as numpy computes them from a stage run's router tensors."""
    eng = engines("qwen2_moe")
    K = SHAPES["qwen2_moe"].top_k
    ids = random_ids(SHAPES["qwen2_moe"].vocab, N, seed=17)
    with eng.trace() as tr:
        eng.forward(ids)
    run = eng.stages(ids)
    run.embedding()
    for layer in range(SHAPES["qwen2_moe"].layers):
        run.attention()
        r = run.router()
        if layer not in moe_layers("qwen2_moe"):
            assert np.isnan(tr.routing_margins[layer]).all()
        else:
            for j, name in enumerate(("router_logits", "router_probs")):
                v = -np.sort(-r[name], axis=-1)
                np.testing.assert_array_equal(tr.routing_margins[layer, :, j], v[:, K - 1] - v[:, K])
        run.run_layer()
    run.finish()
    frac = tr.near_tie_fraction(gap=0.05)
    assert np.isnan(frac[1]) and 0.0 <= frac[0] <= 1.0


def test_logit_lens_table(models, engines):
    from colibri_lab.runtime.interventions import logit_lens

    eng = engines("mixtral")
    ids = random_ids(SHAPES["mixtral"].vocab, N, seed=18)
    full = eng.forward(ids)
    target = int(np.argmax(full[5]))
    ll = logit_lens(eng, ids, [5, 9], target=target, k=4)
    L = SHAPES["mixtral"].layers
    assert ll["top_ids"].shape == (L, 2, 4)
    np.testing.assert_array_equal(ll["logits"][L - 1], full[[5, 9]])
    assert ll["target_rank"][L - 1, 0] == 0
    lg = ll["logits"]
    np.testing.assert_array_equal(ll["target_rank"], (lg > lg[..., target][..., None]).sum(-1))


@pytest.mark.parametrize("key", ["mixtral", "qwen2_moe"])
def test_expert_attribution_equals_numpy(models, engines, key):
    """Each chosen expert's weighted output . the target's unembedding / rms(final residual),
    against numpy on a stage run's expert outputs and the transformers model's weights."""
    from colibri_lab.runtime.interventions import expert_attribution

    model, _ = models(key)
    eng = engines(key)
    L, K = SHAPES[key].layers, SHAPES[key].top_k
    ids = random_ids(SHAPES[key].vocab, N, seed=19)
    pos, target = 7, 11
    got = expert_attribution(eng, ids, pos, target)
    run = eng.stages(ids)
    run.embedding()
    ref = np.zeros((L, K))
    outs = {}
    for layer in range(L):
        run.attention()
        if layer in moe_layers(key):
            r = run.router()
            tk, tw = r["topk_ids"][pos].copy(), r["topk_weights"][pos].copy()
            g = run.grouping()
            off, tok = g["expert_offset"].copy(), g["row_token"].copy()
            ex = run.expert_ffn()["ex_out"]
            for j, e in enumerate(tk):
                rows = [i for i in range(off[e], off[e + 1]) if tok[i] == pos]
                outs[layer, j] = (tw[j], ex[rows[0]].astype(np.float64))
        run.run_layer()
    x = run.tensor("x")[pos].astype(np.float64)
    run.finish()
    w_head = model.get_output_embeddings().weight
    u = model.model.norm.weight.detach().double().numpy() * w_head[target].detach().double().numpy()
    rms = np.sqrt(np.mean(x * x) + model.config.rms_norm_eps)
    for (layer, j), (w, out) in outs.items():
        ref[layer, j] = w * out @ u / rms
    np.testing.assert_allclose(got["attribution"], ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["rms"], rms, rtol=1e-5)
    assert abs(ref).max() > 1e-3


def test_viz_figures(engines):
    from colibri_lab.analysis import viz
    from colibri_lab.runtime.interventions import expert_attribution, logit_lens

    eng = engines("mixtral")
    ids = random_ids(SHAPES["mixtral"].vocab, 12, seed=20)
    with eng.trace() as tr:
        eng.forward(ids)
    fig = viz.routing_margins(tr)
    assert len(fig.data) == 2 and np.array_equal(np.asarray(fig.data[1].z), tr.routing_margins[..., 1])
    ll = logit_lens(eng, ids, [3], target=5, k=3)
    table = viz.logit_lens_table(ll)
    assert len(table.data[0].cells.values) == 1 + 3 + 1
    attr = expert_attribution(eng, ids, 4, 5)
    bars = viz.expert_attribution(attr)
    assert len(bars.data) == SHAPES["mixtral"].top_k
    np.testing.assert_array_equal(np.asarray(bars.data[0].y), attr["attribution"][:, 0])


# ---- the shared expert's output -----------------------------------------------------


@contextlib.contextmanager
def hf_shared(model, layer, replace=None, add=None, got=None):
    """transformers' shared expert of `layer` hooked: its gated output (Qwen2-MoE: sigmoid
    gate times the shared MLP's output; DeepSeek: the shared experts' output) captured in
    got["gated"] [T, H], replaced by or added to a vector at positions (the hook changes the
    MLP's output by vec / gate, so that the gated value is the vector)."""
    replace, add = replace or {}, add or {}
    mlp = model.model.layers[layer].mlp
    mod = getattr(mlp, "shared_expert", None) or mlp.shared_experts
    gate = getattr(mlp, "shared_expert_gate", None)

    def post(m, args, out):
        x = args[0]
        o = out.clone()
        flat = o.view(-1, o.shape[-1])
        g = torch.sigmoid(gate(x)).reshape(-1, 1) if gate is not None else torch.ones(flat.shape[0], 1)
        if got is not None:
            got["gated"] = (g * flat).detach().clone().numpy()
        for pos, vec in replace.items():
            flat[pos] = torch.tensor(np.asarray(vec, np.float32)) / g[pos]
        for pos, vec in add.items():
            flat[pos] = flat[pos] + torch.tensor(np.asarray(vec, np.float32)) / g[pos]
        return o

    h = mod.register_forward_hook(post)
    try:
        yield
    finally:
        h.remove()


@pytest.mark.parametrize("key", ["qwen2_moe", "deepseek_v3"])
def test_shared_expert_output(models, engines, key):
    """Record the shared expert's output (after Qwen2-MoE's sigmoid gate) and replace or add to
    it, against transformers with a forward hook on the shared-expert module."""
    model, _ = models(key)
    eng = engines(key)
    H = SHAPES[key].hidden
    layer = moe_layers(key)[-1]
    a = random_ids(SHAPES[key].vocab, N, seed=21)
    b = random_ids(SHAPES[key].vocab, N, seed=22)
    got = {}
    with hf_shared(model, layer, got=got), torch.no_grad():
        model(torch.tensor([list(a)]))
    with eng.intervene(record=[("shared_out", layer, 5), ("shared_out", layer, 11)]) as rec:
        plain = eng.forward(a)
    for pos in (5, 11):
        np.testing.assert_allclose(rec.recorded[("shared_out", layer, pos)], got["gated"][pos], rtol=0, atol=TOL)
    assert np.array_equal(plain, eng.forward(a))  # recording changes nothing: a plain forward's bits
    steer = np.random.default_rng(23).standard_normal(H).astype(np.float32)
    src = rec.recorded[("shared_out", layer, 5)]
    with hf_shared(model, layer, replace={9: src}, add={3: steer}), torch.no_grad():
        out = model(torch.tensor([list(b)]), output_router_logits=True)
    ref, rl = out.logits[0].float().numpy(), out.router_logits
    with eng.intervene(patch={("shared_out", layer, 9): src}, add={("shared_out", layer, 3): steer}):
        patched = eng.forward(b)
    check(ref, rl, patched, key, "shared_out")
    assert np.max(np.abs(patched - eng.forward(b))) > 1e-3, "the patch changes nothing"


def test_shared_expert_output_refused_without_one(engines):
    eng = engines("mixtral")  # no shared expert
    zero = np.zeros(SHAPES["mixtral"].hidden)
    with pytest.raises(ColibriError, match="no shared expert"), eng.intervene(add={("shared_out", 0, 1): zero}):
        pass
    eng2 = engines("qwen2_moe")  # layer 1 is a dense MLP
    with pytest.raises(ColibriError, match="no shared expert"), eng2.intervene(record=[("shared_out", 1, 1)]):
        pass


# ---- target log-probabilities (colibri_batch_logprobs) ------------------------------


def _log_softmax64(logits):
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_logprobs_equal_numpy(engines):
    """The engine's log-probability of each next token equals float64 numpy on the engine's own
    float32 logits (within float32 rounding: the engine sums in float32), under an ablation
    too; the last token has no target (NaN)."""
    eng = engines("mixtral")
    V = SHAPES["mixtral"].vocab
    ids = random_ids(V, N, seed=30)
    tg = np.append(ids[1:], -1)
    for q in (0, 1, 2):
        eng.sequence(q).clear()
    for iv in ({}, {"ablate": {0: [2]}}):
        with eng.intervene(**iv):
            logits = eng.batch([(0, ids)], logits="all")[0]
            eng.sequence(0).clear()
            (lp,) = eng.logprobs([(0, ids, tg)])
            eng.sequence(0).clear()
        ref = _log_softmax64(logits)[np.arange(N - 1), ids[1:]]
        assert np.isnan(lp[-1])
        np.testing.assert_allclose(lp[:-1], ref, rtol=0, atol=2e-6)


def test_logprobs_bitwise_batch_independent(models, engines):
    """Several ablations as separate sequences of one batch (each sequence its own): every
    sequence's log-probabilities are bitwise what it gets alone, with other chunkings (a
    context of max_batch 5) and with one thread."""
    eng = engines("mixtral")
    V = SHAPES["mixtral"].vocab
    ids = random_ids(V, N, seed=31)
    tg = np.append(ids[1:], -1)
    ablations = [{0: [1]}, {1: [4]}, {0: [0, 5]}]
    for q in range(3):
        eng.sequence(q).clear()
    alone = []
    for q, ab in enumerate(ablations):
        with eng.intervene(ablate=ab, seq=q):
            alone.append(eng.logprobs([(q, ids, tg)])[0])
        eng.sequence(q).clear()
    with contextlib.ExitStack() as st:
        for q, ab in enumerate(ablations):
            st.enter_context(eng.intervene(ablate=ab, seq=q))
        both = eng.logprobs([(q, ids, tg) for q in range(3)])
    for q in range(3):
        eng.sequence(q).clear()
        assert np.array_equal(both[q], alone[q], equal_nan=True)
    assert not np.array_equal(alone[0], alone[1], equal_nan=True)
    _, path = models("mixtral")
    with colibri_lab.Engine(path, max_batch=5, num_threads=1, max_seqs=3) as small:
        with contextlib.ExitStack() as st:
            for q, ab in enumerate(ablations):
                st.enter_context(small.intervene(ablate=ab, seq=q))
            split = small.logprobs([(q, ids[:7], tg[:7]) for q in range(3)])  # two calls per sequence
            rest = small.logprobs([(q, ids[7:], tg[7:]) for q in range(3)])
        assert small.config.max_batch == 5
        for q in range(3):
            assert np.array_equal(np.concatenate([split[q], rest[q]]), alone[q], equal_nan=True)


def test_logprobs_refused(engines):
    eng = engines("mixtral")
    V = SHAPES["mixtral"].vocab
    ids = random_ids(V, 6, seed=32)
    eng.sequence(0).clear()
    with pytest.raises(ColibriError, match="out of range"):
        eng.logprobs([(0, ids, [1, 2, V, 3, 4, 5])])
    assert len(eng.sequence(0)) == 0  # a refused batch changes nothing
    with pytest.raises(ColibriError, match="one id per token"):
        eng.logprobs([(0, ids, [1, 2])])
    with pytest.raises(ColibriError, match="neither a token id"):
        eng.logprobs([(0, ids, [1, 2, -3, 3, 4, 5])])
    assert 1 <= eng._get_int("logprob_rows") <= eng.config.max_batch
