"""The engine's reference dequantizer (colibri_dequantize, core/quant.c and quant_grid.c)
against the `gguf` package's gguf.quants.dequantize, bit for bit, on random blocks of every
quantized type; the grid types' codebooks and their refusals; and its refusals."""
import ctypes

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from colibri_lab.format import blocks
from colibri_lab.format import spec as fmt
from colibri_lab.runtime import _native

QT = gguf.GGMLQuantizationType
TYPES = {fmt.DTYPE_Q8_0: QT.Q8_0, fmt.DTYPE_Q4_K: QT.Q4_K, fmt.DTYPE_Q5_K: QT.Q5_K,
         fmt.DTYPE_Q6_K: QT.Q6_K, fmt.DTYPE_MXFP4: QT.MXFP4, fmt.DTYPE_Q4_0: QT.Q4_0,
         fmt.DTYPE_Q4_1: QT.Q4_1, fmt.DTYPE_Q5_0: QT.Q5_0, fmt.DTYPE_Q5_1: QT.Q5_1,
         fmt.DTYPE_Q2_K: QT.Q2_K, fmt.DTYPE_Q3_K: QT.Q3_K, fmt.DTYPE_IQ4_NL: QT.IQ4_NL,
         fmt.DTYPE_IQ4_XS: QT.IQ4_XS, fmt.DTYPE_IQ2_XXS: QT.IQ2_XXS, fmt.DTYPE_IQ2_XS: QT.IQ2_XS,
         fmt.DTYPE_IQ2_S: QT.IQ2_S, fmt.DTYPE_IQ3_XXS: QT.IQ3_XXS, fmt.DTYPE_IQ3_S: QT.IQ3_S,
         fmt.DTYPE_IQ1_S: QT.IQ1_S, fmt.DTYPE_IQ1_M: QT.IQ1_M}
# byte offsets of each block's f16 fields (MXFP4: an e8m0 byte, every value is one)
F16_AT = {fmt.DTYPE_Q8_0: (0,), fmt.DTYPE_Q4_K: (0, 2), fmt.DTYPE_Q5_K: (0, 2),
          fmt.DTYPE_Q6_K: (208,), fmt.DTYPE_MXFP4: (), fmt.DTYPE_Q4_0: (0,),
          fmt.DTYPE_Q4_1: (0, 2), fmt.DTYPE_Q5_0: (0,), fmt.DTYPE_Q5_1: (0, 2),
          fmt.DTYPE_Q2_K: (80, 82), fmt.DTYPE_Q3_K: (108,), fmt.DTYPE_IQ4_NL: (0,),
          fmt.DTYPE_IQ4_XS: (0,), fmt.DTYPE_IQ2_XXS: (0,), fmt.DTYPE_IQ2_XS: (0,),
          fmt.DTYPE_IQ2_S: (0,), fmt.DTYPE_IQ3_XXS: (0,), fmt.DTYPE_IQ3_S: (0,), fmt.DTYPE_IQ1_S: (0,),
          fmt.DTYPE_IQ1_M: ()}   # IQ1_M's f16 is four scattered nibbles: random, as any bytes


def _random_blocks(dtype: int, n_blocks: int, rng) -> np.ndarray:
    """Random bytes for every field, with finite f16 scales (any sign, subnormals too)."""
    be, bb = fmt.DTYPE_BLOCKS[dtype]
    raw = rng.integers(0, 256, size=(n_blocks, bb), dtype=np.uint8)
    def f16(n):
        v = (rng.standard_normal(n) * rng.choice([1e-6, 1e-3, 0.05, 3.0], n)).astype(np.float16)
        return v.view(np.uint8).reshape(n, 2)
    for off in F16_AT[dtype]:
        raw[:, off:off + 2] = f16(n_blocks)
    if n_blocks > 2 and F16_AT[dtype]:   # an all-zero block, and one with a zero scale
        raw[0] = 0
        raw[1, F16_AT[dtype][0]:F16_AT[dtype][0] + 2] = 0
    return raw


