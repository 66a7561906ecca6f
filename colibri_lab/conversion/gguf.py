"""Import a llama.cpp GGUF file of a supported MoE family into a `.colibri` file
(docs/quantization.md, "GGUF import"; docs/format.md, "Version 2").

Supported: Mixtral (GGUF architecture `llama` with `llama.expert_count` > 0), `qwen2moe`,
`qwen3moe` and `olmoe` (read here), `deepseek2` and `gpt-oss` (gguf_arch.ARCH_IMPORTERS),
with tensors in F32, F16, BF16, Q8_0, Q4_K, Q5_K or Q6_K (GGUF
file types f32, f16, bf16, q8_0, q4_K_S/M, q5_K_S/M, q6_K). Any other tensor type is
refused by name.

Nothing is requantized: every weight's bytes are copied as the GGUF stores them (the
format's quantized dtypes are ggml's blocks byte for byte). Rows may be reordered:

* llama.cpp's converter permutes the rows of the `llama` architecture's q and k
  projections (`LlamaModel.permute`, for ggml's interleaved RoPE); the importer undoes the
  permutation by moving whole rows, so colibri's rotate-half RoPE sees the Hugging Face
  order. `qwen2moe`, `qwen3moe` and `olmoe` are not permuted by the converter.
* fused tensors (`attn_qkv`, `ffn_gate_up_exps`) are split by rows, and llama.cpp's old
  per-expert tensors (`blk.N.ffn_gate.E.weight`) are concatenated.

The FFNs are written in the split form of format version 2 (`blk.N.ffn_gate_exps` ...)
with each tensor's GGUF dtype; 1-D tensors (norm weights, biases) are stored as f32; a
router (`ffn_gate_inp`) keeps an f32/f16/bf16 dtype and is dequantized to f32 when the
GGUF has it quantized (said on the progress output).

The hyper-parameters and the family options come from the GGUF metadata and from which
tensors exist (biases, q/k norms and their shapes, dense layers, shared experts); the
tokenizer section is rebuilt from the GGUF vocabulary (`tokenizer.ggml.*`) with the same
builders the Hugging Face converter uses (`spm`, `bpe`), fed with a faithful
reconstruction of the `tokenizer.model` / `tokenizer.json` the GGUF was made from.

Streaming: the GGUF is memory-mapped (`gguf.GGUFReader`) and each tensor is copied in
row chunks by `convert.write_colibri`; peak memory is a few chunks.

Entry point: `convert_gguf(gguf_path, output_path, max_seq_len=None, progress=True)`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import tempfile
import warnings
from collections import Counter

import numpy as np

from ..format import spec as fmt
from ..format.spec import DTYPE_F32, LAYOUT_ROW_MAJOR, MetaValue
from .gguf_arch import ARCH_IMPORTERS
from .gguf_file import (
    _FLOAT_TYPES,
    _SUPPORTED_LIST,
    SUPPORTED_GGML_TYPES,
    Chunk,
    GgufFile,
    GTensor,
    Rows,
    _check_type,
    _copy_producer,
    _dequantize,
    _f32_producer,
    _f32_value,
    _int,
)
from .spec import ConversionError, ModelSpec, PlannedTensor, _version
from .tokenizer import _no_tokenizer, _tokenizer_meta_entries, end_ids_entry
from .writer import _Say, family_metadata, spec_metadata, write_colibri

__all__ = ["convert_gguf", "GGUF_ARCHITECTURES", "SUPPORTED_GGML_TYPES"]

IMPORTER_NAME = "colibri_lab.conversion.gguf"

# GGUF general.architecture -> colibri family
GGUF_ARCHITECTURES = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
                      "olmoe": "olmoe"}
# Whether the routed top-k weights are renormalised when the GGUF says nothing
# (`{arch}.expert_weights_norm` absent): what llama.cpp's graph for the architecture does
# (src/models/*.cpp pass norm_w = true for llama and qwen3moe, false for qwen2moe and olmoe;
# Mixtral always normalises; transformers' Qwen3-MoE checkpoints set norm_topk_prob true).
DEFAULT_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}

# tokenizer.ggml.pre -> (pre-tokenizer pattern name, NFC normalizer, ignore_merges).
# The pattern names are colibri_lab.conversion.bpe's; NFC: every Qwen tokenizer.json normalises with
# NFC, which the GGUF does not record; ignore_merges: Llama-3's tokenizer.json sets it, and
# llama.cpp sets it for these pre-tokenizers.
BPE_PRE_TOKENIZERS = {
    "qwen2": ("qwen2", True, False),
    "deepseek-r1-qwen": ("qwen2", True, False),
    "gpt-2": ("gpt2", False, False),
    "olmo": ("gpt2", False, False),
    "llama3": ("llama3", False, True),
    "llama-v3": ("llama3", False, True),
    "llama-bpe": ("llama3", False, True),
    # gpt-oss (o200k): llama.cpp's GPT4O regex, tiktoken's pattern; no normalizer
    "gpt-4o": ("o200k", False, False),
    # DeepSeek-V3 / R1: three splits in sequence (bpe.DEEPSEEK_V3_SPLITS); no normalizer
    "deepseek-v3": ("deepseek_v3", False, False),
    # DeepSeek-LLM / DeepSeek-V2: six splits in sequence (bpe.DEEPSEEK_LLM_SPLITS); no normalizer
    "deepseek-llm": ("deepseek_llm", False, False),
    # Kimi-K2 (a deepseek2 file): tokenization_kimi.py's tiktoken pattern (bpe.KIMI_K2_PATTERN);
    # ignore_merges as tiktoken (a whole pre-token that is a token stays one)
    "kimi-k2": ("kimi_k2", False, True),
    # llama.cpp's fallback, for a file that names it or names no pre-tokenizer (GGUFs made
    # before tokenizer.ggml.pre existed): four splits in sequence (bpe.LLAMA_DEFAULT_SPLITS)
    "default": ("llama_default", False, False),
}
# Pre-tokenizers llama.cpp knows that colibri's tokenizer has no kind for: refused by name
# with what they are (the weights can still be imported with tokenizer='none').
UNSUPPORTED_PRE_TOKENIZERS = {
    "deepseek-coder": "DeepSeek-Coder's regex sequence",
}

# llama.cpp token types (llama_token_type), the same numbers as sentencepiece's piece types
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6
LLAMA_CPP_ADDED_SCORE = -1000.0   # the score llama.cpp's converter gives added/control tokens


def _read_spec(g: GgufFile, arch: str) -> tuple[ModelSpec, dict]:
    """ModelSpec from the metadata and the tensors present; plus layer facts for planning."""
    A = arch
    L = _int(g, f"{A}.block_count")
    H = _int(g, f"{A}.embedding_length")
    nh = _int(g, f"{A}.attention.head_count")
    nkv = _int(g, f"{A}.attention.head_count_kv", nh)
    E = _int(g, f"{A}.expert_count", 0, minimum=0)
    if E == 0:
        raise ConversionError(f"{g.path}: {A}.expert_count is 0 or missing: a dense model; colibri "
                              "runs Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)")
    k = _int(g, f"{A}.expert_used_count")
    if k > E:
        raise ConversionError(f"{g.path}: {A}.expert_used_count {k} > expert_count {E}")
    if nh % nkv:
        raise ConversionError(f"{g.path}: head_count {nh} is not a multiple of head_count_kv {nkv}")

    emb = g.tensor("token_embd.weight")
    if len(emb.shape) != 2 or emb.shape[1] != H:
        raise ConversionError(f"{g.path}: token_embd.weight has shape {list(emb.shape)}, expected "
                              f"[vocab, {H}]")
    V = emb.shape[0]

    # head_dim: attention.key_length, else the q projection's rows / heads, else H / heads
    hd = g.get(f"{A}.attention.key_length")
    if hd is None and g.has("blk.0.attn_q.weight"):
        q_rows = g.tensors["blk.0.attn_q.weight"].shape[0]
        hd = q_rows // nh if q_rows % nh == 0 else None
    elif hd is None:
        hd = H // nh if H % nh == 0 else None
    if hd is None:
        raise ConversionError(f"{g.path}: cannot tell the head dimension ({A}.attention.key_length "
                              "is missing)")
    hd = int(hd)
    vl = g.get(f"{A}.attention.value_length")
    if vl is not None and int(vl) != hd:
        raise ConversionError(f"{g.path}: value_length {vl} != key_length {hd}; colibri needs "
                              "equal key and value head sizes")
    if hd % 2:
        raise ConversionError(f"{g.path}: head dimension {hd} is odd; RoPE needs an even one")
    rd = g.get(f"{A}.rope.dimension_count")
    if rd is not None and int(rd) != hd:
        raise ConversionError(f"{g.path}: {A}.rope.dimension_count {rd} != head dimension {hd}: "
                              "partial rotary embeddings are not implemented")
    rst = g.get(f"{A}.rope.scaling.type")
    if rst not in (None, "none"):
        raise ConversionError(f"{g.path}: {A}.rope.scaling.type {rst!r}; colibri implements only "
                              "the default (unscaled) RoPE")
    for key in (f"{A}.rope.scaling.factor",):
        v = g.get(key)
        if v not in (None, 0.0, 1.0):
            raise ConversionError(f"{g.path}: {key} = {v}; colibri implements only unscaled RoPE")
    if g.has("rope_freqs.weight"):
        raise ConversionError(f"{g.path}: the file has rope_freqs.weight (Llama-3 style scaled "
                              "RoPE), which colibri does not implement")
    for key in (f"{A}.attention.sliding_window_pattern", f"{A}.rope.freq_base_swa"):
        if key in g.fields:
            raise ConversionError(f"{g.path}: {key} is set; per-layer sliding windows are not "
                                  "imported from GGUF")

    theta = g.get(f"{A}.rope.freq_base", 10000.0)   # llama.cpp's default
    eps = g.get(f"{A}.attention.layer_norm_rms_epsilon")
    if eps is None:
        raise ConversionError(f"{g.path}: {A}.attention.layer_norm_rms_epsilon is missing (colibri "
                              "runs RMSNorm models)")
    ctx = _int(g, f"{A}.context_length")
    sw = g.get(f"{A}.attention.sliding_window")
    sw = 0 if sw is None else int(sw)
    norm_topk = g.get(f"{A}.expert_weights_norm")
    norm_topk = DEFAULT_NORM_TOPK[A] if norm_topk is None else bool(norm_topk)
    if A == "llama" and not norm_topk:
        raise ConversionError(f"{g.path}: llama.expert_weights_norm is false; Mixtral always "
                              "renormalises the chosen experts' weights")
    gating = g.get(f"{A}.expert_gating_func")
    if gating not in (None, 1):   # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX = 1
        raise ConversionError(f"{g.path}: {A}.expert_gating_func {gating}; colibri routes with a "
                              "softmax")
    scale = g.get(f"{A}.expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ConversionError(f"{g.path}: {A}.expert_weights_scale {scale}; colibri does not "
                              "scale the routed experts' weights")

    # ---- layers: MoE or dense, expert widths, shared experts
    layer_ffn, widths, dense_w, shared_w, shared_gate = [], set(), set(), set(), []
    for n in range(L):
        b = f"blk.{n}"
        if g.has(f"{b}.ffn_gate_inp.weight"):
            layer_ffn.append(1)
            if g.has(f"{b}.ffn_gate_exps.weight"):
                widths.add(g.tensors[f"{b}.ffn_gate_exps.weight"].shape[1])
            elif g.has(f"{b}.ffn_gate_up_exps.weight"):
                widths.add(g.tensors[f"{b}.ffn_gate_up_exps.weight"].shape[1] // 2)
            elif g.has(f"{b}.ffn_gate.0.weight"):
                widths.add(g.tensors[f"{b}.ffn_gate.0.weight"].shape[0])
            else:
                raise ConversionError(f"{g.path}: layer {n} has a router but no expert tensors "
                                      f"({b}.ffn_gate_exps.weight)")
            if g.has(f"{b}.ffn_gate_shexp.weight"):
                shared_w.add(g.tensors[f"{b}.ffn_gate_shexp.weight"].shape[0])
            else:
                shared_w.add(0)
            shared_gate.append(g.has(f"{b}.ffn_gate_inp_shexp.weight"))
        elif g.has(f"{b}.ffn_gate.weight"):
            layer_ffn.append(0)
            dense_w.add(g.tensors[f"{b}.ffn_gate.weight"].shape[0])
        else:
            raise ConversionError(f"{g.path}: layer {n} has neither a router "
                                  f"({b}.ffn_gate_inp.weight) nor a dense FFN ({b}.ffn_gate.weight)")
    if not any(layer_ffn):
        raise ConversionError(f"{g.path}: no layer is a Mixture-of-Experts block")
    if len(widths) != 1:
        raise ConversionError(f"{g.path}: the experts' widths differ between layers "
                              f"({sorted(widths)}); colibri needs one")
    I = widths.pop()
    want_I = g.get(f"{A}.expert_feed_forward_length") if A in ("qwen2moe", "qwen3moe") else \
        g.get(f"{A}.feed_forward_length")
    if isinstance(want_I, list):
        want_I = want_I[0] if len(set(want_I)) == 1 else None
    if want_I is not None and int(want_I) != I:
        raise ConversionError(f"{g.path}: the expert tensors are {I} wide but the metadata says "
                              f"{want_I}")
    if len(shared_w) > 1:
        raise ConversionError(f"{g.path}: some MoE layers have a shared expert and others not, or "
                              f"with different widths ({sorted(shared_w)})")
    Is = shared_w.pop() if shared_w else 0
    if any(shared_gate) and (not all(shared_gate) or Is == 0):
        raise ConversionError(f"{g.path}: shared-expert gates (ffn_gate_inp_shexp) on only some "
                              "layers, or without a shared expert")
    if len(dense_w) > 1:
        raise ConversionError(f"{g.path}: the dense layers' widths differ ({sorted(dense_w)})")
    Id = dense_w.pop() if dense_w else 0

    # ---- attention options, from which tensors exist
    qkv_bias = g.has("blk.0.attn_q.bias") or g.has("blk.0.attn_qkv.bias")
    out_bias = g.has("blk.0.attn_output.bias")
    qk = "none"
    if g.has("blk.0.attn_q_norm.weight"):
        nqn = g.tensors["blk.0.attn_q_norm.weight"].shape[-1]
        if nqn == hd and nqn != nh * hd:
            qk = "head"
        elif nqn == nh * hd and nqn != hd:
            qk = "full"
        elif nqn == hd:   # one head: both readings are the same numbers
            qk = "full" if A == "olmoe" else "head"
        else:
            raise ConversionError(f"{g.path}: blk.0.attn_q_norm.weight has {nqn} values: neither "
                                  f"the head dimension {hd} nor the q projection {nh * hd}")
    clip = g.get(f"{A}.attention.clamp_kqv")
    clip = 0.0 if clip is None else _f32_value(clip)
    if clip < 0 or not math.isfinite(clip):
        raise ConversionError(f"{g.path}: {A}.attention.clamp_kqv {clip} must be positive")

    fam = GGUF_ARCHITECTURES[A]
    spec = ModelSpec(
        vocab_size=V, hidden_size=H, intermediate_size=I, n_layers=L, n_heads=nh, n_kv_heads=nkv,
        head_dim=hd, n_experts=E, top_k=k, rms_norm_eps=_f32_value(eps),
        rope_theta=_f32_value(theta), max_position_embeddings=ctx, sliding_window=sw,
        tie_word_embeddings=not g.has("output.weight"), architecture=fam,
        norm_topk_prob=norm_topk, layer_ffn=tuple(layer_ffn) if not all(layer_ffn) else (),
        dense_intermediate_size=Id, shared_expert_intermediate_size=Is,
        shared_expert_gate=bool(shared_gate) and all(shared_gate), attn_qkv_bias=qkv_bias,
        attn_output_bias=out_bias, attn_qk_norm=qk, clip_qkv=clip)
    for name in ("hidden_size", "intermediate_size", "vocab_size", "n_layers", "n_experts",
                 "dense_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(spec, name) > fmt.U32_MAX:
            raise ConversionError(f"{g.path}: {name} does not fit the format's u32")
    return spec, {"permuted": A == "llama"}


# --------------------------------------------------------------------------- producers

def _unpermute_index(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's LlamaModel.permute(w, n_head): GGUF row
    h*hd + 2*i + j holds Hugging Face row h*hd + j*hd/2 + i (j in {0, 1}, i < hd/2)."""
    if rows % (2 * n_head):
        raise ConversionError(f"internal: {rows} rows do not split into {n_head} heads of pairs")
    return (np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1))


