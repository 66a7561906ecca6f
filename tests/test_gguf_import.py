"""GGUF import (colibri_lab.conversion.gguf): real GGUFs made by llama.cpp's own
convert_hf_to_gguf.py from tiny Hugging Face checkpoints of each family, imported and
compared with the checkpoint itself and with the Hugging Face converter's file.

The llama.cpp source comes from the llama-cpp-python sdist (pip download, cached under
$COLIBRI_LAB_CACHE/llama.cpp, default ~/.cache/colibri-lab/llama.cpp, as the benchmarks
use it); a failed download skips these tests, and the tests that run llama.cpp's own
programs (llama-quantize, llama-completion) skip, naming the missing program, where that
tree has no build. The GGUFs of this file and of tests/test_gguf_families.py are made by one
converter process per pytest session (conftest's gguf_models, tests/gguf_shared.py: the
imports of torch and transformers dominate a conversion's time).

Checked per family (Mixtral = GGUF `llama` with experts, Qwen2-MoE with a dense layer and a
shared expert, Qwen3-MoE with q/k head norms, OLMoE with full q/k norms and clip_qkv):

* f32 GGUF: every stored value equals the checkpoint's (q/k rows un-permuted for llama);
* bf16 / q8_0 GGUF: every tensor's bytes equal the GGUF's (no requantization), the split
  FFN dtypes are the GGUF's, L2 norms are those of the dequantized values;
* metadata and family options equal the Hugging Face converter's for the same checkpoint;
* the tokenizer section equals the Hugging Face converter's byte for byte, and its token
  ids equal Hugging Face `tokenizers` / `sentencepiece`;
* the engine runs every import (a refusal fails the test): logits equal transformers' and
  the Hugging Face converter's file's (f32), and those of the dequantized values (bf16,
  q8_0, MXFP4, K-quants);
* refusals: an unsupported tensor type (Q8_1), gate/up of different dtypes, a truncated
  file, a non-GGUF file, an unsupported architecture.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

import colibri_lab  # noqa: E402
from colibri_lab.format import reader as fmt_reader, spec as fmt  # noqa: E402
from colibri_lab.conversion.spec import ConversionError  # noqa: E402
from colibri_lab.conversion.gguf import convert_gguf, gguf_end_ids  # noqa: E402
from colibri_lab.bench.llama_cpp import _find_llama_src  # noqa: E402

from colibri_lab.bench.models import FamilyShape, MixtralShape, build_model, byte_level_bpe, save_checkpoint  # noqa: E402

SPECIALS = {"qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            "olmo": ["<|endoftext|>", "<|padding|>"]}
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MIXTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}"
                    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
TEXTS = [
    "def forward(self, x):\n    return self.w2(F.silu(self.w1(x)) * self.w3(x))\n",
    "The router sends each token to 2 of 6 experts — DON'T expect uniform load!",
    "<|im_start|>user\n你好, мир 🙂 123456<|im_end|>  trailing   spaces  ",
    "<think>a<|fim_pad|>b</think> <think>\u0338 <|endoftext|><|padding|>",
    "Ça va? naïve café ﬁ Å (A + ring) \u00c5 \u212b",
]


# --------------------------------------------------------------------------- llama.cpp

def _llama_root() -> Path:
    from colibri_lab.bench.common import default_cache_dir

    return default_cache_dir() / "llama.cpp"


def llama_cpp_source(root: Path) -> Path:
    """The llama.cpp source tree (convert_hf_to_gguf.py, gguf-py) under `root`: an unpacked
    llama-cpp-python sdist, downloaded with pip and unpacked when missing. Nothing is built.
    Skips the calling test only when the download itself fails."""
    import importlib.util

    root.mkdir(parents=True, exist_ok=True)
    src = _find_llama_src(root)
    if src is not None:
        return src
    sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        # pip prepares the sdist's metadata with its build backend: the installed
        # scikit-build-core when there is one, else an isolated build environment
        isolation = [] if importlib.util.find_spec("scikit_build_core") is None else \
            ["--no-build-isolation"]
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                            ":all:", *isolation, "llama-cpp-python", "-d", str(root)],
                           capture_output=True, text=True)
        sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
        if r.returncode != 0 or not sdists:
            tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
            pytest.skip(f"could not download the llama-cpp-python sdist (for llama.cpp's "
                        f"convert_hf_to_gguf.py) into {root}: {tail}")
    with tarfile.open(sdists[-1]) as tf:
        if sys.version_info >= (3, 12):
            tf.extractall(root, filter="data")
        else:
            tf.extractall(root)
    src = _find_llama_src(root)
    assert src is not None, f"{sdists[-1]} holds no vendor/llama.cpp"
    return src


# One process converts every checkpoint: convert_hf_to_gguf's main() once per job. For a
# byte-level BPE vocabulary the converter names the pre-tokenizer by hashing the token ids of
# a probe text, a table of real checkpoints' tokenizers that a tokenizer trained here is not
# in: the job gives the name instead (the one thing replaced; the vocabulary, merges, token
# types and special ids are the converter's own).
DRIVER = r"""
import json, sys
src, jobs = sys.argv[1], json.load(open(sys.argv[2]))
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
import convert_hf_to_gguf as c
import conversion.base as base
orig = base.TextModel.get_vocab_base_pre
for job in jobs:
    pre = job.get("pre")
    base.TextModel.get_vocab_base_pre = (lambda self, tok, p=pre: p) if pre else orig
    sys.argv = ["convert_hf_to_gguf.py", job["model"], "--outtype", job["outtype"],
                "--outfile", job["outfile"], *job.get("args", [])]
    c.main()
