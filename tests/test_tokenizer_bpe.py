"""Parity of Colibri's byte-level BPE tokenizer (native/src/tokenizer/bpe.c) with Hugging Face
`tokenizers`.

Tokenizers are trained here with the `tokenizers` library (seconds), saved as tokenizer.json,
turned into a tokenizer section by colibri_lab.conversion.bpe and loaded by the C library; ids and
decoded text are compared with `tokenizers` on more than 1 MB of seeded, varied text per
tokenizer: Python source, prose with contractions in every case ("DON'T", "we'Re", "it'ſ"),
CJK, Hangul (precomposed and as jamo), emoji (ZWJ sequences, flags, skin tones), whitespace
runs of every White_Space character (and U+001C..U+001F, which are not), digits of many
scripts, combining marks in random order (NFC), control characters, random assigned code
points, and added / special tokens inside the text.

  (a) Qwen2-style: NFC + Sequence([Split(Qwen2 regex, Isolated), ByteLevel(use_regex=False)]),
      special tokens <|endoftext|>, <|im_start|>, <|im_end|> and a normalized added token;
  (b) GPT-2-style: ByteLevel(use_regex=True), no normalizer, <|endoftext|>;
  (c) (a)'s model with the Llama-3 split regex (\\p{N}{1,3}) and ignore_merges = true;
  (d) gpt-oss-style: Sequence([Split(o200k regex, Isolated), ByteLevel(use_regex=False)]), no
      normalizer, gpt-oss's special tokens (<|start|>, <|message|>, <|channel|>, <|end|>, ...),
      on the shared corpus plus o200k-specific text (contractions glued to words in every
      case, CamelCase, digit runs, marks, slashes after punctuation, \\r\\n, chat turns);
  (e) DeepSeek-V3-style: an empty normalizer Sequence and the Sequence of three Isolated splits
      (\\p{N}{1,3}, CJK / kana runs, the punctuation / letters regex) then ByteLevel, with
      DeepSeek's special tokens, on the shared and (d)'s text plus CJK, kana, ASCII
      punctuation before letters and characters outside every alternative.

The tokenizers are compared on text of the Unicode version of Python's unicodedata (the
tables' source): characters assigned later may be classified differently by `tokenizers`.

The C tokenizer is used only through colibri_lab.Tokenizer (from_section_bytes, encode of
bytes, decode_bytes, piece_bytes); its errors are ColibriError subclasses carrying the C
message.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import unicodedata
from pathlib import Path

import pytest

import colibri_lab
from colibri_lab.conversion.bpe import (DEEPSEEK_LLM_SPLITS, DEEPSEEK_V3_SPLITS, LLAMA3_PATTERN, LLAMA_DEFAULT_SPLITS, O200K_PATTERN, QWEN2_PATTERN,
                              build_bpe_tokenizer_section)

REPO = Path(__file__).resolve().parents[1]

tokenizers = pytest.importorskip("tokenizers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_NORMALIZED = "colibri_added"  # a non-special added token (normalized=True)
ADDED_RAW = "naïve tok"  # added token with characters outside the ByteLevel alphabet (decoded as UTF-8)
TARGET_BYTES = 1_050_000


# ---------------------------------------------------------------------------------
# Seeded corpus.

ASSIGNED = [cp for cp in range(0x20, 0x110000)
            if not 0xD800 <= cp < 0xE000 and unicodedata.category(chr(cp)) not in ("Cn", "Co", "Cs")]
WS = " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2001\u2005\u200a\u2028\u2029\u202f\u205f\u3000\u200b\u180e"
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part naïve café résumé coöperate façade Ångström").split()
CONTRACTIONS = ["don't", "DON'T", "Don'T", "I'M", "i'm", "we'Re", "WE'RE", "they've", "THEY'VE", "she'll", "SHE'LL",
                "he'd", "HE'D", "it's", "IT'S", "it'ſ", "'s", "'S", "'ll", "'LL", "'Ll", "'t", "'re", "'ve", "'m", "'d",
                "o'clock", "rock'n'roll", "'tis", " 'twas", "x'ſt"]
EMOJI = ["👨‍👩‍👧‍👦", "👩🏽‍💻", "🏳️‍🌈", "🇫🇷", "🇯🇵", "👍🏿", "❤️", "🧑‍🚀", "😀", "🙈🙉🙊", "✋🏻", "🫠", "#️⃣",
         "\U0001F469\u200D\u2764\uFE0F\u200D\U0001F468"]
SCRIPTS = ["Привет, как дела? Ёжик", "Γειά σου Κόσμε ΣΊΣΥΦΟΣ", "مرحبا بالعالم ١٢٣٤", "שלום עולם", "नमस्ते दुनिया क्षत्रिय",
           "สวัสดีชาวโลก", "こんにちは世界、カタカナ・ひらがな。", "你好，世界！中文字符测试。", "안녕하세요 세계",
           "Ꭰ Ꭱ Ꭲ", "ǅungla ǈ ǋ", "ﬁ ﬂ ﬀ", "Ⅻ ⅻ ① ⑳ ² ³ ½ ¾", "٠١٢٣٤٥٦٧٨٩ ۰۱۲ ०१२३ ０１２３"]
CODE = [Path(os.__file__).read_text(encoding="utf-8"), Path(json.__file__).read_text(encoding="utf-8"),
        (REPO / "colibri_lab" / "conversion" / "spm.py").read_text(encoding="utf-8")]


def _rand_ws(rng: random.Random) -> str:
    return "".join(rng.choice(WS) for _ in range(rng.randint(1, 6)))


def _prose(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.08:
            out.append(rng.choice(CONTRACTIONS))
        elif r < 0.12:
            out.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
        elif r < 0.14:
            out.append(rng.choice(SPECIALS) if rng.random() < 0.7 else rng.choice([ADDED_NORMALIZED, ADDED_RAW]))
        elif r < 0.16:
            out.append(rng.choice(EMOJI))
        else:
            w = rng.choice(WORDS)
            out.append(w.upper() if rng.random() < 0.1 else w.capitalize() if rng.random() < 0.2 else w)
        out.append(rng.choice([" ", " ", " ", ", ", ". ", "\n", "  ", "! ", "? ", "; ", " - ", "'", "\n\n"])
                   if rng.random() < 0.95 else _rand_ws(rng))
    return "".join(out)


def _doc(rng: random.Random) -> str:
    kind = rng.randrange(10)
    if kind == 0:
        src = rng.choice(CODE)
        a = rng.randrange(len(src))
        return src[a:a + rng.randint(200, 4000)]
    if kind in (1, 2, 3):
        return _prose(rng, rng.randint(50, 600))
    if kind == 4:  # CJK + Hangul, precomposed and as conjoining jamo
        parts = []
        for _ in range(rng.randint(20, 300)):
            r = rng.random()
            if r < 0.5:
                parts.append(chr(rng.randint(0x4E00, 0x9FFF)))
            elif r < 0.65:
                parts.append(chr(rng.randint(0x3041, 0x30FF)))
            elif r < 0.8:
                parts.append(chr(rng.randint(0xAC00, 0xD7A3)))
            elif r < 0.9:
                parts.append(unicodedata.normalize("NFD", chr(rng.randint(0xAC00, 0xD7A3))))
            else:
                parts.append(rng.choice(["，", "。", "、", "「", "」", " ", "\n", "！", "1", "２"]))
        return "".join(parts)
    if kind == 5:  # scripts, combining marks in random order (NFC reordering / composition)
        parts = []
        for _ in range(rng.randint(10, 80)):
            r = rng.random()
            if r < 0.4:
                parts.append(rng.choice(SCRIPTS))
            elif r < 0.8:
                base = rng.choice("aeiouAEIOUnNcCsSzZyYwWαΑωΩиИ가")
                marks = [chr(rng.choice([0x300, 0x301, 0x302, 0x303, 0x308, 0x30A, 0x323, 0x327, 0x328, 0x331,
                                          0x345, 0x35C, 0x1AB0, 0x20D7, 0x302A, 0x1D165]))
                         for _ in range(rng.randint(1, 4))]
                parts.append(base + "".join(marks))
            else:
                parts.append(rng.choice([" ", "\n", ", ", "\u0958", "\u2126", "\u212B", "\uFB2C", "\u0344",
                                         "\u1E9B\u0323", "\u0F73", "\U0001D15E"]))
        return "".join(parts)
    if kind == 6:  # whitespace, digits, controls
        parts = []
        for _ in range(rng.randint(30, 300)):
            r = rng.random()
            if r < 0.35:
                parts.append(_rand_ws(rng))
            elif r < 0.6:
                parts.append(str(rng.randint(0, 10 ** 15)))
            elif r < 0.75:
                parts.append(chr(rng.choice(list(range(0, 32)) + [0x7F] + list(range(0x80, 0xA0)))))
            else:
                parts.append(rng.choice(WORDS + CONTRACTIONS + ["!!", "...", "--", "/*", "*/", "'", '"']))
        return "".join(parts)
    if kind == 7:  # random assigned code points
        return "".join(chr(rng.choice(ASSIGNED)) if rng.random() < 0.7 else rng.choice(" \n'a1.")
                       for _ in range(rng.randint(20, 400)))
    if kind == 8:  # chat-style with special tokens
        turns = []
        for _ in range(rng.randint(1, 6)):
            turns.append(f"<|im_start|>{rng.choice(['system', 'user', 'assistant'])}\n{_prose(rng, rng.randint(5, 60))}"
                         f"<|im_end|>\n")
        return "".join(turns) + rng.choice(["<|endoftext|>", "<|im_sta", "<|", "", "<|endoftext|><|endoftext|>"])
    return "".join(rng.choice(EMOJI) + rng.choice(["", " ", "\n", "a", "1"]) for _ in range(rng.randint(5, 80)))


def make_corpus(seed: int, target: int = TARGET_BYTES) -> list[str]:
    rng = random.Random(seed)
    docs, total = [], 0
    while total < target:
        d = _doc(rng)
        docs.append(d)
        total += len(d.encode("utf-8"))
    return docs


# ---------------------------------------------------------------------------------
# Trained tokenizers.


def _train(pre_tokenizer, normalizer, texts, vocab_size: int, specials=SPECIALS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([ADDED_NORMALIZED, ADDED_RAW])
    return tok


@pytest.fixture(scope="module")
def train_texts():
    return make_corpus(seed=1234, target=300_000)


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory, train_texts):
    from tokenizers import Regex, normalizers, pre_tokenizers

    pt = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok = _train(pt, normalizers.NFC(), train_texts, 4000)
    d = tmp_path_factory.mktemp("qwen")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>",
                                                         "pad_token": "<|endoftext|>"}))
    return d / "tokenizer.json"


@pytest.fixture(scope="module")
def gpt2_style(tmp_path_factory, train_texts):
    from tokenizers import pre_tokenizers

    tok = _train(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None, train_texts, 3000)
    d = tmp_path_factory.mktemp("gpt2")
    tok.save(str(d / "tokenizer.json"))
    return d / "tokenizer.json"


@pytest.fixture(scope="module")
def llama3_style(tmp_path_factory, qwen_style):
    tj = json.loads(qwen_style.read_text(encoding="utf-8"))
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = LLAMA3_PATTERN
    tj["model"]["ignore_merges"] = True
    tj["normalizer"] = None
    d = tmp_path_factory.mktemp("llama3")
    (d / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    return d / "tokenizer.json"


def assert_same_ids(got: list[list[int]], want: list[list[int]], label: str, piece) -> None:
    """Every document's ids equal; else name the first differing document and position,
    with the reference's pieces around it."""
    bad = [i for i in range(len(want)) if got[i] != want[i]]
    if bad:
        i = bad[0]
        k = next(j for j in range(min(len(got[i]), len(want[i])) + 1)
                 if j >= len(got[i]) or j >= len(want[i]) or got[i][j] != want[i][j])
        raise AssertionError(f"{label}: {len(bad)} of {len(want)} documents differ; first doc {i} at id {k}: "
                             f"C {got[i][max(0, k - 3):k + 3]} reference {want[i][max(0, k - 3):k + 3]} "
                             f"{[piece(x) for x in want[i][max(0, k - 3):k + 3]]}")


