"""The converter on real checkpoint variants: transformers 4 and 5 config styles, sharded
checkpoints, fused expert keys, the tokenizer, the embedded default model, refusals
with clear messages and no leftover files, and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_format import load_source, make_hf  # noqa: E402

import colibri_lab  # noqa: E402
from colibri_lab.conversion.spec import ConversionError
from colibri_lab.conversion.hf import convert
from colibri_lab.conversion.cli import main  # noqa: E402
from colibri_lab.format.reader import inspect  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf5(tmp_path_factory):
    return make_hf(tmp_path_factory.mktemp("v5") / "hf")


def signature(path: Path):
    """What must not depend on how the checkpoint was stored: header, metadata (less the
    folder name), every tensor's name/dtype/shape/offset/CRC/norm."""
    info = inspect(path, verify=True)
    meta = {k: v for k, v in info.metadata.items() if k != "general.name"}
    tensors = [(t.name, t.dtype, t.layout, t.shape, t.offset, t.nbytes, t.crc32, t.l2norm)
               for t in info.tensors]
    return info.header, meta, tensors


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".colibri")))


def test_v4_and_v5_config_styles_give_the_same_file(hf5, tmp_path):
    cfg = json.loads((hf5 / "config.json").read_text())
    assert "rope_parameters" in cfg and cfg["head_dim"] == 4    # v5 style as written
    v4 = tmp_path / "hf"
    v4.mkdir()
    for f in hf5.iterdir():
        (v4 / f.name).write_bytes(f.read_bytes())
    old = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "head_dim")}
    old |= {"rope_theta": 1e6, "rope_scaling": None, "transformers_version": "4.46.0",
            "torch_dtype": "float32"}
    (v4 / "config.json").write_text(json.dumps(old))
    a, b = tmp_path / "a.colibri", tmp_path / "b.colibri"
    convert(hf5, a, progress=False)
    convert(v4, b, progress=False)   # head_dim missing -> hidden / heads = 4
    assert signature(a) == signature(b)


def test_head_dim_null_and_theta_sliding_tie(tmp_path):
    hf = make_hf(tmp_path / "hf", head_dim=None, hidden_size=24, num_attention_heads=4,
                 num_key_value_heads=2, sliding_window=7, tie_word_embeddings=True,
                 rope_parameters={"rope_theta": 12345.0, "rope_type": "default"})
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["head_dim"] is None and cfg["tie_word_embeddings"] is True
    out = tmp_path / "m.colibri"
    convert(hf, out, progress=False)
    info = inspect(out)
    m = info.metadata
    assert m["model.head_dim"] == 6 and m["model.sliding_window"] == 7
    assert m["model.rope_theta"] == 12345.0 and m["model.tie_word_embeddings"] is True
    assert info.flags["tied_embeddings"] and info.header["flags"] == 2
    names = {t.name for t in info.tensors}
    assert "output.weight" not in names and "token_embd.weight" in names
    assert info.header["max_seq_len"] == m["model.max_seq_len"] == 300   # default