"""


def make_ggufs(src: Path, jobs: list[dict], work: Path) -> None:
    driver = work / "gguf_driver.py"
    driver.write_text(DRIVER)
    (work / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, str(driver), str(src), str(work / "jobs.json")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError("convert_hf_to_gguf.py failed:\n" + (r.stderr or r.stdout)[-4000:])
    for j in jobs:   # a file, or the shards of a split one (--split-max-*: NAME-00001-of-N.gguf ...)
        out = Path(j["outfile"])
        assert out.is_file() or any(out.parent.glob(f"{out.stem}-00001-of-*.gguf")), j


# --------------------------------------------------------------------------- checkpoints

def _corpus() -> list[str]:
    from test_family_tokenizer import _corpus as stdlib_corpus

    return stdlib_corpus(150_000) + TEXTS


def _bpe_tokenizer(kind: str, vocab_size: int):
    """A byte-level BPE tokenizer like Qwen's (NFC, the Qwen2 split pattern) or OLMoE's
    (GPT-NeoX: ByteLevel with the GPT-2 regex, no normalizer), trained on Python's stdlib."""
    return byte_level_bpe(_corpus(), vocab_size, SPECIALS[kind], style="qwen2" if kind == "qwen" else "gpt2")


FAMILY_SHAPES = {
    # q8_0 needs rows of whole 32-value blocks: hidden, expert and dense widths are multiples
    "qwen2_moe": dict(family="qwen2_moe", hidden=64, inter=32, dense_inter=96, shared_inter=64,
                      layers=2, heads=4, kv_heads=2, experts=4, top_k=2,
                      seed=3),
    "qwen3_moe": dict(family="qwen3_moe", hidden=64, inter=64, layers=2, heads=4, kv_heads=2,
                      head_dim=32, experts=4, top_k=2, norm_topk=True, seed=4),
    # no clip_qkv: llama.cpp's OlmoeModel does not write it (nor does its OLMoE graph clamp);
    # the importer reads {arch}.attention.clamp_kqv when a GGUF has it (tested below)
    "olmoe": dict(family="olmoe", hidden=64, inter=32, layers=2, heads=4, kv_heads=4,
                  experts=4, top_k=2, seed=5),
}
# 256-wide (whole Q4_K/Q5_K/Q6_K blocks per row) for llama-quantize's K-quant mixes
KQUANT_SHAPE = dict(family="qwen3_moe", hidden=256, inter=256, layers=2, heads=4, kv_heads=2,
                    head_dim=64, experts=4, top_k=2, norm_topk=True, seed=8)
KQUANT_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")
MIXTRAL_SHAPE = dict(vocab=32000, hidden=64, inter=64, layers=2, heads=4, kv_heads=2, experts=4,
                     top_k=2, max_pos=512, seed=6)
OUTTYPES = {"mixtral": ("f32", "f16", "q8_0"), "qwen2_moe": ("f32", "bf16", "q8_0"),
            "qwen3_moe": ("f32", "q8_0"), "olmoe": ("f32", "bf16")}
# convert_hf_to_gguf --fuse-qkv: one attn_qkv tensor (llama: of the permuted q/k rows)
FUSED = {"mixtral": "q8_0", "qwen2_moe": "f32"}
PRE = {"mixtral": None, "qwen2_moe": "qwen2", "qwen3_moe": "qwen2", "olmoe": "olmo"}


