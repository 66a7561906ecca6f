"""Kimi's tokenizer (Kimi-K2, K2.5, Kimi-Linear): a tiktoken vocabulary (`tiktoken.model`)
with the split pattern of its tokenizer class (tokenization_kimi.py's TikTokenTokenizer:
o200k's alternatives with runs of Han split off first and Han taken out of the letter
classes), against `tiktoken` itself with that pattern, the reference the class runs.

A byte-level BPE is trained here with `tokenizers` on the shared corpus split by Kimi's
pattern; its tokens, ranked by id, become a tiktoken vocabulary, written beside a
tokenizer_config.json (Kimi's special tokens among 256 reserved ids, auto_map naming the
class) and a tokenizer class file stating the pattern as Kimi's does ("|".join of eight
strings). Then:

  * the HF-side folder (colibri_lab.conversion.bpe.build_tiktoken_section, and the whole
    converter on a Kimi-K2 checkpoint: model_type kimi_k2, DeepseekV3ForCausalLM) encodes as
    tiktoken.encode(text, allowed_special="all") over ~2 MB of text (the shared corpus,
    gpt-oss-style text and Kimi-specific text: Han of every range among letters, digits,
    kana, punctuation, ideographic iteration marks and numerals, radicals, CamelCase,
    contractions after Han) and decodes as tiktoken less the special ids; the same text split
    by o200k's pattern gives other ids for many documents, so the Han rules are exercised;
  * a GGUF tokenizer as llama.cpp's converter writes Kimi's (tokenizer.ggml.pre = kimi-k2,
    tokens in the byte-level alphabet, one merge per token, the special ids CONTROL, [PAD]
    fillers) imports to the same ids;
  * bad vocabularies and unknown patterns are refused with the reason.
"""

from __future__ import annotations

import base64
import json
import random
import shutil
import sys
import unicodedata
from pathlib import Path

import pytest

tiktoken = pytest.importorskip("tiktoken")
pytest.importorskip("tokenizers")

sys.path.insert(0, str(Path(__file__).parent))
import colibri_lab  # noqa: E402
from colibri_lab.bench.models import KIMI_SPECIAL_TOKENS, kimi_style_tokenizer  # noqa: E402
from colibri_lab.conversion.bpe import (  # noqa: E402
    KIMI_K2_PATTERN,
    O200K_PATTERN,
    build_tiktoken_section,
    bytes_to_unicode,
)
from colibri_lab.conversion.spec import ConversionError  # noqa: E402
from test_tokenizer_bpe import O200K_WORDS, WORDS, _o200k_docs, assert_same_ids, make_corpus  # noqa: E402

# tokenization_kimi.py's pat_str, as that file writes it
KIMI_PARTS = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
KIMI_SPECIALS = list(KIMI_SPECIAL_TOKENS)
RESERVED = 256
# Script=Han, the assigned ranges of the Unicode version of Python's unicodedata (the
# engine's tables), written out here as the reference for the text below
HAN = [(0x2E80, 0x2E99), (0x2E9B, 0x2EF3), (0x2F00, 0x2FD5), (0x3005, 0x3005), (0x3007, 0x3007), (0x3021, 0x3029),
       (0x3038, 0x303B), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFA6D), (0xFA70, 0xFAD9), (0x16FE2, 0x16FE3),
       (0x16FF0, 0x16FF1), (0x20000, 0x2A6DF), (0x2A700, 0x2B738), (0x2B740, 0x2B81D), (0x2B820, 0x2CEA1),
       (0x2CEB0, 0x2EBE0), (0x2F800, 0x2FA1D), (0x30000, 0x3134A)]
# characters beside the Han ranges, of other scripts or categories
NEAR_HAN = [chr(c) for c in [*range(0x3000, 0x3040), 0x2E7F, 0x2E9A, 0x2FD6, 0x2FF0, 0x2FFB, 0x3006, 0x3008, 0x302A,
                             0x302F, 0x3037, 0x303C, 0x303D, 0xFA6E, 0x16FE0, 0x16FE4, 0x16FF2, 0x1F200]
            if unicodedata.category(chr(c)) != "Cn"]
