"""Build a byte-level BPE tokenizer section (GPT-2 / Qwen2 / Llama-3 style) from a Hugging
Face `tokenizer.json`, from a mistral-common tekken (tiktoken-style) `tekken_*.json`
(see _build_tekken: reproduces mistral_common's Tekkenizer), or from a tiktoken vocabulary
with its tokenizer class (`tiktoken.model`, Kimi's: see build_tiktoken_section).

The layout is specified in docs/format.md, "Tokenizer section encoding", "Byte-level BPE
(type 2)"; the C reader is native/src/tokenizer/bpe.c. Only what the engine implements
exactly is accepted; anything else is refused with a ValueError naming the reason:

* model: BPE over the ByteLevel alphabet (all 256 byte characters in the vocabulary), no
  dropout, no byte_fallback, no continuing_subword_prefix / end_of_word_suffix;
  `ignore_merges` is supported;
* normalizer: none, or NFC (alone or as the only member of a Sequence);
* pre-tokenizer: ByteLevel(add_prefix_space=False, use_regex=True) (the GPT-2 pattern), or
  Sequence([Split(Regex(P), "Isolated", invert=False), ByteLevel(add_prefix_space=False,
  use_regex=False)]) where P is one of SUPPORTED_PATTERNS (GPT-2, Qwen2, Llama-3, o200k, Kimi), or
  one of SPLIT_SEQUENCES (DeepSeek-V3's three Splits, DeepSeek-LLM / DeepSeek-V2's six, llama.cpp's default four) and
  ByteLevel(use_regex=False);
* decoder: ByteLevel;
* added tokens with lstrip / rstrip / single_word = false (those options are refused).

A tekken file must use mistral-common's split pattern (TEKKEN_PATTERN); others are refused.

The post-processor is not stored: `colibri_tokenize` reproduces
`Tokenizer.encode(text, add_special_tokens=False)`, with BOS prepended on request.
"""

from __future__ import annotations

import json
import os
import struct
import unicodedata

import numpy as np

__all__ = ["build_bpe_tokenizer_section", "build_tiktoken_section", "SUPPORTED_PATTERNS", "bytes_to_unicode"]

from .spm import HEADER_SIZE, SECTION_MAGIC, SECTION_VERSION  # the sub-header both types share

TYPE_BYTE_LEVEL_BPE = 2
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
# OpenAI o200k_base (tiktoken `pat_str`), as gpt-oss's tokenizer.json writes it
O200K_PATTERN = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
                 r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
                 r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
                 r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Moonshot's Kimi (K2; K2.5 and Linear too: `pat_str` of tokenization_kimi.py's TikTokenTokenizer): o200k's
# alternatives with Han runs split off first and taken out of the letter classes
KIMI_K2_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# pattern string -> (id in the section, name); id 4 is tekken (tekken_*.json only)
SUPPORTED_PATTERNS = {GPT2_PATTERN: (1, "gpt2"), QWEN2_PATTERN: (2, "qwen2"), LLAMA3_PATTERN: (3, "llama3"),
                      O200K_PATTERN: (5, "o200k"), KIMI_K2_PATTERN: (8, "kimi_k2")}
# DeepSeek-V3's tokenizer.json: three Isolated splits in sequence (each split applied to the
# pieces of the one before), then ByteLevel(use_regex=False). The \r\n inside the third regex's
# classes are the characters themselves, as the file writes them.
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^""" "\r\n" r"""\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+"""
    "[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
DEEPSEEK_V3_PATTERN_ID = 6
# DeepSeek-LLM's and DeepSeek-V2's tokenizer.json (llama.cpp's `deepseek-llm`): six Isolated
# splits in sequence, then ByteLevel(use_regex=False): [\r\n]; \s? and a class of cased letters
# of many scripts (written by code point here: the file's characters, not their NFC forms); \s?
# and ASCII / fullwidth / CJK punctuation (`:-~` holds the ASCII letters too); \s+$; CJK and
# Hangul; \p{N}+.
DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
    "\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)
DEEPSEEK_LLM_PATTERN_ID = 7
# llama.cpp's "default" BPE pre-tokenizer (LLAMA_VOCAB_PRE_TYPE_DEFAULT: a GGUF whose
# tokenizer.ggml.pre is "default" or missing): four splits in sequence, applied as
# DeepSeek's are (each regex's matches and the stretches between them are pieces): runs of
# punctuation and of $+<=>^~|; GPT-2's regex (without its last `\s+`, which changes no piece:
# the stretch it would match is a piece anyway); runs of numbers; three ASCII digits.
LLAMA_DEFAULT_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)""",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)
LLAMA_DEFAULT_PATTERN_ID = 9
# sequences of several Split regexes -> (id in the section, name)
SPLIT_SEQUENCES = {DEEPSEEK_V3_SPLITS: (DEEPSEEK_V3_PATTERN_ID, "deepseek_v3"),
                   DEEPSEEK_LLM_SPLITS: (DEEPSEEK_LLM_PATTERN_ID, "deepseek_llm"),
                   LLAMA_DEFAULT_SPLITS: (LLAMA_DEFAULT_PATTERN_ID, "llama_default")}
