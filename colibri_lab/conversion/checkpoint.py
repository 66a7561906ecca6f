"""A Hugging Face checkpoint folder read without torch: the safetensors headers parsed here,
each tensor (or a row range of it) read with seek + readinto, single or sharded files.

FP8 checkpoints (DeepSeek-V3/R1, Kimi, Qwen3 "-FP8": config.json `quantization_config`
{quant_method: fp8, fmt: e4m3, weight_block_size: [bm, bn]}): a `float8_e4m3fn` weight
W [R, C] comes with `W_scale_inv` [ceil(R/bm), ceil(C/bn)] (f32, bf16 or f16), and its
value is e4m3fn(W[i, j]) * scale[i // bm, j // bn] (one f32 product; edge blocks are
partial). `Checkpoint.get` returns such a weight as an `Fp8SrcTensor`, which reads as f32
values, dequantized row block by row block as it is read: the producers stream it like
any f32 tensor, into any output dtype, never holding more than the rows they asked for.

INT4 checkpoints in compressed-tensors' pack-quantized format (Kimi-K2-Thinking's routed
experts: config.json `quantization_config` {quant_method: compressed-tensors, format:
pack-quantized, config_groups: weights {num_bits: 4, type: int, symmetric: true, strategy:
group, group_size: G}}): a weight W [R, C] is stored as `W_packed` (int32 [R, ceil(C / 8)],
value j at bits 4 (j % 8) of word j // 8, plus 8), `W_scale` [R, ceil(C / G)] and `W_shape`
([R, C]); its value is compressed-tensors' dequantization, (q - 8) * scale[i, j // G] rounded
to the scale's dtype (bf16 for Kimi). `Checkpoint.get` returns it as a `PackedIntSrcTensor`,
read as f32 values row by row like the FP8 weights.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np

from ..format import spec as fmt
from ..format.spec import DTYPE_BF16, DTYPE_F16, DTYPE_F32
from .spec import ConversionError

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
        if self.st_dtype == "U8":   # raw bytes (MXFP4 blocks and scales), Checkpoint.get_bytes
            return np.dtype("u1")
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


def e4m3fn_table() -> np.ndarray:
    """The 256 values of float8_e4m3fn as float32 (1 sign, 4 exponent bits with bias 7, 3
    mantissa bits; exponent 0 subnormal m/8 * 2^-6; S.1111.111 NaN; no infinities)."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    out = (sign * mag).astype(np.float32)
    out[(e == 15) & (m == 7)] = np.nan
    return out


_E4M3FN = e4m3fn_table()


@dataclass
class _DequantSrcTensor(SrcTensor):
    """A quantized weight read as f32 values (dtype_id f32), dequantized per row range as the
    producers read it: subclasses give the rows r0 .. r1 - 1 as float32 [r1 - r0, C]."""
    scale: SrcTensor | None = None

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype("<f4")

    @property
    def dtype_id(self) -> int:
        return DTYPE_F32

    def rows_f32(self, r0: int, r1: int) -> np.ndarray:
        raise NotImplementedError

    def read_flat(self, first: int, count: int) -> np.ndarray:
        if first < 0 or count < 0 or first + count > self.numel:
            raise ConversionError(f"internal: read past tensor {self.name}")
        C = self.shape[-1]
        r0, r1 = first // C, -(-(first + count) // C)
        x = self.rows_f32(r0, r1).reshape(-1)
        off = first - r0 * C
        return x[off:off + count]

    def scale_rows(self, r0: int, r1: int) -> np.ndarray:
        """Rows r0 .. r1 - 1 of the scale tensor, as f32."""
        gc = self.scale.shape[-1]
        return fmt.stored_to_f32(self.scale.read_flat(r0 * gc, (r1 - r0) * gc), self.scale.dtype_id).reshape(r1 - r0, gc)