FIXED = ["中文English混合", "汉字abc", "北京市 Pascal", "人々は〇〇年に〡〢", "⺀⺁abc ⼀x ⿰", "getHTTPResponse 漢字's 字'LL",
         "日本語のテキスト、カタカナ。ｶﾀｶﾅ", "<|im_user|>hi<|im_end|><|im_assistant|>", "a/b//c ./x !/ ?\r\n",
         "1234567 〇一二三 ٣٤٥", "e\u0301te\u0301 ΣΊΣΥΦΟΣ's DON'T", "\U00016FF0x\U00016FE2y", " 中 \n\n 文  "]


def _han(rng: random.Random) -> str:
    a, b = rng.choice(HAN)
    return chr(rng.randint(a, b))


def kimi_doc(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(20, 150)):
        r = rng.random()
        if r < 0.3:
            out.append("".join(_han(rng) for _ in range(rng.randint(1, 4))))
        elif r < 0.4:
            out.append(rng.choice(NEAR_HAN))
        elif r < 0.55:
            out.append(rng.choice(O200K_WORDS + WORDS + ["getHTTP", "CamelCase", "ΣΊΣ", "e\u0301", "ǅx", "ʰa", "ﬁ"]))
        elif r < 0.62:
            out.append(rng.choice(["'s", "'T", "'re", "'LL", "'d", "'ve", "'m", "'x"]))
        elif r < 0.7:
            out.append("".join(rng.choice("0123456789٣١") for _ in range(rng.randint(1, 5))))
        elif r < 0.8:
            out.append(rng.choice(["!", "、", "。", "「", "」", "/", "//", "?\r\n", "—", "(", ")", "💡", "\u0301"]))
        elif r < 0.87:
            out.append(rng.choice(["ひらがな", "カタカナ", "한국어", "ㄱ", "ｶﾀｶﾅ", "ー"]))
        elif r < 0.9:
            out.append(rng.choice(KIMI_SPECIALS + ["<|reserved_token_9|>", "<|im_end", "[BOS"]))
        else:
            out.append(rng.choice([" ", "  ", "\n", "\r\n", "\t", " \n ", "\u3000", "\u00a0"]))
        if rng.random() < 0.4:
            out.append(rng.choice([" ", "", "\n"]))
    return "".join(out)


