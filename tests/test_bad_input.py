"""Bad input gets a clear error, never a crash.

Every corrupt file is opened in a child process, so a segfault or abort fails the test
instead of killing the test run. Header and section CRCs are recomputed after a
mutation where said, so the mutation reaches the deeper checks (offsets, sizes,
metadata and tensor-directory parsing) instead of stopping at the checksum.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import colibri_lab  # noqa: E402
from colibri_lab import ColibriError  # noqa: E402

from colibri_lab.bench.models import MixtralShape, build_model, save_checkpoint  # noqa: E402

SECTION_NAMES = ["metadata", "tensor_dir", "tokenizer", "dense", "router", "experts"]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A small valid model with the real tokenizer (so the tokenizer section is parsed)."""
    d = tmp_path_factory.mktemp("bad")
    shape = MixtralShape(vocab=32000, hidden=24, inter=20, layers=2, heads=2, kv_heads=1,
                  experts=4, top_k=2, max_pos=64, seed=5)
    folder = save_checkpoint(build_model(shape), d / "hf")
    out = d / "good.colibri"
    colibri_lab.convert(folder, out, dtype="bf16", progress=False)
    return out


def sections(data: bytes):
    return [struct.unpack_from("<QQI", data, 56 + 24 * i) for i in range(6)]


def fix_crcs(buf: bytearray, *, sections_too: bool = True) -> bytearray:
    """Recompute the small sections' CRCs and the header CRC after a mutation."""
    if sections_too:
        for i in range(3):
            off, size, _ = struct.unpack_from("<QQI", buf, 56 + 24 * i)
            if off + size <= len(buf):
                struct.pack_into("<I", buf, 56 + 24 * i + 16, zlib.crc32(buf[off:off + size]))
    struct.pack_into("<I", buf, 252, zlib.crc32(buf[:252]))
    return buf


OPENER = textwrap.dedent(
    """
    import json, sys
    import colibri_lab
    results = []
    for path in sys.argv[1:]:
        try:
            with colibri_lab.Engine(path) as eng:
                eng.forward([1, 2, 3])
            results.append(["ok", ""])
        except colibri_lab.ColibriError as e:
            results.append([type(e).__name__, str(e)])
    print(json.dumps(results))
    """
)


