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
"Converter mixes") each weight matrix gets the dtype `quants.mix_dtype` gives it and is
quantized chunk by chunk of whole rows with llama.cpp's reference quantizers
(`colibri_lab.quants`); every FFN is stored split (gate, up, down row-major tensors,
format version 2), so no expert matrix is ever read whole; routers and norms stay f32.

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
from . import _deepseek, quants
from .format import (DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_I8, DTYPE_IDS, DTYPE_NUMPY,
                     LAYOUT_EXPERTS_PACKED, LAYOUT_ROW_MAJOR, QUANT_DTYPES,
                     MetaValue)

CONVERTER_NAME = "colibri_lab.convert"
CHUNK_ELEMS = 1 << 20   # values per conversion chunk (about 4 MiB of f32)
FLOAT_DTYPES = ("f32", "f16", "bf16")
# block-quantized converter mixes (docs/quantization.md, "Converter mixes"); each tensor's
# dtype comes from quants.mix_dtype, every FFN is stored split (format version 2)
QUANT_MIXES = quants.MIXES

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


# --------------------------------------------------------------------------- config

@dataclass
class ModelSpec:
    """What the converter needs from config.json. The fields after `tie_word_embeddings`
    are the format's family options (docs/format.md); their defaults are Mixtral's."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int           # routed experts' width
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
    architecture: str = "mixtral"
    norm_topk_prob: bool = True
    layer_ffn: tuple = ()            # per layer 1 = MoE, 0 = dense MLP; () = all MoE
    dense_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    attn_qkv_bias: bool = False
    attn_output_bias: bool = False
    attn_qk_norm: str = "none"       # none | head | full
    clip_qkv: float = 0.0
    layer_sliding_window: tuple = () # per-layer windows; () = all `sliding_window`
    # the family's choices (Family, docs/format.md "Family options")
    attention: str = "gqa"
    routing: str = "softmax_topk"
    activation: str = "silu_glu"
    rope_type: str = "default"       # default | yarn
    rope_inv_freq: tuple = ()        # yarn: the [rope_dim / 2] inverse frequencies
    rope_attention_factor: float = 1.0   # yarn: multiplies cos and sin
    # grouped routing (DeepSeek; model/route_group.c): n_group groups, topk_group kept
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False        # a per-expert correction bias for the choice only (V3)
    mla: object = None               # _deepseek.MLAOptions of a multi-head latent attention
    # gpt-oss (docs/format.md, "Family options of gpt-oss")
    swiglu_limit: float = 0.0        # activation clamped_swiglu: the clamp bound
    swiglu_alpha: float = 0.0        # activation clamped_swiglu: the sigmoid's gain
    router_logit_bias: bool = False  # blk.N.ffn_gate_inp.bias added to the router logits
    attn_sinks: bool = False         # blk.N.attn_sinks, one sink logit per query head
    expert_bias: bool = False        # blk.N.ffn_{gate,up,down}_exps.bias

    def is_moe(self, layer: int) -> bool:
        return not self.layer_ffn or bool(self.layer_ffn[layer])


MixtralSpec = ModelSpec   # the name before the other families arrived


def _cfg_int(cfg: dict, key: str, default=None) -> int:
    v = cfg.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ConversionError(f"config.json: {key} must be an integer, got {v!r}")
    if v < 1:
        raise ConversionError(f"config.json: {key} must be >= 1, got {v}")
    return int(v)


def _cfg_bool(cfg: dict, key: str, default: bool) -> bool:
    v = cfg.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConversionError(f"config.json: {key} must be true or false, got {v!r}")
    return v


def _cfg_size(cfg: dict, key: str, default=None) -> int:
    """An integer width that may be 0."""
    v = cfg.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < 0:
        raise ConversionError(f"config.json: {key} must be an integer >= 0, got {v!r}")
    return int(v)


def _sparse_layers(cfg: dict, n_layers: int, n_experts: int) -> tuple:
    """Qwen's rule (Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer): layer i is an MoE block
    iff i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ConversionError(f"config.json: mlp_only_layers must be a list of layer indices, "
                              f"got {only!r}")
    step = _cfg_int(cfg, "decoder_sparse_step", 1)
    return tuple(int(i not in only and n_experts > 0 and (i + 1) % step == 0)
                 for i in range(n_layers))