def _engine_dequant(dtype: int, raw: np.ndarray, n: int) -> np.ndarray:
    _native.install_codebook(dtype)          # the grid types' codebooks (the gguf package's)
    out = np.empty(n, dtype=np.float32)
    src = np.ascontiguousarray(raw)
    st = _native.lib.colibri_dequantize(dtype, src.ctypes.data_as(ctypes.c_void_p), n,
                                        out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    assert st == 0
    return out


@pytest.mark.parametrize("dtype", list(TYPES), ids=lambda d: fmt.DTYPE_NAMES[d])
def test_dequantize_bit_for_bit_with_gguf(dtype):
    rng = np.random.default_rng(1000 + dtype)
    be, _ = fmt.DTYPE_BLOCKS[dtype]
    for n_blocks in (1, 3, 37):
        raw = _random_blocks(dtype, n_blocks, rng)
        want = gguf.quants.dequantize(raw.reshape(-1), TYPES[dtype]).reshape(-1).astype(np.float32)
        got = _engine_dequant(dtype, raw, n_blocks * be)
        assert got.shape == want.shape
        diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert diff.size == 0, (f"{fmt.DTYPE_NAMES[dtype]}: {diff.size} of {got.size} values differ, "
                                f"first at {diff[0]}: {got[diff[0]]!r} vs {want[diff[0]]!r}")


def test_dequantize_float_types_and_refusals():
    x = np.array([1.5, -2.25, 3.0e-5, 7.0], dtype=np.float32)
    assert np.array_equal(_engine_dequant(fmt.DTYPE_F32, x, 4), x)
    h = x.astype(np.float16)
    assert np.array_equal(_engine_dequant(fmt.DTYPE_F16, h, 4), h.astype(np.float32))
    out = np.empty(40, dtype=np.float32)
    raw = np.zeros(34 * 2, dtype=np.uint8)
    p = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    lib = _native.lib
    assert lib.colibri_dequantize(fmt.DTYPE_Q8_0, raw.ctypes.data_as(ctypes.c_void_p), 33, p) != 0  # not whole blocks
    assert lib.colibri_dequantize(fmt.DTYPE_I8, raw.ctypes.data_as(ctypes.c_void_p), 4, p) != 0    # not a weight type
    assert lib.colibri_dequantize(99, raw.ctypes.data_as(ctypes.c_void_p), 32, p) != 0             # unknown
    assert lib.colibri_dequantize(fmt.DTYPE_Q8_0, None, 32, p) != 0


def _engine_sumsq(dtype: int, raw, n: int) -> tuple[int, float]:
    out = ctypes.c_double(-1.0)
    src = None if raw is None else np.ascontiguousarray(raw).ctypes.data_as(ctypes.c_void_p)
    st = _native.lib.colibri_dequantize_sumsq(dtype, src, n, ctypes.byref(out))
    return st, out.value


@pytest.mark.parametrize("dtype", list(TYPES) + [fmt.DTYPE_F32, fmt.DTYPE_F16, fmt.DTYPE_BF16],
                         ids=lambda d: fmt.DTYPE_NAMES[d])
def test_dequantize_sumsq(dtype):
    """colibri_dequantize_sumsq: the f64 sum of squares of colibri_dequantize's values (a
    converter's tensor norms), over chunks and float rows of any length; and the converter's
    stored_sumsq gives it with the library and without (numpy)."""
    from colibri_lab.conversion import spec as conv_spec
    rng = np.random.default_rng(2000 + dtype)
    if dtype in TYPES:
        be, _ = fmt.DTYPE_BLOCKS[dtype]
        cases = [(_random_blocks(dtype, nb, rng), nb * be) for nb in (1, 3, 37, 300)]  # 300: > one 4096 chunk
    else:
        cases = []
        for n in (1, 7, 13, 4099, 9000):
            x = (rng.standard_normal(n) * 3).astype(np.float32)
            cases.append((fmt.f32_to_stored(x, dtype).reshape(-1), n))
    for raw, n in cases:
        vals = _engine_dequant(dtype, raw, n).astype(np.float64)
        finite = np.isfinite(vals).all()
        want = float(np.sum(vals * vals))
        st, got = _engine_sumsq(dtype, raw, n)
        assert st == 0
        if finite:
            assert got == pytest.approx(want, rel=1e-12, abs=1e-300), (fmt.DTYPE_NAMES[dtype], n)
        row = raw.reshape(1, -1)
        with_lib = conv_spec.stored_sumsq(row, dtype, n)
        saved = conv_spec._native_sumsq
        try:
            conv_spec._native_sumsq = False          # as without the library: numpy dequantizes
            without = conv_spec.stored_sumsq(row, dtype, n)
        finally:
            conv_spec._native_sumsq = saved
        if finite:
            assert with_lib == got
            assert without == pytest.approx(want, rel=1e-12, abs=1e-300)


def test_dequantize_sumsq_refusals():
    raw = np.zeros(34 * 2, dtype=np.uint8)
    for dt, n, src in ((fmt.DTYPE_Q8_0, 33, raw), (fmt.DTYPE_I8, 4, raw), (99, 32, raw), (fmt.DTYPE_Q8_0, 32, None),
                       (fmt.DTYPE_Q8_0, -32, raw)):
        st, got = _engine_sumsq(dt, src, n)
        assert st != 0 and got == -1.0, (dt, n)      # refused, nothing written
    assert _native.lib.colibri_dequantize_sumsq(fmt.DTYPE_Q8_0, raw.ctypes.data_as(ctypes.c_void_p), 32, None) != 0
    assert _engine_sumsq(fmt.DTYPE_Q8_0, raw, 0) == (0, 0.0)


def test_codebooks():
    """The grid types' codebooks: the gguf package's grids install (their CRC-32 is ggml's,
    which the engine checks); a wrong size, a changed entry or a dtype without one is refused;
    a grid type's blocks before any install are refused (COLIBRI_E_UNSUPPORTED, as
    colibri_dequantize documents) — checked in a fresh process, since installs are per process."""
    import subprocess
    import sys
    lib = _native.lib
    for dt in fmt.GRID_DTYPES:
        _native.install_codebook(dt)
        grid = np.ascontiguousarray(blocks.codebook(fmt.CODEBOOK_OF[dt]))
        assert lib.colibri_install_codebook(dt, grid.ctypes.data_as(ctypes.c_void_p), grid.nbytes) == 0  # again: same
        assert lib.colibri_install_codebook(dt, grid.ctypes.data_as(ctypes.c_void_p), grid.nbytes - 1) != 0
        bad = grid.copy()
        bad.reshape(-1)[7] ^= 1
        assert lib.colibri_install_codebook(dt, bad.ctypes.data_as(ctypes.c_void_p), bad.nbytes) != 0
    g = np.zeros(16, np.int8)
    assert lib.colibri_install_codebook(fmt.DTYPE_Q4_K, g.ctypes.data_as(ctypes.c_void_p), 16) != 0
    code = ("import ctypes, numpy as np\n"
            "from colibri_lab.runtime import _native\n"
            "from colibri_lab.format import spec as fmt\n"
            "raw = np.zeros(66, np.uint8); out = np.empty(256, np.float32)\n"
            "st = _native.lib.colibri_dequantize(fmt.DTYPE_IQ2_XXS, raw.ctypes.data_as(ctypes.c_void_p), 256,"
            " out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))\n"
            "assert st == _native.E_UNSUPPORTED, st\n"
            "_native.install_codebook(fmt.DTYPE_IQ2_XXS)\n"
            "assert _native.lib.colibri_dequantize(fmt.DTYPE_IQ2_XXS, raw.ctypes.data_as(ctypes.c_void_p), 256,"
            " out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))) == 0\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
