"""Build a byte-level BPE tokenizer section (GPT-2 / Qwen2 / Llama-3 style) from a Hugging
Face `tokenizer.json`.

The layout is specified in docs/format.md, "Tokenizer section encoding", "Byte-level BPE
(type 2)"; the C reader is native/src/tokenizer_bpe.c. Only what the engine implements
exactly is accepted; anything else is refused with a ValueError naming the reason:

* model: BPE over the ByteLevel alphabet (all 256 byte characters in the vocabulary), no
  dropout, no byte_fallback, no continuing_subword_prefix / end_of_word_suffix;
  `ignore_merges` is supported;
* normalizer: none, or NFC (alone or as the only member of a Sequence);
* pre-tokenizer: ByteLevel(add_prefix_space=False, use_regex=True) (the GPT-2 pattern), or
  Sequence([Split(Regex(P), "Isolated", invert=False), ByteLevel(add_prefix_space=False,
  use_regex=False)]) where P is one of SUPPORTED_PATTERNS (GPT-2, Qwen2, Llama-3);
* decoder: ByteLevel;
* added tokens with lstrip / rstrip / single_word = false (those options are refused).

The post-processor is not stored: `colibri_tokenize` reproduces
`Tokenizer.encode(text, add_special_tokens=False)`, with BOS prepended on request.
"""

from __future__ import annotations

import json
import os
import struct
import unicodedata

__all__ = ["build_bpe_tokenizer_section", "SUPPORTED_PATTERNS", "bytes_to_unicode"]

SECTION_MAGIC = b"CBTOKEN\0"
SECTION_VERSION = 1
TYPE_BYTE_LEVEL_BPE = 2
HEADER_SIZE = 128
TOKEN_RECORD_SIZE = 16
MERGE_RECORD_SIZE = 16

FLAG_IGNORE_MERGES = 1 << 0
FLAG_NFC = 1 << 1

TF_MODEL, TF_ADDED, TF_SPECIAL, TF_NORMALIZED = 1, 2, 4, 8

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                 r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                  r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
# pattern string -> (id in the section, name)
SUPPORTED_PATTERNS = {GPT2_PATTERN: (1, "gpt2"), QWEN2_PATTERN: (2, "qwen2"), LLAMA3_PATTERN: (3, "llama3")}

EMPTY64 = 0xFFFFFFFFFFFFFFFF
EMPTY32 = 0xFFFFFFFF
HASH_MUL = 0x9E3779B97F4A7C15
M64 = 0xFFFFFFFFFFFFFFFF


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & M64
    return h


def _slot(h: int, bits: int) -> int:
    return ((h * HASH_MUL) & M64) >> (64 - bits)


def _bits_for(n: int) -> int:
    bits = 1
    while (1 << bits) < 2 * max(n, 1):
        bits += 1
    if bits > 31:
        raise ValueError("tokenizer.json: too many entries for a hash table")
    return bits


def _align(n: int, a: int) -> int:
    return n + (a - n % a) % a


def _pattern_name_list() -> str:
    return "; ".join(f"{name}: {p!r}" for p, (_i, name) in SUPPORTED_PATTERNS.items())


def _check_byte_level(pt: dict, path: str, use_regex: bool) -> None:
    if pt.get("add_prefix_space", False):
        raise ValueError(f"{path}: ByteLevel pre-tokenizer with add_prefix_space=true is not implemented")
    if bool(pt.get("use_regex", True)) != use_regex:
        raise ValueError(f"{path}: ByteLevel pre-tokenizer with use_regex={pt.get('use_regex', True)} is not supported here "
                         f"(expected use_regex={use_regex} in this position)")