def test_sharded_checkpoint_with_index(hf5, tmp_path):
    sharded = make_hf(tmp_path / "sharded", shard="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) >= 2
    a, b = tmp_path / "a.colibri", tmp_path / "b.colibri"
    convert(hf5, a, progress=False)
    convert(sharded, b, progress=False)
    assert signature(a) == signature(b)
    # shards without an index are found too
    (sharded / "model.safetensors.index.json").unlink()
    c = tmp_path / "c.colibri"
    convert(sharded, c, progress=False)
    assert signature(a) == signature(c)


def test_fused_expert_keys(hf5, tmp_path):
    """transformers' in-memory layout: mlp.experts.gate_up_proj [E, 2I, H] (gate rows,
    then up rows) and down_proj [E, H, I], router mlp.gate.weight."""
    from safetensors.torch import save_file

    src = load_source(hf5)
    fused = {}
    for name, t in src.items():
        if ".block_sparse_moe.experts." in name:
            continue
        fused[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = t
    for n in range(2):
        p = f"model.layers.{n}.block_sparse_moe.experts"
        w1 = torch.stack([src[f"{p}.{e}.w1.weight"] for e in range(3)])
        w3 = torch.stack([src[f"{p}.{e}.w3.weight"] for e in range(3)])
        w2 = torch.stack([src[f"{p}.{e}.w2.weight"] for e in range(3)])
        fused[f"model.layers.{n}.mlp.experts.gate_up_proj"] = torch.cat([w1, w3], 1).contiguous()
        fused[f"model.layers.{n}.mlp.experts.down_proj"] = w2.contiguous()
    d = tmp_path / "fused"
    d.mkdir()
    (d / "config.json").write_bytes((hf5 / "config.json").read_bytes())
    save_file(fused, d / "model.safetensors")
    a, b = tmp_path / "a.colibri", tmp_path / "b.colibri"
    convert(hf5, a, dtype="f32", block_size=4, progress=False)
    convert(d, b, dtype="f32", block_size=4, progress=False)
    assert signature(a) == signature(b)


def test_fused_keys_are_what_transformers_uses(hf5):
    """Guard for the fused order: transformers' module holds exactly [w1; w3] and w2."""
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(hf5)
    src = load_source(hf5)
    ex = model.model.layers[0].mlp.experts
    p = "model.layers.0.block_sparse_moe.experts"
    torch.testing.assert_close(ex.gate_up_proj[1, :13], src[f"{p}.1.w1.weight"])
    torch.testing.assert_close(ex.gate_up_proj[1, 13:], src[f"{p}.1.w3.weight"])
    torch.testing.assert_close(ex.down_proj[1], src[f"{p}.1.w2.weight"])


def test_tokenizer_section_from_tokenizer_model(tmp_path):
    pytest.importorskip("sentencepiece")
    tok = REPO / "data" / "tokenizer.model.v1"
    hf = make_hf(tmp_path / "hf", vocab_size=32000, num_hidden_layers=1)
    (hf / "tokenizer.model").write_bytes(tok.read_bytes())
    out = tmp_path / "m.colibri"
    convert(hf, out, progress=False)
    info = inspect(out)
    m = info.metadata
    assert m["tokenizer.type"] == "sentencepiece_bpe"
    assert (m["tokenizer.bos_id"], m["tokenizer.eos_id"], m["tokenizer.unk_id"]) == (1, 2, 0)
    assert m["tokenizer.pad_id"] == -1
    assert info.section("tokenizer").size > 0 and info.section("tokenizer").crc_ok


def test_default_model_converts(tmp_path):
    d = REPO / "data" / "tiny-mixtral"
    out = tmp_path / "tiny.colibri"
    convert(d, out, progress=False)
    info = inspect(out, verify=True)
    h = info.header
    assert (h["vocab_size"], h["hidden_size"], h["n_layers"], h["n_experts"], h["top_k"],
            h["intermediate_size"], h["max_seq_len"]) == (32000, 96, 4, 8, 2, 192, 4096)
    assert info.metadata["model.head_dim"] == 24 and info.metadata["model.n_kv_heads"] == 2
    assert info.metadata["tokenizer.type"] == "sentencepiece_bpe"
    assert info.metadata["general.name"] == "tiny-mixtral"


def test_default_model_files():
    d = REPO / "data" / "tiny-mixtral"
    total = sum(f.stat().st_size for f in d.iterdir())
    assert total < 20e6
    assert (d / "tokenizer.model").read_bytes() == (REPO / "data" / "tokenizer.model.v1").read_bytes()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"]


# ------------------------------------------------------------------------ refusals

def test_missing_tensor_is_named_and_leaves_nothing(hf5, tmp_path):
    from safetensors.torch import save_file

    src = load_source(hf5)
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    del src[gone]
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_bytes((hf5 / "config.json").read_bytes())
    save_file(src, d / "model.safetensors")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(ConversionError, match=gone.replace(".", r"\.")):
        convert(d, out_dir / "m.colibri", progress=False)
    assert leftovers(out_dir) == []


def test_wrong_shape_is_named(hf5, tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    for f in hf5.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 14
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"experts\.0\.w1\.weight.*shape \[13, 20\]"):
        convert(d, tmp_path / "m.colibri", progress=False)
    assert leftovers(tmp_path) == []


def test_failure_while_writing_leaves_nothing_and_keeps_old_output(hf5, tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    for f in hf5.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "out.colibri"
    out.write_bytes(b"previous")
    # truncate the weights: the header is fine, the last tensors' bytes are gone
    st = d / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) - 400])
    with pytest.raises(ConversionError, match="past the end|truncated"):
        convert(d, out, progress=False)
    assert out.read_bytes() == b"previous"
    assert not (tmp_path / "out.colibri.tmp").exists()


