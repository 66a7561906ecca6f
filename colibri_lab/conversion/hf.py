"""Convert a Hugging Face MoE checkpoint folder into one `.colibri` file (docs/format.md).

Supported families: the entries of FAMILY_TABLE (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V2, DeepSeek-V3, gpt-oss).
A family is one `Family` entry: its config keys (`Family.read`), its tensor names, and its
choices of attention, routing, activation and RoPE; its differences (biases, q/k norms,
clipping, dense layers, shared expert, per-layer windows, YaRN) become the format's
family-option metadata keys (docs/format.md, "Family options"), which the engine checks
against its own family table (native/src/model/family.c).

The converter streams: it never holds the model in memory. It parses the safetensors
headers itself and reads each source tensor (or a row range of it) with seek +
readinto — no mmap, so pages it touched are page cache, not resident memory. Dense
tensors are converted and written in row chunks of about `CHUNK_ELEMS` values; the
experts section is written layer by layer, expert by expert, gate/up in groups of
blocks; the one full read is one expert's down projection (for the transpose). Peak
memory is therefore a small multiple of one expert matrix plus a few chunks, whatever
the model's size.

With a block-quantized mix (`dtype="q8_0" | "q4_k" | "q4_k_m"`, docs/quantization.md,
"Converter mixes") each weight matrix gets the dtype `mixes.mix_dtype` gives it and is
quantized chunk by chunk of whole rows with llama.cpp's reference quantizers
(`colibri_lab.format.blocks`); every FFN is stored split (gate, up, down row-major tensors,
format version 2), so no expert matrix is ever read whole; routers and norms stay f32.

CRCs and norms are computed while writing; the file is written to `OUT.tmp` with a
zeroed header and a zeroed tensor directory, which are patched at the end, then fsynced
and renamed. On any error the temporary file is removed and no output is left.

Entry point: `convert(model_dir, output_path, ...)`; the command line is `cli.py`.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ..format import blocks as quants
from ..format import spec as fmt
from ..format.spec import (
    DTYPE_F32,
    DTYPE_I8,
    DTYPE_IDS,
    LAYOUT_EXPERTS_PACKED,
    LAYOUT_ROW_MAJOR,
    QUANT_DTYPES,
)
from . import deepseek as _deepseek
from . import mixes
from .checkpoint import Checkpoint, SrcTensor
from .families import FAMILY_BY_NAME, Family, read_config
from .spec import (
    CHUNK_ELEMS,
    FLOAT_DTYPES,
    Chunk,
    ConversionError,
    ModelSpec,
    PlannedTensor,
    stored_sumsq,
)
from .tokenizer import _tokenizer_section
from .writer import _Say, build_metadata, write_colibri

# block-quantized converter mixes (docs/quantization.md, "Converter mixes"); each tensor's
# dtype comes from mixes.mix_dtype, every FFN is stored split (format version 2)
QUANT_MIXES = mixes.MIXES

def _to_stored(x: np.ndarray, src_dtype: int, dst_dtype: int) -> np.ndarray:
    """Source storage values -> destination storage values (bit-exact when equal)."""
    if src_dtype == dst_dtype:
        return np.ascontiguousarray(x)
    return fmt.f32_to_stored(fmt.stored_to_f32(np.ascontiguousarray(x), src_dtype), dst_dtype)


def _with_sumsq(stored: np.ndarray, dtype: int) -> Chunk:
    return stored, stored_sumsq(stored, dtype, stored.shape[-1])


def _dense_producer(src: SrcTensor, dst: int) -> Callable[[], Iterator[Chunk]]:
    def gen():
        ncols = src.shape[-1]
        nrows = src.numel // ncols
        step = max(1, CHUNK_ELEMS // ncols)
        for r0 in range(0, nrows, step):
            n = min(step, nrows - r0)
            yield _with_sumsq(_to_stored(src.read_rows(r0, n, ncols), src.dtype_id, dst), dst)
    return gen


def _norm_producer(src: SrcTensor) -> Callable[[], Iterator[Chunk]]:
    def gen():
        x = fmt.stored_to_f32(src.read_flat(0, src.numel), src.dtype_id)
        yield _with_sumsq(np.ascontiguousarray(x, dtype="<f4"), DTYPE_F32)
    return gen


def _float_rows_producer(parts: list[tuple[SrcTensor, int, int]], ncols: int,
                         dst: int) -> Callable[[], Iterator[Chunk]]:
    """As `_rows_producer` for a float dtype (bit-exact when it is the source's)."""
    def gen():
        step = max(1, CHUNK_ELEMS // ncols)
        for src, r0, nrows in parts:
            for a in range(0, nrows, step):
                n = min(step, nrows - a)
                yield _with_sumsq(_to_stored(src.read_rows(r0 + a, n, ncols), src.dtype_id,
                                             dst), dst)
    return gen


def _rows_producer(parts: list[tuple[SrcTensor, int, int]], ncols: int,
                   dst: int) -> Callable[[], Iterator[Chunk]]:
    """Rows of one or more sources, back to back: `parts` = (tensor viewed as [-1, ncols],
    first row, row count). Read in chunks of whole rows (a quantized row is whole blocks,
    so a chunk quantizes on its own), converted with quants.to_stored; the sum of squares
    is of the values the file holds (the dequantized ones)."""
    def gen():
        step = max(1, CHUNK_ELEMS // ncols)
        for src, r0, nrows in parts:
            for a in range(0, nrows, step):
                n = min(step, nrows - a)
                x = fmt.stored_to_f32(src.read_rows(r0 + a, n, ncols), src.dtype_id)
                st = quants.to_stored(x, dst)
                del x
                yield st, stored_sumsq(st, dst, ncols)
    return gen


@dataclass
class ExpertSource:
    """Where w1, w3 (each [I, H]) and w2 ([H, I]) of one expert are: (tensor, first row)."""
    w1: tuple[SrcTensor, int]
    w3: tuple[SrcTensor, int]
    w2: tuple[SrcTensor, int]


def _experts_producer(experts: list[ExpertSource], I: int, H: int, B: int,
                      dst: int) -> Callable[[], Iterator[Chunk]]:
    def gen():
        blocks = (I + B - 1) // B
        per = max(1, CHUNK_ELEMS // max(1, 2 * B * H))   # blocks per chunk
        for ex in experts:
            (t1, r1), (t3, r3), (t2, r2) = ex.w1, ex.w3, ex.w2
            # rows 0..2I-1: blocks of B rows of w1 then the same rows of w3
            for b0 in range(0, blocks, per):
                b1 = min(blocks, b0 + per)
                lo, hi = b0 * B, min(b1 * B, I)
                g = _to_stored(t1.read_rows(r1 + lo, hi - lo, H), t1.dtype_id, dst)
                u = _to_stored(t3.read_rows(r3 + lo, hi - lo, H), t3.dtype_id, dst)
                out = np.empty((2 * (hi - lo), H), dtype=g.dtype)
                for b in range(b0, b1):
                    s, e = b * B - lo, min((b + 1) * B, I) - lo
                    nb = e - s
                    out[2 * s:2 * s + nb] = g[s:e]
                    out[2 * s + nb:2 * e] = u[s:e]
                del g, u
                yield _with_sumsq(out, dst)
                del out
            # rows 2I..3I-1: w2 transposed, row i = w2[:, i]
            w2 = t2.read_rows(r2, H, I)
            step = max(1, CHUNK_ELEMS // H)
            for i0 in range(0, I, step):
                i1 = min(I, i0 + step)
                yield _with_sumsq(_to_stored(w2[:, i0:i1].T, t2.dtype_id, dst), dst)
            del w2
    return gen


class _RouterInt8:
    """Quantises one layer's router once and hands out q, scale and zero."""

    def __init__(self, src: SrcTensor):
        self.src, self._r = src, None

    def get(self):
        if self._r is None:
            w = fmt.stored_to_f32(self.src.read_flat(0, self.src.numel),
                                  self.src.dtype_id).reshape(self.src.shape)
            q, scale, zero = fmt.quantize_router_int8(w)
            deq = fmt.dequantize_router_int8(q, scale, zero)
            self._r = (q, scale, zero, fmt.sumsq_f64(deq))
        return self._r

    def producer(self, which: str) -> Callable[[], Iterator[Chunk]]:
        def gen():
            q, scale, zero, ss = self.get()
            if which == "q":
                yield np.ascontiguousarray(q), ss
            elif which == "scale":
                yield _with_sumsq(np.ascontiguousarray(scale, "<f4"), DTYPE_F32)
            else:
                yield _with_sumsq(np.ascontiguousarray(zero, "<f4"), DTYPE_F32)
        return gen


def _expert_sources(ck: Checkpoint, fam: Family, layer: int, E: int, I: int,
                    H: int) -> list[ExpertSource]:
    """The routed experts of a layer, under the family's MoE block names: per-expert keys
    (`fam.expert_names`: Mixtral w1/w3/w2, the others gate_proj/up_proj/down_proj) or fused
    gate_up_proj [E, 2I, H] (gate rows first, then up, as transformers' experts modules) +
    down_proj [E, H, I]."""
    for moe in fam.moe_blocks:
        p = f"model.layers.{layer}.{moe}.experts"
        if ck.has(f"{p}.gate_up_proj") or ck.has(f"{p}.down_proj"):
            gu = ck.get(f"{p}.gate_up_proj", (E, 2 * I, H))
            dn = ck.get(f"{p}.down_proj", (E, H, I))
            return [ExpertSource((gu, e * 2 * I), (gu, e * 2 * I + I), (dn, e * H))
                    for e in range(E)]
    w1, w3, w2 = fam.expert_names
    p = next((f"model.layers.{layer}.{moe}.experts" for moe in fam.moe_blocks
              if ck.has(f"model.layers.{layer}.{moe}.experts.0.{w1}.weight")),
             f"model.layers.{layer}.{fam.moe_blocks[0]}.experts")
    return [ExpertSource((ck.get(f"{p}.{e}.{w1}.weight", (I, H)), 0),
                         (ck.get(f"{p}.{e}.{w3}.weight", (I, H)), 0),
                         (ck.get(f"{p}.{e}.{w2}.weight", (H, I)), 0)) for e in range(E)]


def _mlp_source(ck: Checkpoint, prefix: str, I: int, H: int) -> ExpertSource:
    """A SwiGLU MLP `prefix.{gate_proj,up_proj,down_proj}.weight` as one expert."""
    return ExpertSource((ck.get(f"{prefix}.gate_proj.weight", (I, H)), 0),
                        (ck.get(f"{prefix}.up_proj.weight", (I, H)), 0),
                        (ck.get(f"{prefix}.down_proj.weight", (H, I)), 0))


def _router_source(ck: Checkpoint, fam: Family, layer: int, E: int, H: int) -> SrcTensor:
    for moe in fam.moe_blocks:
        n = f"model.layers.{layer}.{moe}.{fam.router}.weight"
        if ck.has(n):
            return ck.get(n, (E, H))
    return ck.get(f"model.layers.{layer}.{fam.moe_blocks[0]}.{fam.router}.weight", (E, H))


class TensorPlan:
    """The output's tensors in file order, built by the family's planners: `dense` (a
    weight matrix in the file's dtype or the mix's), `vec` (a 1-D f32 tensor), `split` /
    `packed` (an FFN of one or E experts), each with its source checked (name, shape).

    mix None: every weight in the float dtype W, FFNs packed (format version 1). mix
    (mixes.MIXES): each weight matrix in mixes.mix_dtype's dtype, routers
    f32 (or int8), every FFN split into gate / up / down tensors (format version 2)."""

    def __init__(self, ck: Checkpoint, s: ModelSpec, W: int, int8_router: bool, B: int,
                 mix: str | None):
        self.ck, self.s, self.W, self.int8_router, self.B, self.mix = ck, s, W, int8_router, B, mix
        self.fam = FAMILY_BY_NAME[s.architecture]
        self.out: list[PlannedTensor] = []

    def wdtype(self, name, shape, layer=None) -> int:
        if self.mix is None:
            return self.W
        s = self.s
        return mixes.mix_dtype(self.mix, name, shape, layer=layer, n_layers=s.n_layers,
                                n_experts=s.n_experts, tied=s.tie_word_embeddings,
                                n_gqa=s.n_heads // max(1, s.n_kv_heads))

    def dense(self, name, src_name, shape, section=fmt.SECTION_DENSE, dtype=None):
        src = self.ck.get(src_name, shape)
        layer = int(name.split(".")[1]) if name.startswith("blk.") else None
        dt = self.wdtype(name, shape, layer) if dtype is None else dtype
        parts = [(src, 0, math.prod(shape[:-1]))]
        if dt in QUANT_DTYPES:
            prod = _rows_producer(parts, shape[-1], dt)
        else:
            prod = _dense_producer(src, dt)
        self.out.append(PlannedTensor(name, dt, LAYOUT_ROW_MAJOR, shape, section, prod))

    def vec(self, name, src_name, n=None):
        """A 1-D tensor (norm weight, bias), always f32."""
        n = self.s.hidden_size if n is None else n
        src = self.ck.get(src_name, (n,))
        self.out.append(PlannedTensor(name, DTYPE_F32, LAYOUT_ROW_MAJOR, (n,), fmt.SECTION_DENSE,
                                      _norm_producer(src)))

    def split(self, layer, suffix, srcs, width):
        """One FFN as three row-major tensors (docs/format.md, "The split FFN"): gate and
        up [.., width, H] from w1 / w3, down [.., H, width] from w2 as it is (rows over the
        intermediate dimension, not transposed). `srcs`: the experts (3-D tensors) or one
        MLP (suffix "" or "_shexp": 2-D)."""
        H = self.s.hidden_size
        lead = (len(srcs),) if suffix == "_exps" else ()
        names = [f"blk.{layer}.ffn_{w}{suffix}" for w in ("gate", "up", "down")]
        shapes = [lead + (width, H), lead + (width, H), lead + (H, width)]
        dts = [self.wdtype(n, sh, layer) for n, sh in zip(names, shapes)]
        if dts[0] != dts[1]:
            raise ConversionError(f"internal: {names[0]} and {names[1]} got different dtypes")
        parts = ([(ex.w1[0], ex.w1[1], width) for ex in srcs],
                 [(ex.w3[0], ex.w3[1], width) for ex in srcs],
                 [(ex.w2[0], ex.w2[1], H) for ex in srcs])
        for n, sh, dt, pp in zip(names, shapes, dts, parts):
            ncols = sh[-1]
            if dt in QUANT_DTYPES:
                prod = _rows_producer(pp, ncols, dt)
            else:   # a float fallback (rows no block divides): the same rows, converted
                prod = _float_rows_producer(pp, ncols, dt)
            self.out.append(PlannedTensor(n, dt, LAYOUT_ROW_MAJOR, sh, fmt.SECTION_EXPERTS, prod))

    def packed(self, name, srcs, width):
        H = self.s.hidden_size
        self.out.append(PlannedTensor(name, self.W, LAYOUT_EXPERTS_PACKED, (len(srcs), 3 * width, H),
                                      fmt.SECTION_EXPERTS,
                                      _experts_producer(srcs, width, H, self.B, self.W)))

    def ffn(self, layer, suffix, srcs, width):
        """An FFN in the file's layout: split for a quantized mix, packed otherwise."""
        if self.mix is not None:
            self.split(layer, suffix, srcs, width)
        else:
            self.packed(f"blk.{layer}.ffn_" + {"": "dense", "_exps": "experts",
                                               "_shexp": "shared"}[suffix], srcs, width)


def plan_gqa_attention(P: TensorPlan, n: int) -> None:
    """Grouped-query attention of layer n: q/k/v/o projections, the biases and q/k norms
    the spec enables (refusing checkpoint tensors it would leave unused)."""
    s, ck = P.s, P.ck
    H = s.hidden_size
    nq, nkv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    qk = {"none": None, "head": (s.head_dim, s.head_dim), "full": (nq, nkv)}[s.attn_qk_norm]
    a = f"model.layers.{n}.self_attn"
    for what, has, names in (("q/k/v", s.attn_qkv_bias, ("q_proj", "k_proj", "v_proj")),
                             ("output", s.attn_output_bias, ("o_proj",))):
        if not has and any(ck.has(f"{a}.{x}.bias") for x in names):
            raise ConversionError(f"{a} has {what} biases but config.json does not enable "
                                  f"them for {s.architecture}; colibri would not run them")
    if qk is None and (ck.has(f"{a}.q_norm.weight") or ck.has(f"{a}.k_norm.weight")):
        raise ConversionError(f"{a} has q/k norm weights, which {s.architecture} does not "
                              "use; colibri would not run them")
    P.dense(f"blk.{n}.attn_q.weight", f"{a}.q_proj.weight", (nq, H))
    P.dense(f"blk.{n}.attn_k.weight", f"{a}.k_proj.weight", (nkv, H))
    P.dense(f"blk.{n}.attn_v.weight", f"{a}.v_proj.weight", (nkv, H))
    if s.attn_qkv_bias:
        P.vec(f"blk.{n}.attn_q.bias", f"{a}.q_proj.bias", nq)
        P.vec(f"blk.{n}.attn_k.bias", f"{a}.k_proj.bias", nkv)
        P.vec(f"blk.{n}.attn_v.bias", f"{a}.v_proj.bias", nkv)
    if qk is not None:
        P.vec(f"blk.{n}.attn_q_norm.weight", f"{a}.q_norm.weight", qk[0])
        P.vec(f"blk.{n}.attn_k_norm.weight", f"{a}.k_norm.weight", qk[1])
    if s.attn_sinks:   # gpt-oss
        P.vec(f"blk.{n}.attn_sinks", f"{a}.sinks", s.n_heads)
    P.dense(f"blk.{n}.attn_output.weight", f"{a}.o_proj.weight", (H, nq))
    if s.attn_output_bias:
        P.vec(f"blk.{n}.attn_output.bias", f"{a}.o_proj.bias", H)


def plan_router(P: TensorPlan, n: int) -> None:
    """Layer n's router (f32/float or int8 with scale and zero) and shared-expert gate."""
    s, ck, fam = P.s, P.ck, P.fam
    E, H, R = s.n_experts, s.hidden_size, fmt.SECTION_ROUTER
    src = _router_source(ck, fam, n, E, H)
    name = f"blk.{n}.ffn_gate_inp"
    if P.int8_router:
        r = _RouterInt8(src)
        P.out.append(PlannedTensor(f"{name}.weight", DTYPE_I8, LAYOUT_ROW_MAJOR, (E, H), R,
                                   r.producer("q")))
        P.out.append(PlannedTensor(f"{name}.scale", DTYPE_F32, LAYOUT_ROW_MAJOR, (E,), R,
                                   r.producer("scale")))
        P.out.append(PlannedTensor(f"{name}.zero", DTYPE_F32, LAYOUT_ROW_MAJOR, (E,), R,
                                   r.producer("zero")))
    else:
        rdt = P.W if P.mix is None else DTYPE_F32
        P.out.append(PlannedTensor(f"{name}.weight", rdt, LAYOUT_ROW_MAJOR, (E, H), R,
                                   _dense_producer(src, rdt)))
    moe = f"model.layers.{n}.{fam.moe_blocks[-1]}"
    if s.router_bias:   # DeepSeek-V3's e_score_correction_bias (the choice only), f32
        b = ck.get(f"{moe}.gate.e_score_correction_bias", (E,))
        P.out.append(PlannedTensor(f"blk.{n}.exp_probs_b.bias", DTYPE_F32, LAYOUT_ROW_MAJOR, (E,), R,
                                   _norm_producer(b)))
    if s.shared_expert_gate:
        P.dense(f"blk.{n}.ffn_shared_gate.weight", f"{moe}.{fam.shared_expert}_gate.weight",
                (1, H), R, dtype=None if P.mix is None else DTYPE_F32)
    elif s.shared_expert_intermediate_size == 0:   # e.g. Qwen2-MoE's empty shared expert
        for x in ("gate_proj", "up_proj", "down_proj"):
            ck.skip(f"{moe}.{fam.shared_expert}.{x}.weight")
        ck.skip(f"{moe}.{fam.shared_expert}_gate.weight")


def plan_swiglu_ffn(P: TensorPlan, n: int) -> None:
    """Layer n's FFN: a dense SwiGLU MLP, or the routed experts and the shared expert."""
    s, ck, fam = P.s, P.ck, P.fam
    H, mlp = s.hidden_size, f"model.layers.{n}.mlp"
    if not s.is_moe(n):
        Id = s.dense_intermediate_size
        P.ffn(n, "", [_mlp_source(ck, mlp, Id, H)], Id)
        return
    P.ffn(n, "_exps", _expert_sources(ck, fam, n, s.n_experts, s.intermediate_size, H),
          s.intermediate_size)
    Is = s.shared_expert_intermediate_size
    if Is > 0:
        moe = f"model.layers.{n}.{fam.moe_blocks[-1]}"
        P.ffn(n, "_shexp", [_mlp_source(ck, f"{moe}.{fam.shared_expert}", Is, H)], Is)


def plan_mla_attention(P: TensorPlan, n: int) -> None:
    """Multi-head latent attention of layer n (colibri_lab/conversion/deepseek.py): q or the q LoRA,
    kv_a, kv_b, o. The RoPE rows of q and kv_a of a checkpoint with interleaved RoPE pairs
    are reordered (even dims, then odd) so that the engine's rotate_half RoPE computes the
    interleaved rotation (_deepseek.rope_rows)."""
    for name, src_name, shape, runs, is_vec in _deepseek.attention_tensors(P.s, n):
        if is_vec:
            P.vec(name, src_name, shape[0])
        elif runs is None:
            P.dense(name, src_name, shape)
        else:
            src = P.ck.get(src_name, shape)
            dt = P.wdtype(name, shape, n)
            parts = [(src, r0, k) for r0, k in runs]
            prod = (_rows_producer if dt in QUANT_DTYPES else _float_rows_producer)(parts, shape[-1], dt)
            P.out.append(PlannedTensor(name, dt, LAYOUT_ROW_MAJOR, shape, fmt.SECTION_DENSE, prod))


def _gptoss_rows_producer(src: SrcTensor, E: int, nrows: int, ncols: int, pick,
                          dst: int) -> Callable[[], Iterator[Chunk]]:
    """Expert e's [nrows, ncols] block of `src` (viewed as [E * nrows, ncols]), turned into
    the stored matrix by `pick` (a column slice and a transpose), one expert at a time,
    then in chunks of whole rows converted to `dst` (float or block-quantized)."""
    def gen():
        for e in range(E):
            a = fmt.stored_to_f32(src.read_rows(e * nrows, nrows, ncols), src.dtype_id)
            m = np.ascontiguousarray(pick(a), dtype=np.float32)
            del a
            step = max(1, CHUNK_ELEMS // m.shape[1])
            for r0 in range(0, m.shape[0], step):
                x = m[r0:r0 + step]
                if dst in QUANT_DTYPES:
                    st = quants.to_stored(x, dst)
                    yield st, stored_sumsq(st, dst, x.shape[1])
                else:
                    yield _with_sumsq(fmt.f32_to_stored(x, dst), dst)
            del m
    return gen


def _gptoss_bias_producer(src: SrcTensor, pick) -> Callable[[], Iterator[Chunk]]:
    def gen():
        x = fmt.stored_to_f32(src.read_flat(0, src.numel), src.dtype_id).reshape(src.shape)
        yield _with_sumsq(np.ascontiguousarray(pick(x), dtype="<f4"), DTYPE_F32)
    return gen


def _gptoss_mxfp4_producer(blocks: SrcTensor, scales: SrcTensor, E: int, rows: int, G: int,
                           sel: slice, dst: int) -> Callable[[], Iterator[Chunk]]:
    """Rows `sel` of each expert's MXFP4 matrix of a transformers checkpoint (`*_blocks`
    [E, rows, G, 16], `*_scales` [E, rows, G]: rows are the output dimension, blocks along
    the input, the engine's row layout) repacked by quants.mxfp4_from_hf: stored as they
    are for an MXFP4 destination (no requantization), else dequantized and converted."""
    def gen():
        K = 32 * G
        for e in range(E):
            b = blocks.read_rows(e * rows, rows, G * 16).reshape(rows, G, 16)
            sc = scales.read_rows(e * rows, rows, G)
            q = np.ascontiguousarray(quants.mxfp4_from_hf(b, sc)[sel])
            del b, sc
            if dst == fmt.DTYPE_MXFP4:
                yield q, stored_sumsq(q, dst, K)
                continue
            x = np.asarray(quants.from_stored(q, fmt.DTYPE_MXFP4, K), dtype=np.float32).reshape(-1, K)
            step = max(1, CHUNK_ELEMS // K)
            for r0 in range(0, x.shape[0], step):
                c = x[r0:r0 + step]
                if dst in QUANT_DTYPES:
                    st = quants.to_stored(c, dst)
                    yield st, stored_sumsq(st, dst, K)
                else:
                    yield _with_sumsq(fmt.f32_to_stored(c, dst), dst)
    return gen


def plan_gptoss_router(P: TensorPlan, n: int) -> None:
    """gpt-oss's router (`mlp.router.weight`, as plan_router) and its logit bias
    (`mlp.router.bias`, f32 also beside an int8 router)."""
    plan_router(P, n)
    E = P.s.n_experts
    if P.s.router_logit_bias:
        b = P.ck.get(f"model.layers.{n}.mlp.router.bias", (E,))
        P.out.append(PlannedTensor(f"blk.{n}.ffn_gate_inp.bias", DTYPE_F32, LAYOUT_ROW_MAJOR, (E,),
                                   fmt.SECTION_ROUTER, _norm_producer(b)))


def plan_gptoss_ffn(P: TensorPlan, n: int) -> None:
    """Layer n's routed experts as the split FFN (docs/format.md, "The split FFN") with
    their biases, whatever the dtype (the clamped SwiGLU runs on the split layout).
    transformers' GptOssExperts computes x @ gate_up_proj[e] ([E, H, 2I], gate = columns
    0::2, up = columns 1::2, interleaved) + gate_up_proj_bias and h @ down_proj[e]
    ([E, I, H]) + down_proj_bias: the gate and up rows are those columns transposed, down
    is down_proj[e] transposed."""
    s, ck = P.s, P.ck
    E, I, H = s.n_experts, s.intermediate_size, s.hidden_size
    p = f"model.layers.{n}.mlp.experts"
    names = [f"blk.{n}.ffn_{w}_exps" for w in ("gate", "up", "down")]
    shapes = [(E, I, H), (E, I, H), (E, H, I)]
    dts = [P.wdtype(nm, sh, n) for nm, sh in zip(names, shapes)]
    if dts[0] != dts[1]:
        raise ConversionError(f"internal: {names[0]} and {names[1]} got different dtypes")
    if ck.has(f"{p}.gate_up_proj_blocks") or ck.has(f"{p}.down_proj_blocks"):
        # the hub's MXFP4 experts: rows = outputs (gate/up interleaved), blocks along inputs
        if H % 32 or I % 32:
            raise ConversionError(f"{p}: MXFP4 experts need hidden_size and intermediate_size "
                                  f"multiples of 32, got {H} and {I}")
        gb = ck.get_bytes(f"{p}.gate_up_proj_blocks", (E, 2 * I, H // 32, 16))
        gs = ck.get_bytes(f"{p}.gate_up_proj_scales", (E, 2 * I, H // 32))
        db = ck.get_bytes(f"{p}.down_proj_blocks", (E, H, I // 32, 16))
        ds = ck.get_bytes(f"{p}.down_proj_scales", (E, H, I // 32))
        srcs = [(gb, gs, 2 * I, H // 32, slice(0, None, 2)), (gb, gs, 2 * I, H // 32, slice(1, None, 2)),
                (db, ds, H, I // 32, slice(None))]
        for nm, sh, dt, (b, sc, rows, G, sel) in zip(names, shapes, dts, srcs):
            P.out.append(PlannedTensor(nm, dt, LAYOUT_ROW_MAJOR, sh, fmt.SECTION_EXPERTS,
                                       _gptoss_mxfp4_producer(b, sc, E, rows, G, sel, dt)))
    else:
        gu = ck.get(f"{p}.gate_up_proj", (E, H, 2 * I))
        dn = ck.get(f"{p}.down_proj", (E, I, H))
        picks = [(gu, H, 2 * I, lambda a: a[:, 0::2].T), (gu, H, 2 * I, lambda a: a[:, 1::2].T),
                 (dn, I, H, lambda a: a.T)]
        for nm, sh, dt, (src, nr, nc, pick) in zip(names, shapes, dts, picks):
            P.out.append(PlannedTensor(nm, dt, LAYOUT_ROW_MAJOR, sh, fmt.SECTION_EXPERTS,
                                       _gptoss_rows_producer(src, E, nr, nc, pick, dt)))
    if s.expert_bias:
        gub = ck.get(f"{p}.gate_up_proj_bias", (E, 2 * I))
        dnb = ck.get(f"{p}.down_proj_bias", (E, H))
        for nm, sh, src, pick in ((names[0], (E, I), gub, lambda b: b[:, 0::2]),
                                  (names[1], (E, I), gub, lambda b: b[:, 1::2]),
                                  (names[2], (E, H), dnb, lambda b: b)):
            P.out.append(PlannedTensor(f"{nm}.bias", DTYPE_F32, LAYOUT_ROW_MAJOR, sh,
                                       fmt.SECTION_DENSE, _gptoss_bias_producer(src, pick)))


# family.attention -> the planner of a layer's attention tensors
ATTENTION_PLANNERS: dict[str, Callable[[TensorPlan, int], None]] = {"gqa": plan_gqa_attention,
                                                                   "mla": plan_mla_attention}
# family.activation -> the planners of a MoE layer's router and of a layer's FFN tensors
FFN_PLANNERS: dict[str, tuple[Callable[[TensorPlan, int], None], Callable[[TensorPlan, int], None]]] = {
    "silu_glu": (plan_router, plan_swiglu_ffn),
    "clamped_swiglu": (plan_gptoss_router, plan_gptoss_ffn)}


def plan_tensors(ck: Checkpoint, s: ModelSpec, W: int, int8_router: bool,
                 B: int, mix: str | None = None) -> list[PlannedTensor]:
    """Every tensor of the output in file order (dense: embedding, each layer's norms and
    attention, final norm, LM head; routers; experts), through the family's planners
    (ATTENTION_PLANNERS, FFN_PLANNERS). See TensorPlan for W, mix and B."""
    P = TensorPlan(ck, s, W, int8_router, B, mix)
    attention = ATTENTION_PLANNERS[s.attention]
    router, ffn = FFN_PLANNERS[s.activation]
    V, H = s.vocab_size, s.hidden_size
    P.dense("token_embd.weight", "model.embed_tokens.weight", (V, H))
    for n in range(s.n_layers):
        p = f"model.layers.{n}"
        P.vec(f"blk.{n}.attn_norm.weight", f"{p}.input_layernorm.weight")
        attention(P, n)
        P.vec(f"blk.{n}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight")
    P.vec("output_norm.weight", "model.norm.weight")
    if not s.tie_word_embeddings:
        P.dense("output.weight", "lm_head.weight", (V, H))
    for n in range(s.n_layers):
        if s.is_moe(n):
            router(P, n)
    for n in range(s.n_layers):
        ffn(P, n)
    return P.out



def convert(model_dir, output_path, *, dtype: str = "bf16", quantize_router: str | None = None,
            block_size: int = fmt.DEFAULT_BLOCK_SIZE, max_seq_len: int | None = None,
            progress: bool = True, tokenizer: str = "auto") -> str:
    """Convert the Hugging Face checkpoint in `model_dir` (a family of FAMILY_TABLE: Mixtral,
    Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss) to `output_path`.

    dtype: weight dtype "f32", "f16" or "bf16" (1-D norm weights are always f32), or a
    block-quantized mix "q8_0", "q4_k", "q4_k_m" or "mxfp4" (docs/quantization.md, "Converter
    mixes": each weight matrix's dtype from mixes.mix_dtype, llama.cpp's reference
    quantizers, routers and norms f32, every FFN in the split form; a version 2 file).
    quantize_router: None/"none" (routers in `dtype`; f32 for a quantized mix) or "int8"
    (allowed with every dtype, the quantized mixes included).
    block_size: row block B of the packed expert layout.
    max_seq_len: written to the header; default the config's max_position_embeddings.
    progress: print stages and a progress bar to stderr.
    tokenizer: "auto" (tokenizer.model, else tokenizer.json, else tekken.json, else none)
    or "none".
    Returns the output path. Raises ConversionError (a ValueError) on a bad checkpoint
    or argument; on any error no output (and no OUT.tmp) is left behind.
    """
    fmt.require_little_endian()
    model_dir = os.fspath(model_dir)
    output_path = os.fspath(output_path)
    if os.path.isfile(model_dir):
        raise ConversionError(f"{model_dir} is a file: convert() takes a Hugging Face checkpoint "
                              "folder; a llama.cpp GGUF is imported with "
                              "colibri_lab.convert_gguf(path, output_path) (or colibri-convert)")
    if dtype not in FLOAT_DTYPES + QUANT_MIXES:
        raise ConversionError(f"dtype {dtype!r}: choose one of "
                              f"{', '.join(FLOAT_DTYPES + QUANT_MIXES)}")
    if quantize_router not in (None, "none", "int8"):
        raise ConversionError(f"quantize_router {quantize_router!r}: choose none or int8")
    int8_router = quantize_router == "int8"
    if isinstance(block_size, bool) or not isinstance(block_size, int) or \
            not 1 <= block_size <= fmt.U32_MAX:
        raise ConversionError(f"block_size {block_size!r}: must be an integer >= 1")
    if not os.path.isdir(model_dir):
        raise ConversionError(f"{model_dir} is not a folder; give a Hugging Face checkpoint "
                              "folder (config.json + *.safetensors)")
    mix = dtype if dtype in QUANT_MIXES else None
    W = DTYPE_F32 if mix else DTYPE_IDS[dtype]

    say = _Say(progress)
    say.stage(1, "reading config")
    spec = read_config(model_dir)
    msl = spec.max_position_embeddings if max_seq_len is None else max_seq_len
    if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= fmt.U32_MAX:
        raise ConversionError(f"max_seq_len {msl!r}: must be an integer in 1..{fmt.U32_MAX}")
    ck = Checkpoint(model_dir)
    tensors = plan_tensors(ck, spec, W, int8_router, block_size, mix=mix)
    extra = ck.unused()
    if extra:
        warnings.warn(f"{len(extra)} checkpoint tensors are not used by a {spec.architecture} "
                      "model and "
                      f"are left out: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}",
                      RuntimeWarning, stacklevel=2)

    say.stage(2, "tokenizer")
    tok_bytes, tok_meta = _tokenizer_section(model_dir, say, tokenizer)

    name = os.path.basename(os.path.normpath(os.path.abspath(model_dir)))
    meta = build_metadata(spec, name, W, int8_router, block_size, msl, tok_meta, mix=mix)
    return write_colibri(output_path, spec, tensors, meta, tok_bytes, msl=msl,
                         int8_router=int8_router, block_size=block_size, say=say)


