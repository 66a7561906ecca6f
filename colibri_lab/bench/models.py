"""The random-model factory: seeded random-init Hugging Face checkpoints of every MoE family
the converter knows, made with transformers itself (needs torch), for the tests, the
benchmarks and the notebooks — one way to make them::

    from colibri_lab.bench import models

    m = models.build_model(models.FamilyShape("qwen3_moe", hidden=48))   # a transformers model
    models.save_checkpoint(m, "qwen3-tiny")                               # save_pretrained (+ tokenizer)
    hf = models.make_model("mixtral-791m")                                # MIXTRAL_791M, cached on disk
    hf = models.make_family_model("ds", "deepseek_v3", models.DEEPSEEK_V3_800M)

- **Shapes**: :class:`MixtralShape`, :class:`FamilyShape` (Qwen2-MoE, Qwen3-MoE, OLMoE,
  gpt-oss) and :class:`DeepseekShape` (DeepSeek-V2/V3) name a model's sizes and options in a
  few fields; ``shape.config()`` is its transformers config. Plain config dicts work too
  (:data:`TINY_FAMILY_CONFIGS`, :data:`DEEPSEEK_V3_800M`, ``AutoConfig.for_model`` keys).
- **Models**: :func:`build_model` (a shape) and :func:`build_from_config` (family + config
  dict) make a float32 model in eval mode with eager experts, seeded, every 1-D parameter
  randomised by :func:`randomise` so that none is a no-op: RMSNorm weights in [0.5, 1.5],
  biases in [-0.5, 0.5] (gpt-oss's 2-D expert biases too), attention sinks in [-1, 2] (a
  visible share of the softmax), DeepSeek-V3's score-correction bias (a buffer) in
  ±``correction_bias``. :func:`load_model` reads one back in float32 (eager).
- **Folders**: :func:`save_checkpoint` (``save_pretrained``, optionally in another dtype,
  with a tokenizer), and the cached makers :func:`make_model` (a Mixtral of a
  :data:`MIXTRAL_791M`-style shape dict) and :func:`make_family_model`, which reuse a folder
  that already holds the same model (a ``colibri_bench_shape.json`` stamp).

Tokenizers: "spm" copies the real Mixtral ``tokenizer.model`` (SentencePiece, 32000 pieces:
``data/tokenizer.model.v1`` in a checkout, else the copy in the mistral-common wheel) beside
a model whose vocabulary has 32000 entries; "bpe" trains a byte-level BPE ``tokenizer.json``
of the vocabulary's size on this package's own source; "none" neither.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

__all__ = [
    "DEEPSEEK_V3_800M",
    "FAMILY_CLASSES",
    "MIXTRAL_791M",
    "TINY_FAMILY_CONFIGS",
    "DeepseekShape",
    "FamilyShape",
    "MixtralShape",
    "build_from_config",
    "build_model",
    "load_model",
    "make_family_model",
    "make_model",
    "randomise",
    "save_checkpoint",
    "tokenizer_model_file",
]

#: model_type -> the transformers class of its causal LM
FAMILY_CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}

#: The reference model of ``docs/performance.md``: a random-init Mixtral of 791 M
#: parameters, about 230 M of them active per token (the shape :func:`make_model` takes).
MIXTRAL_791M = dict(vocab=32000, hidden=1024, inter=3584, layers=8, heads=16, kv_heads=4,
                    experts=8, top_k=2, max_pos=4096)  # fmt: skip

#: Random models of about 800 M parameters for other families (transformers config keys);
#: ``make_family_model(dir, "deepseek_v3", DEEPSEEK_V3_800M)``: MLA with a q LoRA, a dense
#: first layer, 32 routed experts in 4 groups (top-2 groups, top-4 experts) plus one shared
#: expert, sigmoid routing with the score-correction bias — the DeepSeek-V3 recipe, scaled.
DEEPSEEK_V3_800M = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
    num_hidden_layers=14, num_attention_heads=16, num_key_value_heads=16,
    q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4,
    n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

#: Qwen3-30B-A3B's MoE shape with 3 layers instead of 48 (transformers config keys): 128
#: experts of width 768, top-8, hidden 2048, 32 query / 4 KV heads of 128; the vocabulary is
#: the Mixtral tokenizer's 32000 (not Qwen's 151936), so that the experts, not the LM head,
#: dominate a decode token's bytes as they do in the 48-layer model. About 2.0 G parameters
#: (8 GB in f32 while it is generated), about 235 M of them active per token.
QWEN3_MOE_A3B_3L = dict(
    vocab_size=32000, hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
    num_hidden_layers=3, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
    rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False)

#: A tiny random model of every family the converter knows (transformers config keys, for
#: :func:`make_family_model`): sizes that are not multiples of 8, the family's own choices
#: switched on (Qwen2-MoE's gated shared expert, OLMoE's q/k norms, DeepSeek's latent
#: attention and group-limited routing, gpt-oss's sinks, windows and clamped SwiGLU).
_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY_FAMILY_CONFIGS = {
    "mixtral": dict(vocab_size=512, hidden_size=48, intermediate_size=40, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
                    num_experts_per_tok=2, max_position_embeddings=256, **_IDS),
    "qwen2_moe": dict(vocab_size=512, hidden_size=48, intermediate_size=56, moe_intermediate_size=24,
                      shared_expert_intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
                      max_position_embeddings=256, **_IDS),
    "qwen3_moe": dict(vocab_size=512, hidden_size=48, moe_intermediate_size=24, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256, **_IDS),
    "olmoe": dict(vocab_size=512, hidden_size=48, intermediate_size=24, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=256, **_IDS),
    "deepseek_v2": dict(vocab_size=512, hidden_size=48, intermediate_size=64, moe_intermediate_size=20,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
                        v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                        n_group=4, topk_group=2, topk_method="group_limited_greedy",
                        first_k_dense_replace=1, routed_scaling_factor=1.5,
                        max_position_embeddings=256, **_IDS),
    "deepseek_v3": dict(vocab_size=512, hidden_size=48, intermediate_size=64, moe_intermediate_size=20,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=20, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
                        v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
                        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                        norm_topk_prob=True, max_position_embeddings=256, **_IDS),
    "gpt_oss": dict(vocab_size=512, hidden_size=48, intermediate_size=24, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=6,
                    num_experts_per_tok=2, sliding_window=6, swiglu_limit=1.5,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    max_position_embeddings=256,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 64}, **_IDS),
}


# ---------------------------------------------------------------------------------------
# Shapes: a model's sizes and options in a few fields
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixtralShape:
    """A Mixtral (the parity tests' default: odd sizes, top-1 of 4 experts)."""
    vocab: int = 1003
    hidden: int = 72
    inter: int = 100
    layers: int = 2
    heads: int = 6
    kv_heads: int = 6
    head_dim: int | None = None
    experts: int = 4
    top_k: int = 1
    sliding_window: int | None = None
    tie: bool = False
    max_pos: int = 1024
    std: float = 0.08
    seed: int = 0
    extra: tuple = field(default=())
    family = "mixtral"

    def config(self):
        from transformers import MixtralConfig

        return MixtralConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.inter,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            num_local_experts=self.experts, num_experts_per_tok=self.top_k,
            sliding_window=self.sliding_window, tie_word_embeddings=self.tie,
            max_position_embeddings=self.max_pos, initializer_range=self.std,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **dict(self.extra))


