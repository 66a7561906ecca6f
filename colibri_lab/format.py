"""The `.colibri` file format, version 1 (docs/format.md): constants, encoders, and a
pure-Python reader.

What lives here:

- the numeric constants of the format (dtype ids, layout ids, metadata value types,
  section names, header offsets), so the converter, the bindings and the tests all use
  one definition;
- the low-level encoders the converter uses (`encode_metadata`, `encode_tensor_record`,
  `encode_header`, `align_up`, `f32_to_bf16_bits`, `quantize_router_int8`);
- `inspect(path)`, a reader that validates a file the way the engine does (magic,
  version, header CRC, sizes, bounds, section order, small-section CRCs, record
  constraints) without the engine, and returns a `ColibriInfo` that prints as a
  readable summary and shows as an HTML table in a notebook.

Every failure of the reader raises `FormatError` (a `ValueError`) whose message names
the field and says what was expected.
"""

from __future__ import annotations

import html
import math
import os
import struct
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

# --------------------------------------------------------------------------- constants

MAGIC = b"COLIBRI\x00"
# Version 2 added block-quantized tensor dtypes and the split expert FFN (docs/format.md,
# "Version 2"); writers write 1 for a file that uses neither, so older readers keep
# reading float files. Readers read both.
VERSION = 2
READ_VERSIONS = (1, 2)
HEADER_SIZE = 256
ALIGNMENT = 64            # tensor data alignment written by the converter
SECTION_ALIGNMENT = 4096  # start of the dense, router and experts sections
SMALL_SECTION_ALIGNMENT = 64
DEFAULT_BLOCK_SIZE = 32

# dtypes: id -> (name, bytes per element)
DTYPE_F32 = 0
DTYPE_F16 = 1
DTYPE_BF16 = 2
DTYPE_I8 = 3
# block-quantized types, byte-compatible with ggml's blocks (docs/format.md, "Quantized
# dtypes"); ids 4..6 are the engine's array-only types and never appear in a file
DTYPE_Q8_0 = 7
DTYPE_Q4_K = 8
DTYPE_Q5_K = 9
DTYPE_Q6_K = 10
# OCP MXFP4 as ggml's block_mxfp4: an e8m0 scale byte, then 16 bytes of e2m1 nibbles
DTYPE_MXFP4 = 11
DTYPE_NAMES = {DTYPE_F32: "f32", DTYPE_F16: "f16", DTYPE_BF16: "bf16", DTYPE_I8: "i8",
               DTYPE_Q8_0: "q8_0", DTYPE_Q4_K: "q4_k", DTYPE_Q5_K: "q5_k", DTYPE_Q6_K: "q6_k",
               DTYPE_MXFP4: "mxfp4"}
DTYPE_IDS = {v: k for k, v in DTYPE_NAMES.items()}
# elements per block and bytes per block; a float type is a block of one element
DTYPE_BLOCKS = {DTYPE_F32: (1, 4), DTYPE_F16: (1, 2), DTYPE_BF16: (1, 2), DTYPE_I8: (1, 1),
                DTYPE_Q8_0: (32, 34), DTYPE_Q4_K: (256, 144), DTYPE_Q5_K: (256, 176),
                DTYPE_Q6_K: (256, 210), DTYPE_MXFP4: (32, 17)}
QUANT_DTYPES = (DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K, DTYPE_MXFP4)
# bytes per element of the element types (the block types have no element size)
DTYPE_SIZES = {d: bb for d, (be, bb) in DTYPE_BLOCKS.items() if be == 1}
# numpy storage type of each dtype (bf16 is kept as its raw uint16 bits; a quantized
# tensor as its raw bytes, [rows, row bytes])
DTYPE_NUMPY = {DTYPE_F32: np.dtype("<f4"), DTYPE_F16: np.dtype("<f2"),
               DTYPE_BF16: np.dtype("<u2"), DTYPE_I8: np.dtype("i1"),
               **{q: np.dtype("u1") for q in QUANT_DTYPES}}


def row_nbytes(dtype: int, n: int) -> int:
    """Bytes of one row of n elements (n must be a whole number of the dtype's blocks)."""
    be, bb = DTYPE_BLOCKS[dtype]
    if n % be:
        raise FormatError(f"a {DTYPE_NAMES[dtype]} row holds whole blocks of {be} "
                          f"elements; {n} is not a multiple of {be}")
    return n // be * bb


