"""colibri_lab.format.blocks: the block quantizers (Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, Q4_0, Q4_1,
Q5_0, Q5_1, Q2_K, Q3_K) and the dequantizer of every block type (those and IQ4_NL, IQ4_XS).

- `dequantize` is bit for bit the `gguf` package's `gguf.quants.dequantize` (the
  reference for what a block means), on random blocks, odd row counts.
- `quantize` is llama.cpp's reference quantizer byte for byte: for Q8_0, Q4_0, Q4_1, Q5_0
  and Q5_1 against the `gguf` package's ports; for every type against golden digests of what
  ggml's `quantize_row_*_ref` (libggml-base) writes for a fixed input (checked when the
  digests were made; llama.cpp itself is not used here).
- round-trip errors within each type's bound, determinism, edge rows, refusals.
- `mix_dtype`: the converter mixes, llama.cpp's Q4_K_M / Q3_K_M / Q2_K rules, the fallbacks.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from colibri_lab.format import spec as fmt
from colibri_lab.conversion import mixes
from colibri_lab.format import blocks as Q
from colibri_lab.format.spec import (DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_IQ4_NL, DTYPE_IQ4_XS,
                                     DTYPE_MXFP4, DTYPE_Q2_K, DTYPE_Q3_K, DTYPE_Q4_0, DTYPE_Q4_1,
                                     DTYPE_Q4_K, DTYPE_Q5_0, DTYPE_Q5_1, DTYPE_Q5_K, DTYPE_Q6_K,
                                     DTYPE_Q8_0, QUANT_DTYPES)

gguf = pytest.importorskip("gguf")
GQT = gguf.GGMLQuantizationType
NAMES = {d: fmt.DTYPE_NAMES[d] for d in QUANT_DTYPES}
# where each block keeps its f16 fields: (byte offset, count)
F16_FIELDS = {DTYPE_Q8_0: [(0, 1)], DTYPE_Q4_K: [(0, 2)], DTYPE_Q5_K: [(0, 2)],
              DTYPE_Q6_K: [(208, 1)], DTYPE_MXFP4: [],   # MXFP4: an e8m0 byte, any value
              DTYPE_Q4_0: [(0, 1)], DTYPE_Q4_1: [(0, 2)], DTYPE_Q5_0: [(0, 1)],
              DTYPE_Q5_1: [(0, 2)], DTYPE_Q2_K: [(80, 2)], DTYPE_Q3_K: [(108, 1)],
              DTYPE_IQ4_NL: [(0, 1)], DTYPE_IQ4_XS: [(0, 1)],
              # ggml's grid types (IQ1_M's f16 is four scattered nibbles: any bits, as MXFP4's)
              **{d: [(0, 1)] for d in fmt.GRID_DTYPES if d != fmt.DTYPE_IQ1_M}, fmt.DTYPE_IQ1_M: []}
# the types `quantize` writes; the others are read only
WRITABLE = Q.WRITABLE_DTYPES
# the integer-grid types (MXFP4's grid is e2m1's: its bounds are tests/test_mxfp4.py's)
GRID_DTYPES = tuple(d for d in WRITABLE if d != DTYPE_MXFP4)
# gguf-py's quantizers that are ports of ggml's reference ones
GGUF_QUANTIZERS = (DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q5_0, DTYPE_Q5_1)


def random_blocks(dtype: int, rows: int, n: int, seed: int, finite: bool = True) -> np.ndarray:
    """Random bytes for [rows, n] of `dtype`; the f16 scales drawn finite (or any bits)."""
    rng = np.random.default_rng(seed)
    rb = fmt.row_nbytes(dtype, n)
    raw = rng.integers(0, 256, (rows, rb), dtype=np.uint8)
    if finite:
        be, bb = fmt.DTYPE_BLOCKS[dtype]
        blk = raw.reshape(-1, bb)
        for off, cnt in F16_FIELDS[dtype]:
            v = (rng.standard_normal((blk.shape[0], cnt)) * 10.0 ** rng.uniform(-6, 2, (blk.shape[0], 1)))
            blk[:, off:off + 2 * cnt] = v.astype("<f2").view(np.uint8)
    return raw


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal float32 arrays, any NaN equal to any NaN."""
    a = np.ascontiguousarray(a, np.float32)
    b = np.ascontiguousarray(b, np.float32)
    if a.shape != b.shape:
        return False
    ne = a.view(np.uint32) != b.view(np.uint32)
    ne &= ~(np.isnan(a) & np.isnan(b))
    return not ne.any()