@dataclass(frozen=True)
class CommonConfig:
    """The config keys every family shares, read before the family's own (`Family.read`)."""
    cfg: dict
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_layers: int


def _layer_windows(cfg: dict, n_layers: int, win: int, default_types) -> tuple[int, tuple]:
    """`layer_types` (sliding_attention / full_attention per layer; `default_types` when the
    config has none) -> (sliding_window, layer_sliding_window): one window for every layer
    when they agree, else the per-layer tuple."""
    types = cfg.get("layer_types")
    if types is None:
        types = default_types
    if not isinstance(types, list) or len(types) != n_layers or \
            any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConversionError(f"config.json: layer_types {types!r} must list "
                              f"sliding_attention or full_attention for each of "
                              f"the {n_layers} layers")
    if "sliding_attention" in types and win == 0:
        raise ConversionError("config.json: layer_types has sliding_attention "
                              "layers but no sliding window (use_sliding_window / "
                              "sliding_window)")
    windows = tuple(win if t == "sliding_attention" else 0 for t in types)
    if len(set(windows)) == 1:
        return windows[0], ()
    return 0, windows


def _mixtral_options(c: CommonConfig) -> dict:
    cfg = c.cfg
    sw = cfg.get("sliding_window")
    return dict(n_experts=_cfg_int(cfg, "num_local_experts"),
                intermediate_size=_cfg_int(cfg, "intermediate_size"),
                sliding_window=0 if sw is None else _cfg_size(cfg, "sliding_window"))


def _qwen_moe_layers(c: CommonConfig, E: int) -> dict:
    """Qwen's dense layers (mlp_only_layers / decoder_sparse_step) and window switch."""
    cfg = c.cfg
    out: dict = {}
    layer_ffn = _sparse_layers(cfg, c.n_layers, E)
    if not any(layer_ffn):
        raise ConversionError("config.json: no layer is an MoE block (mlp_only_layers / "
                              "decoder_sparse_step); colibri runs MoE models")
    if not all(layer_ffn):
        out["layer_ffn"] = layer_ffn
        out["dense_intermediate_size"] = _cfg_int(cfg, "intermediate_size")
    return out


def _qwen_window(cfg: dict) -> int:
    use_sw = _cfg_bool(cfg, "use_sliding_window", False)
    win = cfg.get("sliding_window") if use_sw else None
    return 0 if win is None else _cfg_size(cfg, "sliding_window")


def _qwen2_moe_options(c: CommonConfig) -> dict:
    cfg = c.cfg
    E = _cfg_int(cfg, "num_experts")
    Is = _cfg_size(cfg, "shared_expert_intermediate_size")
    out = dict(n_experts=E, intermediate_size=_cfg_int(cfg, "moe_intermediate_size"),
               norm_topk_prob=_cfg_bool(cfg, "norm_topk_prob", False),
               shared_expert_intermediate_size=Is,
               shared_expert_gate=Is > 0,   # Qwen2MoeSparseMoeBlock always gates it
               attn_qkv_bias=_cfg_bool(cfg, "qkv_bias", True), **_qwen_moe_layers(c, E))
    # Qwen2MoeConfig: sliding_window only when use_sliding_window; layer_types default:
    # sliding on even layers below max_window_layers.
    use_sw = _cfg_bool(cfg, "use_sliding_window", False)
    mwl = _cfg_size(cfg, "max_window_layers", 28)
    default = ["sliding_attention" if (i + 1) % 2 and i < mwl and use_sw else "full_attention"
               for i in range(c.n_layers)]
    out["sliding_window"], out["layer_sliding_window"] = \
        _layer_windows(cfg, c.n_layers, _qwen_window(cfg), default)
    return out


def _qwen3_moe_options(c: CommonConfig) -> dict:
    cfg = c.cfg
    # Qwen3-MoE's config.json says num_local_experts (attribute_map) or num_experts
    E = _cfg_int(cfg, "num_experts" if "num_experts" in cfg else "num_local_experts")
    bias = _cfg_bool(cfg, "attention_bias", False)
    return dict(n_experts=E, intermediate_size=_cfg_int(cfg, "moe_intermediate_size"),
                norm_topk_prob=_cfg_bool(cfg, "norm_topk_prob", False),
                sliding_window=_qwen_window(cfg),   # one window for every layer
                attn_qkv_bias=bias, attn_output_bias=bias, attn_qk_norm="head",
                **_qwen_moe_layers(c, E))


