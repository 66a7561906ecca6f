"""GGUF import of DeepSeek-V2/V3 (`deepseek2`) and gpt-oss (`gpt-oss`): GGUFs made by
llama.cpp's own convert_hf_to_gguf.py (as tests/test_gguf_import.py fetches and runs it; one
converter process per pytest session makes both files' GGUFs: conftest's gguf_models)
from tiny random checkpoints, imported and compared with transformers and with the
Hugging Face converter's file of the same checkpoint.

* DeepSeek-V3: q LoRA, sigmoid router with exp_probs_b, 4 groups (2 kept), renormalised and
  scaled weights, a leading dense layer, a shared expert, YaRN; the converter's split
  attn_k_b / attn_v_b (and the older single attn_kv_b, rewritten from it);
* DeepSeek-V2: no q LoRA, softmax router, no renormalisation, two shared experts, tied
  embeddings, YaRN with mscale_all_dim (the softmax scale changes too);
* gpt-oss: attention sinks, sliding / full layers, q/k/v/o, router and expert biases, the
  clamped SwiGLU, YaRN; MXFP4 experts (rewritten with gguf.quants, ggml's reference).

Checked: metadata and family options equal the Hugging Face converter's, exact-mode logits
equal transformers' (f32) and those of the dequantized values (bf16, q8_0, MXFP4), the
tokenizer (pre-tokenizers `deepseek-v3`, `gpt-4o`) equal to the Hugging Face converter's
and to `tokenizers` on varied text, the chat template kept; refusals by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

import colibri_lab  # noqa: E402
from colibri_lab.bench.models import (  # noqa: E402
    DeepseekShape, FamilyShape, build_model, byte_level_bpe, load_model, save_checkpoint,
)
from colibri_lab.conversion.gguf import convert_gguf  # noqa: E402
from colibri_lab.conversion.spec import ConversionError  # noqa: E402
from colibri_lab.format import reader as fmt_reader  # noqa: E402
from test_gguf_import import (  # noqa: E402
    CHATML, TEXTS, _corpus, _engine, _native_or_fail, dequantized, no_vocab, rewrite_gguf, section_bytes,
)

TOL = 1e-4
MORE_TEXTS = [
    "x = [1, 22, 333, 4444, 55555]  # digits 1234567890\n\tif x:\n\t\treturn x[0]  \n\n\n",
    "東京都の天気は晴れ。今日は2026年12月6日です。カタカナとひらがな、漢字。",
    "emoji 🙂🚀👩‍💻 and ZWJ; tabs\t\tand    runs of     spaces\r\n\r\nCRLF",
    "HELLO World's don't I'M they'll WE'VE snake_case camelCase URL/path/to?q=1&r=2",
]
YARN_V3 = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
               original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
               mscale=1.0, mscale_all_dim=1.0)
# DeepSeek-V2's own YaRN: mscale = mscale_all_dim (the GGUF stores only mscale_all_dim)
YARN_V2 = dict(YARN_V3, mscale=0.707, mscale_all_dim=0.707)
# q8_0 needs rows of whole 32-value blocks: every column count a multiple of 32
SHAPES = {
    "deepseek_v3": DeepseekShape(
        "deepseek_v3", hidden=64, inter=32, dense_inter=64, layers=3, heads=2, q_lora=32,
        kv_lora=32, nope=32, rope=16, v_dim=32, experts=8, top_k=2, shared=1, first_dense=1,
        n_group=4, topk_group=2, norm_topk=True, scale=2.5, yarn=YARN_V3, max_pos=256, seed=31),
    "deepseek_v2": DeepseekShape(
        "deepseek_v2", hidden=64, inter=32, dense_inter=96, layers=2, heads=2, kv_lora=32,
        nope=32, rope=16, v_dim=32, experts=4, top_k=2, shared=2, first_dense=1,
        norm_topk=False, yarn=YARN_V2, tie=True, max_pos=256, seed=32),
    "gpt_oss": FamilyShape(
        "gpt_oss", hidden=64, inter=32, layers=3, heads=4, kv_heads=2, head_dim=32, experts=4,
        top_k=2, sliding_window=6, max_pos=256, seed=33,
        rope=(("rope_type", "yarn"), ("rope_theta", 10000.0), ("factor", 4.0),
              ("original_max_position_embeddings", 64), ("beta_fast", 32.0), ("beta_slow", 1.0))),
}
PRE = {"deepseek_v3": "deepseek-v3", "deepseek_v2": "deepseek-llm", "gpt_oss": "gpt-4o"}
STYLE = {"deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v3", "gpt_oss": "o200k"}
OUTTYPES = {"deepseek_v3": ("f32", "bf16", "q8_0"), "deepseek_v2": ("f32", "q8_0"),
            "gpt_oss": ("f32", "bf16", "q8_0")}
FAMILIES = tuple(SHAPES)
QUANTIZED = [(f, t) for f in FAMILIES for t in OUTTYPES[f] if t != "f32"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _checkpoint(fam: str, folder: Path):
    tok = byte_level_bpe(_corpus(), 600, SPECIALS, style=STYLE[fam])
    if fam == "deepseek_v2":   # DeepSeek-V2's own pre-tokenizer: six splits (its merges as trained)
        from tokenizers import Regex, pre_tokenizers

        from colibri_lab.conversion.bpe import DEEPSEEK_LLM_SPLITS

        tok.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False) for rx in DEEPSEEK_LLM_SPLITS),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    shape = SHAPES[fam]
    import dataclasses

    shape = dataclasses.replace(shape, vocab=tok.get_vocab_size() + 5)   # [PAD] fillers
    save_checkpoint(build_model(shape), folder, tokenizer="none")
    if fam == "deepseek_v3":
        # as DeepSeek-V3's own config.json: llama.cpp's converter writes expert_gating_func
        # from scoring_func (transformers' config object does not keep it)
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(scoring_func="sigmoid", topk_method="noaux_tc")
        (folder / "config.json").write_text(json.dumps(cfg))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok


def model_jobs(work: Path) -> tuple[list[dict], dict]:
    """The checkpoints of this file under `work` and the converter jobs that make their
    GGUFs: (jobs, state), state JSON-able for load_models."""
    state, jobs = {}, []
    for fam in FAMILIES:
        folder = work / fam
        _checkpoint(fam, folder)
        hf = work / f"{fam}-hf.colibri"
        colibri_lab.convert(folder, hf, dtype="f32", progress=False)
        files = {}
        for t in OUTTYPES[fam]:
            files[t] = str(work / f"{fam}-{t}.gguf")
            jobs.append({"model": str(folder), "outtype": t, "outfile": files[t], "pre": PRE[fam]})
        state[fam] = {"folder": str(folder), "hf": str(hf), "gguf": files}
    # DeepSeek's downloadable GGUFs are split (a hub file is at most 50 GB): its q8_0 again,
    # in shards of at most 9 tensors, the first holding only the metadata
    split = work / "split"
    split.mkdir()
    jobs.append({"model": state["deepseek_v3"]["folder"], "outtype": "q8_0",
                 "outfile": str(split / "deepseek_v3-q8_0.gguf"), "pre": PRE["deepseek_v3"],
                 "args": ["--split-max-tensors", "9", "--no-tensor-first-split"]})
    state["split"] = str(split)
    state["gpt_oss_mxfp4"] = _hub_mxfp4_checkpoint(work / "gpt_oss_mxfp4", jobs)
    return jobs, state


def load_models(state: dict, src: Path) -> dict:
    """family -> dict(folder, tok, hf (the HF converter's f32 file), gguf {outtype: path});
    "split" -> the shards of DeepSeek-V3's split q8_0 GGUF, in order;
    "gpt_oss_mxfp4" -> dict(folder, hf, blocks {(layer, name): ggml MXFP4 rows}, gguf)."""
    from tokenizers import Tokenizer

    out = {"src": src}
    for fam in FAMILIES:
        st = state[fam]
        out[fam] = {"folder": Path(st["folder"]), "hf": Path(st["hf"]),
                    "gguf": {k: Path(v) for k, v in st["gguf"].items()},
                    "tok": Tokenizer.from_file(str(Path(st["folder"]) / "tokenizer.json"))}
    out["split"] = sorted(Path(state["split"]).glob("deepseek_v3-q8_0-*-of-*.gguf"))
    st = state["gpt_oss_mxfp4"]
    with np.load(st["blocks"]) as z:
        blocks = {(int(k.split(":")[0]), k.split(":")[1]): z[k] for k in z.files}
    out["gpt_oss_mxfp4"] = {"folder": Path(st["folder"]), "hf": Path(st["hf"]), "blocks": blocks,
                            "gguf": Path(st["gguf"])}
    return out


@pytest.fixture(scope="module")
def models(gguf_models):
    """The GGUFs of this file, made by the session's one converter process (conftest's
    gguf_models, shared with test_gguf_import.py)."""
    return load_models(gguf_models["families"], gguf_models["src"])


def _hub_mxfp4_checkpoint(folder: Path, jobs: list) -> dict:
    """gpt-oss as the hub ships it: experts as *_blocks / *_scales (MXFP4, rows = outputs,
    gate/up interleaved) and quantization_config mxfp4, for which llama.cpp's converter
    repacks the blocks into ggml's MXFP4 instead of writing floats. Returns the state
    dict(folder, hf (the HF converter's f32 file), blocks (an .npz of the ggml MXFP4 rows by
    "layer:name"), gguf)."""
    from safetensors.torch import load_file, save_file

    from colibri_lab.format import blocks as quants
    from colibri_lab.format.spec import DTYPE_MXFP4
    from test_parity_gptoss import _hf_mxfp4

    model = build_model(SHAPES["gpt_oss"])
    save_checkpoint(model, folder, tokenizer="none")
    sd = load_file(str(folder / "model.safetensors"))
    ours = {}
    for n, layer in enumerate(model.model.layers):
        ex, p = layer.mlp.experts, f"model.layers.{n}.mlp.experts"
        for name, prm in (("gate_up_proj", ex.gate_up_proj), ("down_proj", ex.down_proj)):
            rows = prm.detach().numpy().transpose(0, 2, 1)   # [E, out, in]
            q = quants.to_stored(np.ascontiguousarray(rows.reshape(-1, rows.shape[-1])), DTYPE_MXFP4)
            ours[n, name] = q.reshape(*rows.shape[:-1], -1)
            b, sc = _hf_mxfp4(ours[n, name])
            del sd[f"{p}.{name}"]
            sd[f"{p}.{name}_blocks"] = torch.from_numpy(b)
            sd[f"{p}.{name}_scales"] = torch.from_numpy(sc)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):   # the gpt_oss checkpoint's
        (folder / f).write_bytes((folder.parent / "gpt_oss" / f).read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(cfg))
    hf = folder.parent / "gpt_oss_mxfp4-hf.colibri"
    colibri_lab.convert(folder, hf, dtype="f32", progress=False, tokenizer="none")
    g = folder.parent / "gpt_oss_mxfp4.gguf"
    jobs.append({"model": str(folder), "outtype": "f32", "outfile": str(g), "pre": "gpt-4o"})
    blocks = folder.parent / "gpt_oss_mxfp4-blocks.npz"
    np.savez(blocks, **{f"{n}:{name}": v for (n, name), v in ours.items()})
    return {"folder": str(folder), "hf": str(hf), "blocks": str(blocks), "gguf": str(g)}


@pytest.fixture(scope="module")
def imported(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("families-imported")
    cache = {}

    def get(fam: str, outtype: str) -> Path:
        if (fam, outtype) not in cache:
            out = work / f"{fam}-{outtype}.colibri"
            assert convert_gguf(models[fam]["gguf"][outtype], out, progress=False) == str(out)
            cache[fam, outtype] = out
        return cache[fam, outtype]
    return get


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-6, abs=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


# --------------------------------------------------------------------------- metadata

@pytest.mark.parametrize("fam", FAMILIES)
def test_metadata_equals_the_hf_converter(models, imported, fam):
    """Hyper-parameters, family options (MLA widths, groups, routing, sinks, windows, YaRN
    frequencies) and the chat template equal the Hugging Face converter's for the same
    checkpoint; floats read back from the GGUF's f32 values within 1e-6. The end tokens are
    each source's own: llama.cpp's end-of-generation set for the GGUF."""
    from colibri_lab.conversion.gguf import gguf_end_ids

    hf = fmt_reader.inspect(models[fam]["hf"])
    got = fmt_reader.inspect(imported(fam, "f32"), verify=True)
    eos = got.metadata["tokenizer.eos_id"]
    assert got.metadata.get("tokenizer.end_ids", []) == \
        [i for i in gguf_end_ids(str(models[fam]["gguf"]["f32"])) if i != eos]
    own = {"general.name", "convert.source", "model.weight_dtype", "tokenizer.special_source", "tokenizer.end_ids"}
    keys = (set(hf.metadata) | set(got.metadata)) - own
    diff = {k: (got.metadata.get(k), hf.metadata.get(k)) for k in sorted(keys)
            if not _close(got.metadata.get(k), hf.metadata.get(k))}
    assert not diff
    assert got.metadata["general.architecture"] == fam
    assert got.metadata["tokenizer.chat_template"] == CHATML


# --------------------------------------------------------------------------- logits

def _hf_ref(models, fam, ids):
    from helpers import hf_logits

    ref, _ = hf_logits(load_model(fam, models[fam]["folder"]), ids)
    return ref


@pytest.mark.parametrize("fam", FAMILIES)
def test_engine_logits_equal_transformers(models, imported, fam):
    """Exact mode on the f32 import: transformers' logits within 1e-4 (30 tokens: past the
    gpt-oss window), and the Hugging Face converter's file's."""
    from helpers import random_ids

    info = fmt_reader.inspect(imported(fam, "f32"))
    ids = random_ids(info.metadata["model.vocab_size"], 30, seed=41)
    ref = _hf_ref(models, fam, ids)
    with _engine(imported(fam, "f32")) as eng:
        got = eng.forward(ids)
    with _engine(models[fam]["hf"]) as eng:
        conv = eng.forward(ids)
    d = float(np.abs(got - ref).max())
    assert d <= TOL * max(1.0, float(np.abs(ref).max())), f"{fam}: max |Δ| vs transformers {d:.3g}"
    assert float(np.abs(got - conv).max()) <= TOL


@pytest.mark.parametrize("fam,outtype", QUANTIZED)
def test_quantized_imports_run_as_their_values(models, imported, fam, outtype, tmp_path):
    """bf16 / q8_0: the weights keep the GGUF's dtype and bytes (attn_kv_b rebuilt from
    block-quantized attn_k_b / attn_v_b is f32, their exact values), and the engine's logits
    equal those of the f32 GGUF of the same dequantized values."""
    from helpers import random_ids

    path = imported(fam, outtype)
    info = fmt_reader.inspect(path, verify=True)
    assert info.metadata["model.weight_dtype"] == f"gguf_{outtype}"
    r = gguf.GGUFReader(models[fam]["gguf"][outtype])
    src = {t.name: t for t in r.tensors}
    for t in info.tensors:
        name = t.name if t.name.endswith((".weight", ".bias")) else t.name + ".weight"
        if name in src and len(t.shape) >= 2 and "ffn_gate_inp" not in name and \
                "attn_q" not in name and "kv_a_mqa" not in name:
            assert t.dtype == src[name].tensor_type.name.lower(), t.name
            assert info.read_tensor(t.name).tobytes() == np.array(src[name].data).tobytes(), t.name
    deq = rewrite_gguf(models[fam]["gguf"][outtype], tmp_path / "deq.gguf", tensors=dequantized,
                       fields=no_vocab)
    ref_path = convert_gguf(deq, tmp_path / "deq.colibri", progress=False)
    ids = random_ids(info.metadata["model.vocab_size"], 30, seed=42)
    with _engine(path) as eng:
        got = eng.forward(ids)
    with _engine(ref_path) as eng:
        ref = eng.forward(ids)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=TOL * max(1.0, float(np.abs(ref).max())))


def _same_import(a: Path, b: Path) -> None:
    """Two .colibri files of the same weights: every tensor's bytes, the tokenizer and the
    metadata (less convert.source, which names the file read) equal."""
    ia, ib = fmt_reader.inspect(a, verify=True), fmt_reader.inspect(b, verify=True)
    assert [t.name for t in ia.tensors] == [t.name for t in ib.tensors]
    for t in ia.tensors:
        assert ia.read_tensor(t.name).tobytes() == ib.read_tensor(t.name).tobytes(), t.name
    assert section_bytes(ia, "tokenizer") == section_bytes(ib, "tokenizer")
    drop = ("convert.source",)
    assert {k: v for k, v in ia.metadata.items() if k not in drop} == \
        {k: v for k, v in ib.metadata.items() if k not in drop}


def test_split_gguf_imports_whole_from_any_shard(models, imported, tmp_path):
    """A split GGUF (convert_hf_to_gguf --split-max-tensors, the first shard metadata only):
    imported from its first shard or from its last, the file equals the one-file GGUF's."""
    shards = models["split"]
    n = len(shards)
    assert n >= 3 and shards[0].name == f"deepseek_v3-q8_0-00001-of-{n:05d}.gguf"
    first = gguf.GGUFReader(shards[0])
    assert len(first.tensors) == 0 and int(first.fields["split.count"].contents()) == n
    whole = imported("deepseek_v3", "q8_0")
    for i in (0, n - 1):
        out = tmp_path / f"from-{i}.colibri"
        assert convert_gguf(shards[i], out, progress=False) == str(out)
        _same_import(whole, out)
        src = fmt_reader.inspect(out).metadata["convert.source"]
        assert f"{shards[0].name} (1 of {n} shards)" in src, src