# --------------------------------------------------------------------------- planning

def _plan(g: GgufFile, s: ModelSpec, facts: dict, say) -> tuple[list[PlannedTensor], str]:
    """Every tensor of the output in file order (as convert.plan_tensors), and the router
    dtype name for model.router_dtype."""
    V, H, I, E, L = s.vocab_size, s.hidden_size, s.intermediate_size, s.n_experts, s.n_layers
    Id, Is = s.dense_intermediate_size, s.shared_expert_intermediate_size
    nq, nkv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    D, R, X = fmt.SECTION_DENSE, fmt.SECTION_ROUTER, fmt.SECTION_EXPERTS
    permuted = facts["permuted"]
    out: list[PlannedTensor] = []

    def add_copy(name: str, parts: list[Rows], shape: tuple[int, ...], section: int) -> None:
        tn = parts[0].t.type_name
        for p in parts:
            _check_type(p.t)
            if p.t.type_name != tn:
                raise ConversionError(f"{name}: its GGUF parts have different types "
                                      f"({p.t.type_name}, {tn})")
        if sum(p.count for p in parts) != math.prod(shape[:-1]):
            raise ConversionError(f"internal: {name} rows do not add up")
        out.append(PlannedTensor(name, SUPPORTED_GGML_TYPES[tn], LAYOUT_ROW_MAJOR, shape, section,
                                 _copy_producer(parts, tn, shape[-1])))

    def add_f32(name: str, parts: list[Rows], shape: tuple[int, ...], section: int = D) -> None:
        for p in parts:
            _check_type(p.t)
        out.append(PlannedTensor(name, DTYPE_F32, LAYOUT_ROW_MAJOR, shape, section,
                                 _f32_producer(parts, shape[-1])))

    def vec(name: str, n: int, gname: str | None = None, index: np.ndarray | None = None) -> None:
        """A 1-D tensor (norm weight, bias), always f32."""
        t = g.tensor(gname or name)
        if t.shape not in ((n,), (1, n)):
            raise ConversionError(f"{g.path}: tensor {t.name} has shape {list(t.shape)}, expected "
                                  f"[{n}]")
        if index is not None:   # a permuted bias: reorder its values (one value per "row")
            col = GTensor(t.name, t.type_name, (n, 1), t.raw.reshape(n, -1))
            out.append(PlannedTensor(name, DTYPE_F32, LAYOUT_ROW_MAJOR, (n,), D,
                                     _f32_producer([Rows(col, index=index)], 1)))
            _check_type(t)
            return
        add_f32(name, [Rows(t)], (n,))

    def mat(name: str, shape: tuple[int, ...], gname: str | None = None,
            index: np.ndarray | None = None, section: int = D) -> None:
        t = g.tensor(gname or name, shape)
        add_copy(name, [Rows(t, index=index)], shape, section)

    def qkv_parts(n: int):
        """(q rows, k rows, v rows) of layer n: separate tensors or a fused attn_qkv."""
        b = f"blk.{n}"
        qi = _unpermute_index(nq, s.n_heads) if permuted else None
        ki = _unpermute_index(nkv, s.n_kv_heads) if permuted else None
        if g.has(f"{b}.attn_qkv.weight"):
            t = g.tensor(f"{b}.attn_qkv.weight", (nq + 2 * nkv, H))
            q = Rows(t, index=qi) if qi is not None else Rows(t, 0, nq)
            k = Rows(t, index=nq + ki) if ki is not None else Rows(t, nq, nkv)
            return q, k, Rows(t, nq + nkv, nkv)
        return (Rows(g.tensor(f"{b}.attn_q.weight", (nq, H)), index=qi),
                Rows(g.tensor(f"{b}.attn_k.weight", (nkv, H)), index=ki),
                Rows(g.tensor(f"{b}.attn_v.weight", (nkv, H))))

    qk_n = {"none": None, "head": (s.head_dim, s.head_dim), "full": (nq, nkv)}[s.attn_qk_norm]
    mat("token_embd.weight", (V, H))
    for n in range(L):
        b = f"blk.{n}"
        for what, has, names in (("q/k/v", s.attn_qkv_bias, ("attn_q", "attn_k", "attn_v",
                                                              "attn_qkv")),
                                 ("output", s.attn_output_bias, ("attn_output",))):
            present = [x for x in names if g.has(f"{b}.{x}.bias")]
            if not has and present:
                raise ConversionError(f"{g.path}: layer {n} has {what} biases but layer 0 has "
                                      "none; colibri runs one attention for all layers")
        if qk_n is None and (g.has(f"{b}.attn_q_norm.weight") or g.has(f"{b}.attn_k_norm.weight")):
            raise ConversionError(f"{g.path}: layer {n} has q/k norms but layer 0 has none")
        vec(f"{b}.attn_norm.weight", H)
        q, k, v = qkv_parts(n)
        add_copy(f"{b}.attn_q.weight", [q], (nq, H), D)
        add_copy(f"{b}.attn_k.weight", [k], (nkv, H), D)
        add_copy(f"{b}.attn_v.weight", [v], (nkv, H), D)
        if s.attn_qkv_bias:
            qi = _unpermute_index(nq, s.n_heads) if permuted else None
            ki = _unpermute_index(nkv, s.n_kv_heads) if permuted else None
            if g.has(f"{b}.attn_qkv.bias"):
                t = g.tensor(f"{b}.attn_qkv.bias")
                if t.shape != (nq + 2 * nkv,):
                    raise ConversionError(f"{g.path}: {t.name} has shape {list(t.shape)}")
                col = GTensor(t.name, t.type_name, (nq + 2 * nkv, 1), t.raw.reshape(nq + 2 * nkv, -1))
                for name, rows in ((f"{b}.attn_q.bias", Rows(col, index=qi) if qi is not None
                                    else Rows(col, 0, nq)),
                                   (f"{b}.attn_k.bias", Rows(col, index=nq + ki) if ki is not None
                                    else Rows(col, nq, nkv)),
                                   (f"{b}.attn_v.bias", Rows(col, nq + nkv, nkv))):
                    _check_type(t)
                    out.append(PlannedTensor(name, DTYPE_F32, LAYOUT_ROW_MAJOR, (rows.count,), D,
                                             _f32_producer([rows], 1)))
            else:
                vec(f"{b}.attn_q.bias", nq, index=qi)
                vec(f"{b}.attn_k.bias", nkv, index=ki)
                vec(f"{b}.attn_v.bias", nkv)
        if qk_n is not None:
            vec(f"{b}.attn_q_norm.weight", qk_n[0])
            vec(f"{b}.attn_k_norm.weight", qk_n[1])
        mat(f"{b}.attn_output.weight", (H, nq))
        if s.attn_output_bias:
            vec(f"{b}.attn_output.bias", H)
        vec(f"{b}.ffn_norm.weight", H)
    vec("output_norm.weight", H)
    if not s.tie_word_embeddings:
        mat("output.weight", (V, H))

    # ---- routers (and shared-expert gates)
    routers = [g.tensor(f"blk.{n}.ffn_gate_inp.weight", (E, H)) for n in range(L) if s.is_moe(n)]
    for t in routers:
        _check_type(t)
    kinds = {t.type_name for t in routers}
    if len(kinds) == 1 and kinds <= set(_FLOAT_TYPES):
        rname = kinds.pop().lower()
    else:
        rname = "f32"
        say(f"note: routers stored as {', '.join(sorted(kinds))} in the GGUF; written as f32 "
            "(colibri keeps routers in f32/f16/bf16: dequantized, not requantized)")
    ri = iter(routers)
    for n in range(L):
        if not s.is_moe(n):
            continue
        t = next(ri)
        name = f"blk.{n}.ffn_gate_inp.weight"
        if rname == "f32" and t.type_name != "F32":
            add_f32(name, [Rows(t)], (E, H), R)
        else:
            add_copy(name, [Rows(t)], (E, H), R)
        if s.shared_expert_gate:
            t = g.tensor(f"blk.{n}.ffn_gate_inp_shexp.weight")
            if t.shape not in ((H,), (1, H)):
                raise ConversionError(f"{g.path}: {t.name} has shape {list(t.shape)}, expected [{H}]")
            gt = GTensor(t.name, t.type_name, (1, H), t.raw.reshape(1, -1))
            _check_type(t)
            if t.type_name in _FLOAT_TYPES:
                add_copy(f"blk.{n}.ffn_shared_gate.weight", [Rows(gt)], (1, H), R)
            else:
                add_f32(f"blk.{n}.ffn_shared_gate.weight", [Rows(gt)], (1, H), R)

    # ---- FFNs, split form (format version 2)
    def split3(names: tuple[str, str, str], gate: list[Rows], up: list[Rows], down: list[Rows],
               shapes: tuple) -> None:
        for p in gate + up + down:
            _check_type(p.t)
        gt, ut = gate[0].t.type_name, up[0].t.type_name
        if gt != ut:
            raise ConversionError(f"{g.path}: {names[0]} is {gt} but {names[1]} is {ut}; colibri "
                                  "needs the gate and up projections of an FFN in one dtype "
                                  "(re-quantize the GGUF with llama-quantize, or use another file)")
        for name, parts, shape in zip(names, (gate, up, down), shapes):
            add_copy(name, parts, shape, X)

    for n in range(L):
        b = f"blk.{n}"
        if not s.is_moe(n):
            split3((f"{b}.ffn_gate", f"{b}.ffn_up", f"{b}.ffn_down"),
                   [Rows(g.tensor(f"{b}.ffn_gate.weight", (Id, H)))],
                   [Rows(g.tensor(f"{b}.ffn_up.weight", (Id, H)))],
                   [Rows(g.tensor(f"{b}.ffn_down.weight", (H, Id)))],
                   ((Id, H), (Id, H), (H, Id)))
            continue
        shapes = ((E, I, H), (E, I, H), (E, H, I))
        names = (f"{b}.ffn_gate_exps", f"{b}.ffn_up_exps", f"{b}.ffn_down_exps")
        if g.has(f"{b}.ffn_gate_exps.weight") or g.has(f"{b}.ffn_gate_up_exps.weight"):
            if g.has(f"{b}.ffn_gate_up_exps.weight"):
                t = g.tensor(f"{b}.ffn_gate_up_exps.weight", (E, 2 * I, H))
                gate = [Rows(t, e * 2 * I, I) for e in range(E)]
                up = [Rows(t, e * 2 * I + I, I) for e in range(E)]
            else:
                gate = [Rows(g.tensor(f"{b}.ffn_gate_exps.weight", (E, I, H)))]
                up = [Rows(g.tensor(f"{b}.ffn_up_exps.weight", (E, I, H)))]
            down = [Rows(g.tensor(f"{b}.ffn_down_exps.weight", (E, H, I)))]
        else:   # llama.cpp's old per-expert tensors: blk.N.ffn_gate.E.weight
            gate = [Rows(g.tensor(f"{b}.ffn_gate.{e}.weight", (I, H))) for e in range(E)]
            up = [Rows(g.tensor(f"{b}.ffn_up.{e}.weight", (I, H))) for e in range(E)]
            down = [Rows(g.tensor(f"{b}.ffn_down.{e}.weight", (H, I))) for e in range(E)]
        split3(names, gate, up, down, shapes)
        if Is > 0:
            split3((f"{b}.ffn_gate_shexp", f"{b}.ffn_up_shexp", f"{b}.ffn_down_shexp"),
                   [Rows(g.tensor(f"{b}.ffn_gate_shexp.weight", (Is, H)))],
                   [Rows(g.tensor(f"{b}.ffn_up_shexp.weight", (Is, H)))],
                   [Rows(g.tensor(f"{b}.ffn_down_shexp.weight", (H, Is)))],
                   ((Is, H), (Is, H), (H, Is)))
    return out, rname


