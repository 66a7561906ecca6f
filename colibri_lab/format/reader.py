"""`inspect(path)`: a pure-Python reader that validates a `.colibri` file the way the engine
does (magic, version, header CRC, sizes, bounds, section order, small-section CRCs, record
constraints) without the engine, and returns a `ColibriInfo` that prints as a readable
summary and shows as an HTML table in a notebook; and `colibri-inspect` (`main`).

Every failure of the reader raises `FormatError` (a `ValueError`) whose message names
the field and says what was expected."""

from __future__ import annotations

import html
import math
import os
import struct
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .spec import (
    _HDR_FIXED,
    _HDR_TAIL,
    _META_SCALAR,
    _REC_HEAD,
    _REC_TAIL,
    _SECTION,
    DTYPE_BLOCKS,
    DTYPE_NAMES,
    DTYPE_NUMPY,
    FAMILY_OPTION_DEFAULTS,
    FLAG_ROUTER_INT8,
    FLAG_TIED_EMBEDDINGS,
    HDR_ALIGNMENT_OFFSET,
    HDR_CRC_OFFSET,
    HDR_SECTIONS_OFFSET,
    HEADER_FIELDS,
    HEADER_SIZE,
    KNOWN_FLAGS,
    LAYOUT_EXPERTS_PACKED,
    LAYOUT_NAMES,
    MAGIC,
    MAX_DIMS,
    MAX_KEY_LEN,
    MAX_NAME_LEN,
    META_TYPE_NAMES,
    MT_ARRAY,
    MT_BOOL,
    MT_STRING,
    N_SECTIONS,
    QUANT_DTYPES,
    READ_VERSIONS,
    SECTION_ALIGNMENT,
    SECTION_METADATA,
    SECTION_NAMES,
    SECTION_TENSORS,
    SECTION_TOKENIZER,
    SMALL_SECTIONS,
    U64_MAX,
    WEIGHT_SECTIONS,
    FormatError,
    crc32,
    require_little_endian,
    stored_shape,
    stored_to_f32,
    tensor_nbytes,
)

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
            from . import blocks as quants
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
        if magic[:4] == b"GGUF":
            raise FormatError(f"{path}: a llama.cpp GGUF, not a .colibri file; import it once "
                              f"(weights copied, not requantized): colibri-convert "
                              f"--model_name_or_path {path} --output_path MODEL.colibri")
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
