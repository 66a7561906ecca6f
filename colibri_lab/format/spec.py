"""The `.colibri` file format, version 2 (docs/format.md): its constants (dtype ids and
block sizes, layout ids, metadata value types, section names, header offsets, family
option defaults), the numeric conversions it defines (bf16 bits, the int8 router) and the
low-level encoders a writer uses (`encode_metadata`, `encode_tensor_record`,
`encode_header`, `align_up`). A leaf: it imports nothing of the package, so the converter,
the reader, the block codecs, the bindings and the tests share one definition."""

from __future__ import annotations

import math
import struct
import sys
import zlib
from dataclasses import dataclass
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
# ggml's legacy blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1), its Q2_K / Q3_K super-blocks and its
# non-linear 4-bit IQ4_NL (blocks of 32) / IQ4_XS (super-blocks of 256)
DTYPE_Q4_0 = 12
DTYPE_Q4_1 = 13
DTYPE_Q5_0 = 14
DTYPE_Q5_1 = 15
DTYPE_Q2_K = 16
DTYPE_Q3_K = 17
DTYPE_IQ4_NL = 18
DTYPE_IQ4_XS = 19
# ggml's grid types ("i-quants", super-blocks of 256, read only): indices into a codebook
# (ggml's grid) that a file holding them carries as the int8 tensor "codebook.<name>"
DTYPE_IQ2_XXS = 20
DTYPE_IQ2_XS = 21
DTYPE_IQ2_S = 22
DTYPE_IQ3_XXS = 23
DTYPE_IQ3_S = 24
DTYPE_IQ1_S = 25
DTYPE_IQ1_M = 26
DTYPE_NAMES = {DTYPE_F32: "f32", DTYPE_F16: "f16", DTYPE_BF16: "bf16", DTYPE_I8: "i8",
               DTYPE_Q8_0: "q8_0", DTYPE_Q4_K: "q4_k", DTYPE_Q5_K: "q5_k", DTYPE_Q6_K: "q6_k",
               DTYPE_MXFP4: "mxfp4", DTYPE_Q4_0: "q4_0", DTYPE_Q4_1: "q4_1", DTYPE_Q5_0: "q5_0",
               DTYPE_Q5_1: "q5_1", DTYPE_Q2_K: "q2_k", DTYPE_Q3_K: "q3_k", DTYPE_IQ4_NL: "iq4_nl",
               DTYPE_IQ4_XS: "iq4_xs", DTYPE_IQ2_XXS: "iq2_xxs", DTYPE_IQ2_XS: "iq2_xs",
               DTYPE_IQ2_S: "iq2_s", DTYPE_IQ3_XXS: "iq3_xxs", DTYPE_IQ3_S: "iq3_s",
               DTYPE_IQ1_S: "iq1_s", DTYPE_IQ1_M: "iq1_m"}
DTYPE_IDS = {v: k for k, v in DTYPE_NAMES.items()}
# elements per block and bytes per block; a float type is a block of one element
DTYPE_BLOCKS = {DTYPE_F32: (1, 4), DTYPE_F16: (1, 2), DTYPE_BF16: (1, 2), DTYPE_I8: (1, 1),
                DTYPE_Q8_0: (32, 34), DTYPE_Q4_K: (256, 144), DTYPE_Q5_K: (256, 176),
                DTYPE_Q6_K: (256, 210), DTYPE_MXFP4: (32, 17), DTYPE_Q4_0: (32, 18),
                DTYPE_Q4_1: (32, 20), DTYPE_Q5_0: (32, 22), DTYPE_Q5_1: (32, 24),
                DTYPE_Q2_K: (256, 84), DTYPE_Q3_K: (256, 110), DTYPE_IQ4_NL: (32, 18),
                DTYPE_IQ4_XS: (256, 136), DTYPE_IQ2_XXS: (256, 66), DTYPE_IQ2_XS: (256, 74),
                DTYPE_IQ2_S: (256, 82), DTYPE_IQ3_XXS: (256, 98), DTYPE_IQ3_S: (256, 110),
                DTYPE_IQ1_S: (256, 50), DTYPE_IQ1_M: (256, 56)}
QUANT_DTYPES = (DTYPE_Q8_0, DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K, DTYPE_MXFP4, DTYPE_Q4_0,
                DTYPE_Q4_1, DTYPE_Q5_0, DTYPE_Q5_1, DTYPE_Q2_K, DTYPE_Q3_K, DTYPE_IQ4_NL,
                DTYPE_IQ4_XS, DTYPE_IQ2_XXS, DTYPE_IQ2_XS, DTYPE_IQ2_S, DTYPE_IQ3_XXS,
                DTYPE_IQ3_S, DTYPE_IQ1_S, DTYPE_IQ1_M)
# the grid types, and the codebook each reads (IQ1_M reads IQ1_S's): name -> (entries, width)
GRID_DTYPES = (DTYPE_IQ2_XXS, DTYPE_IQ2_XS, DTYPE_IQ2_S, DTYPE_IQ3_XXS, DTYPE_IQ3_S,
               DTYPE_IQ1_S, DTYPE_IQ1_M)
CODEBOOK_OF = {d: DTYPE_NAMES[d] for d in GRID_DTYPES}
CODEBOOK_OF[DTYPE_IQ1_M] = "iq1_s"
CODEBOOK_SHAPES = {"iq2_xxs": (256, 8), "iq2_xs": (512, 8), "iq2_s": (1024, 8),
                   "iq3_xxs": (256, 4), "iq3_s": (512, 4), "iq1_s": (2048, 8)}
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
MAX_END_IDS = 64   # tokenizer.end_ids: the most a file may name (colibri.h COLIBRI_MAX_END_IDS)
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