def open_all(paths):
    """Open each file in one child process; a crash fails with the child's stderr."""
    proc = subprocess.run([sys.executable, "-c", OPENER, *map(str, paths)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"child crashed (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_variants(tmp_path, variants):
    paths = []
    for i, data in enumerate(variants):
        p = tmp_path / f"v{i}.colibri"
        p.write_bytes(bytes(data))
        paths.append(p)
    return paths


def test_good_file_opens(good):
    assert open_all([good]) == [["ok", ""]]


def test_truncated_at_many_points(good, tmp_path):
    data = good.read_bytes()
    cuts = {0, 1, 7, 8, 11, 12, 100, 251, 252, 255, 256, len(data) - 1, len(data) // 2}
    for off, size, _ in sections(data):
        cuts |= {off - 1, off, off + 1, off + size - 1, off + size // 2}
    rng = np.random.default_rng(0)
    cuts |= set(rng.integers(1, len(data), 40).tolist())
    cuts = sorted(c for c in cuts if 0 <= c < len(data))
    results = open_all(write_variants(tmp_path, [data[:c] for c in cuts]))
    for cut, (kind, msg) in zip(cuts, results):
        assert kind != "ok", f"file cut at {cut} of {len(data)} bytes opened"
        assert msg, f"cut at {cut}: empty message"
        if cut >= 256:
            assert "truncat" in msg.lower() or "size" in msg.lower(), msg


def test_header_errors(good, tmp_path):
    data = good.read_bytes()
    cases = {}
    b = bytearray(data); b[0:8] = b"GGUF\0\0\0\0"; cases["magic"] = b
    b = bytearray(data); b[0:8] = b"PK\x03\x04\0\0\0\0"; cases["other magic"] = b
    b = bytearray(data); struct.pack_into("<I", b, 8, 7); cases["version"] = fix_crcs(b)
    b = bytearray(data); b[30] ^= 0xFF; cases["header crc"] = b
    b = bytearray(data); struct.pack_into("<I", b, 24, 0); cases["0 experts"] = fix_crcs(b)
    b = bytearray(data); struct.pack_into("<I", b, 28, 9); cases["top_k > experts"] = fix_crcs(b)
    b = bytearray(data); struct.pack_into("<I", b, 48, 0); cases["0 layers"] = fix_crcs(b)
    b = bytearray(data); struct.pack_into("<Q", b, 16, len(data) + 4096); cases["file_size"] = fix_crcs(b)
    for i in range(6):
        b = bytearray(data); struct.pack_into("<Q", b, 56 + 24 * i, len(data) + 64)
        cases[f"{SECTION_NAMES[i]} offset past end"] = fix_crcs(b, sections_too=False)
        b = bytearray(data); struct.pack_into("<Q", b, 56 + 24 * i + 8, 2**64 - 16)
        cases[f"{SECTION_NAMES[i]} size overflow"] = fix_crcs(b, sections_too=False)
    b = bytearray(data); b[sections(data)[0][0] + 20] ^= 0x55; cases["metadata crc"] = b
    results = dict(zip(cases, open_all(write_variants(tmp_path, cases.values()))))
    for name, (kind, msg) in results.items():
        assert kind != "ok", f"{name}: opened"
        assert len(msg) > 15, f"{name}: message too short: {msg!r}"
    assert results["magic"][0] == "ColibriFormatError"
    assert "llama.cpp GGUF" in results["magic"][1] and "colibri-convert" in results["magic"][1]
    assert results["other magic"][0] == "ColibriFormatError" and "COLIBRI magic" in results["other magic"][1]
    assert results["version"][0] == "ColibriVersionError"
    assert "7" in results["version"][1]
    assert results["header crc"][0] == "ColibriChecksumError"
    assert results["metadata crc"][0] == "ColibriChecksumError"


def test_fuzzed_metadata_and_directory(good, tmp_path):
    """Random byte changes in the metadata, tensor directory and tokenizer sections,
    CRCs recomputed: the parser sees garbage lengths, types, offsets and shapes."""
    data = good.read_bytes()
    secs = sections(data)
    rng = np.random.default_rng(1)
    variants = []
    for i in range(300):
        b = bytearray(data)
        off, size, _ = secs[i % 3]
        if size == 0:
            continue
        for _ in range(rng.integers(1, 4)):
            pos = off + int(rng.integers(0, size))
            b[pos] = int(rng.integers(0, 256)) if rng.random() < 0.7 else 0xFF
        variants.append(fix_crcs(b))
    results = open_all(write_variants(tmp_path, variants))
    assert all(msg or kind == "ok" for kind, msg in results)
    # Most mutants are caught; the few that open changed only a value the engine
    # accepts (e.g. a name byte of an unused metadata key or a tokenizer score).
    n_caught = sum(kind != "ok" for kind, _ in results)
    assert n_caught >= len(results) // 2


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ColibriError, match="nope.colibri"):
        colibri_lab.Engine(tmp_path / "nope.colibri")
    with pytest.raises(ColibriError) as e:
        colibri_lab.Engine(tmp_path)
    assert "director" in str(e.value).lower()
    empty = tmp_path / "empty.colibri"
    empty.write_bytes(b"")
    with pytest.raises(ColibriError):
        colibri_lab.Engine(empty)


def test_bad_token_ids_and_lengths_lose_nothing(good):
    with colibri_lab.Engine(good, max_seq_len=32) as eng:
        ref = eng.forward([1, 2, 3, 4])
        for bad in ([1, -1], [1, 32000], [2**31 - 1]):
            with pytest.raises(ColibriError, match="out of range") as e:
                eng.forward(bad, start_pos=4)
            assert isinstance(e.value, ValueError)
        with pytest.raises(ColibriError, match="32"):
            eng.forward(list(range(5, 38)))  # 33 tokens > max_seq_len 32
        with pytest.raises(ColibriError):
            eng.forward([5] * 30, start_pos=4)  # 4 + 30 > 32
        with pytest.raises(ColibriError):
            eng.forward([5], start_pos=9)  # beyond what is cached
        with pytest.raises(ColibriError):
            eng.forward([])
        # The failed calls changed nothing: continuing gives the same as a full forward.
        assert eng.cached_len == 4
        cont = eng.forward([5, 6], start_pos=4)
        full = eng.forward([1, 2, 3, 4, 5, 6])
        assert np.max(np.abs(full[:4] - ref)) <= 1e-5
        assert np.max(np.abs(full[4:] - cont)) <= 1e-5
    with pytest.raises(ColibriError):
        colibri_lab.Engine(good, max_seq_len=10**9)  # above the file's max_seq_len


def test_cli_reports_errors(good, tmp_path, cli_path):
    cli = cli_path
    bad = tmp_path / "bad.colibri"
    bad.write_bytes(good.read_bytes()[:1000])
    for args, needle in [
        (["--model", str(bad), "--prompt", "hi", "--max_new_tokens", "1"], "truncat"),
        (["--model", str(tmp_path / "none.colibri"), "--prompt", "hi"], "none.colibri"),
        (["--model", str(good), "--prompt", "hello " * 40, "--max_seq_len", "16",
          "--max_new_tokens", "1"], "16"),
    ]:
        proc = subprocess.run([cli, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0, args
        assert needle in proc.stderr.lower() or needle in proc.stderr, proc.stderr


def test_duplicate_names_are_refused(good, tmp_path):
    """A tensor name or metadata key that appears twice makes lookups ambiguous."""
    data = good.read_bytes()
    (moff, msize, _), (doff, dsize, _) = sections(data)[:2]
    b = bytearray(data)
    at = b.index(b"blk.0.attn_q.weight", doff, doff + dsize)
    b[at:at + 19] = b"blk.0.attn_k.weight"
    dup_tensor = fix_crcs(b)
    b = bytearray(data)
    at = b.index(b"tokenizer.bos_id", moff, moff + msize)
    b[at:at + 16] = b"tokenizer.eos_id"
    dup_key = fix_crcs(b)
    (k1, m1), (k2, m2) = open_all(write_variants(tmp_path, [dup_tensor, dup_key]))
    assert k1 == "ColibriFormatError" and "blk.0.attn_k.weight" in m1 and "more than once" in m1
    assert k2 == "ColibriFormatError" and "tokenizer.eos_id" in m2 and "more than once" in m2