def _parse_pre_tokenizer(pt, path: str) -> int:
    if pt is None:
        raise ValueError(f"{path}: no pre_tokenizer; only byte-level pre-tokenizers are implemented")
    t = pt.get("type")
    if t == "ByteLevel":
        _check_byte_level(pt, path, use_regex=True)
        return SUPPORTED_PATTERNS[GPT2_PATTERN][0]
    if t == "Sequence":
        items = pt.get("pretokenizers", [])
        if len(items) == 2 and items[0].get("type") == "Split" and items[1].get("type") == "ByteLevel":
            sp = items[0]
            pat = sp.get("pattern", {})
            if "Regex" not in pat:
                raise ValueError(f"{path}: Split pre-tokenizer with a String pattern is not implemented (only Regex)")
            if sp.get("behavior") != "Isolated" or sp.get("invert", False):
                raise ValueError(f"{path}: Split pre-tokenizer must have behavior Isolated and invert false "
                                 f"(got {sp.get('behavior')!r}, invert={sp.get('invert')!r})")
            _check_byte_level(items[1], path, use_regex=False)
            regex = pat["Regex"]
            if regex not in SUPPORTED_PATTERNS:
                raise ValueError(f"{path}: unsupported pre-tokenizer split pattern {regex!r}; "
                                 f"supported patterns are {_pattern_name_list()}")
            return SUPPORTED_PATTERNS[regex][0]
        if len(items) == 1 and items[0].get("type") == "ByteLevel":
            return _parse_pre_tokenizer(items[0], path)
    raise ValueError(f"{path}: pre_tokenizer {json.dumps(pt)[:200]} is not implemented; supported: "
                     "ByteLevel(add_prefix_space=false, use_regex=true), or Sequence([Split(Regex(P), Isolated), "
                     f"ByteLevel(add_prefix_space=false, use_regex=false)]) with P one of: {_pattern_name_list()}")


def _parse_normalizer(nm, path: str) -> bool:
    """True for NFC, False for none."""
    if nm is None:
        return False
    if nm.get("type") == "NFC":
        return True
    if nm.get("type") == "Sequence":
        items = nm.get("normalizers", [])
        if not items:
            return False
        if len(items) == 1:
            return _parse_normalizer(items[0], path)
    raise ValueError(f"{path}: normalizer {json.dumps(nm)[:200]} is not implemented (only none or NFC)")


def _token_id(name, vocab_all: dict[str, int]) -> int:
    if isinstance(name, dict):
        name = name.get("content")
    if not name:
        return -1
    return vocab_all.get(name, -1)