def _make_checkpoint(family: str, folder: Path):
    """(folder, reference tokenizer) of a tiny random checkpoint with its tokenizer."""
    if family == "mixtral":
        model = build_model(MixtralShape(**MIXTRAL_SHAPE))
        save_checkpoint(model, folder, tokenizer="spm")
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
             "chat_template": MIXTRAL_TEMPLATE,
             # as Mixtral's: llama.cpp's converter then types these CONTROL with score -1000
             "added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False,
                                               "rstrip": False, "single_word": False,
                                               "special": True}
                                      for i, c in enumerate(["<unk>", "<s>", "</s>"])}}))
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    kind = "olmo" if family == "olmoe" else "qwen"
    tok = _bpe_tokenizer(kind, 700)
    if family == "qwen3_moe":
        # added after the vocabulary, as Qwen3's own (<think> is not special there)
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                        AddedToken("</think>", special=False, normalized=False)])
        tok.add_special_tokens([AddedToken("<|fim_pad|>", special=True, normalized=False)])
    # the embedding is padded past the tokenizer (as real checkpoints): llama.cpp's
    # converter fills the GGUF vocabulary up with [PAD{i}] tokens, which the importer drops
    shape = FamilyShape(vocab=tok.get_vocab_size() + 9, **FAMILY_SHAPES[family])
    model = build_model(shape)
    save_checkpoint(model, folder, tokenizer="none")
    tok.save(str(folder / "tokenizer.json"))
    cfg = ({"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "chat_template": CHATML} if kind == "qwen" else
           {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|padding|>"})
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok


def model_jobs(work: Path) -> tuple[list[dict], dict]:
    """The checkpoints of this file under `work` and the converter jobs that make their
    GGUFs: (jobs, state), state JSON-able for load_models. Every family's checkpoint, its
    tokenizer and the Hugging Face converter's f32 file; "kquant": the 256-wide checkpoint."""
    state, jobs = {}, []
    for fam in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        folder = work / fam
        _make_checkpoint(fam, folder)
        hf = work / f"{fam}-hf-f32.colibri"
        colibri_lab.convert(folder, hf, dtype="f32", progress=False)
        files = {}
        for t in OUTTYPES[fam]:
            files[t] = work / f"{fam}-{t}.gguf"
            jobs.append({"model": str(folder), "outtype": t, "outfile": str(files[t]),
                         "pre": PRE[fam]})
        if fam in FUSED:
            files["fused"] = work / f"{fam}-{FUSED[fam]}-fused.gguf"
            jobs.append({"model": str(folder), "outtype": FUSED[fam], "outfile": str(files["fused"]),
                         "pre": PRE[fam], "args": ["--fuse-qkv"]})
        state[fam] = {"folder": str(folder), "hf": str(hf), "gguf": {k: str(v) for k, v in files.items()}}
    folder = work / "kquant"
    tok = _bpe_tokenizer("qwen", 400)
    save_checkpoint(build_model(FamilyShape(vocab=tok.get_vocab_size(), **KQUANT_SHAPE)),
                    folder, tokenizer="none")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    state["kquant"] = {"folder": str(folder), "gguf": {"f32": str(work / "kquant-f32.gguf")}}
    jobs.append({"model": str(folder), "outtype": "f32", "outfile": str(work / "kquant-f32.gguf"),
                 "pre": "qwen2"})
    return jobs, state


def load_models(state: dict, src: Path) -> dict:
    """family -> dict(folder, tok (the reference tokenizer), hf (the HF converter's f32 file),
    gguf {outtype: path}); "kquant" -> dict(folder, gguf {"f32": path}); "src" -> the
    llama.cpp source tree."""
    import sentencepiece as spm
    from tokenizers import Tokenizer

    out = {"src": src}
    for fam, st in state.items():
        folder = Path(st["folder"])
        m = {"folder": folder, "gguf": {k: Path(v) for k, v in st["gguf"].items()}}
        if "hf" in st:
            m["hf"] = Path(st["hf"])
            m["tok"] = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")) \
                if fam == "mixtral" else Tokenizer.from_file(str(folder / "tokenizer.json"))
        out[fam] = m
    return out


@pytest.fixture(scope="module")
def models(gguf_models):
    """The GGUFs of this file, made by the session's one converter process (conftest's
    gguf_models, shared with test_gguf_families.py)."""
    return load_models(gguf_models["import"], gguf_models["src"])


FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
QUANTIZED = [(f, t) for f in FAMILIES for t in OUTTYPES[f] if t != "f32"]


@pytest.fixture(scope="module")
def imported(models, tmp_path_factory):
    """(family, outtype) -> the .colibri file imported from that GGUF (made once)."""
    work = tmp_path_factory.mktemp("imported")
    cache = {}

    def get(fam: str, outtype: str) -> Path:
        if (fam, outtype) not in cache:
            out = work / f"{fam}-{outtype}.colibri"
            assert convert_gguf(models[fam]["gguf"][outtype], out, progress=False) == str(out)
            cache[fam, outtype] = out
        return cache[fam, outtype]
    return get


# --------------------------------------------------------------------------- helpers

def rewrite_gguf(src: Path, dst: Path, *, arch: str | None = None, tensors=None, fields=None,
                 add_fields: dict | None = None) -> Path:
    """Copy a GGUF with gguf.GGUFWriter. tensors(name, type, data) -> a list of (name, type,
    data) to write instead (data: numpy, bytes-shaped uint8 for block types); fields(key,
    value) -> the value to write, or None to drop the key; add_fields: {key: (value, type)}."""
    GT = gguf.GGUFValueType
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, arch or r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        val = f.contents()
        if fields is not None:
            val = fields(key, val)
            if val is None:
                continue
        w.add_key_value(key, val, f.types[0], sub_type=f.types[-1] if f.types[0] == GT.ARRAY else None)
    for key, (val, vtype) in (add_fields or {}).items():
        w.add_key_value(key, val, vtype)
    for t in r.tensors:
        data = np.array(t.data)
        outs = tensors(t.name, t.tensor_type, data) if tensors else [(t.name, t.tensor_type, data)]
        for name, ttype, d in outs:
            w.add_tensor(name, d, raw_dtype=ttype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def no_vocab(key, value):
    """A rewrite_gguf fields filter: no tokenizer (faster to read; the weights are the point)."""
    return None if key.startswith("tokenizer.") else value


def llama_completion(exe: Path, gguf_path: Path, prompt: str, n_new: int, f32_attention: bool = False) -> bytes:
    """llama-completion's greedy continuation of `prompt` (its stdout: the prompt, then `n_new`
    tokens, --ignore-eos), with f32_attention its KV cache in f32 and its flash attention off
    (by default: an f16 cache, flash attention on the CPU). Its output (stdout too) is written
    by a log thread that main() does not wait for (its logger is leaked at exit by design), so
    a run can lose its tail (status 0, no closing performance summary): on a tiny model, whose
    run takes milliseconds, most runs do. It is run again, up to 200 times (each of those runs
    is as short), until one prints its summary."""
    kv = ["-ctk", "f32", "-ctv", "f32", "-fa", "off"] if f32_attention else []
    for _ in range(200):
        r = subprocess.run([str(exe), "-m", str(gguf_path), "-p", prompt, "-n", str(n_new), "--temp", "0",
                            "--ignore-eos", "-no-cnv", "-t", "2", "--no-warmup", "-c", "256", *kv],
                           capture_output=True, timeout=300, stdin=subprocess.DEVNULL, check=False)
        assert r.returncode == 0, r.stderr[-2000:].decode("utf-8", "replace")
        if b"common_perf_print" in r.stderr:
            return r.stdout
    raise AssertionError("llama-completion never finished a run")


def dequantized(name, ttype, data):
    """A rewrite_gguf transform: every tensor as F32 values (gguf.quants.dequantize)."""
    if ttype == gguf.GGMLQuantizationType.F32:
        return [(name, ttype, data)]
    return [(name, gguf.GGMLQuantizationType.F32,
             np.ascontiguousarray(gguf.quants.dequantize(data, ttype), dtype=np.float32))]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf), on rows of any kind."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str) -> str:
    """The GGUF tensor a colibri tensor of the import comes from."""
    if name.endswith(".ffn_shared_gate.weight"):
        return name.replace(".ffn_shared_gate.weight", ".ffn_gate_inp_shexp.weight")
    return name if name.endswith((".weight", ".bias")) else name + ".weight"


_HF_CACHE: dict = {}


def hf_weights(folder: Path) -> dict:
    if folder not in _HF_CACHE:
        from safetensors.numpy import load_file

        _HF_CACHE[folder] = load_file(str(folder / "model.safetensors"))
    return _HF_CACHE[folder]


def hf_tensor(folder: Path, fam: str, name: str, E: int) -> np.ndarray:
    """The checkpoint's value of a colibri tensor (float32, the import's shape)."""
    w = hf_weights(folder)
    top = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
           "output_norm.weight": "model.norm.weight"}
    if name in top:
        return w[top[name]]
    _, n, rest = name.split(".", 2)
    p = f"model.layers.{n}"
    moe = f"{p}.block_sparse_moe" if fam == "mixtral" else f"{p}.mlp"
    simple = {"attn_norm.weight": f"{p}.input_layernorm.weight",
              "ffn_norm.weight": f"{p}.post_attention_layernorm.weight",
              "ffn_gate_inp.weight": f"{moe}.gate.weight",
              "ffn_shared_gate.weight": f"{p}.mlp.shared_expert_gate.weight",
              "attn_q_norm.weight": f"{p}.self_attn.q_norm.weight",
              "attn_k_norm.weight": f"{p}.self_attn.k_norm.weight"}
    for short, proj in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
        for kind in ("weight", "bias"):
            simple[f"attn_{short}.{kind}"] = f"{p}.self_attn.{proj}_proj.{kind}"
    for x, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        simple[f"ffn_{x}_shexp"] = f"{p}.mlp.shared_expert.{proj}.weight"
        simple[f"ffn_{x}"] = f"{p}.mlp.{proj}.weight"
    if rest in simple:
        return w[simple[rest]]
    x = rest[len("ffn_"):-len("_exps")]
    proj = ({"gate": "w1", "up": "w3", "down": "w2"} if fam == "mixtral" else
            {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})[x]
    return np.stack([w[f"{moe}.experts.{e}.{proj}.weight"] for e in range(E)])


def section_bytes(info, name: str) -> bytes:
    s = info.section(name)
    with open(info.path, "rb") as f:
        f.seek(s.offset)
        return f.read(s.size)


def _native_or_fail():
    """The engine's library; an error (not a skip) when it cannot be loaded."""
    from colibri_lab.runtime import _native  # noqa: F401  (raises ImportError with its reason)

    return _native


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"gguf {version('gguf')}"
    except PackageNotFoundError:
        return f"gguf from {gguf.__file__}"


# --------------------------------------------------------------------------- f32: values

@pytest.mark.parametrize("fam", FAMILIES)
def test_f32_values_equal_the_checkpoint(models, imported, fam):
    """Every tensor of an f32 GGUF's import holds the checkpoint's values, in the
    checkpoint's row order (llama: q/k un-permuted), with the split FFN."""
    info = fmt_reader.inspect(imported(fam, "f32"), verify=True)
    assert info.version == 2
    E = info.metadata["model.n_experts"]
    names = {t.name for t in info.tensors}
    assert "blk.0.ffn_gate_exps" in names and "blk.0.ffn_experts" not in names
    for t in info.tensors:
        assert t.dtype == "f32" and t.layout == "row_major", t
        got = info.read_tensor(t.name)
        ref = hf_tensor(models[fam]["folder"], fam, t.name, E)
        if t.name.endswith("ffn_shared_gate.weight"):
            ref = ref.reshape(1, -1)
        assert got.shape == ref.shape, t.name
        np.testing.assert_array_equal(got, ref, err_msg=t.name)
        assert t.l2norm == pytest.approx(float(np.sqrt(np.sum(ref.astype(np.float64) ** 2))),
                                         rel=1e-12)


@pytest.mark.parametrize("fam", FAMILIES)
def test_metadata_equals_the_hf_converter(models, imported, fam):
    """Header, hyper-parameters, family options and tokenizer keys equal the Hugging Face
    converter's for the same checkpoint; only provenance, the dtype names and the end tokens
    differ (the GGUF's are llama.cpp's end-of-generation set; the checkpoint's, those of its
    generation_config.json)."""
    hf = fmt_reader.inspect(models[fam]["hf"])
    got = fmt_reader.inspect(imported(fam, "f32"))
    assert {k: got.header[k] for k in fmt.HEADER_FIELDS} == \
        {k: hf.header[k] for k in fmt.HEADER_FIELDS}
    assert got.family_options == hf.family_options
    eos = got.metadata["tokenizer.eos_id"]
    assert got.metadata.get("tokenizer.end_ids", []) == \
        [i for i in gguf_end_ids(str(models[fam]["gguf"]["f32"])) if i != eos]
    own = {"general.name", "convert.source", "model.weight_dtype", "tokenizer.special_source", "tokenizer.end_ids"}
    a = {k: v for k, v in hf.metadata.items() if k not in own}
    b = {k: v for k, v in got.metadata.items() if k not in own}
    assert b == a
    assert got.metadata_types == {k: t for k, t in hf.metadata_types.items() if k not in own} | \
        {k: got.metadata_types[k] for k in own & set(got.metadata)}
    assert got.metadata["model.weight_dtype"] == "gguf_f32"
    assert got.metadata["convert.source"].startswith("colibri_lab.conversion.gguf ")
    assert "from GGUF" in got.metadata["convert.source"]
    template = {"mixtral": MIXTRAL_TEMPLATE, "olmoe": None}.get(fam, CHATML)
    assert got.metadata.get("tokenizer.chat_template") == template


@pytest.mark.parametrize("fam", FAMILIES)
def test_tokenizer_equals_the_hf_converter_and_the_reference(models, imported, fam):
    """The tokenizer section rebuilt from the GGUF's vocabulary is the Hugging Face
    converter's byte for byte, and tokenizes as sentencepiece / tokenizers do."""
    hf = fmt_reader.inspect(models[fam]["hf"])
    got = fmt_reader.inspect(imported(fam, "f32"))
    assert section_bytes(got, "tokenizer") == section_bytes(hf, "tokenizer")
    _native_or_fail()
    from colibri_lab.runtime.engine import Tokenizer

    ref = models[fam]["tok"]
    with Tokenizer.from_section_bytes(section_bytes(got, "tokenizer")) as tk:
        for text in TEXTS + _corpus()[:2]:
            if fam == "mixtral":
                want = ref.encode(text)
                assert tk.encode(text, add_bos=True) == [ref.bos_id()] + want
            else:
                want = ref.encode(text, add_special_tokens=False).ids
                assert tk.encode(text, add_bos=True) == want   # no BOS (bos_token null)
            assert tk.encode(text, add_bos=False) == want


# --------------------------------------------------------------------------- bytes as stored

def _check_bytes_as_stored(info, gguf_path: Path, permuted: bool) -> None:
    r = gguf.GGUFReader(gguf_path)
    src = {t.name: t for t in r.tensors}
    nh, nkv = info.metadata["model.n_heads"], info.metadata["model.n_kv_heads"]
    for t in info.tensors:
        s = src[gguf_name(t.name)]
        got = info.read_tensor(t.name)
        want = np.array(s.data)
        if len(t.shape) == 1 or t.name.endswith("ffn_gate_inp.weight"):
            assert s.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        else:
            assert t.dtype == s.tensor_type.name.lower(), t.name   # the GGUF's dtype
        if permuted and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            got = permute(got, nh if ".attn_q." in t.name else nkv)
        assert got.tobytes() == want.tobytes(), f"{t.name}: bytes differ from the GGUF's"
        vals = want if s.tensor_type == gguf.GGMLQuantizationType.F32 else \
            gguf.quants.dequantize(want, s.tensor_type)
        assert t.l2norm == pytest.approx(float(np.sqrt(np.sum(vals.astype(np.float64) ** 2))),
                                         rel=1e-12), t.name


@pytest.mark.parametrize("fam,outtype", QUANTIZED)
def test_quantized_bytes_equal_the_gguf(models, imported, fam, outtype):
    """bf16 / q8_0: each tensor's bytes are the GGUF's (whole rows moved, nothing
    requantized), in the GGUF's dtype; L2 norms are those of the dequantized values."""
    path = imported(fam, outtype)
    info = fmt_reader.inspect(path, verify=True)
    assert info.metadata["model.weight_dtype"] == f"gguf_{outtype}"
    assert info.metadata["model.router_dtype"] == "f32"
    routers = ("ffn_gate_inp.weight", "ffn_shared_gate.weight")   # f32 in llama.cpp's GGUFs
    assert {t.dtype for t in info.tensors if len(t.shape) >= 2 and not t.name.endswith(routers)} \
        == {outtype}
    _check_bytes_as_stored(info, models[fam]["gguf"][outtype], fam == "mixtral")


@pytest.mark.parametrize("fam", sorted(FUSED))
def test_fused_qkv_imports_as_separate(models, imported, fam, tmp_path):
    """--fuse-qkv (one attn_qkv tensor and bias) imports to the same tensors, byte for
    byte, as the separate q/k/v of the same checkpoint."""
    r = gguf.GGUFReader(models[fam]["gguf"]["fused"])
    assert any(t.name == "blk.0.attn_qkv.weight" for t in r.tensors)
    out = convert_gguf(models[fam]["gguf"]["fused"], tmp_path / "fused.colibri", progress=False)
    a = fmt_reader.inspect(out, verify=True)
    b = fmt_reader.inspect(imported(fam, FUSED[fam]), verify=True)
    assert [(t.name, t.dtype, t.shape, t.crc32) for t in a.tensors] == \
        [(t.name, t.dtype, t.shape, t.crc32) for t in b.tensors]


# --------------------------------------------------------------------------- the engine

def _hf_model(fam: str, folder: Path):
    if fam == "mixtral":
        from transformers import MixtralForCausalLM

        m = MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        m.set_experts_implementation("eager")
        return m
    from colibri_lab.bench.models import load_model

    return load_model(fam, folder)


def _engine(path: Path):
    """An Engine on `path`: the engine runs every file the importer writes, so any refusal
    (ColibriError) propagates and fails the calling test."""
    _native_or_fail()
    return colibri_lab.Engine(path)


@pytest.mark.parametrize("fam", FAMILIES)
def test_engine_logits_equal_transformers(models, imported, fam):
    """The engine on the f32 import gives transformers' logits, and the Hugging Face
    converter's file's (packed FFN) within float rounding."""
    from helpers import compare_logits, hf_logits, random_ids

    info = fmt_reader.inspect(imported(fam, "f32"))
    ids = random_ids(info.metadata["model.vocab_size"], 24, seed=9)
    ref, router_logits = hf_logits(_hf_model(fam, models[fam]["folder"]), ids)
    with _engine(imported(fam, "f32")) as eng:
        got = eng.forward(ids)
    with colibri_lab.Engine(models[fam]["hf"]) as eng:
        packed = eng.forward(ids)
    top_k = info.metadata["model.top_k"]
    compare_logits(ref, got, router_logits, top_k, f"{fam} gguf f32 vs transformers")
    compare_logits(packed, got, router_logits, top_k, f"{fam} gguf f32 vs hf-converted", tol=1e-5)


@pytest.mark.parametrize("fam,outtype", QUANTIZED)
def test_engine_runs_quantized_as_its_values(models, imported, fam, outtype, tmp_path):
    """The engine on a bf16 / q8_0 import gives the logits of the f32 file of the same
    (dequantized) values: the copied blocks mean what the GGUF meant."""
    from helpers import random_ids

    deq = rewrite_gguf(models[fam]["gguf"][outtype], tmp_path / "deq.gguf", tensors=dequantized, fields=no_vocab)
    ref_path = convert_gguf(deq, tmp_path / "deq.colibri", progress=False)
    info = fmt_reader.inspect(imported(fam, outtype))
    ids = random_ids(info.metadata["model.vocab_size"], 24, seed=10)
    with _engine(imported(fam, outtype)) as eng:
        got = eng.forward(ids)
    with _engine(ref_path) as eng:
        ref = eng.forward(ids)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * max(1.0, float(np.abs(ref).max())))


def test_mxfp4_experts_import_and_run_as_their_values(models, tmp_path):
    """An f32 GGUF whose expert tensors are rewritten as MXFP4 (gguf.quants, = ggml's
    quantize_row_mxfp4_ref): the import copies their bytes (no requantization), and the
    engine's logits on it are those of the f32 file of the same dequantized values, in the
    exact and the fast mode (which runs MXFP4 on the exact kernels)."""
    from helpers import random_ids
    if not hasattr(gguf.GGMLQuantizationType, "MXFP4"):
        pytest.skip(f"the installed gguf package ({_gguf_version()}) has no "
                    "GGMLQuantizationType.MXFP4")
    MX, F32 = gguf.GGMLQuantizationType.MXFP4, gguf.GGMLQuantizationType.F32
    blocks = {}

    def mx(name, ttype, data):
        if "_exps" in name and ttype == F32 and data.shape[-1] % 32 == 0:
            blocks[name] = gguf.quants.quantize(data, MX)
            return [(name, MX, blocks[name])]
        return [(name, ttype, data)]

    def mx_values(name, ttype, data):
        (n, t, d), = mx(name, ttype, data)
        if t == MX:
            return [(n, F32, np.ascontiguousarray(gguf.quants.dequantize(d, MX), dtype=np.float32))]
        return [(n, t, d)]

    src = models["qwen3_moe"]["gguf"]["f32"]
    g = rewrite_gguf(src, tmp_path / "mx.gguf", tensors=mx, fields=no_vocab)
    assert blocks
    gv = rewrite_gguf(src, tmp_path / "mxv.gguf", tensors=mx_values, fields=no_vocab)
    out = convert_gguf(g, tmp_path / "mx.colibri", progress=False)
    ref = convert_gguf(gv, tmp_path / "mxv.colibri", progress=False)
    info = fmt_reader.inspect(out, verify=True)
    for name in ("blk.0.ffn_gate_exps", "blk.0.ffn_up_exps", "blk.0.ffn_down_exps"):
        assert info.tensor(name).dtype == "mxfp4", name
        assert info.read_tensor(name).tobytes() == blocks[gguf_name(name)].tobytes(), name
    ids = random_ids(info.metadata["model.vocab_size"], 24, seed=11)
    for precision in ("exact", "fast"):
        _native_or_fail()
        with colibri_lab.Engine(out, precision=precision) as eng:
            got = eng.forward(ids)
        with colibri_lab.Engine(ref, precision=precision) as eng:
            want = eng.forward(ids)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())))


