"""Parity of Colibri's C tokenizer (native/src/tokenizer.c) with the `sentencepiece` library.

Uses the real Mistral / Mixtral tokenizer (data/tokenizer.model.v1, else the copy in the
mistral-common wheel), turned into a tokenizer section by colibri_lab._spm, and compares
ids and decoded text with sentencepiece on more than 1 MB of seeded, varied text: Python
source, prose, CJK, emoji (ZWJ sequences, flags, skin tones), whitespace runs, digits,
control characters, many scripts, combining marks, and raw malformed UTF-8 bytes (the
sentencepiece Python binding accepts bytes, so those are compared exactly too).

The C library comes from colibri_lab._native when it is importable, else from the path in
$COLIBRI_LIB, else it is compiled here from native/src/tokenizer.c with the system C compiler.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

spm = pytest.importorskip("sentencepiece")

try:
    from colibri_lab._spm import build_tokenizer_section, read_model_specs  # noqa: E402
except ImportError:  # the package needs the full native library; _spm itself does not
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_colibri_spm", REPO / "colibri_lab" / "_spm.py")
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
    build_tokenizer_section, read_model_specs = _mod.build_tokenizer_section, _mod.read_model_specs

COLIBRI_OK = 0
COLIBRI_E_INVALID_ARG = 1
COLIBRI_E_FORMAT = 3
COLIBRI_E_UNSUPPORTED = 6
COLIBRI_E_TOKEN_RANGE = 8
COLIBRI_E_BUFFER_TOO_SMALL = 10


def _model_path() -> Path:
    local = REPO / "data" / "tokenizer.model.v1"
    if local.exists():
        return local
    mc = pytest.importorskip("mistral_common")
    p = Path(mc.__file__).parent / "data" / "tokenizer.model.v1"
    if not p.exists():
        pytest.skip("no tokenizer.model.v1 (neither data/ nor mistral-common)")
    return p


# ---------------------------------------------------------------------------------
# The C library.


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    c = ctypes
    lib.colibri_tokenizer_from_memory.argtypes = [c.c_void_p, c.c_uint64, c.POINTER(c.c_void_p), c.c_char_p,
                                                  c.c_size_t]
    lib.colibri_tokenizer_from_memory.restype = c.c_int
    lib.colibri_tokenizer_free.argtypes = [c.c_void_p]
    lib.colibri_tokenizer_free.restype = None
    lib.colibri_tokenizer_last_error.argtypes = [c.c_void_p]
    lib.colibri_tokenizer_last_error.restype = c.c_char_p
    for fn in ("colibri_tokenizer_vocab_size", "colibri_tokenizer_bos_id", "colibri_tokenizer_eos_id"):
        getattr(lib, fn).argtypes = [c.c_void_p]
        getattr(lib, fn).restype = c.c_int32
    lib.colibri_tokenize.argtypes = [c.c_void_p, c.c_char_p, c.c_uint64, c.c_int, c.POINTER(c.c_int32), c.c_int64,
                                     c.POINTER(c.c_int64)]
    lib.colibri_tokenize.restype = c.c_int
    lib.colibri_detokenize.argtypes = [c.c_void_p, c.POINTER(c.c_int32), c.c_int64, c.c_char_p, c.c_uint64,
                                       c.POINTER(c.c_uint64)]
    lib.colibri_detokenize.restype = c.c_int
    lib.colibri_token_piece.argtypes = [c.c_void_p, c.c_int32, c.POINTER(c.c_void_p), c.POINTER(c.c_uint64)]
    lib.colibri_token_piece.restype = c.c_int
    return lib


@pytest.fixture(scope="session")
def lib(tmp_path_factory) -> ctypes.CDLL:
    try:
        from colibri_lab import _native  # type: ignore

        for attr in ("lib", "_lib", "LIB"):
            cand = getattr(_native, attr, None)
            if isinstance(cand, ctypes.CDLL):
                return _declare(ctypes.CDLL(cand._name))  # own handle: our argtypes stay local
    except Exception:
        pass
    env = os.environ.get("COLIBRI_LIB")
    if env:
        return _declare(ctypes.CDLL(env))
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no colibri_lab._native, no $COLIBRI_LIB and no C compiler")
    out = tmp_path_factory.mktemp("cbtok") / "libcbtok.so"
    cmd = [cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
           f"-I{REPO / 'native' / 'include'}", f"-I{REPO / 'native' / 'src'}",
           str(REPO / "native" / "src" / "tokenizer.c"), str(REPO / "native" / "src" / "tokenizer_bpe.c"),
           str(REPO / "native" / "src" / "unicode_tables.c"), "-o", str(out), "-lm"]
    subprocess.run(cmd, check=True)
    return _declare(ctypes.CDLL(str(out)))


class CTok:
    """Minimal handle over the C tokenizer; keeps the section bytes alive."""

    def __init__(self, lib: ctypes.CDLL, section: bytes):
        self.lib = lib
        self._buf = ctypes.create_string_buffer(section, len(section))
        self.h = ctypes.c_void_p()
        err = ctypes.create_string_buffer(512)
        st = lib.colibri_tokenizer_from_memory(self._buf, len(section), ctypes.byref(self.h), err, 512)
        if st != COLIBRI_OK:
            raise RuntimeError(f"load failed ({st}): {err.value.decode()}")

    def close(self):
        if self.h:
            self.lib.colibri_tokenizer_free(self.h)
            self.h = ctypes.c_void_p()

    def error(self) -> str:
        return self.lib.colibri_tokenizer_last_error(self.h).decode("utf-8", "replace")

    def encode(self, data: bytes | str, add_bos: bool = False) -> list[int]:
        if isinstance(data, str):
            data = data.encode("utf-8")
        cap = len(data) + 8
        out = (ctypes.c_int32 * cap)()
        n = ctypes.c_int64()
        st = self.lib.colibri_tokenize(self.h, data, len(data), int(add_bos), out, cap, ctypes.byref(n))
        if st == COLIBRI_E_BUFFER_TOO_SMALL:
            cap = n.value
            out = (ctypes.c_int32 * cap)()
            st = self.lib.colibri_tokenize(self.h, data, len(data), int(add_bos), out, cap, ctypes.byref(n))
        if st != COLIBRI_OK:
            raise RuntimeError(f"tokenize failed ({st}): {self.error()}")
        return list(out[: n.value])

    def decode(self, ids: list[int]) -> bytes:
        arr = (ctypes.c_int32 * max(1, len(ids)))(*ids)
        cap = 16 * len(ids) + 16
        buf = ctypes.create_string_buffer(cap)
        n = ctypes.c_uint64()
        st = self.lib.colibri_detokenize(self.h, arr, len(ids), buf, cap, ctypes.byref(n))
        if st == COLIBRI_E_BUFFER_TOO_SMALL:
            cap = n.value
            buf = ctypes.create_string_buffer(cap)
            st = self.lib.colibri_detokenize(self.h, arr, len(ids), buf, cap, ctypes.byref(n))
        if st != COLIBRI_OK:
            raise RuntimeError(f"detokenize failed ({st}): {self.error()}")
        return buf.raw[: n.value]


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
def ctok(lib, section):
    t = CTok(lib, section[0])
    yield t
    t.close()


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
    try:
        m = pb2.ModelProto()
        m.ParseFromString(model_path.read_bytes())
    except Exception as e:  # protobuf runtime too old for the bundled pb2
        pytest.skip(f"protobuf cannot parse with the bundled pb2: {e}")
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
    assert ctok.encode("Hello") == [22557] == sp.encode("Hello")
    assert ctok.encode("Hello", add_bos=True) == [1, 22557]
    assert ctok.encode("") == []
    assert ctok.encode("", add_bos=True) == [1]
    lib = ctok.lib
    assert lib.colibri_tokenizer_vocab_size(ctok.h) == 32000
    assert lib.colibri_tokenizer_bos_id(ctok.h) == 1
    assert lib.colibri_tokenizer_eos_id(ctok.h) == 2
    p, n = ctypes.c_void_p(), ctypes.c_uint64()
    assert lib.colibri_token_piece(ctok.h, 22557, ctypes.byref(p), ctypes.byref(n)) == COLIBRI_OK
    assert ctypes.string_at(p, n.value).decode() == "▁Hello" == sp.id_to_piece(22557)
    assert lib.colibri_token_piece(ctok.h, 32000, ctypes.byref(p), ctypes.byref(n)) == COLIBRI_E_TOKEN_RANGE
    assert "32000" in ctok.error()


def test_encode_parity_per_document(ctok, sp, corpus):
    mismatches = []
    n_bytes = 0
    for i, doc in enumerate(corpus):
        n_bytes += len(doc)
        a, b = ctok.encode(doc), _sp_encode(sp, doc)
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
            if ctok.encode(line) != _sp_encode(sp, line):
                mismatches.append(line[:80])
    assert n > 1000
    assert not mismatches, mismatches[:5]


def test_encode_parity_large_chunks(ctok, sp, corpus):
    blob = b"\n".join(corpus)
    assert len(blob) >= 1_000_000
    chunks = [blob[:300_000], blob[300_000:700_000], blob]
    for c in chunks:
        a, b = ctok.encode(c), _sp_encode(sp, c)
        assert a == b, next(i for i, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y)


def test_decode_parity(ctok, sp, corpus):
    mismatches = []
    for doc in corpus:
        ids = _sp_encode(sp, doc)
        if ctok.decode(ids) != sp.decode(ids).encode("utf-8"):
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
        if ctok.decode(ids) != sp.decode(ids).encode("utf-8"):
            mismatches.append(ids)
    assert not mismatches, mismatches[:5]


def test_invalid_utf8_does_not_crash_and_matches(ctok, sp):
    rng = random.Random(99)
    for _ in range(2000):
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
        ids = ctok.encode(data)
        assert ids == _sp_encode(sp, data)
        assert ctok.decode(ids) == sp.decode(ids).encode("utf-8")
        # sentencepiece replaces each malformed byte by U+FFFD: decode gives the input with
        # malformed bytes replaced, and for well-formed input the round trip is exact
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text == text.lstrip(" "):
            assert ctok.decode(ids) == data


def test_errors_and_buffers(ctok):
    lib = ctok.lib
    out = (ctypes.c_int32 * 1)()
    n = ctypes.c_int64()
    st = lib.colibri_tokenize(ctok.h, b"Hello world", 11, 1, out, 1, ctypes.byref(n))
    assert st == COLIBRI_E_BUFFER_TOO_SMALL and n.value == 3 and out[0] == 1
    assert lib.colibri_tokenize(ctok.h, None, 5, 0, out, 1, ctypes.byref(n)) == COLIBRI_E_INVALID_ARG
    ids = (ctypes.c_int32 * 2)(22557, 32000)
    ln = ctypes.c_uint64()
    buf = ctypes.create_string_buffer(64)
    assert lib.colibri_detokenize(ctok.h, ids, 2, buf, 64, ctypes.byref(ln)) == COLIBRI_E_TOKEN_RANGE
    assert "32000" in ctok.error()
    ids = (ctypes.c_int32 * 1)(-1)
    assert lib.colibri_detokenize(ctok.h, ids, 1, buf, 64, ctypes.byref(ln)) == COLIBRI_E_TOKEN_RANGE
    ids = (ctypes.c_int32 * 1)(22557)
    assert lib.colibri_detokenize(ctok.h, ids, 1, buf, 3, ctypes.byref(ln)) == COLIBRI_E_BUFFER_TOO_SMALL
    assert ln.value == 5 and buf.raw[:3] == b"Hel"


def test_corrupt_sections_are_refused_or_safe(lib, section):
    """Truncations and random byte flips: load fails with a status, or loads and works."""
    data = section[0]
    rng = random.Random(3)
    h = ctypes.c_void_p()
    err = ctypes.create_string_buffer(256)
    for cut in [0, 1, 8, 64, 127, 128, 200, 4096, len(data) // 2, len(data) - 8]:  # the last < 8 bytes are padding
        buf = ctypes.create_string_buffer(data[:cut], max(cut, 1))
        st = lib.colibri_tokenizer_from_memory(buf, cut, ctypes.byref(h), err, 256)
        assert st in (COLIBRI_E_FORMAT, COLIBRI_E_INVALID_ARG), (cut, st)
        assert not h.value and err.value
    n_loaded = 0
    for _ in range(300):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(0, 160) if rng.random() < 0.5 else rng.randrange(len(b))
            b[pos] = rng.getrandbits(8)
        buf = ctypes.create_string_buffer(bytes(b), len(b))
        st = lib.colibri_tokenizer_from_memory(buf, len(b), ctypes.byref(h), err, 256)
        if st == COLIBRI_OK:
            n_loaded += 1
            t = CTok.__new__(CTok)
            t.lib, t._buf, t.h = lib, buf, h
            ids = t.encode("Hello wörld 😀 \x80 done")
            t.decode(ids)
            t.decode(list(range(0, 300)))
            t.close()
            h = ctypes.c_void_p()
        else:
            assert st in (COLIBRI_E_FORMAT, COLIBRI_E_UNSUPPORTED), st
            assert err.value
    assert n_loaded > 0  # flips in score bytes or strings of unused regions still load


def test_builder_refuses_unsupported_models(model_path, tmp_path):
    pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    try:
        m = pb2.ModelProto()
        m.ParseFromString(model_path.read_bytes())
    except Exception as e:
        pytest.skip(f"protobuf cannot parse with the bundled pb2: {e}")
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


def test_other_normalizer_flags_and_user_defined(lib, model_path, tmp_path):
    """The same vocabulary with remove_extra_whitespaces, without dummy prefix, without byte
    fallback, and with user-defined and unused pieces: still byte-exact with sentencepiece."""
    pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    try:
        base = pb2.ModelProto()
        base.ParseFromString(model_path.read_bytes())
    except Exception as e:
        pytest.skip(f"protobuf cannot parse with the bundled pb2: {e}")
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
        t = CTok(lib, build_tokenizer_section(path)[0])
        try:
            bad = [d[:60] for d in docs if t.encode(d) != list(spx.encode(d))]
            assert not bad, (name, bad[:3])
            bad = [d[:60] for d in docs if t.decode(list(spx.encode(d))) != spx.decode(list(spx.encode(d))).encode()]
            assert not bad, (name, bad[:3])
            rr = random.Random(5)
            for _ in range(300):
                ids = [rr.randrange(spx.get_piece_size()) for _ in range(rr.randint(0, 8))]
                assert t.decode(ids) == spx.decode(ids).encode(), (name, ids)
        finally:
            t.close()


def test_speed_report(ctok, sp, corpus):
    """Not a pass/fail criterion: prints encode MB/s of the C tokenizer and sentencepiece."""
    blob = b"\n".join(corpus)
    mb = len(blob) / 1e6

    def best(fn, reps=3):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    t_c_one = best(lambda: ctok.encode(blob))
    t_s_one = best(lambda: sp.encode(blob))
    t_c_docs = best(lambda: [ctok.encode(d) for d in corpus])
    t_s_docs = best(lambda: [sp.encode(d) for d in corpus])
    print(f"\nencode {mb:.2f} MB as one call: colibri {mb / t_c_one:.2f} MB/s, sentencepiece {mb / t_s_one:.2f} MB/s"
          f" (ratio {t_s_one / t_c_one:.2f}x)")
    print(f"encode {len(corpus)} documents: colibri {mb / t_c_docs:.2f} MB/s, sentencepiece {mb / t_s_docs:.2f} MB/s"
          f" (ratio {t_s_docs / t_c_docs:.2f}x)")