def test_failure_mid_write_removes_tmp(hf5, tmp_path, monkeypatch):
    import importlib

    conv = importlib.import_module("colibri_lab.conversion.checkpoint")

    calls = {"n": 0}
    real = conv.SrcTensor.read_flat

    def flaky(self, first, count):
        calls["n"] += 1
        if calls["n"] == 9:
            raise OSError("disk on fire")
        return real(self, first, count)

    monkeypatch.setattr(conv.SrcTensor, "read_flat", flaky)
    with pytest.raises(OSError, match="disk on fire"):
        convert(hf5, tmp_path / "m.colibri", progress=False)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("model_type,arch", [("llama", "LlamaForCausalLM"),
                                             ("dbrx", "DbrxForCausalLM")])
def test_unknown_architecture_names_supported(tmp_path, model_type, arch):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch],
                                               "hidden_size": 8}))
    with pytest.raises(ConversionError, match=rf"unsupported architecture '{model_type}'.*mixtral"):
        convert(d, tmp_path / "m.colibri", progress=False)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("change,match", [
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}},
     "YaRN needs original_max_position_embeddings"),
    ({"rope_parameters": None, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}},
     "rope_type 'linear'"),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 64, "low_freq_factor": 1.0}},
     r"\['low_freq_factor'\]"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 5}, "head_dim 5 is odd"),
    ({"num_experts_per_tok": 4}, "num_experts_per_tok 4 > num_local_experts 3"),
    ({"num_key_value_heads": 2}, "not a multiple of num_key_value_heads"),
])  # fmt: skip
def test_unsupported_config_is_refused(hf5, tmp_path, change, match):
    d = tmp_path / "hf"
    d.mkdir()
    for f in hf5.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "config.json").read_text()) | change
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=match):
        convert(d, tmp_path / "m.colibri", progress=False)


def test_bad_arguments(hf5, tmp_path):
    for kw, match in [({"dtype": "q8"}, "dtype"), ({"quantize_router": "int4"}, "quantize_router"),
                      ({"block_size": 0}, "block_size"), ({"max_seq_len": 0}, "max_seq_len")]:
        with pytest.raises(ConversionError, match=match):
            convert(hf5, tmp_path / "m.colibri", progress=False, **kw)
    with pytest.raises(ConversionError, match="not a folder"):
        convert(tmp_path / "nope", tmp_path / "m.colibri", progress=False)
    with pytest.raises(ConversionError, match="no config.json"):
        convert(tmp_path, tmp_path / "m.colibri", progress=False)
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ConversionError, match=r"is a file: .*colibri_lab\.convert_gguf"):
        convert(tmp_path / "model.gguf", tmp_path / "m.colibri", progress=False)
    (tmp_path / "model.gguf").unlink()
    assert leftovers(tmp_path) == []
    from colibri_lab.conversion.gguf import convert_gguf
    assert colibri_lab.convert_gguf is convert_gguf   # the GGUF importer, loaded on first use


