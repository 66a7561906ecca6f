"""GGUF import of the architectures whose layers are not the grouped-query decoder of
colibri_lab.conversion.gguf's own reader: `deepseek2` (DeepSeek-V2 / -V3, multi-head latent
attention) and `gpt-oss` (docs/quantization.md, "GGUF import").

Each architecture is one `ArchImporter` entry of `ARCH_IMPORTERS` (read the spec, plan the
tensors); gguf.convert_gguf looks the GGUF's `general.architecture` up there after its own
table. The spec and the tensors are those the Hugging Face converter writes for the same
checkpoint (conversion/deepseek.py, conversion/families.py, conversion/hf.py), so the
engine runs an import unchanged.

What a GGUF of these families does not state is decided as llama.cpp runs the file
(src/models/deepseek2.cpp, src/models/openai-moe.cpp, src/llama-context.cpp, ggml's RoPE);
docs/quantization.md, "DeepSeek and gpt-oss GGUFs", lists the rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ..format import spec as fmt
from ..format.spec import DTYPE_F32, LAYOUT_ROW_MAJOR
from . import deepseek as _deepseek
from .families import yarn_parameters
from .gguf_file import (
    _FLOAT_TYPES,
    SUPPORTED_GGML_TYPES,
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
from .spec import ConversionError, ModelSpec, PlannedTensor

# llama_expert_gating_func_type
GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT = 1, 2, 3
# gpt-oss's clamped SwiGLU: llama.cpp's graph (LLM_FFN_SWIGLU_OAI_MOE) hard-codes these;
# the GGUF has no key for them
GPTOSS_SWIGLU_ALPHA, GPTOSS_SWIGLU_LIMIT = 1.702, 7.0


@dataclass(frozen=True)
class ArchImporter:
    """One GGUF architecture: read(g) -> (ModelSpec, facts); plan(g, spec, facts, say) ->
    (planned tensors in file order, router dtype name)."""
    read: Callable
    plan: Callable


# --------------------------------------------------------------------------- shared

def _get_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(g: GgufFile, A: str, dim: int, ctx: int, theta: float, *, deepseek: bool):
    """YaRN as llama.cpp runs a GGUF's `{A}.rope.scaling.*`: None for the default RoPE, else
    (rope_inv_freq, rope_attention_factor, softmax mscale).

    llama.cpp (llama-context.cpp, ggml's rope): factor = rope.scaling.factor; the ramp's
    correction dims are always floor / ceil'ed (transformers' `truncate` true; the GGUF
    does not record truncate); beta_fast / beta_slow default 32 / 1. The cos/sin factor
    is mscale(factor, m) / mscale(factor, m_all) when `yarn_log_multiplier` is set (the
    converter writes 0.1 * mscale_all_dim; for deepseek2 m = m_all unless m_all is 1, else
    m = 1: the file has no `mscale`), else mscale(factor), times
    rope.scaling.yarn_attn_factor when present. deepseek2 also multiplies the softmax scale
    by (that factor * mscale(factor, m_all))^2 (deepseek2.cpp's kq_scale)."""
    rst = g.get(f"{A}.rope.scaling.type")
    if rst in (None, "none"):
        for key in (f"{A}.rope.scaling.factor",):
            if g.get(key) not in (None, 0.0, 1.0):
                raise ConversionError(f"{g.path}: {key} is set without rope.scaling.type yarn")
        return None
    if rst != "yarn":
        raise ConversionError(f"{g.path}: {A}.rope.scaling.type {rst!r}; colibri implements the "
                              "default RoPE and YaRN")
    factor = g.get(f"{A}.rope.scaling.factor")
    omp = g.get(f"{A}.rope.scaling.original_context_length")
    if factor is None or omp is None:
        raise ConversionError(f"{g.path}: YaRN without {A}.rope.scaling.factor or "
                              "original_context_length")
    factor = _f32_value(factor)
    ext = g.get(f"{A}.rope.scaling.yarn_ext_factor")
    if ext not in (None, 1.0):
        raise ConversionError(f"{g.path}: {A}.rope.scaling.yarn_ext_factor {ext}; colibri runs "
                              "YaRN with the full ramp (1.0)")
    log_mul = g.get(f"{A}.rope.scaling.yarn_log_multiplier")
    m_all = float(np.float32(log_mul) / np.float32(0.1)) if log_mul else 0.0
    if m_all:
        m = m_all if (deepseek and m_all != 1.0) else 1.0
        af = _get_mscale(factor, m) / _get_mscale(factor, m_all)
    else:
        af = _get_mscale(factor)
    extra = g.get(f"{A}.rope.scaling.yarn_attn_factor")
    if extra is not None:
        af *= _f32_value(extra)
    rp = {"rope_theta": theta, "factor": factor, "original_max_position_embeddings": int(omp),
          "beta_fast": _f32_value(g.get(f"{A}.rope.scaling.yarn_beta_fast", 32.0)),
          "beta_slow": _f32_value(g.get(f"{A}.rope.scaling.yarn_beta_slow", 1.0)),
          "truncate": True, "attention_factor": af}
    inv, af = yarn_parameters(rp, dim, ctx)
    kq_mscale = (af * _get_mscale(factor, m_all)) ** 2 if deepseek else 1.0
    return tuple(float(x) for x in inv), float(af), kq_mscale


def _index(runs: list[tuple[int, int]]) -> np.ndarray:
    return np.concatenate([np.arange(a, a + c) for a, c in runs])


def _vec(g: GgufFile, out: list, name: str, n: int, gname: str | None = None,
         shape: tuple | None = None, section: int = fmt.SECTION_DENSE) -> None:
    """A 1-D (or small 2-D, `shape`) tensor stored as f32."""
    t = g.tensor(gname or name)
    shape = shape or (n,)
    if math.prod(t.shape) != math.prod(shape) or t.shape[-1] != shape[-1]:
        raise ConversionError(f"{g.path}: tensor {t.name} has shape {list(t.shape)}, expected "
                              f"{list(shape)}")
    _check_type(t)
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    gt = GTensor(t.name, t.type_name, (rows, shape[-1]), t.raw.reshape(rows, -1))
    out.append(PlannedTensor(name, DTYPE_F32, LAYOUT_ROW_MAJOR, shape, section,
                             _f32_producer([Rows(gt)], shape[-1])))


def _mat(g: GgufFile, out: list, name: str, shape: tuple, gname: str | None = None,
         index: np.ndarray | None = None, section: int = fmt.SECTION_DENSE) -> GTensor:
    """A weight copied as stored (rows reordered by `index`)."""
    t = g.tensor(gname or name, shape)
    _check_type(t)
    out.append(PlannedTensor(name, SUPPORTED_GGML_TYPES[t.type_name], LAYOUT_ROW_MAJOR, shape,
                             section, _copy_producer([Rows(t, index=index)], t.type_name,
                                                     shape[-1])))
    return t


def _router(g: GgufFile, s: ModelSpec, say) -> str:
    """The routers (ffn_gate_inp.weight of every MoE layer) in one float dtype: the GGUF's
    when all are F32/F16/BF16 alike, else f32 (dequantized, not requantized)."""
    E, H = s.n_experts, s.hidden_size
    ts = {n: g.tensor(f"blk.{n}.ffn_gate_inp.weight", (E, H)) for n in range(s.n_layers)
          if s.is_moe(n)}
    kinds = {t.type_name for t in ts.values()}
    for t in ts.values():
        _check_type(t)
    rname = kinds.pop().lower() if len(kinds) == 1 and kinds <= set(_FLOAT_TYPES) else "f32"
    if rname == "f32" and any(t.type_name != "F32" for t in ts.values()):
        say("note: routers stored quantized or in mixed dtypes in the GGUF; written as f32 "
            "(dequantized, not requantized)")
    return rname


def _add_router(g: GgufFile, out: list, n: int, s: ModelSpec, rname: str) -> None:
    E, H = s.n_experts, s.hidden_size
    t = g.tensor(f"blk.{n}.ffn_gate_inp.weight", (E, H))
    name = f"blk.{n}.ffn_gate_inp.weight"
    if rname == "f32" and t.type_name != "F32":
        out.append(PlannedTensor(name, DTYPE_F32, LAYOUT_ROW_MAJOR, (E, H), fmt.SECTION_ROUTER,
                                 _f32_producer([Rows(t)], H)))
    else:
        out.append(PlannedTensor(name, SUPPORTED_GGML_TYPES[t.type_name], LAYOUT_ROW_MAJOR, (E, H),
                                 fmt.SECTION_ROUTER, _copy_producer([Rows(t)], t.type_name, H)))


def _split_ffn(g: GgufFile, out: list, n: int, suffix: str, width: int, lead: tuple) -> None:
    """blk.n.ffn_{gate,up,down}{suffix} as stored (split form, format version 2)."""
    H = g.tensors["token_embd.weight"].shape[1]
    shapes = (lead + (width, H), lead + (width, H), lead + (H, width))
    ts = [g.tensor(f"blk.{n}.ffn_{w}{suffix}.weight", sh) for w, sh in
          zip(("gate", "up", "down"), shapes)]
    if ts[0].type_name != ts[1].type_name:
        raise ConversionError(f"{g.path}: blk.{n}.ffn_gate{suffix} is {ts[0].type_name} but "
                              f"blk.{n}.ffn_up{suffix} is {ts[1].type_name}; colibri needs the "
                              "gate and up projections of an FFN in one dtype (re-quantize the "
                              "GGUF with llama-quantize, or use another file)")
    for w, t, sh in zip(("gate", "up", "down"), ts, shapes):
        _check_type(t)
        out.append(PlannedTensor(f"blk.{n}.ffn_{w}{suffix}", SUPPORTED_GGML_TYPES[t.type_name],
                                 LAYOUT_ROW_MAJOR, sh, fmt.SECTION_EXPERTS,
                                 _copy_producer([Rows(t)], t.type_name, sh[-1])))


def _width(g: GgufFile, name: str, axis: int) -> int | None:
    t = g.tensors.get(name)
    return None if t is None else t.shape[axis]


# --------------------------------------------------------------------------- deepseek2

def _read_deepseek2(g: GgufFile, A: str = "deepseek2") -> tuple[ModelSpec, dict]:
    """DeepSeek-V2 / -V3 from a `deepseek2` GGUF (llama.cpp's DeepseekV2Model converter).

    The family follows the routing llama.cpp runs: expert_gating_func sigmoid ->
    deepseek_v3 (sigmoid_topk, exp_probs_b the choice bias), softmax or absent (llama.cpp's
    default for files without the key) -> deepseek_v2 (softmax_topk). The top-k weights
    are renormalised iff expert_weights_norm (absent: no), scaled by expert_weights_scale
    (absent or 0: 1). MLA widths: key_length_mla / value_length_mla when the file has them
    (split attn_k_b / attn_v_b), else key_length / value_length (one attn_kv_b);
    qk_rope = rope.dimension_count. llama.cpp rotates adjacent pairs (its NORM RoPE) for
    deepseek2, so the RoPE rows are de-interleaved as for a checkpoint with interleaved
    RoPE (deepseek.rope_rows)."""
    L = _int(g, f"{A}.block_count")
    H = _int(g, f"{A}.embedding_length")
    nh = _int(g, f"{A}.attention.head_count")
    E = _int(g, f"{A}.expert_count")
    k = _int(g, f"{A}.expert_used_count")
    if k > E:
        raise ConversionError(f"{g.path}: {A}.expert_used_count {k} > expert_count {E}")
    emb = g.tensor("token_embd.weight")
    if len(emb.shape) != 2 or emb.shape[1] != H:
        raise ConversionError(f"{g.path}: token_embd.weight has shape {list(emb.shape)}")
    V = emb.shape[0]
    ql = int(g.get(f"{A}.attention.q_lora_rank", 0) or 0)
    r = _int(g, f"{A}.attention.kv_lora_rank")
    # the split attn_k_b / attn_v_b alone (current converter), or one attn_kv_b (older
    # files; some converters wrote all three: attn_kv_b is then taken as stored, and the
    # split copies of the same values are left aside)
    split_kv = not g.has("blk.0.attn_kv_b.weight") and (g.has("blk.0.attn_k_b.weight") or
                                                        g.has("blk.0.attn_v_b.weight"))
    if split_kv:
        dq = _int(g, f"{A}.attention.key_length_mla")
        dv = _int(g, f"{A}.attention.value_length_mla")
    else:
        dq = int(g.get(f"{A}.attention.key_length_mla") or _int(g, f"{A}.attention.key_length"))
        dv = int(g.get(f"{A}.attention.value_length_mla") or _int(g, f"{A}.attention.value_length"))
    dr = _int(g, f"{A}.rope.dimension_count")
    dn = dq - dr
    if dn < 1:
        raise ConversionError(f"{g.path}: key length {dq} leaves no non-RoPE dims past the "
                              f"{dr} RoPE dims")
    if dr % 2:
        raise ConversionError(f"{g.path}: rope.dimension_count {dr} is odd; RoPE rotates pairs")
    if ql and not g.has("blk.0.attn_q_a.weight"):
        raise ConversionError(f"{g.path}: q_lora_rank {ql} but no blk.0.attn_q_a.weight")
    if not ql and g.has("blk.0.attn_q_a.weight"):   # llama.cpp's "lite" files omit the key
        ql = g.tensors["blk.0.attn_q_a.weight"].shape[0]
    nd = int(g.get(f"{A}.leading_dense_block_count", 0) or 0)
    layer_ffn = tuple(int(i >= nd) for i in range(L))
    if not any(layer_ffn):
        raise ConversionError(f"{g.path}: leading_dense_block_count {nd} leaves no MoE layer")
    first_moe = layer_ffn.index(1)
    I = _width(g, f"blk.{first_moe}.ffn_gate_exps.weight", 1)
    if I is None:
        raise ConversionError(f"{g.path}: no blk.{first_moe}.ffn_gate_exps.weight (the experts of "
                              "the first MoE layer)")
    want = g.get(f"{A}.expert_feed_forward_length")
    if isinstance(want, list):
        want = want[first_moe]
    if want is not None and int(want) != I:
        raise ConversionError(f"{g.path}: the experts are {I} wide but expert_feed_forward_length "
                              f"is {want}")
    Id = _width(g, "blk.0.ffn_gate.weight", 0) if nd else 0
    if nd and Id is None:
        raise ConversionError(f"{g.path}: no blk.0.ffn_gate.weight (a leading dense layer)")
    n_shared = int(g.get(f"{A}.expert_shared_count", 0) or 0)
    Is = _width(g, f"blk.{first_moe}.ffn_gate_shexp.weight", 0) or 0
    if Is != n_shared * I:
        raise ConversionError(f"{g.path}: the shared experts are {Is} wide; expert_shared_count "
                              f"{n_shared} x {I} expected")

    # routing
    gating = g.get(f"{A}.expert_gating_func")
    if gating is None:
        # llama.cpp's deepseek2 loader: files without the key route with a softmax, except
        # the 47/48-layer, 154880-token GLM-4.7 files, which use a sigmoid
        gating = GATING_SIGMOID if L in (47, 48) and V == 154880 else GATING_SOFTMAX
    gating = int(gating)
    has_bias = g.has(f"blk.{first_moe}.exp_probs_b.bias")
    if gating == GATING_SIGMOID:
        fam, routing = "deepseek_v3", "sigmoid_topk"
    elif gating == GATING_SOFTMAX:
        fam, routing = "deepseek_v2", "softmax_topk"
        if has_bias:
            raise ConversionError(f"{g.path}: a softmax router with a choice bias (exp_probs_b); "
                                  "colibri's softmax routers have no choice bias")
    else:
        raise ConversionError(f"{g.path}: {A}.expert_gating_func {gating}; colibri routes "
                              "deepseek2 files with a softmax (1) or a sigmoid (2)")
    G = int(g.get(f"{A}.expert_group_count", 1) or 1)
    TG = int(g.get(f"{A}.expert_group_used_count", G) or G)
    if E % G or TG > G or TG * (E // G) < k:
        raise ConversionError(f"{g.path}: expert groups {G} (used {TG}) do not fit {E} experts "
                              f"and top-{k}")
    if routing == "sigmoid_topk" and G > 1 and E // G < 2:
        raise ConversionError(f"{g.path}: one expert per group; a group scores its two best")
    scale = g.get(f"{A}.expert_weights_scale")
    scale = 1.0 if not scale else _f32_value(scale)
    norm = bool(g.get(f"{A}.expert_weights_norm", False))

    theta = _f32_value(g.get(f"{A}.rope.freq_base", 10000.0))
    ctx = _int(g, f"{A}.context_length")
    yarn = _yarn(g, A, dr, ctx, theta, deepseek=True)
    kq = (dq ** -0.5) * (yarn[2] if yarn else 1.0)
    eps = g.get(f"{A}.attention.layer_norm_rms_epsilon")
    if eps is None:
        raise ConversionError(f"{g.path}: {A}.attention.layer_norm_rms_epsilon is missing")
    mla = _deepseek.MLAOptions(ql, r, dn, dr, dv, True, kq)
    spec = ModelSpec(
        vocab_size=V, hidden_size=H, intermediate_size=I, n_layers=L, n_heads=nh, n_kv_heads=nh,
        head_dim=dr, n_experts=E, top_k=k, rms_norm_eps=_f32_value(eps), rope_theta=theta,
        max_position_embeddings=ctx, sliding_window=0,
        tie_word_embeddings=not g.has("output.weight"), architecture=fam,
        norm_topk_prob=norm, layer_ffn=layer_ffn if not all(layer_ffn) else (),
        dense_intermediate_size=Id or 0, shared_expert_intermediate_size=Is,
        attention="mla", routing=routing, n_group=G, topk_group=TG,
        routed_scaling_factor=scale, router_bias=routing == "sigmoid_topk" and has_bias, mla=mla)
    if yarn:
        spec.rope_type, spec.rope_inv_freq, spec.rope_attention_factor = "yarn", yarn[0], yarn[1]
    return spec, {"permuted": False, "split_kv": split_kv}


def _kv_b_producer(kb: GTensor, vb: GTensor, nh: int, dn: int, dv: int, r: int,
                   dst: int) -> Callable[[], Iterator[tuple[np.ndarray, float]]]:
    """kv_b [nh * (dn + dv), r] from llama.cpp's split attn_k_b [nh, r, dn] (kv_b's k rows,
    transposed) and attn_v_b [nh, dv, r], one head at a time: the values exactly (a float
    GGUF type kept, block types dequantized to f32)."""
    def gen():
        for h in range(nh):
            k = _dequantize(np.asarray(kb.raw[h * r:(h + 1) * r]), kb.type_name, dn)   # [r, dn]
            v = _dequantize(np.asarray(vb.raw[h * dv:(h + 1) * dv]), vb.type_name, r)  # [dv, r]
            x = np.concatenate([k.T, v], axis=0).astype(np.float32)
            yield fmt.f32_to_stored(x, dst).reshape(-1), fmt.sumsq_f64(x)
    return gen


def _plan_deepseek2(g: GgufFile, s: ModelSpec, facts: dict, say):
    m = s.mla
    V, H, L, E, nh = s.vocab_size, s.hidden_size, s.n_layers, s.n_experts, s.n_heads
    r, dn, dr, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    dq = dn + dr
    out: list[PlannedTensor] = []
    _mat(g, out, "token_embd.weight", (V, H))
    q_idx = _index(_deepseek.rope_rows(nh, dq, dn, dr, True))
    kv_idx = _index(_deepseek.rope_rows(1, r + dr, r, dr, True))
    for n in range(L):
        b = f"blk.{n}"
        _vec(g, out, f"{b}.attn_norm.weight", H)
        if m.q_lora_rank:
            _mat(g, out, f"{b}.attn_q_a.weight", (m.q_lora_rank, H))
            _vec(g, out, f"{b}.attn_q_a_norm.weight", m.q_lora_rank)
            _mat(g, out, f"{b}.attn_q_b.weight", (nh * dq, m.q_lora_rank), index=q_idx)
        else:
            _mat(g, out, f"{b}.attn_q.weight", (nh * dq, H), index=q_idx)
        _mat(g, out, f"{b}.attn_kv_a_mqa.weight", (r + dr, H), index=kv_idx)
        _vec(g, out, f"{b}.attn_kv_a_norm.weight", r)
        if facts["split_kv"]:
            kb = g.tensor(f"{b}.attn_k_b.weight", (nh, r, dn))
            vb = g.tensor(f"{b}.attn_v_b.weight", (nh, dv, r))
            _check_type(kb)
            _check_type(vb)
            types = {kb.type_name, vb.type_name}
            dst = SUPPORTED_GGML_TYPES[types.pop()] if len(types) == 1 and \
                kb.type_name in _FLOAT_TYPES else DTYPE_F32
            out.append(PlannedTensor(f"{b}.attn_kv_b.weight", dst, LAYOUT_ROW_MAJOR,
                                     (nh * (dn + dv), r), fmt.SECTION_DENSE,
                                     _kv_b_producer(kb, vb, nh, dn, dv, r, dst)))
        else:
            _mat(g, out, f"{b}.attn_kv_b.weight", (nh * (dn + dv), r))
            for x, shape in (("k", (nh, r, dn)), ("v", (nh, dv, r))):
                if g.has(f"{b}.attn_{x}_b.weight"):   # the same values, split: checked, unused
                    g.tensor(f"{b}.attn_{x}_b.weight", shape)
        _mat(g, out, f"{b}.attn_output.weight", (H, nh * dv))
        _vec(g, out, f"{b}.ffn_norm.weight", H)
    _vec(g, out, "output_norm.weight", H)
    if not s.tie_word_embeddings:
        _mat(g, out, "output.weight", (V, H))
    rname = _router(g, s, say)
    for n in range(L):
        if s.is_moe(n):
            _add_router(g, out, n, s, rname)
            if s.router_bias:
                _vec(g, out, f"blk.{n}.exp_probs_b.bias", E, section=fmt.SECTION_ROUTER)
    if facts["split_kv"] and any(g.tensors[f"blk.{n}.attn_{x}_b.weight"].type_name not in
                                 _FLOAT_TYPES for n in range(L) for x in "kv"):
        say("note: attn_k_b / attn_v_b are block-quantized; attn_kv_b is rebuilt from them as "
            "f32 (their exact values, k_b transposed back)")
    for n in range(L):
        if not s.is_moe(n):
            _split_ffn(g, out, n, "", s.dense_intermediate_size, ())
            continue
        _split_ffn(g, out, n, "_exps", s.intermediate_size, (E,))
        if s.shared_expert_intermediate_size:
            _split_ffn(g, out, n, "_shexp", s.shared_expert_intermediate_size, ())
    return out, rname


# --------------------------------------------------------------------------- gpt-oss

def _read_gptoss(g: GgufFile, A: str = "gpt-oss") -> tuple[ModelSpec, dict]:
    """gpt-oss from a `gpt-oss` GGUF (llama.cpp's GptOssModel converter: gate and up split,
    not interleaved; MXFP4 experts when the checkpoint has them). Not in the file, as
    llama.cpp runs it (openai-moe.cpp): the clamped SwiGLU's alpha 1.702 and limit 7.0; the
    sliding layers from attention.sliding_window_pattern, else every other layer starting
    with layer 0 (set_swa_pattern(2)); the window as stored (query i sees key j iff
    i - j < window: llama.cpp's standard SWA and the engine's rule); RoPE rotate-half
    (NEOX, no row permutation); softmax scale 1/sqrt(head_dim)."""
    L = _int(g, f"{A}.block_count")
    H = _int(g, f"{A}.embedding_length")
    nh = _int(g, f"{A}.attention.head_count")
    nkv = _int(g, f"{A}.attention.head_count_kv", nh)
    E = _int(g, f"{A}.expert_count")
    k = _int(g, f"{A}.expert_used_count")
    if k > E or nh % nkv:
        raise ConversionError(f"{g.path}: expert_used_count {k} / expert_count {E}, heads {nh} / "
                              f"kv heads {nkv} do not fit")
    emb = g.tensor("token_embd.weight")
    V = emb.shape[0]
    hd = _int(g, f"{A}.attention.key_length")
    if int(g.get(f"{A}.attention.value_length", hd)) != hd or hd % 2:
        raise ConversionError(f"{g.path}: key/value lengths {hd}/"
                              f"{g.get(f'{A}.attention.value_length')}: equal and even needed")
    rd = g.get(f"{A}.rope.dimension_count")
    if rd is not None and int(rd) != hd:
        raise ConversionError(f"{g.path}: partial RoPE ({rd} of {hd} dims) is not implemented")
    I = _width(g, "blk.0.ffn_gate_exps.weight", 1)
    if I is None:
        raise ConversionError(f"{g.path}: no blk.0.ffn_gate_exps.weight")
    win = int(g.get(f"{A}.attention.sliding_window", 0) or 0)
    pat = g.get(f"{A}.attention.sliding_window_pattern")
    if isinstance(pat, list):
        if len(pat) != L:
            raise ConversionError(f"{g.path}: sliding_window_pattern has {len(pat)} entries for "
                                  f"{L} layers")
        swa = [bool(x) for x in pat]
    else:
        p = 2 if pat is None else int(pat)
        swa = [p == 0 or (i % p) < p - 1 for i in range(L)]
    if any(swa) and win <= 0:
        raise ConversionError(f"{g.path}: sliding layers but no {A}.attention.sliding_window")
    if g.get(f"{A}.rope.freq_base_swa") not in (None, g.get(f"{A}.rope.freq_base")):
        raise ConversionError(f"{g.path}: a separate RoPE base for sliding layers is not "
                              "implemented")
    windows = tuple(win if x else 0 for x in swa)
    sw, lsw = (windows[0], ()) if len(set(windows)) == 1 else (0, windows)
    theta = _f32_value(g.get(f"{A}.rope.freq_base", 10000.0))
    ctx = _int(g, f"{A}.context_length")
    yarn = _yarn(g, A, hd, ctx, theta, deepseek=False)
    eps = g.get(f"{A}.attention.layer_norm_rms_epsilon")
    if eps is None:
        raise ConversionError(f"{g.path}: {A}.attention.layer_norm_rms_epsilon is missing")
    scale = g.get(f"{A}.expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ConversionError(f"{g.path}: {A}.expert_weights_scale {scale}; gpt-oss does not "
                              "scale the routed weights")
    for what in ("attn_sinks.weight", "ffn_gate_inp.bias"):
        if not g.has(f"blk.0.{what}"):
            raise ConversionError(f"{g.path}: no blk.0.{what}; llama.cpp's gpt-oss needs it")
    spec = ModelSpec(
        vocab_size=V, hidden_size=H, intermediate_size=I, n_layers=L, n_heads=nh,
        n_kv_heads=nkv, head_dim=hd, n_experts=E, top_k=k, rms_norm_eps=_f32_value(eps),
        rope_theta=theta, max_position_embeddings=ctx, sliding_window=sw,
        layer_sliding_window=lsw, tie_word_embeddings=not g.has("output.weight"),
        architecture="gpt_oss", norm_topk_prob=False, attn_qkv_bias=g.has("blk.0.attn_q.bias"),
        attn_output_bias=g.has("blk.0.attn_output.bias"), routing="topk_softmax",
        activation="clamped_swiglu", swiglu_limit=GPTOSS_SWIGLU_LIMIT,
        swiglu_alpha=GPTOSS_SWIGLU_ALPHA, router_logit_bias=True, attn_sinks=True,
        expert_bias=g.has("blk.0.ffn_gate_exps.bias"))
    if yarn:
        spec.rope_type, spec.rope_inv_freq, spec.rope_attention_factor = "yarn", yarn[0], yarn[1]
    return spec, {"permuted": False}


def _plan_gptoss(g: GgufFile, s: ModelSpec, facts: dict, say):
    V, H, L, E, I = s.vocab_size, s.hidden_size, s.n_layers, s.n_experts, s.intermediate_size
    nq, nkv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    out: list[PlannedTensor] = []
    _mat(g, out, "token_embd.weight", (V, H))
    for n in range(L):
        b = f"blk.{n}"
        for what, has in (("attn_q", s.attn_qkv_bias), ("attn_output", s.attn_output_bias),
                          ("ffn_gate_exps", s.expert_bias)):
            if g.has(f"{b}.{what}.bias") != has:
                raise ConversionError(f"{g.path}: layer {n} {'lacks' if has else 'has'} "
                                      f"{what}.bias, unlike layer 0")
        _vec(g, out, f"{b}.attn_norm.weight", H)
        _mat(g, out, f"{b}.attn_q.weight", (nq, H))
        _mat(g, out, f"{b}.attn_k.weight", (nkv, H))
        _mat(g, out, f"{b}.attn_v.weight", (nkv, H))
        if s.attn_qkv_bias:
            _vec(g, out, f"{b}.attn_q.bias", nq)
            _vec(g, out, f"{b}.attn_k.bias", nkv)
            _vec(g, out, f"{b}.attn_v.bias", nkv)
        _vec(g, out, f"{b}.attn_sinks", s.n_heads, gname=f"{b}.attn_sinks.weight")
        _mat(g, out, f"{b}.attn_output.weight", (H, nq))
        if s.attn_output_bias:
            _vec(g, out, f"{b}.attn_output.bias", H)
        _vec(g, out, f"{b}.ffn_norm.weight", H, gname=f"{b}.post_attention_norm.weight")
    _vec(g, out, "output_norm.weight", H)
    if not s.tie_word_embeddings:
        _mat(g, out, "output.weight", (V, H))
    rname = _router(g, s, say)
    for n in range(L):
        _add_router(g, out, n, s, rname)
        _vec(g, out, f"blk.{n}.ffn_gate_inp.bias", E, section=fmt.SECTION_ROUTER)
    for n in range(L):
        _split_ffn(g, out, n, "_exps", I, (E,))
        if s.expert_bias:
            for w, width in (("gate", I), ("up", I), ("down", H)):
                _vec(g, out, f"blk.{n}.ffn_{w}_exps.bias", width, shape=(E, width))
    return out, rname


ARCH_IMPORTERS: dict[str, ArchImporter] = {
    "deepseek2": ArchImporter(_read_deepseek2, _plan_deepseek2),
    "gpt-oss": ArchImporter(_read_gptoss, _plan_gptoss),
}