def _olmoe_options(c: CommonConfig) -> dict:
    cfg = c.cfg
    # OlmoeAttention normalises the whole q and k projections (q_norm over hidden_size,
    # k_norm over (H // nh) * nkv values), which only fits when head_dim == H // nh.
    if c.hidden % c.n_heads or c.head_dim != c.hidden // c.n_heads:
        raise ConversionError(f"config.json: OLMoE's q/k norms need head_dim == "
                              f"hidden_size / num_attention_heads ({c.hidden}/{c.n_heads}), "
                              f"got head_dim {c.head_dim}")
    bias = _cfg_bool(cfg, "attention_bias", False)
    clip = cfg.get("clip_qkv")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                             or not clip > 0 or not math.isfinite(clip)):
        raise ConversionError(f"config.json: clip_qkv must be a positive number or "
                              f"null, got {clip!r}")
    E = _cfg_int(cfg, "num_experts" if "num_experts" in cfg else "num_local_experts")
    return dict(n_experts=E, intermediate_size=_cfg_int(cfg, "intermediate_size"),
                norm_topk_prob=_cfg_bool(cfg, "norm_topk_prob", False),
                attn_qkv_bias=bias, attn_output_bias=bias, attn_qk_norm="full",
                clip_qkv=float(clip or 0.0))


def _deepseek_options(c: CommonConfig, fam: str) -> dict:
    """DeepSeek-V2/V3 (colibri_lab/_deepseek.py): multi-head latent attention, dense first
    layers, shared experts (ungated), grouped routers."""
    cfg = c.cfg
    if c.n_kv_heads != c.n_heads:
        raise ConversionError(f"config.json: num_key_value_heads {c.n_kv_heads} != "
                              f"num_attention_heads {c.n_heads}; DeepSeek's MLA has one latent "
                              "for every head")
    E = _cfg_int(cfg, "n_routed_experts")
    try:
        opts = _deepseek.deepseek_config(cfg, fam, c.n_layers, E,
                                         _cfg_int(cfg, "num_experts_per_tok"))
    except ValueError as e:
        raise ConversionError(str(e)) from None
    # RoPE (and YaRN's frequencies) over qk_rope_head_dim, transformers' config.head_dim
    return dict(n_experts=E, rope_dim=opts["head_dim"], **opts)


def _cfg_positive(cfg: dict, key: str, default: float) -> float:
    v = cfg.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConversionError(f"config.json: {key} must be a positive number, got {v!r}")
    return float(v)


def _gptoss_options(c: CommonConfig) -> dict:
    """gpt-oss (transformers 5.24's GptOssConfig / modeling_gpt_oss.py). Every layer is MoE;
    q/k/v/o biases when attention_bias (default true); one sink logit per query head; the
    router has a bias and takes top-k of its logits, then a softmax over those k; the
    experts have biases and the clamped SwiGLU (swiglu_limit, and swiglu_alpha, 1.702 when
    the config predates the key). layer_types picks the sliding layers (default: even
    layers); transformers' sliding mask lets query i see key j iff i - j < sliding_window,
    the engine's rule, so the window is stored as it is."""
    cfg = c.cfg
    bias = _cfg_bool(cfg, "attention_bias", True)
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(c.n_layers)]
    win = cfg.get("sliding_window")
    win = 0 if win is None else _cfg_size(cfg, "sliding_window")
    out = dict(n_experts=_cfg_int(cfg, "num_local_experts" if "num_local_experts" in cfg
                                  else "num_experts"),
               intermediate_size=_cfg_int(cfg, "intermediate_size"), norm_topk_prob=False,
               attn_qkv_bias=bias, attn_output_bias=bias,
               swiglu_limit=_cfg_positive(cfg, "swiglu_limit", 7.0),
               swiglu_alpha=_cfg_positive(cfg, "swiglu_alpha", 1.702),
               router_logit_bias=True, attn_sinks=True, expert_bias=True)
    out["sliding_window"], out["layer_sliding_window"] = _layer_windows(cfg, c.n_layers, win, default)
    return out


