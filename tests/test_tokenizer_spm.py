"""Parity of Colibri's C tokenizer (native/src/tokenizer/tokenizer.c) with the `sentencepiece` library.

Uses the real Mistral / Mixtral tokenizer (data/tokenizer.model.v1, else the copy in the
mistral-common wheel), turned into a tokenizer section by colibri_lab.conversion.spm, and compares
ids and decoded text with sentencepiece on more than 1 MB of seeded, varied text: Python
source, prose, CJK, emoji (ZWJ sequences, flags, skin tones), whitespace runs, digits,
control characters, many scripts, combining marks, and raw malformed UTF-8 bytes (the
sentencepiece Python binding accepts bytes, so those are compared exactly too).

The C tokenizer is used only through colibri_lab.Tokenizer (from_section_bytes, encode of
bytes, decode_bytes); its errors are ColibriError subclasses carrying the C message. The
raw C buffer protocol (COLIBRI_E_BUFFER_TOO_SMALL, NULL arguments) is tested in
native/tests/test_tokenizer.c.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import pytest

from colibri_lab import (
    ColibriError,
    ColibriFormatError,
    ColibriInvalidArgError,
    ColibriTokenRangeError,
    ColibriUnsupportedError,
    Tokenizer,
)
from colibri_lab.conversion.spm import build_tokenizer_section, read_model_specs

REPO = Path(__file__).resolve().parents[1]

spm = pytest.importorskip("sentencepiece")


def _model_path() -> Path:
    local = REPO / "data" / "tokenizer.model.v1"
    if local.exists():
        return local
    try:
        import mistral_common
    except ImportError:
        pytest.skip(f"{local} is missing and mistral-common (which also ships it) is not installed")
    p = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    if not p.exists():
        pytest.skip(f"{local} is missing and so is {p}")
    return p


def _parse_model(pb2, model_path: Path):
    """The model as sentencepiece's bundled protobuf classes read it; skips (naming the
    protobuf runtime) where that runtime cannot run the bundled sentencepiece_model_pb2."""
    try:
        m = pb2.ModelProto()
        m.ParseFromString(model_path.read_bytes())
    except Exception as e:  # protobuf runtime too old for the bundled pb2
        from importlib.metadata import PackageNotFoundError, version

        try:
            runtime = f"protobuf {version('protobuf')}"
        except PackageNotFoundError:
            runtime = "the installed protobuf runtime"
        pytest.skip(f"{runtime} cannot parse {model_path.name} with sentencepiece's bundled "
                    f"sentencepiece_model_pb2: {e}")
    return m


@pytest.fixture(scope="session")
def model_path() -> Path:
    return _model_path()


@pytest.fixture(scope="session")
def section(model_path) -> tuple[bytes, dict]:
    return build_tokenizer_section(model_path)


@pytest.fixture(scope="session")
def sp(model_path):
    return spm.SentencePieceProcessor(model_file=str(model_path))


@pytest.fixture(scope="session")
def ctok(section):
    with Tokenizer.from_section_bytes(section[0]) as t:
        yield t


# ---------------------------------------------------------------------------------
# The corpus: seeded, > 1 MB, as a list of documents (bytes).

_WORDS = ("the of and to in is was that for it with as his on be at by had are but from or have an they which "
          "one you were all we her she there been if more when will would who so no time people year way day man "
          "thing woman life child world school state family student group country problem hand part place case "
          "week company system program question work government number night point home water room mother area "
          "money story fact month lot right study book eye job word business issue side kind head house service "
          "friend father power hour game line end member law car city community name president team minute idea "
          "kid body information back parent face others level office door health person art war history party "
          "result change morning reason research girl guy moment air teacher force education tokenizer mixture "
          "experts inference engine colibri sentencepiece byte fallback naïve café résumé Zürich São Paulo").split()

_EMOJI = ["👨‍👩‍👧‍👦", "🏳️‍🌈", "👍🏽", "🇫🇷", "🇯🇵", "🧑‍💻", "👩🏿‍🚀", "❤️", "😀", "🙈", "🦜", "🐦",
          "🏴‍☠️", "👁️‍🗨️", "🧔🏻‍♂️", "⌚", "☕", "🀄", "🃏", "🫠"]

_SCRIPTS = [(0x0600, 0x06FF), (0x0400, 0x04FF), (0x0900, 0x097F), (0x0E00, 0x0E7F), (0x0370, 0x03FF),
            (0x0590, 0x05FF), (0x0530, 0x058F), (0x10A0, 0x10FF), (0x0980, 0x09FF), (0x0B80, 0x0BFF),
            (0x1100, 0x11FF), (0x1E00, 0x1EFF)]
_CJK = [(0x4E00, 0x9FFF), (0x3040, 0x309F), (0x30A0, 0x30FF), (0xAC00, 0xD7A3), (0x3000, 0x303F),
        (0xFF00, 0xFFEF)]


def _rand_chars(rng: random.Random, ranges, n: int) -> str:
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def _prose(rng: random.Random, n_words: int) -> str:
    out = []
    cap = True
    for _ in range(n_words):
        w = rng.choice(_WORDS)
        if cap:
            w = w[:1].upper() + w[1:]
            cap = False
        out.append(w)
        r = rng.random()
        if r < 0.08:
            out[-1] += "."
            cap = True
        elif r < 0.12:
            out[-1] += ","
        elif r < 0.13:
            out[-1] += rng.choice(["!", "?", ";", ":", "...", " —", "'s", ")"])
    return " ".join(out)


def _whitespace(rng: random.Random) -> str:
    return "".join(rng.choice([" ", "  ", "\t", "\n", "\r\n", "\u3000", "\u00a0", "    ", "\n\n", "\v", "\f"])
                   for _ in range(rng.randint(1, 6)))


def _digits(rng: random.Random) -> str:
    return rng.choice([str(rng.randint(0, 10 ** rng.randint(1, 12))), f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 6)}f}",
                       f"{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}",
                       f"{rng.randint(1, 12):02d}/{rng.randint(1, 28):02d}/{rng.randint(1900, 2100)}",
                       "0x%X" % rng.getrandbits(32), "1e-%d" % rng.randint(1, 30), "٣٤٥", "१२३", "１２３"])


def _controls(rng: random.Random) -> str:
    return "".join(chr(rng.choice(list(range(0x00, 0x20)) + [0x7F, 0x85, 0x200B, 0x200D, 0xFEFF, 0x2028]))
                   for _ in range(rng.randint(1, 8)))


def _combining(rng: random.Random) -> str:
    base = rng.choice("aeiouAEIOUnczsy")
    return base + "".join(chr(rng.randint(0x0300, 0x036F)) for _ in range(rng.randint(1, 4)))


def _odd_unicode(rng: random.Random) -> str:
    cands = ["\ufffd", "\u2581", "\u2581\u2581 \u2581", "\ue000", "\uffff", "\U0010FFFF", "\U0001F9FF", "\u0000",
             chr(rng.randint(0x10000, 0x10FFFF)), chr(rng.randint(0xE000, 0xFFFD)), "<s>", "</s>", "<unk>",
             "<0x41>", "▁▁▁▁", "ﬁ", "Å", "Å"]
    return rng.choice(cands)


def _invalid_bytes(rng: random.Random) -> bytes:
    cands = [b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xc2", b"\xe2\x82", b"\xe2\x28\xa1", b"\xed\xa0\x80",
             b"\xed\xbf\xbf", b"\xf0\x9f", b"\xf0\x9f\x98", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xf8\x88\x80\x80\x80",
             b"\xfe", b"\xff", b"\xe0\x80\xaf", b"\xf0\x80\x80\xaf", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x96",
             bytes([rng.randint(0x80, 0xFF) for _ in range(rng.randint(1, 6))])]
    return rng.choice(cands)


def _stdlib_sources(rng: random.Random, budget: int) -> list[bytes]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    rng.shuffle(files)
    docs, total = [], 0
    for p in files:
        try:
            data = p.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        # cut into chunks of a few KB at line boundaries, as a model would see them
        lines = data.splitlines(keepends=True)
        i = 0
        while i < len(lines) and total < budget:
            k = rng.randint(5, 120)
            chunk = b"".join(lines[i:i + k])
            i += k
            docs.append(chunk)
            total += len(chunk)
        if total >= budget:
            break
    return docs


def _mixed_doc(rng: random.Random) -> bytes:
    parts: list[bytes] = []
    if rng.random() < 0.3:
        parts.append(_whitespace(rng).encode())  # leading whitespace
    for _ in range(rng.randint(1, 30)):
        r = rng.random()
        if r < 0.30:
            s = _prose(rng, rng.randint(1, 40))
        elif r < 0.42:
            s = _rand_chars(rng, _CJK, rng.randint(1, 40))
        elif r < 0.50:
            s = "".join(rng.choice(_EMOJI) for _ in range(rng.randint(1, 6)))
        elif r < 0.60:
            s = _rand_chars(rng, _SCRIPTS, rng.randint(1, 30))
        elif r < 0.68:
            s = _whitespace(rng)
        elif r < 0.75:
            s = _digits(rng)
        elif r < 0.80:
            s = _controls(rng)
        elif r < 0.85:
            s = _combining(rng)
        elif r < 0.90:
            s = _odd_unicode(rng)
        elif r < 0.95:
            parts.append(_invalid_bytes(rng))
            continue
        else:
            s = rng.choice(["def f(x):\n    return x ** 2\n", "if (a && b) { c++; }", "SELECT * FROM t;",
                            "https://example.com/a?b=c&d=%20e", "mailto:someone@example.org", "C:\\Windows\\",
                            "[1, 2, 3]", "{\"k\": [true, null]}", "<div class=\"x\">", "$\\int_0^1 x\\,dx$"])
        parts.append(s.encode("utf-8", "surrogatepass"))
        if rng.random() < 0.5:
            parts.append(rng.choice([b" ", b"", b"\n", b"  "]))
    if rng.random() < 0.3:
        parts.append(_whitespace(rng).encode())  # trailing whitespace
    return b"".join(parts)


def build_corpus(seed: int = 20240607, target: int = 1_200_000) -> list[bytes]:
    rng = random.Random(seed)
    docs: list[bytes] = []
    docs += _stdlib_sources(rng, target // 3)
    docs += [_prose(rng, rng.randint(50, 600)).encode() for _ in range(150)]
    total = sum(map(len, docs))
    while total < target:
        d = _mixed_doc(rng)
        docs.append(d)
        total += len(d)
    # fixed edge cases
    docs += [b"", b" ", b"  ", b"\n", b"\t", b" Hello", b"Hello", b"Hello ", b"Hello  world", b"\xe2\x96\x81",
             b"\xe2\x96\x81Hello", b"\x00", b"\x80", b"a\x80b", b"\xff\xfe", "▁ ▁".encode(), b"1234567890",
             "   leading and trailing   ".encode(), "\u3000全角\u3000".encode(), b"\r\n\r\n"]
    rng.shuffle(docs)
    return docs


@pytest.fixture(scope="session")
def corpus() -> list[bytes]:
    docs = build_corpus()
    assert sum(map(len, docs)) >= 1_000_000
    return docs


def _sp_encode(sp, data: bytes) -> list[int]:
    return list(sp.encode(data))


# ---------------------------------------------------------------------------------
# Tests.


def test_section_metadata(section, sp):
    data, meta = section
    assert data[:8] == b"CBTOKEN\0"
    assert meta == {"tokenizer.type": "sentencepiece_bpe", "tokenizer.bos_id": sp.bos_id(),
                    "tokenizer.eos_id": sp.eos_id(), "tokenizer.unk_id": sp.unk_id(),
                    "tokenizer.pad_id": sp.pad_id(), "n_pieces": sp.get_piece_size()}
    assert meta["n_pieces"] == 32000 and meta["tokenizer.bos_id"] == 1 and meta["tokenizer.eos_id"] == 2


def test_spec_reader_matches_protobuf(model_path):
    pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    m = _parse_model(pb2, model_path)
    s = read_model_specs(model_path.read_bytes())
    assert s["model_type"] == m.trainer_spec.model_type
    assert s["byte_fallback"] == m.trainer_spec.byte_fallback
    assert s["add_dummy_prefix"] == m.normalizer_spec.add_dummy_prefix
    assert s["remove_extra_whitespaces"] == m.normalizer_spec.remove_extra_whitespaces
    assert s["escape_whitespaces"] == m.normalizer_spec.escape_whitespaces
    assert s["precompiled_charsmap"] == m.normalizer_spec.precompiled_charsmap
    assert s["normalizer_name"] == m.normalizer_spec.name == "identity"
    assert s["unk_surface"] == m.trainer_spec.unk_surface.encode()


def test_basic(ctok, sp):
    assert ctok.encode("Hello", add_bos=False) == [22557] == sp.encode("Hello")
    assert ctok.encode("Hello", add_bos=True) == [1, 22557]
    assert ctok.encode("", add_bos=False) == []
    assert ctok.encode("", add_bos=True) == [1]
    assert ctok.vocab_size == 32000
    assert ctok.bos_id == 1
    assert ctok.eos_id == 2
    assert ctok.piece_bytes(22557).decode() == "▁Hello" == sp.id_to_piece(22557)
    with pytest.raises(ColibriTokenRangeError) as ei:
        ctok.piece_bytes(32000)
    assert "32000" in ei.value.message


def test_encode_parity_per_document(ctok, sp, corpus):
    mismatches = []
    n_bytes = 0
    for i, doc in enumerate(corpus):
        n_bytes += len(doc)
        a, b = ctok.encode(doc, add_bos=False), _sp_encode(sp, doc)
        if a != b:
            mismatches.append((i, doc[:80], a[:20], b[:20]))
    print(f"\nencode parity: {len(corpus)} documents, {n_bytes} bytes, {len(mismatches)} mismatches")
    assert n_bytes >= 1_000_000
    assert not mismatches, mismatches[:5]


def test_encode_parity_per_line(ctok, sp, corpus):
    mismatches, n = [], 0
    for doc in corpus[:400]:
        for line in doc.split(b"\n"):
            n += 1
            if ctok.encode(line, add_bos=False) != _sp_encode(sp, line):
                mismatches.append(line[:80])
    assert n > 1000
    assert not mismatches, mismatches[:5]


def test_encode_parity_large_chunks(ctok, sp, corpus):
    blob = b"\n".join(corpus)
    assert len(blob) >= 1_000_000
    chunks = [blob[:300_000], blob[300_000:700_000], blob]
    for c in chunks:
        a, b = ctok.encode(c, add_bos=False), _sp_encode(sp, c)
        assert a == b, next(i for i, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y)


def test_decode_parity(ctok, sp, corpus):
    mismatches = []
    for doc in corpus:
        ids = _sp_encode(sp, doc)
        if ctok.decode_bytes(ids) != sp.decode(ids).encode("utf-8"):
            mismatches.append(doc[:80])
    assert not mismatches, mismatches[:5]


def test_decode_parity_random_ids(ctok, sp):
    """Arbitrary id sequences: control, unknown, byte pieces and '▁' pieces in every order."""
    rng = random.Random(7)
    n = sp.get_piece_size()
    special = [0, 1, 2, sp.piece_to_id("▁"), sp.piece_to_id("▁▁"), 22557] + list(range(3, 259))
    mismatches = []
    for _ in range(3000):
        ids = [rng.choice(special) if rng.random() < 0.6 else rng.randrange(n) for _ in range(rng.randint(0, 12))]
        if ctok.decode_bytes(ids) != sp.decode(ids).encode("utf-8"):
            mismatches.append(ids)
    assert not mismatches, mismatches[:5]


def test_invalid_utf8_does_not_crash_and_matches(ctok, sp):
    rng = random.Random(99)
    for _ in range(2000):
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
        ids = ctok.encode(data, add_bos=False)
        assert ids == _sp_encode(sp, data)
        assert ctok.decode_bytes(ids) == sp.decode(ids).encode("utf-8")
        # sentencepiece replaces each malformed byte by U+FFFD: decode gives the input with
        # malformed bytes replaced, and for well-formed input the round trip is exact
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text == text.lstrip(" "):
            assert ctok.decode_bytes(ids) == data


def test_errors_and_buffers(ctok, sp):
    """Errors are ColibriError subclasses with the C message; results longer than the
    binding's first buffer come back whole (the binding grows it on
    COLIBRI_E_BUFFER_TOO_SMALL; the C side of that is in native/tests/test_tokenizer.c)."""
    ids = ctok.encode(b"Hello world", add_bos=True)
    assert len(ids) == 3 and ids[0] == 1 and ids[1:] == sp.encode("Hello world")
    with pytest.raises(ColibriInvalidArgError):
        ctok.encode(None)
    with pytest.raises(ColibriTokenRangeError) as ei:
        ctok.decode_bytes([22557, 32000])
    assert "32000" in ei.value.message
    with pytest.raises(ColibriTokenRangeError):
        ctok.decode_bytes([-1])
    assert ctok.decode_bytes([22557]) == b"Hello"
    # more ids than bytes ('▁', then one U+FFFD piece per malformed byte)
    data = b"\x80" * 100
    ids = ctok.encode(data, add_bos=False)
    assert ids == _sp_encode(sp, data) and len(ids) > len(data)
    # more bytes than 8 per id ('▁Становништво' is 25 bytes)
    ids = [21160] * 50
    out = ctok.decode_bytes(ids)
    assert out == sp.decode(ids).encode("utf-8") and len(out) > 8 * len(ids)


def test_corrupt_sections_are_refused_or_safe(section):
    """Truncations and random byte flips: loading raises a ColibriError with a message, or
    the tokenizer loads and works (any other exception, or a crash, fails)."""
    data = section[0]
    rng = random.Random(3)
    for cut in [0, 1, 8, 64, 127, 128, 200, 4096, len(data) // 2, len(data) - 8]:  # the last < 8 bytes are padding
        with pytest.raises((ColibriFormatError, ColibriInvalidArgError)) as ei:
            Tokenizer.from_section_bytes(data[:cut])
        assert ei.value.message, cut
    n_loaded = 0
    for _ in range(300):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(0, 160) if rng.random() < 0.5 else rng.randrange(len(b))
            b[pos] = rng.getrandbits(8)
        try:
            t = Tokenizer.from_section_bytes(b)
        except ColibriError as e:
            assert isinstance(e, (ColibriFormatError, ColibriUnsupportedError)), repr(e)
            assert e.message
            continue
        n_loaded += 1
        with t:
            ids = t.encode("Hello wörld 😀 \x80 done", add_bos=False)
            t.decode_bytes(ids)
            t.decode_bytes(list(range(0, 300)))
    assert n_loaded > 0  # flips in score bytes or strings of unused regions still load


def test_builder_refuses_unsupported_models(model_path, tmp_path):
    pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    m = _parse_model(pb2, model_path)
    m1 = pb2.ModelProto()
    m1.CopyFrom(m)
    m1.trainer_spec.model_type = pb2.TrainerSpec.UNIGRAM
    p1 = tmp_path / "unigram.model"
    p1.write_bytes(m1.SerializeToString())
    with pytest.raises(ValueError, match="BPE"):
        build_tokenizer_section(p1)
    m2 = pb2.ModelProto()
    m2.CopyFrom(m)
    m2.normalizer_spec.name = "nmt_nfkc"
    m2.normalizer_spec.precompiled_charsmap = b"\x04\x00\x00\x00abcdxyz"
    p2 = tmp_path / "nfkc.model"
    p2.write_bytes(m2.SerializeToString())
    with pytest.raises(ValueError, match="normalizer"):
        build_tokenizer_section(p2)


def test_other_normalizer_flags_and_user_defined(model_path, tmp_path):
    """The same vocabulary with remove_extra_whitespaces, without dummy prefix, without byte
    fallback, and with user-defined and unused pieces: still byte-exact with sentencepiece."""
    pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    base = _parse_model(pb2, model_path)
    rng = random.Random(11)
    docs = [_mixed_doc(rng) for _ in range(150)] + [b"  a  b  ", b"   ", b"x", b"<us1> <us1><us1>x", b"\xe2\x96\x81 \x80",
                                                   b"the zz ab c ab  c qqq  qqq\xe2\x96\x81 \xe4\xb8\xad\xe6\x96\x87\xe5\xad\x97\xe5\x85\xb8ZZ"]
    variants = []
    m = pb2.ModelProto(); m.CopyFrom(base); m.normalizer_spec.remove_extra_whitespaces = True; variants.append(("rmws", m))
    m = pb2.ModelProto(); m.CopyFrom(base); m.normalizer_spec.add_dummy_prefix = False; variants.append(("noprefix", m))
    m = pb2.ModelProto(); m.CopyFrom(base); m.normalizer_spec.escape_whitespaces = False; variants.append(("noescape", m))
    m = pb2.ModelProto(); m.CopyFrom(base)
    m.trainer_spec.byte_fallback = False
    keep = [p for p in m.pieces if p.type != pb2.ModelProto.SentencePiece.BYTE]
    del m.pieces[:]
    m.pieces.extend(keep)
    variants.append(("nobytes", m))
    m = pb2.ModelProto(); m.CopyFrom(base)
    for i, p in enumerate(m.pieces):
        if p.type == pb2.ModelProto.SentencePiece.NORMAL and i % 7 == 0 and len(p.piece) > 1:
            p.type = pb2.ModelProto.SentencePiece.UNUSED
    for s in ["<us1>", "▁the▁zz", "ab c", "中文字典ZZ", "qqq▁", "<us1>x"]:
        np_ = m.pieces.add(); np_.piece = s; np_.score = 0.0; np_.type = pb2.ModelProto.SentencePiece.USER_DEFINED
    variants.append(("user+unused", m))
    for name, mp in variants:
        path = tmp_path / f"{name}.model"
        path.write_bytes(mp.SerializeToString())
        spx = spm.SentencePieceProcessor(model_file=str(path))
        with Tokenizer.from_section_bytes(build_tokenizer_section(path)[0]) as t:
            bad = [d[:60] for d in docs if t.encode(d, add_bos=False) != list(spx.encode(d))]
            assert not bad, (name, bad[:3])
            bad = [d[:60] for d in docs if t.decode_bytes(list(spx.encode(d))) != spx.decode(list(spx.encode(d))).encode()]
            assert not bad, (name, bad[:3])
            rr = random.Random(5)
            for _ in range(300):
                ids = [rr.randrange(spx.get_piece_size()) for _ in range(rr.randint(0, 8))]
                assert t.decode_bytes(ids) == spx.decode(ids).encode(), (name, ids)
