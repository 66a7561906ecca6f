"""MXFP4 (COLIBRI_DTYPE_MXFP4, ggml's block_mxfp4; docs/format.md, docs/quantization.md):

* the engine's reference dequantizer (colibri_dequantize, core/quant.c) equals the numpy one
  (colibri_lab.format.blocks) and gguf-py's bit for bit, on random blocks with every code and every
  scale byte 0..255;
* mxfp4_from_hf + our dequantizer equals transformers' convert_moe_packed_tensors (the
  gpt-oss checkpoint reader) value for value, on random blocks and scales;
* quantize_mxfp4 writes gguf-py's (= ggml's quantize_row_mxfp4_ref) bytes, and its error is
  within half a code step of the block (or the clip above 6 scale units);
* a GGUF with an MXFP4 tensor (gguf.GGUFWriter) reads back through the importer's reader as
  DTYPE_MXFP4 with the bytes unchanged.
"""
import ctypes

import numpy as np
import pytest

from colibri_lab.format import reader as fmt_reader, spec as fmt
from colibri_lab.format import blocks as quants

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType
HAS_GGUF_MXFP4 = hasattr(QT, "MXFP4")

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _engine_dequant(raw: np.ndarray, n: int) -> np.ndarray:
    from colibri_lab.runtime import _native
    out = np.empty(n, dtype=np.float32)
    src = np.ascontiguousarray(raw)
    st = _native.lib.colibri_dequantize(fmt.DTYPE_MXFP4, src.ctypes.data_as(ctypes.c_void_p), n,
                                        out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    assert st == 0
    return out


def _all_codes_blocks(rng) -> np.ndarray:
    """256 x 4 blocks: every scale byte 0..255, four blocks each; the first of the four holds
    every code in both nibbles, the others random bytes."""
    raw = rng.integers(0, 256, size=(256 * 4, 17), dtype=np.uint8)
    raw[:, 0] = np.repeat(np.arange(256, dtype=np.uint8), 4)
    codes = np.arange(16, dtype=np.uint8)
    raw[0::4, 1:] = codes | (codes[::-1] << 4)
    return raw


def _ldexp_values(raw: np.ndarray) -> np.ndarray:
    """Independent decoding: e2m1 * 2^(e - 127) in float64, element j < 16 the low nibble of
    qs[j], j + 16 its high one; e = 255 as 2^127 times the doubled value (ggml)."""
    e = raw[:, 0].astype(np.int64)
    qs = raw[:, 1:]
    code = np.concatenate([qs & 15, qs >> 4], axis=1)
    v = E2M1[code]
    scale = np.where(e == 255, 2.0 ** 128, np.ldexp(1.0, e - 127))
    with np.errstate(over="ignore"):
        return (v * scale[:, None]).astype(np.float32)      # exact, or inf past FLT_MAX


def test_layout_tables():
    assert fmt.DTYPE_MXFP4 == 11 and fmt.DTYPE_NAMES[11] == "mxfp4"
    assert fmt.DTYPE_BLOCKS[fmt.DTYPE_MXFP4] == (32, 17)
    assert fmt.DTYPE_MXFP4 in fmt.QUANT_DTYPES
    assert fmt.row_nbytes(fmt.DTYPE_MXFP4, 2880) == 90 * 17
    assert np.array_equal(quants.MXFP4_K2, (2 * E2M1).astype(np.int8))
    if HAS_GGUF_MXFP4:
        assert int(QT.MXFP4) == 39 and quants.GGML_TYPES[fmt.DTYPE_MXFP4] == QT.MXFP4
        assert gguf.GGML_QUANT_SIZES[QT.MXFP4] == (32, 17)


def test_numpy_dequantizer_every_code_and_scale():
    raw = _all_codes_blocks(np.random.default_rng(1))
    got = quants.dequantize_mxfp4(raw, raw.shape[0] * 32).reshape(-1, 32)
    want = _ldexp_values(raw)
    assert np.array_equal(got, want)            # == : code 8 gives +0 (ggml), -0 here
    assert not np.isnan(got).any()
    if HAS_GGUF_MXFP4:
        with np.errstate(over="ignore"):                    # e >= 253: inf, as ours
            g = gguf.quants.dequantize(raw.reshape(-1), QT.MXFP4).reshape(-1, 32).astype(np.float32)
        assert np.array_equal(got.view(np.uint32), g.view(np.uint32))


def test_engine_dequantizer_equals_numpy_bit_for_bit():
    rng = np.random.default_rng(2)
    raw = _all_codes_blocks(rng)
    for n_blocks in (1, 3, 37, raw.shape[0]):
        r = raw[:n_blocks] if n_blocks < raw.shape[0] else raw
        got = _engine_dequant(r, n_blocks * 32)
        want = quants.dequantize_mxfp4(r, n_blocks * 32).reshape(-1)
        diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
        assert diff.size == 0, f"{diff.size} values differ, first at {diff[0]}: {got[diff[0]]!r} vs {want[diff[0]]!r}"
    # a length that is not whole blocks is refused
    from colibri_lab.runtime import _native
    out = np.empty(64, np.float32)
    src = np.ascontiguousarray(raw)
    assert _native.lib.colibri_dequantize(fmt.DTYPE_MXFP4, src.ctypes.data_as(ctypes.c_void_p), 33,
                                          out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))) != 0