def test_cli_imports_a_folder_of_one_gguf(models, imported, tmp_path, capsys):
    """colibri-convert given a folder (a hub download of one quantization): the one split
    GGUF its shards make is imported; a folder of two models is refused, naming both."""
    from colibri_lab.conversion.cli import main as convert_main

    folder = tmp_path / "DeepSeek-V3-Q8_0"
    folder.mkdir()
    for s in models["split"]:
        (folder / s.name).symlink_to(s)
    out = tmp_path / "folder.colibri"
    assert convert_main(["--model_name_or_path", str(folder), "--output_path", str(out), "--quiet"]) == 0
    _same_import(imported("deepseek_v3", "q8_0"), out)
    (folder / "other.gguf").symlink_to(models["deepseek_v3"]["gguf"]["f32"])
    assert convert_main(["--model_name_or_path", str(folder), "--output_path", str(tmp_path / "x.colibri"),
                         "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "2 GGUF models" in err and "other.gguf" in err and "deepseek_v3-q8_0-*-of-" in err, err


def test_split_gguf_refusals(models, tmp_path):
    """A shard missing, shards renamed, and the shards of two files mixed: each refused by
    a ConversionError that names the file and what to do, with no output left behind."""
    shards = models["split"]
    n = len(shards)
    out = tmp_path / "out.colibri"

    def refused(path, *words):
        with pytest.raises(ConversionError) as e:
            convert_gguf(path, out, progress=False)
        for w in words:
            assert w in str(e.value), str(e.value)
        assert not out.exists() and not Path(str(out) + ".tmp").exists()

    gone = tmp_path / "gone"
    gone.mkdir()
    for s in shards[:-1]:
        (gone / s.name).symlink_to(s)
    refused(gone / shards[0].name, shards[-1].name, "same folder")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "deepseek.gguf").symlink_to(shards[1])
    refused(renamed / "deepseek.gguf", f"-00002-of-{n:05d}.gguf", "llama-gguf-split --merge")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for i, s in enumerate(shards):   # shard 2's place taken by shard 3's file
        (mixed / s.name).symlink_to(shards[2] if i == 1 else s)
    refused(mixed / shards[0].name, shards[1].name, "different files")


@pytest.mark.parametrize("both", [False, True])
def test_deepseek_legacy_kv_b_equals_split(models, imported, tmp_path, both):
    """Older llama.cpp GGUFs hold one attn_kv_b (key_length = qk head, value_length = v
    head, no *_mla keys), some converters wrote it beside the split attn_k_b / attn_v_b
    (both: with the *_mla keys): rewritten so from the split file, the import is the same
    model."""
    A = "deepseek2"
    src = models["deepseek_v3"]["gguf"]["f32"]
    r = gguf.GGUFReader(src)
    nh = int(r.fields[f"{A}.attention.head_count"].contents())
    dq = int(r.fields[f"{A}.attention.key_length_mla"].contents())
    dv = int(r.fields[f"{A}.attention.value_length_mla"].contents())
    kb = {}

    def merge(name, ttype, data):
        if name.endswith("attn_k_b.weight"):
            kb[name] = data
            return [(name, ttype, data)] if both else []
        if name.endswith("attn_v_b.weight"):
            k = kb.pop(name.replace("v_b", "k_b"))           # [nh, r, dn]
            kv = np.concatenate([np.swapaxes(k, 1, 2), data], axis=1)   # [nh, dn + dv, r]
            return [(name, ttype, data)] * both + [
                (name.replace("attn_v_b", "attn_kv_b"), ttype,
                 np.ascontiguousarray(kv.reshape(-1, kv.shape[-1])))]
        return [(name, ttype, data)]

    def keys(k, v):
        if both:
            return v
        if k.endswith(("key_length_mla", "value_length_mla")):
            return None
        return {f"{A}.attention.key_length": dq, f"{A}.attention.value_length": dv}.get(k, v)

    g = rewrite_gguf(src, tmp_path / "legacy.gguf", tensors=merge, fields=keys)
    names = {t.name for t in gguf.GGUFReader(g).tensors}
    assert "blk.0.attn_kv_b.weight" in names and ("blk.0.attn_k_b.weight" in names) == both and nh
    a = fmt_reader.inspect(convert_gguf(g, tmp_path / "legacy.colibri", progress=False))
    b = fmt_reader.inspect(imported("deepseek_v3", "f32"))
    assert [(t.name, t.dtype, t.shape, t.crc32) for t in a.tensors] == \
        [(t.name, t.dtype, t.shape, t.crc32) for t in b.tensors]
    assert a.family_options == b.family_options


def test_gptoss_mxfp4_experts(models, tmp_path):
    """gpt-oss experts as MXFP4 (gguf.quants = ggml's quantize_row_mxfp4_ref): the bytes are
    copied, and the engine's logits are those of the dequantized values."""
    from helpers import random_ids

    MX, F32 = gguf.GGMLQuantizationType.MXFP4, gguf.GGMLQuantizationType.F32
    blocks = {}

    def mx(name, ttype, data):
        if name.endswith("_exps.weight"):
            blocks[name] = gguf.quants.quantize(data, MX)
            return [(name, MX, blocks[name])]
        return [(name, ttype, data)]

    def mx_values(name, ttype, data):
        (n, t, d), = mx(name, ttype, data)
        if t == MX:
            return [(n, F32, np.ascontiguousarray(gguf.quants.dequantize(d, MX), dtype=np.float32))]
        return [(n, t, d)]

    src = models["gpt_oss"]["gguf"]["f32"]
    out = convert_gguf(rewrite_gguf(src, tmp_path / "mx.gguf", tensors=mx, fields=no_vocab),
                       tmp_path / "mx.colibri", progress=False)
    ref = convert_gguf(rewrite_gguf(src, tmp_path / "mxv.gguf", tensors=mx_values,
                                    fields=no_vocab), tmp_path / "mxv.colibri", progress=False)
    info = fmt_reader.inspect(out, verify=True)
    for w in ("gate", "up", "down"):
        t = f"blk.1.ffn_{w}_exps"
        assert info.tensor(t).dtype == "mxfp4"
        assert info.read_tensor(t).tobytes() == blocks[t + ".weight"].tobytes()
    ids = random_ids(info.metadata["model.vocab_size"], 30, seed=43)
    with _engine(out) as eng:
        got = eng.forward(ids)
    with _engine(ref) as eng:
        want = eng.forward(ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * max(1.0, float(np.abs(want).max())))


# --------------------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("fam", ["deepseek_v3", "deepseek_v2", "gpt_oss"])
def test_tokenizer_pre_tokenizers(models, imported, fam):
    """tokenizer.ggml.pre `deepseek-v3` / `deepseek-llm` / `gpt-4o`: the section rebuilt from the GGUF is the
    Hugging Face converter's byte for byte, and encodes as `tokenizers` does (code, CJK,
    digits, emoji, whitespace runs, special tokens)."""
    got = fmt_reader.inspect(imported(fam, "f32"))
    hf = fmt_reader.inspect(models[fam]["hf"])
    assert section_bytes(got, "tokenizer") == section_bytes(hf, "tokenizer")
    _native_or_fail()
    from colibri_lab.runtime.engine import Tokenizer

    ref = models[fam]["tok"]
    with Tokenizer.from_section_bytes(section_bytes(got, "tokenizer")) as tk:
        for text in TEXTS + MORE_TEXTS + _corpus()[:2]:
            assert tk.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False).ids