# --------------------------------------------------------------------------- dequantize

@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("rows,n", [(1, 256), (7, 512), (13, 768), (3, 2048)])
def test_dequantize_is_gguf_bit_for_bit(dtype, rows, n):
    raw = random_blocks(dtype, rows, n, seed=rows * 1000 + n + dtype)
    got = Q.dequantize(raw, dtype, n)
    want = gguf.quants.dequantize(raw, Q.GGML_TYPES[dtype])
    assert got.dtype == np.float32 and got.shape == (rows, n)
    assert want.shape == (rows, n)
    assert same_bits(got, want)
    # flat bytes are accepted too
    assert same_bits(Q.dequantize(raw.reshape(-1), dtype, n), want)


@pytest.mark.parametrize("dtype", [d for d in QUANT_DTYPES if F16_FIELDS[d]], ids=NAMES.get)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_dequantize_any_f16_bits_nan_aware(dtype):   # (MXFP4's 256 scale bytes: test_mxfp4.py)
    """Scales with any bits (subnormals, inf, NaN): still gguf's bits (NaN as NaN)."""
    raw = random_blocks(dtype, 9, 256, seed=99 + dtype, finite=False)
    off = F16_FIELDS[dtype][0][0]
    bb = fmt.DTYPE_BLOCKS[dtype][1]
    blk = raw.reshape(-1, bb)
    for i, bits in enumerate((0x7C00, 0xFC00, 0x7E00, 0x0001, 0x8000, 0x03FF)):
        blk[i, off:off + 2] = np.array([bits], "<u2").view(np.uint8)   # inf, -inf, NaN, ...
    got = Q.dequantize(raw, dtype, 256)
    want = gguf.quants.dequantize(raw, Q.GGML_TYPES[dtype])
    assert same_bits(got, want)
    assert np.isnan(got).any() or np.isinf(got).any()    # the draw did reach them


def test_dequantize_refuses_partial_rows():
    with pytest.raises(ValueError, match="whole number"):
        Q.dequantize(np.zeros(35, np.uint8), DTYPE_Q8_0, 32)
    with pytest.raises(fmt.FormatError, match="multiple of 256"):
        Q.dequantize(np.zeros(144, np.uint8), DTYPE_Q4_K, 100)


def test_ggml_types_map():
    assert Q.GGML_TYPES == {DTYPE_F32: GQT.F32, DTYPE_F16: GQT.F16, DTYPE_BF16: GQT.BF16,
                            DTYPE_Q8_0: GQT.Q8_0, DTYPE_Q4_K: GQT.Q4_K, DTYPE_Q5_K: GQT.Q5_K,
                            DTYPE_Q6_K: GQT.Q6_K, DTYPE_MXFP4: GQT.MXFP4, DTYPE_Q4_0: GQT.Q4_0,
                            DTYPE_Q4_1: GQT.Q4_1, DTYPE_Q5_0: GQT.Q5_0, DTYPE_Q5_1: GQT.Q5_1,
                            DTYPE_Q2_K: GQT.Q2_K, DTYPE_Q3_K: GQT.Q3_K, DTYPE_IQ4_NL: GQT.IQ4_NL,
                            DTYPE_IQ4_XS: GQT.IQ4_XS, fmt.DTYPE_IQ2_XXS: GQT.IQ2_XXS,
                            fmt.DTYPE_IQ2_XS: GQT.IQ2_XS, fmt.DTYPE_IQ2_S: GQT.IQ2_S,
                            fmt.DTYPE_IQ3_XXS: GQT.IQ3_XXS, fmt.DTYPE_IQ3_S: GQT.IQ3_S,
                            fmt.DTYPE_IQ1_S: GQT.IQ1_S, fmt.DTYPE_IQ1_M: GQT.IQ1_M}
    assert Q.DTYPE_OF_GGML[GQT.Q6_K] == DTYPE_Q6_K
    for d in QUANT_DTYPES:   # the block sizes agree with gguf's
        assert gguf.GGML_QUANT_SIZES[Q.GGML_TYPES[d]] == fmt.DTYPE_BLOCKS[d]


