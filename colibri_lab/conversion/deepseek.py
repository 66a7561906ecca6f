"""DeepSeek-V2 / -V3 for the converter (convert.py's family table): config reading,
the attention tensors of multi-head latent attention and the family-option metadata
(docs/format.md, "Family options"). Read from transformers' modeling_deepseek_v2.py /
modeling_deepseek_v3.py (transformers 5): what they compute is what the file says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class _Err(ValueError):
    pass


@dataclass(frozen=True)
class MLAOptions:
    """Multi-head latent attention (model.attention "mla")."""
    q_lora_rank: int          # 0: q = W_q x; else q = W_qb rmsnorm(W_qa x)
    kv_lora_rank: int         # r
    qk_nope_head_dim: int     # dn
    qk_rope_head_dim: int     # dr (the file's model.head_dim, as transformers' config.head_dim)
    v_head_dim: int           # dv
    rope_interleave: bool     # the checkpoint's RoPE dims are interleaved pairs (permuted at conversion)
    attn_scale: float         # the softmax scale: qk_head_dim^-0.5 (* YaRN's mscale^2)


def _int(cfg: dict, key: str, default=None, lo: int = 1) -> int:
    v = cfg.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v or v < lo:
        raise _Err(f"config.json: {key} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' yarn_get_mscale (modeling_deepseek_v3.py)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: dict, qk_head_dim: int) -> float:
    """DeepseekV{2,3}Attention.scaling: qk_head_dim ** -0.5, times mscale(factor,
    mscale_all_dim) ** 2 when the RoPE is not the default one and mscale_all_dim is set
    (yarn_apply_mscale)."""
    scale = qk_head_dim ** -0.5
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rp, dict) and rp.get("rope_type", rp.get("type", "default")) != "default":
        mad = rp.get("mscale_all_dim", 0)
        if mad:
            m = _yarn_get_mscale(float(rp["factor"]), float(mad))
            scale = scale * m * m
    return scale


def deepseek_config(cfg: dict, fam: str, n_layers: int, E: int, k: int) -> dict:
    """The ModelSpec fields of a DeepSeek-V2/V3 config.json (besides the common ones):
    MLA widths, the dense first layers, the shared experts and the router."""
    if cfg.get("attention_bias"):
        raise _Err("config.json: attention_bias is true; colibri's MLA has no q_a/kv_a/o biases")
    if cfg.get("mlp_bias"):
        raise _Err("config.json: mlp_bias is true; colibri's MLPs have no biases")
    ql = cfg.get("q_lora_rank")
    ql = 0 if ql is None else _int(cfg, "q_lora_rank")
    r = _int(cfg, "kv_lora_rank")
    dn = _int(cfg, "qk_nope_head_dim")
    dr = _int(cfg, "qk_rope_head_dim")
    dv = _int(cfg, "v_head_dim")
    if dr % 2:
        raise _Err(f"config.json: qk_rope_head_dim {dr} is odd; RoPE rotates pairs")
    # V2 rotates complex pairs (apply_rotary_emb, always interleaved); V3 when rope_interleave
    interleave = True if fam == "deepseek_v2" else bool(cfg.get("rope_interleave", True))
    mla = MLAOptions(ql, r, dn, dr, dv, interleave, softmax_scale(cfg, dn + dr))

    # dense layers: DeepseekV{2,3}DecoderLayer makes layer i an MoE block iff
    # i >= first_k_dense_replace; the original DeepSeek code also asks i % moe_layer_freq
    # == 0 (1 in every released checkpoint, where both rules agree)
    fk = _int(cfg, "first_k_dense_replace", 0, lo=0)
    freq = _int(cfg, "moe_layer_freq", 1)
    layer_ffn = tuple(int(i >= fk and i % freq == 0) for i in range(n_layers))
    if not any(layer_ffn):
        raise _Err("config.json: no layer is an MoE block (first_k_dense_replace / moe_layer_freq)")
    inter = _int(cfg, "moe_intermediate_size")
    n_shared = _int(cfg, "n_shared_experts", 0, lo=0) or 0

    # the router
    G = cfg.get("n_group")
    G = 1 if G is None else _int(cfg, "n_group")
    TG = cfg.get("topk_group")
    TG = G if TG is None else _int(cfg, "topk_group")
    scoring = cfg.get("scoring_func")
    if fam == "deepseek_v2":
        method = cfg.get("topk_method", "greedy") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise _Err(f"config.json: topk_method {method!r}; DeepSeek-V2 routes by greedy or "
                       "group_limited_greedy")
        if scoring not in (None, "softmax"):
            raise _Err(f"config.json: scoring_func {scoring!r}; DeepseekV2TopkRouter uses softmax")
        routing = "softmax_topk"
        # DeepseekV2TopkRouter never renormalises, whatever norm_topk_prob says
        norm = False
        if method == "greedy":
            G = TG = 1
    else:
        method = cfg.get("topk_method", "noaux_tc") or "noaux_tc"
        if method != "noaux_tc":
            raise _Err(f"config.json: topk_method {method!r}; DeepseekV3TopkRouter is noaux_tc")
        if scoring not in (None, "sigmoid"):
            raise _Err(f"config.json: scoring_func {scoring!r}; DeepseekV3TopkRouter uses sigmoid")
        routing = "sigmoid_topk"
        norm = bool(cfg.get("norm_topk_prob", True))
    if E % G:
        raise _Err(f"config.json: n_routed_experts {E} is not a multiple of n_group {G}")
    if TG > G:
        raise _Err(f"config.json: topk_group {TG} > n_group {G}")
    if routing == "sigmoid_topk" and G > 1 and E // G < 2:
        raise _Err(f"config.json: {E // G} expert per group; noaux_tc scores a group by its two best")
    if TG * (E // G) < k:
        raise _Err(f"config.json: the {TG} kept groups hold {TG * (E // G)} experts, fewer than "
                   f"num_experts_per_tok {k}")
    scale = cfg.get("routed_scaling_factor", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise _Err(f"config.json: routed_scaling_factor must be a number, got {scale!r}")
    out = dict(
        head_dim=dr, intermediate_size=inter, norm_topk_prob=norm,
        shared_expert_intermediate_size=n_shared * inter, shared_expert_gate=False,
        router_bias=routing == "sigmoid_topk", n_group=G, topk_group=TG, routed_scaling_factor=float(scale), mla=mla,
    )
    if not all(layer_ffn):
        out["layer_ffn"] = layer_ffn
        out["dense_intermediate_size"] = _int(cfg, "intermediate_size")
    return out


def _merge(rows: list[int]) -> list[tuple[int, int]]:
    """Row indices -> (first, count) runs of consecutive rows."""
    runs: list[tuple[int, int]] = []
    for i in rows:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def rope_rows(n_blocks: int, block: int, first: int, dr: int, interleave: bool) -> list[tuple[int, int]]:
    """The source rows of a projection, in the file's order, as (first, count) runs:
    `n_blocks` blocks of `block` rows whose rows first .. first+dr-1 are RoPE dims.

    Interleaved checkpoints rotate pairs (x0, x1), (x2, x3), ... (DeepSeek-V2's complex
    rotation, V3's rope_interleave); the engine's RoPE is rotate_half, which rotates
    (x_i, x_{i + dr/2}). Reordering the RoPE rows to the even ones, then the odd ones
    (x0, x2, ..., x1, x3, ...) makes rotate_half compute exactly the interleaved
    rotation, de-interleaved; since q and k are permuted alike, q_pe . k_pe is unchanged.
    """
    rows = []
    for b in range(n_blocks):
        base = b * block
        head = list(range(base, base + block))
        if interleave:
            rope = head[first:first + dr]
            head[first:first + dr] = rope[0::2] + rope[1::2]
        rows += head
    return _merge(rows)


# The file's tensor names of an MLA layer (GGUF's where it has them) and the checkpoint's.
def attention_tensors(s, n: int) -> list[tuple]:
    """(file name, checkpoint name, shape, row runs or None, is_vector) of layer n's
    attention, in file order; row runs (rope_rows) reorder the RoPE rows of q and kv_a."""
    m: MLAOptions = s.mla
    H, nh = s.hidden_size, s.n_heads
    dq = m.qk_nope_head_dim + m.qk_rope_head_dim
    a = f"model.layers.{n}.self_attn"
    q_rows = rope_rows(nh, dq, m.qk_nope_head_dim, m.qk_rope_head_dim, m.rope_interleave)
    out = []
    if m.q_lora_rank:
        out += [(f"blk.{n}.attn_q_a.weight", f"{a}.q_a_proj.weight", (m.q_lora_rank, H), None, False),
                (f"blk.{n}.attn_q_a_norm.weight", f"{a}.q_a_layernorm.weight", (m.q_lora_rank,), None, True),
                (f"blk.{n}.attn_q_b.weight", f"{a}.q_b_proj.weight", (nh * dq, m.q_lora_rank), q_rows, False)]
    else:
        out.append((f"blk.{n}.attn_q.weight", f"{a}.q_proj.weight", (nh * dq, H), q_rows, False))
    r, dr = m.kv_lora_rank, m.qk_rope_head_dim
    out += [
        (f"blk.{n}.attn_kv_a_mqa.weight", f"{a}.kv_a_proj_with_mqa.weight", (r + dr, H),
         rope_rows(1, r + dr, r, dr, m.rope_interleave), False),
        (f"blk.{n}.attn_kv_a_norm.weight", f"{a}.kv_a_layernorm.weight", (r,), None, True),
        (f"blk.{n}.attn_kv_b.weight", f"{a}.kv_b_proj.weight",
         (nh * (m.qk_nope_head_dim + m.v_head_dim), r), None, False),
        (f"blk.{n}.attn_output.weight", f"{a}.o_proj.weight", (H, nh * m.v_head_dim), None, False),
    ]
    return out


def metadata(s) -> list[tuple[str, int, object]]:
    """(key, metadata type name, value) of the DeepSeek family options (model.attention and
    model.routing are the family table's, written for every family)."""
    m: MLAOptions = s.mla
    return [
        ("model.q_lora_rank", "U32", m.q_lora_rank),
        ("model.kv_lora_rank", "U32", m.kv_lora_rank),
        ("model.qk_nope_head_dim", "U32", m.qk_nope_head_dim),
        ("model.v_head_dim", "U32", m.v_head_dim),
        ("model.attn_scale", "F64", m.attn_scale),
        ("model.n_group", "U32", s.n_group),
        ("model.topk_group", "U32", s.topk_group),
        ("model.routed_scaling_factor", "F64", s.routed_scaling_factor),
        ("model.router_bias", "BOOL", s.router_bias),
    ]
