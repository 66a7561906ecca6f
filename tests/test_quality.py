"""colibri_lab.analysis.quality: the statistics against hand-computed values, routing flips on
synthetic top-k arrays, the llama-perplexity output parser on a captured run, the
engine comparison on real files (a model against itself, bf16, q8_0), and the fast
numeric mode against the exact one (precision_agreement)."""

from __future__ import annotations

import json
import math
import struct
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import colibri_lab
from colibri_lab import quality as q
from colibri_lab.analysis.quality_cli import main as quality_main
from colibri_lab.bench import llama_quality
from conftest import REPO_ROOT

TINY = REPO_ROOT / "data" / "tiny-mixtral"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """data/tiny-mixtral converted: {dtype: path} for f32 and bf16."""
    d = tmp_path_factory.mktemp("quality")
    return {dt: colibri_lab.convert(TINY, d / f"tiny-{dt}.colibri", dtype=dt, progress=False)
            for dt in ("f32", "bf16")}


@pytest.fixture(scope="module")
def text_ids(tiny):
    """BOS + heapq.py of the running Python's standard library (a file the tiny model
    did not train on: docs/training/summary.json), as llama-perplexity would score it."""
    src = (Path(sysconfig.get_paths()["stdlib"]) / "heapq.py").read_text(encoding="utf-8")
    return q.text_tokens(tiny["f32"], src)


# --------------------------------------------------------------------------- statistics by hand

def _softmax(row):
    m = max(row)
    e = [math.exp(x - m) for x in row]
    s = sum(e)
    return [x / s for x in e]


