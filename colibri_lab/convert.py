"""Convert a Hugging Face Mixtral checkpoint folder into one `.colibri` file (docs/format.md).

The converter streams: it never holds the model in memory. It parses the safetensors
headers itself and reads each source tensor (or a row range of it) with seek +
readinto — no mmap, so pages it touched are page cache, not resident memory. Dense
tensors are converted and written in row chunks of about `CHUNK_ELEMS` values; the
experts section is written layer by layer, expert by expert, gate/up in groups of
blocks; the one full read is one expert's down projection (for the transpose). Peak
memory is therefore a small multiple of one expert matrix plus a few chunks, whatever
the model's size.

CRCs and norms are computed while writing; the file is written to `OUT.tmp` with a
zeroed header and a zeroed tensor directory, which are patched at the end, then fsynced
and renamed. On any error the temporary file is removed and no output is left.

Entry points: `convert(model_dir, output_path, ...)` and `main(argv)` (console scripts
`colibri-convert` and `convert_hf_to_colibri`, and `python -m colibri_lab.convert`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from . import format as fmt
from .format import (DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_I8, DTYPE_IDS, DTYPE_NUMPY,
                     DTYPE_SIZES, LAYOUT_EXPERTS_PACKED, LAYOUT_ROW_MAJOR, MetaValue)

CONVERTER_NAME = "colibri_lab.convert"
CHUNK_ELEMS = 1 << 20   # values per conversion chunk (about 4 MiB of f32)
SUPPORTED = "mixtral (MixtralForCausalLM)"


class ConversionError(ValueError):
    """The checkpoint cannot be converted; the message says why and what to do."""


def _version() -> str:
    try:
        from importlib.metadata import version
        for dist in ("colibri-lab", "colibri_lab"):
            try:
                return version(dist)
            except Exception:
                pass
    except Exception:
        pass
    return "dev"


# --------------------------------------------------------------------------- sources

# safetensors dtype -> (numpy storage dtype, colibri dtype id for float conversion)
_ST_DTYPES = {"F32": (np.dtype("<f4"), DTYPE_F32), "F16": (np.dtype("<f2"), DTYPE_F16),
              "BF16": (np.dtype("<u2"), DTYPE_BF16)}


@dataclass
class SrcTensor:
    """One tensor inside a safetensors file: where its bytes are, and how to read them."""
    name: str
    path: str
    st_dtype: str
    shape: tuple[int, ...]
    start: int   # absolute byte offset in the file
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return _ST_DTYPES[self.st_dtype][0]

    @property
    def dtype_id(self) -> int:
        return _ST_DTYPES[self.st_dtype][1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read_flat(self, first: int, count: int) -> np.ndarray:
        """Elements first..first+count-1 of the flattened tensor, a fresh 1-D array."""
        if first < 0 or count < 0 or first + count > self.numel:
            raise ConversionError(f"internal: read past tensor {self.name}")
        dt = self.np_dtype
        out = np.empty(count, dtype=dt)
        mv = memoryview(out.view(np.uint8))
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.start + first * dt.itemsize)
            got = 0
            while got < len(mv):
                r = f.readinto(mv[got:])
                if not r:
                    raise ConversionError(f"{self.path}: file ends inside tensor {self.name} "
                                          "(truncated download?)")
                got += r
        return out

    def read_rows(self, row0: int, nrows: int, ncols: int) -> np.ndarray:
        """Rows row0.. of the tensor viewed as [-1, ncols], shape (nrows, ncols)."""
        return self.read_flat(row0 * ncols, nrows * ncols).reshape(nrows, ncols)


def _read_st_header(path: str) -> dict[str, SrcTensor]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ConversionError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise ConversionError(f"{path}: not a safetensors file (bad header length {n})")
        try:
            meta = json.loads(f.read(n))
        except ValueError as e:
            raise ConversionError(f"{path}: safetensors header is not JSON: {e}") from None
    base = 8 + n
    out = {}
    for name, d in meta.items():
        if name == "__metadata__":
            continue
        b, e = d["data_offsets"]
        shape = tuple(int(x) for x in d["shape"])
        t = SrcTensor(name, path, d["dtype"], shape, base + b, e - b)
        if base + e > size:
            raise ConversionError(f"{path}: tensor {name} lies past the end of the file "
                                  "(truncated download?)")
        if d["dtype"] in _ST_DTYPES and t.numel * t.np_dtype.itemsize != t.nbytes:
            raise ConversionError(f"{path}: tensor {name}: byte size does not match its shape")
        out[name] = t
    return out


class Checkpoint:
    """Tensor name -> SrcTensor over a single or sharded safetensors checkpoint."""

    def __init__(self, model_dir: str):
        self.dir = model_dir
        idx = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        self.tensors: dict[str, SrcTensor] = {}
        self.used: set[str] = set()
        if os.path.exists(idx):
            with open(idx) as f:
                wmap = json.load(f).get("weight_map")
            if not isinstance(wmap, dict):
                raise ConversionError(f"{idx}: no weight_map")
            headers = {}
            for fname in sorted(set(wmap.values())):
                p = os.path.join(model_dir, fname)
                if not os.path.exists(p):
                    raise ConversionError(f"{idx} names shard {fname}, which is not in "
                                          f"{model_dir}")
                headers[fname] = _read_st_header(p)
            for name, fname in wmap.items():
                if name not in headers[fname]:
                    raise ConversionError(f"{idx} puts tensor {name} in {fname}, but that "
                                          "shard does not hold it")
                self.tensors[name] = headers[fname][name]
        elif os.path.exists(single):
            self.tensors = _read_st_header(single)
        else:
            shards = sorted(x for x in os.listdir(model_dir) if x.endswith(".safetensors"))
            if not shards:
                hint = (" (found PyTorch .bin weights: re-save them as safetensors with "
                        "save_pretrained(..., safe_serialization=True))"
                        if any(x.endswith(".bin") for x in os.listdir(model_dir)) else "")
                raise ConversionError(f"no *.safetensors weights in {model_dir}{hint}")
            for s in shards:
                for name, t in _read_st_header(os.path.join(model_dir, s)).items():
                    if name in self.tensors:
                        raise ConversionError(f"tensor {name} appears in two shards")
                    self.tensors[name] = t

    def get(self, name: str, shape: tuple[int, ...]) -> SrcTensor:
        t = self.tensors.get(name)
        if t is None:
            raise ConversionError(f"missing tensor {name!r} in {self.dir} "
                                  "(incomplete or not a Mixtral checkpoint)")
        if t.st_dtype not in _ST_DTYPES:
            raise ConversionError(f"tensor {name!r} has dtype {t.st_dtype}; the converter "
                                  "reads F32, F16 and BF16 checkpoints")
        if t.shape != tuple(shape):
            raise ConversionError(f"tensor {name!r} has shape {list(t.shape)}, expected "
                                  f"{list(shape)} from config.json")
        self.used.add(name)
        return t

    def unused(self) -> list[str]:
        skip = ("rotary_emb.inv_freq", "lm_head.weight")   # derived, or tied
        return sorted(n for n in self.tensors if n not in self.used and not n.endswith(skip))

    def has(self, name: str) -> bool:
        return name in self.tensors


# --------------------------------------------------------------------------- config

@dataclass
class MixtralSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    sliding_window: int
    tie_word_embeddings: bool


def _cfg_int(cfg: dict, key: str, default=None) -> int:
    v = cfg.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ConversionError(f"config.json: {key} must be an integer, got {v!r}")
    if v < 1:
        raise ConversionError(f"config.json: {key} must be >= 1, got {v}")
    return int(v)


def read_config(model_dir: str) -> MixtralSpec:
    """Parse config.json (transformers 4 or 5 style) of a Mixtral checkpoint."""
    p = os.path.join(model_dir, "config.json")
    if not os.path.isfile(p):
        raise ConversionError(f"no config.json in {model_dir}: give the folder of a Hugging "
                              "Face checkpoint")
    with open(p) as f:
        cfg = json.load(f)
    mt = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if mt != "mixtral" and "MixtralForCausalLM" not in archs:
        what = mt or (archs[0] if archs else "unknown")
        raise ConversionError(f"unsupported architecture {what!r} (model_type={mt!r}, "
                              f"architectures={archs}); supported: {SUPPORTED}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"config.json: hidden_act {act!r}; colibri runs silu experts only")

    H = _cfg_int(cfg, "hidden_size")
    nh = _cfg_int(cfg, "num_attention_heads")
    nkv = _cfg_int(cfg, "num_key_value_heads", nh)
    hd = cfg.get("head_dim")
    if hd is None:
        if H % nh:
            raise ConversionError(f"config.json: head_dim is missing and hidden_size {H} is "
                                  f"not a multiple of num_attention_heads {nh}")
        hd = H // nh
    hd = _cfg_int({"head_dim": hd}, "head_dim")
    if hd % 2:
        raise ConversionError(f"config.json: head_dim {hd} is odd; RoPE needs an even head_dim")
    if nh % nkv:
        raise ConversionError(f"config.json: num_attention_heads {nh} is not a multiple of "
                              f"num_key_value_heads {nkv}")

    # RoPE: transformers 5 writes rope_parameters {rope_theta, rope_type}; 4 writes
    # rope_theta and rope_scaling. Only the default (unscaled) RoPE is supported.
    rp = cfg.get("rope_parameters")
    theta = None
    if rp is not None:
        if not isinstance(rp, dict) or any(isinstance(v, dict) for v in rp.values()):
            raise ConversionError(f"config.json: rope_parameters {rp!r} not understood "
                                  "(expected {rope_theta, rope_type})")
        rtype = rp.get("rope_type", rp.get("type", "default"))
        if rtype != "default":
            raise ConversionError(f"config.json: rope_type {rtype!r}; version 1 of the format "
                                  "supports only the default RoPE (no scaling)")
        extra = set(rp) - {"rope_theta", "rope_type", "type"}
        if extra:
            raise ConversionError(f"config.json: rope_parameters has {sorted(extra)}, which "
                                  "colibri does not implement")
        theta = rp.get("rope_theta")
    rs = cfg.get("rope_scaling")
    if rs is not None:
        rtype = rs.get("rope_type", rs.get("type")) if isinstance(rs, dict) else rs
        if rtype != "default":
            raise ConversionError(f"config.json: rope_scaling {rs!r}; version 1 of the format "
                                  "supports only the default RoPE (no scaling)")
    if theta is None:
        theta = cfg.get("rope_theta", 1e6)   # MixtralConfig's default
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConversionError(f"config.json: rope_theta must be a positive number, got {theta!r}")

    sw = cfg.get("sliding_window")
    sw = 0 if sw is None else int(sw)
    if sw < 0:
        raise ConversionError(f"config.json: sliding_window {sw} < 0")
    E = _cfg_int(cfg, "num_local_experts")
    k = _cfg_int(cfg, "num_experts_per_tok")
    if k > E:
        raise ConversionError(f"config.json: num_experts_per_tok {k} > num_local_experts {E}")
    eps = cfg.get("rms_norm_eps", 1e-5)
    spec = MixtralSpec(
        vocab_size=_cfg_int(cfg, "vocab_size"), hidden_size=H,
        intermediate_size=_cfg_int(cfg, "intermediate_size"),
        n_layers=_cfg_int(cfg, "num_hidden_layers"), n_heads=nh, n_kv_heads=nkv, head_dim=hd,
        n_experts=E, top_k=k, rms_norm_eps=float(eps), rope_theta=float(theta),
        max_position_embeddings=_cfg_int(cfg, "max_position_embeddings"),
        sliding_window=sw, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    for name in ("hidden_size", "intermediate_size", "vocab_size", "n_layers", "n_experts"):
        if getattr(spec, name) > fmt.U32_MAX:
            raise ConversionError(f"config.json: {name} does not fit the format's u32")
    return spec


# --------------------------------------------------------------------------- tokenizer

def _tokenizer_section(model_dir: str, say: Callable[[str], None]):
    """(section bytes, metadata dict) — empty section and type 'none' without tokenizer.model."""
    none = {"tokenizer.type": "none", "tokenizer.bos_id": -1, "tokenizer.eos_id": -1,
            "tokenizer.unk_id": -1, "tokenizer.pad_id": -1}
    path = os.path.join(model_dir, "tokenizer.model")
    if not os.path.isfile(path):
        say(f"note: no tokenizer.model in {model_dir}; writing a file without a tokenizer "
            "(the engine then runs on token ids only)")
        return b"", none
    from ._spm import build_tokenizer_section

    data, info = build_tokenizer_section(path)
    # Keys named "tokenizer.*" go to the metadata; others (n_pieces) are information.
    meta = {k: v for k, v in info.items() if k.startswith("tokenizer.")}
    if "n_pieces" in info:
        say(f"tokenizer: {info['n_pieces']} pieces, type {meta.get('tokenizer.type')}")
    for k in ("tokenizer.type", "tokenizer.bos_id", "tokenizer.eos_id", "tokenizer.unk_id",
              "tokenizer.pad_id"):
        if k not in meta:
            raise ConversionError(f"internal: tokenizer builder did not return {k}")
    return bytes(data), meta


def _tokenizer_meta_entries(meta: dict) -> list[tuple[str, MetaValue]]:
    out = [("tokenizer.type", MetaValue(fmt.MT_STRING, str(meta["tokenizer.type"])))]
    for k in ("bos_id", "eos_id", "unk_id", "pad_id"):
        v = meta[f"tokenizer.{k}"]
        out.append((f"tokenizer.{k}", MetaValue(fmt.MT_I32, -1 if v is None else int(v))))
    for k, v in meta.items():
        if any(k == key for key, _ in out):
            continue
        if isinstance(v, MetaValue):
            out.append((k, v))
        elif isinstance(v, bool):
            out.append((k, MetaValue(fmt.MT_BOOL, v)))
        elif isinstance(v, int):
            out.append((k, MetaValue(fmt.MT_U32 if 0 <= v <= fmt.U32_MAX else fmt.MT_I64, v)))
        elif isinstance(v, float):
            out.append((k, MetaValue(fmt.MT_F64, v)))
        elif isinstance(v, str):
            out.append((k, MetaValue(fmt.MT_STRING, v)))
        # anything else (lists, dicts) stays out of the metadata
    return out


# --------------------------------------------------------------------------- planning

Chunk = tuple[np.ndarray, float]   # (stored values, their sum of squares in f64)


@dataclass
class PlannedTensor:
    name: str
    dtype: int
    layout: int
    shape: tuple[int, ...]
    section: int
    produce: Callable[[], Iterator[Chunk]]   # yields the stored bytes front to back
    offset: int = 0
    crc: int = 0
    l2norm: float = 0.0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def _to_stored(x: np.ndarray, src_dtype: int, dst_dtype: int) -> np.ndarray:
    """Source storage values -> destination storage values (bit-exact when equal)."""
    if src_dtype == dst_dtype:
        return np.ascontiguousarray(x)
    return fmt.f32_to_stored(fmt.stored_to_f32(np.ascontiguousarray(x), src_dtype), dst_dtype)


def _with_sumsq(stored: np.ndarray, dtype: int) -> Chunk:
    return stored, fmt.sumsq_f64(fmt.stored_to_f32(stored, dtype))


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


def _expert_sources(ck: Checkpoint, layer: int, E: int, I: int, H: int) -> list[ExpertSource]:
    """Hub-style per-expert keys (w1/w2/w3) or fused gate_up_proj [E, 2I, H] (gate rows
    first, then up, as transformers' MixtralExperts) + down_proj [E, H, I]."""
    for moe in ("block_sparse_moe", "mlp"):
        p = f"model.layers.{layer}.{moe}.experts"
        if ck.has(f"{p}.gate_up_proj") or ck.has(f"{p}.down_proj"):
            gu = ck.get(f"{p}.gate_up_proj", (E, 2 * I, H))
            dn = ck.get(f"{p}.down_proj", (E, H, I))
            return [ExpertSource((gu, e * 2 * I), (gu, e * 2 * I + I), (dn, e * H))
                    for e in range(E)]
    p = f"model.layers.{layer}.block_sparse_moe.experts"
    if not ck.has(f"{p}.0.w1.weight") and ck.has(f"model.layers.{layer}.mlp.experts.0.w1.weight"):
        p = f"model.layers.{layer}.mlp.experts"
    return [ExpertSource((ck.get(f"{p}.{e}.w1.weight", (I, H)), 0),
                         (ck.get(f"{p}.{e}.w3.weight", (I, H)), 0),
                         (ck.get(f"{p}.{e}.w2.weight", (H, I)), 0)) for e in range(E)]


def _router_source(ck: Checkpoint, layer: int, E: int, H: int) -> SrcTensor:
    for moe in ("block_sparse_moe", "mlp"):
        n = f"model.layers.{layer}.{moe}.gate.weight"
        if ck.has(n):
            return ck.get(n, (E, H))
    return ck.get(f"model.layers.{layer}.block_sparse_moe.gate.weight", (E, H))


def plan_tensors(ck: Checkpoint, s: MixtralSpec, W: int, int8_router: bool,
                 B: int) -> list[PlannedTensor]:
    """Every tensor of the output in file order, with its source checked (name, shape)."""
    V, H, I, E = s.vocab_size, s.hidden_size, s.intermediate_size, s.n_experts
    nq, nkv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    D, R, X = fmt.SECTION_DENSE, fmt.SECTION_ROUTER, fmt.SECTION_EXPERTS
    out: list[PlannedTensor] = []

    def dense(name, src_name, shape):
        src = ck.get(src_name, shape)
        out.append(PlannedTensor(name, W, LAYOUT_ROW_MAJOR, shape, D, _dense_producer(src, W)))

    def norm(name, src_name):
        src = ck.get(src_name, (H,))
        out.append(PlannedTensor(name, DTYPE_F32, LAYOUT_ROW_MAJOR, (H,), D, _norm_producer(src)))

    dense("token_embd.weight", "model.embed_tokens.weight", (V, H))
    for n in range(s.n_layers):
        p = f"model.layers.{n}"
        if ck.has(f"{p}.self_attn.q_proj.bias") or ck.has(f"{p}.self_attn.o_proj.bias"):
            raise ConversionError(f"{p}.self_attn has biases; Mixtral attention has none and "
                                  "colibri does not run them")
        norm(f"blk.{n}.attn_norm.weight", f"{p}.input_layernorm.weight")
        dense(f"blk.{n}.attn_q.weight", f"{p}.self_attn.q_proj.weight", (nq, H))
        dense(f"blk.{n}.attn_k.weight", f"{p}.self_attn.k_proj.weight", (nkv, H))
        dense(f"blk.{n}.attn_v.weight", f"{p}.self_attn.v_proj.weight", (nkv, H))
        dense(f"blk.{n}.attn_output.weight", f"{p}.self_attn.o_proj.weight", (H, nq))
        norm(f"blk.{n}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight")
    norm("output_norm.weight", "model.norm.weight")
    if not s.tie_word_embeddings:
        dense("output.weight", "lm_head.weight", (V, H))
    for n in range(s.n_layers):
        src = _router_source(ck, n, E, H)
        name = f"blk.{n}.ffn_gate_inp"
        if int8_router:
            r = _RouterInt8(src)
            out.append(PlannedTensor(f"{name}.weight", DTYPE_I8, LAYOUT_ROW_MAJOR, (E, H), R,
                                     r.producer("q")))
            out.append(PlannedTensor(f"{name}.scale", DTYPE_F32, LAYOUT_ROW_MAJOR, (E,), R,
                                     r.producer("scale")))
            out.append(PlannedTensor(f"{name}.zero", DTYPE_F32, LAYOUT_ROW_MAJOR, (E,), R,
                                     r.producer("zero")))
        else:
            out.append(PlannedTensor(f"{name}.weight", W, LAYOUT_ROW_MAJOR, (E, H), R,
                                     _dense_producer(src, W)))
    for n in range(s.n_layers):
        srcs = _expert_sources(ck, n, E, I, H)
        out.append(PlannedTensor(f"blk.{n}.ffn_experts", W, LAYOUT_EXPERTS_PACKED,
                                 (E, 3 * I, H), X, _experts_producer(srcs, I, H, B, W)))
    return out


def build_metadata(s: MixtralSpec, name: str, W: int, int8_router: bool, B: int,
                   max_seq_len: int, tok_meta: dict) -> bytes:
    wname = fmt.DTYPE_NAMES[W]
    M = MetaValue
    entries = [
        ("general.architecture", M(fmt.MT_STRING, "mixtral")),
        ("general.name", M(fmt.MT_STRING, name)),
        ("model.n_layers", M(fmt.MT_U32, s.n_layers)),
        ("model.hidden_size", M(fmt.MT_U32, s.hidden_size)),
        ("model.intermediate_size", M(fmt.MT_U32, s.intermediate_size)),
        ("model.vocab_size", M(fmt.MT_U32, s.vocab_size)),
        ("model.n_heads", M(fmt.MT_U32, s.n_heads)),
        ("model.n_kv_heads", M(fmt.MT_U32, s.n_kv_heads)),
        ("model.head_dim", M(fmt.MT_U32, s.head_dim)),
        ("model.n_experts", M(fmt.MT_U32, s.n_experts)),
        ("model.top_k", M(fmt.MT_U32, s.top_k)),
        ("model.norm_topk_prob", M(fmt.MT_BOOL, True)),
        ("model.rms_norm_eps", M(fmt.MT_F64, s.rms_norm_eps)),
        ("model.rope_theta", M(fmt.MT_F64, s.rope_theta)),
        ("model.rope_type", M(fmt.MT_STRING, "default")),
        ("model.max_position_embeddings", M(fmt.MT_U64, s.max_position_embeddings)),
        ("model.sliding_window", M(fmt.MT_U64, s.sliding_window)),
        ("model.tie_word_embeddings", M(fmt.MT_BOOL, s.tie_word_embeddings)),
        ("model.max_seq_len", M(fmt.MT_U64, max_seq_len)),
        ("model.router_dtype", M(fmt.MT_STRING, "int8" if int8_router else wname)),
        ("model.weight_dtype", M(fmt.MT_STRING, wname)),
        *_tokenizer_meta_entries(tok_meta),
        ("convert.block_size", M(fmt.MT_U32, B)),
        ("convert.source", M(fmt.MT_STRING, f"{CONVERTER_NAME} {_version()}")),
    ]
    return fmt.encode_metadata(entries)


# --------------------------------------------------------------------------- writing

class _Out:
    """Sequential writer that keeps the CRC of the current section."""

    def __init__(self, f):
        self.f, self.pos, self.crc = f, 0, 0

    def write(self, data, count_crc: bool = True) -> None:
        mv = memoryview(data).cast("B")
        self.f.write(mv)
        if count_crc:
            self.crc = fmt.crc32(mv, self.crc)
        self.pos += len(mv)

    def pad_to(self, offset: int, count_crc: bool) -> None:
        if offset < self.pos:
            raise ConversionError("internal: layout went backwards")
        if offset > self.pos:
            self.write(bytes(offset - self.pos), count_crc)


def convert(model_dir, output_path, *, dtype: str = "bf16", quantize_router: str | None = None,
            block_size: int = fmt.DEFAULT_BLOCK_SIZE, max_seq_len: int | None = None,
            progress: bool = True) -> str:
    """Convert the Hugging Face Mixtral checkpoint in `model_dir` to `output_path`.

    dtype: weight dtype "f32", "f16" or "bf16" (1-D norm weights are always f32).
    quantize_router: None/"none" (routers in `dtype`) or "int8".
    block_size: row block B of the packed expert layout.
    max_seq_len: written to the header; default the config's max_position_embeddings.
    progress: print stages and a progress bar to stderr.
    Returns the output path. Raises ConversionError (a ValueError) on a bad checkpoint
    or argument; on any error no output (and no OUT.tmp) is left behind.
    """
    fmt.require_little_endian()
    model_dir = os.fspath(model_dir)
    output_path = os.fspath(output_path)
    if dtype not in ("f32", "f16", "bf16"):
        raise ConversionError(f"dtype {dtype!r}: choose f32, f16 or bf16")
    if quantize_router not in (None, "none", "int8"):
        raise ConversionError(f"quantize_router {quantize_router!r}: choose none or int8")
    int8_router = quantize_router == "int8"
    if isinstance(block_size, bool) or not isinstance(block_size, int) or \
            not 1 <= block_size <= fmt.U32_MAX:
        raise ConversionError(f"block_size {block_size!r}: must be an integer >= 1")
    if not os.path.isdir(model_dir):
        raise ConversionError(f"{model_dir} is not a folder; give a Hugging Face checkpoint "
                              "folder (config.json + *.safetensors)")
    W = DTYPE_IDS[dtype]

    say = _Say(progress)
    say.stage(1, "reading config")
    spec = read_config(model_dir)
    msl = spec.max_position_embeddings if max_seq_len is None else max_seq_len
    if isinstance(msl, bool) or not isinstance(msl, int) or not 1 <= msl <= fmt.U32_MAX:
        raise ConversionError(f"max_seq_len {msl!r}: must be an integer in 1..{fmt.U32_MAX}")
    ck = Checkpoint(model_dir)
    tensors = plan_tensors(ck, spec, W, int8_router, block_size)
    extra = ck.unused()
    if extra:
        warnings.warn(f"{len(extra)} checkpoint tensors are not used by a Mixtral model and "
                      f"are left out: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}",
                      RuntimeWarning, stacklevel=2)

    say.stage(2, "tokenizer")
    tok_bytes, tok_meta = _tokenizer_section(model_dir, say)

    name = os.path.basename(os.path.normpath(os.path.abspath(model_dir)))
    meta = build_metadata(spec, name, W, int8_router, block_size, msl, tok_meta)

    # ---- layout
    A = fmt.ALIGNMENT
    sec = [[0, 0, 0] for _ in range(fmt.N_SECTIONS)]   # offset, size, crc
    sec[0][:2] = [fmt.align_up(fmt.HEADER_SIZE, fmt.SMALL_SECTION_ALIGNMENT), len(meta)]
    dir_size = 8 + sum(fmt.tensor_record_size(t.name) for t in tensors)
    sec[1][:2] = [fmt.align_up(sum(sec[0][:2]), fmt.SMALL_SECTION_ALIGNMENT), dir_size]
    sec[2][:2] = [fmt.align_up(sum(sec[1][:2]), fmt.SMALL_SECTION_ALIGNMENT), len(tok_bytes)]
    end = sum(sec[2][:2])
    for k in fmt.WEIGHT_SECTIONS:
        start = fmt.align_up(end, fmt.SECTION_ALIGNMENT)
        cur = start
        for t in tensors:
            if t.section == k:
                t.offset = fmt.align_up(cur, A)
                cur = t.offset + t.nbytes
        sec[k][:2] = [start, cur - start]
        end = cur
    file_size = end

    tmp = output_path + ".tmp"
    parent = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(parent):
        raise ConversionError(f"output folder {parent} does not exist")
    try:
        with open(tmp, "wb") as f:
            o = _Out(f)
            o.write(bytes(fmt.HEADER_SIZE), False)           # patched at the end
            o.pad_to(sec[0][0], False)
            o.write(meta)
            sec[0][2], o.crc = o.crc, 0
            o.pad_to(sec[1][0], False)
            o.write(bytes(dir_size), False)                   # patched at the end
            o.pad_to(sec[2][0], False)
            o.write(tok_bytes)
            sec[2][2], o.crc = o.crc, 0

            stages = {fmt.SECTION_DENSE: (3, "dense weights"), fmt.SECTION_ROUTER: (4, "routers"),
                      fmt.SECTION_EXPERTS: (5, "experts")}
            for k in fmt.WEIGHT_SECTIONS:
                i, what = stages[k]
                say.stage(i, what)
                bar = say.bar(sum(t.nbytes for t in tensors if t.section == k), what)
                o.pad_to(sec[k][0], False)
                o.crc = 0
                for t in (t for t in tensors if t.section == k):
                    o.pad_to(t.offset, True)
                    tcrc, ss, n = 0, 0.0, 0
                    for chunk, chunk_ss in t.produce():
                        if chunk.dtype != DTYPE_NUMPY[t.dtype]:
                            raise ConversionError(f"internal: {t.name} chunk dtype {chunk.dtype}")
                        chunk = np.ascontiguousarray(chunk)
                        o.write(chunk)
                        tcrc = fmt.crc32(chunk, tcrc)
                        ss += chunk_ss
                        n += chunk.nbytes
                        bar.update(chunk.nbytes)
                    if n != t.nbytes:
                        raise ConversionError(f"internal: {t.name} wrote {n} of {t.nbytes} bytes")
                    t.crc, t.l2norm = tcrc, math.sqrt(ss)
                if o.pos != sec[k][0] + sec[k][1]:
                    raise ConversionError("internal: section size mismatch")
                sec[k][2] = o.crc
                bar.close()
            if o.pos != file_size:
                raise ConversionError("internal: file size mismatch")

            say.stage(6, "finalising checksums")
            directory = struct.pack("<Q", len(tensors)) + b"".join(
                fmt.encode_tensor_record(t.name, t.dtype, t.layout, t.shape, t.crc, t.offset,
                                         t.nbytes, t.l2norm) for t in tensors)
            assert len(directory) == dir_size
            sec[1][2] = fmt.crc32(directory)
            f.seek(sec[1][0])
            f.write(directory)
            fields = {"n_experts": spec.n_experts, "top_k": spec.top_k,
                      "hidden_size": spec.hidden_size,
                      "intermediate_size": spec.intermediate_size,
                      "vocab_size": spec.vocab_size, "max_seq_len": msl,
                      "n_layers": spec.n_layers,
                      "flags": (fmt.FLAG_ROUTER_INT8 if int8_router else 0)
                      | (fmt.FLAG_TIED_EMBEDDINGS if spec.tie_word_embeddings else 0)}
            f.seek(0)
            f.write(fmt.encode_header(fields, [tuple(s) for s in sec], file_size, A, block_size))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, output_path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    say(f"wrote {output_path} ({file_size:,} bytes, {len(tensors)} tensors)")
    return output_path


class _Say:
    """Stage lines and a tqdm bar on stderr, or nothing when progress is off."""

    N_STAGES = 6

    def __init__(self, on: bool):
        self.on = on

    def __call__(self, msg: str) -> None:
        if self.on:
            print(msg, file=sys.stderr, flush=True)

    def stage(self, i: int, what: str) -> None:
        self(f"[{i}/{self.N_STAGES}] {what}")

    def bar(self, total: int, desc: str):
        if not self.on:
            return _NoBar()
        try:
            from tqdm import tqdm
        except ImportError:
            return _NoBar()
        return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                    desc=desc, file=sys.stderr, dynamic_ncols=True)


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


