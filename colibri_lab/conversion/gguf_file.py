"""Reading a GGUF file for import: the tensors (`GgufFile`, `GTensor`: shapes, types, raw
rows over the memory map), the ggml types colibri stores as they are, and the producers that
stream a tensor's rows into a `.colibri` file — as stored (`_copy_producer`) or as f32
(`_f32_producer`). Shared by the importer of the grouped-query families (`gguf.py`) and
that of DeepSeek and gpt-oss (`gguf_arch.py`); knows no architecture.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from ..format import blocks as quants
from ..format import spec as fmt
from ..format.spec import DTYPE_NUMPY
from .spec import CHUNK_ELEMS, ConversionError, stored_sumsq

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


# A split GGUF's shards (llama.cpp's gguf-split, convert_hf_to_gguf --split-max-*,
# llama-quantize --keep-split): PREFIX-00001-of-00003.gguf ... (llama_split_path's name)
_SHARD_NAME = re.compile(r"(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


def _open_reader(path: str):
    """gguf.GGUFReader over one file (memory-mapped), its failures as ConversionError."""
    try:
        import gguf
    except ImportError as e:   # pragma: no cover - a dependency of the package
        raise ConversionError(f"reading GGUF files needs the gguf package (pip install gguf): "
                              f"{e}") from None
    if not os.path.isfile(path):
        raise ConversionError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF":
        raise ConversionError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:
        raise ConversionError(f"{path}: cannot read this GGUF file ({type(e).__name__}: {e}); "
                              "the file is truncated or damaged (an interrupted download?), "
                              "or written by a newer llama.cpp than the installed gguf "
                              "package reads") from None
    if reader.byte_order != "I":
        raise ConversionError(f"{path}: a big-endian GGUF; colibri reads little-endian files")
    return reader


def _read_fields(reader, path: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for k, fld in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            fields[k] = fld.contents()
        except Exception as e:
            raise ConversionError(f"{path}: metadata key {k!r} cannot be read ({e}); the file "
                                  "is damaged") from None
    return fields


def _shard_paths(path: str, no: int, count: int) -> list[str]:
    """The paths of every shard of the split GGUF that `path` (shard `no`, 0-based, of
    `count`) belongs to, by llama.cpp's naming; each must exist."""
    folder, base = os.path.split(path)
    m = _SHARD_NAME.fullmatch(base)
    if m is None or int(m["no"]) != no + 1 or int(m["count"]) != count:
        raise ConversionError(
            f"{path}: shard {no + 1} of {count} of a split GGUF, but its name does not end in "
            f"-{no + 1:05d}-of-{count:05d}.gguf as llama.cpp names shards, so the other shards "
            "cannot be found; give their original names, or merge them into one file "
            "(llama-gguf-split --merge)")
    paths = [os.path.join(folder, f"{m['prefix']}-{i + 1:05d}-of-{count:05d}.gguf")
             for i in range(count)]
    missing = [os.path.basename(p) for p in paths if not os.path.isfile(p)]
    if missing:
        names = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise ConversionError(
            f"{path}: one of the {count} files of a split GGUF; {names} "
            f"{'is' if len(missing) == 1 else 'are'} not in {folder or '.'}: every shard must be "
            "in the same folder, under its original name")
    return paths


def _split_int(fields: dict[str, Any], key: str, path: str) -> int | None:
    v = fields.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ConversionError(f"{path}: metadata {key} = {v!r} is not a count")
    return int(v)


def gguf_in_folder(folder: str) -> str | None:
    """The GGUF a folder holds, for a folder given where a file is expected (a model hub's
    download of one quantization, often the shards of a split GGUF): its one GGUF file, or
    the first shard of its one split GGUF; None when it holds no .gguf file. Several
    models in one folder are refused, naming them."""
    names = sorted(n for n in os.listdir(folder) if n.lower().endswith(".gguf")
                   and os.path.isfile(os.path.join(folder, n)))
    models: dict[str, str] = {}   # model -> the file to open
    for n in names:
        m = _SHARD_NAME.fullmatch(n)
        key = f"{m['prefix']}-*-of-{m['count']}.gguf" if m else n
        if key not in models or (m and int(m["no"]) == 1):
            models[key] = n
    if not models:
        return None
    if len(models) > 1:
        shown = ", ".join(sorted(models)[:6]) + (" ..." if len(models) > 6 else "")
        raise ConversionError(f"{folder} holds {len(models)} GGUF models ({shown}); give the "
                              "file (for a split GGUF, any of its shards) to import")
    return os.path.join(folder, next(iter(models.values())))


