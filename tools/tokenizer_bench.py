"""Encode speed of Colibri's C tokenizer against the reference library, one thread each.

    python tools/tokenizer_bench.py [--kind spm,bpe,tiktoken] [--reps 7] [--text FILE]
                                    [--spm-model tokenizer.model] [--bpe-json tokenizer.json]
                                    [--tiktoken-dir FOLDER]

- spm: the SentencePiece BPE tokenizer (default data/tokenizer.model.v1, Mistral / Mixtral's)
  turned into a tokenizer section (colibri_lab.conversion.spm), against `sentencepiece`;
- bpe: a byte-level BPE tokenizer.json (default: a Qwen2-style one, NFC + the Qwen2 split
  regex + ByteLevel, 4000 pieces, trained here on the text with `tokenizers` in seconds)
  turned into a section (colibri_lab.conversion.bpe), against `tokenizers` (Tokenizer.encode,
  one thread: encode_batch would spread the documents over every core);
- tiktoken: a tiktoken vocabulary with its tokenizer class (a Kimi checkpoint's
  tiktoken.model, tokenizer_config.json and tokenization_kimi.py; default: a Kimi-style one,
  4000 ranks trained here with Kimi's split pattern) turned into a section
  (colibri_lab.conversion.bpe.build_tiktoken_section), against `tiktoken` with the class's
  pattern and special tokens (encode(text, allowed_special="all")).

The text (default: the package's own source, colibri_lab/**/*.py, and docs/*.md, about 1 MB)
is encoded two ways: as one call, and as its documents (split at blank lines) one call each.
Both tokenizers must give the same ids first (the bench refuses to time different work);
then each repetition times Colibri and the reference back to back, the order swapped every
repetition. Prints the medians (s and MB/s), the ratio reference / Colibri (> 1: Colibri is
faster), the CPU model and its SIMD flags.

Run from the repository root with the library and the package importable (installed, or
COLIBRI_LIB=build/libcolibri.so PYTHONPATH=.).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def default_text() -> str:
    files = sorted((REPO / "colibri_lab").rglob("*.py")) + sorted((REPO / "docs").glob("*.md"))
    return "\n\n".join(p.read_text(encoding="utf-8") for p in files)


def documents(text: str) -> list[str]:
    return [d for d in text.split("\n\n") if d.strip()]


SIMD = re.compile(r"^(sse|ssse|avx|amx|fma|f16c|bmi|vaes|vpclmul|gfni|asimd|sve|i8mm|bf16|dcpop|atomics)")


def machine() -> str:
    """The CPU model and its SIMD flags (/proc/cpuinfo), the CPUs this process may use."""
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        txt = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^(?:model name|Model|Hardware)\s*:\s*(.+)$", txt, re.MULTILINE)
        cpu = m.group(1).strip() if m else cpu
        fl = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", txt, re.MULTILINE)  # x86 | AArch64
        flags = [f for f in fl.group(1).split() if SIMD.match(f)] if fl else []
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"cpu: {cpu} ({usable} of {os.cpu_count()} cpus usable; both tokenizers use one)\n"
            f"simd: {' '.join(flags) or 'none found'}")


def train_bpe(text: str, folder: Path) -> Path:
    """A Qwen2-style byte-level BPE tokenizer.json trained on `text` (the tests' qwen_style)."""
    from colibri_lab.bench.models import byte_level_bpe

    tok = byte_level_bpe(documents(text), 4000, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    out = folder / "tokenizer.json"
    tok.save(str(out))
    return out


def pair(kind: str, args, text: str, tmp: Path):
    """(label, colibri encode(str) -> ids, reference encode(str) -> ids)."""
    import colibri_lab

    if kind == "spm":
        import sentencepiece as spm

        from colibri_lab.conversion.spm import build_tokenizer_section

        model = Path(args.spm_model)
        section, _ = build_tokenizer_section(model)
        ct = colibri_lab.Tokenizer.from_section_bytes(section)
        sp = spm.SentencePieceProcessor(model_file=str(model))
        return (f"spm {model.name} vs sentencepiece",
                lambda s: ct.encode(s, add_bos=False), lambda s: sp.encode(s))
    if kind == "tiktoken":
        return tiktoken_pair(args, text, tmp)
    from tokenizers import Tokenizer

    from colibri_lab.conversion.bpe import build_bpe_tokenizer_section

    path = Path(args.bpe_json) if args.bpe_json else train_bpe(text, tmp)
    section, _ = build_bpe_tokenizer_section(path)
    ct = colibri_lab.Tokenizer.from_section_bytes(section)
    hf = Tokenizer.from_file(str(path))
    name = path.name if args.bpe_json else "qwen2-style trained here"
    return (f"byte-level bpe {name} vs tokenizers",
            lambda s: ct.encode(s, add_bos=False), lambda s: hf.encode(s, add_special_tokens=False).ids)


def tiktoken_pair(args, text: str, tmp: Path):
    import json

    import tiktoken
    import tiktoken.load

    import colibri_lab
    from colibri_lab.bench.models import kimi_style_tokenizer
    from colibri_lab.conversion.bpe import _tiktoken_code_facts, build_tiktoken_section

    folder = Path(args.tiktoken_dir) if args.tiktoken_dir else tmp / "kimi"
    if not args.tiktoken_dir:
        kimi_style_tokenizer(documents(text), 4000, folder)
    model = folder / "tiktoken.model"
    section, _ = build_tiktoken_section(model)
    ct = colibri_lab.Tokenizer.from_section_bytes(section)
    cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    pat, reserved, _ = _tiktoken_code_facts(str(folder), cfg, str(model))
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # no copy of the local file in the temp folder's data-gym-cache
    ranks = tiktoken.load.load_tiktoken_bpe(str(model))
    n = len(ranks)
    names = {i: f"<|reserved_token_{i}|>" for i in range(n, n + reserved)}
    names.update({int(k): v["content"] for k, v in (cfg.get("added_tokens_decoder") or {}).items()})
    enc = tiktoken.Encoding(name=model.name, pat_str=pat, mergeable_ranks=ranks,
                            special_tokens={v: k for k, v in names.items()})
    name = str(folder) if args.tiktoken_dir else "kimi-style trained here"
    return (f"tiktoken vocabulary {name} ({n} ranks) vs tiktoken",
            lambda s: ct.encode(s, add_bos=False), lambda s: enc.encode(s, allowed_special="all"))


def bench(label: str, ours, ref, text: str, reps: int) -> None:
    docs = documents(text)
    mb = len(text.encode("utf-8")) / 1e6
    mb_docs = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    cases = {"one call": (lambda f: f(text), mb),
             f"{len(docs)} documents": (lambda f: [f(d) for d in docs], mb_docs)}
    # the same work first: ids equal on the whole text and on every document
    if ours(text) != ref(text):
        sys.exit(f"{label}: the ids differ on the whole text; not timing different work")
    bad = sum(ours(d) != ref(d) for d in docs)
    if bad:
        sys.exit(f"{label}: the ids differ on {bad} of {len(docs)} documents; not timing different work")
    print(f"\n{label}: {mb:.2f} MB, {len(ref(text))} ids, ids equal")
    for case, (run, size) in cases.items():
        run(ours), run(ref)  # warm up
        t = {"colibri": [], "reference": []}
        for r in range(reps):
            order = (("colibri", ours), ("reference", ref))
            for who, fn in (order if r % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                run(fn)
                t[who].append(time.perf_counter() - t0)
        c, f = statistics.median(t["colibri"]), statistics.median(t["reference"])
        print(f"  {case:>16}: colibri {c:.4f} s ({size / c:6.2f} MB/s), reference {f:.4f} s "
              f"({size / f:6.2f} MB/s), reference/colibri {f / c:.2f}x  (medians of {reps})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="spm,bpe,tiktoken",
                    help="spm, bpe, tiktoken, comma-separated (default all three)")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per tokenizer and case (default 7)")
    ap.add_argument("--text", help="a UTF-8 text file (default: colibri_lab/**/*.py and docs/*.md)")
    ap.add_argument("--spm-model", default=str(REPO / "data" / "tokenizer.model.v1"),
                    help="a SentencePiece BPE model (default data/tokenizer.model.v1)")
    ap.add_argument("--bpe-json", help="a byte-level BPE tokenizer.json (default: one trained on the text)")
    ap.add_argument("--tiktoken-dir", help="a folder with tiktoken.model, tokenizer_config.json and the tokenizer "
                                           "class file (default: a Kimi-style one trained on the text)")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kind.split(",") if k.strip()]
    if not kinds or set(kinds) - {"spm", "bpe", "tiktoken"}:
        ap.error(f"--kind takes spm, bpe, tiktoken or several of them, got {args.kind!r}")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    text = Path(args.text).read_text(encoding="utf-8") if args.text else default_text()
    from colibri_lab.runtime import _native

    print(machine())
    print(f"{_native.version()} ({_native.lib_path}); python {platform.python_version()}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            bench(*pair(kind, args, text, Path(tmp)), text, args.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
