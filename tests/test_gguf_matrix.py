"""llama.cpp's own files of every family in the block types of popular quantized GGUFs:
each family's random checkpoint (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2,
DeepSeek-V3, gpt-oss; hidden and expert widths 256, so that the K and IQ4_XS blocks fit
whole rows) converted by convert_hf_to_gguf.py to f32, then quantized by llama-quantize to
Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K_M, IQ4_NL and IQ4_XS, with an importance matrix to the grid
types' mixes (IQ1_S/M, IQ2_XXS/XS/S/M, IQ3_XXS/XS/S/M), and one file whose rows are not
multiples of 256 (Q4_K_M falling back to Q5_0 / Q8_0). For each file:

* it imports, and holds the block type asked for;
* the engine's exact-mode logits equal transformers' on the dequantized weights (the
  checkpoint with every tensor llama-quantize changed replaced by its gguf.quants values)
  within 1e-4 x the logit scale;
* llama.cpp's llama-completion on the F32 file of the same values (the file's tensors
  dequantized with gguf.quants; its KV cache in f32, its flash attention off) and the engine
  on the quantized import generate the same greedy tokens (up to a tie within TIE x the logit
  scale, which rounding decides), both with llama.cpp's end-of-generation tokens banned, as
  its --ignore-eos bans them;
* on the quantized file itself llama.cpp multiplies these blocks with 8-bit-quantized
  activations (Q8_0 / Q8_K), the exact mode with f32 ones: its greedy text is recorded (the
  rank and gap of each of its tokens among the engine's logits: the test's "steps" property),
  not asserted. On these random tiny models most files' texts part within ten tokens, mostly
  at near-ties (llama-server's own log-probabilities on gpt-oss IQ4_XS lie up to 0.3 from the
  exact ones), once (DeepSeek-V3 Q3_K_M) at a token 3.9 below the engine's top; its f32 KV
  cache gives the same texts as its f16 one.
  llama.cpp's bytes are read back as tokens through the engine's logits (teacher forcing), so
  the first differing token, its rank and its gap are known.

The dequantized checkpoint is found without knowing any family's tensor names: the
converter also converts an *index checkpoint* (the same folder with every weight value
replaced by a float whose bits are its position in the checkpoint), so each GGUF value's
position in the checkpoint is read from the index GGUF (checked: the real f32 GGUF maps back
to the checkpoint bit for bit).

By default each family runs with one or two of the classic types and one grid type, each
classic type with at least one family (COLIBRI_GGUF_MATRIX=full runs every pair). A grid
type's file also carries its codebook, which the engine checks (test_grid_codebook_is_checked). Needs llama.cpp's convert_hf_to_gguf.py, a built
llama-quantize and llama-completion (the benchmarks build them); skipped, naming the missing
file, without them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

import colibri_lab  # noqa: E402
from colibri_lab.bench.llama_cpp import synthetic_imatrix  # noqa: E402
from colibri_lab.bench.models import (  # noqa: E402
    DeepseekShape, FamilyShape, MixtralShape, build_model, byte_level_bpe, load_model, save_checkpoint,
)
from colibri_lab.conversion.gguf import convert_gguf, gguf_end_ids  # noqa: E402
from colibri_lab.format import reader as fmt_reader  # noqa: E402
from test_gguf_import import (  # noqa: E402
    CHATML, MIXTRAL_TEMPLATE, SPECIALS, _corpus, _llama_program, _llama_root, _native_or_fail,
    dequantized, llama_completion, llama_cpp_source, make_ggufs, rewrite_gguf,
)

TOL = 1e-4
YARN_V3 = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
               beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
YARN_V2 = dict(YARN_V3, mscale=0.707, mscale_all_dim=0.707)
W = 256   # hidden and expert widths: whole K / IQ4_XS blocks per row
SHAPES = {
    "mixtral": MixtralShape(vocab=32000, hidden=W, inter=W, layers=2, heads=4, kv_heads=2, experts=4,
                            top_k=2, max_pos=512, seed=61),
    "qwen2_moe": FamilyShape("qwen2_moe", hidden=W, inter=W, dense_inter=W, shared_inter=W, layers=2,
                             heads=4, kv_heads=2, experts=4, top_k=2, seed=62),
    # no attention biases (Qwen3-MoE's and OLMoE's own checkpoints have none; llama.cpp's graphs
    # of these families do not load them)
    "qwen3_moe": FamilyShape("qwen3_moe", hidden=W, inter=W, layers=2, heads=4, kv_heads=2, head_dim=64,
                             experts=4, top_k=2, norm_topk=True, bias=False, seed=63),
    "olmoe": FamilyShape("olmoe", hidden=W, inter=W, layers=2, heads=4, kv_heads=4, experts=4, top_k=2,
                         bias=False, seed=64),
    # with a q LoRA, as DeepSeek-V2 itself (llama.cpp loads a deepseek2 file without one only
    # at V2-Lite's layer counts)
    "deepseek_v2": DeepseekShape("deepseek_v2", hidden=W, inter=W, dense_inter=W, layers=2, heads=2,
                                 q_lora=W, kv_lora=W, nope=64, rope=32, v_dim=64, experts=4, top_k=2,
                                 shared=2, first_dense=1, norm_topk=False, yarn=YARN_V2, max_pos=256,
                                 seed=65),
    "deepseek_v3": DeepseekShape("deepseek_v3", hidden=W, inter=W, dense_inter=W, layers=3, heads=2,
                                 q_lora=W, kv_lora=W, nope=64, rope=32, v_dim=64, experts=8, top_k=2,
                                 shared=1, first_dense=1, n_group=4, topk_group=2, norm_topk=True,
                                 scale=2.5, yarn=YARN_V3, max_pos=256, seed=66),
    "gpt_oss": FamilyShape("gpt_oss", hidden=W, inter=W, layers=3, heads=4, kv_heads=2, head_dim=64,
                           experts=4, top_k=2, sliding_window=6, max_pos=256, seed=67,
                           rope=(("rope_type", "yarn"), ("rope_theta", 10000.0), ("factor", 4.0),
                                 ("original_max_position_embeddings", 64), ("beta_fast", 32.0),
                                 ("beta_slow", 1.0))),
    # rows of 160: llama-quantize's K mixes fall back to Q5_0 / Q5_1 / Q4_0 / Q8_0
    "qwen3_moe_160": FamilyShape("qwen3_moe", hidden=160, inter=96, layers=2, heads=4, kv_heads=2,
                                 head_dim=32, experts=4, top_k=2, norm_topk=True, bias=False, seed=68),
}
# tokenizer: (byte_level_bpe style, tokenizer.ggml.pre); None = the Mixtral SentencePiece model
TOKENIZERS = {"mixtral": None, "qwen2_moe": ("qwen2", "qwen2"), "qwen3_moe": ("qwen2", "qwen2"),
              "olmoe": ("gpt2", "olmo"), "deepseek_v2": ("deepseek_v3", "deepseek-v3"),
              "deepseek_v3": ("deepseek_v3", "deepseek-v3"), "gpt_oss": ("o200k", "gpt-4o"),
              "qwen3_moe_160": ("qwen2", "qwen2")}
# llama-quantize ftype -> the block type its file must hold
FTYPES = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q2_K": "Q2_K",
          "Q3_K_M": "Q3_K", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS",
          # the grid types (ggml's i-quants), quantized with an importance matrix as published
          # files are (llama-quantize refuses IQ2 and IQ1 without one): the IQ2_S mix is IQ2_XS
          # blocks (with IQ3_S), IQ2_M's IQ2_S, IQ3_XS's IQ3_XXS (with IQ3_S), IQ3_M's IQ3_S
          "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_XS", "IQ2_M": "IQ2_S",
          "IQ3_XXS": "IQ3_XXS", "IQ3_XS": "IQ3_XXS", "IQ3_S": "IQ3_S", "IQ3_M": "IQ3_S",
          "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M"}
IMATRIX = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ1_S", "IQ1_M"}
FALLBACK = {"Q4_K_M": "Q5_0"}    # qwen3_moe_160's file: rows of 160 hold no Q4_K
FAMILIES = [f for f in SHAPES if f != "qwen3_moe_160"]
FULL = [(f, t) for f in FAMILIES for t in FTYPES] + [("qwen3_moe_160", t) for t in FALLBACK]
# the default: every family and every type at least once
DIAGONAL = [("mixtral", "Q4_0"), ("qwen2_moe", "Q5_1"), ("qwen3_moe", "IQ4_XS"), ("olmoe", "Q4_1"),
            ("deepseek_v2", "Q3_K_M"), ("deepseek_v3", "Q2_K"), ("gpt_oss", "IQ4_NL"),
            ("gpt_oss", "Q5_0"), ("qwen3_moe_160", "Q4_K_M"),
            ("mixtral", "IQ3_XXS"), ("qwen3_moe", "IQ2_XXS"), ("deepseek_v2", "IQ2_M"),
            ("olmoe", "IQ1_M"), ("qwen2_moe", "IQ1_S"), ("deepseek_v3", "IQ3_M"), ("gpt_oss", "IQ2_XS")]
_ASKED = os.environ.get("COLIBRI_GGUF_MATRIX", "")   # "full", or family:ftype,... (those alone)
CASES = FULL if _ASKED == "full" else [tuple(c.split(":")) for c in _ASKED.split(",")] if _ASKED else DIAGONAL
BASE = 0x3F800000   # index checkpoint: value bits = BASE + position (floats 1.0 ...)
PROMPTS = {"mixtral": "The router sends each token"}
PROMPT = "def forward(self, x):"
N_NEW = 10
# on the F32 file of the same values llama.cpp differs from the exact mode by rounding alone:
# a greedy tie within this share of the logit scale falls either way (measured: a top-2 margin
# of 0.001, 2e-4 of the scale, on Qwen3-MoE Q5_0's values)
TIE = 1e-3


def _bpe(style: str, toks: dict):
    """The byte-level BPE tokenizer of a style (trained once per module)."""
    if style not in toks:
        toks[style] = byte_level_bpe(_corpus(), 500, SPECIALS["olmo" if style == "gpt2" else "qwen"],
                                     style=style)
    return toks[style]


def _tokenizer(fam: str, folder: Path, toks: dict):
    """Writes the family's tokenizer into `folder`; returns the reference tokenizer."""
    if TOKENIZERS[fam] is None:
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
             "chat_template": MIXTRAL_TEMPLATE}))
        return None
    style = TOKENIZERS[fam][0]
    tok = _bpe(style, toks)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": None, "eos_token": "<|endoftext|>" if style == "gpt2" else "<|im_end|>",
           "tokenizer_class": "PreTrainedTokenizerFast"}
    if style != "gpt2":
        cfg["chat_template"] = CHATML
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok


