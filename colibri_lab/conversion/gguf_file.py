"""Reading a GGUF file for import: the tensors (`GgufFile`, `GTensor`: shapes, types, raw
rows over the memory map), the ggml types colibri stores as they are, and the producers that
stream a tensor's rows into a `.colibri` file — as stored (`_copy_producer`) or as f32
(`_f32_producer`). Shared by the importer of the grouped-query families (`gguf.py`) and
that of DeepSeek and gpt-oss (`gguf_arch.py`); knows no architecture.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from ..format import blocks as quants
from ..format import spec as fmt
from ..format.spec import DTYPE_NUMPY
from .spec import CHUNK_ELEMS, ConversionError

# ggml type name (GGMLQuantizationType) -> colibri dtype id: the block bytes are the same
# (docs/format.md, "Version 2"); from colibri_lab.format.blocks.GGML_TYPES, the one table
SUPPORTED_GGML_TYPES = {t.name: d for d, t in quants.GGML_TYPES.items()}
_SUPPORTED_LIST = ", ".join(SUPPORTED_GGML_TYPES)
_FLOAT_TYPES = ("F32", "F16", "BF16")

# --------------------------------------------------------------------------- reading

@dataclass
class GTensor:
    """One GGUF tensor: logical shape in numpy order (outermost first: GGUF's ne reversed),
    ggml type name, and its bytes as a [rows, row bytes] uint8 view of the mapped file."""
    name: str
    type_name: str
    shape: tuple[int, ...]
    raw: np.ndarray

    @property
    def rows(self) -> int:
        return self.raw.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def dtype(self) -> int:
        return SUPPORTED_GGML_TYPES[self.type_name]


class GgufFile:
    """A GGUF file opened with gguf.GGUFReader (memory-mapped): metadata values and tensors."""

    def __init__(self, path: str):
        try:
            import gguf
        except ImportError as e:   # pragma: no cover - a dependency of the package
            raise ConversionError(f"reading GGUF files needs the gguf package (pip install gguf): "
                                  f"{e}") from None
        self.path = path
        if not os.path.isfile(path):
            raise ConversionError(f"{path}: no such GGUF file")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
        if head[:4] != b"GGUF":
            raise ConversionError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
        try:
            self.reader = gguf.GGUFReader(path, "r")
        except Exception as e:
            raise ConversionError(f"{path}: cannot read this GGUF file ({type(e).__name__}: {e}); "
                                  "the file is truncated or damaged (an interrupted download?), "
                                  "or written by a newer llama.cpp than the installed gguf "
                                  "package reads") from None
        if self.reader.byte_order != "I":
            raise ConversionError(f"{path}: a big-endian GGUF; colibri reads little-endian files")
        self.fields: dict[str, Any] = {}
        for k, fld in self.reader.fields.items():
            if k.startswith("GGUF."):
                continue
            try:
                self.fields[k] = fld.contents()
            except Exception as e:
                raise ConversionError(f"{path}: metadata key {k!r} cannot be read ({e}); the file "
                                      "is damaged") from None
        self.tensors: dict[str, GTensor] = {}
        data = self.reader.data
        for t in self.reader.tensors:
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            start, nbytes = int(t.data_offset), int(t.n_bytes)
            if start + nbytes > size:
                raise ConversionError(f"{path}: tensor {t.name} lies past the end of the file "
                                      f"({start + nbytes} > {size} bytes): the file is truncated")
            rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
            if rows == 0 or nbytes % rows:
                raise ConversionError(f"{path}: tensor {t.name} has shape {list(shape)} and "
                                      f"{nbytes} bytes, which do not divide into rows")
            raw = data[start:start + nbytes].reshape(rows, nbytes // rows)
            self.tensors[t.name] = GTensor(t.name, t.tensor_type.name, shape, raw)
        self.used: set[str] = set()

    # ---- metadata
    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> GTensor:
        t = self.tensors.get(name)
        if t is None:
            raise ConversionError(f"{self.path}: missing tensor {name!r} (incomplete GGUF, or "
                                  "not of the architecture its metadata names)")
        if shape is not None and t.shape != tuple(shape):
            raise ConversionError(f"{self.path}: tensor {name!r} has shape {list(t.shape)} "
                                  f"(numpy order), expected {list(shape)} from the metadata")
        self.used.add(name)
        return t


def _f32_value(v) -> float:
    """A GGUF float32 metadata value as the decimal it was written from: the shortest
    decimal that rounds to the same float32 (1e-06 rather than 9.99999997e-07), as the
    Hugging Face config the converter read."""
    return float(np.format_float_positional(np.float32(v), unique=True, trim="-")) \
        if math.isfinite(v) else float(v)


def _int(g: GgufFile, key: str, default=None, *, minimum: int = 1) -> int:
    v = g.get(key, default)
    if isinstance(v, list):
        if not v or len(set(v)) != 1:
            raise ConversionError(f"{g.path}: {key} differs between layers ({v[:8]}...); colibri "
                                  "runs one value for all layers")
        v = v[0]
    if v is None or isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ConversionError(f"{g.path}: metadata {key} is missing or not an integer ({v!r})")
    if v < minimum:
        raise ConversionError(f"{g.path}: metadata {key} = {v}, must be >= {minimum}")
    return int(v)


# --------------------------------------------------------------------------- spec

Chunk = tuple[np.ndarray, float]


@dataclass
class Rows:
    """Rows of a GGUF tensor: `start .. start+count-1` of its [rows, row bytes] view, or the
    rows named by `index` (a reordering, in output order)."""
    t: GTensor
    start: int = 0
    count: int = -1
    index: np.ndarray | None = None

    def __post_init__(self):
        if self.index is not None:
            self.count = len(self.index)
        elif self.count < 0:
            self.count = self.t.rows - self.start

    def take(self, a: int, b: int) -> np.ndarray:
        """Output rows a..b-1, a fresh contiguous [b-a, row bytes] uint8 array."""
        if self.index is not None:
            return self.t.raw[self.index[a:b]]
        return np.array(self.t.raw[self.start + a:self.start + b])


def _dequantize(raw: np.ndarray, type_name: str, cols: int) -> np.ndarray:
    """[n, row bytes] of a GGUF type -> float32 [n, cols] (gguf.quants for block types:
    the bits colibri's reference dequantizer gives, docs/format.md)."""
    return quants.dequantize(raw, SUPPORTED_GGML_TYPES[type_name], cols)


def _copy_producer(parts: list[Rows], type_name: str, cols: int) -> Callable[[], Iterator[Chunk]]:
    """The rows' bytes as stored (no conversion), with the sum of squares of their values."""
    dt = SUPPORTED_GGML_TYPES[type_name]

    def gen():
        step = max(1, CHUNK_ELEMS // cols)
        for p in parts:
            for a in range(0, p.count, step):
                raw = p.take(a, min(p.count, a + step))
                ss = fmt.sumsq_f64(_dequantize(raw, type_name, cols))
                yield (raw.view(DTYPE_NUMPY[dt]) if dt not in fmt.QUANT_DTYPES else raw), ss
    return gen


def _f32_producer(parts: list[Rows], cols: int) -> Callable[[], Iterator[Chunk]]:
    """The rows' values as f32 (1-D tensors, and routers stored quantized)."""
    def gen():
        step = max(1, CHUNK_ELEMS // cols)
        for p in parts:
            for a in range(0, p.count, step):
                x = np.ascontiguousarray(_dequantize(p.take(a, min(p.count, a + step)),
                                                     p.t.type_name, cols), dtype="<f4")
                yield x.reshape(-1), fmt.sumsq_f64(x)
    return gen


def _check_type(t: GTensor) -> None:
    if t.type_name not in SUPPORTED_GGML_TYPES:
        raise ConversionError(f"tensor {t.name} has type {t.type_name}, which colibri does not "
                              f"support; supported: {_SUPPORTED_LIST}")