# --------------------------------------------------------------------------- K-quants

def _llama_program(src: Path, name: str) -> Path:
    """llama.cpp's program `name` as the benchmarks build it (src/build/bin); skips the
    calling test, naming the missing file and how to build it, when it is not there."""
    exe = src / "build" / "bin" / name
    if not exe.is_file():
        pytest.skip(f"llama.cpp's {name} is not built: no {exe} (python -m "
                    f"colibri_lab.bench.side_by_side builds it, or cmake --build {src / 'build'} "
                    f"--target {name})")
    return exe


@pytest.mark.parametrize("qtype", KQUANT_TYPES)
def test_k_quant_mixes(models, qtype, tmp_path):
    """llama-quantize's Q4_K_M / Q5_K_M / Q6_K files (Q4_K, Q5_K, Q6_K and Q8_0 blocks, as
    llama.cpp mixes them): bytes copied, and the engine gives the logits of the dequantized
    values. Needs llama.cpp's llama-quantize (the benchmarks build it); skipped without it."""
    exe = _llama_program(models["src"], "llama-quantize")
    q = tmp_path / f"kquant-{qtype}.gguf"
    r = subprocess.run([str(exe), str(models["kquant"]["gguf"]["f32"]), str(q), qtype],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    types = {t.tensor_type.name for t in gguf.GGUFReader(q).tensors}
    want = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K"}[qtype]
    assert want in types, types
    out = convert_gguf(q, tmp_path / "k.colibri", progress=False)
    info = fmt_reader.inspect(out, verify=True)
    assert info.metadata["model.weight_dtype"] == f"gguf_{qtype.lower()}"
    _check_bytes_as_stored(info, q, permuted=False)
    deq = rewrite_gguf(q, tmp_path / "deq.gguf", tensors=dequantized, fields=no_vocab)
    ref_path = convert_gguf(deq, tmp_path / "deq.colibri", progress=False)
    from helpers import random_ids

    ids = random_ids(info.metadata["model.vocab_size"], 16, seed=11)
    with _engine(out) as eng:
        got = eng.forward(ids)
    with _engine(ref_path) as eng:
        ref = eng.forward(ids)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * max(1.0, float(np.abs(ref).max())))


