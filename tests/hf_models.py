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


def hf_logits(model, ids):
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


class ModelCache:
    """shape id -> a random HF model (built once), its checkpoint folder and the files
    converted from it per weight dtype; one per test module."""

    def __init__(self, tmp_factory, shapes: dict, build=build_model):
        self.tmp, self.shapes, self.build = tmp_factory, shapes, build
        self.cache = {}

    def folder(self, key):
        if key not in self.cache:
            model = self.build(self.shapes[key])
            self.cache[key] = (model, save_checkpoint(model, self.tmp.mktemp(key)), {})
        return self.cache[key][1]

    def __call__(self, key, dtype="f32"):
        import colibri_lab

        folder = self.folder(key)
        model, _, files = self.cache[key]
        if dtype not in files:
            out = folder.parent / f"{folder.name}-{dtype}.colibri"
            colibri_lab.convert(folder, out, dtype=dtype, progress=False)
            files[dtype] = out
        return model, files[dtype]


def compare_logits(ref, got, router_logits, top_k, what, tol=1e-4) -> float:
    """Assert max |Δ| <= tol over the positions not decided by a routing near-tie
    (see first_near_tie); returns the max |Δ| and prints it for the test log."""
    import warnings

    import numpy as np
    import pytest

    cut = first_near_tie(router_logits, top_k)
    if cut is not None:
        warnings.warn(f"{what}: positions from {cut} excluded (router near-tie within 1e-5)")
        if cut == 0:
            pytest.skip(f"{what}: first token has a router near-tie")
        ref, got = ref[:cut], got[:cut]
    assert got.shape == ref.shape and got.dtype == np.float32
    delta = float(np.max(np.abs(ref - got)))
    scale = float(np.max(np.abs(ref)))
    assert delta <= tol, f"{what}: max |Δ logits| = {delta:.3g} (logit scale {scale:.3g})"
    print(f"{what}: max |Δ logits| = {delta:.3g} (logit scale {scale:.3g})")
    return delta


def random_ids(vocab: int, n: int, seed: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def check_bf16_checkpoint(model, load, vocab: int, top_k: int, tmp_path, what: str) -> float:
    """--dtype bf16 equals an f32 transformers model loaded (by `load(folder)`) from the
    bf16 checkpoint of `model`; returns the max |Δ logits|."""
    import torch

    import colibri_lab

    folder = save_checkpoint(model, tmp_path / "bf16", dtype=torch.bfloat16)
    ref_model = load(folder)
    out = tmp_path / "m.colibri"
    colibri_lab.convert(folder, out, dtype="bf16", progress=False)
    ids = random_ids(vocab, 50, seed=5)
    ref, router_logits = hf_logits(ref_model, ids)
    with colibri_lab.Engine(out) as eng:
        got = eng.forward(ids)
    return compare_logits(ref, got, router_logits, top_k, what)


def patch_metadata(path, out, old: bytes, new: bytes):
    """Copy a .colibri file to `out` with bytes `old` replaced by `new` (same length, found
    once) inside its metadata section, the section CRC and the header CRC fixed: a file
    whose options say something else (the engine's refusals)."""
    import struct
    import zlib

    buf = bytearray(Path(path).read_bytes())
    off, size, _ = struct.unpack_from("<QQI", buf, 56)
    meta = bytes(buf[off:off + size])
    assert meta.count(old) == 1 and len(old) == len(new)
    buf[off:off + size] = meta.replace(old, new)
    struct.pack_into("<I", buf, 56 + 16, zlib.crc32(buf[off:off + size]))
    struct.pack_into("<I", buf, 252, zlib.crc32(buf[:252]))
    out.write_bytes(bytes(buf))
    return out
