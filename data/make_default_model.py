"""Create the embedded default model data/tiny-mixtral/ (deterministically).

A tiny random-weight Mixtral (vocab 32000, hidden 64, 4 layers, 8 experts, top-2,
intermediate 128, 4 heads / 2 KV heads, head_dim 16) saved as a Hugging Face
checkpoint folder with the REAL Mixtral SentencePiece tokenizer, so examples and tests
have a model with real tokenization without any download:

    data/tiny-mixtral/config.json              MixtralForCausalLM (transformers 5 style)
    data/tiny-mixtral/model.safetensors        bf16 weights, hub-style key names
    data/tiny-mixtral/tokenizer.model          mistral_common/data/tokenizer.model.v1
    data/tiny-mixtral/tokenizer_config.json    so AutoTokenizer works offline
    data/tiny-mixtral/special_tokens_map.json
    data/tokenizer.model.v1                    the same tokenizer file, on its own

Weights come from numpy.random.default_rng(SEED) in a fixed order (normal, std 0.02;
norm weights 1.0), rounded to bf16 by torch, so the files are byte-for-byte reproducible.
Run by hand (not in CI), from the repository root:

    /work/devenv/bin/python data/make_default_model.py

It then checks that transformers loads the model and the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import numpy as np

SEED = 20240611
STD = 0.02
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "tiny-mixtral")

CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "rms_norm_eps": 1e-05,
    "hidden_act": "silu",
    "sliding_window": None,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
    "initializer_range": STD,
    "router_aux_loss_coef": 0.001,
    "router_jitter_noise": 0.0,
    "output_router_logits": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
    "use_cache": True,
    "dtype": "bfloat16",
}

TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "add_bos_token": True,
    "add_eos_token": False,
    "add_prefix_space": None,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": None,
    "clean_up_tokenization_spaces": False,
    "legacy": True,
    "model_max_length": 4096,
    "sp_model_kwargs": {},
    "spaces_between_special_tokens": False,
    "use_default_system_prompt": False,
}

SPECIAL_TOKENS_MAP = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def tensor_specs(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) in the fixed generation order; kind 'norm' or 'weight'."""
    V, H, I = c["vocab_size"], c["hidden_size"], c["intermediate_size"]
    nq, nkv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    out = [("model.embed_tokens.weight", (V, H), "weight")]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}"
        out += [(f"{p}.input_layernorm.weight", (H,), "norm"),
                (f"{p}.self_attn.q_proj.weight", (nq, H), "weight"),
                (f"{p}.self_attn.k_proj.weight", (nkv, H), "weight"),
                (f"{p}.self_attn.v_proj.weight", (nkv, H), "weight"),
                (f"{p}.self_attn.o_proj.weight", (H, nq), "weight"),
                (f"{p}.post_attention_layernorm.weight", (H,), "norm"),
                (f"{p}.block_sparse_moe.gate.weight", (c["num_local_experts"], H), "weight")]
        for e in range(c["num_local_experts"]):
            q = f"{p}.block_sparse_moe.experts.{e}"
            out += [(f"{q}.w1.weight", (I, H), "weight"), (f"{q}.w2.weight", (H, I), "weight"),
                    (f"{q}.w3.weight", (I, H), "weight")]
    out += [("model.norm.weight", (H,), "norm"), ("lm_head.weight", (V, H), "weight")]
    return out


def tokenizer_source() -> str:
    import mistral_common
    p = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")
    if not os.path.isfile(p):
        sys.exit(f"error: {p} not found; pip install mistral-common")
    return p


def main() -> int:
    import torch
    from safetensors.torch import save_file

    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(SEED)
    tensors = {}
    for name, shape, kind in tensor_specs(CONFIG):
        if kind == "norm":
            a = np.ones(shape, dtype=np.float32)
        else:
            a = (rng.standard_normal(shape, dtype=np.float32) * np.float32(STD))
        tensors[name] = torch.from_numpy(a).to(torch.bfloat16).contiguous()
    save_file(tensors, os.path.join(OUT, "model.safetensors"), metadata={"format": "pt"})
    del tensors

    with open(os.path.join(OUT, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
        json.dump(TOKENIZER_CONFIG, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(OUT, "special_tokens_map.json"), "w") as f:
        json.dump(SPECIAL_TOKENS_MAP, f, indent=2, sort_keys=True)
        f.write("\n")
    tok = tokenizer_source()
    shutil.copyfile(tok, os.path.join(OUT, "tokenizer.model"))
    shutil.copyfile(tok, os.path.join(HERE, "tokenizer.model.v1"))

    check()
    total = 0
    for fn in sorted(os.listdir(OUT)):
        p = os.path.join(OUT, fn)
        total += os.path.getsize(p)
        with open(p, "rb") as f:
            h = hashlib.sha256(f.read()).hexdigest()[:16]
        print(f"  {fn:<28} {os.path.getsize(p):>10,} bytes  sha256 {h}")
    print(f"wrote {OUT} ({total / 1e6:.1f} MB)")
    if total >= 20e6:
        print("error: the folder must stay under 20 MB", file=sys.stderr)
        return 1
    return 0


def check() -> None:
    """transformers loads the checkpoint and the tokenizer, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import sentencepiece as spm
    import torch
    from transformers import AutoTokenizer, MixtralForCausalLM

    m = MixtralForCausalLM.from_pretrained(OUT, dtype=torch.float32)
    m.eval()
    t = AutoTokenizer.from_pretrained(OUT)
    ids = t("Hello world").input_ids
    sp = spm.SentencePieceProcessor(model_file=os.path.join(OUT, "tokenizer.model"))
    want = [sp.bos_id()] + sp.encode("Hello world")
    if ids != want:
        raise SystemExit(f"error: AutoTokenizer gives {ids}, sentencepiece {want}")
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits
    if logits.shape != (1, len(ids), CONFIG["vocab_size"]) or not torch.isfinite(logits).all():
        raise SystemExit(f"error: bad logits {tuple(logits.shape)}")
    print(f"transformers loads it: 'Hello world' -> {ids}, logits {tuple(logits.shape)}")


if __name__ == "__main__":
    sys.exit(main())