@pytest.mark.parametrize("shape", [(3, 5, 4), (1, 7, 90), (2, 1, 1)])
def test_mxfp4_from_hf_equals_transformers(shape):
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    E, R, G = shape
    rng = np.random.default_rng(sum(shape))
    blocks = rng.integers(0, 256, size=(E, R, G, 16), dtype=np.uint8)
    blocks[0, 0, 0] = np.arange(16, dtype=np.uint8) * 17                            # every code
    scales = rng.integers(0, 255, size=(E, R, G), dtype=np.uint8)                     # not 255
    scales.reshape(-1)[:4] = [0, 1, 127, 254][:scales.size]
    hf = mx.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                       dtype=torch.float32)            # [E, K, R]: transposed
    hf = hf.transpose(1, 2).contiguous().numpy()                       # [E, R, K]
    rows = quants.mxfp4_from_hf(blocks, scales)
    assert rows.shape == (E, R, G * 17) and rows.dtype == np.uint8
    ours = quants.dequantize_mxfp4(rows.reshape(-1, G * 17), G * 32).reshape(E, R, G * 32)
    assert np.array_equal(ours, hf, equal_nan=False)   # the same values (+0 where HF has -0)
    # the engine reads the repacked rows as the same values too
    eng = _engine_dequant(rows, E * R * G * 32).reshape(E, R, G * 32)
    assert np.array_equal(eng, hf)


def test_mxfp4_from_hf_refusals():
    b = np.zeros((2, 3, 16), np.uint8)
    s = np.zeros((2, 3), np.uint8)
    assert quants.mxfp4_from_hf(b, s).shape == (2, 51)
    with pytest.raises(ValueError, match="255"):
        quants.mxfp4_from_hf(b, np.full((2, 3), 255, np.uint8))
    with pytest.raises(ValueError, match="expected"):
        quants.mxfp4_from_hf(b, np.zeros((2, 4), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        quants.mxfp4_from_hf(b.astype(np.int32), s)


def _rows(rng, rows, n):
    scale = rng.choice([1e-30, 1e-3, 0.02, 1.0, 300.0, 1e20], size=(rows, 1))
    x = (rng.standard_normal((rows, n)) * scale).astype(np.float32)
    x[0, :32] = 0.0                                           # an all-zero block
    x[0, 32:64] = np.float32(2.0) ** np.arange(-16, 16)       # powers of two (log2 exact)
    x[0, 64:96] = np.nextafter(np.float32(4.0), np.float32(0)) * np.linspace(-1, 1, 32, dtype=np.float32)
    x[1, :32] = np.float32(1.25) * np.float32(2.0) ** -140    # below 2^-125: e clamps to 0
    return x


def test_quantize_error_bound_and_round_trip():
    rng = np.random.default_rng(3)
    x = _rows(rng, 40, 320)
    q = quants.quantize_mxfp4(x)
    assert q.shape == (40, 170) and q.dtype == np.uint8
    y = quants.dequantize_mxfp4(q, 320)
    blocks, yb = x.reshape(-1, 32).astype(np.float64), y.reshape(-1, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        s = np.where(amax > 0, np.exp2(np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2), 0)
    s = np.maximum(s, 2.0 ** -127)              # the clamped scale of the tiniest blocks
    a = np.abs(blocks) / s                      # in scale units: codes are 0, .5, 1, 1.5, 2, 3, 4, 6
    half_gap = np.where(a < 2, 0.25, np.where(a < 4, 0.5, np.where(a <= 6, 1.0, a - 6)))
    err = np.abs(yb - blocks)
    assert (err <= half_gap * s * (1 + 1e-6) + 2.0 ** -149).all()
    # the codes' values are a fixed point: quantizing them again gives the same bytes
    assert np.array_equal(quants.quantize_mxfp4(y), q)
    # threads do not change the bytes
    assert np.array_equal(quants.quantize_mxfp4(x, threads=3), q)
    with pytest.raises(ValueError):
        quants.quantize_mxfp4(np.full((1, 32), np.inf, np.float32))


@pytest.mark.skipif(not HAS_GGUF_MXFP4, reason="this gguf package has no MXFP4")
def test_quantize_equals_gguf_py():
    rng = np.random.default_rng(4)
    x = _rows(rng, 64, 2880)
    x[1, :32] = rng.standard_normal(32).astype(np.float32)   # the clamp is ours alone (UB in ggml)
    ours = quants.quantize_mxfp4(x)
    theirs = gguf.quants.quantize(x, QT.MXFP4)
    assert np.array_equal(ours, theirs)
    assert np.array_equal(quants.dequantize_mxfp4(ours, 2880),
                          gguf.quants.dequantize(theirs, QT.MXFP4).reshape(64, 2880))


@pytest.mark.skipif(not HAS_GGUF_MXFP4, reason="this gguf package has no MXFP4")
def test_gguf_tensor_round_trip(tmp_path):
    """An MXFP4 tensor written by gguf.GGUFWriter reads back through the importer's reader
    (gguf_import.GgufFile) as DTYPE_MXFP4, its bytes those we quantized, and the engine
    dequantizes them to gguf-py's values."""
    from colibri_lab.conversion import gguf as gguf_import
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 3, 96)) * 0.1).astype(np.float32)     # [experts, rows, K]
    q = quants.quantize_mxfp4(x.reshape(-1, 96)).reshape(6, 3, 51)
    p = tmp_path / "mx.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_tensor("blk.0.ffn_up_exps.weight", q, raw_dtype=QT.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "MXFP4" in gguf_import.SUPPORTED_GGML_TYPES
    g = gguf_import.GgufFile(str(p))
    t = g.tensors["blk.0.ffn_up_exps.weight"]
    assert t.type_name == "MXFP4" and t.dtype == fmt.DTYPE_MXFP4
    assert t.shape == (6, 3, 96)
    assert np.array_equal(np.asarray(t.raw).reshape(-1), q.reshape(-1))
    want = gguf.quants.dequantize(q.reshape(-1), QT.MXFP4).reshape(-1).astype(np.float32)
    assert np.array_equal(_engine_dequant(np.asarray(t.raw), want.size).view(np.uint32), want.view(np.uint32))


