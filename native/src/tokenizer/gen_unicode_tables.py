#!/usr/bin/env python3
"""Generate native/src/tokenizer/unicode_tables.c from Python's `unicodedata`.

    python3 native/src/tokenizer/gen_unicode_tables.py > native/src/tokenizer/unicode_tables.c

The byte-level BPE tokenizer (native/src/tokenizer/bpe.c) needs, for its hand-written
pre-tokenizer matchers and its NFC normalizer:

* the General Category of every code point (compact ranges of equal category, binary
  search; a direct table for U+0000..U+00FF);
* White_Space (`\\s` of the Oniguruma / Rust regex engines): a fixed list, checked here
  against `str.isspace()` (which additionally counts U+001C..U+001F);
* Script=Han (`\\p{Han}`, Kimi's split pattern): a fixed list of the assigned characters,
  checked here against the `regex` module's `\\p{Han}` when it is installed;
* canonical combining classes (ranges of non-zero classes);
* full canonical decompositions (recursively expanded, Hangul syllables excluded: they
  are algorithmic) and the primary-composite pairs (canonical two-character
  decompositions whose composite survives NFC, i.e. not composition-excluded).

The tables follow the Unicode version of the Python that runs this script (it is written
into the output); code points assigned after that version are "Cn" (unassigned) here.
"""

from __future__ import annotations

import sys
import unicodedata as ud

CATS = ["Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps", "Pe",
        "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"]

WHITE_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
               (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]

# Script=Han, the characters assigned in this Unicode version (radicals, ideographs, the
# ideographic iteration mark and numerals among them: categories Lo, Lm, Nl, So, Po, Mc)
HAN = [(0x2E80, 0x2E99), (0x2E9B, 0x2EF3), (0x2F00, 0x2FD5), (0x3005, 0x3005), (0x3007, 0x3007), (0x3021, 0x3029),
       (0x3038, 0x303B), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFA6D), (0xFA70, 0xFAD9), (0x16FE2, 0x16FE3),
       (0x16FF0, 0x16FF1), (0x20000, 0x2A6DF), (0x2A700, 0x2B738), (0x2B740, 0x2B81D), (0x2B820, 0x2CEA1),
       (0x2CEB0, 0x2EBE0), (0x2F800, 0x2FA1D), (0x30000, 0x3134A)]

MAX_CP = 0x10FFFF
SBASE, SCOUNT = 0xAC00, 11172


def ranges(values):
    """[(start, end, value)] runs of equal non-None value over 0..MAX_CP."""
    out = []
    cur = None
    for cp in range(MAX_CP + 1):
        v = values(cp)
        if cur is not None and v == cur[2] and cp == cur[1] + 1:
            cur[1] = cp
            continue
        if cur is not None:
            out.append(tuple(cur))
            cur = None
        if v is not None:
            cur = [cp, cp, v]
    if cur is not None:
        out.append(tuple(cur))
    return out

HELPERS = """
int cb_ucat(uint32_t cp) {
    if (cp < 256) return cb_ucat_latin1[cp];
    if (cp > 0x10FFFF) return UC_Cn;
    uint32_t lo = 0, hi = cb_ucat_n; /* last range with start <= cp */
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (cb_ucat_start[mid] <= cp) lo = mid; else hi = mid;
    }
    if (cb_ucat_start[lo] <= cp && cp <= (cb_ucat_end_cat[lo] >> 5)) return (int)(cb_ucat_end_cat[lo] & 31u);
    return UC_Cn;
}

int cb_uspace(uint32_t cp) {
    if (cp < 0x80) return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20;
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
           cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

int cb_uhan(uint32_t cp) {
    if (cp < 0x2E80 || cp > 0x3134A) return 0;
    uint32_t lo = 0, hi = cb_han_n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (cb_han_ranges[mid][1] < cp) lo = mid + 1; else hi = mid;
    }
    return lo < cb_han_n && cb_han_ranges[lo][0] <= cp;
}

int cb_uccc(uint32_t cp) {
    if (cp < 0x300 || cp > 0x10FFFF) return 0;
    uint32_t lo = 0, hi = cb_ccc_n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if ((cb_ccc_ranges[mid][1] >> 8) < cp) lo = mid + 1; else hi = mid;
    }
    if (lo < cb_ccc_n && (cb_ccc_ranges[lo][0] >> 8) <= cp) return (int)(cb_ccc_ranges[lo][0] & 0xFFu);
    return 0;
}

int cb_udecomp(uint32_t cp, const uint32_t **out, uint32_t *n) {
    uint32_t lo = 0, hi = cb_decomp_n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (cb_decomp[mid][0] < cp) lo = mid + 1; else hi = mid;
    }
    if (lo < cb_decomp_n && cb_decomp[lo][0] == cp) {
        *out = cb_decomp_pool + (cb_decomp[lo][1] >> 4);
        *n = cb_decomp[lo][1] & 15u;
        return 1;
    }
    return 0;
}

uint32_t cb_ucomp(uint32_t a, uint32_t b) {
    uint64_t key = ((uint64_t)a << 21) | b;
    uint32_t lo = 0, hi = cb_comp_n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (cb_comp[mid][0] < key) lo = mid + 1; else hi = mid;
    }
    return (lo < cb_comp_n && cb_comp[lo][0] == key) ? (uint32_t)cb_comp[lo][1] : 0;
}
"""