def _pair(path: Path):
    from tokenizers import Tokenizer

    section, meta = build_bpe_tokenizer_section(path)
    return Tokenizer.from_file(str(path)), colibri_lab.Tokenizer.from_section_bytes(section), meta


# ---------------------------------------------------------------------------------
# Parity.


def _reference(hf, docs):
    """HF's ids and decoded texts of docs. With COLIBRI_TEST_REF_CACHE (a folder) they are
    read from, or written to, a file named by the tokenizer and the corpus: the sanitized run of
    these tests (test_sanitizers.py) takes them from an unsanitized run of the same tests, so
    only the engine runs under the sanitizers (HF's tokenizer is many times slower there)."""
    cache = os.environ.get("COLIBRI_TEST_REF_CACHE")
    path = None
    if cache:
        key = hashlib.sha256(hf.to_str().encode("utf-8") + b"\0" + "\0".join(docs).encode("utf-8")).hexdigest()
        path = Path(cache) / f"{key[:32]}.json"
        if path.exists():
            ref = json.loads(path.read_text(encoding="utf-8"))
            return ref["ids"], ref["decoded"]
    want = [e.ids for e in hf.encode_batch(docs, add_special_tokens=False)]
    decoded = hf.decode_batch(want, skip_special_tokens=True)
    if path is not None:
        path.write_text(json.dumps({"ids": want, "decoded": decoded}), encoding="utf-8")
    return want, decoded


