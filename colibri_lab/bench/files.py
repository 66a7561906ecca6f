"""Model files of the side-by-side benchmark: the .colibri conversion cache (converted
from the checkpoint, or imported from llama.cpp's GGUF for a quantized dtype), the
checkout being measured, and the page-cache helpers that make every engine load cold."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

from .common import _say


def _model_key(model_dir: Path) -> str:
    h = hashlib.sha256()
    h.update(str(Path(model_dir).resolve()).encode())
    for f in sorted(Path(model_dir).glob("*")):
        if f.suffix in (".json", ".safetensors", ".model"):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return f"{Path(model_dir).name}-{h.hexdigest()[:10]}"


def colibri_file(model_dir: Path, dtype: str, cache: Path) -> Path:
    """The model converted to .colibri at `dtype`, cached under cache/converted."""
    from ..conversion.hf import convert

    out = cache / "converted" / f"{_model_key(model_dir)}-{dtype}.colibri"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        _say(f"converting {model_dir} to {out}")
        convert(model_dir, out, dtype=dtype, progress=False)
    return out


def colibri_from_gguf(gguf: Path, cache: Path, tokenizer: str = "auto") -> Path:
    """The GGUF imported into .colibri by :func:`colibri_lab.conversion.gguf.convert_gguf`
    (the GGUF's bytes copied, not requantized: both engines run the same weights), cached
    under cache/converted by the GGUF's name, size and modification time. ``tokenizer``
    "none" imports the weights without the vocabulary (the bench feeds token ids: the GGUFs
    of its random BPE models name llama.cpp's fallback pre-tokenizer, which colibri refuses)."""
    from ..conversion.gguf import convert_gguf

    gguf = Path(gguf)
    st = gguf.stat()
    stamp = f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:8]
    out = cache / "converted" / f"{gguf.stem}-gguf{key}{'-notok' if tokenizer == 'none' else ''}.colibri"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        _say(f"importing {gguf} to {out}")
        convert_gguf(gguf, out, progress=False, tokenizer=tokenizer)
    return out


def source_info() -> dict:
    """The checkout this run measured: git HEAD and whether the working tree had changes
    (read-only git; empty when not in a git checkout)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "native"],
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_head": head, "native_tree_modified": bool(dirty)} if head else {}



def drop_from_page_cache(path) -> bool:
    """Evict a (clean) file from the page cache, so that every engine loads its model file
    cold, the same way. Which page-cache folios a file sits in decides whether a mapping
    of it can use 2 MiB pages, and that changes decode speed by 10-25 % on this machine
    class: a file just written (by a converter) sits in small folios; one read back through
    a mapping comes in large ones. Returns False where the OS cannot do it."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def hugepage_fraction(path) -> float | None:
    """The share of a file that a fresh read-only mapping gets in 2 MiB pages (Linux
    `FilePmdMapped`), i.e. what every engine that maps the file now gets: one byte of
    every 2 MiB is touched, which maps a whole huge page where the page cache holds the
    range in a 2 MiB folio. None where /proc/self/smaps does not say."""
    import mmap

    size = os.path.getsize(path)
    if size < (2 << 20) or not os.path.exists("/proc/self/smaps"):
        return None
    real = os.path.realpath(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for off in range(0, size, 2 << 20):
            m[off]
        pmd_kb, found = 0, False
        with open("/proc/self/smaps") as sm:
            inside = False
            for line in sm:
                head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
                if head:
                    inside = head.group(1).strip() == real
                    found |= inside
                elif inside and line.startswith("FilePmdMapped:"):
                    pmd_kb += int(line.split()[1])
    return pmd_kb * 1024 / size if found else None