def main() -> None:
    cat_index = {c: i for i, c in enumerate(CATS)}
    cats = [cat_index[ud.category(chr(cp))] for cp in range(MAX_CP + 1)]
    cat_ranges = ranges(lambda cp: cats[cp] if cats[cp] != 0 else None)

    ws = set()
    for a, b in WHITE_SPACE:
        ws.update(range(a, b + 1))
    py_space = {cp for cp in range(MAX_CP + 1) if chr(cp).isspace()}
    assert py_space - ws == set(range(0x1C, 0x20)) and ws <= py_space, "White_Space list out of date"

    han = set()
    for a, b in HAN:
        han.update(range(a, b + 1))
    assert all(cats[cp] != 0 for cp in han), "HAN list holds unassigned code points"
    try:
        import regex
    except ImportError:
        regex = None
    if regex is not None:
        rx = regex.compile(r"\p{Han}")
        found = {cp for cp in range(MAX_CP + 1) if cats[cp] != 0 and rx.match(chr(cp))}
        assert found == han, f"HAN list out of date: {sorted(found ^ han)[:8]}"

    ccc_ranges = ranges(lambda cp: ud.combining(chr(cp)) or None)

    def full_decomp(cp):
        d = ud.decomposition(chr(cp))
        if not d or d.startswith("<"):
            return [cp]
        out = []
        for h in d.split():
            out.extend(full_decomp(int(h, 16)))
        return out

    decomps = []
    comps = []
    for cp in range(MAX_CP + 1):
        if SBASE <= cp < SBASE + SCOUNT:
            continue
        d = ud.decomposition(chr(cp))
        if not d or d.startswith("<"):
            continue
        full = full_decomp(cp)
        assert ud.normalize("NFD", chr(cp)) == "".join(map(chr, full))
        decomps.append((cp, full))
        parts = [int(h, 16) for h in d.split()]
        if len(parts) == 2 and ud.normalize("NFC", chr(cp)) == chr(cp):
            comps.append(((parts[0] << 21) | parts[1], cp))
    comps.sort()

    w = sys.stdout.write
    w("/*\n * unicode_tables.c — GENERATED by native/src/tokenizer/gen_unicode_tables.py from Python's\n")
    w(f" * unicodedata (Unicode {ud.unidata_version}). Do not edit; re-run the script.\n */\n")
    w('#include "unicode_tables.h"\n\n')
    w(f"const char cb_unicode_version[] = \"{ud.unidata_version}\";\n\n")
    w("const uint8_t cb_ucat_latin1[256] = {")
    for cp in range(256):
        w(("\n    " if cp % 16 == 0 else " ") + f"{cats[cp]},")
    w("\n};\n\n")
    w(f"const uint32_t cb_ucat_n = {len(cat_ranges)};\n")
    w("/* start of each range of one category */\nconst uint32_t cb_ucat_start[] = {")
    for i, (a, _b, _v) in enumerate(cat_ranges):
        w(("\n    " if i % 8 == 0 else " ") + f"0x{a:X},")
    w("\n};\n/* (end << 5) | category */\nconst uint32_t cb_ucat_end_cat[] = {")
    for i, (_a, b, v) in enumerate(cat_ranges):
        w(("\n    " if i % 8 == 0 else " ") + f"0x{(b << 5) | v:X},")
    w("\n};\n\n")
    w(f"const uint32_t cb_han_n = {len(HAN)};\n")
    w("/* Script=Han: first, last code point of each range */\nconst uint32_t cb_han_ranges[][2] = {")
    for i, (a, b) in enumerate(HAN):
        w(("\n    " if i % 4 == 0 else " ") + f"{{0x{a:X}, 0x{b:X}}},")
    w("\n};\n\n")
    w(f"const uint32_t cb_ccc_n = {len(ccc_ranges)};\n")
    w("/* (start << 8) | ccc, (end << 8) | ccc */\nconst uint32_t cb_ccc_ranges[][2] = {")
    for i, (a, b, v) in enumerate(ccc_ranges):
        w(("\n    " if i % 4 == 0 else " ") + f"{{0x{(a << 8) | v:X}, 0x{(b << 8) | v:X}}},")
    w("\n};\n\n")
    pool = []
    w(f"const uint32_t cb_decomp_n = {len(decomps)};\n")
    w("/* code point, (offset into cb_decomp_pool << 4) | length */\nconst uint32_t cb_decomp[][2] = {")
    for i, (cp, full) in enumerate(decomps):
        assert len(full) < 16
        w(("\n    " if i % 4 == 0 else " ") + f"{{0x{cp:X}, 0x{(len(pool) << 4) | len(full):X}}},")
        pool.extend(full)
    w("\n};\n")
    w(f"const uint32_t cb_decomp_pool[{len(pool)}] = {{")
    for i, cp in enumerate(pool):
        w(("\n    " if i % 8 == 0 else " ") + f"0x{cp:X},")
    w("\n};\n\n")
    w(f"const uint32_t cb_comp_n = {len(comps)};\n")
    w("/* key (first << 21) | second, composite; sorted by key */\nconst uint64_t cb_comp[][2] = {")
    for i, (k, c) in enumerate(comps):
        w(("\n    " if i % 3 == 0 else " ") + f"{{0x{k:X}ull, 0x{c:X}ull}},")
    w("\n};\n")
    w(HELPERS)


if __name__ == "__main__":
    main()