# --------------------------------------------------------------------------- refusals

def test_unsupported_pre_tokenizer_is_refused_by_name(models, tmp_path, capsys):
    from colibri_lab.conversion.cli import main

    g = rewrite_gguf(models["deepseek_v2"]["gguf"]["f32"], tmp_path / "coder.gguf",
                     fields=lambda k, v: "deepseek-coder" if k == "tokenizer.ggml.pre" else v)
    with pytest.raises(ConversionError, match=r"tokenizer\.ggml\.pre = 'deepseek-coder' \(DeepSeek"):
        convert_gguf(g, tmp_path / "x.colibri", progress=False)
    assert main(["--model_name_or_path", str(g), "--output_path", str(tmp_path / "y.colibri"),
                 "--quiet"]) == 1
    assert "deepseek-coder" in capsys.readouterr().err
    assert not (tmp_path / "y.colibri").exists()
    info = fmt_reader.inspect(convert_gguf(g, tmp_path / "z.colibri", progress=False,
                                           tokenizer="none"))
    assert info.metadata["tokenizer.type"] == "none"


@pytest.mark.parametrize("pre", ["default", None])
def test_default_pre_tokenizer(models, tmp_path, pre):
    """tokenizer.ggml.pre "default", or no such key (a GGUF older than it): llama.cpp's
    fallback pre-tokenizer, four splits in sequence (pattern 9); the ids those of
    `tokenizers` with that sequence over the same vocabulary and merges. A missing key warns,
    as llama.cpp does."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    from colibri_lab.conversion.bpe import LLAMA_DEFAULT_SPLITS

    g = rewrite_gguf(models["deepseek_v2"]["gguf"]["f32"], tmp_path / "old.gguf",
                     fields=lambda k, v: pre if k == "tokenizer.ggml.pre" else v)
    out = tmp_path / "old.colibri"
    if pre is None:
        with pytest.warns(RuntimeWarning, match="names no pre-tokenizer.*'default'"):
            convert_gguf(g, out, progress=False)
    else:
        convert_gguf(g, out, progress=False)
    info = fmt_reader.inspect(out)
    assert info.metadata["tokenizer.pattern"] == "llama_default"
    hf = Tokenizer.from_file(str(models["deepseek_v2"]["folder"] / "tokenizer.json"))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in LLAMA_DEFAULT_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    ct = colibri_lab.Tokenizer.from_section_bytes(section_bytes(info, "tokenizer"))
    for text in TEXTS + MORE_TEXTS + ["x=12345678; (1,234.56)", "a+b<=c>d^e~f|g $$100 ¿¡…"]:
        assert ct.encode(text.encode("utf-8"), add_bos=False) == \
            hf.encode(text, add_special_tokens=False).ids, text


def test_softmax_router_with_choice_bias_is_refused(models, tmp_path):
    """deepseek2 without expert_gating_func routes with a softmax (llama.cpp's default); a
    choice bias (exp_probs_b) with it is refused, not dropped."""
    g = rewrite_gguf(models["deepseek_v3"]["gguf"]["f32"], tmp_path / "nogate.gguf",
                     fields=lambda k, v: None if k == "deepseek2.expert_gating_func" else
                     no_vocab(k, v))
    with pytest.raises(ConversionError, match="softmax router with a choice bias"):
        convert_gguf(g, tmp_path / "x.colibri", progress=False)


# --------------------------------------------------------------------------- llama.cpp itself

@pytest.mark.parametrize("fam", ["deepseek_v3", "gpt_oss"])
def test_greedy_text_equals_llama_cpp(models, imported, fam):
    """llama.cpp's llama-completion on the f32 GGUF and the engine on its import generate
    the same greedy bytes (DeepSeek-V3: MLA, q LoRA, groups, exp_probs_b, YaRN; gpt-oss:
    sinks, sliding layers, biases, clamped SwiGLU, YaRN; both tokenizers). Compared as
    bytes: random weights produce bytes that are not UTF-8. Needs llama.cpp's
    llama-completion (the benchmarks build it); skipped without it (test_gguf_import's
    llama_completion runs it until a run's output is whole). Not DeepSeek-V2: llama.cpp refuses a `deepseek2`
    file without q LoRA unless it has one of its "lite" layer counts."""
    from colibri_lab.conversion.bpe import bytes_to_unicode
    from colibri_lab.conversion.gguf import gguf_end_ids
    from test_gguf_import import _llama_program, llama_completion

    exe = _llama_program(models["src"], "llama-completion")
    prompt = "def forward(self, x):"
    out = llama_completion(exe, models[fam]["gguf"]["f32"], prompt, 12)
    ban = {i: -1e9 for i in gguf_end_ids(str(models[fam]["gguf"]["f32"]))}   # as --ignore-eos
    with _engine(imported(fam, "f32")) as eng:
        ids = [t.id for t in eng.generate(prompt, max_new_tokens=12, stop_at_eos=False, logit_bias=ban)]
    inv = {v: k for k, v in bytes_to_unicode().items()}
    tok = models[fam]["tok"]
    got = b"".join(bytes(inv[c] for c in tok.id_to_token(i)) for i in ids)
    assert len(ids) == 12
    assert out.rstrip(b"\n") == prompt.encode() + got


def test_gptoss_hub_mxfp4_gguf(models, tmp_path):
    """llama.cpp's converter on a hub-style MXFP4 gpt-oss writes its experts as ggml MXFP4
    (its nibble repack, gate/up de-interleaved): the import keeps those bytes, which are
    the checkpoint's blocks, and runs as the Hugging Face converter's f32 file of the same
    checkpoint."""
    from helpers import random_ids

    m = models["gpt_oss_mxfp4"]
    r = gguf.GGUFReader(m["gguf"])
    assert {t.tensor_type.name for t in r.tensors if "_exps.weight" in t.name} == {"MXFP4"}
    out = convert_gguf(m["gguf"], tmp_path / "mx.colibri", progress=False, tokenizer="none")
    info = fmt_reader.inspect(out, verify=True)
    for n in range(SHAPES["gpt_oss"].layers):
        gu, dn = m["blocks"][n, "gate_up_proj"], m["blocks"][n, "down_proj"]
        for name, want in (("gate", gu[:, 0::2]), ("up", gu[:, 1::2]), ("down", dn)):
            t = f"blk.{n}.ffn_{name}_exps"
            assert info.tensor(t).dtype == "mxfp4"
            assert info.read_tensor(t).tobytes() == np.ascontiguousarray(want).tobytes(), t
    ids = random_ids(info.metadata["model.vocab_size"], 30, seed=44)
    with _engine(out) as eng:
        got = eng.forward(ids)
    with _engine(m["hf"]) as eng:
        want = eng.forward(ids)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * max(1.0, float(np.abs(want).max())))


def test_gptoss_sliding_pattern_keys(models, tmp_path):
    """attention.sliding_window_pattern decides the sliding layers when present (a per-layer
    array, or a period n: layer i slides iff i % n < n - 1), as llama.cpp's loader; without
    it every other layer from layer 0 slides. A separate RoPE base for sliding layers is
    refused."""
    GT = gguf.GGUFValueType
    src = models["gpt_oss"]["gguf"]["f32"]
    base = fmt_reader.inspect(convert_gguf(src, tmp_path / "d.colibri", progress=False,
                                           tokenizer="none"))
    assert base.metadata["model.layer_sliding_window"] == [6, 0, 6]
    for value, vtype, want in (([False, True, True], GT.ARRAY, [0, 6, 6]),
                               (3, GT.UINT32, [6, 6, 0])):
        if vtype == GT.ARRAY:   # an array key: written with GGUFWriter.add_array
            r = gguf.GGUFReader(src)
            g = tmp_path / "arr.gguf"
            w = gguf.GGUFWriter(g, "gpt-oss")
            for key, f in r.fields.items():
                if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture":
                    continue
                w.add_key_value(key, f.contents(), f.types[0],
                                sub_type=f.types[-1] if f.types[0] == GT.ARRAY else None)
            w.add_array("gpt-oss.attention.sliding_window_pattern", value)
            for t in r.tensors:
                w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
        else:
            g = rewrite_gguf(src, tmp_path / "per.gguf", fields=no_vocab,
                             add_fields={"gpt-oss.attention.sliding_window_pattern": (value, vtype)})
        info = fmt_reader.inspect(convert_gguf(g, tmp_path / "p.colibri", progress=False))
        assert info.metadata["model.layer_sliding_window"] == want, value
    g = rewrite_gguf(src, tmp_path / "swa.gguf", fields=no_vocab,
                     add_fields={"gpt-oss.rope.freq_base_swa": (5000.0, GT.FLOAT32)})
    with pytest.raises(ConversionError, match="separate RoPE base for sliding layers"):
        convert_gguf(g, tmp_path / "x.colibri", progress=False)
