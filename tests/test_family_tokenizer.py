"""A Qwen2-MoE checkpoint with a byte-level BPE `tokenizer.json`, end to end: the
converter picks the tokenizer up, the engine's tokenizer equals Hugging Face `tokenizers`
on it, and text-in, text-out generation equals transformers'."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

import colibri_lab  # noqa: E402

from colibri_lab.bench.models import FamilyShape, build_model, byte_level_bpe, save_checkpoint  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "def forward(self, x):\n    return self.w2(F.silu(self.w1(x)) * self.w3(x))\n",
    "The router sends each token to 2 of 6 experts — DON'T expect uniform load!",
    "<|im_start|>user\n你好, мир 🙂 123456<|im_end|>",
]


def _corpus(chars: int = 400_000) -> list[str]:
    """Python's own standard library source (text every installation has), about `chars`
    characters, then TEXTS."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for p in sorted(root.glob("*.py")):
        t = p.read_text("utf-8", "replace")
        out.append(t)
        size += len(t)
        if size > chars:
            break
    return out + TEXTS


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    tok = byte_level_bpe(_corpus(), 1200, SPECIALS)
    vocab = tok.get_vocab_size()
    shape = FamilyShape(family="qwen2_moe", vocab=vocab, hidden=48, inter=30, dense_inter=70,
                        shared_inter=40, layers=2, heads=4, kv_heads=2, experts=4, top_k=2,
                        mlp_only_layers=(1,), seed=11)
    model = build_model(shape)
    folder = save_checkpoint(model, tmp_path_factory.mktemp("qwen-tok"), tokenizer="none")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    out = folder.parent / "qwen.colibri"
    colibri_lab.convert(folder, out, dtype="f32", progress=False)
    return model, tok, folder, out


def test_converter_stores_the_byte_level_tokenizer(qwen_folder):
    _, tok, _, out = qwen_folder
    info = colibri_lab.inspect(out)
    assert info.metadata["tokenizer.type"] == "byte_level_bpe"
    assert info.metadata["tokenizer.bos_id"] == -1
    assert info.metadata["tokenizer.eos_id"] == tok.token_to_id("<|im_end|>")


def test_engine_tokenizer_equals_tokenizers(qwen_folder):
    _, tok, _, out = qwen_folder
    with colibri_lab.Engine(out) as eng:
        assert eng.tokenizer.bos_id == -1
        for text in TEXTS + _corpus()[:3]:
            ref = tok.encode(text, add_special_tokens=False).ids
            # add_bos is a no-op for a tokenizer without BOS (as transformers does for Qwen)
            assert eng.tokenizer.encode(text, add_bos=True) == ref
            assert eng.tokenizer.decode(ref) == tok.decode(ref, skip_special_tokens=True)


def test_text_generation_equals_transformers(qwen_folder):
    model, tok, _, out = qwen_folder
    prompt = TEXTS[0]
    ids = tok.encode(prompt, add_special_tokens=False).ids
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    with colibri_lab.Engine(out) as eng:
        got = list(eng.generate(prompt, max_new_tokens=24, stop_at_eos=False))
    assert [t.id for t in got] == ref
    assert "".join(t.text for t in got) == tok.decode(ref, skip_special_tokens=True)


def test_unsupported_tokenizer_json_is_refused_or_skipped(qwen_folder, tmp_path):
    import shutil

    _, _, folder, _ = qwen_folder
    d = tmp_path / "wordpiece"
    shutil.copytree(folder, d)
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(d / "tokenizer.json"))
    with pytest.raises(ValueError, match="no_tokenizer"):
        colibri_lab.convert(d, tmp_path / "x.colibri", dtype="f32", progress=False)
    assert not (tmp_path / "x.colibri").exists()
    from colibri_lab.conversion.cli import main

    assert main(["--model_name_or_path", str(d), "--output_path", str(tmp_path / "y.colibri"),
                 "--dtype", "f32", "--no_tokenizer", "--quiet"]) == 0
    with colibri_lab.Engine(tmp_path / "y.colibri") as eng:
        assert np.isfinite(eng.forward([1, 2, 3])).all()
        with pytest.raises(colibri_lab.ColibriError, match="no tokenizer"):
            eng.tokenizer.encode("hi")


def test_tekken_json_is_picked_up(tmp_path):
    """A folder with Mistral's tekken.json (and no tokenizer.model / tokenizer.json) gets
    that vocabulary; ids equal mistral-common's Tekkenizer."""
    import shutil

    tekken_mod = pytest.importorskip("mistral_common.tokens.tokenizers.tekken")
    import mistral_common

    files = sorted((Path(mistral_common.__file__).parent / "data").glob("tekken_*.json"))
    if not files:
        pytest.skip("no tekken_*.json in this mistral-common")
    from colibri_lab.bench.models import MixtralShape, build_model

    folder = save_checkpoint(build_model(MixtralShape(vocab=300, hidden=24, inter=20, layers=1, heads=2,
                                               kv_heads=1, experts=4, top_k=2)),
                             tmp_path / "hf", tokenizer="none")
    shutil.copy(files[-1], folder / "tekken.json")
    out = tmp_path / "m.colibri"
    colibri_lab.convert(folder, out, dtype="f32", progress=False)
    ref = tekken_mod.Tekkenizer.from_file(str(files[-1]))
    text = "Hello, Mixtral! Ça va? 你好 🙂 DON'T [INST] 12345"
    with colibri_lab.Engine(out) as eng:
        assert colibri_lab.inspect(out).metadata["tokenizer.type"] == "byte_level_bpe"
        assert eng.tokenizer.encode(text, add_bos=True) == ref.encode(text, bos=True, eos=False)
        assert eng.tokenizer.bos_id == ref.bos_id and eng.tokenizer.eos_id == ref.eos_id