# --------------------------------------------------------------------------- tokenizer

def _pb_varint(v: int) -> bytes:
    v &= (1 << 64) - 1   # int32 / int64 negatives: 10-byte two's complement, as protobuf
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _pb_key(field: int, wire: int) -> bytes:
    return _pb_varint((field << 3) | wire)


def _pb_bytes(field: int, data: bytes) -> bytes:
    return _pb_key(field, 2) + _pb_varint(len(data)) + data


def _pb_int(field: int, v: int) -> bytes:
    return _pb_key(field, 0) + _pb_varint(int(v))


def _sentencepiece_proto(tokens: list[str], scores: list[float], types: list[int], *,
                         unk: int, bos: int, eos: int, pad: int, add_dummy_prefix: bool,
                         remove_extra_whitespaces: bool, byte_fallback: bool) -> bytes:
    """A serialized sentencepiece ModelProto (BPE, identity normalizer) of the pieces: what
    colibri_lab.conversion.spm reads from a tokenizer.model. Special pieces are named by the trainer
    spec's *_piece fields, as sentencepiece's bos_id() & co. look them up."""
    out = bytearray()
    for s, sc, t in zip(tokens, scores, types):
        rec = _pb_bytes(1, s.encode("utf-8")) + _pb_key(2, 5) + struct.pack("<f", sc) + _pb_int(3, t)
        out += _pb_bytes(1, rec)

    def piece(i: int, default: str) -> bytes:
        # an id that is not a piece of the right type names no piece: sentencepiece then
        # reports -1, as for the original model
        return (tokens[i] if 0 <= i < len(tokens) else "\x01<none>").encode("utf-8") \
            if i is not None else default.encode("utf-8")

    trainer = (_pb_int(3, 2) + _pb_int(4, len(tokens)) + _pb_int(35, int(byte_fallback))
               + _pb_bytes(45, piece(unk, "<unk>")) + _pb_bytes(46, piece(bos, "<s>"))
               + _pb_bytes(47, piece(eos, "</s>")) + _pb_bytes(48, piece(pad, "<pad>")))
    normalizer = (_pb_bytes(1, b"identity") + _pb_int(3, int(add_dummy_prefix))
                  + _pb_int(4, int(remove_extra_whitespaces)) + _pb_int(5, 1))
    return bytes(out + _pb_bytes(2, trainer) + _pb_bytes(3, normalizer))