def _index_checkpoint(folder: Path, out: Path) -> None:
    """`folder` with every float value replaced by the float whose bits are BASE + its
    position (tensors in sorted name order, row-major)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, out)
    w = load_file(str(folder / "model.safetensors"))
    pos, idx = 0, {}
    for name in sorted(w):
        a = w[name]
        assert a.dtype == np.float32, (name, a.dtype)
        idx[name] = (np.arange(a.size, dtype=np.uint32) + np.uint32(BASE + pos)).view(np.float32).reshape(a.shape)
        pos += a.size
    assert BASE + pos < 0x7F800000
    save_file(idx, str(out / "model.safetensors"), metadata={"format": "pt"})


def _positions(index_gguf: Path, real_gguf: Path, folder: Path) -> dict:
    """GGUF tensor name -> the checkpoint position of each of its values (flat, in the
    GGUF's order); checked against the real f32 GGUF: it maps back to the checkpoint."""
    from safetensors.numpy import load_file

    w = load_file(str(folder / "model.safetensors"))
    flat = np.concatenate([w[n].reshape(-1) for n in sorted(w)]).view(np.uint32)
    real = {t.name: np.array(t.data) for t in gguf.GGUFReader(real_gguf).tensors}
    out = {}
    for t in gguf.GGUFReader(index_gguf).tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        p = np.array(t.data).reshape(-1).view(np.uint32).astype(np.int64) - BASE
        assert p.min() >= 0 and p.max() < flat.size, f"{t.name}: not a rearrangement of the checkpoint"
        assert np.array_equal(flat[p], real[t.name].reshape(-1).view(np.uint32)), t.name
        out[t.name] = p
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> dict(folder, tok, f32 (GGUF), pos (GGUF name -> checkpoint positions)); plus
    "quantize" and "completion": llama.cpp's programs."""
    src = llama_cpp_source(_llama_root())
    quantize = _llama_program(src, "llama-quantize")
    completion = _llama_program(src, "llama-completion")
    work = tmp_path_factory.mktemp("gguf-matrix")
    out, jobs, toks = {"quantize": quantize, "completion": completion}, [], {}
    for fam in sorted({f for f, _ in CASES}):
        folder = work / fam
        shape = SHAPES[fam]
        if TOKENIZERS[fam] is None:
            save_checkpoint(build_model(shape), folder, tokenizer="spm")
        else:
            # the embedding as large as the vocabulary: no [PAD] fillers a greedy run could pick
            shape = dataclasses.replace(shape, vocab=_bpe(TOKENIZERS[fam][0], toks).get_vocab_size())
            save_checkpoint(build_model(shape), folder, tokenizer="none")
        tok = _tokenizer(fam, folder, toks)
        if fam.startswith("deepseek_v3"):   # as DeepSeek-V3's config.json (see test_gguf_families)
            cfg = json.loads((folder / "config.json").read_text())
            cfg.update(scoring_func="sigmoid", topk_method="noaux_tc")
            (folder / "config.json").write_text(json.dumps(cfg))
        _index_checkpoint(folder, work / f"{fam}-index")
        pre = TOKENIZERS[fam][1] if TOKENIZERS[fam] else None
        for name, f in ((fam, folder), (f"{fam}-index", work / f"{fam}-index")):
            jobs.append({"model": str(f), "outtype": "f32", "outfile": str(work / f"{name}.gguf"), "pre": pre})
        out[fam] = dict(folder=folder, tok=tok, f32=work / f"{fam}.gguf")
    make_ggufs(src, jobs, work)
    for fam in out:
        if fam in SHAPES:
            out[fam]["pos"] = _positions(work / f"{fam}-index.gguf", out[fam]["f32"], out[fam]["folder"])
    return out




def _dequantized_checkpoint(m: dict, q: Path, out: Path) -> Path:
    """The checkpoint with every value the GGUF `q` holds replaced by its gguf.quants value."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(m["folder"], out)
    w = load_file(str(m["folder"] / "model.safetensors"))
    names = sorted(w)
    flat = np.concatenate([w[n].reshape(-1) for n in names])
    seen = np.zeros(flat.size, bool)
    for t in gguf.GGUFReader(q).tensors:
        data = np.array(t.data)
        vals = data if t.tensor_type == gguf.GGMLQuantizationType.F32 else \
            gguf.quants.dequantize(data, t.tensor_type)
        p = m["pos"][t.name]
        vals = np.asarray(vals, np.float32).reshape(-1)
        assert vals.size == p.size, t.name
        # a value written twice (a checkpoint tensor in two GGUF tensors) must agree
        assert np.array_equal(flat[p[seen[p]]], vals[seen[p]]), f"{t.name}: two values for one weight"
        flat[p] = vals
        seen[p] = True
    pos, new = 0, {}
    for n in names:
        new[n] = flat[pos:pos + w[n].size].reshape(w[n].shape)
        pos += w[n].size
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _piece_bytes(tok, folder: Path):
    """id -> the bytes llama-completion prints for it: none for control tokens, and a piece
    only up to its first NUL byte (it prints each piece as a C string)."""
    g = _piece_bytes_whole(tok, folder)
    return lambda i: g(i).split(b"\0", 1)[0]


def _piece_bytes_whole(tok, folder: Path):
    """id -> the token's bytes (none for control tokens)."""
    if tok is None:   # SentencePiece: "▁" is a space, <0xAB> a byte
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))

        def g(i: int) -> bytes:
            if sp.is_control(i) or sp.is_unknown(i):
                return b""
            p = sp.id_to_piece(i)
            if sp.is_byte(i):
                return bytes([int(p[3:5], 16)])
            return p.replace("\u2581", " ").encode()
        return g
    from colibri_lab.conversion.bpe import bytes_to_unicode

    inv = {v: k for k, v in bytes_to_unicode().items()}
    special = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}

    def f(i: int) -> bytes:
        p = tok.id_to_token(i)
        return b"" if p is None or p in special else bytes(inv[c] for c in p)
    return f