# --------------------------------------------------------------------------- other layouts

def test_fused_gate_up_and_per_expert_tensors(models, imported, tmp_path):
    """ffn_gate_up_exps ([E, 2I, H]: gate rows, then up rows) and llama.cpp's old
    per-expert tensors (blk.N.ffn_gate.E.weight) import to the same split FFN."""
    src = models["mixtral"]["gguf"]["q8_0"]
    E = 4
    gates = {t.name: np.array(t.data) for t in gguf.GGUFReader(src).tensors
             if t.name.endswith("ffn_gate_exps.weight")}

    def fuse(name, ttype, data):
        if name.endswith("ffn_gate_exps.weight"):
            return []
        if name.endswith("ffn_up_exps.weight"):
            gate = gates[name.replace("up_exps", "gate_exps")]
            return [(name.replace("up_exps", "gate_up_exps"), ttype,
                     np.concatenate([gate, data], axis=1))]
        return [(name, ttype, data)]

    def split(name, ttype, data):
        if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")):
            base = name.replace("_exps.weight", "")
            return [(f"{base}.{e}.weight", ttype, np.ascontiguousarray(data[e])) for e in range(E)]
        return [(name, ttype, data)]

    want = fmt_reader.inspect(imported("mixtral", "q8_0"))
    for how in (fuse, split):
        g = rewrite_gguf(src, tmp_path / f"{how.__name__}.gguf", tensors=how, fields=no_vocab)
        info = fmt_reader.inspect(convert_gguf(g, tmp_path / f"{how.__name__}.colibri", progress=False,
                                        tokenizer="none"), verify=True)
        assert [(t.name, t.dtype, t.shape, t.crc32) for t in info.tensors] == \
            [(t.name, t.dtype, t.shape, t.crc32) for t in want.tensors], how.__name__


