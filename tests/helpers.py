"""What the tests share: transformers' logits and router logits of a model
(`hf_logits`), the comparison that leaves out positions decided by a router near-tie
(`first_near_tie`, `compare_logits`), a per-module cache of random models and their
conversions (`ModelCache`), and a metadata patcher for refusal tests (`patch_metadata`).
The models themselves come from the one random-model factory, colibri_lab.bench.models."""

from __future__ import annotations

from pathlib import Path

from colibri_lab.bench.models import build_model, save_checkpoint


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

    cut = first_near_tie(router_logits, top_k)
    if cut is not None:
        warnings.warn(f"{what}: positions from {cut} excluded (router near-tie within 1e-5)")
        assert cut > 0, f"{what}: the first token has a router near-tie, nothing to compare: choose other ids"
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
