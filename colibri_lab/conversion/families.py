"""The MoE families the converter knows, one `Family` entry each (`FAMILY_TABLE`): the
config keys it reads, its tensor names, its choices of attention, routing, activation and
RoPE; and `read_config(model_dir)`, config.json -> `ModelSpec`."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..format import spec as fmt
from . import deepseek as _deepseek
from .spec import ConversionError, ModelSpec


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
    """DeepSeek-V2/V3 (colibri_lab/conversion/deepseek.py): multi-head latent attention, dense first
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


@dataclass(frozen=True)
class TextWrapper:
    """A multimodal checkpoint whose language model is one of FAMILY_TABLE's: its text config
    (under `config_key`) and its weights (named under `prefix`) convert as that family's; the
    other parts' weights (vision tower, projector) are left out, and said."""
    hf_class: str
    model_type: str
    family: str
    config_key: str
    prefix: str


TEXT_WRAPPERS: tuple[TextWrapper, ...] = (
    # Kimi-K2.5 and later: a DeepSeek-V3 language model beside a vision tower
    TextWrapper("KimiK25ForConditionalGeneration", "kimi_k25", "deepseek_v3", "text_config", "language_model."),
)


def text_wrapper(cfg: dict) -> TextWrapper | None:
    """The TEXT_WRAPPERS entry of a config.json (by model_type or architectures), or None."""
    archs = cfg.get("architectures") or []
    for w in TEXT_WRAPPERS:
        if cfg.get("model_type") == w.model_type or w.hf_class in archs:
            if not isinstance(cfg.get(w.config_key), dict):
                raise ConversionError(f"config.json of a {w.hf_class}: no {w.config_key} (its language model's)")
            return w
    return None


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
                              "Face checkpoint (or a llama.cpp GGUF file, or a folder holding "
                              "one: colibri-convert imports it)")
    with open(p) as f:
        cfg = json.load(f)
    w = text_wrapper(cfg)
    if w is not None:
        cfg, fam = cfg[w.config_key], FAMILY_BY_NAME[w.family]
    else:
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