# mistral-common tekken_*.json (tiktoken `pat_str`)
TEKKEN_PATTERN = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"""
                  r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"""
                  r""" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
TEKKEN_PATTERN_ID = 4
FLAG_SPECIAL_SPLITS_DECODE = 1 << 2
# Kimi's tiktoken class encodes each stretch between special tokens in parts (every 400,000
# characters; runs of whitespace or of other characters longer than 25,000 cut)
FLAG_CHUNKED = 1 << 3
# mistral-common's Tekkenizer.DEPRECATED_SPECIAL_TOKENS: the control tokens of files without a
# "special_tokens" list (versions up to v7), ids 0..19
TEKKEN_DEPRECATED_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                              "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                              "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                              "[TOOL_CONTENT]"]

EMPTY64 = 0xFFFFFFFFFFFFFFFF
EMPTY32 = 0xFFFFFFFF
HASH_MUL = 0x9E3779B97F4A7C15


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
        if len(items) >= 2 and all(it.get("type") == "Split" for it in items[:-1]) \
                and items[-1].get("type") == "ByteLevel":
            regexes = []
            for sp in items[:-1]:
                pat = sp.get("pattern", {})
                if "Regex" not in pat:
                    raise ValueError(f"{path}: Split pre-tokenizer with a String pattern is not implemented (only Regex)")
                if sp.get("behavior") != "Isolated" or sp.get("invert", False):
                    raise ValueError(f"{path}: Split pre-tokenizer must have behavior Isolated and invert false "
                                     f"(got {sp.get('behavior')!r}, invert={sp.get('invert')!r})")
                regexes.append(pat["Regex"])
            _check_byte_level(items[-1], path, use_regex=False)
            if tuple(regexes) in SPLIT_SEQUENCES:
                return SPLIT_SEQUENCES[tuple(regexes)][0]
            if len(regexes) > 1:
                raise ValueError(f"{path}: unsupported sequence of {len(regexes)} pre-tokenizer splits {regexes!r}; "
                                 "the supported sequences are " +
                                 "; ".join(f"{name}: {list(seq)!r}" for seq, (_i, name) in SPLIT_SEQUENCES.items()))
            regex = regexes[0]
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


def _fnv1a64_many(data: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """FNV-1a-64 of the byte strings data[offs[i] : offs[i] + lens[i]], vectorised over i."""
    h = np.full(len(offs), 0xCBF29CE484222325, dtype=np.uint64)
    prime = np.uint64(0x100000001B3)
    for j in range(int(lens.max(initial=0))):
        act = np.nonzero(lens > j)[0]
        h[act] = (h[act] ^ data[offs[act] + j].astype(np.uint64)) * prime
    return h


def _place(hashes: np.ndarray, bits: int) -> np.ndarray:
    """Open addressing with linear probing, vectorised: the table (1 << bits slots) of indices
    into `hashes` (-1 = empty). In each round every unplaced key tries its current slot; of
    the keys that find the same free slot the first one takes it; the others, and the keys
    that found it taken, move one slot on. A key only moves past occupied slots, so probing
    from its home slot finds it (the layout differs from one-by-one insertion, which the
    format does not fix)."""
    size = 1 << bits
    table = np.full(size, -1, dtype=np.int64)
    with np.errstate(over="ignore"):
        pos = ((hashes * np.uint64(HASH_MUL)) >> np.uint64(64 - bits)).astype(np.int64)
    pending = np.arange(len(hashes), dtype=np.int64)
    while pending.size:
        p = pos[pending]
        free = table[p] < 0
        slots, first = np.unique(p[free], return_index=True)
        winners = pending[free][first]
        table[slots] = winners
        won = np.zeros(len(hashes), dtype=bool)
        won[winners] = True
        pending = pending[~won[pending]]
        pos[pending] = (pos[pending] + 1) & (size - 1)
    return table


def _write_section(path, piece_b: list[bytes], bytes_b: list[bytes], flags: list[int], m_left, m_right, m_rank,
                   m_merged, added_sorted: list[int], byte_ids: list[int], ids4, hflags: int, pattern: int) -> bytes:
    """The type-2 section (docs/format.md) of n tokens (strings, bytes, flags), the merges
    (parallel sequences: left id, right id, rank, merged id; each (left, right) once), the
    added-token list, the byte -> id table, (bos, eos, unk, pad), header flags and pattern id."""
    n = len(piece_b)
    for i in range(n):
        if len(piece_b[i]) > 0xFFFF or len(bytes_b[i]) > 0xFFFF:
            raise ValueError(f"{path}: token {i} is longer than 65535 bytes")
    n_merges = len(m_left)
    if n_merges > 0x7FFFFFFE:
        raise ValueError(f"{path}: too many merges")
    merge_bits = _bits_for(n_merges)
    keys = (np.asarray(m_left, dtype=np.uint64) << np.uint64(32)) | np.asarray(m_right, dtype=np.uint64)
    mslots = _place(keys, merge_bits)
    mtab = np.zeros(1 << merge_bits, dtype=[("key", "<u8"), ("rank", "<u4"), ("mid", "<u4")])
    mtab["key"] = EMPTY64
    used = mslots >= 0
    mtab["key"][used] = keys[mslots[used]]
    mtab["rank"][used] = np.asarray(m_rank, dtype=np.uint32)[mslots[used]]
    mtab["mid"][used] = np.asarray(m_merged, dtype=np.uint32)[mslots[used]]

    # blob: each token's string, then its bytes when they differ
    blob = bytearray()
    po = np.zeros(n, dtype=np.uint32)
    bo = np.zeros(n, dtype=np.uint32)
    for i in range(n):
        p = len(blob)
        po[i] = p
        blob += piece_b[i]
        if bytes_b[i] == piece_b[i]:
            bo[i] = p
        else:
            bo[i] = len(blob)
            blob += bytes_b[i]
        if len(blob) > 0xFFFFFFFF:
            raise ValueError(f"{path}: token strings exceed 4 GiB")
    blob_np = np.frombuffer(bytes(blob), dtype=np.uint8)
    flags_np = np.asarray(flags, dtype=np.uint8)
    blen = np.asarray([len(b) for b in bytes_b], dtype=np.int64)

    model_ids = np.nonzero(flags_np & TF_MODEL)[0]
    vbits = _bits_for(n)
    vh = _fnv1a64_many(blob_np, bo[model_ids].astype(np.int64), blen[model_ids])
    vslots = _place(vh, vbits)
    vtab = np.full(1 << vbits, EMPTY32, dtype="<u4")
    vtab[vslots >= 0] = model_ids[vslots[vslots >= 0]]

    tokens_off = HEADER_SIZE
    byte_ids_off = _align(tokens_off + n * TOKEN_RECORD_SIZE, 8)
    merges_off = _align(byte_ids_off + 256 * 4, 8)
    vhash_off = _align(merges_off + MERGE_RECORD_SIZE * len(mtab), 8)
    added_off = _align(vhash_off + 4 * len(vtab), 8)
    blob_off = _align(added_off + 4 * len(added_sorted), 8)
    total = _align(blob_off + len(blob), 8)

    out = bytearray(total)
    fmt = "<8sIIII iiii IIII QQQ II QQQQ Q"
    assert struct.calcsize(fmt) == HEADER_SIZE
    bos, eos, unk, pad = ids4
    struct.pack_into(fmt, out, 0, SECTION_MAGIC, SECTION_VERSION, TYPE_BYTE_LEVEL_BPE, HEADER_SIZE, n,
                     bos, eos, unk, pad, hflags, pattern, n_merges, merge_bits,
                     tokens_off, merges_off, vhash_off, vbits, len(added_sorted),
                     added_off, blob_off, len(blob), byte_ids_off, 0)
    rec = np.zeros(n, dtype=[("po", "<u4"), ("bo", "<u4"), ("pl", "<u2"), ("bl", "<u2"), ("fl", "u1"),
                             ("pad", "V3")])
    assert rec.dtype.itemsize == TOKEN_RECORD_SIZE and mtab.dtype.itemsize == MERGE_RECORD_SIZE
    rec["po"], rec["bo"], rec["fl"] = po, bo, flags_np
    rec["pl"] = [len(p) for p in piece_b]
    rec["bl"] = blen
    out[tokens_off:tokens_off + n * TOKEN_RECORD_SIZE] = rec.tobytes()
    struct.pack_into("<256i", out, byte_ids_off, *byte_ids)
    out[merges_off:merges_off + mtab.nbytes] = mtab.tobytes()
    out[vhash_off:vhash_off + vtab.nbytes] = vtab.tobytes()
    if added_sorted:
        struct.pack_into(f"<{len(added_sorted)}I", out, added_off, *added_sorted)
    out[blob_off:blob_off + len(blob)] = blob
    return bytes(out)


def _section_meta(ids4, n_pieces: int, pattern: str, normalizer: str, source: str) -> dict:
    """The metadata every byte-level BPE builder returns: (bos, eos, unk, pad) ids, the number of
    pieces, the pattern's name, the normalizer and where the special ids came from."""
    bos, eos, unk, pad = ids4
    return {"tokenizer.type": "byte_level_bpe", "tokenizer.bos_id": bos, "tokenizer.eos_id": eos,
            "tokenizer.unk_id": unk, "tokenizer.pad_id": pad, "n_pieces": n_pieces, "tokenizer.pattern": pattern,
            "tokenizer.normalizer": normalizer, "tokenizer.special_source": source}


