"""Random-init Hugging Face Mixtral checkpoints for the parity tests.

Models are made with transformers itself (torch==2.13.0 CPU), seeded, with norm
weights randomised too (an all-ones norm hides a wrongly applied norm), and saved
with ``save_pretrained`` so the converter reads exactly what users will give it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_MODEL = REPO / "data" / "tokenizer.model.v1"


@dataclass(frozen=True)
class Shape:
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

    def config(self):
        from transformers import MixtralConfig

        return MixtralConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.inter,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            num_local_experts=self.experts,
            num_experts_per_tok=self.top_k,
            sliding_window=self.sliding_window,
            tie_word_embeddings=self.tie,
            max_position_embeddings=self.max_pos,
            initializer_range=self.std,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
            **dict(self.extra),
        )


def build_model(shape: Shape):
    """A seeded random MixtralForCausalLM in float32, eval mode, eager experts."""
    import torch
    from transformers import MixtralForCausalLM

    torch.manual_seed(shape.seed)
    model = MixtralForCausalLM(shape.config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm weights: randomise so a misapplied norm shows
                p.uniform_(0.5, 1.5)
    model.set_experts_implementation("eager")
    return model


def save_checkpoint(model, folder: Path, *, dtype=None, with_tokenizer: bool | None = None) -> Path:
    """save_pretrained (optionally in another dtype), plus the real tokenizer when the
    vocabulary is the Mixtral one."""
    import torch

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    to_save = model
    if dtype is not None and dtype != torch.float32:
        import copy

        to_save = copy.deepcopy(model).to(dtype)
    to_save.save_pretrained(folder)
    if with_tokenizer is None:
        with_tokenizer = model.config.vocab_size == 32000
    if with_tokenizer:
        shutil.copy(TOKENIZER_MODEL, folder / "tokenizer.model")
    return folder


def hf_logits(model, ids) -> "np.ndarray":
    import numpy as np
    import torch

    with torch.no_grad():
        out = model(torch.tensor([list(ids)], dtype=torch.long), output_router_logits=True)
    return out.logits[0].float().numpy().astype(np.float32), out.router_logits


def first_near_tie(router_logits, top_k: int, gap: float = 1e-5) -> int | None:
    """Position of the first token whose k-th and (k+1)-th router probabilities are
    within `gap` in some layer (expert choice there is decided by float rounding), or
    None. Positions from it on are excluded from exact comparison: a flipped choice
    changes that token's hidden state and, through attention, every later one."""
    import torch

    first = None
    for layer_logits in router_logits:
        probs = torch.softmax(layer_logits.float(), dim=-1)
        n_exp = probs.shape[-1]
        if top_k >= n_exp:
            continue
        top = torch.topk(probs, top_k + 1, dim=-1).values
        tied = (top[:, top_k - 1] - top[:, top_k]).abs() < gap
        idx = torch.nonzero(tied).flatten()
        if len(idx):
            p = int(idx[0])
            first = p if first is None else min(first, p)
    return first