def _trim_padding(tokens: list[str], types: list[int]) -> int:
    """Number of tokens without llama.cpp's trailing "[PAD{i}]" fillers (UNUSED tokens the
    converter appends up to the model's vocab_size; the tokenizer never had them)."""
    n = len(tokens)
    while n > 1 and types[n - 1] == TT_UNUSED and tokens[n - 1].startswith("[PAD") \
            and tokens[n - 1].endswith("]"):
        n -= 1
    return n


def _gguf_tokenizer(g: GgufFile, say, tokenizer: str) -> tuple[bytes, dict]:
    """(tokenizer section, tokenizer metadata) rebuilt from the GGUF's tokenizer.ggml.*."""
    none = _no_tokenizer(tokenizer, say)
    if tokenizer == "none":
        return b"", none
    model = g.get("tokenizer.ggml.model")
    if model in (None, "none", "no_vocab"):
        say(f"note: {g.path} holds no tokenizer; writing a file without one (the engine then "
            "runs on token ids only)")
        return b"", none
    tokens = g.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ConversionError(f"{g.path}: tokenizer.ggml.model is {model!r} but there is no "
                              "tokenizer.ggml.tokens list")
    types = g.get("tokenizer.ggml.token_type") or [TT_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ConversionError(f"{g.path}: tokenizer.ggml.token_type has {len(types)} entries for "
                              f"{len(tokens)} tokens")
    hint = ". To import the weights anyway, without a tokenizer, pass tokenizer='none'"
    try:
        with tempfile.TemporaryDirectory(prefix="colibri-gguf-tok-") as tmp:
            if model == "llama":
                data, info = _spm_section(g, tokens, types, tmp)
            elif model == "gpt2":
                data, info = _bpe_section(g, tokens, types, tmp)
            else:
                raise ConversionError(f"{g.path}: tokenizer.ggml.model {model!r} is not supported "
                                      "(supported: 'llama' = SentencePiece BPE, 'gpt2' = "
                                      "byte-level BPE)")
    except ConversionError as e:
        raise ConversionError(f"{e}{hint}") from None
    except ValueError as e:   # the section builders' refusals
        raise ConversionError(f"{g.path}: the GGUF tokenizer cannot be stored: {e}{hint}") from None
    meta = {k: v for k, v in info.items() if k.startswith("tokenizer.")}
    say(f"tokenizer: {info.get('n_pieces')} pieces, type {meta['tokenizer.type']} (from the GGUF "
        "metadata)")
    tpl = g.get("tokenizer.chat_template")
    if isinstance(tpl, str) and tpl and "\x00" not in tpl:
        meta["tokenizer.chat_template"] = tpl
        say(f"chat template: {len(tpl):,} characters from tokenizer.chat_template")
    meta.update(end_ids_entry(gguf_end_ids(g), meta["tokenizer.eos_id"], info.get("n_pieces"),
                              "the GGUF's end-of-generation tokens", say))
    return bytes(data), meta


# The token texts llama.cpp's vocabulary loader counts as end of generation, whatever their
# ids (src/llama-vocab.cpp, special_eog_ids)
LLAMA_END_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})


