"""Build the tokenizer section of a `.colibri` file from a SentencePiece `tokenizer.model`.

The layout is specified in docs/format.md, "Tokenizer section encoding"; the C reader is
native/src/tokenizer/tokenizer.c. Only what the engine's encoder implements is accepted: a BPE
model whose normalizer has no character map (the "identity" normalizer of the
Llama / Mistral / Mixtral tokenizers). Anything else is refused with a ValueError that
names the reason, so a converted file never tokenizes differently from `sentencepiece`.

`sentencepiece` itself loads the model (it validates the proto and gives the pieces,
scores, types and special ids); the few NormalizerSpec / TrainerSpec fields the encoder
needs are read by a minimal protobuf wire-format reader below, so that no particular
`protobuf` runtime version is required.
"""

from __future__ import annotations

import math
import os
import struct

__all__ = ["build_tokenizer_section", "read_model_specs", "SECTION_MAGIC"]

SECTION_MAGIC = b"CBTOKEN\0"
SECTION_VERSION = 1
TYPE_SENTENCEPIECE_BPE = 1
HEADER_SIZE = 128
PIECE_RECORD_SIZE = 12
NODE_RECORD_SIZE = 12

# Piece types (sentencepiece ModelProto.SentencePiece.Type, same numbers).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Sub-header flag bits.
FLAG_ADD_DUMMY_PREFIX = 1 << 0
FLAG_REMOVE_EXTRA_WHITESPACES = 1 << 1
FLAG_ESCAPE_WHITESPACES = 1 << 2
FLAG_BYTE_FALLBACK = 1 << 3

_MODEL_TYPES = {1: "UNIGRAM", 2: "BPE", 3: "WORD", 4: "CHAR"}
_MAX_PIECE_BYTES = 0xFFFF


