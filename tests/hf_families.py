"""Random-init Hugging Face checkpoints of the other MoE families (Qwen2-MoE, Qwen3-MoE,
OLMoE, gpt-oss; DeepSeek-V2/V3 in DeepseekShape) for the parity tests — the counterpart of
``hf_models.py`` (Mixtral), whose
``save_checkpoint``, ``hf_logits`` and ``first_near_tie`` serve these models too.

Models are made with transformers itself (torch==2.13.0 CPU, float32, eager experts),
seeded, with every 1-D parameter randomised: RMSNorm weights (layer norms, q/k norms) in
[0.5, 1.5] and biases in [-0.5, 0.5], so that a norm or bias applied in the wrong place,
or not at all, changes the logits (DeepSeek-V3's e_score_correction_bias, a buffer,
in [-0.3, 0.3]). gpt-oss's 2-D expert biases (`gate_up_proj_bias`, `down_proj_bias`) are
biases too, and its attention sinks (`self_attn.sinks`, one logit per query head) are drawn
from [-1, 2] so that they take a visible share of the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAMILIES = ("qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")


@dataclass(frozen=True)
class FamilyShape:
    family: str                       # one of FAMILIES
    vocab: int = 1003
    hidden: int = 60
    inter: int = 38                   # routed experts: Qwen moe_intermediate_size,
                                      # OLMoE intermediate_size
    dense_inter: int = 90             # Qwen dense-MLP layers (intermediate_size)
    shared_inter: int = 54            # Qwen2-MoE shared expert; 0 = none
    layers: int = 3
    heads: int = 5
    kv_heads: int = 5
    head_dim: int | None = None       # Qwen3-MoE only (the others use hidden // heads)
    experts: int = 6
    top_k: int = 2
    norm_topk: bool = False
    mlp_only_layers: tuple = ()
    sparse_step: int = 1
    bias: bool = True                 # Qwen2 qkv_bias; Qwen3/OLMoE attention_bias (q/k/v and o)
    clip_qkv: float | None = None     # OLMoE
    sliding_window: int | None = None  # Qwen: use_sliding_window with this window
    max_window_layers: int = 28       # Qwen2-MoE
    tie: bool = False
    layer_types: tuple | None = None  # gpt-oss: None = transformers' default (sliding, full, ...)
    swiglu_limit: float = 7.0         # gpt-oss
    rope: tuple | None = None         # gpt-oss rope_parameters items; None = default RoPE
    max_pos: int = 1024
    std: float = 0.08
    seed: int = 0
    extra: tuple = field(default=())

    def config(self):
        common = dict(
            vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            num_experts=self.experts, num_experts_per_tok=self.top_k,
            norm_topk_prob=self.norm_topk, tie_word_embeddings=self.tie,
            max_position_embeddings=self.max_pos, initializer_range=self.std,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        if self.family == "gpt_oss":
            from transformers import GptOssConfig

            rope = dict(self.rope) if self.rope else {"rope_type": "default"}
            rope.setdefault("rope_theta", 10000.0)
            gcommon = {k: v for k, v in common.items() if k not in ("num_experts", "norm_topk_prob")}
            return GptOssConfig(**gcommon, num_local_experts=self.experts,
                                intermediate_size=self.inter, head_dim=self.head_dim or 64,
                                rms_norm_eps=1e-5, attention_bias=self.bias,
                                sliding_window=self.sliding_window,
                                layer_types=list(self.layer_types) if self.layer_types else None,
                                swiglu_limit=self.swiglu_limit, rope_parameters=rope,
                                **dict(self.extra))
        if self.family == "olmoe":
            from transformers import OlmoeConfig

            return OlmoeConfig(**common, intermediate_size=self.inter, rms_norm_eps=1e-5,
                               attention_bias=self.bias, clip_qkv=self.clip_qkv,
                               **dict(self.extra))
        qwen = dict(common, moe_intermediate_size=self.inter, intermediate_size=self.dense_inter,
                    mlp_only_layers=list(self.mlp_only_layers),
                    decoder_sparse_step=self.sparse_step, rms_norm_eps=1e-6,
                    use_sliding_window=self.sliding_window is not None,
                    sliding_window=self.sliding_window)
        if self.family == "qwen2_moe":
            from transformers import Qwen2MoeConfig

            return Qwen2MoeConfig(**qwen, shared_expert_intermediate_size=self.shared_inter,
                                  qkv_bias=self.bias, max_window_layers=self.max_window_layers,
                                  **dict(self.extra))
        if self.family == "qwen3_moe":
            from transformers import Qwen3MoeConfig

            return Qwen3MoeConfig(**qwen, head_dim=self.head_dim or self.hidden // self.heads,
                                  attention_bias=self.bias, **dict(self.extra))
        raise ValueError(f"unknown family {self.family!r}")


def model_class(family: str):
    import transformers

    return getattr(transformers, {"qwen2_moe": "Qwen2MoeForCausalLM",
                                  "qwen3_moe": "Qwen3MoeForCausalLM",
                                  "olmoe": "OlmoeForCausalLM",
                                  "gpt_oss": "GptOssForCausalLM"}[family])


def randomise_vectors(model) -> None:
    """Norm weights in [0.5, 1.5], biases in [-0.5, 0.5], attention sinks in [-1, 2]
    (under the caller's seed)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.uniform_(-1.0, 2.0)
            elif name.endswith("_bias"):   # gpt-oss experts' [E, 2I] and [E, H] biases
                p.uniform_(-0.5, 0.5)
            elif p.ndim == 1:
                if name.endswith(".bias"):
                    p.uniform_(-0.5, 0.5)
                else:
                    p.uniform_(0.5, 1.5)


def build_family_model(shape: FamilyShape):
    """A seeded random model of `shape.family` in float32, eval mode, eager experts."""
    import torch

    torch.manual_seed(shape.seed)
    model = model_class(shape.family)(shape.config()).eval()
    randomise_vectors(model)
    model.set_experts_implementation("eager")
    return model


def load_family_model(family: str, folder, dtype=None):
    """from_pretrained in float32 (e.g. of a bf16 checkpoint), eval, eager experts."""
    import torch

    model = model_class(family).from_pretrained(folder, dtype=dtype or torch.float32).eval()
    model.set_experts_implementation("eager")
    return model


# ------------------------------------------------------------------------ DeepSeek-V2/V3

@dataclass(frozen=True)
class DeepseekShape:
    """A tiny DeepSeek-V2 or -V3 (multi-head latent attention, grouped routers, shared
    experts, dense first layers) for the parity tests (tests/test_parity_deepseek.py)."""
    family: str                       # "deepseek_v2" or "deepseek_v3"
    vocab: int = 509
    hidden: int = 54                  # a multiple of heads (DeepseekV2Config checks it)
    inter: int = 22                   # moe_intermediate_size (routed experts)
    dense_inter: int = 46             # intermediate_size (the first_k_dense_replace layers)
    layers: int = 3
    heads: int = 3
    q_lora: int | None = None         # q_lora_rank
    kv_lora: int = 20                 # kv_lora_rank
    nope: int = 10                    # qk_nope_head_dim
    rope: int = 6                     # qk_rope_head_dim
    v_dim: int = 9                    # v_head_dim
    experts: int = 8
    top_k: int = 2
    shared: int = 1                   # n_shared_experts
    first_dense: int = 1              # first_k_dense_replace
    n_group: int | None = None
    topk_group: int | None = None
    topk_method: str = "greedy"       # V2: greedy | group_limited_greedy (V3: noaux_tc)
    norm_topk: bool = True            # V3 only (transformers' V2 never renormalises)
    scale: float = 1.0                # routed_scaling_factor
    interleave: bool = True           # V3 rope_interleave (V2 is always interleaved)
    yarn: dict | None = None          # rope_parameters of a YaRN RoPE (with rope_theta)
    tie: bool = False
    max_pos: int = 1024
    std: float = 0.08
    bias_range: float = 0.3           # V3: e_score_correction_bias uniform in +-this
    seed: int = 0

    def config(self):
        kw = dict(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.dense_inter,
            moe_intermediate_size=self.inter, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.heads,
            q_lora_rank=self.q_lora, kv_lora_rank=self.kv_lora, qk_nope_head_dim=self.nope,
            qk_rope_head_dim=self.rope, v_head_dim=self.v_dim, n_routed_experts=self.experts,
            num_experts_per_tok=self.top_k, n_shared_experts=self.shared,
            first_k_dense_replace=self.first_dense, n_group=self.n_group,
            topk_group=self.topk_group, routed_scaling_factor=self.scale,
            norm_topk_prob=self.norm_topk, tie_word_embeddings=self.tie,
            max_position_embeddings=self.max_pos, initializer_range=self.std,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        if self.yarn is not None:
            kw["rope_parameters"] = dict(self.yarn)
        if self.family == "deepseek_v2":
            from transformers import DeepseekV2Config

            return DeepseekV2Config(**kw, topk_method=self.topk_method)
        from transformers import DeepseekV3Config

        return DeepseekV3Config(**kw, rope_interleave=self.interleave)


def build_deepseek_model(shape: DeepseekShape):
    """A seeded random DeepSeek model in float32, eval mode, eager experts and attention;
    1-D parameters randomised as above, and V3's correction bias (a buffer) too."""
    import torch
    import transformers

    torch.manual_seed(shape.seed)
    cls = {"deepseek_v2": transformers.DeepseekV2ForCausalLM,
           "deepseek_v3": transformers.DeepseekV3ForCausalLM}[shape.family]
    config = shape.config()
    config._attn_implementation = "eager"
    model = cls(config).eval()
    randomise_vectors(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-shape.bias_range, shape.bias_range)
    model.set_experts_implementation("eager")
    return model


def load_deepseek_model(family: str, folder, dtype=None):
    import torch
    import transformers

    cls = {"deepseek_v2": transformers.DeepseekV2ForCausalLM,
           "deepseek_v3": transformers.DeepseekV3ForCausalLM}[family]
    model = cls.from_pretrained(folder, dtype=dtype or torch.float32,
                                attn_implementation="eager").eval()
    model.set_experts_implementation("eager")
    return model