@dataclass
class Fp8SrcTensor(_DequantSrcTensor):
    """A float8_e4m3fn weight with its block scales: value[i, j] = e4m3fn(byte[i, j]) *
    scale[i // bm, j // bn], in float32."""
    block: tuple[int, int] = (128, 128)

    def rows_f32(self, r0: int, r1: int) -> np.ndarray:
        C = self.shape[-1]
        raw = SrcTensor(self.name, self.path, "U8", self.shape, self.start,
                        self.nbytes).read_flat(r0 * C, (r1 - r0) * C).reshape(r1 - r0, C)
        bm, bn = self.block
        b0, b1 = r0 // bm, -(-r1 // bm)
        rows = np.repeat(self.scale_rows(b0, b1), bm, axis=0)[r0 - b0 * bm:r1 - b0 * bm]
        return (_E4M3FN[raw] * np.repeat(rows, bn, axis=1)[:, :C]).astype(np.float32)


@dataclass
class PackedIntSrcTensor(_DequantSrcTensor):
    """A compressed-tensors pack-quantized INT4 weight with its group scales: value[i, j] =
    (nibble j of row i - 8) * scale[i, j // group], one f32 product (exact) rounded to the
    scale's dtype, as compressed-tensors' dequantize computes it in that dtype.
    `start`/`nbytes` are the packed int32 words'."""
    group: int = 32

    def rows_f32(self, r0: int, r1: int) -> np.ndarray:
        C = self.shape[-1]
        W = -(-C // 8)                      # int32 words a row
        raw = SrcTensor(self.name, self.path, "U8", (self.nbytes,), self.start,
                        self.nbytes).read_flat(r0 * 4 * W, (r1 - r0) * 4 * W).reshape(r1 - r0, 4 * W)
        q = np.empty((r1 - r0, 8 * W), dtype=np.int8)
        q[:, 0::2] = raw & 0xF               # little-endian words: the low nibble first
        q[:, 1::2] = raw >> 4
        q = q[:, :C].astype(np.float32) - 8.0
        x = (q * np.repeat(self.scale_rows(r0, r1), self.group, axis=1)[:, :C]).astype(np.float32)
        if self.scale.dtype_id == DTYPE_BF16:       # round to nearest even, to bf16
            u = x.view(np.uint32)
            u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
            u &= np.uint32(0xFFFF0000)
        elif self.scale.dtype_id == DTYPE_F16:
            x = x.astype(np.float16).astype(np.float32)
        return x


def _packed_config(qc) -> int | None:
    """The group size of a compressed-tensors pack-quantized INT4 quantization_config, None
    when it is not one; refuses the compressed-tensors schemes the converter does not read."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    what = "config.json: quantization_config (compressed-tensors)"
    if qc.get("format") != "pack-quantized":
        raise ConversionError(f"{what} format {qc.get('format')!r}; the converter reads pack-quantized "
                              "INT4 weights (Kimi-K2-Thinking's)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConversionError(f"{what} has no config_groups")
    sizes = set()
    for gname, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            raise ConversionError(f"{what} group {gname!r} has no weights scheme")
        if g.get("input_activations") is not None or g.get("output_activations") is not None:
            raise ConversionError(f"{what} group {gname!r} quantizes activations too; the converter reads "
                                  "weight-only schemes (activations are not quantized here)")
        want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "dynamic": False}
        bad = {k: w.get(k) for k, v in want.items() if w.get(k, v if k == "dynamic" else None) != v}
        if w.get("actorder") not in (None, False, "static") or bad:
            raise ConversionError(f"{what} group {gname!r}: {bad or {'actorder': w.get('actorder')}}; the converter "
                                  "reads symmetric INT4 with group scales (num_bits 4, type int, symmetric, "
                                  "strategy group)")
        gs = w.get("group_size")
        if not (isinstance(gs, int) and gs > 0):
            raise ConversionError(f"{what} group {gname!r}: group_size {gs!r}")
        sizes.add(gs)
    if len(sizes) != 1:
        raise ConversionError(f"{what}: groups of different sizes {sorted(sizes)}")
    return sizes.pop()


def _config(model_dir: str) -> dict:
    p = os.path.join(model_dir, "config.json")
    if not os.path.isfile(p):
        return {}
    with open(p) as f:
        return json.load(f)


def _quantization_config(cfg: dict, wrapper):
    """config.json's quantization_config, or its language model's (a multimodal wrapper's)."""
    qc = cfg.get("quantization_config")
    if qc is None and wrapper is not None:
        qc = cfg[wrapper.config_key].get("quantization_config")
    return qc


def _fp8_config(qc) -> tuple[int, int] | None:
    """A quantization_config's FP8 block size (weight_block_size), None when the checkpoint is not
    FP8; refuses the FP8 variants the converter does not read."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConversionError(f"config.json: quantization_config fmt {qc.get('fmt')!r}; the "
                              "converter reads e4m3 FP8 checkpoints")
    bs = qc.get("weight_block_size")
    if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(v, int) and v > 0
                                                          for v in bs)):
        raise ConversionError(f"config.json: quantization_config weight_block_size {bs!r}; the "
                              "converter reads block-scaled FP8 ([rows, cols], e.g. [128, 128])")
    return int(bs[0]), int(bs[1])


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
        if d["dtype"] in (*_ST_DTYPES, "F8_E4M3") and \
                t.numel * (1 if d["dtype"] == "F8_E4M3" else t.np_dtype.itemsize) != t.nbytes:
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
        from .families import text_wrapper

        cfg = _config(model_dir)
        wrapper = text_wrapper(cfg)
        qc = _quantization_config(cfg, wrapper)
        self.fp8_block = _fp8_config(qc)
        self.int4_group = _packed_config(qc)
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
        if wrapper is not None:   # the language model's weights under their family's names
            p = wrapper.prefix
            self.tensors = {(n[len(p):] if n.startswith(p) else n): t for n, t in self.tensors.items()}

    def get(self, name: str, shape: tuple[int, ...]) -> SrcTensor:
        t = self.tensors.get(name)
        if t is None and name + "_packed" in self.tensors:
            t = self._packed(name, shape)
        if t is None:
            raise ConversionError(f"missing tensor {name!r} in {self.dir} (incomplete "
                                  "checkpoint, or not of the family config.json names)")
        if t.st_dtype == "F8_E4M3":
            t = self._fp8(t, name)
        if t.st_dtype not in _ST_DTYPES and not isinstance(t, (Fp8SrcTensor, PackedIntSrcTensor)):
            raise ConversionError(f"tensor {name!r} has dtype {t.st_dtype}; the converter "
                                  "reads F32, F16 and BF16 checkpoints, and FP8 (F8_E4M3) "
                                  "weights with block scales")
        if t.shape != tuple(shape):
            raise ConversionError(f"tensor {name!r} has shape {list(t.shape)}, expected "
                                  f"{list(shape)} from config.json")
        self.used.add(name)
        return t

    def _fp8(self, t: SrcTensor, name: str) -> Fp8SrcTensor:
        """An F8_E4M3 weight (named `name` here) with its `<name>_scale_inv` block scales."""
        if self.fp8_block is None:
            raise ConversionError(f"tensor {t.name!r} is float8_e4m3fn but config.json has no "
                                  "quantization_config {quant_method: fp8, weight_block_size}")
        if len(t.shape) != 2:
            raise ConversionError(f"tensor {t.name!r}: FP8 weights are 2-D, got {list(t.shape)}")
        sname = name + "_scale_inv"
        sc = self.tensors.get(sname)
        bm, bn = self.fp8_block
        want = (-(-t.shape[0] // bm), -(-t.shape[1] // bn))
        if sc is None or sc.st_dtype not in _ST_DTYPES or sc.shape != want:
            raise ConversionError(f"FP8 tensor {t.name!r} needs {sname} of shape {list(want)} "
                                  f"(blocks of {bm}x{bn}), found "
                                  f"{'none' if sc is None else f'{sc.st_dtype} {list(sc.shape)}'}")
        self.used.add(sname)
        return Fp8SrcTensor(t.name, t.path, t.st_dtype, t.shape, t.start, t.nbytes, scale=sc,
                            block=(bm, bn))

    def _packed(self, name: str, shape: tuple[int, ...]) -> PackedIntSrcTensor:
        """A pack-quantized INT4 weight: `<name>_packed`, `<name>_scale`, `<name>_shape`."""
        if self.int4_group is None:
            raise ConversionError(f"tensor {name!r} is stored packed ({name}_packed) but config.json has no "
                                  "quantization_config {quant_method: compressed-tensors, format: pack-quantized}")
        G = self.int4_group
        pk, sc, sh = (self.tensors.get(name + x) for x in ("_packed", "_scale", "_shape"))
        if len(shape) != 2:
            raise ConversionError(f"packed tensor {name!r}: INT4 weights are 2-D, expected {list(shape)}")
        R, C = shape
        if sh is None or sh.st_dtype not in ("I32", "I64") or sh.shape != (2,):
            raise ConversionError(f"packed tensor {name!r} needs {name}_shape (2 integers)")
        stored = SrcTensor(sh.name, sh.path, "U8", (sh.nbytes,), sh.start, sh.nbytes).read_flat(0, sh.nbytes)
        stored = [int(v) for v in stored.view("<i4" if sh.st_dtype == "I32" else "<i8")]
        want_pk, want_sc = (R, -(-C // 8)), (R, -(-C // G))
        if stored != [R, C]:
            raise ConversionError(f"packed tensor {name!r} has {name}_shape {stored}, expected {[R, C]} from "
                                  "config.json")
        if pk.st_dtype != "I32" or pk.shape != want_pk or pk.nbytes != 4 * R * want_pk[1]:
            raise ConversionError(f"packed tensor {name!r}: {name}_packed is {pk.st_dtype} {list(pk.shape)}, "
                                  f"expected I32 {list(want_pk)}")
        if sc is None or sc.st_dtype not in _ST_DTYPES or sc.shape != want_sc:
            raise ConversionError(f"packed tensor {name!r} needs {name}_scale of shape {list(want_sc)} (groups of "
                                  f"{G}), found {'none' if sc is None else f'{sc.st_dtype} {list(sc.shape)}'}")
        self.used.update((name + "_packed", name + "_scale", name + "_shape"))
        return PackedIntSrcTensor(name, pk.path, "I32", (R, C), pk.start, pk.nbytes, scale=sc, group=G)

    def get_bytes(self, name: str, shape: tuple[int, ...]) -> SrcTensor:
        """A U8 tensor (an MXFP4 checkpoint's *_blocks / *_scales), read as raw bytes."""
        t = self.tensors.get(name)
        if t is None:
            raise ConversionError(f"missing tensor {name!r} in {self.dir}")
        if t.st_dtype != "U8" or t.shape != tuple(shape):
            raise ConversionError(f"tensor {name!r} is {t.st_dtype} {list(t.shape)}, expected U8 "
                                  f"{list(shape)} (MXFP4 blocks / scales)")
        self.used.add(name)
        return t

    def unused(self) -> list[str]:
        skip = ("rotary_emb.inv_freq", "lm_head.weight")   # derived, or tied
        return sorted(n for n in self.tensors if n not in self.used and not n.endswith(skip))

    def has(self, name: str) -> bool:
        return name in self.tensors or name + "_packed" in self.tensors

    def skip(self, name: str) -> None:
        """Mark a tensor as deliberately left out (e.g. an empty shared expert)."""
        if name in self.tensors:
            self.used.add(name)

