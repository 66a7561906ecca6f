"""GGUF import of llama-quantize's files holding Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL and
IQ4_XS blocks: on a model whose rows are not multiples of 256 (hidden 160), so that the K mixes
fall back to the 32-element types as they do for such models, and on a 256-wide one (the K and
IQ4_XS blocks themselves):

* each file imports, its tensors' bytes and dtypes are the GGUF's;
* the exact mode's logits on it equal those of the import of the same file with these types'
  tensors replaced by their (gguf.quants-dequantized) f32 values; the fast mode runs these
  types on its int8 path (cpu/fast.h): its logits differ from the exact mode's, and those of
  the int8 table this CPU picks are the plain-C reference table's bit for bit
  (COLIBRI_FAST_KERNELS=reference). Where the CPU's table also has its own attention (the
  BF16 tables on AVX-512: their own summation order, fast.h), that table runs alone too and
  its int8 table is the one compared;
* `mix_dtype` gives every tensor the type llama-quantize gave it (Q4_K_M, Q3_K_M, Q2_K), and
  `quants.quantize` its bytes (Q2_K, Q3_K, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0 blocks of the f32 file).

Needs llama.cpp's convert_hf_to_gguf.py and a built llama-quantize (the benchmarks build it);
skipped, naming the missing file, without them. The always-on checks of the types are
tests/test_quants.py, tests/test_quant_native.py and native/tests/test_kernels.c.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")
pytest.importorskip("tokenizers")

import colibri_lab  # noqa: E402
from colibri_lab.bench.models import FamilyShape, build_model, save_checkpoint  # noqa: E402
from colibri_lab.conversion import mixes  # noqa: E402
from colibri_lab.conversion.gguf import convert_gguf  # noqa: E402
from colibri_lab.format import blocks as quants, reader as fmt_reader  # noqa: E402
from colibri_lab.format.spec import DTYPE_NAMES  # noqa: E402
from test_gguf_import import (  # noqa: E402
    _bpe_tokenizer, _check_bytes_as_stored, _llama_program, _llama_root, _native_or_fail,
    dequantized, llama_cpp_source, make_ggufs, no_vocab, rewrite_gguf)

# hidden and expert widths multiples of 32, not of 256; and multiples of 256
SHAPES = {160: dict(family="qwen3_moe", hidden=160, inter=96, layers=2, heads=4, kv_heads=2,
                    head_dim=32, experts=4, top_k=2, norm_topk=True, seed=12),
          256: dict(family="qwen3_moe", hidden=256, inter=256, layers=2, heads=4, kv_heads=2,
                    head_dim=64, experts=4, top_k=2, norm_topk=True, seed=14)}
# (width, llama-quantize ftype) -> block types its file must hold
FTYPES = {(160, "Q4_K_M"): {"Q5_0", "Q8_0"}, (160, "Q3_K_M"): {"Q4_0", "Q5_1", "Q8_0"},
          (160, "Q2_K"): {"Q4_0", "Q8_0"}, (160, "Q4_0"): {"Q4_0"}, (160, "Q4_1"): {"Q4_1"},
          (160, "Q5_0"): {"Q5_0"}, (160, "Q5_1"): {"Q5_1"}, (160, "IQ4_NL"): {"IQ4_NL"},
          (160, "IQ4_XS"): {"IQ4_NL"},
          (256, "Q4_K_M"): {"Q4_K", "Q6_K"}, (256, "Q3_K_M"): {"Q3_K", "Q4_K", "Q5_K", "Q6_K"},
          (256, "Q2_K"): {"Q2_K", "Q3_K", "Q6_K"}, (256, "IQ4_XS"): {"IQ4_XS"}}
NEW_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"}
# the ftypes whose per-tensor choice mix_dtype reproduces
MIXED = [(w, f) for w in SHAPES for f in ("Q4_K_M", "Q3_K_M", "Q2_K")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """({width: the f32 GGUF of a Qwen3-MoE made by convert_hf_to_gguf.py}, llama-quantize)"""
    work = tmp_path_factory.mktemp("gguf-qtypes")
    src = llama_cpp_source(_llama_root())
    exe = _llama_program(src, "llama-quantize")
    tok = _bpe_tokenizer("qwen", 400)
    files, jobs = {}, []
    for w, shape in SHAPES.items():
        folder = work / f"ckpt{w}"
        save_checkpoint(build_model(FamilyShape(vocab=tok.get_vocab_size(), **shape)), folder,
                        tokenizer="none")
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": None, "eos_token": "<|im_end|>",
             "tokenizer_class": "PreTrainedTokenizerFast"}))
        files[w] = work / f"m{w}-f32.gguf"
        jobs.append({"model": str(folder), "outtype": "f32", "outfile": str(files[w]), "pre": "qwen2"})
    make_ggufs(src, jobs, work)
    return files, exe


def new_types_dequantized(name, ttype, data):
    """A rewrite_gguf transform: the tensors of the types above as their F32 values."""
    return dequantized(name, ttype, data) if ttype.name in NEW_TYPES else [(name, ttype, data)]


def _quantize(model, width: int, ftype: str, work: Path) -> Path:
    files, exe = model
    q = work / f"m{width}-{ftype}.gguf"
    r = subprocess.run([str(exe), str(files[width]), str(q), ftype], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return q


@pytest.mark.parametrize("width,ftype", list(FTYPES))
def test_imports_and_runs_as_its_values(model, width, ftype, tmp_path, monkeypatch):
    from helpers import random_ids

    q = _quantize(model, width, ftype, tmp_path)
    types = {t.tensor_type.name for t in gguf.GGUFReader(q).tensors}
    assert FTYPES[width, ftype] <= types, types
    out = convert_gguf(q, tmp_path / "q.colibri", progress=False)
    info = fmt_reader.inspect(out, verify=True)
    _check_bytes_as_stored(info, q, permuted=False)
    deq = rewrite_gguf(q, tmp_path / "deq.gguf", tensors=new_types_dequantized, fields=no_vocab)
    ref = convert_gguf(deq, tmp_path / "deq.colibri", progress=False)
    ids = random_ids(info.metadata["model.vocab_size"], 16, seed=13)
    _native_or_fail()
    with colibri_lab.Engine(out) as eng:
        got = eng.forward(ids)
    with colibri_lab.Engine(ref) as eng:
        want = eng.forward(ids)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())),
                               err_msg=f"{width} {ftype} exact")
    with colibri_lab.Engine(out, precision="fast") as eng:
        fast = eng.forward(ids)
        kernels = eng.config.kernels
    int8 = re.search(r"fast\(int8 ([\w-]+)", kernels)
    assert int8, kernels
    assert np.isfinite(fast).all() and not np.array_equal(fast, got)
    if ", attention " in kernels:   # the BF16 table's own attention: its int8 table alone
        monkeypatch.setenv("COLIBRI_FAST_KERNELS", int8[1])   # read when an engine starts
        with colibri_lab.Engine(out, precision="fast") as eng:
            assert f"fast(int8 {int8[1]}" in eng.config.kernels and ", attention " not in eng.config.kernels, \
                eng.config.kernels
            fast = eng.forward(ids)
    monkeypatch.setenv("COLIBRI_FAST_KERNELS", "reference")
    with colibri_lab.Engine(out, precision="fast") as eng:
        assert "fast(int8 reference," in eng.config.kernels, eng.config.kernels
        fast_ref = eng.forward(ids)
    assert np.array_equal(fast, fast_ref), \
        f"{width} {ftype} {int8[1]}: max |diff| {np.abs(fast - fast_ref).max():g}"


@pytest.mark.parametrize("width,ftype", MIXED)
def test_mix_dtype_is_llama_quantize_s_choice(model, width, ftype, tmp_path):
    shape_ = SHAPES[width]
    q = _quantize(model, width, ftype, tmp_path)
    r = gguf.GGUFReader(q)
    got, want = {}, {}
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))     # ggml ne order -> rows last
        dt = mixes.mix_dtype(ftype.lower(), t.name, shape, layer=None, n_layers=shape_["layers"],
                             n_experts=shape_["experts"], n_gqa=shape_["heads"] // shape_["kv_heads"])
        got[t.name] = DTYPE_NAMES[dt].upper()
        want[t.name] = t.tensor_type.name
    assert got == want
    # and our quantizers write llama-quantize's bytes for every quantized tensor
    src = {t.name: t for t in gguf.GGUFReader(model[0][width]).tensors}
    for t in r.tensors:
        dt = quants.DTYPE_OF_GGML.get(t.tensor_type)
        if dt not in quants.WRITABLE_DTYPES:
            continue
        x = np.array(src[t.name].data, dtype=np.float32)
        q = quants.quantize(x.reshape(-1, x.shape[-1]), dt)
        assert q.tobytes() == np.array(t.data).tobytes(), (t.name, t.tensor_type.name)