def _follow(eng, prompt: str, theirs: bytes, piece, banned: list[int]) -> list[tuple[int, float, float]]:
    """llama.cpp's continuation `theirs` read back as tokens through the engine's own logits
    (teacher forcing): per generated token, (the rank of llama.cpp's token among the engine's
    logits, the engine's top logit minus that token's, the engine's top-2 margin). Rank 0
    everywhere: the same greedy text. llama.cpp's token at a step is the best-ranked of the
    engine's whose bytes begin what is left of `theirs`; the `banned` ids (what
    `--ignore-eos` bans: gguf_end_ids) are not candidates."""
    ids = eng.tokenizer.encode(prompt, add_bos=True)
    out, rest = [], theirs
    for _ in range(N_NEW):
        logits = eng.forward(ids)[-1]
        logits[banned] = -np.inf
        order = np.argsort(-logits, kind="stable")
        for rank, t in enumerate(order[:200]):
            b = piece(int(t))
            if rest.startswith(b) and (b or rank == 0):
                break
        else:
            raise AssertionError(f"llama.cpp's output {rest!r} starts with none of the engine's top 200 tokens")
        out.append((rank, float(logits[order[0]] - logits[t]), float(logits[order[0]] - logits[order[1]])))
        ids.append(int(t))
        rest = rest[len(b):]
    return out