def test_dense_layer(models, tmp_path):
    """A layer with blk.N.ffn_gate/up/down.weight and no router is a dense MLP
    (model.layer_ffn 0, model.dense_intermediate_size), stored split as ffn_gate/up/down."""
    src = models["qwen2_moe"]["gguf"]["f32"]

    def densify(name, ttype, data):
        if name.startswith("blk.1."):
            if name.endswith(("_shexp.weight",)) and "gate_inp" not in name:
                return [(name.replace("_shexp", ""), ttype, data)]   # shared expert -> the MLP
            if "ffn_gate_inp" in name or "_exps" in name:
                return []
        return [(name, ttype, data)]

    g = rewrite_gguf(src, tmp_path / "dense.gguf", tensors=densify)
    info = fmt_reader.inspect(convert_gguf(g, tmp_path / "dense.colibri", progress=False), verify=True)
    assert info.metadata["model.layer_ffn"] == [1, 0]
    assert info.metadata["model.dense_intermediate_size"] == 64
    assert info.tensor("blk.1.ffn_gate").shape == (64, 64)
    assert info.tensor("blk.1.ffn_down").shape == (64, 64)
    names = {t.name for t in info.tensors}
    assert "blk.1.ffn_gate_inp.weight" not in names and "blk.1.ffn_gate_exps" not in names
    with _engine(info.path) as eng:
        assert np.isfinite(eng.forward([1, 2, 3])).all()