# --------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="colibri-convert",
        description="Convert a Hugging Face Mixtral checkpoint folder into a .colibri file.")
    p.add_argument("--model_name_or_path", required=True,
                   help="checkpoint folder: config.json, *.safetensors, optional tokenizer.model")
    p.add_argument("--output_path", required=True, help="the .colibri file to write")
    p.add_argument("--dtype", choices=["f32", "f16", "bf16"], default="bf16",
                   help="weight dtype (norm weights are always f32); default bf16")
    p.add_argument("--quantize_router", choices=["none", "int8"], default="none",
                   help="store router weights as int8 with per-row scale/zero; default none")
    p.add_argument("--block_size", type=int, default=fmt.DEFAULT_BLOCK_SIZE,
                   help="row block of the packed expert layout; default 32")
    p.add_argument("--max_seq_len", type=int, default=None,
                   help="longest sequence; default the config's max_position_embeddings")
    p.add_argument("--quiet", action="store_true", help="no stages, no progress bar")
    a = p.parse_args(argv)
    try:
        convert(a.model_name_or_path, a.output_path, dtype=a.dtype,
                quantize_router=a.quantize_router, block_size=a.block_size,
                max_seq_len=a.max_seq_len, progress=not a.quiet)
    except (ConversionError, fmt.FormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