@dataclass(frozen=True)
class FamilyShape:
    """Qwen2-MoE, Qwen3-MoE, OLMoE or gpt-oss."""
    family: str                       # qwen2_moe | qwen3_moe | olmoe | gpt_oss
    vocab: int = 1003
    hidden: int = 60
    inter: int = 38                   # routed experts: Qwen moe_intermediate_size,
                                      # OLMoE / gpt-oss intermediate_size
    dense_inter: int = 90             # Qwen dense-MLP layers (intermediate_size)
    shared_inter: int = 54            # Qwen2-MoE shared expert; 0 = none
    layers: int = 3
    heads: int = 5
    kv_heads: int = 5
    head_dim: int | None = None       # Qwen3-MoE, gpt-oss (the others use hidden // heads)
    experts: int = 6
    top_k: int = 2
    norm_topk: bool = False
    mlp_only_layers: tuple = ()
    sparse_step: int = 1
    bias: bool = True                 # Qwen2 qkv_bias; Qwen3/OLMoE/gpt-oss attention_bias
    clip_qkv: float | None = None     # OLMoE
    sliding_window: int | None = None  # Qwen: use_sliding_window with this window; gpt-oss
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
        import transformers

        common = dict(
            vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            num_experts=self.experts, num_experts_per_tok=self.top_k,
            norm_topk_prob=self.norm_topk, tie_word_embeddings=self.tie,
            max_position_embeddings=self.max_pos, initializer_range=self.std,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        extra = dict(self.extra)
        if self.family == "gpt_oss":
            rope = dict(self.rope) if self.rope else {"rope_type": "default"}
            rope.setdefault("rope_theta", 10000.0)
            gcommon = {k: v for k, v in common.items() if k not in ("num_experts", "norm_topk_prob")}
            return transformers.GptOssConfig(
                **gcommon, num_local_experts=self.experts, intermediate_size=self.inter,
                head_dim=self.head_dim or 64, rms_norm_eps=1e-5, attention_bias=self.bias,
                sliding_window=self.sliding_window,
                layer_types=list(self.layer_types) if self.layer_types else None,
                swiglu_limit=self.swiglu_limit, rope_parameters=rope, **extra)
        if self.family == "olmoe":
            return transformers.OlmoeConfig(**common, intermediate_size=self.inter, rms_norm_eps=1e-5,
                                            attention_bias=self.bias, clip_qkv=self.clip_qkv, **extra)
        qwen = dict(common, moe_intermediate_size=self.inter, intermediate_size=self.dense_inter,
                    mlp_only_layers=list(self.mlp_only_layers), decoder_sparse_step=self.sparse_step,
                    rms_norm_eps=1e-6, use_sliding_window=self.sliding_window is not None,
                    sliding_window=self.sliding_window)
        if self.family == "qwen2_moe":
            return transformers.Qwen2MoeConfig(**qwen, shared_expert_intermediate_size=self.shared_inter,
                                               qkv_bias=self.bias, max_window_layers=self.max_window_layers,
                                               **extra)
        if self.family == "qwen3_moe":
            return transformers.Qwen3MoeConfig(**qwen, head_dim=self.head_dim or self.hidden // self.heads,
                                               attention_bias=self.bias, **extra)
        raise ValueError(f"FamilyShape: unknown family {self.family!r} (qwen2_moe, qwen3_moe, olmoe, "
                         "gpt_oss; MixtralShape and DeepseekShape for the others)")


@dataclass(frozen=True)
class DeepseekShape:
    """DeepSeek-V2 or -V3: multi-head latent attention, grouped routers, shared experts,
    dense first layers."""
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
        import transformers

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
            return transformers.DeepseekV2Config(**kw, topk_method=self.topk_method)
        return transformers.DeepseekV3Config(**kw, rope_interleave=self.interleave)


# ---------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------


def _model_class(family: str):
    import transformers

    if family not in FAMILY_CLASSES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILY_CLASSES)}")
    return getattr(transformers, FAMILY_CLASSES[family])