# --------------------------------------------------------------------------- quantize

def golden_input(rows: int = 64, n: int = 1024) -> np.ndarray:
    """A fixed input made with integer arithmetic only (the same on every platform and
    numpy version): near-gaussian sums of four uniforms, and rows of other kinds (heavy
    tails, sparse, positive only, negative only, a few levels with rounding ties, a scale
    per sub-block), an all-zero row, a constant row, an outlier."""
    idx = np.arange(rows * n * 4, dtype=np.uint64)
    v = (idx * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)) \
        * np.uint64(0x9E3779B97F4A7C15)
    u = ((v >> np.uint64(40)).astype(np.float64) / float(1 << 24)).reshape(rows, n, 4)
    g = u.sum(axis=2) - 2.0
    kind = np.arange(rows) % 8
    x = g * 0.05
    x[kind == 1] = g[kind == 1] ** 3 * 0.01
    x[kind == 2] = np.where(u[kind == 2, :, 0] < 0.6, 0.0, g[kind == 2])
    x[kind == 3] = u[kind == 3, :, 0] + 0.5
    x[kind == 4] = -u[kind == 4, :, 1] * 0.1
    x[kind == 5] = np.round(g[kind == 5] * 4) / 8
    x[kind == 6] = g[kind == 6] * 2.0 ** (np.arange(n) // 32 % 7 - 3)
    x[7] = 0.0
    x[15] = 0.25
    x[23, 37] = 40.0
    return x.astype(np.float32)


# sha256 of what ggml's quantize_row_*_ref wrote (llama.cpp as vendored by llama-cpp-python
# 0.3.36, libggml-base.so called through ctypes)
# on golden_input(); our quantize gave the same bytes when these were recorded.
GOLDEN = {
    DTYPE_Q8_0: "fde5f8bdb2f85130f75d09461756a598318a4aee972a7410565f3893fbd772a9",
    DTYPE_Q4_K: "f7b1175af2c8818b774e17990509f6e71ecda421941da58c1594eec75b2a2267",
    DTYPE_Q5_K: "2ebe03cc910ec50a7b19394665e87bea90052b37a23ab94d3132bb401ad54d84",
    DTYPE_Q6_K: "11bd93c72ea7b8ca8fe4fc9e363ae3dacd31dde33d09acd1c2325f59a3abab3d",
    # quantize_row_mxfp4_ref of the same libggml-base (recorded 2026 on the mxfp4 branch)
    DTYPE_MXFP4: "7d546363203d59e0dc3d0d8f0c35b24bdec4ab098b0cefdbad18b1becb31fbf4",
    # quantize_row_q4_0_ref / q4_1 / q5_0 / q5_1 of the same libggml-base (ggml_quantize_chunk
    # without an importance matrix)
    DTYPE_Q4_0: "a6e03423aa75812c6de9597c21b7e78d96791f2a24e497f2168e4baa96dc0997",
    DTYPE_Q4_1: "3c4c0c24fa98e5c7da324b0cac9a8e2f601559064eb3cb1eaa157c87cac44782",
    DTYPE_Q5_0: "300a900e447ee61f0648be9d5c97753c697f79f04074f2bb09be55fcfe5a6392",
    DTYPE_Q5_1: "1980f3164eb2eb186ab2e5013100f41e6bc4648852f5ac0dcb99a6fc738396dc",
    DTYPE_Q2_K: "7f548618983230ed8223edc20bb4174f5c1a3443b7c742f4958ea15b30a8af88",
    DTYPE_Q3_K: "8ccbc9a729a71a9c6fa7334840bfd3b26e9d63d5a71540b0545b2b04b04681f7",
}


@pytest.mark.parametrize("dtype", WRITABLE, ids=NAMES.get)
def test_quantize_matches_llama_cpp_reference_bytes(dtype):
    x = golden_input()
    assert 0.03 < float(x[0].std()) < 0.045          # the input is what it was
    q = Q.quantize(x, dtype)
    assert q.dtype == np.uint8 and q.shape == (64, fmt.row_nbytes(dtype, 1024))
    assert hashlib.sha256(q.tobytes()).hexdigest() == GOLDEN[dtype]


@pytest.mark.parametrize("rows,n,scale", [(5, 96, 1.0), (33, 4096, 0.02), (1, 32, 1e-4)])
def test_q8_0_is_gguf_quantize(rows, n, scale):
    x = (np.random.default_rng(rows).standard_normal((rows, n)) * scale).astype(np.float32)
    x[0, :32] = 0.0                          # a zero block
    x[-1, -32:] = np.float32(0.5) * np.arange(32, dtype=np.float32)   # ties at .5
    want = gguf.quants.quantize(x, GQT.Q8_0)
    got = Q.quantize(x, DTYPE_Q8_0)
    assert got.shape == want.shape and np.array_equal(got, want)
    assert same_bits(Q.dequantize(got, DTYPE_Q8_0, n), gguf.quants.dequantize(want, GQT.Q8_0))


@pytest.mark.parametrize("dtype", GGUF_QUANTIZERS, ids=NAMES.get)
@pytest.mark.parametrize("rows,n,scale", [(5, 96, 1.0), (33, 1024, 0.02), (2, 32, 1e-4), (3, 64, 2e3)])
def test_quantize_is_gguf_quantize(dtype, rows, n, scale):
    """0 bytes different from gguf-py's ports of quantize_row_q{4,5}_{0,1}_ref (and Q8_0):
    zero, constant, one-sign and tie blocks included."""
    x = (np.random.default_rng(rows + dtype).standard_normal((rows, n)) * scale).astype(np.float32)
    x[0, :32] = 0.0
    x[-1, -32:] = np.float32(scale / 8) * np.arange(32, dtype=np.float32)   # a positive ramp
    if n >= 64:
        x[0, 32:64] = np.float32(-scale)                                     # constant negative
    got = Q.quantize(x, dtype)
    want = gguf.quants.quantize(x, Q.GGML_TYPES[dtype])
    assert got.shape == want.shape and np.array_equal(got, want)
    assert same_bits(Q.dequantize(got, dtype, n), gguf.quants.dequantize(want, Q.GGML_TYPES[dtype]))


@pytest.mark.parametrize("dtype", [d for d in QUANT_DTYPES if d not in WRITABLE], ids=NAMES.get)
def test_read_only_types_refuse_to_quantize(dtype):
    with pytest.raises(NotImplementedError, match="read .* but not written"):
        Q.quantize(np.zeros((1, 256), np.float32), dtype)


# rms error / rms value on unit gaussians; llama.cpp's own figures are about 0.004, 0.07,
# 0.035, 0.018; each bound is under the next-coarser type's error
# (MXFP4, 4-bit e2m1 with a power-of-two scale: about 0.115; Q4_0 0.085, Q4_1 0.078, Q5_0
# 0.042, Q5_1 0.038, Q2_K 0.29, Q3_K 0.15)
RMSE_BOUND = {DTYPE_Q8_0: 0.008, DTYPE_Q4_K: 0.085, DTYPE_Q5_K: 0.045, DTYPE_Q6_K: 0.022,
              DTYPE_MXFP4: 0.13, DTYPE_Q4_0: 0.1, DTYPE_Q4_1: 0.09, DTYPE_Q5_0: 0.05, DTYPE_Q5_1: 0.045,
              DTYPE_Q2_K: 0.33, DTYPE_Q3_K: 0.17}
RMSE_FLOOR = {DTYPE_Q8_0: 0.002, DTYPE_Q4_K: 0.05, DTYPE_Q5_K: 0.025, DTYPE_Q6_K: 0.012,
              DTYPE_MXFP4: 0.09, DTYPE_Q4_0: 0.06, DTYPE_Q4_1: 0.05, DTYPE_Q5_0: 0.025, DTYPE_Q5_1: 0.02,
              DTYPE_Q2_K: 0.25, DTYPE_Q3_K: 0.12}


@pytest.mark.parametrize("dtype", WRITABLE, ids=NAMES.get)
def test_round_trip_error_within_the_type_bound(dtype):
    x = np.random.default_rng(3).standard_normal((31, 2048)).astype(np.float32)
    y = Q.dequantize(Q.quantize(x, dtype), dtype, 2048)
    rel = float(np.sqrt(np.mean((y - x) ** 2)))
    assert RMSE_FLOOR[dtype] < rel < RMSE_BOUND[dtype], rel
    # no element is off by more than a step of its block's grid
    be = {DTYPE_Q6_K: 16, DTYPE_Q2_K: 16, DTYPE_Q3_K: 16}.get(dtype, 32)
    # MXFP4: at most half its block's amax (the clip of [6, 8) scale units to 6)
    levels = {DTYPE_Q8_0: 254, DTYPE_Q4_K: 15, DTYPE_Q5_K: 31, DTYPE_Q6_K: 63, DTYPE_MXFP4: 3,
              DTYPE_Q4_0: 15, DTYPE_Q4_1: 15, DTYPE_Q5_0: 31, DTYPE_Q5_1: 31, DTYPE_Q2_K: 3,
              DTYPE_Q3_K: 7}[dtype]
    xb = x.reshape(-1, be)
    span = (xb.max(1) - np.minimum(xb.min(1), 0))[:, None]
    assert (np.abs(y - x).reshape(-1, be) <= 1.5 * span / levels).all()


@pytest.mark.parametrize("dtype", WRITABLE, ids=NAMES.get)
def test_quantize_is_deterministic_and_row_independent(dtype):
    x = (np.random.default_rng(5).standard_normal((9, 1024)) * 0.03).astype(np.float32)
    a = Q.quantize(x, dtype, threads=1)
    assert np.array_equal(a, Q.quantize(x, dtype, threads=3))
    assert np.array_equal(a, Q.quantize(x.copy(), dtype))
    assert np.array_equal(a[4:6], Q.quantize(x[4:6], dtype))
    assert np.array_equal(a[0], Q.quantize(x[0], dtype)[0])    # a 1-D row


@pytest.mark.parametrize("dtype", GRID_DTYPES, ids=NAMES.get)
def test_edge_rows(dtype):
    n = 512
    rng = np.random.default_rng(11)
    x = np.zeros((6, n), np.float32)
    x[1] = 0.37                                           # constant positive
    x[2] = -1.25                                          # constant negative
    x[3] = -rng.uniform(0.01, 1.0, n)                     # negative only
    x[4] = rng.standard_normal(n) * 0.01
    x[4, 100] = 1000.0                                    # one huge outlier
    x[5] = rng.uniform(0.5, 1.0, n)                       # positive only
    q = Q.quantize(x, dtype)
    y = Q.dequantize(q, dtype, n)
    assert np.isfinite(y).all()
    assert (y[0] == 0).all()                              # all zero stays exactly zero
    if dtype in (DTYPE_Q8_0, DTYPE_Q4_1, DTYPE_Q5_1):   # d = 0 (and m = 0): every byte 0
        assert not q[0].any()
    tol = {DTYPE_Q8_0: 0.005, DTYPE_Q4_K: 0.02, DTYPE_Q5_K: 0.01, DTYPE_Q6_K: 0.01,
           DTYPE_Q4_0: 0.02, DTYPE_Q4_1: 0.02, DTYPE_Q5_0: 0.01, DTYPE_Q5_1: 0.01,
           DTYPE_Q2_K: 0.1, DTYPE_Q3_K: 0.05}[dtype]
    np.testing.assert_allclose(y[1], 0.37, rtol=tol)
    np.testing.assert_allclose(y[2], -1.25, rtol=tol)
    assert (y[3] <= 1e-6).all()
    half_step = {DTYPE_Q8_0: 0.005, DTYPE_Q4_K: 0.06, DTYPE_Q5_K: 0.03, DTYPE_Q6_K: 0.02,
                 DTYPE_Q4_0: 0.07, DTYPE_Q4_1: 0.035, DTYPE_Q5_0: 0.035, DTYPE_Q5_1: 0.02,
                 DTYPE_Q2_K: 0.3, DTYPE_Q3_K: 0.15}[dtype]
    np.testing.assert_allclose(y[3], x[3], atol=half_step)
    assert abs(y[4, 100] - 1000.0) <= 1000.0 * tol
    # the blocks without the outlier keep their own precision (a K type's super-block of
    # 256 shares one scale of its sub-block scales, so the outlier's whole super-block
    # coarsens)
    far = np.r_[256:512] if fmt.DTYPE_BLOCKS[dtype][0] == 256 else np.r_[0:96, 128:512]
    assert np.abs(y[4, far] - x[4, far]).max() < {DTYPE_Q2_K: 0.012, DTYPE_Q3_K: 0.006}.get(dtype, 0.003)
    np.testing.assert_allclose(y[5], x[5], atol=half_step)


def test_quantize_refusals():
    with pytest.raises(ValueError, match="NaN or infinity"):
        Q.quantize(np.full((1, 256), np.nan, np.float32), DTYPE_Q4_K)
    with pytest.raises(ValueError, match="NaN or infinity"):
        Q.quantize(np.full((1, 32), np.inf, np.float32), DTYPE_Q8_0)
    with pytest.raises(fmt.FormatError, match="multiple of 256"):
        Q.quantize(np.zeros((2, 288), np.float32), DTYPE_Q6_K)
    with pytest.raises(fmt.FormatError, match="multiple of 32"):
        Q.quantize(np.zeros((2, 20), np.float32), DTYPE_Q8_0)
    with pytest.raises(ValueError, match=r"\[rows, n\]"):
        Q.quantize(np.zeros((2, 2, 32), np.float32), DTYPE_Q8_0)


def test_float_pass_through():
    x = np.random.default_rng(1).standard_normal((3, 40)).astype(np.float32)
    assert np.array_equal(Q.to_stored(x, DTYPE_F32), x)
    assert Q.to_stored(x, DTYPE_F16).dtype == np.float16
    assert Q.to_stored(x, DTYPE_BF16).dtype == np.uint16
    for d in (DTYPE_F32, DTYPE_F16, DTYPE_BF16):
        s = Q.to_stored(x, d)
        back = Q.from_stored(s, d, 40)
        assert back.shape == (3, 40) and back.dtype == np.float32
        assert same_bits(back, fmt.stored_to_f32(s, d))
        assert same_bits(Q.from_stored(s.view(np.uint8), d, 40), back)   # raw bytes too
    assert same_bits(Q.from_stored(Q.to_stored(x[:, :32], DTYPE_Q8_0), DTYPE_Q8_0, 32),
                     Q.dequantize(Q.quantize(x[:, :32], DTYPE_Q8_0), DTYPE_Q8_0, 32))


# --------------------------------------------------------------------------- mixes

def test_use_more_bits():
    assert [i for i in range(32) if mixes.use_more_bits(i, 32)] == \
        [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [mixes.use_more_bits(i, 4) for i in range(4)] == [False, False, True, True]


def _mix(mix, name, shape, n_layers=32, n_experts=8, layer=None, **kw):
    return mixes.mix_dtype(mix, name, shape, layer=layer, n_layers=n_layers, n_experts=n_experts,
                       **kw)


def test_q4_k_m_on_a_32_layer_8_expert_model():
    """Mixtral-8x7B's shapes: what llama-quantize Q4_K_M writes for it."""
    H, I, V, KV = 4096, 14336, 32000, 1024
    more = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}
    assert _mix("q4_k_m", "token_embd.weight", (V, H)) == DTYPE_Q4_K
    assert _mix("q4_k_m", "output.weight", (V, H)) == DTYPE_Q6_K
    assert _mix("q4_k_m", "output_norm.weight", (H,)) == DTYPE_F32
    for n in range(32):
        b = f"blk.{n}."
        assert _mix("q4_k_m", b + "attn_q.weight", (H, H)) == DTYPE_Q4_K
        assert _mix("q4_k_m", b + "attn_k.weight", (KV, H)) == DTYPE_Q8_0      # 8 experts
        assert _mix("q4_k_m", b + "attn_v.weight", (KV, H)) == DTYPE_Q8_0      # 8 experts
        assert _mix("q4_k_m", b + "attn_output.weight", (H, H)) == DTYPE_Q5_K  # 8 experts
        assert _mix("q4_k_m", b + "ffn_gate_exps", (8, I, H)) == DTYPE_Q4_K
        assert _mix("q4_k_m", b + "ffn_up_exps.weight", (8, I, H)) == DTYPE_Q4_K
        assert _mix("q4_k_m", b + "ffn_down_exps", (8, H, I)) == \
            (DTYPE_Q6_K if n in more else DTYPE_Q4_K)
        assert _mix("q4_k_m", b + "ffn_gate_inp.weight", (8, H)) == DTYPE_F32
        assert _mix("q4_k_m", b + "attn_norm.weight", (H,)) == DTYPE_F32
    # the layer may be given instead of parsed
    assert _mix("q4_k_m", "ffn_down_exps", (8, H, I), layer=6) == DTYPE_Q6_K
    assert _mix("q4_k_m", "ffn_down_exps", (8, H, I), layer=7) == DTYPE_Q4_K


def test_q4_k_m_on_a_4_layer_model_with_dense_and_shared_ffns():
    H, I = 2048, 1408
    # not 8 experts: attn_v by use_more_bits, attn_k / attn_output default
    got = {n: (_mix("q4_k_m", f"blk.{n}.attn_v.weight", (256, H), n_layers=4, n_experts=60),
               _mix("q4_k_m", f"blk.{n}.ffn_down_exps", (60, H, 1536), n_layers=4, n_experts=60),
               _mix("q4_k_m", f"blk.{n}.ffn_down_shexp", (H, 5632), n_layers=4, n_experts=60),
               _mix("q4_k_m", f"blk.{n}.ffn_down", (H, 5632), n_layers=4, n_experts=60))
           for n in range(4)}
    K4, K6 = DTYPE_Q4_K, DTYPE_Q6_K
    assert got == {0: (K4, K4, K4, K4), 1: (K4, K4, K4, K4), 2: (K6, K6, K6, K6),
                   3: (K6, K6, K6, K6)}
    for name in ("attn_k.weight", "attn_output.weight", "attn_q.weight", "ffn_gate_shexp",
                 "ffn_up_shexp", "ffn_gate", "ffn_up"):
        assert _mix("q4_k_m", f"blk.3.{name}", (H, H), n_layers=4, n_experts=60) == K4, name
    assert _mix("q4_k_m", "blk.0.ffn_shared_gate.weight", (1, H), n_layers=4) == DTYPE_F32
    assert _mix("q4_k_m", "blk.0.ffn_gate_inp_shexp.weight", (1, H), n_layers=4) == DTYPE_F32
    assert _mix("q4_k_m", "blk.0.attn_q.bias", (H,), n_layers=4) == DTYPE_F32
    assert _mix("q4_k_m", "blk.0.attn_q_norm.weight", (128,), n_layers=4) == DTYPE_F32
    # tied embeddings: token_embd takes the output's type
    assert _mix("q4_k_m", "token_embd.weight", (1000, H), n_layers=4, tied=True) == K6
    assert _mix("q4_k_m", "token_embd.weight", (1000, H), n_layers=4) == K4


def test_q3_k_m_and_q2_k_on_a_4_layer_model():
    """llama_tensor_get_type's Q3_K_M and Q2_K choices (no importance matrix)."""
    H = 2048
    for n in range(4):
        b = f"blk.{n}."
        kw = {"n_layers": 32, "n_experts": 60}
        assert _mix("q3_k_m", b + "attn_q.weight", (H, H), **kw) == DTYPE_Q3_K
        assert _mix("q3_k_m", b + "attn_v.weight", (512, H), **kw) == (DTYPE_Q5_K if n < 2 else DTYPE_Q4_K)
        assert _mix("q3_k_m", b + "attn_output.weight", (H, H), **kw) == DTYPE_Q4_K
        assert _mix("q3_k_m", b + "ffn_down_exps", (60, H, 1536), **kw) == \
            (DTYPE_Q5_K if n < 2 else DTYPE_Q4_K)                               # layer < 32 / 16
        assert _mix("q3_k_m", b + "ffn_up_exps", (60, 1536, H), **kw) == DTYPE_Q3_K
        assert _mix("q2_k", b + "attn_q.weight", (H, H), **kw) == DTYPE_Q2_K
        assert _mix("q2_k", b + "attn_v.weight", (512, H), n_gqa=4, **kw) == DTYPE_Q4_K
        assert _mix("q2_k", b + "attn_v.weight", (512, H), n_gqa=2, **kw) == DTYPE_Q3_K
        assert _mix("q2_k", b + "attn_output.weight", (H, H), **kw) == DTYPE_Q3_K
        assert _mix("q2_k", b + "ffn_down_exps", (60, H, 1536), **kw) == DTYPE_Q3_K
        assert _mix("q2_k", b + "ffn_gate_exps", (60, 1536, H), **kw) == DTYPE_Q2_K
        # 8 experts: attn_k / attn_v Q8_0, attn_output Q5_K
        for mix in ("q3_k_m", "q2_k"):
            assert _mix(mix, b + "attn_k.weight", (512, H), n_experts=8) == DTYPE_Q8_0
            assert _mix(mix, b + "attn_v.weight", (512, H), n_experts=8) == DTYPE_Q8_0
            assert _mix(mix, b + "attn_output.weight", (H, H), n_experts=8) == DTYPE_Q5_K
    for mix, t in (("q3_k_m", DTYPE_Q3_K), ("q2_k", DTYPE_Q2_K)):
        assert _mix(mix, "token_embd.weight", (1000, H)) == t
        assert _mix(mix, "output.weight", (1000, H)) == DTYPE_Q6_K
        assert _mix(mix, "token_embd.weight", (1000, H), tied=True) == DTYPE_Q6_K
    assert {"q3_k_m", "q2_k"} <= set(mixes.MIXES)


def test_q8_0_and_q4_k_mixes_are_uniform():
    for mix, t in (("q8_0", DTYPE_Q8_0), ("q4_k", DTYPE_Q4_K), ("q4_0", DTYPE_Q4_0),
                   ("q4_1", DTYPE_Q4_1), ("q5_0", DTYPE_Q5_0), ("q5_1", DTYPE_Q5_1)):
        for name, shape in (("token_embd.weight", (100, 512)), ("output.weight", (100, 512)),
                            ("blk.3.attn_v.weight", (256, 512)),
                            ("blk.3.ffn_down_exps", (8, 512, 1024)),
                            ("blk.3.attn_output.weight", (512, 512))):
            assert _mix(mix, name, shape) == t
        assert _mix(mix, "blk.3.ffn_gate_inp.weight", (8, 512)) == DTYPE_F32
        assert _mix(mix, "blk.3.ffn_norm.weight", (512,)) == DTYPE_F32


def test_fallbacks():
    # llama.cpp's tensor_type_fallback: 256 does not divide the row: Q4_K -> Q5_0, Q5_K ->
    # Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K -> Q4_0, IQ4_XS -> IQ4_NL; 32 does not either -> F16
    assert _mix("q4_k", "blk.0.attn_q.weight", (96, 96)) == DTYPE_Q5_0
    assert _mix("q4_k_m", "blk.2.attn_v.weight", (96, 96), n_layers=4) == DTYPE_Q8_0  # Q6_K ->
    assert _mix("q4_k_m", "blk.0.attn_output.weight", (96, 96), n_experts=8) == DTYPE_Q5_1
    assert _mix("q4_k_m", "blk.0.attn_q.weight", (96, 96), n_experts=8) == DTYPE_Q5_0
    assert _mix("q4_k_m", "output.weight", (100, 96)) == DTYPE_Q8_0
    assert _mix("q4_k_m", "blk.0.ffn_down_exps", (8, 96, 20)) == DTYPE_F16
    assert _mix("q8_0", "blk.0.attn_q.weight", (20, 20)) == DTYPE_F16
    assert _mix("q8_0", "blk.0.attn_q.weight", (20, 64)) == DTYPE_Q8_0   # rows only count
    assert _mix("q4_0", "blk.0.attn_q.weight", (20, 20)) == DTYPE_F16
    assert _mix("q2_k", "blk.0.attn_q.weight", (160, 160), n_experts=4) == DTYPE_Q4_0
    assert _mix("q3_k_m", "blk.5.attn_q.weight", (160, 160), n_experts=4) == DTYPE_Q4_0
    assert mixes.fallback_dtype(DTYPE_Q6_K, 512) == DTYPE_Q6_K
    assert mixes.fallback_dtype(DTYPE_Q6_K, 480) == DTYPE_Q8_0
    assert mixes.fallback_dtype(DTYPE_Q5_K, 40) == DTYPE_F16
    assert mixes.fallback_dtype(DTYPE_Q5_K, 160) == DTYPE_Q5_1
    assert mixes.fallback_dtype(DTYPE_Q3_K, 96) == DTYPE_Q4_0
    assert mixes.fallback_dtype(DTYPE_IQ4_XS, 96) == DTYPE_IQ4_NL
    assert mixes.fallback_dtype(DTYPE_BF16, 7) == DTYPE_BF16
    with pytest.raises(ValueError, match="mix 'q3_k'"):
        _mix("q3_k", "output.weight", (10, 256))