class GgufFile:
    """A GGUF opened with gguf.GGUFReader (memory-mapped): metadata values and tensors. A
    split GGUF (shards PREFIX-00001-of-0000N.gguf ..., as llama.cpp's gguf-split and
    `--split-max-*` write them) is opened whole from any of its shards: the metadata is
    the first shard's, the tensors those of every shard, each still a view of its own file."""

    def __init__(self, path: str):
        reader = _open_reader(path)
        fields = _read_fields(reader, path)
        count = _split_int(fields, "split.count", path)
        paths = [path]
        if count is not None and count > 1:
            no = _split_int(fields, "split.no", path)
            if no is None or no >= count:
                raise ConversionError(f"{path}: split.count {count} with split.no {no!r}: not a "
                                      "shard llama.cpp would read")
            paths = _shard_paths(path, no, count)
        opened = {path: (reader, fields)}   # each shard opened once

        def shard(p: str):
            if p not in opened:
                r = _open_reader(p)
                opened[p] = (r, _read_fields(r, p))
            return opened[p]

        reader, fields = shard(paths[0])
        self.path = paths[0]
        self.paths = paths
        self.reader = reader   # the first shard's: the metadata and GGUF version
        self.fields = fields
        self.tensors: dict[str, GTensor] = {}
        for i, p in enumerate(paths):
            r, sf = shard(p)
            if len(paths) > 1:
                got = (_split_int(sf, "split.no", p), _split_int(sf, "split.count", p))
                if got != (i, len(paths)):
                    says = "no split.no / split.count" if None in got else \
                        f"shard {got[0] + 1} of {got[1]}"
                    raise ConversionError(
                        f"{p}: its metadata says {says}, but its name makes it shard {i + 1} of "
                        f"{len(paths)} of {os.path.basename(paths[0])}'s split GGUF: the folder "
                        "mixes the shards of different files")
            self._add_tensors(r, p)
        expect = _split_int(fields, "split.tensors.count", self.path) if len(paths) > 1 else None
        if expect is not None and expect != len(self.tensors):
            raise ConversionError(f"{self.path}: the split GGUF's shards hold {len(self.tensors)} "
                                  f"tensors, its first shard says {expect} (split.tensors.count)")
        self.used: set[str] = set()

    def _add_tensors(self, reader, path: str) -> None:
        size = os.path.getsize(path)
        data = reader.data
        for t in reader.tensors:
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            start, nbytes = int(t.data_offset), int(t.n_bytes)
            if start + nbytes > size:
                raise ConversionError(f"{path}: tensor {t.name} lies past the end of the file "
                                      f"({start + nbytes} > {size} bytes): the file is truncated")
            rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
            if rows == 0 or nbytes % rows:
                raise ConversionError(f"{path}: tensor {t.name} has shape {list(shape)} and "
                                      f"{nbytes} bytes, which do not divide into rows")
            if t.name in self.tensors:
                raise ConversionError(f"{path}: tensor {t.name} is in two shards of the split GGUF")
            raw = data[start:start + nbytes].reshape(rows, nbytes // rows)
            self.tensors[t.name] = GTensor(t.name, t.tensor_type.name, shape, raw)

    @property
    def label(self) -> str:
        """The file's name as a source: its basename, and for a split GGUF its shard count."""
        base = os.path.basename(self.path)
        return base if len(self.paths) == 1 else f"{base} (1 of {len(self.paths)} shards)"

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
                yield (raw.view(DTYPE_NUMPY[dt]) if dt not in fmt.QUANT_DTYPES else raw), stored_sumsq(raw, dt, cols)
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


