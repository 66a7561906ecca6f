"""What a conversion produces, shared by the Hugging Face and GGUF paths: the model's
description (`ModelSpec`: config values and the family's choices, written as the file's
metadata), a planned tensor (`PlannedTensor`: name, dtype, layout, shape, section and a
producer of its stored bytes), and the error every converter raises (`ConversionError`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ..format import spec as fmt

CONVERTER_NAME = "colibri_lab.convert"
CHUNK_ELEMS = 1 << 20   # values per conversion chunk (about 4 MiB of f32)
FLOAT_DTYPES = ("f32", "f16", "bf16")


class ConversionError(ValueError):
    """The checkpoint cannot be converted; the message says why and what to do."""


_native_sumsq = None   # the engine's colibri_dequantize_sumsq, once looked up (False: none)


def stored_sumsq(stored: np.ndarray, dtype: int, n: int) -> float:
    """The sum of squares, in f64, of the values `stored` holds (rows of `n` values of
    `dtype`, as a tensor stores them): what a tensor's `l2norm` is the root of. With the
    engine's library loadable, its `colibri_dequantize_sumsq` computes it without the values
    in memory (the reference dequantizer's values, bit for bit numpy's `quants.dequantize`);
    without it, numpy dequantizes. The two sum in different orders: the norm is checked to a
    relative 1e-5 (docs/format.md). Plain numpy (`np.dot` would wake OpenBLAS's threads,
    which took milliseconds per chunk next to the quantizer's thread pool)."""
    global _native_sumsq
    if _native_sumsq is None:
        try:
            from ..runtime import _native
            _native_sumsq = _native.lib.colibri_dequantize_sumsq
        except ImportError:
            _native_sumsq = False
    if _native_sumsq and dtype in fmt.GRID_DTYPES:
        from ..runtime import _native
        _native.install_codebook(dtype)      # the grid types' lookups (idempotent)
    if not _native_sumsq or not (dtype in fmt.QUANT_DTYPES or dtype in (fmt.DTYPE_F32, fmt.DTYPE_F16, fmt.DTYPE_BF16)):
        from ..format import blocks as quants
        v = quants.from_stored(stored, dtype, n).reshape(-1).astype(np.float64)
        return float(np.einsum("i,i->", v, v))
    import ctypes
    raw = np.ascontiguousarray(stored).view(np.uint8).reshape(-1)
    count = raw.size // fmt.row_nbytes(dtype, n) * n
    out = ctypes.c_double()
    st = _native_sumsq(dtype, raw.ctypes.data_as(ctypes.c_void_p), count, ctypes.byref(out))
    if st != 0 or raw.size != fmt.row_nbytes(dtype, n) * (count // n):
        raise ConversionError(f"internal: {raw.size} bytes are not whole {fmt.DTYPE_NAMES[dtype]} "
                              f"rows of {n}")
    return out.value


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
    # grouped routing (DeepSeek; backend/cpu/route_group.c): n_group groups, topk_group kept
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