def _parity(hf, ct, seed: int, label: str, extra_docs=()):
    docs = make_corpus(seed) + list(extra_docs)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    want, hf_dec = _reference(hf, docs)
    data = [d.encode("utf-8") for d in docs]
    got = [ct.encode(d, add_bos=False) for d in data]
    assert_same_ids(got, want, label, hf.id_to_token)
    bad_dec = [i for i in range(len(docs)) if ct.decode_bytes(want[i]).decode("utf-8") != hf_dec[i]]
    assert not bad_dec, f"{label}: decode differs for {len(bad_dec)} documents (first {bad_dec[0]})"
    return n_bytes


def test_qwen_style_parity(qwen_style):
    hf, ct, meta = _pair(qwen_style)
    assert meta["tokenizer.type"] == "byte_level_bpe" and meta["tokenizer.pattern"] == "qwen2"
    assert meta["tokenizer.normalizer"] == "NFC"
    assert _parity(hf, ct, 1, "qwen2+NFC") >= 1_000_000


def test_gpt2_style_parity(gpt2_style):
    hf, ct, meta = _pair(gpt2_style)
    assert meta["tokenizer.pattern"] == "gpt2" and meta["tokenizer.normalizer"] == "none"
    assert _parity(hf, ct, 2, "gpt2") >= 1_000_000


def test_llama3_style_parity(llama3_style):
    hf, ct, meta = _pair(llama3_style)
    assert meta["tokenizer.pattern"] == "llama3"
    _parity(hf, ct, 3, "llama3+ignore_merges")


# ---------------------------------------------------------------------------------
# gpt-oss (OpenAI o200k_base split pattern, pattern id 5).

