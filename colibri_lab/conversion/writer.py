"""Writing a `.colibri` file: the metadata of a `ModelSpec` (`build_metadata`,
`family_metadata`, `spec_metadata`) and `write_colibri`, which lays out and streams the
planned tensors (CRCs and norms computed while writing, header and directory patched at
the end, OUT.tmp renamed), with the converter's progress lines (`_Say`)."""

from __future__ import annotations

import math
import os
import struct
import sys

import numpy as np

from ..format import spec as fmt
from ..format.spec import DTYPE_NUMPY, MetaValue
from . import deepseek as _deepseek
from .spec import CONVERTER_NAME, ConversionError, ModelSpec, PlannedTensor, _version
from .tokenizer import _tokenizer_meta_entries


def family_metadata(s: ModelSpec) -> list[tuple[str, MetaValue]]:
    """The family-option keys (docs/format.md, "Family options"). A Mixtral file needs
    none of them (their defaults are Mixtral's); other families write them all, so that
    `colibri-inspect` shows every option. The RoPE keys of a YaRN file go with every family."""
    M = MetaValue
    out: list[tuple[str, MetaValue]] = []
    if s.architecture != "mixtral":
        L = s.n_layers
        out += [
            ("model.attention", M(fmt.MT_STRING, s.attention)),
            ("model.routing", M(fmt.MT_STRING, s.routing)),
            ("model.activation", M(fmt.MT_STRING, s.activation)),
            ("model.layer_ffn", M(fmt.MT_ARRAY, list(s.layer_ffn or (1,) * L), fmt.MT_U32)),
            ("model.dense_intermediate_size", M(fmt.MT_U32, s.dense_intermediate_size)),
            ("model.shared_expert_intermediate_size", M(fmt.MT_U32, s.shared_expert_intermediate_size)),
            ("model.shared_expert_gate", M(fmt.MT_BOOL, s.shared_expert_gate)),
            ("model.attn_qkv_bias", M(fmt.MT_BOOL, s.attn_qkv_bias)),
            ("model.attn_output_bias", M(fmt.MT_BOOL, s.attn_output_bias)),
            ("model.attn_qk_norm", M(fmt.MT_STRING, s.attn_qk_norm)),
            ("model.clip_qkv", M(fmt.MT_F64, s.clip_qkv)),
        ]
        if s.mla is not None:   # DeepSeek: MLA widths, router groups, bias and scale
            types = {"STRING": fmt.MT_STRING, "U32": fmt.MT_U32, "F64": fmt.MT_F64,
                     "BOOL": fmt.MT_BOOL}
            out += [(k, M(types[t], v)) for k, t, v in _deepseek.metadata(s)]
        if s.activation == "clamped_swiglu":   # gpt-oss
            out += [("model.swiglu_limit", M(fmt.MT_F64, s.swiglu_limit)),
                    ("model.swiglu_alpha", M(fmt.MT_F64, s.swiglu_alpha))]
        if s.architecture == "gpt_oss":
            out += [("model.router_logit_bias", M(fmt.MT_BOOL, s.router_logit_bias)),
                    ("model.attn_sinks", M(fmt.MT_BOOL, s.attn_sinks)),
                    ("model.expert_bias", M(fmt.MT_BOOL, s.expert_bias))]
        if s.layer_sliding_window:
            out.append(("model.layer_sliding_window",
                        M(fmt.MT_ARRAY, list(s.layer_sliding_window), fmt.MT_U64)))
    if s.rope_type != "default":
        out += [("model.rope_inv_freq", M(fmt.MT_ARRAY, list(s.rope_inv_freq), fmt.MT_F64)),
                ("model.rope_attention_factor", M(fmt.MT_F64, s.rope_attention_factor))]
    return out


