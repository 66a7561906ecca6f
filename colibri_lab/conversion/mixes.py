"""The converter's block-quantized mixes: `mix_dtype(mix, name, shape, ...)`, the dtype a
mix ("q8_0", "q4_k", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q3_k_m", "q2_k", "mxfp4")
gives a tensor; "q4_k_m", "q3_k_m" and "q2_k" are llama.cpp's LLAMA_FTYPE_MOSTLY_* as
`llama_tensor_get_type` decides them without an importance matrix (docs/quantization.md,
"Converter mixes")."""

from __future__ import annotations

import re

from ..format import spec as fmt
from ..format.blocks import QK_K, QK_MXFP4
from ..format.spec import (
    DTYPE_BF16,
    DTYPE_F16,
    DTYPE_F32,
    DTYPE_IQ4_NL,
    DTYPE_IQ4_XS,
    DTYPE_MXFP4,
    DTYPE_Q2_K,
    DTYPE_Q3_K,
    DTYPE_Q4_0,
    DTYPE_Q4_1,
    DTYPE_Q4_K,
    DTYPE_Q5_0,
    DTYPE_Q5_1,
    DTYPE_Q5_K,
    DTYPE_Q6_K,
    DTYPE_Q8_0,
    QUANT_DTYPES,
)

# --------------------------------------------------------------------------- mixes