GPTOSS_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                   "<|end|>", "<|message|>", "<|call|>"]
O200K_WORDS = ["CamelCase", "camelCase", "HTTPServer", "XMLHttpRequest", "iPhone", "McDonald", "ABCdef", "aBC",
               "getHTTPResponseCode", "ǅungla", "ǈubljana", "ΣΊΣΥΦΟΣ", "Σίσυφος", "ПРИВЕТмир", "МирПРИВЕТ",
               "नमस्ते", "क्षत्रिय", "हिन्दी", "ञ्ज", "e\u0301te\u0301", "E\u0301TE\u0301", "\u0301\u0301x",
               "ʰʲ", "ʰa", "Aʰ", "ﬁﬂ", "ǅǅ", "Ⅻx", "x²", "中文Abc", "かなKANA", "가나다Abc"]
O200K_SUFFIXES = ["'s", "'S", "'t", "'T", "'re", "'RE", "'Re", "'rE", "'ve", "'VE", "'m", "'M", "'ll", "'LL", "'Ll",
                  "'lL", "'d", "'D", "'ſ", "n't", "N'T", "'", "''s", "'x", "'llama", "'sup", "'Dare"]
O200K_PUNCT = ["/", "//", "./", "../", "!/", "?\r\n", ".\n", ",\r\n\r\n", "://", " /", " //x", "-->", " ...",
               "'\n", "\"/", "(/)", "[\r/\n]", " ¿", "«»", "—/", "💡/", "©/"]


def _o200k_doc(rng: random.Random) -> str:
    if rng.random() < 0.15:  # a gpt-oss (harmony) chat
        turns = []
        for _ in range(rng.randint(1, 5)):
            role = rng.choice(["system", "developer", "user", "assistant"])
            chan = f"<|channel|>{rng.choice(['analysis', 'final', 'commentary'])}" if role == "assistant" else ""
            turns.append(f"<|start|>{role}{chan}<|message|>{_prose(rng, rng.randint(5, 40))}"
                         f"{rng.choice(['<|end|>', '<|return|>', '<|call|>'])}")
        return "".join(turns) + rng.choice(["", "<|start|>assistant", "<|sta", "<|end|><|end|>", "<|endoftext|>"])
    parts = []
    for _ in range(rng.randint(20, 200)):
        r = rng.random()
        if r < 0.3:
            w = rng.choice(O200K_WORDS + WORDS)
            w = w.upper() if rng.random() < 0.15 else w
            parts.append(w + (rng.choice(O200K_SUFFIXES) if rng.random() < 0.5 else ""))
        elif r < 0.45:
            parts.append(rng.choice(CONTRACTIONS))
        elif r < 0.6:
            parts.append("".join(rng.choice("0123456789") for _ in range(rng.randint(1, 7))))
        elif r < 0.72:
            parts.append(rng.choice(O200K_PUNCT))
        elif r < 0.8:
            parts.append(rng.choice(SCRIPTS + EMOJI))
        elif r < 0.85:
            parts.append(rng.choice(GPTOSS_SPECIALS))
        elif r < 0.92:
            parts.append(_rand_ws(rng))
        else:
            parts.append(rng.choice(["\r\n", "\n\n", " \r\n ", "\t\n", "  \n", "\r", "٣٤٥", "１２３４"]))
        if rng.random() < 0.6:
            parts.append(rng.choice([" ", " ", "", "\n", ", "]))
    return "".join(parts)


def _o200k_docs(seed: int, target: int) -> list[str]:
    rng = random.Random(seed)
    docs, total = [], 0
    while total < target:
        d = _o200k_doc(rng)
        docs.append(d)
        total += len(d.encode("utf-8"))
    return docs


@pytest.fixture(scope="module")
def gptoss_style(tmp_path_factory, train_texts):
    from tokenizers import Regex, pre_tokenizers

    pt = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
                                  pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    repo_text = [(REPO / "colibri_lab" / "conversion" / "bpe.py").read_text(encoding="utf-8"),
                 (REPO / "docs" / "format.md").read_text(encoding="utf-8")]
    tok = _train(pt, None, train_texts + repo_text + _o200k_docs(99, 100_000), 5000, specials=GPTOSS_SPECIALS)
    d = tmp_path_factory.mktemp("gptoss")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                                                         "pad_token": "<|endoftext|>"}))
    return d / "tokenizer.json"


def test_gptoss_style_parity(gptoss_style):
    tj = json.loads(gptoss_style.read_text(encoding="utf-8"))
    pt = tj["pre_tokenizer"]["pretokenizers"]  # the structure gpt-oss's tokenizer.json has
    assert pt[0] == {"type": "Split", "pattern": {"Regex": O200K_PATTERN}, "behavior": "Isolated", "invert": False}
    assert pt[1] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    hf, ct, meta = _pair(gptoss_style)
    assert meta["tokenizer.pattern"] == "o200k" and meta["tokenizer.normalizer"] == "none"
    vocab = hf.get_vocab()
    assert meta["tokenizer.eos_id"] == vocab["<|return|>"] and meta["tokenizer.bos_id"] == vocab["<|startoftext|>"]
    fixed = ["don't DON'T Don'T we'Re THEY'VE she'LL it'ſ x'ſt CamelCase'S HTTPServer'LL", "getHTTPResponseCode",
             "1 12 123 1234 12345 123456 1234567", "a/b//c ./x !/ ?\r\n\r\n", "  \r\n \n\n\t x  y   ",
             "नमस्ते क्षत्रिय e\u0301te\u0301 ΣΊΣΥΦΟΣ's", "<|start|>user<|message|>Hi<|end|><|start|>assistant"]
    n = _parity(hf, ct, 5, "o200k", extra_docs=fixed + _o200k_docs(6, 400_000))
    assert n >= 1_400_000
    for text in fixed:  # round trips
        ids = ct.encode(text.encode("utf-8"), add_bos=False)
        assert ids == hf.encode(text, add_special_tokens=False).ids
        assert ct.decode_bytes(ids).decode("utf-8") == hf.decode(ids, skip_special_tokens=True)
        assert ct.decode_bytes(ids).decode("utf-8") == "".join(
            t for t in _split_specials(text) if t not in GPTOSS_SPECIALS)
    assert ct.encode(b"hi", add_bos=True) == [vocab["<|startoftext|>"]] + hf.encode("hi", add_special_tokens=False).ids


