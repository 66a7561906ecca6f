"""colibri_lab.bench.tuning: the roofline arithmetic on a known shape, the bandwidth and timing
helpers on the machine at hand (positive, finite figures; the median logic), the sweeps
on a tiny model, colibri_bench through its runner, and make_model's checkpoints loading
in transformers and in Colibri. Timings are not judged, only that they exist and add up."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import colibri_lab
from colibri_lab import tuning
from colibri_lab.bench import models

NAN = float("nan")


@pytest.fixture(scope="module")
def model(make_model):
    return make_model()  # (hf_dir, .colibri path): vocab 32000, hidden 64, 2 layers, 4 experts top-2


# ---------------------------------------------------------------------------------------
# The roofline arithmetic


def test_roofline_of_the_791m_shape():
    """The figures docs/performance.md quotes for the reference model, element by element."""
    w = tuning.active_weights(models.MIXTRAL_791M)
    assert w["parts"] == {"attention": 20_971_520, "router": 65_536, "experts": 176_160_768,
                          "lm_head": 32_768_000, "embedding_row": 1_024}  # fmt: skip
    assert w["matrices"] == 229_966_848 and w["norms_f32"] == 17_408
    f32 = tuning.decode_roofline(models.MIXTRAL_791M, "f32", 30.0)
    bf16 = tuning.decode_roofline(models.MIXTRAL_791M, "bf16", 30.0)
    assert f32["active_params"] == bf16["active_params"] == 229_984_256
    assert f32["bytes_per_token"] == 919_937_024
    assert bf16["bytes_per_token"] == 229_966_848 * 2 + 17_408 * 4 == 460_003_328  # norms stay f32
    assert bf16["parts_bytes"]["experts"] == 176_160_768 * 2
    assert f32["roofline_tok_s"] == pytest.approx(32.611, abs=1e-3)
    assert bf16["roofline_tok_s"] == pytest.approx(65.217, abs=1e-3)
    # a read_hf_config result (explicit head_dim) gives the same as the make_model shape
    cfg = dict(models.MIXTRAL_791M, head_dim=64, model_type="mixtral", tie=False)
    assert tuning.decode_roofline(cfg, "f32", 30.0) == f32
    json.dumps(f32)  # a plain dict to JSON

    table = tuning.roofline_table(models.MIXTRAL_791M, 30.0)
    assert table.column("dtype") == ["f32", "bf16"]
    assert table.column("MB_per_token") == [919.937024, 460.003328]
    text = str(table)
    assert text.splitlines()[0] == "decode roofline at 30 GB/s"
    assert "229,984,256" in text and "919.9" in text and "32.6" in text and "65.2" in text


def test_active_weights_match_the_model(model):
    """The roofline's bytes per token: every parameter one token touches, counted from the
    transformers model itself (experts scaled by top_k / n_experts, one embedding row)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    hf_dir = model[0]
    m = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = tuning.read_hf_config(hf_dir)
    count = 0.0
    for name, p in m.named_parameters():
        if ".experts." in name:
            count += p.numel() * cfg["top_k"] / cfg["experts"]
        elif "embed_tokens" in name:
            count += p.shape[1]
        else:
            count += p.numel()
    w = tuning.active_weights(cfg)
    assert w["matrices"] + w["norms_f32"] == count
    roof = tuning.decode_roofline(cfg, "bf16", 10.0)
    assert roof["bytes_per_token"] == w["matrices"] * 2 + w["norms_f32"] * 4
    assert math.isclose(roof["roofline_tok_s"], 10e9 / roof["bytes_per_token"])


# ---------------------------------------------------------------------------------------
# The machine


def test_bandwidth_is_a_positive_finite_figure():
    b = tuning.measure_bandwidth(8 << 20, reps=3)
    assert len(b["samples_gbs"]) == len(b["wall_samples_gbs"]) == 3
    for k in ("median_gbs", "max_gbs", "wall_median_gbs"):
        assert math.isfinite(b[k]) and b[k] > 0, k
    assert b["max_gbs"] >= b["median_gbs"] == sorted(b["samples_gbs"])[1]
    assert "8 MiB" in b["method"]
    json.dumps(b)


def test_machine_info():
    info = tuning.machine_info()
    assert info["cpus_usable"] >= 1 and info["cpus_online"] >= info["cpus_usable"]
    assert set(info.get("simd", [])) <= set(tuning.SIMD_FLAGS)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():  # each flag reported exactly when the CPU lists it (x86 flags / AArch64 Features)
        listed = set()
        for line in cpuinfo.read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() in ("flags", "Features"):
                listed = set(val.split())
                break
        assert set(info.get("simd", [])) == listed & set(tuning.SIMD_FLAGS)
    assert str(info).splitlines()[0].startswith("platform")
    json.dumps(info)