def tensor_nbytes(dtype: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor: rows (every dim but the last) x row_nbytes(last dim)."""
    return math.prod(shape[:-1]) * row_nbytes(dtype, shape[-1])


def stored_shape(dtype: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The numpy shape of a tensor's stored values: `shape`, or for a quantized dtype
    (rows..., row bytes)."""
    if dtype in QUANT_DTYPES:
        return tuple(shape[:-1]) + (row_nbytes(dtype, shape[-1]),)
    return tuple(shape)

# layouts
LAYOUT_ROW_MAJOR = 0
LAYOUT_EXPERTS_PACKED = 1
LAYOUT_NAMES = {LAYOUT_ROW_MAJOR: "row_major", LAYOUT_EXPERTS_PACKED: "experts_packed"}

# metadata value types
MT_U32 = 0
MT_I32 = 1
MT_F32 = 2
MT_BOOL = 3
MT_STRING = 4
MT_U64 = 5
MT_I64 = 6
MT_F64 = 7
MT_ARRAY = 8
META_TYPE_NAMES = {MT_U32: "u32", MT_I32: "i32", MT_F32: "f32", MT_BOOL: "bool",
                   MT_STRING: "string", MT_U64: "u64", MT_I64: "i64", MT_F64: "f64",
                   MT_ARRAY: "array"}
# scalar types: struct format
_META_SCALAR = {MT_U32: "<I", MT_I32: "<i", MT_F32: "<f", MT_BOOL: "<B",
                MT_U64: "<Q", MT_I64: "<q", MT_F64: "<d"}
MAX_KEY_LEN = 1024
MAX_NAME_LEN = 256
MAX_DIMS = 4

# header flags
FLAG_ROUTER_INT8 = 1 << 0
FLAG_TIED_EMBEDDINGS = 1 << 1
KNOWN_FLAGS = FLAG_ROUTER_INT8 | FLAG_TIED_EMBEDDINGS

# sections, in file order
SECTION_METADATA = 0
SECTION_TENSORS = 1
SECTION_TOKENIZER = 2
SECTION_DENSE = 3
SECTION_ROUTER = 4
SECTION_EXPERTS = 5
SECTION_NAMES = ("metadata", "tensor_directory", "tokenizer", "dense", "router", "experts")
N_SECTIONS = 6
# sections whose CRC the engine checks at start-up (the small ones)
SMALL_SECTIONS = (SECTION_METADATA, SECTION_TENSORS, SECTION_TOKENIZER)
WEIGHT_SECTIONS = (SECTION_DENSE, SECTION_ROUTER, SECTION_EXPERTS)

# header layout: offsets of the fields
_HDR_FIXED = struct.Struct("<8sIIQIIIIIIII")   # magic .. flags, 56 bytes
_SECTION = struct.Struct("<QQII")              # 24 bytes
_HDR_TAIL = struct.Struct("<II")               # alignment, block_size at 200
HDR_SECTIONS_OFFSET = 56
HDR_ALIGNMENT_OFFSET = 200
HDR_CRC_OFFSET = 252
assert _HDR_FIXED.size == HDR_SECTIONS_OFFSET
assert HDR_SECTIONS_OFFSET + N_SECTIONS * _SECTION.size == HDR_ALIGNMENT_OFFSET

# tensor record: after the name
_REC_HEAD = struct.Struct("<IIII")   # dtype, layout, n_dims, crc32
_REC_TAIL = struct.Struct("<4QQQd")  # dims[4], offset, nbytes, l2norm
TENSOR_RECORD_FIXED = 4 + _REC_HEAD.size + _REC_TAIL.size  # + name_len

HEADER_FIELDS = ("n_experts", "top_k", "hidden_size", "intermediate_size", "vocab_size",
                 "max_seq_len", "n_layers", "flags")


def _header_layout() -> tuple[tuple[int, int, str, str], ...]:
    """Every field of the 256-byte header as (offset, size, name, struct code), in file
    order, derived from the structs above (one definition; docs/format.md, "Header")."""
    rows, off = [], 0

    def add(name: str, code: str) -> None:
        nonlocal off
        size = struct.calcsize("<" + code)
        rows.append((off, size, name, code))
        off += size

    fixed_codes = ["8s", "I", "I", "Q"] + ["I"] * len(HEADER_FIELDS)
    for name, code in zip(("magic", "version", "header_size", "file_size") + HEADER_FIELDS,
                          fixed_codes):
        add(name, code)
    for s in SECTION_NAMES:
        for part, code in zip(("offset", "size", "crc32", "reserved"), ("Q", "Q", "I", "I")):
            add(f"sections.{s}.{part}", code)
    add("alignment", "I")
    add("block_size", "I")
    add("reserved", f"{HDR_CRC_OFFSET - off}s")
    add("header_crc32", "I")
    assert "".join(r[3] for r in rows[:len(fixed_codes)]) == _HDR_FIXED.format.lstrip("<")
    assert off == HEADER_SIZE
    return tuple(rows)


#: (offset, size, name, struct code) of every header field, for dumps and hex views.
HEADER_LAYOUT = _header_layout()

# The family-option metadata keys (docs/format.md, "Family options") and their defaults,
# which are Mixtral's behaviour. None = "model.sliding_window for every layer".
ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
FAMILY_OPTION_DEFAULTS: dict[str, Any] = {
    "model.layer_ffn": None,                      # ARRAY of U32, 1 MoE / 0 dense; None = all MoE
    "model.dense_intermediate_size": 0,
    "model.shared_expert_intermediate_size": 0,
    "model.shared_expert_gate": False,
    "model.attn_qkv_bias": False,
    "model.attn_output_bias": False,
    "model.attn_qk_norm": "none",                 # none | head | full
    "model.clip_qkv": 0.0,
    "model.layer_sliding_window": None,           # ARRAY of U64
}
QK_NORMS = ("none", "head", "full")

U32_MAX = 0xFFFFFFFF
U64_MAX = 0xFFFFFFFFFFFFFFFF


class FormatError(ValueError):
    """A file (or a value to be written) breaks the .colibri format."""


def require_little_endian() -> None:
    """The format is little-endian and so is every buffer we write straight from numpy."""
    if sys.byteorder != "little":
        raise FormatError("the .colibri format is little-endian and this host is big-endian; "
                          "convert and read .colibri files on a little-endian machine")


def align_up(offset: int, alignment: int) -> int:
    """As in the spec: the smallest multiple of `alignment` that is >= `offset`."""
    return offset + (alignment - (offset % alignment)) % alignment


def crc32(data, crc: int = 0) -> int:
    """CRC-32 as zlib.crc32 (accepts bytes, memoryview or a C-contiguous numpy array)."""
    return zlib.crc32(data, crc) & 0xFFFFFFFF


# --------------------------------------------------------------------------- numerics

def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16, nearest, ties to even, exactly like torch.

    Same algorithm as c10::round_to_nearest_even: NaN -> 0x7FC0 (sign kept as torch
    does: positive canonical NaN), else (bits + 0x7FFF + lsb) >> 16. Returns uint16 bits.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    bias = ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
    out = ((u + bias) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32, exact."""
    b = np.ascontiguousarray(b, dtype=np.uint16)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def stored_to_f32(raw: np.ndarray, dtype: int) -> np.ndarray:
    """Values as stored (numpy storage type of `dtype`) -> float32."""
    if dtype == DTYPE_BF16:
        return bf16_bits_to_f32(raw)
    if dtype in (DTYPE_F32, DTYPE_F16, DTYPE_I8):
        return raw.astype(np.float32, copy=False)
    raise FormatError(f"unknown dtype id {dtype}")


def f32_to_stored(x: np.ndarray, dtype: int) -> np.ndarray:
    """float32 values -> storage array of `dtype` (f32, f16 nearest-even, bf16 nearest-even)."""
    if dtype == DTYPE_F32:
        return np.ascontiguousarray(x, dtype="<f4")
    if dtype == DTYPE_F16:
        return np.ascontiguousarray(x.astype("<f2"))
    if dtype == DTYPE_BF16:
        return f32_to_bf16_bits(x)
    raise FormatError(f"cannot store float weights as dtype {DTYPE_NAMES.get(dtype, dtype)}")


def quantize_router_int8(w: np.ndarray):
    """Int8 router quantisation of docs/format.md, per row r of an [E, H] matrix.

    The range is widened to contain 0 (min_r = min(row, 0), max_r = max(row, 0)) so that
    the zero point is always representable; scale[r] = (max_r - min_r) / 255 (1 if that
    range is empty), stored as f32; zero[r] = clamp(round(-128 - min_r / scale[r]), -128, 127);
    q = clamp(round(w / scale[r]) + zero[r], -128, 127); round = half to even (np.rint).
    Arithmetic in f64 with the f32-rounded scale. Returns (q int8, scale f32, zero f32).
    Dequantisation: (q - zero) * scale, error <= scale/2 (plus f32 rounding).
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise FormatError("router weights to quantise must be 2-D [E, H]")
    w64 = w.astype(np.float64)
    mn = np.minimum(w64.min(axis=1), 0.0)
    mx = np.maximum(w64.max(axis=1), 0.0)
    rng = mx - mn
    scale = np.where(rng > 0, rng / 255.0, 1.0).astype(np.float32)
    s64 = scale.astype(np.float64)
    zero = np.clip(np.rint(-128.0 - mn / s64), -128, 127)
    q = np.clip(np.rint(w64 / s64[:, None]) + zero[:, None], -128, 127).astype(np.int8)
    return q, scale, zero.astype(np.float32)


def dequantize_router_int8(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """(q - zero) * scale in float32, as the engine computes it."""
    return ((q.astype(np.float32) - zero.astype(np.float32)[:, None])
            * scale.astype(np.float32)[:, None])


def sumsq_f64(x_f32: np.ndarray) -> float:
    """Sum of squares in f64 (for the per-tensor L2 norm; add chunk results, then sqrt)."""
    v = np.ascontiguousarray(x_f32, dtype=np.float64).reshape(-1)
    return float(np.dot(v, v))


# --------------------------------------------------------------------------- encoders

@dataclass(frozen=True)
class MetaValue:
    """A typed metadata value: `type` is one of MT_*; for MT_ARRAY `elem_type` is set."""
    type: int
    value: Any
    elem_type: int | None = None


def _encode_scalar(t: int, v: Any, key: str) -> bytes:
    if t == MT_STRING:
        b = str(v).encode("utf-8")
        if b"\x00" in b:
            raise FormatError(f"metadata {key!r}: strings may not contain NUL")
        return struct.pack("<Q", len(b)) + b
    if t == MT_BOOL:
        return struct.pack("<B", 1 if v else 0)
    fmt = _META_SCALAR.get(t)
    if fmt is None:
        raise FormatError(f"metadata {key!r}: unknown value type {t}")
    try:
        return struct.pack(fmt, v)
    except struct.error as e:
        raise FormatError(f"metadata {key!r}: value {v!r} does not fit {META_TYPE_NAMES[t]}: {e}")


def encode_metadata(entries: Iterable[tuple[str, MetaValue]]) -> bytes:
    """Encode the metadata section: u64 count, then entries packed back to back."""
    parts = []
    seen = set()
    n = 0
    for key, mv in entries:
        kb = key.encode("utf-8")
        if not 1 <= len(kb) <= MAX_KEY_LEN or b"\x00" in kb:
            raise FormatError(f"metadata key {key!r}: length must be 1..{MAX_KEY_LEN}, no NUL")
        if key in seen:
            raise FormatError(f"metadata key {key!r} given twice")
        seen.add(key)
        parts.append(struct.pack("<I", len(kb)) + kb + struct.pack("<I", mv.type))
        if mv.type == MT_ARRAY:
            et = mv.elem_type
            if et is None or et in (MT_ARRAY, MT_STRING) or et not in META_TYPE_NAMES:
                raise FormatError(f"metadata {key!r}: bad array element type {et}")
            vals = list(mv.value)
            parts.append(struct.pack("<IQ", et, len(vals)))
            parts.extend(_encode_scalar(et, v, key) for v in vals)
        else:
            parts.append(_encode_scalar(mv.type, mv.value, key))
        n += 1
    return struct.pack("<Q", n) + b"".join(parts)


def encode_tensor_record(name: str, dtype: int, layout: int, shape: tuple[int, ...],
                         crc: int, offset: int, nbytes: int, l2norm: float) -> bytes:
    nb = name.encode("ascii")
    if not 1 <= len(nb) <= MAX_NAME_LEN:
        raise FormatError(f"tensor name {name!r}: length must be 1..{MAX_NAME_LEN}")
    if not 1 <= len(shape) <= MAX_DIMS:
        raise FormatError(f"tensor {name!r}: 1..{MAX_DIMS} dims, got {shape}")
    dims = list(shape) + [1] * (MAX_DIMS - len(shape))
    return (struct.pack("<I", len(nb)) + nb
            + _REC_HEAD.pack(dtype, layout, len(shape), crc)
            + _REC_TAIL.pack(*dims, offset, nbytes, l2norm))


def tensor_record_size(name: str) -> int:
    return TENSOR_RECORD_FIXED + len(name.encode("ascii"))


def encode_header(fields: dict[str, int], sections: list[tuple[int, int, int]],
                  file_size: int, alignment: int, block_size: int,
                  version: int = VERSION) -> bytes:
    """The 256-byte header with its CRC. `sections`: 6 × (offset, size, crc32)."""
    if len(sections) != N_SECTIONS:
        raise FormatError("the header holds exactly 6 sections")
    if version not in READ_VERSIONS:
        raise FormatError(f"format version {version}: this writer writes {READ_VERSIONS}")
    b = bytearray(HEADER_SIZE)
    _HDR_FIXED.pack_into(b, 0, MAGIC, version, HEADER_SIZE, file_size,
                         *(fields[k] for k in HEADER_FIELDS))
    for i, (off, size, c) in enumerate(sections):
        _SECTION.pack_into(b, HDR_SECTIONS_OFFSET + i * _SECTION.size, off, size, c, 0)
    _HDR_TAIL.pack_into(b, HDR_ALIGNMENT_OFFSET, alignment, block_size)
    struct.pack_into("<I", b, HDR_CRC_OFFSET, crc32(bytes(b[:HDR_CRC_OFFSET])))
    return bytes(b)


# --------------------------------------------------------------------------- reader

@dataclass
class SectionInfo:
    name: str
    offset: int
    size: int
    crc32: int
    crc_ok: bool | None = None   # None: not checked (weight sections unless verify=True)


@dataclass
class TensorInfo:
    name: str
    dtype: str        # "f32", "f16", "bf16", "i8"
    layout: str       # "row_major", "experts_packed"
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc32: int
    l2norm: float
    dtype_id: int = 0
    layout_id: int = 0
    crc_ok: bool | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ColibriInfo:
    """What `inspect` found in a .colibri file. Print it, or show it in a notebook."""
    path: str
    version: int
    header_size: int
    file_size: int
    header: dict[str, Any]          # header fields: magic, version, ... block_size and
                                    # router/experts/tokenizer_offset (the seed's names)
    header_crc32: int
    sections: list[SectionInfo]
    metadata: dict[str, Any]
    metadata_types: dict[str, str]
    tensors: list[TensorInfo]
    verified: bool = False          # weight sections and per-tensor CRCs were checked
    _by_name: dict[str, TensorInfo] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._by_name = {t.name: t for t in self.tensors}

    # -- lookups
    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.path}") from None

    def section(self, name: str) -> SectionInfo:
        for s in self.sections:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def flags(self) -> dict[str, bool]:
        f = self.header["flags"]
        return {"router_int8": bool(f & FLAG_ROUTER_INT8),
                "tied_embeddings": bool(f & FLAG_TIED_EMBEDDINGS)}

    def read_tensor(self, name: str, *, as_float32: bool = False) -> np.ndarray:
        """Read one tensor's bytes from the file (a fresh array, shaped as `dims`).
        bf16 comes back as uint16 bits unless `as_float32`."""
        t = self.tensor(name)
        raw = np.empty(t.nbytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(t.offset)
            _readinto_exact(f, memoryview(raw), self.path)
        if t.dtype_id in QUANT_DTYPES:
            arr = raw.reshape(stored_shape(t.dtype_id, t.shape))
            if not as_float32:
                return arr
            from colibri_lab import quants
            return quants.dequantize(arr, t.dtype_id, t.shape[-1]).reshape(t.shape)
        arr = raw.view(DTYPE_NUMPY[t.dtype_id]).reshape(t.shape)
        return stored_to_f32(arr, t.dtype_id) if as_float32 else arr

    @property
    def family_options(self) -> dict[str, Any]:
        """Every family option (docs/format.md), from the metadata or its default."""
        return {k: self.metadata.get(k, d) for k, d in FAMILY_OPTION_DEFAULTS.items()}

    def expert_stride(self, layer: int) -> int:
        t = self.tensor(f"blk.{layer}.ffn_experts")
        return t.nbytes // t.shape[0]

    # -- presentation
    def summary(self, max_tensors: int | None = 40) -> str:
        h = self.header
        lines = [f"{self.path}: .colibri v{self.version}, {self.file_size:,} bytes"
                 + (" (all CRCs verified)" if self.verified else "")]
        arch = self.metadata.get("general.architecture", "?")
        lines.append(f"  architecture {arch}  name {self.metadata.get('general.name', '?')!r}")
        lines.append("  " + "  ".join(f"{k}={h[k]}" for k in
                                       ("n_layers", "hidden_size", "intermediate_size",
                                        "vocab_size", "n_experts", "top_k", "max_seq_len")))
        fl = [k for k, v in self.flags.items() if v]
        sw = self.metadata.get("model.sliding_window")
        same = {"model.layer_ffn": lambda v: all(x == 1 for x in v),
                "model.layer_sliding_window": lambda v: all(x == sw for x in v)}
        set_opts = [f"{k[len('model.'):]}={_short(v, 40)}" for k, v in self.family_options.items()
                    if v != FAMILY_OPTION_DEFAULTS[k] and not (k in same and same[k](v))]
        if set_opts:
            lines.append("  family options: " + "  ".join(set_opts))
        lines.append(f"  flags={h['flags']:#x} ({', '.join(fl) or 'none'})  "
                     f"alignment={h['alignment']}  block_size={h['block_size']}  "
                     f"header_crc32={self.header_crc32:08x}")
        lines.append("  sections:")
        for s in self.sections:
            ok = {None: "", True: " ok", False: " BAD"}[s.crc_ok]
            lines.append(f"    {s.name:<17} offset {s.offset:>14,}  size {s.size:>14,}  "
                         f"crc32 {s.crc32:08x}{ok}")
        lines.append(f"  metadata ({len(self.metadata)} keys):")
        for k, v in self.metadata.items():
            lines.append(f"    {k:<32} {self.metadata_types[k]:<6} {_short_meta(k, v)}")
        lines.append(f"  tensors ({len(self.tensors)}):")
        shown = self.tensors if max_tensors is None else self.tensors[:max_tensors]
        for t in shown:
            shp = "x".join(str(d) for d in t.shape)
            lines.append(f"    {t.name:<28} {t.dtype:<4} {t.layout:<14} {shp:<16} "
                         f"offset {t.offset:>14,}  nbytes {t.nbytes:>13,}  "
                         f"crc32 {t.crc32:08x}  l2 {t.l2norm:.6g}")
        if len(shown) < len(self.tensors):
            lines.append(f"    ... {len(self.tensors) - len(shown)} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        e = html.escape
        h = self.header
        out = [f"<div><b>{e(os.path.basename(self.path))}</b>: .colibri v{self.version}, "
               f"{self.file_size:,} bytes, {e(str(self.metadata.get('general.architecture', '?')))}"
               + (", all CRCs verified" if self.verified else "") + "</div>"]
        out.append("<table><tr>" + "".join(f"<th>{e(k)}</th>" for k in h) + "</tr><tr>"
                   + "".join(f"<td>{v}</td>" for v in h.values()) + "</tr></table>")
        out.append("<details><summary>metadata</summary><table>"
                   + "".join(f"<tr><td><code>{e(k)}</code></td><td>{e(self.metadata_types[k])}"
                             f"</td><td>{e(_short_meta(k, v))}</td></tr>" for k, v in self.metadata.items())
                   + "</table></details>")
        out.append("<table><tr><th>section</th><th>offset</th><th>size</th><th>crc32</th>"
                   "<th>check</th></tr>"
                   + "".join(f"<tr><td>{e(s.name)}</td><td>{s.offset:,}</td><td>{s.size:,}</td>"
                             f"<td>{s.crc32:08x}</td><td>{ {None: '', True: 'ok', False: 'BAD'}[s.crc_ok]}"
                             f"</td></tr>" for s in self.sections) + "</table>")
        out.append(f"<details><summary>{len(self.tensors)} tensors</summary><table><tr>"
                   "<th>name</th><th>dtype</th><th>layout</th><th>shape</th><th>offset</th>"
                   "<th>nbytes</th><th>crc32</th><th>l2norm</th></tr>"
                   + "".join(f"<tr><td><code>{e(t.name)}</code></td><td>{t.dtype}</td>"
                             f"<td>{t.layout}</td><td>{list(t.shape)}</td><td>{t.offset:,}</td>"
                             f"<td>{t.nbytes:,}</td><td>{t.crc32:08x}</td><td>{t.l2norm:.6g}</td></tr>"
                             for t in self.tensors) + "</table></details>")
        return "\n".join(out)


def _short(v: Any, n: int = 80) -> str:
    s = repr(v) if isinstance(v, str) else str(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def _short_meta(key: str, v: Any) -> str:
    """A metadata value for the summary; the chat template (Jinja source, often kilobytes)
    as its beginning and its length."""
    if key == "tokenizer.chat_template" and isinstance(v, str):
        return f"{_short(v, 60)} ({len(v):,} chars)"
    return _short(v)


def _readinto_exact(f, mv: memoryview, path: str) -> None:
    got = 0
    while got < len(mv):
        r = f.readinto(mv[got:])
        if not r:
            raise FormatError(f"{path}: unexpected end of file")
        got += r


class _Cursor:
    """Bounds-checked little-endian reads from a bytes object (a section)."""

    def __init__(self, data: bytes, what: str):
        self.data, self.pos, self.what = data, 0, what

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise FormatError(f"{self.what}: truncated (need {n} bytes at {self.pos}, "
                              f"section has {len(self.data)})")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return b

    def unpack(self, fmt: str):
        s = struct.calcsize(fmt)
        return struct.unpack(fmt, self.take(s))


def _parse_metadata(data: bytes):
    c = _Cursor(data, "metadata section")
    (n,) = c.unpack("<Q")
    meta, types = {}, {}
    for i in range(n):
        (klen,) = c.unpack("<I")
        if not 1 <= klen <= MAX_KEY_LEN:
            raise FormatError(f"metadata entry {i}: key length {klen} outside 1..{MAX_KEY_LEN}")
        try:
            key = c.take(klen).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"metadata entry {i}: key is not UTF-8") from None
        if "\x00" in key:
            raise FormatError(f"metadata entry {i}: key contains NUL")
        if key in meta:
            raise FormatError(f"metadata key {key!r} appears twice")
        (t,) = c.unpack("<I")
        if t == MT_ARRAY:
            et, cnt = c.unpack("<IQ")
            if et in (MT_ARRAY, MT_STRING) or et not in META_TYPE_NAMES:
                raise FormatError(f"metadata {key!r}: bad array element type {et}")
            val = [_read_scalar(c, et, key) for _ in range(_check_count(cnt, c, et, key))]
            types[key] = f"array[{META_TYPE_NAMES[et]}]"
        elif t in META_TYPE_NAMES:
            val = _read_scalar(c, t, key)
            types[key] = META_TYPE_NAMES[t]
        else:
            raise FormatError(f"metadata {key!r}: unknown value type {t}")
        meta[key] = val
    if c.pos != len(data):
        raise FormatError(f"metadata section: {len(data) - c.pos} bytes after the last entry")
    return meta, types


def _check_count(cnt: int, c: _Cursor, et: int, key: str) -> int:
    if cnt * struct.calcsize(_META_SCALAR[et]) > len(c.data) - c.pos:
        raise FormatError(f"metadata {key!r}: array of {cnt} elements runs past the section")
    return cnt


def _read_scalar(c: _Cursor, t: int, key: str):
    if t == MT_STRING:
        (n,) = c.unpack("<Q")
        try:
            return c.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"metadata {key!r}: string is not UTF-8") from None
    (v,) = c.unpack(_META_SCALAR[t])
    if t == MT_BOOL:
        if v not in (0, 1):
            raise FormatError(f"metadata {key!r}: bool must be 0 or 1, got {v}")
        return bool(v)
    return v


def _parse_tensors(data: bytes, sections: list[SectionInfo], alignment: int):
    c = _Cursor(data, "tensor directory")
    (n,) = c.unpack("<Q")
    out, seen = [], set()
    weight = [sections[i] for i in WEIGHT_SECTIONS]
    for i in range(n):
        (nlen,) = c.unpack("<I")
        if not 1 <= nlen <= MAX_NAME_LEN:
            raise FormatError(f"tensor record {i}: name length {nlen} outside 1..{MAX_NAME_LEN}")
        raw = c.take(nlen)
        try:
            name = raw.decode("ascii")
        except UnicodeDecodeError:
            raise FormatError(f"tensor record {i}: name is not ASCII") from None
        if name in seen:
            raise FormatError(f"tensor {name!r} appears twice in the directory")
        seen.add(name)
        dtype, layout, ndims, tcrc = _REC_HEAD.unpack(c.take(_REC_HEAD.size))
        *dims, offset, nbytes, l2 = _REC_TAIL.unpack(c.take(_REC_TAIL.size))
        if dtype not in DTYPE_BLOCKS:
            raise FormatError(f"tensor {name!r}: unknown dtype id {dtype} "
                              "(written by a newer converter? update colibri_lab)")
        if layout not in LAYOUT_NAMES:
            raise FormatError(f"tensor {name!r}: unknown layout id {layout} "
                              "(written by a newer converter? update colibri_lab)")
        if not 1 <= ndims <= MAX_DIMS:
            raise FormatError(f"tensor {name!r}: n_dims {ndims} outside 1..{MAX_DIMS}")
        if any(d != 1 for d in dims[ndims:]):
            raise FormatError(f"tensor {name!r}: unused dims must be 1, got {dims}")
        shape = tuple(dims[:ndims])
        be, bb = DTYPE_BLOCKS[dtype]
        if shape[-1] % be:
            raise FormatError(f"tensor {name!r}: a {DTYPE_NAMES[dtype]} row holds whole "
                              f"blocks of {be}; the last dim {shape[-1]} is not a multiple")
        want = tensor_nbytes(dtype, shape)
        if want != nbytes or nbytes > U64_MAX:
            raise FormatError(f"tensor {name!r}: nbytes {nbytes} != rows × row bytes of "
                              f"{DTYPE_NAMES[dtype]}{shape} = {want}")
        if offset % alignment:
            raise FormatError(f"tensor {name!r}: offset {offset} is not a multiple of "
                              f"the alignment {alignment}")
        if not any(s.offset <= offset and offset + nbytes <= s.offset + s.size for s in weight):
            raise FormatError(f"tensor {name!r}: bytes {offset}..{offset + nbytes} are not "
                              "inside a weight section (dense, router, experts)")
        if layout == LAYOUT_EXPERTS_PACKED and ndims != 3:
            raise FormatError(f"tensor {name!r}: EXPERTS_PACKED needs 3 dims [E, 3I, H]")
        out.append(TensorInfo(name, DTYPE_NAMES[dtype], LAYOUT_NAMES[layout], shape, offset,
                              nbytes, tcrc, l2, dtype, layout))
    if c.pos != len(data):
        raise FormatError(f"tensor directory: {len(data) - c.pos} bytes after the last record")
    return out


def _file_crc(f, offset: int, size: int, chunk: int = 1 << 22) -> int:
    f.seek(offset)
    buf = bytearray(min(chunk, max(size, 1)))
    mv = memoryview(buf)
    c, left = 0, size
    while left:
        n = min(left, len(buf))
        _readinto_exact(f, mv[:n], getattr(f, "name", "file"))
        c = zlib.crc32(mv[:n], c)
        left -= n
    return c & 0xFFFFFFFF


def inspect(path: str | os.PathLike, *, verify: bool = False) -> ColibriInfo:
    """Read and validate a .colibri file without the engine.

    Checks what the engine checks at start-up (magic, version, header size and CRC,
    file size, section bounds/order/overlap, value constraints, metadata/directory/
    tokenizer CRCs, every record). With `verify=True` it also checks the weight-section
    CRCs and every tensor's CRC-32 (reads the whole file). Raises FormatError.
    """
    require_little_endian()
    path = os.fspath(path)
    real_size = os.path.getsize(path)
    with open(path, "rb", buffering=0) as f:
        hdr = f.read(HEADER_SIZE)
        if len(hdr) < HEADER_SIZE:
            raise FormatError(f"{path}: {len(hdr)} bytes, too short for a .colibri header "
                              f"({HEADER_SIZE} bytes)")
        magic, version, header_size, file_size, *vals = _HDR_FIXED.unpack_from(hdr, 0)
        if magic != MAGIC:
            raise FormatError(f"{path}: not a .colibri file (magic {magic!r}, expected {MAGIC!r})")
        if version not in READ_VERSIONS:
            raise FormatError(f"{path}: format version {version}; this reader reads versions "
                              f"{', '.join(map(str, READ_VERSIONS))} (re-convert the model or "
                              "update colibri_lab)")
        if header_size != HEADER_SIZE:
            raise FormatError(f"{path}: header_size {header_size}, expected {HEADER_SIZE}")
        (hcrc,) = struct.unpack_from("<I", hdr, HDR_CRC_OFFSET)
        if crc32(hdr[:HDR_CRC_OFFSET]) != hcrc:
            raise FormatError(f"{path}: header CRC mismatch (stored {hcrc:08x}, computed "
                              f"{crc32(hdr[:HDR_CRC_OFFSET]):08x}); the file is damaged")
        if file_size != real_size:
            raise FormatError(f"{path}: header says {file_size} bytes but the file has "
                              f"{real_size} (truncated or appended to)")
        header = dict(zip(HEADER_FIELDS, vals))
        alignment, block_size = _HDR_TAIL.unpack_from(hdr, HDR_ALIGNMENT_OFFSET)
        header["alignment"], header["block_size"] = alignment, block_size
        if any(hdr[208:252]):
            raise FormatError(f"{path}: reserved header bytes 208..251 are not zero")
        _check_header_values(path, header)
        sections = []
        prev_end = HEADER_SIZE
        for i in range(N_SECTIONS):
            off, size, scrc, res = _SECTION.unpack_from(hdr, HDR_SECTIONS_OFFSET + i * _SECTION.size)
            name = SECTION_NAMES[i]
            if res:
                raise FormatError(f"{path}: section {name}: reserved field not zero")
            if off > file_size or size > file_size - off:
                raise FormatError(f"{path}: section {name} ({off}+{size}) runs past the end "
                                  f"of the file ({file_size} bytes)")
            if off < prev_end:
                raise FormatError(f"{path}: section {name} at {off} overlaps the previous one "
                                  f"(which ends at {prev_end}) or is out of order")
            if size == 0 and i != SECTION_TOKENIZER:
                raise FormatError(f"{path}: section {name} is empty; only the tokenizer "
                                  "section may be")
            if i in WEIGHT_SECTIONS and off % SECTION_ALIGNMENT:
                raise FormatError(f"{path}: section {name} starts at {off}, not a multiple "
                                  f"of {SECTION_ALIGNMENT}")
            sections.append(SectionInfo(name, off, size, scrc))
            prev_end = off + size
        small = {}
        for i in SMALL_SECTIONS:
            s = sections[i]
            f.seek(s.offset)
            data = f.read(s.size)
            if len(data) != s.size:
                raise FormatError(f"{path}: could not read section {s.name}")
            s.crc_ok = crc32(data) == s.crc32
            if not s.crc_ok:
                raise FormatError(f"{path}: section {s.name}: CRC mismatch (stored "
                                  f"{s.crc32:08x}, computed {crc32(data):08x}); the file "
                                  "is damaged")
            small[i] = data
        meta, types = _parse_metadata(small[SECTION_METADATA])
        tensors = _parse_tensors(small[SECTION_TENSORS], sections, alignment)
        if verify:
            for i in WEIGHT_SECTIONS:
                s = sections[i]
                s.crc_ok = _file_crc(f, s.offset, s.size) == s.crc32
                if not s.crc_ok:
                    raise FormatError(f"{path}: section {s.name}: CRC mismatch; the weights "
                                      "are damaged")
            for t in tensors:
                t.crc_ok = _file_crc(f, t.offset, t.nbytes) == t.crc32
                if not t.crc_ok:
                    raise FormatError(f"{path}: tensor {t.name!r}: CRC mismatch; the weights "
                                      "are damaged")
    # Every header field in one dict, the seed's names included (section offsets).
    header = {"magic": magic.rstrip(b"\0").decode("ascii"), "version": version,
              "header_size": header_size, "file_size": file_size, **header,
              "router_offset": sections[SECTION_NAMES.index("router")].offset,
              "experts_offset": sections[SECTION_NAMES.index("experts")].offset,
              "tokenizer_offset": sections[SECTION_TOKENIZER].offset}
    return ColibriInfo(path, version, header_size, file_size, header, hcrc, sections, meta,
                       types, tensors, verified=verify)


def _check_header_values(path: str, h: dict[str, int]) -> None:
    for k in ("n_experts", "hidden_size", "intermediate_size", "vocab_size", "max_seq_len",
              "n_layers", "block_size"):
        if h[k] < 1:
            raise FormatError(f"{path}: header {k} is {h[k]}, must be >= 1")
    if not 1 <= h["top_k"] <= h["n_experts"]:
        raise FormatError(f"{path}: header top_k {h['top_k']} must be in 1..n_experts "
                          f"({h['n_experts']})")
    if h["flags"] & ~KNOWN_FLAGS:
        raise FormatError(f"{path}: header flags {h['flags']:#x} has unknown bits set")
    a = h["alignment"]
    if a < 64 or a & (a - 1):
        raise FormatError(f"{path}: alignment {a} must be a power of two >= 64")


# --------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    """`python -m colibri_lab inspect FILE [--verify] [--all]`."""
    import argparse
    p = argparse.ArgumentParser(prog="colibri_lab inspect",
                                description="Show and validate a .colibri file.")
    p.add_argument("file")
    p.add_argument("--verify", action="store_true",
                   help="also check the weight-section and per-tensor CRCs (reads the file)")
    p.add_argument("--all", action="store_true", help="list every tensor")
    a = p.parse_args(argv)
    try:
        info = inspect(a.file, verify=a.verify)
    except (FormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(info.summary(max_tensors=None if a.all else 40))
    return 0