@dataclass(frozen=True)
class Family:
    """One MoE family, as one described thing: the config keys it reads (`read`), the
    tensor names of its checkpoints, and its choice of attention, routing, activation and
    RoPE. The converter reads the entry; the file carries the choices as metadata
    (docs/format.md, "Family options"), which the engine checks against its own family
    table (native/src/model/family.c) — so a new family is mostly a new entry here and there.

    attention: "gqa" (grouped-query, KV cache per KV head) | "mla" (multi-head latent).
    routing: "softmax_topk" (softmax over all experts, then top-k, optionally renormalised)
    | "topk_softmax" (top-k of the logits, softmax over those k) | "sigmoid_topk".
    activation: "silu_glu" (silu(gate) * up) | "clamped_swiglu".
    rope_types: the RoPE types its configs may ask for (rope_type / rope_scaling)."""
    name: str                       # config.json model_type = the file's general.architecture
    hf_class: str                   # the architectures entry transformers writes
    read: Callable[[CommonConfig], dict]   # -> ModelSpec fields
    eps_default: float = 1e-6
    rope_theta_default: float = 10000.0
    attention: str = "gqa"
    routing: str = "softmax_topk"
    activation: str = "silu_glu"
    rope_types: tuple = ("default", "yarn")
    # tensor names under model.layers.N (transformers' state dict)
    moe_blocks: tuple = ("mlp",)    # the MoE block's module (router `gate`, `experts`)
    expert_names: tuple = ("gate_proj", "up_proj", "down_proj")   # per-expert w1, w3, w2
    shared_expert: str = "shared_expert"
    router: str = "gate"            # the router's module in the MoE block
    experts_key: str = "num_experts"   # named in the top-k check's message


FAMILY_TABLE: tuple[Family, ...] = (
    Family("mixtral", "MixtralForCausalLM", _mixtral_options, eps_default=1e-5,
           rope_theta_default=1e6, moe_blocks=("block_sparse_moe", "mlp"),
           expert_names=("w1", "w3", "w2"), experts_key="num_local_experts"),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", _qwen2_moe_options),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe_options),
    Family("olmoe", "OlmoeForCausalLM", _olmoe_options, eps_default=1e-5),
    Family("deepseek_v2", "DeepseekV2ForCausalLM", lambda c: _deepseek_options(c, "deepseek_v2"),
           attention="mla", shared_expert="shared_experts", experts_key="n_routed_experts"),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", lambda c: _deepseek_options(c, "deepseek_v3"),
           attention="mla", routing="sigmoid_topk", shared_expert="shared_experts",
           experts_key="n_routed_experts"),
    Family("gpt_oss", "GptOssForCausalLM", _gptoss_options, eps_default=1e-5,
           rope_theta_default=150000.0, routing="topk_softmax", activation="clamped_swiglu",
           router="router", experts_key="num_local_experts"),
)
FAMILY_BY_NAME = {f.name: f for f in FAMILY_TABLE}
# model_type -> the architectures class name transformers writes for it
FAMILIES = {f.name: f.hf_class for f in FAMILY_TABLE}
SUPPORTED = ", ".join(f"{k} ({v})" for k, v in FAMILIES.items())


def family_of(cfg: dict) -> Family:
    """The family entry of a config.json (by model_type, else by architectures); refuses
    every other family by name."""
    mt = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if mt in FAMILY_BY_NAME:
        return FAMILY_BY_NAME[mt]
    for f in FAMILY_TABLE:
        if f.hf_class in archs:
            return f
    what = mt or (archs[0] if archs else "unknown")
    raise ConversionError(f"unsupported architecture {what!r} (model_type={mt!r}, "
                          f"architectures={archs}); supported: {SUPPORTED}")


def _family(cfg: dict) -> str:
    return family_of(cfg).name