def randomise(model, *, correction_bias: float = 0.5) -> None:
    """Every 1-D parameter randomised under the caller's seed (see the module's text), so a
    norm or bias applied in the wrong place, or not at all, changes the logits."""
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
        for name, b in model.named_buffers():   # DeepSeek-V3's score-correction bias
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-correction_bias, correction_bias)


def _build(family: str, config, seed: int, correction_bias: float):
    import torch

    if family.startswith("deepseek"):
        config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = _model_class(family)(config).eval()
    randomise(model, correction_bias=correction_bias)
    model.set_experts_implementation("eager")
    return model


def build_model(shape):
    """A seeded random model of a :class:`MixtralShape`, :class:`FamilyShape` or
    :class:`DeepseekShape`: float32, eval mode, eager experts (and eager attention for
    DeepSeek)."""
    return _build(shape.family, shape.config(), shape.seed, getattr(shape, "bias_range", 0.5))


def build_from_config(family: str, config: dict, seed: int = 0, *, correction_bias: float = 0.5):
    """The same from transformers config keys (``AutoConfig.for_model(family, **config)``)."""
    from transformers import AutoConfig

    return _build(family, AutoConfig.for_model(family, **config), seed, correction_bias)


def load_model(family: str, folder, dtype=None):
    """``from_pretrained`` in float32 (e.g. of a bf16 checkpoint), eval, eager experts (and
    eager attention for DeepSeek)."""
    import torch

    kw = {"attn_implementation": "eager"} if family.startswith("deepseek") else {}
    model = _model_class(family).from_pretrained(folder, dtype=dtype or torch.float32, **kw).eval()
    model.set_experts_implementation("eager")
    return model