# ---------------------------------------------------------------------------------
# Minimal protobuf wire-format reader (only what ModelProto needs).


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("tokenizer.model: truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("tokenizer.model: varint too long")


def _fields(buf: bytes):
    """Yield (field_number, wire_type, value) for one message; value is int or bytes."""
    pos = 0
    n = len(buf)
    while pos < n:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            val, pos = _varint(buf, pos)
        elif wire == 1:
            if pos + 8 > n:
                raise ValueError("tokenizer.model: truncated fixed64")
            val = buf[pos:pos + 8]
            pos += 8
        elif wire == 2:
            ln, pos = _varint(buf, pos)
            if pos + ln > n:
                raise ValueError("tokenizer.model: truncated length-delimited field")
            val = buf[pos:pos + ln]
            pos += ln
        elif wire == 5:
            if pos + 4 > n:
                raise ValueError("tokenizer.model: truncated fixed32")
            val = buf[pos:pos + 4]
            pos += 4
        else:
            raise ValueError(f"tokenizer.model: unsupported wire type {wire}")
        yield field, wire, val


def _last(buf: bytes, wanted: dict[int, str]) -> dict[str, object]:
    """Last occurrence of each wanted scalar field of a message (proto2 semantics)."""
    out: dict[str, object] = {}
    for field, _wire, val in _fields(buf):
        if field in wanted:
            out[wanted[field]] = val
    return out


def read_model_specs(data: bytes) -> dict[str, object]:
    """The TrainerSpec / NormalizerSpec fields the encoder depends on, with proto defaults.

    Field numbers are those of sentencepiece_model.proto.
    """
    trainer = b""
    normalizer = b""
    denormalizer = b""
    have_normalizer = False
    for field, wire, val in _fields(data):
        if wire != 2:
            continue
        if field == 2:
            trainer += val  # repeated occurrences of a message field merge
        elif field == 3:
            normalizer += val
            have_normalizer = True
        elif field == 5:
            denormalizer += val
    t = _last(trainer, {3: "model_type", 24: "treat_whitespace_as_suffix", 35: "byte_fallback",
                        44: "unk_surface"})
    nm = _last(normalizer, {1: "name", 2: "precompiled_charsmap", 3: "add_dummy_prefix",
                            4: "remove_extra_whitespaces", 5: "escape_whitespaces"})
    dn = _last(denormalizer, {1: "name", 2: "precompiled_charsmap"})
    return {
        "model_type": int(t.get("model_type", 1)),
        "treat_whitespace_as_suffix": bool(t.get("treat_whitespace_as_suffix", 0)),
        "byte_fallback": bool(t.get("byte_fallback", 0)),
        "unk_surface": bytes(t["unk_surface"]) if "unk_surface" in t
        else " \u2047 ".encode("utf-8"),
        "has_normalizer_spec": have_normalizer,
        "normalizer_name": bytes(nm.get("name", b"")).decode("utf-8", "replace"),
        "precompiled_charsmap": bytes(nm.get("precompiled_charsmap", b"")),
        "add_dummy_prefix": bool(nm.get("add_dummy_prefix", 1)),
        "remove_extra_whitespaces": bool(nm.get("remove_extra_whitespaces", 1)),
        "escape_whitespaces": bool(nm.get("escape_whitespaces", 1)),
        "denormalizer_charsmap": bytes(dn.get("precompiled_charsmap", b"")),
    }


# ---------------------------------------------------------------------------------
# Trie of the pieces.


def _build_trie(strings: list[bytes]):
    """Nodes in breadth-first order (root = 0, every child index > its parent's).

    Returns (node_ids, node_edge_begin, node_edge_count, edge_labels, edge_children).
    """
    children: list[dict[int, int]] = [{}]
    ids: list[int] = [-1]
    for pid, s in enumerate(strings):
        node = 0
        for b in s:
            nxt = children[node].get(b)
            if nxt is None:
                nxt = len(children)
                children[node][b] = nxt
                children.append({})
                ids.append(-1)
            node = nxt
        if ids[node] != -1:
            raise ValueError(f"tokenizer.model: piece {s!r} appears twice (ids {ids[node]} and {pid})")
        ids[node] = pid
    # Renumber breadth-first so that edges of one node are contiguous and sorted.
    order = [0]
    new_index = {0: 0}
    head = 0
    while head < len(order):
        old = order[head]
        head += 1
        for label in sorted(children[old]):
            child = children[old][label]
            new_index[child] = len(order)
            order.append(child)
    node_ids, edge_begin, edge_count, labels, kids = [], [], [], bytearray(), []
    for old in order:
        node_ids.append(ids[old])
        edge_begin.append(len(kids))
        edge_count.append(len(children[old]))
        for label in sorted(children[old]):
            labels.append(label)
            kids.append(new_index[children[old][label]])
    return node_ids, edge_begin, edge_count, bytes(labels), kids


PAIR_EMPTY = 0xFFFFFFFFFFFFFFFF
PAIR_HASH_MUL = 0x9E3779B97F4A7C15


def pair_key(c1: bytes, c2: bytes) -> int:
    """Key of two adjacent characters: their UTF-8 bytes as little-endian u32s, c1 high."""
    return (int.from_bytes(c1, "little") << 32) | int.from_bytes(c2, "little")


def pair_slot(key: int, bits: int) -> int:
    return ((key * PAIR_HASH_MUL) & 0xFFFFFFFFFFFFFFFF) >> (64 - bits)


def _build_pair_table(pieces: list[bytes], types: list[int]) -> tuple[int, list[int]]:
    """Open-addressing set of every pair of adjacent characters inside a mergeable piece
    (normal, user-defined, unused). A boundary between two characters whose pair is absent
    can never be crossed by a merge, which lets the encoder run BPE segment by segment."""
    keys = set()
    for s, t in zip(pieces, types):
        if t not in (NORMAL, USER_DEFINED, UNUSED):
            continue
        chars = [ch.encode("utf-8") for ch in s.decode("utf-8")]
        for a, b in zip(chars, chars[1:]):
            keys.add(pair_key(a, b))
    bits = 1
    while (1 << bits) < 2 * len(keys):
        bits += 1
    if bits > 30:
        raise ValueError("too many character pairs in the vocabulary")
    table = [PAIR_EMPTY] * (1 << bits)
    mask = (1 << bits) - 1
    for k in sorted(keys):
        i = pair_slot(k, bits)
        while table[i] != PAIR_EMPTY:
            i = (i + 1) & mask
        table[i] = k
    return bits, table


def _align(n: int, a: int) -> int:
    return n + (a - n % a) % a


def build_tokenizer_section(path: str | os.PathLike) -> tuple[bytes, dict]:
    """Read a SentencePiece `tokenizer.model` and return (section bytes, metadata dict).

    Raises ValueError for a model the engine's encoder does not implement exactly
    (not BPE, a normalizer with a character map, whitespace-as-suffix, duplicate pieces).
    """
    import sentencepiece as spm  # runtime dependency of the converter

    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read()
    specs = read_model_specs(data)

    if specs["model_type"] != 2:
        name = _MODEL_TYPES.get(specs["model_type"], str(specs["model_type"]))
        raise ValueError(f"{path}: SentencePiece model type is {name}; only BPE models are supported")
    if specs["precompiled_charsmap"]:
        raise ValueError(
            f"{path}: the normalizer '{specs['normalizer_name']}' has a precompiled character map; "
            "only the 'identity' normalizer (no character map) is implemented")
    if specs["denormalizer_charsmap"]:
        raise ValueError(f"{path}: a denormalizer with a character map is not implemented")
    if specs["treat_whitespace_as_suffix"]:
        raise ValueError(f"{path}: treat_whitespace_as_suffix=true is not implemented")

    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(data)
    except Exception as e:  # sentencepiece raises RuntimeError/OSError with its own message
        raise ValueError(f"{path}: sentencepiece cannot load this model: {e}") from e
    n = sp.get_piece_size()
    if n < 1 or n > 0x7FFFFFFF:
        raise ValueError(f"{path}: {n} pieces")

    pieces: list[bytes] = []
    types: list[int] = []
    scores: list[float] = []
    for i in range(n):
        s = sp.id_to_piece(i).encode("utf-8")
        if not s:
            raise ValueError(f"{path}: piece {i} is empty")
        if len(s) > _MAX_PIECE_BYTES:
            raise ValueError(f"{path}: piece {i} is longer than {_MAX_PIECE_BYTES} bytes")
        if sp.is_unknown(i):
            t = UNKNOWN
        elif sp.is_control(i):
            t = CONTROL
        elif sp.is_byte(i):
            t = BYTE
        elif sp.is_unused(i):
            t = UNUSED
        else:
            t = NORMAL  # NORMAL or USER_DEFINED; told apart from the proto below
        sc = float(sp.get_score(i))
        if math.isnan(sc):
            raise ValueError(f"{path}: piece {i} has a NaN score")
        pieces.append(s)
        types.append(t)
        scores.append(sc)

    # USER_DEFINED is not exposed by the processor: read the piece types from the proto.
    idx = 0
    for field, wire, val in _fields(data):
        if field == 1 and wire == 2:
            rec = _last(val, {3: "type"})
            if int(rec.get("type", NORMAL)) == USER_DEFINED:
                if idx >= n:
                    raise ValueError(f"{path}: more pieces in the proto than in the processor")
                if b"\0" in pieces[idx]:
                    raise ValueError(f"{path}: user-defined piece {idx} contains NUL")
                types[idx] = USER_DEFINED
            idx += 1
    if idx != n:
        raise ValueError(f"{path}: the proto has {idx} pieces, sentencepiece reports {n}")

    for i, t in enumerate(types):
        if t == BYTE:
            s = pieces[i]
            if not (len(s) == 6 and s.startswith(b"<0x") and s.endswith(b">")
                    and s[3:5] == s[3:5].upper() and all(c in b"0123456789ABCDEF" for c in s[3:5])):
                raise ValueError(f"{path}: byte piece {i} {s!r} is not of the form <0xXX>")

    unk_id = int(sp.unk_id())
    if unk_id < 0 or types[unk_id] != UNKNOWN:
        raise ValueError(f"{path}: the model has no unknown piece")
    bos_id, eos_id, pad_id = int(sp.bos_id()), int(sp.eos_id()), int(sp.pad_id())
    byte_ids = [int(sp.piece_to_id("<0x%02X>" % b)) for b in range(256)]

    node_ids, edge_begin, edge_count, labels, kids = _build_trie(pieces)
    pair_bits, pair_table = _build_pair_table(pieces, types)

    # String blob: pieces back to back, then the unknown surface.
    blob = bytearray()
    str_off = []
    for s in pieces:
        str_off.append(len(blob))
        blob += s
    unk_surface = specs["unk_surface"]
    unk_surface_off = len(blob)
    blob += unk_surface
    if len(blob) > 0xFFFFFFFF:
        raise ValueError(f"{path}: piece strings exceed 4 GiB")

    flags = 0
    if specs["add_dummy_prefix"]:
        flags |= FLAG_ADD_DUMMY_PREFIX
    if specs["remove_extra_whitespaces"]:
        flags |= FLAG_REMOVE_EXTRA_WHITESPACES
    if specs["escape_whitespaces"]:
        flags |= FLAG_ESCAPE_WHITESPACES
    if specs["byte_fallback"]:
        flags |= FLAG_BYTE_FALLBACK

    n_nodes = len(node_ids)
    n_edges = len(kids)
    pieces_off = HEADER_SIZE
    byte_ids_off = _align(pieces_off + n * PIECE_RECORD_SIZE, 8)
    nodes_off = _align(byte_ids_off + 256 * 4, 8)
    children_off = _align(nodes_off + n_nodes * NODE_RECORD_SIZE, 8)
    labels_off = _align(children_off + n_edges * 4, 8)
    pairs_off = _align(labels_off + n_edges, 8)
    blob_off = _align(pairs_off + 8 * len(pair_table), 8)
    total = _align(blob_off + len(blob), 8)

    out = bytearray(total)
    struct.pack_into(
        "<8sIIII iiii II QQQQQQQ II Q II",
        out, 0,
        SECTION_MAGIC, SECTION_VERSION, TYPE_SENTENCEPIECE_BPE, HEADER_SIZE, n,
        bos_id, eos_id, unk_id, pad_id,
        flags, n_nodes,
        pieces_off, byte_ids_off, nodes_off, children_off, labels_off, blob_off, len(blob),
        n_edges, pair_bits, pairs_off,
        unk_surface_off, len(unk_surface))
    assert struct.calcsize("<8sIIII iiii II QQQQQQQ II Q II") == HEADER_SIZE
    rec = struct.Struct("<IfHBB")
    for i in range(n):
        rec.pack_into(out, pieces_off + i * PIECE_RECORD_SIZE, str_off[i], scores[i], len(pieces[i]),
                      types[i], 0)
    struct.pack_into(f"<{256}i", out, byte_ids_off, *byte_ids)
    node = struct.Struct("<IIi")
    for k in range(n_nodes):
        node.pack_into(out, nodes_off + k * NODE_RECORD_SIZE, edge_begin[k], edge_count[k], node_ids[k])
    if n_edges:
        struct.pack_into(f"<{n_edges}I", out, children_off, *kids)
    out[labels_off:labels_off + n_edges] = labels
    struct.pack_into(f"<{len(pair_table)}Q", out, pairs_off, *pair_table)
    out[blob_off:blob_off + len(blob)] = blob

    meta = {
        "tokenizer.type": "sentencepiece_bpe",
        "tokenizer.bos_id": bos_id,
        "tokenizer.eos_id": eos_id,
        "tokenizer.unk_id": unk_id,
        "tokenizer.pad_id": pad_id,
        "n_pieces": n,
    }
    return bytes(out), meta