def _rank_merges(tok_bytes: list[bytes], rank_of: dict[bytes, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tiktoken's byte-pair merging as ranked pair merges (left rank, right rank, rank): for
    every token of two or more bytes and every split of its bytes into two tokens (a, b), the
    merge (a, b) ranked by the token's rank. The pair-merge engine then merges, as tiktoken
    does, the adjacent pair whose concatenation has the lowest rank (leftmost on ties)."""
    m_left, m_right, m_rank = [], [], []
    get = rank_of.get
    for r, b in enumerate(tok_bytes):
        for k in range(1, len(b)):
            ra = get(b[:k])
            if ra is not None:
                rb = get(b[k:])
                if rb is not None:
                    m_left.append(ra)
                    m_right.append(rb)
                    m_rank.append(r)
    return (np.asarray(m_left, dtype=np.int64), np.asarray(m_right, dtype=np.int64),
            np.asarray(m_rank, dtype=np.int64))


def _build_tekken(path: str, tj: dict) -> tuple[bytes, dict]:
    """A mistral-common tekken_*.json (tiktoken ranks, base64 token bytes) as a type-2 section,
    reproducing mistral_common's Tekkenizer (encode(text, bos=False, eos=False), decode(ids)
    with the default IGNORE policy):

    * ids: the special tokens first (the file's "special_tokens" list, or for files without
      one, versions up to v7, Tekkenizer.DEPRECATED_SPECIAL_TOKENS), filled up to
      config.default_num_special_tokens with "<SPECIAL_{id}>"; then the vocabulary's ranks
      (id = rank + number of special tokens), cut to config.default_vocab_size ids;
    * merges: for every token of two or more bytes and every split of its bytes into two
      tokens (a, b), the merge (a, b) ranked by the token's rank: the pair-merge engine then
      merges, as tiktoken, the adjacent pair whose concatenation has the lowest rank (leftmost
      on ties); ignore_merges, as tiktoken looks a whole pre-token up first;
    * special tokens are special but not added: never matched in the text, skipped by decode,
      and (header flag bit 2) each run of non-special ids is decoded to UTF-8 on its own;
    * token strings: special tokens their name, others their bytes decoded as UTF-8 with
      U+FFFD for malformed parts (Tekkenizer.id_to_piece).
    """
    import base64

    cfg = tj.get("config") or {}
    pat = cfg.get("pattern")
    if pat != TEKKEN_PATTERN:
        raise ValueError(f"{path}: tiktoken / tekken split pattern {pat!r} is not implemented; the supported "
                         f"tekken pattern is {TEKKEN_PATTERN!r}")
    try:
        vocab_size = int(cfg["default_vocab_size"])
        n_special = int(cfg["default_num_special_tokens"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: tekken config lacks default_vocab_size / default_num_special_tokens ({e})") from None
    version = str(cfg.get("version", ""))
    specials = tj.get("special_tokens")
    if specials is None:
        vnum = int(version[1:]) if version[:1] == "v" and version[1:].isdigit() else None
        if vnum is None or vnum > 7:
            raise ValueError(f"{path}: tekken version {version!r} without a special_tokens list is not supported "
                             "(mistral-common uses its built-in list only up to v7)")
        names = list(TEKKEN_DEPRECATED_SPECIALS)
    else:
        names = []
        for k, t in enumerate(specials):
            if not isinstance(t, dict) or t.get("rank") != k or not isinstance(t.get("token_str"), str) or not t["token_str"]:
                raise ValueError(f"{path}: special token entry {k} is not {{rank: {k}, token_str: ...}}")
            names.append(t["token_str"])
    if len(set(names)) != len(names) or len(names) > n_special:
        raise ValueError(f"{path}: {len(names)} special tokens (not unique, or more than "
                         f"default_num_special_tokens = {n_special})")
    names += [f"<SPECIAL_{i}>" for i in range(len(names), n_special)]
    inner = vocab_size - n_special
    vocab = tj["vocab"]
    if inner < 256 or len(vocab) < inner:
        raise ValueError(f"{path}: default_vocab_size {vocab_size} with {n_special} special tokens needs "
                         f"{inner} vocabulary tokens (256..{len(vocab)})")
    if vocab_size > 0x7FFFFFFF:
        raise ValueError(f"{path}: {vocab_size} tokens")

    tok_bytes: list[bytes] = []
    for r, x in enumerate(vocab[:inner]):
        if not isinstance(x, dict) or x.get("rank") != r or "token_bytes" not in x:
            raise ValueError(f"{path}: vocabulary entry {r} is not {{rank: {r}, token_bytes: ...}}")
        tb = base64.b64decode(x["token_bytes"])
        if not tb or (r < 256 and tb != bytes([r])):
            raise ValueError(f"{path}: vocabulary rank {r} has bytes {tb!r} (ranks 0..255 must be the single bytes)")
        tok_bytes.append(tb)
    rank_of = {b: r for r, b in enumerate(tok_bytes)}
    if len(rank_of) != inner:
        raise ValueError(f"{path}: two vocabulary tokens have the same bytes")

    m_left, m_right, m_rank = _rank_merges(tok_bytes, rank_of)
    m_merged = m_rank + n_special  # ids of the merged tokens
    m_left, m_right = m_left + n_special, m_right + n_special

    piece_b = [nm.encode("utf-8") for nm in names] + \
        [b.decode("utf-8", "replace").encode("utf-8") for b in tok_bytes]
    bytes_b = [nm.encode("utf-8") for nm in names] + tok_bytes
    flags = [TF_SPECIAL] * n_special + [TF_MODEL] * inner
    ids = {nm: i for i, nm in enumerate(names)}
    ids4 = tuple(ids.get(nm, -1) for nm in ("<s>", "</s>", "<unk>", "<pad>"))
    out = _write_section(path, piece_b, bytes_b, flags, m_left, m_right, m_rank, m_merged, [],
                         [n_special + b for b in range(256)], ids4, FLAG_IGNORE_MERGES | FLAG_SPECIAL_SPLITS_DECODE,
                         TEKKEN_PATTERN_ID)
    return out, _section_meta(ids4, vocab_size, "tekken", "none", "tekken special tokens")


def build_bpe_tokenizer_section(path: str | os.PathLike, extra_flags: int = 0) -> tuple[bytes, dict]:
    """Read a Hugging Face `tokenizer.json` (or a tekken_*.json) and return (section bytes, metadata dict).

    The metadata has the keys of colibri_lab.conversion.spm.build_tokenizer_section's
    (tokenizer.type = "byte_level_bpe", tokenizer.bos_id / eos_id / unk_id / pad_id,
    n_pieces) plus "tokenizer.pattern" (gpt2 / qwen2 / llama3 / o200k / deepseek_v3 / deepseek_llm / kimi_k2 / llama_default), "tokenizer.normalizer"
    (none / NFC) and "tokenizer.special_source" (where bos/eos came from). For a tekken file
    the pattern is "tekken" and the special ids are those of <s>, </s>, <unk>, <pad>.
    `extra_flags`: header flag bits to set besides those the file implies (FLAG_CHUNKED for a
    GGUF of Kimi's vocabulary).

    BOS / EOS / PAD: from tokenizer_config.json beside tokenizer.json when it exists
    (bos_token, eos_token, pad_token; null there means none), else from well-known special
    tokens (BOS: <|begin_of_text|>, <s>, <|startoftext|>; EOS: <|end_of_text|>, </s>,
    <|endoftext|>), else -1. UNK: the model's unk_token, else -1.
    """
    path = os.fspath(path)
    with open(path, "r", encoding="utf-8") as f:
        tj = json.load(f)
    if "model" not in tj and "config" in tj and "vocab" in tj:
        return _build_tekken(path, tj)
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

    hflags = (FLAG_IGNORE_MERGES if ignore_merges else 0) | (FLAG_NFC if use_nfc else 0) | extra_flags
    ml = sorted(merge_map.items())
    out = _write_section(
        path, piece_b, bytes_b, [flags[i] for i in range(n)],
        [k[0] for k, _v in ml], [k[1] for k, _v in ml], [v[0] for _k, v in ml], [v[1] for _k, v in ml],
        sorted(added_ids, key=lambda i: (-len(piece_b[i]), i)), [vocab[b2u[b]] for b in range(256)],
        (bos, eos, unk, pad), hflags, pattern)

    pattern_name = {i: name for i, name in (*SUPPORTED_PATTERNS.values(), *SPLIT_SEQUENCES.values())}[pattern]
    return out, _section_meta((bos, eos, unk, pad), n, pattern_name, "NFC" if use_nfc else "none", source)


def _tiktoken_code_facts(folder: str, cfg: dict, path: str) -> tuple[str, int, str]:
    """(split pattern, number of reserved special ids, file) of the tokenizer class a tiktoken
    vocabulary comes with: the Python file tokenizer_config.json's auto_map names
    (tokenization_kimi.py's TikTokenTokenizer), read without running it: its `pat_str` (a
    string, or "|".join of a list of strings) and `num_reserved_special_tokens` (256 if
    absent)."""
    import ast

    auto = (cfg.get("auto_map") or {}).get("AutoTokenizer")
    ref = auto[0] if isinstance(auto, list) and auto else auto
    if not isinstance(ref, str) or "." not in ref:
        raise ValueError(f"{path}: a tiktoken vocabulary needs its tokenizer class (tokenizer_config.json "
                         "auto_map.AutoTokenizer, as Kimi's tokenization_kimi.TikTokenTokenizer) for its split "
                         "pattern; none is named")
    module = ref.split("--")[-1].rsplit(".", 1)[0]
    code_path = os.path.join(folder, module.replace(".", os.sep) + ".py")
    try:
        with open(code_path, "r", encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=code_path)
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the tokenizer class's file {code_path} for its split pattern "
                         f"({e})") from None

    def const(node):
        if isinstance(node, ast.Constant):
            return node.value
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
                and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
                and len(node.args) == 1 and isinstance(node.args[0], (ast.List, ast.Tuple))
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.args[0].elts)):
            return node.func.value.value.join(e.value for e in node.args[0].elts)
        return None

    pat, reserved = None, 256
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, const(node.value)
            if name == "pat_str" and isinstance(value, str):
                pat = value
            elif name == "num_reserved_special_tokens" and isinstance(value, int):
                reserved = value
    if pat is None:
        raise ValueError(f"{path}: {code_path} has no literal pat_str (the split pattern)")
    return pat, reserved, os.path.basename(code_path)


def build_tiktoken_section(path: str | os.PathLike) -> tuple[bytes, dict]:
    """A tiktoken vocabulary (`tiktoken.model`: one "base64(token bytes) rank" line per token,
    Kimi's) with the tokenizer_config.json and tokenizer class beside it, as a type-2 section
    reproducing the class's `encode(text)` (tiktoken, every special token allowed in the
    text) and `decode(ids, skip_special_tokens=True)`:

    * ids: the ranks (0 .. n - 1, every single byte among them), then the class's reserved
      special ids n .. n + num_reserved_special_tokens - 1, named by tokenizer_config.json's
      added_tokens_decoder or "<|reserved_token_{id}|>";
    * merges: as _rank_merges, with ignore_merges (tiktoken looks a whole pre-token up first);
    * the split pattern: the class's `pat_str`, one of SUPPORTED_PATTERNS (Kimi's is
      KIMI_K2_PATTERN); any other is refused by name;
    * special tokens are added and special: matched in the text (leftmost, the longest at a
      place), skipped by decode;
    * token strings: the GPT-2 byte-level spelling of the bytes (the class's
      convert_ids_to_tokens); BOS / EOS / PAD / UNK: tokenizer_config.json's bos_token
      ("[BOS]" if absent), eos_token ("[EOS]" if absent), pad_token, unk_token.

    * the class's parts (header flag bit 3): each stretch of text between special tokens is cut
      every 400,000 characters, and inside each chunk where a run of whitespace (Python's
      isspace) or of other characters passes 25,000 characters, and the parts are encoded apart,
      as the class's encode does (through `tokenizer(text)` and apply_chat_template, which split
      the special tokens off first).
    """
    import base64
    import binascii

    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    cfg = {}
    if os.path.exists(cfg_path):
        with open(cfg_path, "r", encoding="utf-8") as f:
            cfg = json.load(f)
    pat, n_reserved, code_file = _tiktoken_code_facts(folder, cfg, path)
    if pat not in SUPPORTED_PATTERNS:
        raise ValueError(f"{path}: tiktoken split pattern {pat!r} ({code_file}) is not implemented; supported "
                         f"patterns are {_pattern_name_list()}")
    pattern, pattern_name = SUPPORTED_PATTERNS[pat]

    rank_of: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for ln, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                if len(parts) != 2:
                    raise ValueError
                tb, r = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}: line {ln} is not 'base64(token) rank'") from None
            if not tb or tb in rank_of:
                raise ValueError(f"{path}: line {ln}: token {tb!r} is empty or appears twice")
            rank_of[tb] = r
    n = len(rank_of)
    tok_bytes: list[bytes] = [b""] * n
    for tb, r in rank_of.items():
        if not 0 <= r < n or tok_bytes[r]:
            raise ValueError(f"{path}: ranks are not 0..{n - 1}, each once (rank {r} of {tb!r})")
        tok_bytes[r] = tb
    missing = [b for b in range(256) if bytes([b]) not in rank_of]
    if missing:
        raise ValueError(f"{path}: the vocabulary lacks the single byte {missing[0]:#04x} ({len(missing)} missing)")
    if not 0 <= n_reserved <= 65536 or n + n_reserved > 0x7FFFFFFF:
        raise ValueError(f"{path}: {n} tokens and {n_reserved} reserved special ids")

    names = {i: f"<|reserved_token_{i}|>" for i in range(n, n + n_reserved)}
    for k, at in (cfg.get("added_tokens_decoder") or {}).items():
        i = int(k)
        if i not in names:
            raise ValueError(f"{path}: added token {i} of tokenizer_config.json is outside the special ids "
                             f"{n}..{n + n_reserved - 1}")
        content = at.get("content") if isinstance(at, dict) else None
        if not isinstance(content, str) or not content:
            raise ValueError(f"{path}: added token {i} of tokenizer_config.json has no content")
        names[i] = content
    special_ids = {nm: i for i, nm in names.items()}
    if len(special_ids) != len(names):
        raise ValueError(f"{path}: two special ids have the same name")

    m_left, m_right, m_rank = _rank_merges(tok_bytes, rank_of)
    b2u = bytes_to_unicode()
    piece_b = ["".join(b2u[x] for x in tb).encode("utf-8") for tb in tok_bytes] + \
        [names[i].encode("utf-8") for i in range(n, n + n_reserved)]
    bytes_b = tok_bytes + [names[i].encode("utf-8") for i in range(n, n + n_reserved)]
    flags = [TF_MODEL] * n + [TF_ADDED | TF_SPECIAL] * n_reserved
    ids4 = tuple(_token_id(cfg.get(key, default), special_ids)
                 for key, default in (("bos_token", "[BOS]"), ("eos_token", "[EOS]"), ("unk_token", None),
                                      ("pad_token", None)))
    out = _write_section(path, piece_b, bytes_b, flags, m_left, m_right, m_rank, m_rank,
                         sorted(range(n, n + n_reserved), key=lambda i: (-len(piece_b[i]), i)),
                         [rank_of[bytes([b])] for b in range(256)], ids4, FLAG_IGNORE_MERGES | FLAG_CHUNKED, pattern)
    source = "tokenizer_config.json" if os.path.exists(cfg_path) else "the class's defaults"
    return out, _section_meta(ids4, n + n_reserved, pattern_name, "none", source)