def kimi_docs(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [kimi_doc(rng) for _ in range(n)]


def kimi_class_file(parts=KIMI_PARTS, reserved: int = RESERVED) -> str:
    """A tokenizer class file stating its pattern and reserved ids as Kimi's does."""
    body = "".join(f'        r"""{p}""",\n' for p in parts)
    return ("class TikTokenTokenizer:\n"
            f"    num_reserved_special_tokens = {reserved}\n"
            '    pat_str = "|".join(\n        [\n' + body + "        ]\n    )\n")


def write_kimi_tokenizer(folder: Path, texts: list[str], vocab_size: int) -> dict:
    """Kimi's tokenizer files (colibri_lab.bench.models.kimi_style_tokenizer) with a class file
    that writes the pattern as Kimi's does; the ranks."""
    return kimi_style_tokenizer(texts, vocab_size, folder, kimi_class_file())


def copy_tokenizer(src: Path, dst: Path, config: dict | None = None) -> None:
    """The tokenizer files of src in dst, tokenizer_config.json updated with config."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py"):
        shutil.copyfile(src / name, dst / name)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg.update(config or {})
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))


def reference(ranks: dict[bytes, int], pattern: str = KIMI_K2_PATTERN, reserved: int = RESERVED):
    """tiktoken with the pattern, the special ids as the class names them."""
    n = len(ranks)
    names = {i: f"<|reserved_token_{i}|>" for i in range(n, n + reserved)}
    names.update({n + k: nm for k, nm in enumerate(KIMI_SPECIALS)})
    return tiktoken.Encoding(name="kimi-test", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens={nm: i for i, nm in names.items()})


TRAIN = {"texts": None}


def train_texts() -> list[str]:
    if TRAIN["texts"] is None:
        TRAIN["texts"] = make_corpus(seed=1234, target=300_000) + kimi_docs(5, 400)
    return TRAIN["texts"]


@pytest.fixture(scope="module")
def kimi_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi")
    write_kimi_tokenizer(d, train_texts(), 5000)
    return d


@pytest.fixture(scope="module")
def ranks(kimi_folder):
    import tiktoken.load

    # an empty TIKTOKEN_CACHE_DIR: tiktoken would otherwise keep a copy of every file it reads,
    # local ones too, in the temp folder's data-gym-cache (one per test run's path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        return tiktoken.load.load_tiktoken_bpe(str(kimi_folder / "tiktoken.model"))


def _docs() -> list[str]:
    return make_corpus(7, target=700_000) + _o200k_docs(6, 300_000) + kimi_docs(11, 2000) + FIXED


def _check_parity(ct, enc, n: int, docs: list[str], label: str) -> None:
    want = [enc.encode(d, allowed_special="all") for d in docs]
    got = [ct.encode(d.encode("utf-8"), add_bos=False) for d in docs]
    assert_same_ids(got, want, label, lambda i: enc.decode_single_token_bytes(i))
    bad = [i for i, w in enumerate(want)
           if ct.decode_bytes(w).decode("utf-8") != enc.decode([x for x in w if x < n], errors="replace")]
    assert not bad, f"{label}: decode differs for {len(bad)} documents (first {bad[0]})"


def test_pattern_is_kimis():
    assert "|".join(KIMI_PARTS) == KIMI_K2_PATTERN


def test_tiktoken_folder_encodes_as_tiktoken(kimi_folder, ranks):
    section, meta = build_tiktoken_section(kimi_folder / "tiktoken.model")
    n = len(ranks)
    assert meta["tokenizer.pattern"] == "kimi_k2" and meta["n_pieces"] == n + RESERVED
    assert (meta["tokenizer.bos_id"], meta["tokenizer.eos_id"]) == (n, n + 1)
    assert meta["tokenizer.unk_id"] == meta["tokenizer.pad_id"] == -1
    enc = reference(ranks)
    docs = _docs()
    assert sum(len(d.encode("utf-8")) for d in docs) >= 1_900_000
    # the Han rules decide: o200k's pattern over the same vocabulary gives other ids
    o200k = reference(ranks, O200K_PATTERN)
    kimi = kimi_docs(11, 2000)
    assert sum(o200k.encode(d, allowed_special="all") != enc.encode(d, allowed_special="all") for d in kimi) > 300
    with colibri_lab.Tokenizer.from_section_bytes(section) as ct:
        _check_parity(ct, enc, n, docs, "kimi tiktoken")
        for text in FIXED:
            assert ct.encode(text.encode("utf-8"), add_bos=True) == [n] + enc.encode(text, allowed_special="all")
        # a reserved id's name is a special token of the text too; decode skips it
        assert ct.encode(f"x<|reserved_token_{n + 200}|>y".encode(), add_bos=False) == \
            [*enc.encode("x"), n + 200, *enc.encode("y")]
        assert ct.decode_bytes([n + 2, *enc.encode("hi")]) == b"hi"


def class_encode(enc, text: str) -> list[int]:
    """What Kimi's tokenizer class gives for `tokenizer(text)`: its special tokens split off
    first, then each stretch between them cut every 400,000 characters and, inside each chunk,
    before the character that makes a run of whitespace (str.isspace) or of other characters
    25,001 long (and every 25,000 after), each part encoded by tiktoken on its own."""
    import re

    names = sorted(enc.special_tokens_set, key=len, reverse=True)
    ids = []
    for piece in re.split("(" + "|".join(map(re.escape, names)) + ")", text):
        if piece in enc.special_tokens_set:
            ids.append(enc.encode_single_token(piece))
            continue
        for c0 in range(0, len(piece), 400_000):
            chunk, start, run, space = piece[c0:c0 + 400_000], 0, 0, None
            for i, ch in enumerate(chunk):
                sp = ch.isspace()
                if space is None:
                    space = sp
                if sp != space:
                    space, run = sp, 1
                else:
                    run += 1
                    if run > 25_000:
                        ids += enc.encode(chunk[start:i], disallowed_special=())
                        start, run = i, 1
            ids += enc.encode(chunk[start:], disallowed_special=())
    return ids


def test_long_texts_are_encoded_in_the_class_parts(kimi_folder, ranks):
    """Runs of more than 25,000 (non-)whitespace characters and texts of more than 400,000
    characters are encoded in the parts Kimi's class cuts them into, between special tokens."""
    section, _ = build_tiktoken_section(kimi_folder / "tiktoken.model")
    enc = reference(ranks)
    rng = random.Random(17)
    texts = ["abc" * 20_000, " " * 60_001 + "x", "x" + "\u3000\n " * 20_000 + "y", "字" * 50_003,
             "".join(make_corpus(19, target=500_000))[:420_000] + "<|im_end|>" + "a" * 25_001,
             "z" * 24_999 + "<|im_user|>" + "z" * 25_001,
             "".join(rng.choice("ab \x1c\t") for _ in range(80_000)),
             "token " * 70_000]   # the 400,000th character cuts a word: "toke" | "n token ..."
    with colibri_lab.Tokenizer.from_section_bytes(section) as ct:
        for t in texts:
            want = class_encode(enc, t)
            assert ct.encode(t.encode("utf-8"), add_bos=False) == want
        # the cuts change the ids (the parts are not what one tiktoken call gives)
        assert sum(class_encode(enc, t) != enc.encode(t, allowed_special="all") for t in texts) >= 3


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's merging of token's bytes with the merges ranked below max_rank."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[1]):
                best = (i, r)
        if best is None:
            return parts
        i = best[0]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def kimi_gguf_vocab(ranks: dict[bytes, int], n_tokens: int, reserved: int = RESERVED):
    """(tokens, token types, merges) as llama.cpp's converter writes a Kimi vocabulary: the
    ranks' bytes in the byte-level alphabet, the special ids CONTROL, "[PAD{i}]" UNUSED up to
    n_tokens; one merge per token of two or more bytes, its two parts under its own rank."""
    b2u = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    n = len(ranks)
    names = {i: f"<|reserved_token_{i}|>" for i in range(n, n + reserved)}
    names.update({n + k: nm for k, nm in enumerate(KIMI_SPECIALS)})
    by_rank = sorted(ranks, key=ranks.get)
    tokens, types = [], []
    for i in range(n_tokens):
        if i < n:
            tokens.append(s(by_rank[i]))
            types.append(1)
        elif i in names:
            tokens.append(names[i])
            types.append(3)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(5)
    merges = []
    for b in by_rank:
        if len(b) > 1:
            parts = _bpe_parts(ranks, b, ranks[b])
            if len(parts) == 2:
                merges.append(f"{s(parts[0])} {s(parts[1])}")
    return tokens, types, merges


def test_gguf_kimi_k2_tokenizer_imports(tmp_path, ranks):
    """tokenizer.ggml.pre = kimi-k2: the rebuilt tokenizer encodes as tiktoken."""
    gguf = pytest.importorskip("gguf")
    from colibri_lab.conversion.gguf import _gguf_tokenizer
    from colibri_lab.conversion.gguf_file import GgufFile

    n = len(ranks)
    tokens, types, merges = kimi_gguf_vocab(ranks, n + RESERVED + 7)
    path = tmp_path / "kimi.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("kimi-k2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(n)
    w.add_eos_token_id(n + 1)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    section, meta = _gguf_tokenizer(GgufFile(str(path)), lambda *_: None, "auto")
    assert meta["tokenizer.eos_id"] == n + 1 and meta["tokenizer.bos_id"] == -1
    # llama.cpp's end-of-generation set beside EOS: the tokens it counts by their text
    assert sorted(meta["tokenizer.end_ids"].value) == [n + 2, n + 7]   # <|im_end|>, [EOT]
    with colibri_lab.Tokenizer.from_section_bytes(section) as ct:
        assert ct.vocab_size == n + RESERVED
        _check_parity(ct, reference(ranks), n, make_corpus(8, target=300_000) + kimi_docs(12, 800) + FIXED,
                      "kimi-k2 GGUF")


def test_kimi_checkpoint_converts_with_its_tokenizer(tmp_path, kimi_folder, ranks):
    """A Kimi-K2 checkpoint (model_type kimi_k2, DeepseekV3ForCausalLM) with its tiktoken
    vocabulary converts; the engine tokenizes as tiktoken and stops at generation_config's
    end ids."""
    pytest.importorskip("torch")
    from colibri_lab.bench.models import DeepseekShape, build_model, save_checkpoint
    from colibri_lab.format import reader as fmt_reader

    n = len(ranks)
    shape = DeepseekShape("deepseek_v3", vocab=n + RESERVED, hidden=64, inter=32, dense_inter=96, layers=2, heads=2,
                          q_lora=48, kv_lora=32, nope=16, rope=8, v_dim=16, experts=4, top_k=2, shared=1,
                          first_dense=1, n_group=2, topk_group=1, seed=61)
    folder = tmp_path / "kimi"
    save_checkpoint(build_model(shape), folder, tokenizer="none")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"
    (folder / "config.json").write_text(json.dumps(cfg))
    copy_tokenizer(kimi_folder, folder, {"chat_template": "{% for m in messages %}<|im_user|>{{ m['content'] }}"
                                                          "<|im_end|>{% endfor %}<|im_assistant|>"})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": n + 2}))
    out = colibri_lab.convert(folder, tmp_path / "kimi.colibri", dtype="f32", progress=False)
    info = fmt_reader.inspect(out)
    assert info.metadata["tokenizer.type"] == "byte_level_bpe" and info.metadata["general.architecture"] == "deepseek_v3"
    assert list(info.metadata["tokenizer.end_ids"]) == [n + 2]
    enc = reference(ranks)
    with colibri_lab.Engine(out) as eng:
        for text in FIXED + kimi_docs(13, 20):
            assert eng.tokenizer.encode(text, add_bos=False) == enc.encode(text, allowed_special="all")
        assert eng.end_ids == (n + 1, n + 2)


def _refused(folder: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_tiktoken_section(folder / "tiktoken.model")


def test_refusals(tmp_path, kimi_folder, ranks):
    n = len(ranks)

    def folder(name, mutate=None, cfg=None, class_file=None):
        d = tmp_path / name
        copy_tokenizer(kimi_folder, d, cfg)
        if class_file is not None:
            (d / "tokenization_kimi.py").write_text(class_file)
        if mutate is not None:
            mutate(d)
        return d

    # a pattern the engine has no matcher for is refused by name (here: o200k's with Kimi's Han run)
    _refused(folder("pat", class_file=kimi_class_file(KIMI_PARTS[:4] + [r""" ?[^\s\p{L}\p{N}]+[\r\n/]*"""]
                                                       + KIMI_PARTS[5:])),
             r"tiktoken split pattern .* \(tokenization_kimi\.py\) is not implemented")
    _refused(folder("noauto", cfg={"auto_map": None}), "needs its tokenizer class")
    _refused(folder("noclass", mutate=lambda d: (d / "tokenization_kimi.py").unlink()), "cannot read the tokenizer class")
    _refused(folder("nopat", class_file="class TikTokenTokenizer:\n    pat_str = make()\n"), "no literal pat_str")
    _refused(folder("badline", mutate=lambda d: (d / "tiktoken.model").write_text("!!!! 0\n")),
             "line 1 is not 'base64")
    _refused(folder("hole", mutate=lambda d: (d / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(bytes([b])).decode()} {b if b < 200 else b + 1}\n" for b in range(256)))),
        "ranks are not 0..255")
    _refused(folder("nobyte", mutate=lambda d: (d / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(255)))),
        "lacks the single byte 0xff")
    _refused(folder("outside", cfg={"added_tokens_decoder": {"99999": {"content": "<x>", "special": True}}}),
             f"added token 99999 .* outside the special ids {n}..{n + 255}")
    # through the converter: the reason and how to convert without a tokenizer
    from colibri_lab.conversion.tokenizer import _tokenizer_section

    with pytest.raises(ConversionError, match="no literal pat_str.*tokenizer='none'"):
        _tokenizer_section(str(tmp_path / "nopat"), lambda *_: None)