def spec_metadata(s: ModelSpec, *, name: str, max_seq_len: int, router_dtype: str,
                  weight_dtype: str) -> list[tuple[str, MetaValue]]:
    """The required model keys of the metadata (docs/format.md, "Keys"), for the HF
    converter and the GGUF importer alike."""
    M = MetaValue
    return [
        ("general.architecture", M(fmt.MT_STRING, s.architecture)),
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
        ("model.norm_topk_prob", M(fmt.MT_BOOL, s.norm_topk_prob)),
        ("model.rms_norm_eps", M(fmt.MT_F64, s.rms_norm_eps)),
        ("model.rope_theta", M(fmt.MT_F64, s.rope_theta)),
        ("model.rope_type", M(fmt.MT_STRING, s.rope_type)),
        ("model.max_position_embeddings", M(fmt.MT_U64, s.max_position_embeddings)),
        ("model.sliding_window", M(fmt.MT_U64, s.sliding_window)),
        ("model.tie_word_embeddings", M(fmt.MT_BOOL, s.tie_word_embeddings)),
        ("model.max_seq_len", M(fmt.MT_U64, max_seq_len)),
        ("model.router_dtype", M(fmt.MT_STRING, router_dtype)),
        ("model.weight_dtype", M(fmt.MT_STRING, weight_dtype)),
    ]


def build_metadata(s: ModelSpec, name: str, W: int, int8_router: bool, B: int,
                   max_seq_len: int, tok_meta: dict, *, mix: str | None = None) -> bytes:
    """The metadata section. `mix`: a quantized mix's name, which becomes
    model.weight_dtype (its routers are f32 unless int8)."""
    wname = fmt.DTYPE_NAMES[W] if mix is None else mix
    rname = "int8" if int8_router else (fmt.DTYPE_NAMES[W] if mix is None else "f32")
    M = MetaValue
    entries = [
        *spec_metadata(s, name=name, max_seq_len=max_seq_len, router_dtype=rname, weight_dtype=wname),
        *family_metadata(s),
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


def _drop_cached_pages(fd: int) -> None:
    """Drop the just-written (and fsynced, so clean) file from the page cache. Written pages
    stay cached in small folios, which the engine's mapping then has to use with 4 KiB pages;
    read back on first use, through the engine's MADV_HUGEPAGE mapping, they come in 2 MiB
    folios that it maps with huge pages (decode is faster so: `python -m colibri_lab.bench` reports
    the share of the file in 2 MiB pages beside each figure; docs/performance.md).
    Advisory: nothing happens where posix_fadvise is missing."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def file_version(tensors: list[PlannedTensor]) -> int:
    """1 for a file of float tensors in the version 1 layout; 2 when a tensor is
    block-quantized or an FFN is stored split (docs/format.md, "Version 2")."""
    if any(t.dtype in fmt.QUANT_DTYPES for t in tensors):
        return 2
    if any(t.name.endswith(SPLIT_FFN_SUFFIXES) for t in tensors):
        return 2
    return 1


# the tensors of a split FFN (version 2): routed experts, a dense MLP, a shared expert
SPLIT_FFN_SUFFIXES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate", "ffn_up",
                      "ffn_down", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


def codebook_tensors(tensors: list[PlannedTensor]) -> list[PlannedTensor]:
    """The codebooks the grid-type tensors among `tensors` read (IQ2_XXS ... IQ1_M: ggml's
    grids, from the gguf package), one int8 tensor "codebook.<name>" [entries, width] each in
    the dense section, which the engine checks and installs when it opens the file."""
    names = sorted({fmt.CODEBOOK_OF[t.dtype] for t in tensors if t.dtype in fmt.GRID_DTYPES})
    out = []
    for name in names:
        def produce(name=name):
            from ..format import blocks
            g = np.ascontiguousarray(blocks.codebook(name))
            v = g.astype(np.float64).reshape(-1)
            yield g, float(v @ v)
        out.append(PlannedTensor(f"codebook.{name}", fmt.DTYPE_I8, fmt.LAYOUT_ROW_MAJOR,
                                 fmt.CODEBOOK_SHAPES[name], fmt.SECTION_DENSE, produce))
    return out


def write_colibri(output_path: str, spec: "ModelSpec", tensors: list[PlannedTensor],
                  meta: bytes, tok_bytes: bytes, *, msl: int, int8_router: bool,
                  block_size: int, say=None) -> str:
    """Lay out and write a .colibri file: `tensors` in file order (each producing its stored
    bytes front to back), `meta` the encoded metadata, `tok_bytes` the tokenizer section.
    Streams: peak memory is one producer chunk. Written to OUT.tmp and renamed; on any
    error nothing is left behind."""
    if say is None:
        say = _Say(False)
    tensors = tensors + codebook_tensors(tensors)
    version = file_version(tensors)

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
            f.write(fmt.encode_header(fields, [tuple(s) for s in sec], file_size, A, block_size,
                                      version))
            f.flush()
            os.fsync(f.fileno())
            _drop_cached_pages(f.fileno())
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