# ---------------------------------------------------------------------------------------
# Folders
# ---------------------------------------------------------------------------------------


def tokenizer_model_file() -> Path | None:
    """The Mixtral SentencePiece model: data/tokenizer.model.v1 in a checkout, else the
    copy inside the mistral-common wheel; None when neither exists."""
    p = Path(__file__).resolve().parents[2] / "data" / "tokenizer.model.v1"
    if p.is_file():
        return p
    try:
        import mistral_common
    except ImportError:
        return None
    p = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    return p if p.is_file() else None


def byte_level_bpe(texts, vocab_size: int, special_tokens, style: str = "qwen2"):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``: "qwen2" (Qwen2 / Qwen3:
    NFC, the Qwen2 split pattern, byte-level pieces), "gpt2" (GPT-2 / GPT-NeoX, OLMoE's kind:
    the GPT-2 regex, no normalizer), "o200k" (gpt-oss's split pattern), "deepseek_v3"
    (DeepSeek-V3's three splits) or "kimi_k2" (Kimi's split pattern), the last three without a
    normalizer. The tokenizer of the random BPE-family test models and of
    the tokenizer benchmark."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from ..conversion.bpe import QWEN2_PATTERN

    tok = Tokenizer(models.BPE())
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif style == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif style in ("o200k", "deepseek_v3", "kimi_k2"):   # gpt-oss's; DeepSeek-V3's three splits; Kimi's
        from ..conversion.bpe import DEEPSEEK_V3_SPLITS, KIMI_K2_PATTERN, O200K_PATTERN

        rxs = {"o200k": (O200K_PATTERN,), "kimi_k2": (KIMI_K2_PATTERN,)}.get(style, DEEPSEEK_V3_SPLITS)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False) for rx in rxs),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        raise ValueError(f"byte_level_bpe: style is 'qwen2', 'gpt2', 'o200k', 'deepseek_v3' or 'kimi_k2', "
                         f"not {style!r}")
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


# Kimi-K2's named special tokens, the first of its reserved ids after the vocabulary
KIMI_SPECIAL_TOKENS = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                       "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>")