def _split_specials(text: str) -> list[str]:
    import re

    return [t for t in re.split("(" + "|".join(re.escape(s) for s in GPTOSS_SPECIALS) + ")", text) if t]


# ---------------------------------------------------------------------------------
# DeepSeek-V3 (a sequence of three splits, pattern id 6).

DSV3_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
                 "<think>", "</think>"]
DSV3_BITS = ["中文字符", "日本語のテキスト", "カタカナ", "ひらがな", "龥龦", "㐀𠀀", "々〆", "ー", "・", "ゝゞ", "ヽヾ",
             "한국어", ".Hello", "..Hi", "$USD", "@user", "#tag", "_private", "`code`", "{x}", "[a]", "\\n", "x.y.z",
             "é.é", ".é", " .x", "(1+2)*3", "a1b2c3", "١٢٣٤", "Ⅻx", "x²³", "\u0301a", "a\u0301", " \u0301",
             "\x00a", "\x00\x00a", "\u200db", "\u200d\u200d", "\x7f", "\ue000x", "¿Qué?", "«x»", "€5", "🙂x", "x🙂",
             "\r\n\r\n", " \n ", "a\r\n", "!!\r\n", "'s", "'S", "don't", "HTTPServer", "ΣΊΣΥΦΟΣ", "नमस्ते"]