# ---------------------------------------------------------------------------------------
# Timing an Engine


def test_median_rates():
    assert tuning.median_rates([(1.0, 10.0), (3.0, 30.0), (2.0, 20.0)]) == (2.0, 20.0)
    assert tuning.median_rates([(1.0, 10.0), (4.0, 30.0)]) == (2.5, 20.0)
    # NaN (no decode steps in a run) is left out; a column of NaN stays NaN
    pre, dec = tuning.median_rates([(1.0, NAN), (3.0, 5.0), (2.0, 7.0)])
    assert (pre, dec) == (2.0, 6.0)
    pre, dec = tuning.median_rates([(5.0, NAN)])
    assert pre == 5.0 and math.isnan(dec)
    assert all(math.isnan(v) for v in tuning.median_rates([]))


def test_random_ids():
    ids = tuning.random_ids(500, 40, seed=3)
    assert ids.dtype == np.int32 and ids.shape == (500,)
    assert ids.min() >= 3 and ids.max() < 40
    assert np.array_equal(ids, tuning.random_ids(500, 40, seed=3))


def test_timed_run_and_time_engine(model):
    with colibri_lab.Engine(model[1], num_threads=1) as eng:
        pre, dec = tuning.timed_run(eng, n_prefill=12, n_decode=3)
        assert pre > 0 and dec > 0 and math.isfinite(pre) and math.isfinite(dec)
        pre, dec = tuning.timed_run(eng, n_prefill=5, n_decode=0)
        assert pre > 0 and math.isnan(dec)
        r = tuning.time_engine(eng, 3, n_prefill=8, n_decode=2)
        assert r["reps"] == 3 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
        r = tuning.time_engine(eng, 1, n_prefill=8, n_decode=0)
        assert r["prefill_tok_s"] > 0 and math.isnan(r["decode_tok_s"])
        with pytest.raises(ValueError):
            tuning.time_engine(eng, 0)


def test_sweeps(model, tmp_path):
    hf_dir, path = model
    rows = tuning.sweep_threads(path, [1, 2], reps=1, n_prefill=8, n_decode=2)
    assert rows.column("num_threads") == [1, 2]
    assert all(r["threads_used"] >= 1 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
               for r in rows)  # fmt: skip
    head = str(rows).splitlines()[1].split()
    assert head == ["num_threads", "threads_used", "prefill_tok_s", "decode_tok_s"]

    pads = tuning.sweep_group_pad(path, [1, 8], num_threads=1, reps=1, n_prefill=24)
    # every token goes to top_k = 2 experts in each of the 2 MoE layers
    assert pads.column("real_rows") == [24 * 2 * 2] * 2
    assert pads[0]["padding_rows"] == 0 and pads[0]["padding_share"] == 0
    assert pads[1]["padding_rows"] >= 0
    assert pads[1]["padding_share"] == pads[1]["padding_rows"] / pads[1]["real_rows"]
    assert "%" in str(pads)

    lens = tuning.sweep_seq_len(path, [4, 16], num_threads=1, reps=1)
    assert lens.column("seq_len") == [4, 16] and all(v > 0 for v in lens.column("prefill_tok_s"))

    blocks = tuning.sweep_block_size(hf_dir, [8], num_threads=1, reps=1, n_prefill=8,
                                     n_decode=2, workdir=tmp_path)  # fmt: skip
    assert blocks.column("block_size") == [8] and blocks[0]["prefill_tok_s"] > 0
    assert list(tmp_path.iterdir()) == []  # the converted files are removed

    split = tuning.stage_split(path, n_prefill=16, n_decode=4, num_threads=1)
    assert "expert_ffn" in split.column("stage") and "lm_head" in split.column("stage")
    assert sum(split.column("prefill_share")) == pytest.approx(1.0)
    assert sum(split.column("decode_share")) == pytest.approx(1.0)
    assert all(v >= 0 for v in split.column("prefill_ms") + split.column("decode_ms"))


def test_rows_print_and_plot():
    rows = tuning.Rows([{"n": 1, "tok_s": 1234.56, "share": 0.25},
                        {"n": 16, "tok_s": 7.891, "share": None}],
                       title="t", formats={"share": ".0%"})  # fmt: skip
    assert str(rows).splitlines() == [
        "t",
        " n   tok_s  share",
        " 1  1234.6    25%",
        "16    7.89      —",
    ]
    fig = rows.plot("n", ["tok_s"], kind="line", log_x=True)
    assert [t.type for t in fig.data] == ["scatter"] and fig.layout.xaxis.type == "log"
    fig = rows.plot("n", "tok_s")
    assert list(fig.data[0].x) == ["1", "16"] and fig.layout.title.text == "t"
    with pytest.raises(ValueError):
        rows.plot("n", "tok_s", kind="pie")