def kimi_style_tokenizer(texts, vocab_size: int, folder: Path, class_source: str | None = None,
                         config: dict | None = None) -> dict:
    """A tokenizer folder as Kimi's checkpoints ship theirs: `tiktoken.model` (a byte-level BPE
    trained on ``texts`` with Kimi's split pattern, its tokens ranked by id), a
    tokenizer_config.json (KIMI_SPECIAL_TOKENS among 256 reserved ids, auto_map naming the
    class, ``config`` added) and the class file (``class_source``, or one that states the
    pattern). Returns the ranks {token bytes: rank} (tiktoken's mergeable_ranks)."""
    import base64
    import json

    from ..conversion.bpe import KIMI_K2_PATTERN, bytes_to_unicode

    tok = byte_level_bpe(texts, vocab_size, [], style="kimi_k2")
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    ranks: dict[bytes, int] = {}
    for piece, _i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        if all(c in u2b for c in piece):
            ranks.setdefault(bytes(u2b[c] for c in piece), len(ranks))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "tiktoken.model", "w") as f:
        for b, r in ranks.items():
            f.write(f"{base64.b64encode(b).decode()} {r}\n")
    n = len(ranks)
    cfg = {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
           "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
           "added_tokens_decoder": {str(n + k): {"content": nm, "lstrip": False, "normalized": False, "rstrip": False,
                                                 "single_word": False, "special": True}
                                    for k, nm in enumerate(KIMI_SPECIAL_TOKENS)}}
    cfg.update(config or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    if class_source is None:
        class_source = ("class TikTokenTokenizer:\n    num_reserved_special_tokens = 256\n"
                        f"    pat_str = {KIMI_K2_PATTERN!r}\n")
    (folder / "tokenization_kimi.py").write_text(class_source)
    return ranks


def _write_bpe_tokenizer(folder: Path, n_tokens: int) -> None:
    """A byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json) of n_tokens
    entries, trained with the `tokenizers` library on this package's own source: a GPT-2
    style vocabulary with merges, for converters that take nothing else (llama.cpp's
    DeepSeek converter). Ids 0, 1, 2 are <unk>, <s>, </s>; when the source gives fewer
    merges than n_tokens, the remaining ids are added tokens ``<unused_i>``, so that every id
    of the model has a piece."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_tokens, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train(sorted(str(p) for p in Path(__file__).resolve().parents[1].rglob("*.py")), trainer)
    n = tok.get_vocab_size()
    if n < n_tokens:   # the source has fewer merges: the rest are placeholder tokens
        tok.add_tokens([f"<unused_{i}>" for i in range(n, n_tokens)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 1 << 20}))


def save_checkpoint(model, folder, *, dtype=None, tokenizer: str = "spm") -> Path:
    """``save_pretrained`` (in ``dtype`` when given, e.g. ``torch.bfloat16``; the model itself
    is left as it is) to ``folder``, with a tokenizer: "spm" (the Mixtral tokenizer.model,
    for a 32000-entry vocabulary only), "bpe", "none", or "auto" ("bpe" for the DeepSeek
    families, whose llama.cpp converter reads BPE only, else "spm")."""
    import torch
    from transformers.utils import logging as hf_logging

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    to_save = model
    if dtype is not None and dtype != torch.float32:
        to_save = copy.deepcopy(model).to(dtype)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" says nothing here
    try:
        to_save.save_pretrained(folder)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    cfg = model.config
    if tokenizer == "auto":
        tokenizer = "bpe" if cfg.model_type.startswith("deepseek") else "spm"
    if tokenizer == "bpe":
        _write_bpe_tokenizer(folder, int(cfg.vocab_size))
    elif tokenizer == "spm":
        tok = tokenizer_model_file()
        if cfg.vocab_size == 32000 and tok is not None:
            shutil.copy(tok, folder / "tokenizer.model")
    elif tokenizer != "none":
        raise ValueError(f"tokenizer {tokenizer!r}: spm, bpe, none or auto")
    return folder


def _make_cached(out_dir, stamp_fields: dict, build: Callable[[], object], tokenizer: str,
                 log: Callable[[str], None] | None, what: str) -> Path:
    out = Path(out_dir)
    stamp = out / "colibri_bench_shape.json"
    want = json.dumps(stamp_fields, sort_keys=True, default=str)
    if stamp.is_file() and stamp.read_text() == want and (out / "config.json").is_file():
        return out
    if log is not None:
        log(f"generating a random {what} in {out}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(build(), tmp, tokenizer=tokenizer)
    (tmp / "colibri_bench_shape.json").write_text(want)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def mixtral_config(shape: dict) -> dict:
    """A :data:`MIXTRAL_791M`-style shape dict (vocab, hidden, inter, layers, heads, kv_heads,
    experts, top_k, max_pos) as transformers config keys."""
    return dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                intermediate_size=shape["inter"], num_hidden_layers=shape["layers"],
                num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
                max_position_embeddings=shape["max_pos"], rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip


def make_model(out_dir: str | os.PathLike, shape: dict | None = None, seed: int = 0,
               log: Callable[[str], None] | None = None) -> Path:
    """A seeded random-init ``MixtralForCausalLM`` of ``shape`` (the keys of
    :data:`MIXTRAL_791M`, the default) saved in ``out_dir`` as f32 safetensors, with the
    Mixtral tokenizer when the vocabulary has 32000 entries; a folder that already holds the
    same shape and seed is reused as it is. ``log`` gets a line when a model is generated.
    Sizes that are multiples of 4 keep transformers' CPU ``grouped_mm`` experts usable."""
    shape = dict(MIXTRAL_791M if shape is None else shape)
    return _make_cached(out_dir, {**shape, "seed": seed},
                        lambda: build_from_config("mixtral", mixtral_config(shape), seed),
                        "spm", log, f"Mixtral {shape} (seed {seed})")


def make_family_model(out_dir: str | os.PathLike, family: str, config: dict, seed: int = 0,
                      log: Callable[[str], None] | None = None, tokenizer: str = "auto") -> Path:
    """A seeded random-init model of any family of :data:`FAMILY_CLASSES` from transformers
    config keys (``AutoConfig.for_model(family, **config)``), saved in ``out_dir`` as f32
    safetensors with a ``tokenizer`` as :func:`save_checkpoint` takes it; reused when the
    folder already holds the same family, config, seed and tokenizer."""
    return _make_cached(out_dir, {"family": family, **config, "seed": seed, "tokenizer": tokenizer},
                        lambda: build_from_config(family, config, seed), tokenizer, log,
                        f"{family} {config} (seed {seed})")