def _split_sequence(splits):
    """A tokenizer.json pre-tokenizer of Isolated splits in sequence, then ByteLevel without
    its regex (DeepSeek's files, llama.cpp's default)."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
                                    for r in splits]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])


def _dsv3_doc(rng: random.Random) -> str:
    if rng.random() < 0.15:
        turns = "".join(f"<｜User｜>{_prose(rng, rng.randint(3, 30))}<｜Assistant｜><think>{_prose(rng, 10)}</think>"
                        f"{_prose(rng, rng.randint(3, 30))}<｜end▁of▁sentence｜>" for _ in range(rng.randint(1, 4)))
        return "<｜begin▁of▁sentence｜>" + turns
    if rng.random() < 0.5:
        return _o200k_doc(rng)
    return "".join(rng.choice(DSV3_BITS) + rng.choice(["", "", " ", "\n", ", ", "1", "12345"])
                   for _ in range(rng.randint(20, 200)))


@pytest.fixture(scope="module")
def dsv3_style(tmp_path_factory, train_texts):
    from tokenizers import normalizers

    pt = _split_sequence(DEEPSEEK_V3_SPLITS)
    rng = random.Random(77)
    tok = _train(pt, normalizers.Sequence([]), train_texts + [_dsv3_doc(rng) for _ in range(300)], 5000,
                 specials=DSV3_SPECIALS)
    d = tmp_path_factory.mktemp("dsv3")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<｜begin▁of▁sentence｜>",
                                                         "eos_token": "<｜end▁of▁sentence｜>",
                                                         "pad_token": "<｜▁pad▁｜>"}))
    return d / "tokenizer.json"


def test_dsv3_style_parity(dsv3_style):
    tj = json.loads(dsv3_style.read_text(encoding="utf-8"))
    assert tj["normalizer"] == {"type": "Sequence", "normalizers": []}
    pts = tj["pre_tokenizer"]["pretokenizers"]  # the structure DeepSeek-V3's tokenizer.json has
    assert [p["pattern"]["Regex"] for p in pts[:3]] == list(DEEPSEEK_V3_SPLITS)
    assert all(p["type"] == "Split" and p["behavior"] == "Isolated" and p["invert"] is False for p in pts[:3])
    assert pts[3] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    hf, ct, meta = _pair(dsv3_style)
    assert meta["tokenizer.pattern"] == "deepseek_v3" and meta["tokenizer.normalizer"] == "none"
    vocab = hf.get_vocab()
    assert meta["tokenizer.bos_id"] == vocab["<｜begin▁of▁sentence｜>"]
    rng = random.Random(8)
    extra = DSV3_BITS + [_dsv3_doc(rng) for _ in range(1500)]
    assert _parity(hf, ct, 7, "deepseek_v3", extra_docs=extra) >= 1_400_000
    for text in DSV3_BITS + ["<｜User｜>你好，世界！123456<｜Assistant｜>"]:
        ids = ct.encode(text.encode("utf-8"), add_bos=False)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert ct.decode_bytes(ids).decode("utf-8") == hf.decode(ids, skip_special_tokens=True)


def test_dsv3_refusals(tmp_path, dsv3_style):
    base = json.loads(dsv3_style.read_text(encoding="utf-8"))
    for mut in (lambda pts: pts.pop(1), lambda pts: pts[1]["pattern"].update(Regex="[一-龥]+"),
                lambda pts: pts.insert(0, pts[0])):
        tj = json.loads(json.dumps(base))
        mut(tj["pre_tokenizer"]["pretokenizers"])
        p = tmp_path / "tokenizer.json"
        p.write_text(json.dumps(tj), encoding="utf-8")
        with pytest.raises(ValueError, match="sequence of .* pre-tokenizer splits"):
            build_bpe_tokenizer_section(p)


# ---------------------------------------------------------------------------------
# DeepSeek-LLM / DeepSeek-V2 (a sequence of six splits, pattern id 7).

# the edges of its classes: letters in and out of split 2's ranges (U+01BB, U+0294 out; the
# Greek extended, Ohm and Kelvin signs in, by code point, not NFC), split 3's ASCII letters,
# fullwidth forms and U+3000 (both \s and punctuation), trailing whitespace, Hangul and the
# U+0800..U+4E00 stretch, numbers of other scripts
DSLLM_BITS = ["\u01bb\u01c5\u0294\u0295", "\u1f7d\u03ce", "\u2126\u03a9", "\u212aK", "\u1fbe\u03b9", "µm", "ǅungla",
              "ΣΊΣΥΦΟΣ", "Привет", "Ǆ", "ＡＢＣ！", "Ｆ１２", "“quoted”", "‘x’", "…", "\u3000x", "x\u3000", " \u3000.",
              "\u3000\u3000", "。、", "한국어", "ࠀࡀ", "㐀", "龥龦", "カタカナ", "ひらがな", "नमस्ते", "مرحبا", "١٢٣", "²³",
              "Ⅻx", "🙂x", "x🙂", "👩\u200d💻", "a  ", "a \t", "a\u00a0", " ", "\t\t", "\r\n\r\n", " \n ", "a\r\nb",
              "!!\r\n", "x.y", " .x", "$USD", "@user", "don't", "I'M", "12345", "3.14159", "a1b2", "_x_", "`y`"]


def _dsllm_doc(rng: random.Random) -> str:
    if rng.random() < 0.4:
        return _dsv3_doc(rng)
    return "".join(rng.choice(DSLLM_BITS) + rng.choice(["", "", " ", "  ", "\n", ", ", "1", "12345", "\t"])
                   for _ in range(rng.randint(20, 200)))


@pytest.fixture(scope="module")
def dsllm_style(tmp_path_factory, train_texts):
    from tokenizers import normalizers

    pt = _split_sequence(DEEPSEEK_LLM_SPLITS)
    rng = random.Random(79)
    tok = _train(pt, normalizers.Sequence([]), train_texts + [_dsllm_doc(rng) for _ in range(300)], 5000,
                 specials=DSV3_SPECIALS)
    d = tmp_path_factory.mktemp("dsllm")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<｜begin▁of▁sentence｜>",
                                                         "eos_token": "<｜end▁of▁sentence｜>"}))
    return d / "tokenizer.json"


def test_dsllm_style_parity(dsllm_style):
    tj = json.loads(dsllm_style.read_text(encoding="utf-8"))
    pts = tj["pre_tokenizer"]["pretokenizers"]  # the structure DeepSeek-V2's tokenizer.json has
    assert [p["pattern"]["Regex"] for p in pts[:6]] == list(DEEPSEEK_LLM_SPLITS)
    hf, ct, meta = _pair(dsllm_style)
    assert meta["tokenizer.pattern"] == "deepseek_llm" and meta["tokenizer.normalizer"] == "none"
    rng = random.Random(9)
    extra = DSLLM_BITS + [_dsllm_doc(rng) for _ in range(1500)]
    assert _parity(hf, ct, 10, "deepseek_llm", extra_docs=extra) >= 1_400_000
    for text in DSLLM_BITS + ["<｜User｜>你好，世界！123456<｜Assistant｜>", "trailing\t \u3000", "\n\n\n"]:
        ids = ct.encode(text.encode("utf-8"), add_bos=False)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert ct.decode_bytes(ids).decode("utf-8") == hf.decode(ids, skip_special_tokens=True)


def test_dsllm_refusals(tmp_path, dsllm_style):
    """A sequence that is not exactly DeepSeek-LLM's six splits is refused, naming both supported."""
    base = json.loads(dsllm_style.read_text(encoding="utf-8"))
    for mut in (lambda pts: pts.pop(3), lambda pts: pts[4]["pattern"].update(Regex="[一-龥]+"),
                lambda pts: pts.insert(0, pts[0])):
        tj = json.loads(json.dumps(base))
        mut(tj["pre_tokenizer"]["pretokenizers"])
        p = tmp_path / "tokenizer.json"
        p.write_text(json.dumps(tj), encoding="utf-8")
        with pytest.raises(ValueError, match="sequence of .* pre-tokenizer splits.*deepseek_v3.*deepseek_llm"):
            build_bpe_tokenizer_section(p)