# ---------------------------------------------------------------------------------------
# colibri_bench


def test_run_colibri_bench(model, monkeypatch):
    exe = tuning.find_colibri_bench()
    if exe is None:
        pytest.fail("colibri_bench not found: build native/ (pip install the package) or set "
                    "COLIBRI_BENCH")  # fmt: skip
    d = tuning.run_colibri_bench(model[1], sequential_sequences=2, seq_len=9, max_new_tokens=3,
                                 num_requests=2, num_threads=1, warmup=0, seed=5)  # fmt: skip
    assert d["tool"] == "colibri_bench" and d["sequential_sequences"] == 2 and d["seed"] == 5
    # 2 requests of 2 sequences each, one after another
    assert d["prefill"]["tokens"] == 2 * 2 * 9 and d["decode"]["tokens"] == 2 * 2 * 3
    rows = tuning.sweep_sequential_sequences(model[1], [1, 2], seq_len=9, max_new_tokens=2,
                                             num_requests=1, num_threads=1, warmup=0)  # fmt: skip
    assert rows.column("sequential_sequences") == [1, 2]
    assert all(r["request_p50_ms"] > 0 and r["prefill_tok_s"] > 0 for r in rows)
    fast = tuning.run_colibri_bench(model[1], seq_len=9, max_new_tokens=2, num_requests=1,
                                    num_threads=1, warmup=0, precision="fast")  # fmt: skip
    assert fast["precision"] == "fast" and " fast(" in fast["kernels"]
    with pytest.raises(RuntimeError, match="exited with 1"):
        tuning.run_colibri_bench(model[1].parent / "absent.colibri", exe=exe)
    monkeypatch.setattr(tuning, "find_colibri_bench", lambda: None)
    with pytest.raises(FileNotFoundError, match="colibri_bench not found"):
        tuning.run_colibri_bench(model[1])


# ---------------------------------------------------------------------------------------
# make_model


def test_make_model_loads_in_transformers_and_colibri(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(vocab=300, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, experts=4,
                 top_k=2, max_pos=128)  # fmt: skip
    said = []
    out = models.make_model(tmp_path / "m", shape, seed=1, log=said.append)
    assert out == tmp_path / "m" and len(said) == 1 and "random Mixtral" in said[0]
    assert not (out / "tokenizer.model").exists()  # only a 32000 vocabulary gets the real one
    hf = AutoConfig.from_pretrained(out)
    assert (hf.model_type, hf.vocab_size, hf.hidden_size, hf.num_local_experts) == ("mixtral", 300, 32, 4)
    cfg = tuning.read_hf_config(out)
    assert {k: cfg[k] for k in shape if k != "max_pos"} == {k: v for k, v in shape.items()
                                                              if k != "max_pos"}  # fmt: skip
    assert cfg["head_dim"] == 8 and cfg["tie"] is False
    # the same shape and seed again: the folder is reused, not rewritten
    stamp = (out / "config.json").stat().st_mtime_ns
    assert models.make_model(out, shape, seed=1, log=said.append) == out
    assert len(said) == 1 and (out / "config.json").stat().st_mtime_ns == stamp

    path = colibri_lab.convert(out, tmp_path / "m.colibri", dtype="f32", progress=False)
    ids = [1, 17, 250, 3, 99]
    with colibri_lab.Engine(path, num_threads=1) as eng:
        assert eng.vocab_size == 300
        ours = eng.forward(ids)
    m = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = m(torch.tensor([ids])).logits[0].numpy()
    assert ours.shape == ref.shape == (5, 300)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


def test_make_family_model_any_family(tmp_path):
    """make_family_model: a seeded random model of a family by transformers' config keys,
    1-D parameters randomised (no norm of ones, no zero bias), reused for the same
    arguments, regenerated for another seed."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    cfg = dict(vocab_size=211, hidden_size=24, moe_intermediate_size=12, intermediate_size=20,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=12,
               num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    said = []
    out = models.make_family_model(tmp_path / "q3", "qwen3_moe", cfg, seed=3, log=said.append)
    assert len(said) == 1 and "qwen3_moe" in said[0]
    sd = load_file(out / "model.safetensors")
    norms = [v for k, v in sd.items() if k.endswith("norm.weight")]
    assert norms and all(float(v.min()) >= 0.5 and not torch.all(v == 1) for v in norms)
    again = models.make_family_model(tmp_path / "q3", "qwen3_moe", cfg, seed=3, log=said.append)
    assert again == out and len(said) == 1
    models.make_family_model(tmp_path / "q3", "qwen3_moe", cfg, seed=4, log=said.append)
    assert len(said) == 2
    path = colibri_lab.convert(out, tmp_path / "q3.colibri", dtype="f32", progress=False)
    with colibri_lab.Engine(path, num_threads=1) as eng:
        assert eng.vocab_size == 211