def test_big_endian_host_is_refused(hf5, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(ValueError, match="big-endian"):
        convert(hf5, tmp_path / "m.colibri", progress=False)


# ------------------------------------------------------------------------ command line

def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def test_cli_flags_subprocess(hf5, tmp_path):
    out = tmp_path / "m.colibri"
    r = subprocess.run([sys.executable, "-m", "colibri_lab.conversion.cli", "--model_name_or_path",
                        str(hf5), "--output_path", str(out), "--dtype", "f16",
                        "--quantize_router", "int8", "--block_size", "5", "--max_seq_len", "77"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    for stage in ("reading config", "tokenizer", "dense weights", "routers", "experts",
                  "finalising checksums"):
        assert stage in r.stderr
    assert "no tokenizer.model" in r.stderr
    info = inspect(out, verify=True)
    assert info.header["block_size"] == 5 and info.header["max_seq_len"] == 77
    assert info.metadata["model.weight_dtype"] == "f16"
    assert info.metadata["model.router_dtype"] == "int8"
    assert info.tensor("blk.0.ffn_gate_inp.weight").dtype == "i8"

    r = subprocess.run([sys.executable, "-m", "colibri_lab", "inspect", str(out), "--verify"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "blk.1.ffn_experts" in r.stdout and "all CRCs verified" in r.stdout

    out2 = tmp_path / "n.colibri"
    r = subprocess.run([sys.executable, "-m", "colibri_lab", "convert", "--model_name_or_path",
                        str(hf5), "--output_path", str(out2), "--quiet"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert inspect(out2).metadata["model.weight_dtype"] == "bf16"


def test_cli_main_errors(tmp_path, capsys):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rc = main(["--model_name_or_path", str(d), "--output_path", str(tmp_path / "m.colibri")])
    assert rc == 1
    assert "supported: mixtral" in capsys.readouterr().err
    bad = tmp_path / "bad.colibri"
    bad.write_bytes(b"x" * 300)
    from colibri_lab.__main__ import main as lab_main

    assert lab_main(["inspect", str(bad)]) == 1
    assert "not a .colibri file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--output_path", "x"])            # --model_name_or_path is required


def test_progress_output_in_process(hf5, tmp_path, capsys):
    convert(hf5, tmp_path / "m.colibri", progress=True)
    err = capsys.readouterr().err
    assert "[1/6] reading config" in err and "[6/6] finalising checksums" in err
    convert(hf5, tmp_path / "n.colibri", progress=False)
    assert capsys.readouterr().err == ""


def test_values_survive_in_model_terms(hf5, tmp_path):
    """A spot check in model terms: one expert's FFN computed from the packed file rows
    equals the same FFN from the checkpoint (f32)."""
    out = tmp_path / "m.colibri"
    convert(hf5, out, dtype="f32", block_size=4, progress=False)
    info = inspect(out)
    packed = info.read_tensor("blk.1.ffn_experts")[2]      # expert 2, [3I, H]
    I, B = 13, 4
    x = np.random.default_rng(0).standard_normal(20).astype(np.float64)
    h = np.empty(I)
    for b in range((I + B - 1) // B):          # the kernel's order: a block, then silu*up
        lo, hi = b * B, min((b + 1) * B, I)
        nb = hi - lo
        g = packed[2 * b * B: 2 * b * B + nb] @ x
        u = packed[2 * b * B + nb: 2 * b * B + 2 * nb] @ x
        h[lo:hi] = g / (1 + np.exp(-g)) * u
    y = h @ packed[2 * I:]
    src = load_source(hf5)
    p = "model.layers.1.block_sparse_moe.experts.2"
    w1, w3, w2 = (src[f"{p}.{k}.weight"].double().numpy() for k in ("w1", "w3", "w2"))
    g = w1 @ x
    want = w2 @ (g / (1 + np.exp(-g)) * (w3 @ x))
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-9)


def test_unused_checkpoint_tensors_are_reported(hf5, tmp_path):
    from safetensors.torch import save_file

    src = load_source(hf5)
    src["model.layers.0.block_sparse_moe.shared_expert.w1.weight"] = torch.zeros(3, 4)
    d = tmp_path / "extra"
    d.mkdir()
    (d / "config.json").write_bytes((hf5 / "config.json").read_bytes())
    save_file(src, d / "model.safetensors")
    with pytest.warns(RuntimeWarning, match="shared_expert"):
        convert(d, tmp_path / "m.colibri", progress=False)


# ------------------------------------------------------------------------ quantized mixes

from colibri_lab.format import blocks as quants  # noqa: E402
from colibri_lab.format.spec import (DTYPE_F32, DTYPE_Q2_K, DTYPE_Q3_K, DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q4_K,  # noqa: E402
                                     DTYPE_Q5_0, DTYPE_Q5_1, DTYPE_Q5_K, DTYPE_Q6_K, DTYPE_Q8_0,
                                     QUANT_DTYPES)

# rows that 256 divides, 8 experts (llama.cpp's Mixtral-8x rules), 4 layers (use_more_bits:
# layers 2 and 3)
QSHAPE = dict(vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=8,
              num_experts_per_tok=2)


@pytest.fixture(scope="module")
def hfq(tmp_path_factory):
    return make_hf(tmp_path_factory.mktemp("q") / "hf", **QSHAPE)


def source_of(name: str, src: dict) -> np.ndarray:
    """The checkpoint values a Mixtral file's tensor holds (f32, the tensor's shape)."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
           "output_norm.weight": "model.norm.weight"}
    if name in top:
        return src[top[name]].float().numpy()
    _, n, rest = name.split(".", 2)
    p = f"model.layers.{n}"
    per = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
           "attn_v.weight": "self_attn.v_proj.weight",
           "attn_output.weight": "self_attn.o_proj.weight",
           "attn_norm.weight": "input_layernorm.weight",
           "ffn_norm.weight": "post_attention_layernorm.weight",
           "ffn_gate_inp.weight": "block_sparse_moe.gate.weight"}
    if rest in per:
        return src[f"{p}.{per[rest]}"].float().numpy()
    w = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}[rest]
    E = sum(1 for k in src if k.startswith(f"{p}.block_sparse_moe.experts.") and k.endswith(".w1.weight"))
    return np.stack([src[f"{p}.block_sparse_moe.experts.{e}.{w}.weight"].float().numpy()
                     for e in range(E)])


Q4, Q5, Q6, Q8 = DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K, DTYPE_Q8_0
# what each mix gives the Mixtral tensors of QSHAPE (llama.cpp's choices, written out)
EXPECTED = {
    "q8_0": lambda kind, n: DTYPE_F32 if kind in ("norm", "router") else Q8,
    "q4_k": lambda kind, n: DTYPE_F32 if kind in ("norm", "router") else Q4,
    **{m: (lambda kind, n, t=t: DTYPE_F32 if kind in ("norm", "router") else t)
       for m, t in (("q4_0", DTYPE_Q4_0), ("q4_1", DTYPE_Q4_1), ("q5_0", DTYPE_Q5_0),
                    ("q5_1", DTYPE_Q5_1))},
    "q2_k": lambda kind, n: {"norm": DTYPE_F32, "router": DTYPE_F32, "token_embd": DTYPE_Q2_K,
                             "output": Q6, "attn_q": DTYPE_Q2_K, "attn_k": Q8, "attn_v": Q8,
                             "attn_output": Q5, "ffn_gate_exps": DTYPE_Q2_K,
                             "ffn_up_exps": DTYPE_Q2_K, "ffn_down_exps": DTYPE_Q3_K}[kind],
    "q4_k_m": lambda kind, n: {"norm": DTYPE_F32, "router": DTYPE_F32, "token_embd": Q4,
                               "output": Q6, "attn_q": Q4, "attn_k": Q8, "attn_v": Q8,
                               "attn_output": Q5, "ffn_gate_exps": Q4, "ffn_up_exps": Q4,
                               "ffn_down_exps": Q6 if n in (2, 3) else Q4}[kind],
}


def kind_of(name: str) -> tuple[str, int | None]:
    if "norm" in name:
        return "norm", None
    if name in ("token_embd.weight", "output.weight"):
        return name.split(".")[0], None
    _, n, rest = name.split(".", 2)
    k = rest.replace(".weight", "")
    return ("router" if k == "ffn_gate_inp" else k), int(n)


@pytest.mark.parametrize("mix", ["q8_0", "q4_k", "q4_k_m", "q4_0", "q5_1", "q2_k"])
def test_quantized_mix_converts(hfq, tmp_path, mix):
    out = tmp_path / f"{mix}.colibri"
    convert(hfq, out, dtype=mix, progress=False)
    info = inspect(out, verify=True)
    assert info.version == 2 and info.header["version"] == 2
    assert info.metadata["model.weight_dtype"] == mix
    assert info.metadata["model.router_dtype"] == "f32"
    names = [t.name for t in info.tensors]
    assert not any(n.endswith(("ffn_experts", "ffn_dense", "ffn_shared")) for n in names)
    src = load_source(hfq)
    seen = set()
    for t in info.tensors:
        kind, n = kind_of(t.name)
        seen.add(kind)
        assert t.dtype_id == EXPECTED[mix](kind, n), (t.name, t.dtype)
        assert t.layout == "row_major"
        want_src = source_of(t.name, src)
        assert want_src.shape == t.shape, t.name     # down not transposed: [E, H, I]
        got = info.read_tensor(t.name, as_float32=True)
        if t.dtype_id in QUANT_DTYPES:
            q = quants.quantize(want_src.reshape(-1, t.shape[-1]), t.dtype_id)
            assert np.array_equal(info.read_tensor(t.name).reshape(q.shape), q), t.name
            want = quants.dequantize(q, t.dtype_id, t.shape[-1]).reshape(t.shape)
        else:
            want = want_src
        assert got.dtype == np.float32 and np.array_equal(got, want), t.name
        # the norm is the dequantized tensor's
        assert t.l2norm == pytest.approx(float(np.linalg.norm(want.astype(np.float64))), rel=1e-12)
    assert {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "router", "output"} <= seen
    sec = {t.name: t.offset for t in info.tensors}
    ex = info.section("experts")
    for n in range(4):   # the split FFN lives in the experts section, gate, up, down
        offs = [sec[f"blk.{n}.ffn_{w}_exps"] for w in ("gate", "up", "down")]
        assert offs == sorted(offs) and ex.offset <= offs[0] < ex.offset + ex.size


def test_quantized_mix_is_deterministic_and_smaller(hfq, tmp_path):
    a, b, c = tmp_path / "a.colibri", tmp_path / "b.colibri", tmp_path / "c.colibri"
    convert(hfq, a, dtype="q4_k_m", progress=False)
    convert(hfq, b, dtype="q4_k_m", progress=False)
    convert(hfq, c, dtype="bf16", progress=False)
    assert a.read_bytes() == b.read_bytes()
    assert a.stat().st_size < 0.5 * c.stat().st_size
    assert inspect(c).version == 1                       # float files stay version 1


def test_quantized_mix_with_int8_router(hfq, tmp_path):
    out = tmp_path / "m.colibri"
    convert(hfq, out, dtype="q8_0", quantize_router="int8", progress=False)
    info = inspect(out, verify=True)
    assert info.metadata["model.router_dtype"] == "int8" and info.flags["router_int8"]
    assert info.tensor("blk.0.ffn_gate_inp.weight").dtype == "i8"
    assert info.tensor("blk.0.ffn_gate_inp.scale").dtype == "f32"
    assert info.tensor("blk.0.ffn_gate_exps").dtype == "q8_0"


def test_quantized_mix_row_fallbacks(tmp_path):
    """Rows no K block divides fall back as llama.cpp's do (Q4_K -> Q5_0, Q6_K -> Q8_0); rows
    32 does not divide to F16 (values then as the float conversion gives them). The FFN is
    split all the same."""
    hf = make_hf(tmp_path / "hf64", hidden_size=64, intermediate_size=96, head_dim=16,
                 num_attention_heads=4, num_key_value_heads=2)
    out = tmp_path / "a.colibri"
    convert(hf, out, dtype="q4_k_m", progress=False)
    info = inspect(out, verify=True)
    assert info.version == 2
    assert {t.dtype for t in info.tensors if t.dtype != "f32"} == {"q5_0", "q8_0"}
    assert info.tensor("blk.0.ffn_gate_exps").dtype == "q5_0"     # Q4_K's fallback
    assert info.tensor("blk.1.ffn_down_exps").shape == (3, 64, 96)
    src = load_source(hf)
    w = source_of("blk.0.ffn_gate_exps", src)
    want = quants.dequantize(quants.quantize(w.reshape(-1, 64), DTYPE_Q5_0), DTYPE_Q5_0, 64)
    assert np.array_equal(info.read_tensor("blk.0.ffn_gate_exps", as_float32=True).reshape(want.shape), want)
    src = load_source(hf)
    want = quants.dequantize(quants.quantize(source_of("output.weight", src), DTYPE_Q8_0),
                             DTYPE_Q8_0, 64)
    assert np.array_equal(info.read_tensor("output.weight", as_float32=True), want)

    odd = make_hf(tmp_path / "odd")                     # hidden 20, intermediate 13
    out = tmp_path / "b.colibri"
    convert(odd, out, dtype="q8_0", progress=False)
    info = inspect(out, verify=True)
    assert info.version == 2
    assert {t.dtype for t in info.tensors} == {"f16", "f32"}
    t = info.tensor("blk.0.ffn_down_exps")
    assert (t.dtype, t.layout, t.shape) == ("f16", "row_major", (3, 20, 13))
    src = load_source(odd)
    w2 = np.stack([src[f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"].numpy()
                   for e in range(3)])
    assert np.array_equal(info.read_tensor("blk.0.ffn_down_exps"), w2.astype(np.float16))
    assert info.tensor("blk.0.ffn_gate_inp.weight").dtype == "f32"


def test_quantized_qwen2_moe_dense_and_shared_expert(tmp_path):
    from colibri_lab.bench.models import FamilyShape, build_model, save_checkpoint

    shp = FamilyShape("qwen2_moe", vocab=300, hidden=256, inter=256, dense_inter=512,
                      shared_inter=256, layers=3, heads=4, kv_heads=2, experts=4, top_k=2,
                      mlp_only_layers=(1,))
    hf = save_checkpoint(build_model(shp), tmp_path / "hf")
    out = tmp_path / "m.colibri"
    convert(hf, out, dtype="q4_k_m", progress=False)
    info = inspect(out, verify=True)
    assert info.version == 2
    d = {t.name: t.dtype for t in info.tensors}
    # layer 1 is a dense MLP, layers 0 and 2 MoE with a gated shared expert; 3 layers:
    # use_more_bits only on layer 2; not 8 experts, so attn_k / attn_output stay Q4_K
    assert d["blk.1.ffn_gate"] == d["blk.1.ffn_up"] == d["blk.1.ffn_down"] == "q4_k"
    assert "blk.1.ffn_gate_exps" not in d and "blk.1.ffn_gate_inp.weight" not in d
    assert d["blk.0.ffn_down_exps"] == d["blk.0.ffn_down_shexp"] == "q4_k"
    assert d["blk.2.ffn_down_exps"] == d["blk.2.ffn_down_shexp"] == "q6_k"
    assert d["blk.2.attn_v.weight"] == "q6_k" and d["blk.0.attn_v.weight"] == "q4_k"
    assert d["blk.0.attn_k.weight"] == d["blk.0.attn_output.weight"] == "q4_k"
    assert d["blk.0.ffn_gate_shexp"] == d["blk.0.ffn_up_shexp"] == "q4_k"
    assert d["blk.0.ffn_shared_gate.weight"] == "f32" and d["blk.0.attn_q.bias"] == "f32"
    assert info.tensor("blk.1.ffn_down").shape == (256, 512)
    assert info.tensor("blk.0.ffn_up_shexp").shape == (256, 256)
    src = load_source(hf)
    for name, key in (("blk.1.ffn_down", "model.layers.1.mlp.down_proj.weight"),
                      ("blk.2.ffn_gate_shexp", "model.layers.2.mlp.shared_expert.gate_proj.weight"),
                      ("blk.2.ffn_down_shexp", "model.layers.2.mlp.shared_expert.down_proj.weight")):
        t = info.tensor(name)
        w = src[key].float().numpy()
        want = quants.dequantize(quants.quantize(w, t.dtype_id), t.dtype_id, w.shape[-1])
        assert np.array_equal(info.read_tensor(name, as_float32=True), want), name
    assert np.array_equal(info.read_tensor("blk.0.ffn_shared_gate.weight"),
                          src["model.layers.0.mlp.shared_expert_gate.weight"].float().numpy())


def test_quantized_mix_from_the_command_line(hfq, tmp_path):
    out = tmp_path / "m.colibri"
    assert main(["--model_name_or_path", str(hfq), "--output_path", str(out),
                 "--dtype", "q4_k", "--quiet"]) == 0
    info = inspect(out)
    assert info.metadata["model.weight_dtype"] == "q4_k"
    assert info.tensor("output.weight").dtype == "q4_k"
    with pytest.raises(SystemExit):
        main(["--model_name_or_path", str(hfq), "--output_path", str(out), "--dtype", "q3_k"])


def test_quantized_conversion_streams(tmp_path):
    """Peak RSS of a q4_k_m conversion stays a few row chunks: no tensor is read whole."""
    from test_convert_memory import MB, child_peak_kb, write_synthetic_mixtral

    shape = dict(vocab=32000, hidden=256, inter=512, layers=4, experts=8, heads=4, kv_heads=2)
    hf = tmp_path / "hf"
    total, largest = write_synthetic_mixtral(hf, **shape)
    out = tmp_path / "m.colibri"
    base = child_peak_kb("-")
    peak = child_peak_kb(str(hf), str(out), "q4_k_m")
    delta = (peak - base) * 1024
    print(f"\nq4_k_m: model {total / MB:.0f} MiB f32, largest tensor {largest / MB:.1f} MiB, "
          f"converter's own {delta / MB:.1f} MiB")
    assert delta <= 48 * MB, f"converter used {delta / MB:.0f} MiB"
    info = inspect(out)
    assert info.metadata["model.weight_dtype"] == "q4_k_m"
    assert info.tensor("blk.0.ffn_down_exps").shape == (8, 256, 512)