# llama.cpp's "default" pre-tokenizer: what each of its four splits cuts (punctuation and
# $+<=>^~| runs, GPT-2's pieces, number runs, three ASCII digits at a time)
LDF_BITS = ["12345678", " 1234567", "x=12345;", "a+b<=c>d^e~f|g", "$$$100", "¿¡…—–“”«»", "(1,234.5678)",
            "٣٤٥٦٧", "¹²³⁴", "Ⅻ1234", "१२३४५", "\u3000。、！", "a\n\nb", " \t x", "don't 'll 'S",
            "`tick`", "#1 @2 %3 &4 *5", "x__y--z", "..\r\n", "  12  345  ", "emoji🙂123🙂", "x\u00a0\u00a0y",
            "π=3.14159265358979", "0x1F600", "🙂!!🙂"]


def _ldf_doc(rng: random.Random) -> str:
    if rng.random() < 0.4:
        return _dsv3_doc(rng)
    return "".join(rng.choice(LDF_BITS + DSLLM_BITS) + rng.choice(["", "", " ", "  ", "\n", ", ", "1", "12345", "\t"])
                   for _ in range(rng.randint(20, 200)))


@pytest.fixture(scope="module")
def llama_default_style(tmp_path_factory, train_texts):
    from tokenizers import normalizers

    pt = _split_sequence(LLAMA_DEFAULT_SPLITS)
    rng = random.Random(83)
    tok = _train(pt, normalizers.Sequence([]), train_texts + [_ldf_doc(rng) for _ in range(300)], 5000)
    d = tmp_path_factory.mktemp("llama_default")
    tok.save(str(d / "tokenizer.json"))
    return d / "tokenizer.json"


def test_llama_default_style_parity(llama_default_style):
    """llama.cpp's "default" pre-tokenizer (a GGUF naming it or no pre-tokenizer): pattern 9,
    byte for byte tokenizers' ids with its four splits in sequence."""
    hf, ct, meta = _pair(llama_default_style)
    assert meta["tokenizer.pattern"] == "llama_default" and meta["tokenizer.normalizer"] == "none"
    rng = random.Random(11)
    extra = LDF_BITS + DSLLM_BITS + [_ldf_doc(rng) for _ in range(1500)]
    assert _parity(hf, ct, 12, "llama_default", extra_docs=extra) >= 1_400_000
    for text in LDF_BITS + ["", "1", "12", "123", "1234", " ", "\n", "!"]:
        ids = ct.encode(text.encode("utf-8"), add_bos=False)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text


def test_special_ids_and_add_bos(qwen_style, gpt2_style):
    hf, ct, meta = _pair(qwen_style)
    vocab = hf.get_vocab()
    assert meta["tokenizer.bos_id"] == -1  # tokenizer_config.json: bos_token null
    assert meta["tokenizer.eos_id"] == vocab["<|im_end|>"] and meta["tokenizer.pad_id"] == vocab["<|endoftext|>"]
    assert meta["tokenizer.special_source"] == "tokenizer_config.json"
    assert ct.bos_id == -1
    assert ct.vocab_size == hf.get_vocab_size()
    # add_bos without a BOS token is a no-op
    assert ct.encode("hello world", add_bos=True) == ct.encode("hello world", add_bos=False) == hf.encode("hello world").ids
    assert ct.encode("", add_bos=True) == []
    hf2, ct2, meta2 = _pair(gpt2_style)  # no tokenizer_config.json: well-known names
    eot = hf2.get_vocab()["<|endoftext|>"]
    assert meta2["tokenizer.eos_id"] == eot and meta2["tokenizer.bos_id"] == -1
    assert ct2.encode("hi", add_bos=True) == hf2.encode("hi").ids
    for i in (0, 100, eot, hf.get_vocab_size() - 1):
        assert ct.piece_bytes(i).decode("utf-8") == hf.id_to_token(i)


def test_invalid_utf8_and_random_decode(qwen_style):
    hf, ct, _ = _pair(qwen_style)
    rng = random.Random(7)
    pool = [b"\x80", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xed\xa0\x80", b"\xc0\xaf", b"\xff", b"\xf4\x90\x80\x80",
            "é".encode(), b"a", b" ", b"\n", "中".encode(), b"<|im_end|>", "😀".encode()]
    for _ in range(300):
        data = b"".join(rng.choice(pool) for _ in range(rng.randint(1, 30)))
        assert ct.encode(data, add_bos=False) == hf.encode(data.decode("utf-8", "replace"), add_special_tokens=False).ids, data
    n = hf.get_vocab_size()
    for _ in range(300):  # arbitrary id sequences: partial UTF-8, specials
        ids = [rng.randrange(n) for _ in range(rng.randint(0, 40))]
        assert ct.decode_bytes(ids).decode("utf-8") == hf.decode(ids, skip_special_tokens=True), ids