def test_converter_mix_mxfp4(tmp_path):
    """`dtype="mxfp4"`: the routed experts' gate/up/down MXFP4 (quantize_mxfp4 of the
    checkpoint's values, row by row), every other matrix BF16, norms and routers F32; the
    engine runs the file, and its logits follow the f32 file's."""
    from pathlib import Path

    import colibri_lab
    from colibri_lab.conversion.checkpoint import Checkpoint

    src = Path(__file__).resolve().parents[1] / "data" / "tiny-mixtral"
    path = colibri_lab.convert(src, tmp_path / "mx.colibri", dtype="mxfp4", progress=False)
    ref = colibri_lab.convert(src, tmp_path / "f32.colibri", dtype="f32", progress=False)
    info = fmt_reader.inspect(path)
    dts = {t.name: t.dtype for t in info.tensors}
    assert dts["blk.0.ffn_gate_exps"] == dts["blk.0.ffn_down_exps"] == "mxfp4"
    assert dts["blk.0.attn_q.weight"] == "bf16" and dts["blk.0.ffn_gate_inp.weight"] == "f32"
    assert dts["blk.0.attn_norm.weight"] == "f32"
    assert info.metadata["model.weight_dtype"] == "mxfp4"
    # expert 1's gate rows are quantize_mxfp4 of the checkpoint's w1
    ck = Checkpoint(str(src))
    name = next(n for n in ck.tensors if n.endswith("layers.0.block_sparse_moe.experts.1.w1.weight")
                or n.endswith("layers.0.mlp.experts.1.w1.weight"))
    t = ck.tensors[name]
    w1 = fmt.stored_to_f32(t.read_flat(0, t.numel), t.dtype_id).reshape(t.shape)
    raw = info.read_tensor("blk.0.ffn_gate_exps")
    I, H = w1.shape
    got = quants.dequantize(raw.reshape(-1), fmt.DTYPE_MXFP4, H).reshape(-1, I, H)[1]
    want = quants.dequantize(quants.quantize_mxfp4(w1).reshape(-1), fmt.DTYPE_MXFP4, H).reshape(I, H)
    np.testing.assert_array_equal(got, want)
    ids = list(range(3, 70))
    with colibri_lab.Engine(path) as e:
        a = e.forward(ids)
    with colibri_lab.Engine(ref) as e:
        b = e.forward(ids)
    assert np.isfinite(a).all() and (a.argmax(-1) == b.argmax(-1)).mean() > 0.5
