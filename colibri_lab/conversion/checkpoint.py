"""A Hugging Face checkpoint folder read without torch: the safetensors headers parsed here,
each tensor (or a row range of it) read with seek + readinto, single or sharded files."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np

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
            raise ConversionError(f"missing tensor {name!r} in {self.dir} (incomplete "
                                  "checkpoint, or not of the family config.json names)")
        if t.st_dtype not in _ST_DTYPES:
            raise ConversionError(f"tensor {name!r} has dtype {t.st_dtype}; the converter "
                                  "reads F32, F16 and BF16 checkpoints")
        if t.shape != tuple(shape):
            raise ConversionError(f"tensor {name!r} has shape {list(t.shape)}, expected "
                                  f"{list(shape)} from config.json")
        self.used.add(name)
        return t

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
        return name in self.tensors

    def skip(self, name: str) -> None:
        """Mark a tensor as deliberately left out (e.g. an empty shared expert)."""
        if name in self.tensors:
            self.used.add(name)