def test_refusals(tmp_path, qwen_style):
    base = json.loads(qwen_style.read_text(encoding="utf-8"))

    def build(mut):
        tj = json.loads(json.dumps(base))
        mut(tj)
        p = tmp_path / "tokenizer.json"
        p.write_text(json.dumps(tj), encoding="utf-8")
        return build_bpe_tokenizer_section(p)

    with pytest.raises(ValueError, match="unsupported pre-tokenizer split pattern.*gpt2.*qwen2.*llama3"):
        build(lambda tj: tj["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\p{L}+|\s+"))
    with pytest.raises(ValueError, match="normalizer"):
        build(lambda tj: tj.update(normalizer={"type": "NFKC"}))
    with pytest.raises(ValueError, match="lstrip"):
        build(lambda tj: tj["added_tokens"][0].update(lstrip=True))
    with pytest.raises(ValueError, match="add_prefix_space"):
        build(lambda tj: tj["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True))
    with pytest.raises(ValueError, match="tiktoken"):
        build(lambda tj: (tj.clear(), tj.update(config={"pattern": "x"}, vocab=[])))


def test_corrupt_sections_refused(qwen_style):
    """Random byte flips and truncations: loading raises a ColibriError with a message, or
    the tokenizer loads and works (any other exception, or a crash, fails)."""
    section, _ = build_bpe_tokenizer_section(qwen_style)
    rng = random.Random(11)
    for _ in range(200):
        b = bytearray(section)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(b)) if rng.random() < 0.5 else rng.randrange(128)
            b[pos] = rng.randrange(256)
        try:
            t = colibri_lab.Tokenizer.from_section_bytes(b)
        except colibri_lab.ColibriError as e:
            assert e.message
            continue
        with t:  # a harmless change: it must still encode / decode without crashing
            t.decode_bytes(t.encode(b"Hello <|im_end|> world 123", add_bos=True))
    for cut in (0, 16, 127, 128, len(section) // 2, len(section) - 8):
        with pytest.raises(colibri_lab.ColibriError):
            colibri_lab.Tokenizer.from_section_bytes(section[:cut])


# ---------------------------------------------------------------------------------
# mistral-common tekken (tiktoken-style) vocabularies, against mistral-common's Tekkenizer.


def _tekken_files() -> list[Path]:
    try:
        import mistral_common
    except ImportError:
        return []
    return sorted((Path(mistral_common.__file__).parent / "data").glob("tekken_*.json"))


@pytest.mark.parametrize("path", _tekken_files(), ids=lambda p: p.name)
def test_tekken_parity(path):
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    section, meta = build_bpe_tokenizer_section(path)
    ct = colibri_lab.Tokenizer.from_section_bytes(section)
    tk = Tekkenizer.from_file(path)
    assert meta["tokenizer.pattern"] == "tekken" and meta["n_pieces"] == tk.n_words == ct.vocab_size
    assert (meta["tokenizer.bos_id"], meta["tokenizer.eos_id"], meta["tokenizer.unk_id"], meta["tokenizer.pad_id"]) == \
        (tk.bos_id, tk.eos_id, tk.unk_id, tk.pad_id)

    # the shared corpus, plus text spelling tekken's control tokens (never matched in text)
    docs = make_corpus(4) + ["<s>[INST] hello [/INST]</s><unk><pad>[TOOL_CALLS]<SPECIAL_999>", "[IMG]x<s>"]
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    want = [tk.encode(d, bos=False, eos=False) for d in docs]
    got = [ct.encode(d.encode("utf-8"), add_bos=False) for d in docs]
    assert_same_ids(got, want, path.name, tk.id_to_piece)
    bad_dec = [i for i in range(len(docs)) if ct.decode_bytes(want[i]).decode("utf-8") != tk.decode(want[i])]
    assert not bad_dec, f"{path.name}: decode differs for {len(bad_dec)} documents (first {bad_dec[0]})"
    assert ct.encode(b"Hello", add_bos=True) == tk.encode("Hello", bos=True, eos=False)

    # decode: special ids are skipped and end the UTF-8 run before them (Tekkenizer decodes
    # each run of non-special ids on its own); arbitrary id sequences with partial UTF-8
    ns = tk.num_special_tokens
    euro = [ns + b for b in "€".encode("utf-8")]
    assert ct.decode_bytes(euro).decode("utf-8") == tk.decode(euro) == "€"
    split = [euro[0], tk.bos_id, euro[1], euro[2]]
    assert ct.decode_bytes(split).decode("utf-8") == tk.decode(split) == "\ufffd\ufffd\ufffd"
    rng = random.Random(9)
    for _ in range(500):
        ids = [rng.choice([rng.randrange(tk.n_words), rng.randrange(ns), ns + rng.randrange(256)])
               for _ in range(rng.randint(0, 30))]
        assert ct.decode_bytes(ids).decode("utf-8") == tk.decode(ids), ids
    for i in (0, 1, 2, 11, ns - 1, ns, ns + 0xE2, ns + 300, tk.n_words - 1):
        assert ct.piece_bytes(i).decode("utf-8") == tk.id_to_piece(i), i
    assert n_bytes >= 1_000_000


def test_tekken_refusals(tmp_path):
    files = _tekken_files()
    if not files:
        pytest.skip("mistral-common is not installed")
    base = json.loads(files[0].read_text(encoding="utf-8"))

    def build(mut):
        tj = dict(base, config=dict(base["config"]))
        mut(tj)
        p = tmp_path / "tekken_test.json"
        p.write_text(json.dumps(tj), encoding="utf-8")
        return build_bpe_tokenizer_section(p)

    with pytest.raises(ValueError, match="tekken split pattern"):
        build(lambda tj: tj["config"].update(pattern=r"\p{L}+|\s+"))
    with pytest.raises(ValueError, match="special_tokens"):
        build(lambda tj: tj["config"].update(version="v13"))
    with pytest.raises(ValueError, match="default_vocab_size"):
        build(lambda tj: tj["config"].update(default_vocab_size=len(tj["vocab"]) + 2000))