def _rope_parameters(cfg: dict) -> dict:
    """transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; 4 writes
    rope_theta and rope_scaling {type | rope_type, ...}. One dict either way (no theta key
    when the config has none)."""
    rp = cfg.get("rope_parameters")
    rs = cfg.get("rope_scaling")
    out: dict = {}
    for src, what in ((rp, "rope_parameters"), (rs, "rope_scaling")):
        if src is None:
            continue
        if not isinstance(src, dict) or any(isinstance(v, dict) for v in src.values()):
            raise ConversionError(f"config.json: {what} {src!r} not understood (expected one "
                                  "dict of RoPE parameters)")
        out.update(src)
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out["type"]
    out.pop("type", None)
    out.setdefault("rope_type", "default")
    if "rope_theta" not in out and cfg.get("rope_theta") is not None:
        out["rope_theta"] = cfg["rope_theta"]
    return out


def yarn_parameters(rp: dict, dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """YaRN's inverse frequencies ([dim/2] float32) and attention factor, as transformers'
    `_compute_yarn_parameters` computes them (float32 where it uses torch, float64 where it
    uses Python floats)."""
    base = float(rp["rope_theta"])
    factor = rp.get("factor")
    omp = rp.get("original_max_position_embeddings")
    for key, v in (("factor", factor), ("original_max_position_embeddings", omp)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or
                              not v > 0 or not math.isfinite(v)):
            raise ConversionError(f"config.json: YaRN {key} must be a positive number, got {v!r}")
    if omp is None:
        raise ConversionError("config.json: YaRN needs original_max_position_embeddings")
    if factor is None:
        factor = max_position_embeddings / omp
    factor = float(factor)

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    af = rp.get("attention_factor")
    mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
    if af is None:
        af = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
              if mscale and mscale_all else get_mscale(factor))
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1
    truncate = rp.get("truncate", True)

    def corr_dim(rot):
        return (dim * math.log(omp / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    f32 = np.float32
    # base ** (arange(0, dim, 2).float() / dim) as torch's float32 pow (correctly rounded,
    # which numpy's vectorised float32 power is not always): in f64, rounded once
    expo = np.arange(0, dim, 2, dtype=f32) / f32(dim)
    pos = np.array([math.pow(float(f32(base)), float(e)) for e in expo]).astype(f32)
    extrap = (f32(1.0) / pos).astype(f32)
    interp = (f32(1.0) / (f32(factor) * pos)).astype(f32)
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
    ef = (f32(1) - ramp).astype(f32)
    inv = (interp * (f32(1) - ef) + extrap * ef).astype(f32)
    return inv, float(af)


def read_rope(cfg: dict, fam: Family, dim: int, max_pos: int) -> dict:
    """The RoPE fields of a ModelSpec: rope_theta, and for YaRN rope_type, rope_inv_freq
    (the dim/2 frequencies) and rope_attention_factor."""
    rp = _rope_parameters(cfg)
    rtype = rp["rope_type"]
    if rtype not in fam.rope_types:
        raise ConversionError(f"config.json: rope_type {rtype!r}; colibri runs "
                              f"{' and '.join(fam.rope_types)} RoPE for {fam.name}")
    theta = rp.get("rope_theta", fam.rope_theta_default)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConversionError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    known = {"default": {"rope_theta", "rope_type"},
             "yarn": {"rope_theta", "rope_type", "factor", "original_max_position_embeddings",
                      "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                      "truncate"}}[rtype]
    extra = sorted(k for k in set(rp) - known if rp[k] is not None)
    if extra:
        raise ConversionError(f"config.json: RoPE parameters {extra} for rope_type {rtype!r} "
                              "are not implemented by colibri")
    out = {"rope_theta": float(theta)}
    if rtype == "yarn":
        inv, af = yarn_parameters({**rp, "rope_theta": theta}, dim, max_pos)
        out.update(rope_type="yarn", rope_inv_freq=tuple(float(x) for x in inv),
                   rope_attention_factor=af)
    return out


def read_config(model_dir: str) -> ModelSpec:
    """Parse config.json (transformers 4 or 5 style) of a supported MoE checkpoint: the
    common keys here, the family's own through its FAMILY_TABLE entry."""
    p = os.path.join(model_dir, "config.json")
    if not os.path.isfile(p):
        raise ConversionError(f"no config.json in {model_dir}: give the folder of a Hugging "
                              "Face checkpoint")
    with open(p) as f:
        cfg = json.load(f)
    fam = family_of(cfg)
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
    n_layers = _cfg_int(cfg, "num_hidden_layers")
    max_pos = _cfg_int(cfg, "max_position_embeddings")
    opts = fam.read(CommonConfig(cfg, H, nh, nkv, hd, n_layers))
    E = opts["n_experts"]
    rope_dim = opts.pop("rope_dim", hd)
    hd = opts.pop("head_dim", hd)   # MLA: the RoPE width (qk_rope_head_dim)
    opts = {"sliding_window": 0, **read_rope(cfg, fam, rope_dim, max_pos), **opts}
    if opts["sliding_window"] < 0:
        raise ConversionError(f"config.json: sliding_window {opts['sliding_window']} < 0")
    k = _cfg_int(cfg, "num_experts_per_tok")
    if k > E:
        raise ConversionError(f"config.json: num_experts_per_tok {k} > {fam.experts_key} {E}")
    eps = cfg.get("rms_norm_eps", fam.eps_default)
    spec = ModelSpec(
        vocab_size=_cfg_int(cfg, "vocab_size"), hidden_size=H,
        n_layers=n_layers, n_heads=nh, n_kv_heads=nkv, head_dim=hd,
        top_k=k, rms_norm_eps=float(eps), max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        architecture=fam.name, attention=fam.attention, routing=fam.routing,
        activation=fam.activation, **opts)
    for name in ("hidden_size", "intermediate_size", "vocab_size", "n_layers", "n_experts",
                 "dense_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(spec, name) > fmt.U32_MAX:
            raise ConversionError(f"config.json: {name} does not fit the format's u32")
    return spec


# --------------------------------------------------------------------------- tokenizer

def _no_tokenizer(tokenizer: str, say: Callable[[str], None]) -> dict:
    """The metadata of a file without a tokenizer; checks the `tokenizer` option ("auto" or
    "none") and says so when "none" was asked for."""
    if tokenizer not in ("auto", "none"):
        raise ConversionError(f"tokenizer {tokenizer!r}: choose auto or none")
    if tokenizer == "none":
        say("tokenizer: none (asked for); the engine will run on token ids only")
    return {"tokenizer.type": "none", "tokenizer.bos_id": -1, "tokenizer.eos_id": -1,
            "tokenizer.unk_id": -1, "tokenizer.pad_id": -1}


def _tokenizer_section(model_dir: str, say: Callable[[str], None], tokenizer: str = "auto"):
    """(section bytes, metadata dict) for the checkpoint's tokenizer.

    "auto": `tokenizer.model` (SentencePiece BPE: Mixtral, Llama) if present, else
    `tokenizer.json` (byte-level BPE: Qwen, OLMoE, GPT-2 style), else `tekken.json`
    (Mistral's tiktoken-style vocabulary), else none. "none": write a
    file without a tokenizer (the engine then runs on token ids only)."""
    none = _no_tokenizer(tokenizer, say)
    if tokenizer == "none":
        return b"", none
    spm = os.path.join(model_dir, "tokenizer.model")
    bpe = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(spm):
        from ._spm import build_tokenizer_section as build
        path = spm
    elif os.path.isfile(bpe) or os.path.isfile(os.path.join(model_dir, "tekken.json")):
        from ._bpe import build_bpe_tokenizer_section as build  # reads either format
        path = bpe if os.path.isfile(bpe) else os.path.join(model_dir, "tekken.json")
    else:
        say(f"note: no tokenizer.model, tokenizer.json or tekken.json in {model_dir}; writing a "
            "file without a tokenizer (the engine then runs on token ids only)")
        return b"", none
    try:
        data, info = build(path)
    except ValueError as e:
        raise ConversionError(f"{e}. To convert the weights anyway, without a tokenizer, pass "
                              "tokenizer='none' (colibri-convert --no_tokenizer)") from e
    # Keys named "tokenizer.*" go to the metadata; others (n_pieces) are information.
    meta = {k: v for k, v in info.items() if k.startswith("tokenizer.")}
    if "n_pieces" in info:
        say(f"tokenizer: {info['n_pieces']} pieces, type {meta.get('tokenizer.type')}")
    for k in ("tokenizer.type", "tokenizer.bos_id", "tokenizer.eos_id", "tokenizer.unk_id",
              "tokenizer.pad_id"):
        if k not in meta:
            raise ConversionError(f"internal: tokenizer builder did not return {k}")
    template, where = read_chat_template(model_dir)
    if template is not None:
        meta["tokenizer.chat_template"] = template
        say(f"chat template: {len(template):,} characters from {where}")
    elif where:
        say(f"note: {where}; no chat template written")
    return bytes(data), meta


CHAT_TEMPLATE_FILE = "chat_template.jinja"          # transformers >= 4.43 / 5 save_pretrained
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"    # {"chat_template": "..."} (processors)


def read_chat_template(model_dir: str) -> tuple[str | None, str]:
    """The checkpoint's default chat template (its Jinja source) and where it came from.

    As transformers loads it: a `chat_template.jinja` file first (transformers 5 saves the
    template there), then `chat_template.json` ({"chat_template": ...}), then the
    `chat_template` entry of `tokenizer_config.json`, which is a string or a list of
    {"name", "template"} (the one named "default" is used). Returns (None, "") when the
    checkpoint has none, (None, reason) when one is there but unusable (no "default" among
    several, not a string, a NUL character)."""
    def usable(t, where: str) -> tuple[str | None, str]:
        if not isinstance(t, str):
            return None, f"the chat template in {where} is not a string"
        if "\x00" in t:
            return None, f"the chat template in {where} contains a NUL character"
        if not t:
            return None, f"the chat template in {where} is empty"
        return t, where

    p = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
    if os.path.isfile(p):
        with open(p, "r", encoding="utf-8") as f:
            return usable(f.read(), CHAT_TEMPLATE_FILE)
    for name, key in ((LEGACY_CHAT_TEMPLATE_FILE, "chat_template"),
                      ("tokenizer_config.json", "chat_template")):
        p = os.path.join(model_dir, name)
        if not os.path.isfile(p):
            continue
        try:
            with open(p, "r", encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            if name == LEGACY_CHAT_TEMPLATE_FILE:
                return None, f"{name} could not be read ({e})"
            continue  # the tokenizer builder reports a broken tokenizer_config.json itself
        t = cfg.get(key) if isinstance(cfg, dict) else None
        if t is None:
            continue
        if isinstance(t, list):   # [{"name": ..., "template": ...}, ...]
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            if "default" not in named:
                return None, (f"{name} has several chat templates ({', '.join(map(str, named))}) "
                              "and none named 'default'")
            return usable(named["default"], f"{name} (template 'default')")
        if isinstance(t, dict):   # {name: template}
            if "default" not in t:
                return None, (f"{name} has several chat templates ({', '.join(map(str, t))}) "
                              "and none named 'default'")
            return usable(t["default"], f"{name} (template 'default')")
        return usable(t, name)
    return None, ""


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
        return fmt.tensor_nbytes(self.dtype, self.shape)


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
                yield st, _sumsq(quants.from_stored(st, dst, ncols))
    return gen


def _sumsq(x: np.ndarray) -> float:
    """Sum of squares in f64, without BLAS: np.dot (fmt.sumsq_f64) wakes OpenBLAS's threads,
    which took milliseconds per chunk next to the quantizer's thread pool."""
    v = x.reshape(-1).astype(np.float64)
    return float(np.einsum("i,i->", v, v))


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
    "q8_0" / "q4_k" / "q4_k_m": each weight matrix in quants.mix_dtype's dtype, routers
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
        return quants.mix_dtype(self.mix, name, shape, layer=layer, n_layers=s.n_layers,
                                n_experts=s.n_experts, tied=s.tie_word_embeddings)

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
    """Multi-head latent attention of layer n (colibri_lab/_deepseek.py): q or the q LoRA,
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
                    yield st, _sumsq(quants.from_stored(st, dst, x.shape[1]))
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
                yield q, _sumsq(quants.from_stored(q, dst, K))
                continue
            x = np.asarray(quants.from_stored(q, fmt.DTYPE_MXFP4, K), dtype=np.float32).reshape(-1, K)
            step = max(1, CHUNK_ELEMS // K)
            for r0 in range(0, x.shape[0], step):
                c = x[r0:r0 + step]
                if dst in QUANT_DTYPES:
                    st = quants.to_stored(c, dst)
                    yield st, _sumsq(quants.from_stored(st, dst, K))
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
    folios that it maps with huge pages (decode measured 10-25 % faster; docs/performance.md).
    Advisory: nothing happens where posix_fadvise is missing."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def convert(model_dir, output_path, *, dtype: str = "bf16", quantize_router: str | None = None,
            block_size: int = fmt.DEFAULT_BLOCK_SIZE, max_seq_len: int | None = None,
            progress: bool = True, tokenizer: str = "auto") -> str:
    """Convert the Hugging Face checkpoint in `model_dir` (a family of FAMILY_TABLE: Mixtral,
    Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss) to `output_path`.

    dtype: weight dtype "f32", "f16" or "bf16" (1-D norm weights are always f32), or a
    block-quantized mix "q8_0", "q4_k", "q4_k_m" or "mxfp4" (docs/quantization.md, "Converter
    mixes": each weight matrix's dtype from quants.mix_dtype, llama.cpp's reference
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


def write_colibri(output_path: str, spec: "ModelSpec", tensors: list[PlannedTensor],
                  meta: bytes, tok_bytes: bytes, *, msl: int, int8_router: bool,
                  block_size: int, say=None) -> str:
    """Lay out and write a .colibri file: `tensors` in file order (each producing its stored
    bytes front to back), `meta` the encoded metadata, `tok_bytes` the tokenizer section.
    Streams: peak memory is one producer chunk. Written to OUT.tmp and renamed; on any
    error nothing is left behind."""
    if say is None:
        say = _Say(False)
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


# --------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="colibri-convert",
        description="Convert a Hugging Face MoE checkpoint folder (Mixtral, Qwen2-MoE, "
                    "Qwen3-MoE, OLMoE), or a llama.cpp GGUF file of one, into a .colibri file.")
    p.add_argument("--model_name_or_path", required=True,
                   help="checkpoint folder: config.json, *.safetensors, optional tokenizer.model "
                        "or tokenizer.json; or a .gguf file, imported as it is stored (no "
                        "requantizing: --dtype, --quantize_router and --block_size do not apply)")
    p.add_argument("--output_path", required=True, help="the .colibri file to write")
    p.add_argument("--dtype", choices=list(FLOAT_DTYPES + QUANT_MIXES), default=None,
                   help="weight dtype (norm weights are always f32), or a block-quantized "
                        "mix: q8_0, q4_k, q4_k_m (llama.cpp's Q4_K_M) or mxfp4 (routed experts MXFP4, the rest bf16); default bf16")
    p.add_argument("--quantize_router", choices=["none", "int8"], default=None,
                   help="store router weights as int8 with per-row scale/zero; default none")
    p.add_argument("--block_size", type=int, default=None,
                   help="row block of the packed expert layout; default 32")
    p.add_argument("--max_seq_len", type=int, default=None,
                   help="longest sequence; default the config's max_position_embeddings")
    p.add_argument("--no_tokenizer", action="store_true",
                   help="write no tokenizer (default: tokenizer.model, else tokenizer.json, else "
                        "tekken.json)")
    p.add_argument("--quiet", action="store_true", help="no stages, no progress bar")
    a = p.parse_args(argv)
    try:
        if os.path.isfile(a.model_name_or_path):
            from .gguf_import import convert_gguf

            if any(x is not None for x in (a.dtype, a.quantize_router, a.block_size)):
                raise ConversionError("a GGUF is imported with the dtypes it stores; --dtype, "
                                      "--quantize_router and --block_size do not apply to it")
            convert_gguf(a.model_name_or_path, a.output_path, max_seq_len=a.max_seq_len,
                         progress=not a.quiet, tokenizer="none" if a.no_tokenizer else "auto")
            return 0
        convert(a.model_name_or_path, a.output_path, dtype=a.dtype or "bf16",
                quantize_router=a.quantize_router or "none",
                block_size=fmt.DEFAULT_BLOCK_SIZE if a.block_size is None else a.block_size,
                max_seq_len=a.max_seq_len, progress=not a.quiet,
                tokenizer="none" if a.no_tokenizer else "auto")
    except (ConversionError, fmt.FormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