def build_bpe_tokenizer_section(path: str | os.PathLike) -> tuple[bytes, dict]:
    """Read a Hugging Face `tokenizer.json` and return (section bytes, metadata dict).

    The metadata has the keys of colibri_lab._spm.build_tokenizer_section's
    (tokenizer.type = "byte_level_bpe", tokenizer.bos_id / eos_id / unk_id / pad_id,
    n_pieces) plus "tokenizer.pattern" (gpt2 / qwen2 / llama3), "tokenizer.normalizer"
    (none / NFC) and "tokenizer.special_source" (where bos/eos came from).

    BOS / EOS / PAD: from tokenizer_config.json beside tokenizer.json when it exists
    (bos_token, eos_token, pad_token; null there means none), else from well-known special
    tokens (BOS: <|begin_of_text|>, <s>, <|startoftext|>; EOS: <|end_of_text|>, </s>,
    <|endoftext|>), else -1. UNK: the model's unk_token, else -1.
    """
    path = os.fspath(path)
    with open(path, "r", encoding="utf-8") as f:
        tj = json.load(f)
    if "model" not in tj and "config" in tj and "vocab" in tj:
        raise ValueError(f"{path}: a tiktoken-style (tekken) vocabulary, not a Hugging Face tokenizer.json; "
                         "tiktoken / tekken tokenizers are not implemented")
    model = tj.get("model") or {}
    if model.get("type", "BPE") != "BPE" or "merges" not in model:
        raise ValueError(f"{path}: model type {model.get('type')!r} is not BPE")
    if model.get("dropout") not in (None, 0, 0.0):
        raise ValueError(f"{path}: BPE dropout is not implemented")
    if model.get("byte_fallback"):
        raise ValueError(f"{path}: BPE byte_fallback is not implemented for byte-level BPE")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise ValueError(f"{path}: continuing_subword_prefix / end_of_word_suffix are not implemented")
    ignore_merges = bool(model.get("ignore_merges", False))
    pattern = _parse_pre_tokenizer(tj.get("pre_tokenizer"), path)
    use_nfc = _parse_normalizer(tj.get("normalizer"), path)
    dec = tj.get("decoder")
    if not dec or dec.get("type") != "ByteLevel":
        raise ValueError(f"{path}: decoder {json.dumps(dec)[:200]} is not implemented (only ByteLevel)")

    vocab: dict[str, int] = model["vocab"]
    b2u = bytes_to_unicode()
    u2b = {c: b for b, c in b2u.items()}

    pieces: dict[int, str] = {}
    flags: dict[int, int] = {}
    for s, i in vocab.items():
        if not isinstance(i, int) or i < 0 or i > 0x7FFFFFFE:
            raise ValueError(f"{path}: vocabulary id {i!r} of {s!r} is invalid")
        if i in pieces:
            raise ValueError(f"{path}: id {i} appears twice in the vocabulary")
        pieces[i] = s
        flags[i] = TF_MODEL if s and all(c in u2b for c in s) else 0
    for b in range(256):
        if b2u[b] not in vocab:
            raise ValueError(f"{path}: the vocabulary lacks the byte-level character {b2u[b]!r} (byte {b}); "
                             "only BPE over the full ByteLevel alphabet is implemented")

    added = tj.get("added_tokens") or []
    added_ids = []
    for at in added:
        i, content = at["id"], at["content"]
        for opt in ("lstrip", "rstrip", "single_word"):
            if at.get(opt, False):
                raise ValueError(f"{path}: added token {content!r} has {opt}=true, which is not implemented")
        if not content:
            raise ValueError(f"{path}: added token {i} is empty")
        if i in pieces and pieces[i] != content:
            raise ValueError(f"{path}: added token {content!r} has id {i}, which the vocabulary gives to {pieces[i]!r}")
        normalized = bool(at.get("normalized", not at.get("special", False)))
        if normalized and use_nfc and unicodedata.normalize("NFC", content) != content:
            raise ValueError(f"{path}: normalized added token {content!r} is not in NFC form (not implemented)")
        pieces.setdefault(i, content)
        flags[i] = flags.get(i, 0) | TF_ADDED | (TF_SPECIAL if at.get("special", False) else 0) | \
            (TF_NORMALIZED if normalized else 0)
        if i in added_ids:
            raise ValueError(f"{path}: added token id {i} appears twice")
        added_ids.append(i)
    contents = [pieces[i] for i in added_ids]
    if len(set(contents)) != len(contents):
        raise ValueError(f"{path}: two added tokens have the same content")

    n = max(pieces) + 1
    missing = [i for i in range(n) if i not in pieces]
    if missing:
        raise ValueError(f"{path}: token ids are not contiguous (no token for id {missing[0]}, {len(missing)} holes)")
    if n > 0x7FFFFFFF:
        raise ValueError(f"{path}: {n} tokens")

    def token_bytes(s: str) -> bytes:
        # what the ByteLevel decoder makes of one token: its characters mapped back to bytes
        # when all of them are in the alphabet, else the token's own UTF-8
        if all(c in u2b for c in s):
            return bytes(u2b[c] for c in s)
        return s.encode("utf-8")

    piece_b = [pieces[i].encode("utf-8") for i in range(n)]
    bytes_b = [token_bytes(pieces[i]) for i in range(n)]
    for i in range(n):
        if len(piece_b[i]) > 0xFFFF:
            raise ValueError(f"{path}: token {i} is longer than 65535 bytes")

    # Merges: (left id, right id) -> (rank, merged id); a later duplicate overrides (as tokenizers).
    merge_map: dict[tuple[int, int], tuple[int, int]] = {}
    for rank, m in enumerate(model["merges"]):
        if isinstance(m, str):
            parts = m.split(" ")
            if len(parts) != 2:
                raise ValueError(f"{path}: merge {m!r} is not two space-separated tokens")
            a, b = parts
        else:
            a, b = m
        if a not in vocab or b not in vocab:
            raise ValueError(f"{path}: merge {a!r} {b!r} uses a token missing from the vocabulary")
        if a + b not in vocab:
            raise ValueError(f"{path}: merge {a!r} {b!r} makes {a + b!r}, missing from the vocabulary")
        ia, ib = vocab[a], vocab[b]
        if not (flags[ia] & TF_MODEL and flags[ib] & TF_MODEL):
            continue  # not byte-level strings: can never apply
        merge_map[(ia, ib)] = (rank, vocab[a + b])
    if len(merge_map) > 0x7FFFFFFE:
        raise ValueError(f"{path}: too many merges")

    # ---- special ids
    vocab_all = dict(vocab)
    for i in added_ids:
        vocab_all[pieces[i]] = i
    cfg_path = os.path.join(os.path.dirname(path) or ".", "tokenizer_config.json")
    bos = eos = pad = -1
    if os.path.exists(cfg_path):
        with open(cfg_path, "r", encoding="utf-8") as f:
            cfg = json.load(f)
        bos = _token_id(cfg.get("bos_token"), vocab_all)
        eos = _token_id(cfg.get("eos_token"), vocab_all)
        pad = _token_id(cfg.get("pad_token"), vocab_all)
        source = "tokenizer_config.json"
    else:
        for name in ("<|begin_of_text|>", "<s>", "<|startoftext|>"):
            if name in vocab_all:
                bos = vocab_all[name]
                break
        for name in ("<|end_of_text|>", "</s>", "<|endoftext|>"):
            if name in vocab_all:
                eos = vocab_all[name]
                break
        source = "well-known special tokens"
    unk = vocab.get(model.get("unk_token") or "", -1) if model.get("unk_token") else -1

    # ---- tables
    merge_bits = _bits_for(len(merge_map))
    mtab = [(EMPTY64, 0, 0)] * (1 << merge_bits)
    mmask = (1 << merge_bits) - 1
    for (ia, ib), (rank, mid) in merge_map.items():
        key = (ia << 32) | ib
        s = _slot(key, merge_bits)
        while mtab[s][0] != EMPTY64:
            s = (s + 1) & mmask
        mtab[s] = (key, rank, mid)

    model_ids = [i for i in range(n) if flags[i] & TF_MODEL]
    vbits = _bits_for(n)
    vtab = [EMPTY32] * (1 << vbits)
    vmask = (1 << vbits) - 1
    for i in model_ids:
        s = _slot(fnv1a64(bytes_b[i]), vbits)
        while vtab[s] != EMPTY32:
            s = (s + 1) & vmask
        vtab[s] = i

    added_sorted = sorted(added_ids, key=lambda i: (-len(piece_b[i]), i))

    blob = bytearray()
    offs = []
    for i in range(n):
        po = len(blob)
        blob += piece_b[i]
        if bytes_b[i] == piece_b[i]:
            bo = po
        else:
            bo = len(blob)
            blob += bytes_b[i]
        offs.append((po, bo))
    if len(blob) > 0xFFFFFFFF:
        raise ValueError(f"{path}: token strings exceed 4 GiB")

    tokens_off = HEADER_SIZE
    byte_ids_off = _align(tokens_off + n * TOKEN_RECORD_SIZE, 8)
    merges_off = _align(byte_ids_off + 256 * 4, 8)
    vhash_off = _align(merges_off + MERGE_RECORD_SIZE * len(mtab), 8)
    added_off = _align(vhash_off + 4 * len(vtab), 8)
    blob_off = _align(added_off + 4 * len(added_sorted), 8)
    total = _align(blob_off + len(blob), 8)

    hflags = (FLAG_IGNORE_MERGES if ignore_merges else 0) | (FLAG_NFC if use_nfc else 0)
    out = bytearray(total)
    fmt = "<8sIIII iiii IIII QQQ II QQQQ Q"
    assert struct.calcsize(fmt) == HEADER_SIZE
    struct.pack_into(fmt, out, 0, SECTION_MAGIC, SECTION_VERSION, TYPE_BYTE_LEVEL_BPE, HEADER_SIZE, n,
                     bos, eos, unk, pad, hflags, pattern, len(merge_map), merge_bits,
                     tokens_off, merges_off, vhash_off, vbits, len(added_sorted),
                     added_off, blob_off, len(blob), byte_ids_off, 0)
    rec = struct.Struct("<IIHHB3x")
    for i in range(n):
        rec.pack_into(out, tokens_off + i * TOKEN_RECORD_SIZE, offs[i][0], offs[i][1], len(piece_b[i]),
                      len(bytes_b[i]), flags[i])
    struct.pack_into("<256i", out, byte_ids_off, *[vocab[b2u[b]] for b in range(256)])
    mrec = struct.Struct("<QII")
    for k, (key, rank, mid) in enumerate(mtab):
        mrec.pack_into(out, merges_off + k * MERGE_RECORD_SIZE, key, rank, mid)
    struct.pack_into(f"<{len(vtab)}I", out, vhash_off, *vtab)
    if added_sorted:
        struct.pack_into(f"<{len(added_sorted)}I", out, added_off, *added_sorted)
    out[blob_off:blob_off + len(blob)] = blob

    pattern_name = {v[0]: v[1] for v in SUPPORTED_PATTERNS.values()}[pattern]
    meta = {
        "tokenizer.type": "byte_level_bpe",
        "tokenizer.bos_id": bos,
        "tokenizer.eos_id": eos,
        "tokenizer.unk_id": unk,
        "tokenizer.pad_id": pad,
        "n_pieces": n,
        "tokenizer.pattern": pattern_name,
        "tokenizer.normalizer": "NFC" if use_nfc else "none",
        "tokenizer.special_source": source,
    }
    return bytes(out), meta