@pytest.mark.parametrize("fam,ftype", CASES)
def test_llama_quantize_file(models, fam, ftype, tmp_path, record_property):
    from helpers import hf_logits, random_ids

    m = models[fam]
    q = tmp_path / f"{fam}-{ftype}.gguf"
    im = ["--imatrix", str(synthetic_imatrix(m["f32"], tmp_path / "imatrix.dat", 72))] if ftype in IMATRIX else []
    r = subprocess.run([str(models["quantize"]), *im, str(m["f32"]), str(q), ftype], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    types = sorted({t.tensor_type.name for t in gguf.GGUFReader(q).tensors})
    record_property("types", " ".join(types))
    want = {**FTYPES, **FALLBACK}[ftype]
    assert want in types, f"{fam} {ftype}: llama-quantize wrote {types}, no {want}"
    out = convert_gguf(q, tmp_path / "q.colibri", progress=False)
    info = fmt_reader.inspect(out, verify=True)
    assert want.lower() in {t.dtype for t in info.tensors}
    # exact mode == transformers on the dequantized weights
    ref_model = load_model(SHAPES[fam].family, _dequantized_checkpoint(m, q, tmp_path / "deq"))
    ids = random_ids(info.metadata["model.vocab_size"], 24, seed=71)
    ref, _ = hf_logits(ref_model, ids)
    _native_or_fail()
    prompt = PROMPTS.get(fam, PROMPT)
    piece = _piece_bytes(m["tok"], m["folder"])
    # llama.cpp on the file itself, and on the same values as F32 (rewritten with gguf.quants)
    conts = {}
    for kind, path in (("file", q), ("values", rewrite_gguf(q, tmp_path / "deq.gguf", tensors=dequantized))):
        theirs = llama_completion(models["completion"], path, prompt, N_NEW, f32_attention=kind == "values")
        assert prompt.encode() in theirs, theirs
        conts[kind] = theirs.split(prompt.encode(), 1)[1]
    cont = conts["file"]
    with colibri_lab.Engine(out) as eng:
        got = eng.forward(ids)
        # llama-completion --ignore-eos bans its end-of-generation tokens: so does the engine here
        banned = gguf_end_ids(str(q))
        gen = [t.id for t in eng.generate(prompt, max_new_tokens=N_NEW, stop_at_eos=False,
                                          logit_bias={i: -1e9 for i in banned})]
        try:
            steps = _follow(eng, prompt, cont, piece, banned)
        except AssertionError as e:   # recorded only (see below)
            steps = str(e)
        same_values = _follow(eng, prompt, conts["values"], piece, banned)
    scale = max(1.0, float(np.abs(ref).max()))
    delta = float(np.abs(got - ref).max())
    mine = b"".join(piece(i) for i in gen)
    record_property("delta", f"{delta:.3g}")
    record_property("scale", f"{scale:.3g}")
    record_property("greedy_equal", str(isinstance(steps, list) and all(r == 0 for r, _, _ in steps)))
    record_property("steps", json.dumps(steps))
    record_property("same_values_ranks", json.dumps([r for r, _, _ in same_values]))
    record_property("ours", repr(mine))
    record_property("theirs", repr(cont))
    print(f"{fam} {ftype}: types {types}, max |Δ logits| {delta:.3g} (scale {scale:.3g}), llama.cpp's "
          f"tokens' ranks / gaps {steps}, on the F32 values {[r for r, _, _ in same_values]}")
    assert delta <= TOL * scale, f"{fam} {ftype}: max |Δ logits| vs transformers {delta:.3g} (scale {scale:.3g})"
    # greedy on the same values: llama.cpp's text on the F32 file of the dequantized weights is
    # the engine's on the quantized import, token for token, up to a tie (the engine's top two
    # within TIE x the logit scale: rounding decides it). llama.cpp runs it with its KV cache in
    # f32 and without its flash attention: with its defaults (flash attention on the CPU, which
    # works in f16 whatever the cache) its first log-probabilities on a gpt-oss of hidden 512
    # and experts of 768 (Q4_0's values) lie up to 9e-3 from the engine's and turn a near-tie of
    # 1.4e-3 x the scale; an f16 cache alone, up to 5e-3; f32 without it, 1e-5 (llama-server's
    # log-probabilities, n_probs).
    tie = next((k for k, (r, _, _) in enumerate(same_values) if r), None)
    if tie is None:
        assert conts["values"].startswith(mine), (conts["values"], mine)
    else:
        assert same_values[tie][1] <= TIE * scale, (f"{fam} {ftype}: on the F32 values llama.cpp's token "
                                                    f"{tie} is the engine's #{same_values[tie][0] + 1}",
                                                    same_values, conts["values"], mine)
    # on the quantized file itself llama.cpp multiplies with 8-bit-quantized activations (Q8_0 /
    # Q8_K): its text is recorded (steps: rank and gap of each of its tokens among the engine's
    # logits), not asserted, since where it parts from the engine's is decided by its arithmetic
    # (its text on the same values as F32, above, is the engine's)


def test_grid_codebook_is_checked(models, tmp_path, monkeypatch):
    """A file of a grid type carries its codebook (codebook.<name>, int8 [entries, width]); the
    engine refuses it by name when the codebook is missing or is not ggml's grid (its CRC-32
    is checked before it is installed), and runs it otherwise: in fast mode on the int8 path,
    the int8 table this CPU picks giving the plain-C reference table's logits bit for bit (its
    int8 table alone where the CPU's table has an attention of its own)."""
    import re
    import struct
    import zlib

    from colibri_lab import ColibriFormatError, Engine

    m = models["qwen3_moe"]
    q = tmp_path / "iq2_xxs.gguf"
    im = synthetic_imatrix(m["f32"], tmp_path / "imatrix.dat", 73)
    r = subprocess.run([str(models["quantize"]), "--imatrix", str(im), str(m["f32"]), str(q), "IQ2_XXS"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    good = convert_gguf(q, tmp_path / "good.colibri", progress=False)
    info = fmt_reader.inspect(good, verify=True)
    books = {t.name: t for t in info.tensors if t.name.startswith("codebook.")}
    assert "codebook.iq2_xxs" in books, books
    cb = books["codebook.iq2_xxs"]
    assert cb.dtype == "i8" and tuple(cb.shape) == (256, 8)
    ids = list(range(3, 40))
    with Engine(good) as eng:
        exact = eng.forward(ids)
    with Engine(good, precision="fast") as eng:
        kernels = eng.config.kernels
        fast = eng.forward(ids)
    int8 = re.search(r"fast\(int8 ([\w-]+)", kernels)
    assert int8, kernels
    assert np.isfinite(exact).all() and np.isfinite(fast).all() and not np.array_equal(fast, exact)
    if ", attention " in kernels:
        monkeypatch.setenv("COLIBRI_FAST_KERNELS", int8[1])
        with Engine(good, precision="fast") as eng:
            fast = eng.forward(ids)
    monkeypatch.setenv("COLIBRI_FAST_KERNELS", "reference")
    with Engine(good, precision="fast") as eng:
        assert "fast(int8 reference," in eng.config.kernels, eng.config.kernels
        assert np.array_equal(fast, eng.forward(ids)), f"{int8[1]}: not the reference's bits"
    monkeypatch.delenv("COLIBRI_FAST_KERNELS")
    raw = bytearray(Path(good).read_bytes())

    bad = bytearray(raw)
    bad[cb.offset + 100] ^= 0x01                    # one entry changed
    (tmp_path / "bad.colibri").write_bytes(bytes(bad))
    with pytest.raises(ColibriFormatError, match="codebook.iq2_xxs.*not ggml's grid"):
        Engine(tmp_path / "bad.colibri")

    td = info.section("tensor_directory")            # the codebook renamed: the file lacks it
    gone = bytearray(raw)
    body = bytes(gone[td.offset:td.offset + td.size]).replace(b"codebook.iq2_xxs", b"codebook.iq2_xxz")
    gone[td.offset:td.offset + td.size] = body
    struct.pack_into("<I", gone, 56 + 24 + 16, zlib.crc32(body))
    struct.pack_into("<I", gone, 252, zlib.crc32(bytes(gone[:252])))
    (tmp_path / "gone.colibri").write_bytes(bytes(gone))
    with pytest.raises(ColibriFormatError, match="dtype iq2_xxs, whose codebook .*codebook.iq2_xxs.* lacks"):
        Engine(tmp_path / "gone.colibri")