# The texts by which llama.cpp finds the FIM pad / repeat / separator tokens a GGUF does not
# name (src/llama-vocab.cpp); they too end its generations
LLAMA_FIM_TEXTS = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
                   "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
                   "fim_sep": ("<|file_sep|>",)}


def gguf_end_ids(g: GgufFile | str) -> list[int]:
    """The ids after which llama.cpp ends a generation on this GGUF (its end-of-generation
    set, which it also bans under --ignore-eos): the file's EOS, EOT and EOM ids, its FIM
    pad/repeat/separator ids (named, else found by LLAMA_FIM_TEXTS), and every token whose text
    is in LLAMA_END_TEXTS, less "<|end|>" where "<|return|>" and "<|call|>" (or "<|calls|>" and
    "<|flush|>") are there too (gpt-oss ends a message with <|end|> and goes on). In id order,
    each once."""
    if isinstance(g, str):
        g = GgufFile(g)
    tokens = g.get("tokenizer.ggml.tokens") or []
    n = len(tokens)
    ids = set()
    for k in ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep"):
        v = g.get(f"tokenizer.ggml.{k}_token_id")
        if v is not None and 0 <= int(v) < n:
            ids.add(int(v))
        elif k in LLAMA_FIM_TEXTS:
            ids.update(i for i, t in enumerate(tokens) if t in LLAMA_FIM_TEXTS[k])
    ids.update(i for i, t in enumerate(tokens) if t in LLAMA_END_TEXTS)
    texts = {tokens[i] for i in ids}
    if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
        ids.discard(tokens.index("<|end|>"))
    return sorted(ids)


