"""colibri_read_bandwidth (native/src/core/membw.c) through colibri_lab.bench.tuning.measure_read_bandwidth,
and the load path it sits beside: colibri_options.populate (auto by default, on, off).

Timings are not judged, only that they exist and are physically possible: a kernel whose
loads the compiler dropped would "read" a buffer in no time and report an absurd figure.
Bad arguments come back as COLIBRI_E_INVALID_ARG with the engine's message."""

from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path

import pytest

from colibri_lab import Engine, tuning
from colibri_lab.runtime._native import lib
from colibri_lab.runtime.errors import E_INVALID_ARG, E_UNSUPPORTED, ColibriInvalidArgError

MIB = 1 << 20


def _call(threads, nbytes, reps, flags, out=True, samples=None):
    val = ctypes.c_double(-1.0)
    err = ctypes.create_string_buffer(512)
    st = lib.colibri_read_bandwidth(threads, nbytes, reps, flags,
                                    ctypes.byref(val) if out else None, samples, err, len(err))
    return st, val.value, err.value.decode()


@pytest.mark.parametrize("threads", [1, 2])
def test_read_bandwidth_is_a_possible_figure(threads):
    r = tuning.measure_read_bandwidth(threads, 16 * MIB, reps=3,
                                      variants=("plain", "nt_prefetch", "portable"))
    assert r["threads"] == threads and r["bytes"] == 16 * MIB and r["reps"] == 3
    assert set(r["variants"]) == {"plain", "nt_prefetch", "portable"}
    for name, v in r["variants"].items():
        if "error" in v:  # a CPU without SIMD has no non-temporal variant
            assert name != "portable"
            continue
        assert len(v["samples_gbs"]) == 3
        assert v["best_gbs"] == max(v["samples_gbs"]) >= v["median_gbs"] > 0
        # far below any real memory or cache bandwidth of one or two cores: the loads ran
        assert 0.05 < v["best_gbs"] < 2000, (name, v)
    assert r["gbs"] == max(v.get("best_gbs", 0) for v in r["variants"].values())
    assert r["variants"][r["variant"]]["best_gbs"] == r["gbs"]


def test_read_bandwidth_default_threads_and_samples():
    reps = 2
    samples = (ctypes.c_double * reps)(-1.0, -1.0)
    st, best, msg = _call(0, 4 * MIB, reps, 0, samples=samples)  # 0: one per physical core
    assert st == 0 and msg == ""
    assert all(math.isfinite(s) and s > 0 for s in samples) and best == max(samples)


@pytest.mark.parametrize(
    "args, needle",
    [
        ((-1, 4 * MIB, 1, 0), "num_threads -1"),
        ((1025, 4 * MIB, 1, 0), "num_threads 1025"),
        ((1, MIB - 1, 1, 0), "bytes 1048575"),
        ((1, 1 << 41, 1, 0), "1 TiB"),
        ((1, 4 * MIB, 0, 0), "reps 0"),
        ((1, 4 * MIB, 1001, 0), "reps 1001"),
        ((1, 4 * MIB, 1, 16), "flags 0x10"),
        ((1, 4 * MIB, 1, 4 | 8), "not both"),
    ],
)
def test_read_bandwidth_bad_arguments(args, needle):
    st, val, msg = _call(*args)
    assert st == E_INVALID_ARG and needle in msg, msg
    assert val == 0.0  # *gb_per_s is cleared, never left as garbage


def test_read_bandwidth_null_out_and_null_err():
    st, _, msg = _call(1, 4 * MIB, 1, 0, out=False)
    assert st == E_INVALID_ARG and "gb_per_s" in msg
    val = ctypes.c_double()
    assert lib.colibri_read_bandwidth(1, 16, 1, 0, ctypes.byref(val), None, None, 0) == E_INVALID_ARG


def test_read_bandwidth_portable_has_no_non_temporal_variant():
    st, _, msg = _call(1, 4 * MIB, 1, 4 | 1)
    assert st == E_UNSUPPORTED and "non-temporal" in msg
    with pytest.raises(ColibriInvalidArgError, match="bytes"):
        tuning.measure_read_bandwidth(1, 1024, reps=1, variants=("plain",))
    with pytest.raises(ValueError, match="unknown read variant"):
        tuning.measure_read_bandwidth(1, 4 * MIB, reps=1, variants=("fastest",))


# ---------------------------------------------------------------------------------------
# The load path: populate auto / on / off
# ---------------------------------------------------------------------------------------


def _mapped_rss(path: Path) -> tuple[int, int]:
    """(Rss, Size) in bytes of this process's mappings of `path`, from /proc/self/smaps."""
    rss = size = 0
    cur = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            cur = line.rstrip().endswith(os.fspath(path))
        elif cur and head[0] == "Rss:":
            rss += int(head[1]) * 1024
        elif cur and head[0] == "Size:":
            size += int(head[1]) * 1024
    return rss, size


@pytest.fixture(scope="module")
def bigger_model(make_model):
    # ~40 MB of experts, of which init touches none (only routers, norms, the directory)
    return make_model(hidden=256, inter=1024, layers=2, heads=4, kv_heads=2, experts=8)[1]


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not hasattr(os, "posix_fadvise"),
                    reason="needs Linux /proc/self/smaps and posix_fadvise")
def test_populate_default_is_auto_and_prefaults_a_small_file(bigger_model):
    path = Path(bigger_model)
    size = path.stat().st_size
    resident = {}
    for mode in (False, None, True):
        _evict(path)
        with Engine(path, num_threads=1, populate=mode):
            rss, mapped = _mapped_rss(path)
            assert mapped >= size
            resident[mode] = rss
    # off: only what init reads (header, directory, routers, norms) is faulted in
    assert resident[False] < 0.5 * size, resident
    # on, and the default (auto: the file is far under half of MemAvailable): all of it
    assert resident[True] >= size - 4096 and resident[None] >= size - 4096, resident


def test_populate_values():
    from colibri_lab.runtime import _native

    opt = _native.ColibriOptions()
    lib.colibri_options_init(ctypes.byref(opt))
    assert opt.populate == -1  # COLIBRI_POPULATE_AUTO
    with pytest.raises(ColibriInvalidArgError, match="populate"):
        Engine("unused.colibri", populate="yes")


def test_populate_out_of_range_is_refused_by_the_engine(bigger_model):
    from colibri_lab.runtime import _native

    opt = _native.ColibriOptions()
    lib.colibri_options_init(ctypes.byref(opt))
    opt.populate = 2
    ctx = _native.ctx_p()
    err = ctypes.create_string_buffer(512)
    st = lib.colibri_init_ex(os.fsencode(bigger_model), ctypes.byref(opt), ctypes.byref(ctx), err,
                             len(err))  # fmt: skip
    assert st == E_INVALID_ARG and b"populate 2" in err.value and not ctx