def _hand(ref, test, targets):
    """Every statistic with plain Python loops (no numpy), llama-perplexity's formulas."""
    n = len(targets)
    kl, nll_r, nll_t, dp, same = [], [], [], [], 0
    for r, t, y in zip(ref, test, targets):
        p, qq = _softmax(r), _softmax(t)
        kl.append(sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, qq)))
        nll_r.append(-math.log(p[y]))
        nll_t.append(-math.log(qq[y]))
        dp.append(qq[y] - p[y])
        same += max(range(len(r)), key=lambda i: r[i]) == max(range(len(t)), key=lambda i: t[i])

    def mean_err(v):
        m = sum(v) / n
        var = sum(x * x for x in v) / n - m * m
        return m, math.sqrt(var / (n - 1))

    lq, eq = mean_err(nll_t)
    lb, eb = mean_err(nll_r)
    cov = (sum(a * b for a, b in zip(nll_t, nll_r)) / n - lq * lb) / (n - 1)
    kl_m, kl_e = mean_err(kl)
    dp2 = [x * x for x in dp]
    mse, mse_e = mean_err(dp2)
    ks = sorted(kl)
    return dict(ppl_test=math.exp(lq), ppl_ref=math.exp(lb), ppl_test_err=math.exp(lq) * eq,
                ln_ppl_ratio=lq - lb, ln_ppl_ratio_err=math.sqrt(eq * eq + eb * eb - 2 * cov),
                ppl_ratio=math.exp(lq - lb), ppl_diff=math.exp(lq) - math.exp(lb),
                kld_mean=kl_m, kld_mean_err=kl_e, top1_agreement=same / n,
                top1_agreement_err=math.sqrt((same / n) * (1 - same / n) / (n - 1)),
                dp_mean=sum(dp) / n, dp_rms=math.sqrt(mse), dp_rms_err=0.5 / math.sqrt(mse) * mse_e,
                kld_median=0.5 * (ks[n // 2] + ks[n // 2 - 1]) if n % 2 == 0 else ks[n // 2],
                kld_max=ks[-1], kld_list=ks)  # fmt: skip


def test_statistics_match_a_hand_computation():
    rng = np.random.default_rng(7)
    n, V = 23, 6
    ref = rng.normal(0, 2, (n, V)).astype(np.float32)
    test = (ref + rng.normal(0, 0.7, (n, V))).astype(np.float32)
    test[3] = ref[3]                      # one position where both agree exactly
    targets = rng.integers(0, V, n)
    want = _hand(ref.tolist(), test.tolist(), targets.tolist())
    acc = q.KLDAccumulator()
    acc.add(ref[:10], test[:10], targets[:10])   # fed in two chunks
    acc.add(ref[10:], test[10:], targets[10:])
    got = acc.summary()
    assert got["n_scored"] == n
    for k, v in want.items():
        if k == "kld_list":
            continue
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    # P99 / P95: linear interpolation at fraction * (n - 1) of the sorted values
    ks = want["kld_list"]
    for frac, key in ((0.99, "kld_p99"), (0.95, "kld_p95")):
        pos = frac * (n - 1)
        i = int(pos)
        assert got[key] == pytest.approx(ks[i] + (pos - i) * (ks[i + 1] - ks[i]), rel=1e-9), key
    assert 0 < got["top1_agreement"] < 1


def test_token_stats_two_positions_exactly():
    # p = softmax([0, ln 3]) = (1/4, 3/4); q = (1/2, 1/2)
    ref = np.array([[0.0, math.log(3)], [5.0, 5.0]], np.float32)
    test = np.array([[0.0, 0.0], [5.0, 5.0]], np.float32)
    st = q.token_stats(ref, test, [1, 0])
    p0, p1 = 0.25, 0.75
    kl0 = p0 * math.log(p0 / 0.5) + p1 * math.log(p1 / 0.5)
    assert st["kld"][0] == pytest.approx(kl0, rel=1e-6)
    assert st["kld"][1] == 0.0
    assert st["nll_ref"][0] == pytest.approx(-math.log(0.75), rel=1e-6)
    assert st["nll_test"][0] == pytest.approx(math.log(2), rel=1e-6)
    assert st["dp"][0] == pytest.approx(0.5 - 0.75, rel=1e-6)
    assert st["same_top"].tolist() == [False, True]   # argmax 1 vs 0 (first of a tie)


def test_llama_percentile_and_median():
    v = np.array([1.0, 2.0, 4.0, 8.0])
    assert q.percentile(v, 0.5) == 3.0                  # 0.5 * 3 = 1.5 -> between 2 and 4
    assert q.percentile(v, 0.99) == pytest.approx(4 + 0.97 * 4)
    assert q.percentile(v, 0.0) == 1.0 and q.percentile(v, 1.0) == 8.0
    assert q.median(v) == 3.0 and q.median(v[:3]) == 2.0
    assert q.mean_and_uncertainty(10.0, 30.0, 5) == (2.0, 0.0)   # <= 10 values: no error


def test_routing_flips_on_synthetic_topk():
    ref = np.array([[0, 1], [1, 0], [2, 3], [0, 2], [3, 1]])
    test = np.array([[1, 0], [1, 0], [3, 2], [0, 3], [2, 0]])
    sets, top1 = q.routing_flips(ref, test)
    assert sets.tolist() == [False, False, False, True, True]    # order inside the set is free
    assert top1.tolist() == [True, False, True, False, True]
    # [L, T, K]: per layer
    sets2, _ = q.routing_flips(np.stack([ref, ref]), np.stack([ref, test]))
    assert sets2.sum(axis=1).tolist() == [0, 2]
    assert q.expert_load(ref, 5).tolist() == [3, 3, 2, 2, 0]
    assert q.expert_load(np.stack([ref, test]), 4).tolist() == [[3, 3, 2, 2], [4, 2, 2, 2]]
    with pytest.raises(ValueError):
        q.routing_flips(ref, test[:, :1])


# --------------------------------------------------------------------------- llama-perplexity output

# Captured from `llama-perplexity -m tiny-Q8_0.gguf --kl-divergence-base base.kld
# --kl-divergence -c 512 -t 2 --no-repack` (llama.cpp 0c1e570, the llama-cpp-python 0.3.36
# sdist; data/tiny-mixtral, llama-quantize Q8_0, 32 chunks of held-out stdlib source):
# stderr's chunk line, the chunk table's head and tail, and the statistics, as printed.
LLAMA_KLD_OUTPUT = """\
0.00.075.669 I kl_divergence: computing over 32 chunks, n_ctx=512, batch_size=2048, n_seq=4
0.00.275.364 I kl_divergence: 0.20 seconds per pass - ETA 0.02 minutes

chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      40.3749 ±    8.1929       0.00215 ±    0.00106       0.00018 ±    0.00003     0.248 ±  0.021 %    99.216 ±  0.554 %
   2      61.1997 ±    9.1530       0.00121 ±    0.00085       0.00032 ±    0.00013     0.393 ±  0.086 %    98.627 ±  0.516 %
  32     104.3538 ±    4.0916       0.00262 ±    0.00108       0.00059 ±    0.00007     0.357 ±  0.036 %    98.958 ±  0.112 %

====== Perplexity statistics ======
Mean PPL(Q)                   : 104.353816 ±   4.091609
Mean PPL(base)                : 104.080759 ±   4.071860
Cor(ln(PPL(Q)), ln(PPL(base))):  99.96%
Mean ln(PPL(Q)/PPL(base))     :   0.002620 ±   0.001081
Mean PPL(Q)/PPL(base)         :   1.002624 ±   0.001084
Mean PPL(Q)-PPL(base)         :   0.273057 ±   0.114035

====== KL divergence statistics ======
Mean    KLD:   0.000588 ±   0.000066
Maximum KLD:   0.273187
99.9%   KLD:   0.088075
99.0%   KLD:   0.006189
95.0%   KLD:   0.000638
90.0%   KLD:   0.000406
Median  KLD:   0.000129
10.0%   KLD:   0.000020
 5.0%   KLD:   0.000005
 1.0%   KLD:  -0.000013
 0.1%   KLD:  -0.000072
Minimum KLD:  -0.000123

====== Token probability statistics ======
Mean    Δp: -0.003 ± 0.004 %
Maximum Δp: 10.771%
99.9%   Δp:  3.210%
99.0%   Δp:  0.805%
95.0%   Δp:  0.307%
90.0%   Δp:  0.143%
75.0%   Δp:  0.011%
Median  Δp: -0.000%
25.0%   Δp: -0.014%
10.0%   Δp: -0.164%
 5.0%   Δp: -0.333%
 1.0%   Δp: -0.846%
 0.1%   Δp: -2.507%
Minimum Δp: -12.170%
RMS Δp    :  0.357 ± 0.036 %
Same top p: 98.958 ± 0.112 %
"""


def test_parse_llama_perplexity_output():
    r = llama_quality.parse_llama_perplexity(LLAMA_KLD_OUTPUT, ref="f32.gguf", test="Q8_0.gguf")
    assert r.source == "llama.cpp" and r.routing is None
    assert (r.ctx, r.n_chunks, r.n_tokens, r.n_scored) == (512, 32, 32 * 512, 32 * 255)
    assert (r.ppl_test, r.ppl_test_err) == (104.353816, 4.091609)
    assert (r.ppl_ref, r.ppl_ref_err) == (104.080759, 4.071860)
    assert r.ppl_cor == pytest.approx(0.9996)
    assert (r.ln_ppl_ratio, r.ln_ppl_ratio_err) == (0.002620, 0.001081)
    assert (r.ppl_ratio, r.ppl_ratio_err) == (1.002624, 0.001084)
    assert (r.ppl_diff, r.ppl_diff_err) == (0.273057, 0.114035)
    assert (r.kld_mean, r.kld_mean_err) == (0.000588, 0.000066)
    assert (r.kld_max, r.kld_p99, r.kld_p95, r.kld_median) == (0.273187, 0.006189, 0.000638, 0.000129)
    assert r.kld_quantiles["99.9"] == 0.088075 and r.kld_quantiles["min"] == -0.000123
    assert r.kld_quantiles["5.0"] == 0.000005 and r.kld_quantiles["0.1"] == -0.000072
    assert r.dp_mean == pytest.approx(-0.00003) and r.dp_mean_err == pytest.approx(0.00004)
    assert r.dp_quantiles["max"] == pytest.approx(0.10771)
    assert r.dp_quantiles["median"] == 0.0 and r.dp_quantiles["min"] == pytest.approx(-0.12170)
    assert r.dp_rms == pytest.approx(0.00357) and r.dp_rms_err == pytest.approx(0.00036)
    assert r.top1_agreement == pytest.approx(0.98958)
    assert r.top1_agreement_err == pytest.approx(0.00112)
    assert set(r.kld_quantiles) == {k for k, _ in q.KLD_QUANTILES}
    assert set(r.dp_quantiles) == {k for k, _ in q.DP_QUANTILES}
    # a run with too few positions prints no statistics
    head = LLAMA_KLD_OUTPUT.split("====== Perplexity")[0]
    with pytest.raises(llama_quality.LlamaOutputError, match="ppl_test.*kld_mean"):
        llama_quality.parse_llama_perplexity(head)


def test_read_llama_logits_file(tmp_path):
    """A --kl-divergence-base file as llama-perplexity writes it: header, ids, then per
    scored row two floats (scale, min log-prob) as four uint16 and the 16-bit steps."""
    n_ctx, V, n_chunk = 8, 5, 2
    ids = np.arange(n_ctx * n_chunk, dtype="<i4") % V
    rows = n_ctx - 1 - n_ctx // 2
    nv = 2 * ((V + 1) // 2) + 4
    body = np.zeros((n_chunk, rows, nv), "<u2")
    steps = np.arange(n_chunk * rows * V).reshape(n_chunk, rows, V) % 7
    body[..., 4:4 + V] = steps
    for c in range(n_chunk):
        for r in range(rows):
            body[c, r, :4] = np.frombuffer(struct.pack("<ff", 0.5, -10.0), "<u2")
    p = tmp_path / "base.kld"
    p.write_bytes(b"_logits_" + struct.pack("<Iii", n_ctx, V, n_chunk) + ids.tobytes() + body.tobytes())
    got = llama_quality.read_llama_logits_header(p)
    assert got[:3] == (n_ctx, V, n_chunk) and np.array_equal(got[3], ids)
    lps = list(llama_quality.read_llama_log_probs(p))
    assert len(lps) == n_chunk and lps[0].shape == (rows, V)
    assert np.array_equal(lps[1], 0.5 * steps[1] - 10.0)


# --------------------------------------------------------------------------- engines

def test_a_model_against_itself_is_exactly_zero(tiny, text_ids):
    for test in (tiny["f32"], tiny["f32"]):   # the same path: two engines, the same bits
        r = q.compare(tiny["f32"], test, text_ids, ctx=64, n_chunks=6, threads=1)
    assert (r.n_chunks, r.n_tokens, r.n_scored) == (6, 384, 6 * 31)
    assert r.kld_mean == 0.0 and r.kld_max == 0.0 and r.kld_quantiles["min"] == 0.0
    assert r.top1_agreement == 1.0 and r.dp_rms == 0.0
    assert r.ppl_ratio == 1.0 and r.ppl_diff == 0.0 and r.ppl_test == r.ppl_ref
    assert 5.0 < r.ppl_ref < 500.0       # a trained model on Python source
    rt = r.routing
    assert rt.layers == [0, 1, 2, 3] and rt.n_tokens == 384 and rt.top_k == 2
    assert rt.set_flips == [0, 0, 0, 0] and rt.top1_flips == [0, 0, 0, 0]
    assert rt.flip_rate_overall == 0.0 and rt.load_ref == rt.load_test
    assert all(sum(layer) == 384 * 2 for layer in rt.load_ref)
    assert r.tokens_sha256 == q.tokens_sha256(text_ids[:384])
    # the report survives JSON, and reads
    back = q.QualityReport.from_json(r.to_json())
    assert back.to_dict() == r.to_dict() and isinstance(back.routing, q.RoutingReport)
    assert "same top-1 100.000" in repr(r)


def test_deterministic_and_chunks_are_fresh_sequences(tiny, text_ids):
    """Two runs give the same numbers; a chunk's statistics do not depend on the chunks
    before it (each starts a new sequence with BOS)."""
    a = q.compare(tiny["f32"], tiny["bf16"], text_ids, ctx=48, n_chunks=3, routing=False)
    b = q.compare(tiny["f32"], tiny["bf16"], text_ids, ctx=48, n_chunks=3, routing=False)
    assert a.to_dict() == b.to_dict() and a.routing is None
    eng = colibri_lab.Engine(tiny["f32"], max_seq_len=48)
    try:
        chunk = np.array(text_ids[48:96], np.int32)
        chunk[0] = eng.tokenizer.bos_id
        want = eng.forward(chunk)[24:47]
        acc = q.KLDAccumulator()
        acc.add(want, want, chunk[25:])
        alone = acc.summary()
        second = q.compare(eng, eng, text_ids[48:96], ctx=48)
        assert second.ppl_ref == alone["ppl_ref"]
    finally:
        eng.close()


def test_tiny_checkpoint_is_bf16_so_its_bf16_conversion_is_exact(tiny, text_ids):
    """data/tiny-mixtral is stored in bf16: converting it to bf16 loses nothing."""
    r = q.compare(tiny["f32"], tiny["bf16"], text_ids, ctx=64, n_chunks=2)
    assert r.kld_max == 0.0 and r.routing.flip_rate_overall == 0.0


def test_bf16_of_an_f32_checkpoint_is_close_but_not_equal(make_model):
    _, f32 = make_model()
    _, bf16 = make_model(dtype="bf16")
    tokens = q.random_tokens(4 * 64, 32000, seed=1)
    r = q.compare(f32, bf16, tokens, ctx=64)
    assert 0.0 < r.kld_mean < 1e-3, r
    assert r.kld_quantiles["min"] >= -1e-12
    assert r.top1_agreement > 0.9
    assert abs(r.ppl_ratio - 1.0) < 0.01
    rt = r.routing
    assert rt.n_tokens == 256 and len(rt.flip_rate) == 2
    assert 0.0 <= rt.flip_rate_overall < 0.2
    assert rt.load_delta().sum(axis=1).tolist() == [0, 0]   # every token still goes to k experts


def test_q8_0_against_f32(tiny, tiny_q8, text_ids):
    """data/tiny-mixtral converted to q8_0 (the converter's --dtype q8_0) is smaller than
    16 bits a weight and close to the f32 file, routing included."""
    q8 = tiny_q8
    bits = q.weight_bits(q8)
    assert "q8_0" in bits["dtypes"] and bits["bpw"] < 16
    r = q.compare(tiny["f32"], q8, text_ids, ctx=64, n_chunks=6)
    assert 0.0 < r.kld_mean < 0.01, r
    assert r.top1_agreement > 0.95
    assert abs(r.ppl_ratio - 1.0) < 0.05
    assert r.routing.flip_rate_overall < 0.1


def test_cli_random_tokens(tiny, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = quality_main(["--ref", str(tiny["f32"]), "--test", str(tiny["bf16"]), "--random-tokens", "200",
                     "--ctx", "64", "--threads", "1", "--quiet", "--json", str(out)])
    assert rc == 0
    assert "3 chunks x 64 tokens" in capsys.readouterr().out
    d = json.loads(out.read_text())["colibri"]
    assert d["n_chunks"] == 3 and d["kld_mean"] == 0.0 and d["routing"]["n_tokens"] == 192
    rc = quality_main(["--ref", str(tiny["f32"]), "--test", str(tiny["bf16"]), "--random-tokens", "10",
                     "--ctx", "64"])
    assert rc == 1 and "no chunk" in capsys.readouterr().err


def test_bad_input(tiny):
    with pytest.raises(ValueError, match="at least 4"):
        q.compare(tiny["f32"], tiny["f32"], [1, 2, 3], ctx=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        q.compare(tiny["f32"], tiny["f32"], [1] * 63 + [32000], ctx=64)


def test_quality_figures(tiny, text_ids):
    from colibri_lab import viz

    r = q.compare(tiny["f32"], tiny["bf16"], text_ids, ctx=48, n_chunks=2)
    fake = q.QualityReport.from_dict({**r.to_dict(), "kld_mean": 0.01})
    fake.routing.flip_rate = [0.0, 0.01, 0.02, 0.03]
    fake.routing.load_test = [[x + (1 if e == 0 else -1 if e == 1 else 0) for e, x in enumerate(row)]
                              for row in fake.routing.load_ref]
    reps = {"bf16": r, "fake": fake}
    hm = viz.routing_flip_heatmap(reps)
    assert [list(row) for row in hm.data[0].z] == [[0, 0, 0, 0], [0, 1, 2, 3]]
    shift = viz.expert_load_shift(reps)
    assert len(shift.data) == 2 and shift.data[1].z[0][0] > 0 > shift.data[1].z[0][1]
    size = viz.quality_vs_size(reps, {"bf16": 16.0, "fake": 8.5})
    assert list(size.data[0].x) == [16.0, 8.5]
    assert any("KL exactly 0" in a.text for a in size.layout.annotations)   # bf16 is lossless here
    r.routing = None
    assert "no report has routing" in viz.routing_flip_heatmap([r]).layout.annotations[0].text


def test_llama_perplexity_on_the_same_text(tiny, tmp_path, capsys):
    """llama.cpp's own run through the CLI, when llama-perplexity is built (the bench's
    llama.cpp tree, or $LLAMA_PERPLEXITY): it scores our token ids and its report parses."""
    try:
        llama_quality.find_llama_perplexity()
    except FileNotFoundError as e:
        pytest.skip(f"no llama.cpp llama-perplexity here: {e}")
    src = (Path(sysconfig.get_paths()["stdlib"]) / "heapq.py").read_text(encoding="utf-8")
    text = tmp_path / "heapq.txt"
    text.write_text(src)
    base = llama_quality.llama_gguf(TINY, "f32", cache=tmp_path)
    q8 = llama_quality.llama_gguf(TINY, "Q8_0", cache=tmp_path)
    out = tmp_path / "both.json"
    rc = quality_main(["--ref", str(tiny["f32"]), "--test", str(tiny["bf16"]), "--text", str(text),
                     "--ctx", "128", "--chunks", "4", "--threads", "2", "--quiet", "--json", str(out),
                     "--llama-base", str(base), "--llama-test", str(q8)])
    assert rc == 0, capsys.readouterr().err
    assert "the same as ours: True" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["same_tokens"] is True
    ll = d["llama.cpp"][q8.name]
    assert (ll["n_chunks"], ll["ctx"], ll["n_scored"]) == (4, 128, 4 * 63)
    assert ll["tokens_sha256"] == d["colibri"]["tokens_sha256"]
    assert 0 < ll["kld_mean"] < 0.01 and ll["top1_agreement"] > 0.9
    assert ll["ppl_ref"] == pytest.approx(d["colibri"]["ppl_ref"], rel=0.01)   # 16-bit base


# --------------------------------------------------------------------------- numeric modes

@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    return colibri_lab.convert(TINY, tmp_path_factory.mktemp("quality-q8") / "tiny-q8_0.colibri",
                               dtype="q8_0", progress=False)


# Measured on these 2040 positions (heapq.py, 8 chunks of 256; docs/quantization.md, "Fast
# mode accuracy"): bf16 KL mean 5.3e-5, P99 1.0e-4, max 0.022, top-1 99.61 %, flips 0.12 %;
# q8_0 KL mean 4.2e-4, P99 5.6e-3, max 0.14, top-1 98.82 %, flips 0.63 %. The bounds leave
# 4-6x on the mean KL: one bit less in the activations doubles the rounding step and so
# roughly quadruples the KL, and a wrong block scale or a dropped sub-block offset moves the
# logits by far more.
FAST_BOUNDS = {"bf16": dict(kl_mean=3e-4, kl_p99=1e-3, kl_max=0.3, top1=0.99, flips=0.01),
               "q8_0": dict(kl_mean=2e-3, kl_p99=0.025, kl_max=0.6, top1=0.98, flips=0.03)}


@pytest.mark.parametrize("dtype", ["bf16", "q8_0"])
def test_precision_agreement_fast_against_exact(tiny, tiny_q8, text_ids, dtype):
    path = tiny["bf16"] if dtype == "bf16" else tiny_q8
    r = q.precision_agreement(path, text_ids, chunk=256, max_chunks=8, num_threads=2)
    b = FAST_BOUNDS[dtype]
    assert (r["n_tokens"], r["n_chunks"], r["chunk"]) == (8 * 255, 8, 256)
    assert r["n_routing_decisions"] == 8 * 256 * 4 and r["moe_layers"] == [0, 1, 2, 3]
    assert (r["ref"], r["test"], r["weight_dtype"]) == ("exact", "fast", dtype)
    assert " fast(int8 " in r["kernels"]
    assert 0.0 < r["kl_mean"] < b["kl_mean"], r
    assert r["kl_p99"] < b["kl_p99"] and r["kl_max"] < b["kl_max"], r
    assert r["kl_min"] >= -1e-12
    assert b["top1"] <= r["top1"] < 1.0, r
    assert 0.0 <= r["routing_flips"] < b["flips"], r
    assert len(r["routing_flips_per_layer"]) == 4
    assert r["routing_flips"] == pytest.approx(np.mean(r["routing_flips_per_layer"]))
    assert abs(r["ppl_test"] / r["ppl_ref"] - 1) < 0.01
    if dtype == "q8_0":
        assert r["routing_flips"] > 0   # int8 activations do move some routing decisions
    assert json.loads(json.dumps(r)) == r
    # deterministic: the same numbers again
    assert q.precision_agreement(path, text_ids, chunk=256, max_chunks=8, num_threads=1) == r


def test_precision_agreement_exact_against_exact_is_zero(tiny_q8, text_ids):
    r = q.precision_agreement(tiny_q8, text_ids[:300], chunk=128, ref="exact", test="exact")
    assert (r["n_chunks"], r["n_tokens"]) == (3, 127 + 127 + 43)   # the short last chunk counts
    assert r["kl_mean"] == 0.0 and r["kl_max"] == 0.0 and r["top1"] == 1.0
    assert r["routing_flips"] == 0.0 and r["routing_top1_flips"] == 0.0
    assert r["n_routing_decisions"] == 300 * 4 and r["ppl_ref"] == r["ppl_test"]
    with colibri_lab.Engine(tiny_q8, max_seq_len=4) as eng:
        assert r["kernels"] == eng.config.kernels   # the exact table


def test_precision_agreement_bad_input(tiny_q8):
    with pytest.raises(colibri_lab.ColibriInvalidArgError, match="precision"):
        q.precision_agreement(tiny_q8, [1, 2, 3], test="turbo")
    with pytest.raises(ValueError, match="at least 2"):
        q.precision_agreement(tiny_q8, [1])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        q.precision_agreement(tiny_q8, [1, 2, 3], chunk=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        q.precision_agreement(tiny_q8, [1, 2, 32000])
    with pytest.raises(ValueError, match="1-D"):
        q.precision_agreement(tiny_q8, [[1, 2], [3, 4]])
    with pytest.raises(OSError):
        q.precision_agreement(Path(tiny_q8).parent / "absent.colibri", [1, 2, 3])


def test_cli_precision_agreement(tiny, tiny_q8, tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = quality_main(["--precision-agreement", str(tiny_q8), "--precision-agreement", str(tiny["bf16"]),
                     "--random-tokens", "300", "--ctx", "128", "--threads", "1", "--quiet", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "fast against exact over 297 positions" in text and "same top1" in text
    d = json.loads(out.read_text())["precision_agreement"]
    assert set(d) == {str(tiny_q8), str(tiny["bf16"])}
    assert d[str(tiny_q8)]["n_tokens"] == 297 and d[str(tiny_q8)]["kl_mean"] > 0
    from colibri_lab.__main__ import main as package_main   # python -m colibri_lab quality ...

    assert package_main(["quality", "--precision-agreement", str(tiny_q8), "--random-tokens", "50",
                         "--ctx", "25", "--quiet"]) == 0
    assert "fast against exact over 48 positions" in capsys.readouterr().out
    assert quality_main(["--precision-agreement", str(tiny_q8), "--random-tokens", "1"]) == 1
    assert "at least 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quality_main(["--precision-agreement", str(tiny_q8), "--ref", str(tiny_q8)])
    assert "leave out --ref" in capsys.readouterr().err


def test_held_out_text():
    text = q.held_out_text()
    files = json.loads((REPO_ROOT / "docs" / "training" / "summary.json").read_text())["corpus"]["heldout_file_list"]
    first = (Path(sysconfig.get_paths()["stdlib"]) / files[0]).read_text(encoding="utf-8", errors="replace")
    assert text.startswith(first) and len(text) > 100_000
    with pytest.raises(FileNotFoundError):
        q.held_out_text(REPO_ROOT / "absent.json")