def _special(g: GgufFile, name: str, n: int) -> int | None:
    v = g.get(f"tokenizer.ggml.{name}_token_id")
    if v is None:
        return None
    v = int(v)
    return v if 0 <= v < n else None


def _spm_section(g: GgufFile, tokens: list[str], types: list[int], tmp: str):
    """SentencePiece BPE (tokenizer.ggml.model 'llama'): a tokenizer.model rebuilt from the
    pieces, scores and types, for colibri_lab.conversion.spm.

    Reconstruction (llama.cpp's converter writes sentencepiece's pieces, scores and types,
    then marks the tokens of tokenizer_config.json's added_tokens_decoder CONTROL or
    USER_DEFINED with the score -1000): the unknown piece (tokenizer.ggml.unknown_token_id,
    else the one UNKNOWN token, else id 0 as llama.cpp) is typed UNKNOWN again; special
    pieces (control, unknown, user-defined) get sentencepiece's score 0 back where llama.cpp
    wrote -1000; trailing "[PAD{i}]" fillers are dropped. Normalizer: identity, a dummy
    prefix unless tokenizer.ggml.add_space_prefix is false, extra whitespace kept unless
    tokenizer.ggml.remove_extra_whitespaces (llama.cpp's defaults); byte fallback when the
    vocabulary has byte pieces."""
    from .spm import build_tokenizer_section

    if g.get("tokenizer.ggml.precompiled_charsmap"):
        raise ConversionError(f"{g.path}: the SentencePiece normalizer has a precompiled "
                              "character map; only the identity normalizer is implemented")
    scores = g.get("tokenizer.ggml.scores")
    if scores is None:
        scores = [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise ConversionError(f"{g.path}: tokenizer.ggml.scores has {len(scores)} entries for "
                              f"{len(tokens)} tokens")
    n = _trim_padding(tokens, types)
    tokens, types = list(tokens[:n]), [int(t) for t in types[:n]]
    scores = [float(x) for x in scores[:n]]
    unk = _special(g, "unknown", n)
    if unk is None:
        unk_typed = [i for i, t in enumerate(types) if t == TT_UNKNOWN]
        unk = unk_typed[0] if len(unk_typed) == 1 else 0
    for i, t in enumerate(types):
        if t == TT_UNKNOWN and i != unk:
            types[i] = TT_CONTROL
    types[unk] = TT_UNKNOWN
    for i, t in enumerate(types):
        if t in (TT_CONTROL, TT_UNKNOWN, TT_USER_DEFINED) and scores[i] == LLAMA_CPP_ADDED_SCORE:
            scores[i] = 0.0
    bad = [t for t in set(types) if t not in (1, 2, 3, 4, 5, 6)]
    if bad:
        raise ConversionError(f"{g.path}: unknown token types {sorted(bad)}")
    proto = _sentencepiece_proto(
        tokens, scores, types, unk=unk, bos=_special(g, "bos", n), eos=_special(g, "eos", n),
        pad=_special(g, "padding", n),
        add_dummy_prefix=bool(g.get("tokenizer.ggml.add_space_prefix", True)),
        remove_extra_whitespaces=bool(g.get("tokenizer.ggml.remove_extra_whitespaces", False)),
        byte_fallback=TT_BYTE in types)
    path = os.path.join(tmp, "tokenizer.model")
    with open(path, "wb") as f:
        f.write(proto)
    try:
        data, info = build_tokenizer_section(path)
    except ValueError as e:
        raise ValueError(str(e).replace(path, "the rebuilt tokenizer.model")) from None
    return data, info


def _bpe_section(g: GgufFile, tokens: list[str], types: list[int], tmp: str):
    """Byte-level BPE (tokenizer.ggml.model 'gpt2'): a tokenizer.json rebuilt from the tokens,
    merges, token types and tokenizer.ggml.pre, for colibri_lab.conversion.bpe.

    Reconstruction: CONTROL tokens are special added tokens, USER_DEFINED ones non-special
    added tokens, both matched in the raw text (normalized false: llama.cpp splits them off
    before anything else; Qwen's and Llama-3's tokenizer.json say so too); an added token is
    also in the BPE vocabulary when it is spelled in the byte-level alphabet and its id lies
    among the normal tokens' (a tokenizer trained with its special tokens, GPT-NeoX's), not
    when it comes after them (Qwen's, Llama-3's added tokens) - either way it encodes and
    decodes the same; trailing "[PAD{i}]" fillers are dropped; the pre-tokenizer and the
    normalizer follow tokenizer.ggml.pre (BPE_PRE_TOKENIZERS). BOS is the GGUF's bos token
    only when llama.cpp would add it (tokenizer.ggml.add_bos_token, else the pre-tokenizer's
    default), as colibri adds bos_id on request; UNK is none (byte-level BPE never produces
    one)."""
    from .bpe import (
        FLAG_CHUNKED,
        SPLIT_SEQUENCES,
        SUPPORTED_PATTERNS,
        build_bpe_tokenizer_section,
        bytes_to_unicode,
    )

    pre = g.get("tokenizer.ggml.pre")
    if pre is None:   # none named: llama.cpp's fallback, with its warning
        warnings.warn(f"{g.path} names no pre-tokenizer (tokenizer.ggml.pre): using llama.cpp's "
                      "'default', as llama.cpp does; such a file is older than the key, and its "
                      "model's own pre-tokenizer may differ (llama.cpp warns that generation "
                      "quality may be degraded)", RuntimeWarning, stacklevel=2)
        pre = "default"
    if pre not in BPE_PRE_TOKENIZERS:
        what = f" ({UNSUPPORTED_PRE_TOKENIZERS[pre]})" if pre in UNSUPPORTED_PRE_TOKENIZERS else ""
        raise ConversionError(f"{g.path}: byte-level BPE pre-tokenizer tokenizer.ggml.pre = {pre!r}"
                              f"{what} is not supported (supported: "
                              f"{', '.join(BPE_PRE_TOKENIZERS)})")
    pattern_name, nfc, ignore_merges = BPE_PRE_TOKENIZERS[pre]
    pattern = {name: p for p, (_i, name) in SUPPORTED_PATTERNS.items()}.get(pattern_name)
    merges = g.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise ConversionError(f"{g.path}: a byte-level BPE tokenizer without tokenizer.ggml.merges")
    n = _trim_padding(tokens, types)
    alphabet = set(bytes_to_unicode().values())
    last_normal = max((i for i in range(n) if int(types[i]) == TT_NORMAL), default=-1)
    vocab, added = {}, []
    for i in range(n):
        s, t = tokens[i], int(types[i])
        if t in (TT_CONTROL, TT_USER_DEFINED):
            added.append({"id": i, "content": s, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": t == TT_CONTROL})
            if i < last_normal and s and all(c in alphabet for c in s) and s not in vocab:
                vocab[s] = i
        else:
            if s in vocab:
                raise ConversionError(f"{g.path}: token {s!r} appears twice (ids {vocab[s]} and {i})")
            vocab[s] = i
    pairs = []
    for m in merges:
        pos = m.find(" ", 1)   # as llama.cpp splits them
        if pos < 0:
            raise ConversionError(f"{g.path}: merge {m!r} is not two space-separated tokens")
        pairs.append([m[:pos], m[pos + 1:]])
    if pattern_name == "gpt2":
        pre_tok = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                   "use_regex": True}
    elif pattern is None:   # a sequence of splits (DeepSeek)
        splits = next(seq for seq, (_i, name) in SPLIT_SEQUENCES.items() if name == pattern_name)
        pre_tok = {"type": "Sequence", "pretokenizers": [
            *({"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False}
              for rx in splits),
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}]}
    else:
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}]}
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
          "normalizer": {"type": "NFC"} if nfc else None, "pre_tokenizer": pre_tok,
          "post_processor": None,
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                      "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None,
                    "continuing_subword_prefix": None, "end_of_word_suffix": None,
                    "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
                    "vocab": vocab, "merges": pairs}}
    add_bos = g.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = pattern_name == "llama3"   # llama.cpp's default for these pre-tokenizers
    bos = _special(g, "bos", n) if add_bos else None
    eos, pad = _special(g, "eos", n), _special(g, "padding", n)
    cfg = {k: (tokens[v] if v is not None else None)
           for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad))}
    path = os.path.join(tmp, "tokenizer.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False)
    try:
        # Kimi's vocabulary: its tokenizer class's parts too (bpe.build_tiktoken_section)
        data, info = build_bpe_tokenizer_section(path, FLAG_CHUNKED if pattern_name == "kimi_k2" else 0)
    except ValueError as e:
        raise ValueError(str(e).replace(path, "the rebuilt tokenizer.json")) from None
    info["tokenizer.special_source"] = "GGUF metadata"
    return data, info


# --------------------------------------------------------------------------- metadata

def _file_type_name(g: GgufFile) -> str:
    """`gguf_` + the GGUF file type, lower case (general.file_type: MOSTLY_Q4_K_M -> q4_k_m),
    or of the most common weight type when the file does not say."""
    ft = g.get("general.file_type")
    if ft is not None:
        try:
            import gguf
            name = gguf.LlamaFileType(int(ft)).name
            for p in ("MOSTLY_", "ALL_"):
                name = name.removeprefix(p)
            return "gguf_" + name.lower()
        except (ValueError, ImportError):
            return f"gguf_type{int(ft)}"
    kinds = Counter(t.type_name for t in g.tensors.values() if len(t.shape) >= 2)
    return "gguf_" + (kinds.most_common(1)[0][0].lower() if kinds else "unknown")


def _metadata(s: ModelSpec, name: str, router_dtype: str, weight_dtype: str, msl: int,
              tok_meta: dict, source: str) -> bytes:
    """The metadata of convert.build_metadata, with the GGUF's dtype names and provenance."""
    M = MetaValue
    fam = family_metadata(s)
    if s.architecture == "mixtral":
        # Mixtral files need no family option; a GGUF `llama` MoE with biases or q/k norms
        # gets them all (readers run the options, whatever the architecture's name)
        other = family_metadata(dataclasses.replace(s, architecture="qwen3_moe"))
        defaults = fmt.FAMILY_OPTION_DEFAULTS
        if any(k in ("model.attn_qkv_bias", "model.attn_output_bias", "model.attn_qk_norm",
                     "model.clip_qkv", "model.dense_intermediate_size",
                     "model.shared_expert_intermediate_size", "model.shared_expert_gate")
               and v.value != defaults[k] for k, v in other) or s.layer_ffn:
            fam = other
    entries = [
        *spec_metadata(s, name=name, max_seq_len=msl, router_dtype=router_dtype,
                       weight_dtype=weight_dtype),
        *fam,
        *_tokenizer_meta_entries(tok_meta),
        ("convert.block_size", M(fmt.MT_U32, fmt.DEFAULT_BLOCK_SIZE)),
        ("convert.source", M(fmt.MT_STRING, source)),
    ]
    return fmt.encode_metadata(entries)


# --------------------------------------------------------------------------- entry point

def convert_gguf(gguf_path, output_path, *, max_seq_len: int | None = None,
                 progress: bool = True, tokenizer: str = "auto") -> str:
    """Import the llama.cpp GGUF `gguf_path` (Mixtral = `llama` with experts, `qwen2moe`,
    `qwen3moe`, `olmoe`, `deepseek2`, `gpt-oss`; tensors of the types in
    SUPPORTED_GGML_TYPES) into `output_path`, copying every weight's bytes (no
    requantization; rows reordered where llama.cpp permuted them). A split GGUF
    (PREFIX-00001-of-0000N.gguf ..., llama.cpp's gguf-split) is imported whole from any of
    its shards, the others in the same folder under their original names.

    max_seq_len: written to the header; default the GGUF's `{arch}.context_length`.
    progress: print stages and a progress bar to stderr.
    tokenizer: "auto" (the GGUF's vocabulary, if it has one) or "none".
    Returns the output path. Raises ConversionError (a ValueError) saying why a file cannot
    be imported (unsupported architecture or tensor type, damaged file, ...); on any error
    no output (and no OUT.tmp) is left behind.
    """
    fmt.require_little_endian()
    gguf_path = os.fspath(gguf_path)
    output_path = os.fspath(output_path)
    say = _Say(progress)
    say.stage(1, "reading the GGUF metadata")
    g = GgufFile(gguf_path)
    arch = g.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES and arch not in ARCH_IMPORTERS:
        raise ConversionError(f"{gguf_path}: unsupported GGUF architecture {arch!r}; supported: "
                              "llama (Mixtral, with experts), qwen2moe, qwen3moe, olmoe, "
                              "deepseek2, gpt-oss")
    for t in g.tensors.values():   # refuse any unsupported type before writing anything
        _check_type(t)
    importer = ARCH_IMPORTERS.get(arch)
    spec, facts = importer.read(g) if importer else _read_spec(g, arch)
    msl = spec.max_position_embeddings if max_seq_len is None else max_seq_len
    if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= fmt.U32_MAX:
        raise ConversionError(f"max_seq_len {msl!r}: must be an integer in 1..{fmt.U32_MAX}")
    tensors, router_dtype = (importer.plan if importer else _plan)(g, spec, facts, say)
    extra = sorted(set(g.tensors) - g.used)
    if extra:
        raise ConversionError(f"{gguf_path}: {len(extra)} GGUF tensors are not part of colibri's "
                              f"{spec.architecture} decoder ({', '.join(extra[:6])}"
                              f"{' ...' if len(extra) > 6 else ''}); refusing rather than "
                              "dropping weights the model may need")
    counts = Counter(fmt.DTYPE_NAMES[t.dtype] for t in tensors)
    say(f"{arch} -> {spec.architecture}: {spec.n_layers} layers, {spec.n_experts} experts, "
        f"tensors {dict(counts)}" + (" (q/k rows un-permuted)" if facts["permuted"] else ""))

    say.stage(2, "tokenizer")
    tok_bytes, tok_meta = _gguf_tokenizer(g, say, tokenizer)

    wname = _file_type_name(g)
    name = g.get("general.name") or os.path.splitext(os.path.basename(g.path))[0]
    source = (f"{IMPORTER_NAME} {_version()} from GGUF {g.label} "
              f"(llama.cpp file type {wname[5:]}, GGUF version "
              f"{int(g.reader.fields['GGUF.version'].contents())})")
    meta = _metadata(spec, str(name), router_dtype, wname, msl, tok_meta, source)
    return write_colibri(output_path, spec, tensors, meta, tok_bytes, msl=msl, int8_router=False,
                         block_size=fmt.DEFAULT_BLOCK_SIZE, say=say)