def test_metadata_options_from_the_gguf(models, tmp_path):
    """{arch}.attention.clamp_kqv -> model.clip_qkv (f32 written, the decimal read back);
    {arch}.expert_weights_norm overrides the family default."""
    GT = gguf.GGUFValueType
    g = rewrite_gguf(models["olmoe"]["gguf"]["f32"], tmp_path / "clip.gguf",
                     add_fields={"olmoe.attention.clamp_kqv": (2.5, GT.FLOAT32),
                                 "olmoe.expert_weights_norm": (True, GT.BOOL)})
    info = fmt_reader.inspect(convert_gguf(g, tmp_path / "clip.colibri", progress=False))
    assert info.metadata["model.clip_qkv"] == 2.5
    assert info.metadata["model.norm_topk_prob"] is True
    assert info.metadata["model.rms_norm_eps"] == 1e-5     # f32 in the GGUF, 1e-5 here


# --------------------------------------------------------------------------- refusals

def test_unsupported_tensor_type_is_refused_by_name(models, tmp_path):
    Q8_1 = gguf.GGMLQuantizationType.Q8_1   # a block type the format does not have

    def q8_1(name, ttype, data):
        if name == "blk.0.attn_q.weight":
            (rows, cols), (be, bb) = data.shape, gguf.GGML_QUANT_SIZES[Q8_1]
            return [(name, Q8_1, np.zeros((rows, cols // be * bb), np.uint8))]
        return [(name, ttype, data)]

    g = rewrite_gguf(models["qwen3_moe"]["gguf"]["f32"], tmp_path / "q8_1.gguf", tensors=q8_1)
    out = tmp_path / "x.colibri"
    with pytest.raises(ConversionError, match=r"tensor blk\.0\.attn_q\.weight has type Q8_1, "
                                              r"which colibri does not support; supported: "
                                              r"F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K"):
        convert_gguf(g, out, progress=False)
    assert not out.exists() and not Path(str(out) + ".tmp").exists()


def test_gate_and_up_of_different_dtypes_are_refused(models, tmp_path):
    """gate and up of one FFN share a dtype (the kernels stream them together); a down
    projection of another dtype is fine."""
    F16 = gguf.GGMLQuantizationType.F16

    def to_f16(which):
        def f(name, ttype, data):
            if name == f"blk.0.ffn_{which}_exps.weight":
                return [(name, F16, data.astype(np.float16))]
            return [(name, ttype, data)]
        return f

    src = models["qwen3_moe"]["gguf"]["f32"]
    g = rewrite_gguf(src, tmp_path / "up16.gguf", tensors=to_f16("up"))
    with pytest.raises(ConversionError, match=r"ffn_gate_exps is F32 but blk\.0\.ffn_up_exps is "
                                              r"F16.*same|one dtype"):
        convert_gguf(g, tmp_path / "x.colibri", progress=False)
    g = rewrite_gguf(src, tmp_path / "down16.gguf", tensors=to_f16("down"))
    info = fmt_reader.inspect(convert_gguf(g, tmp_path / "y.colibri", progress=False), verify=True)
    assert info.tensor("blk.0.ffn_down_exps").dtype == "f16"
    assert info.tensor("blk.0.ffn_gate_exps").dtype == "f32"


def test_damaged_files_are_refused(models, tmp_path):
    src = models["qwen3_moe"]["gguf"]["q8_0"]
    data = src.read_bytes()
    for cut, what in ((len(data) - 1000, "tensor data"), (len(data) // 3, "tensor data"),
                      (200, "metadata")):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        out = tmp_path / "x.colibri"
        with pytest.raises(ConversionError, match="truncated"):
            convert_gguf(bad, out, progress=False)
        assert not out.exists(), what
    notg = tmp_path / "not.gguf"
    notg.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ConversionError, match="not a GGUF file"):
        convert_gguf(notg, tmp_path / "x.colibri", progress=False)
    with pytest.raises(ConversionError, match="no such GGUF file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "x.colibri", progress=False)


def test_unsupported_architectures_are_refused(models, tmp_path):
    src = models["qwen3_moe"]["gguf"]["f32"]
    g = rewrite_gguf(src, tmp_path / "dbrx.gguf", arch="dbrx")
    with pytest.raises(ConversionError, match=r"unsupported GGUF architecture 'dbrx'; "
                                              r"supported: llama \(Mixtral"):
        convert_gguf(g, tmp_path / "x.colibri", progress=False)
    # a dense llama (no experts)
    g = rewrite_gguf(models["mixtral"]["gguf"]["f32"], tmp_path / "dense.gguf",
                     fields=lambda k, v: 0 if k == "llama.expert_count" else no_vocab(k, v))
    with pytest.raises(ConversionError, match="dense model"):
        convert_gguf(g, tmp_path / "x.colibri", progress=False)


def test_cli(models, tmp_path, capsys):
    """colibri-convert --model_name_or_path X.gguf imports; it refuses the HF-only options."""
    from colibri_lab.conversion.cli import main

    g = str(models["olmoe"]["gguf"]["bf16"])
    out = tmp_path / "m.colibri"
    assert main(["--model_name_or_path", g, "--output_path", str(out), "--max_seq_len", "128",
                 "--quiet"]) == 0
    info = fmt_reader.inspect(out)
    assert info.header["max_seq_len"] == 128 and info.metadata["model.weight_dtype"] == "gguf_bf16"
    assert main(["--model_name_or_path", g, "--output_path", str(tmp_path / "n.colibri"), "--quiet",
                 "--no_tokenizer"]) == 0
    assert fmt_reader.inspect(tmp_path / "n.colibri").metadata["tokenizer.type"] == "none"
    assert main(["--model_name_or_path", g, "--output_path", str(tmp_path / "d.colibri"), "--quiet",
                 "--dtype", "q8_0"]) == 1
    assert "do not apply" in capsys.readouterr().err
    assert not (tmp_path / "d.colibri").exists()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    assert main(["--model_name_or_path", str(bad), "--output_path", str(tmp_path / "o.colibri"),
                 "--quiet"]) == 1
    assert "not a GGUF file" in capsys.readouterr().err


@pytest.mark.parametrize("fam", FAMILIES)
def test_end_ids_are_llama_cpps(models, imported, fam):
    """The import's end ids (colibri_get_end_ids: EOS, then tokenizer.end_ids) are the
    end-of-generation tokens llama.cpp lists for the same GGUF when it loads it (its log at
    -lv 4: "printing all EOG tokens", written as it reads the vocabulary, before the weights:
    llama.cpp's Qwen3-MoE and OLMoE graphs then refuse these checkpoints' attention biases).
    Needs llama.cpp's llama-completion; skipped without it."""
    import re

    exe = _llama_program(models["src"], "llama-completion")
    theirs, seen = None, []
    for _ in range(12):   # its log can come out incomplete on a busy machine: until two runs agree
        r = subprocess.run([str(exe), "-m", str(models[fam]["gguf"]["f32"]), "-p", "x", "-n", "1", "--temp", "0",
                            "-no-cnv", "-t", "1", "--no-warmup", "-c", "64", "-lv", "4"],
                           capture_output=True, timeout=300, stdin=subprocess.DEVNULL, check=False)
        log = r.stderr.decode("utf-8", "replace")
        m = re.search(r"printing all EOG tokens:\n((?:.*? - \d+ \('.*?'\)\n)*)(.*)\n", log)
        # a list read whole ends at the next line of llama.cpp's vocabulary loader ("load: ...")
        if m and "load:" in m.group(2):
            seen.append({int(x) for x in re.findall(r" - (\d+) \('", m.group(1))})
            if len(seen) >= 2 and seen[-1] == seen[-2]:
                theirs = seen[-1]
                break
    assert theirs, f"llama-completion never printed its end-of-generation tokens twice alike ({seen}): {log[-2000:]}"
    with _engine(imported(fam, "f32")) as eng:
        assert set(eng.end_ids) == theirs and len(eng.end_ids) == len(theirs)
        assert eng.end_ids[0] == eng.tokenizer.eos_id


@pytest.mark.parametrize("fam", ["mixtral"])
def test_greedy_text_equals_llama_cpp(models, imported, fam):
    """llama.cpp itself on the f32 GGUF and the engine on its import generate the same
    greedy text (tokenizer, BOS, q/k order, every weight). Needs llama.cpp's
    llama-completion (the benchmarks build it); skipped without it. Mixtral only: the tiny
    BPE vocabularies' random-weight continuations are often lone UTF-8 bytes, which
    llama.cpp's console printing holds back, and llama.cpp's graphs for Qwen3-MoE and OLMoE
    do not load the attention biases these checkpoints have."""
    exe = _llama_program(models["src"], "llama-completion")
    prompt = "The router sends each token"
    out = llama_completion(exe, models[fam]["gguf"]["f32"], prompt, 12).decode("utf-8", "replace")
    ban = {i: -1e9 for i in gguf_end_ids(str(models[fam]["gguf"]["f32"]))}   # as --ignore-eos
    with _engine(imported(fam, "f32")) as eng:
        ids = [t.id for t in eng.generate(prompt, max_new_tokens=12, stop_at_eos=False, logit_bias=ban)]
        got = eng.tokenizer.decode(ids)
    assert prompt in out
    # (decoding the generated ids alone drops SentencePiece's leading space)
    assert out.split(prompt, 1)[1].strip() == got.strip()