MIXES = ("q8_0", "q4_k", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q3_k_m", "q2_k", "mxfp4")
# the mixes of one type for every weight matrix (then the fallback)
_PLAIN = {"q8_0": DTYPE_Q8_0, "q4_k": DTYPE_Q4_K, "q4_0": DTYPE_Q4_0, "q4_1": DTYPE_Q4_1,
          "q5_0": DTYPE_Q5_0, "q5_1": DTYPE_Q5_1}
# llama.cpp's tensor_type_fallback: a 256-block type whose block does not divide a row
_FALLBACK = {DTYPE_Q4_K: DTYPE_Q5_0, DTYPE_Q5_K: DTYPE_Q5_1, DTYPE_Q6_K: DTYPE_Q8_0,
             DTYPE_Q2_K: DTYPE_Q4_0, DTYPE_Q3_K: DTYPE_Q4_0, DTYPE_IQ4_XS: DTYPE_IQ4_NL}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third
    layer between get more bits."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def fallback_dtype(dtype: int, ncols: int) -> int:
    """The dtype a tensor with rows of `ncols` gets when `dtype`'s block does not divide
    them: llama.cpp's tensor_type_fallback, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K
    and Q3_K -> Q4_0, IQ4_XS -> IQ4_NL (blocks of 32), and F16 when 32 does not divide the
    row either (a 32-block type goes to F16 directly)."""
    if dtype not in QUANT_DTYPES or ncols % fmt.DTYPE_BLOCKS[dtype][0] == 0:
        return dtype
    t = _FALLBACK.get(dtype, dtype)
    return t if ncols % fmt.DTYPE_BLOCKS[t][0] == 0 else DTYPE_F16


def mix_dtype(mix: str, name: str, shape, *, layer: int | None, n_layers: int,
              n_experts: int, tied: bool = False, n_gqa: int = 1) -> int:
    """The dtype the converter mix `mix` gives tensor `name` (colibri / GGUF tensor names,
    with or without the ".weight" suffix) of colibri shape `shape` (rows last).

    - 1-D tensors (norm weights, biases), routers (`ffn_gate_inp`), the shared expert's
      gate (`ffn_shared_gate`, GGUF's `ffn_gate_inp_shexp`) and norm weights stay F32.
    - "q8_0": every other weight matrix Q8_0.   "q4_k": every one Q4_K; likewise "q4_0",
      "q4_1", "q5_0", "q5_1".
    - "q4_k_m": llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M (llama_tensor_get_type): output
      Q6_K (Q8_0 when 256 does not divide its rows); token_embd Q4_K, or the output's
      type when the embeddings are tied (`tied`: the file has no output.weight); attn_v
      Q6_K on use_more_bits(layer) layers; attn_k and attn_v Q8_0 and attn_output Q5_K
      when n_experts == 8; every ffn_down (routed, dense, shared) Q6_K on
      use_more_bits(layer) layers; everything else Q4_K. (llama.cpp counts attn_v tensors
      in file order and parses the layer from an MoE model's ffn_down name; with one
      attn_v per layer both are the layer index.)
    - "q3_k_m" (LLAMA_FTYPE_MOSTLY_Q3_K_M): output as q4_k_m; token_embd Q3_K; attn_v
      Q5_K on layers 0 and 1, else Q4_K; attn_output and attn_qkv Q4_K (attn_output Q5_K
      when n_experts == 8); ffn_down Q5_K on layers below n_layers / 16, else Q4_K; attn_k
      and attn_v Q8_0 when n_experts == 8; everything else Q3_K.
    - "q2_k" (LLAMA_FTYPE_MOSTLY_Q2_K): output as q4_k_m; attn_v Q4_K when n_gqa (query
      heads per KV head) >= 4, else Q3_K; ffn_down Q3_K; attn_output Q3_K (Q5_K when
      n_experts == 8); attn_k and attn_v Q8_0 when n_experts == 8; everything else Q2_K.
      (attn_v includes attn_qkv and attn_kv_b, llama.cpp's category_is_attn_v.)
    - "mxfp4": the routed experts (`ffn_{gate,up,down}_exps`) MXFP4, every other weight
      matrix BF16 — the way gpt-oss ships (its experts in MXFP4, the rest bf16).
    - then `fallback_dtype` for a row the type's block does not divide.
    """
    if mix not in MIXES:
        raise ValueError(f"mix {mix!r}: choose one of {', '.join(MIXES)}")
    shape = tuple(int(d) for d in shape)
    base = name[:-len(".weight")] if name.endswith(".weight") else name
    m = _BLK.match(base)
    if m:
        base = m.group(2)
        if layer is None:
            layer = int(m.group(1))
    if (len(shape) < 2 or name.endswith(".bias") or "norm" in base
            or base.startswith("ffn_gate_inp") or base == "ffn_shared_gate"
            or base.endswith((".scale", ".zero"))):
        return DTYPE_F32
    ncols = shape[-1]
    if mix == "mxfp4":
        if base in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") and ncols % QK_MXFP4 == 0:
            return DTYPE_MXFP4
        return DTYPE_BF16
    if mix in _PLAIN:
        return fallback_dtype(_PLAIN[mix], ncols)
    default = {"q4_k_m": DTYPE_Q4_K, "q3_k_m": DTYPE_Q3_K, "q2_k": DTYPE_Q2_K}[mix]
    t = default
    attn_v = base in ("attn_v", "attn_qkv", "attn_kv_b")
    if base == "output" or (base == "token_embd" and tied):
        return DTYPE_Q8_0 if ncols % QK_K else DTYPE_Q6_K
    if base == "token_embd":
        return fallback_dtype(t, ncols)
    if base.startswith("ffn_down") and layer is None:
        raise ValueError(f"{name}: the {mix} mix needs the layer of an ffn_down tensor")
    if attn_v:
        if mix == "q4_k_m" and layer is not None and use_more_bits(layer, n_layers):
            t = DTYPE_Q6_K
        elif mix == "q3_k_m":
            if layer is None:
                raise ValueError(f"{name}: the q3_k_m mix needs the layer of an attn_v tensor")
            t = DTYPE_Q5_K if layer < 2 else DTYPE_Q4_K
        elif mix == "q2_k":
            t = DTYPE_Q4_K if n_gqa >= 4 else DTYPE_Q3_K
        if n_experts == 8:
            t = DTYPE_Q8_0
    elif base == "attn_k":
        if n_experts == 8:
            t = DTYPE_Q8_0
    elif base == "attn_output":
        if n_experts == 8:
            t = DTYPE_Q5_K
        elif mix == "q3_k_m":
            t = DTYPE_Q4_K
        elif mix == "q2_k":
            t = DTYPE_Q3_K
    elif base.startswith("ffn_down"):
        if mix == "q4_k_m" and use_more_bits(layer, n_layers):
            t = DTYPE_Q6_K
        elif mix == "q3_k_m":
            t = DTYPE_Q5_K if layer < n_layers // 16 else DTYPE_Q4_K
        elif mix == "q2_k":
            t = DTYPE_Q3_K
    return fallback_dtype(t, ncols)
