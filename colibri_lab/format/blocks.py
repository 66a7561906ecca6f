"""Block quantization of the `.colibri` format version 2 (docs/format.md, "Version 2"):
Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K (written and read) and
IQ4_NL, IQ4_XS and the grid types IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M
(read; `codebook` gives their grids), byte for byte ggml's blocks.

What lives here:

- `quantize(x, dtype)`: float32 rows -> the stored bytes of a quantized dtype. Our own
  numpy implementation of llama.cpp's reference quantizers (ggml-quants.c
  `quantize_row_q8_0_ref`, `quantize_row_q4_K_ref`, `quantize_row_q5_K_ref`,
  `quantize_row_q6_K_ref`, `quantize_row_mxfp4_ref`, `quantize_row_q{4,5}_{0,1}_ref`,
  `quantize_row_q2_K_ref`, `quantize_row_q3_K_ref`, i.e. what `llama-quantize` does
  without an importance
  matrix). Every step is the C code's float32 arithmetic in the C code's order (sums
  accumulated element by element, no fused multiply-add, `nearest_int`'s
  1.5 * 2^23 rounding trick emulated), so the bytes are the ones the C reference writes
  on a build without FMA contraction (ggml-base is compiled so). Vectorised over all
  blocks of a chunk, and chunks run on a small thread pool (numpy releases the GIL).
- `dequantize(raw, dtype, n)`: stored bytes -> float32, bit for bit the `gguf`
  package's `gguf.quants.dequantize` (float32 products in ggml's order, none fused).
- `to_stored` / `from_stored`: the same for every dtype, the float ones included.
- `GGML_TYPES`: our dtype ids <-> `gguf.GGMLQuantizationType`.
- MXFP4: `quantize_mxfp4` / `dequantize_mxfp4` (the two above for DTYPE_MXFP4), and
  `mxfp4_from_hf(blocks, scales)`: a transformers MXFP4 checkpoint's `*_blocks` /
  `*_scales` (gpt-oss) repacked into our block bytes, the same values, no requantization.
- `mix_dtype(mix, name, shape, ...)`: the dtype a converter mix ("q8_0", "q4_k",
  "q4_k_m") gives a tensor; "q4_k_m" is llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M as
  `llama_tensor_get_type` decides it (docs/quantization.md, "Converter mixes").
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import spec as fmt
from .spec import (DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_IQ4_NL, DTYPE_IQ4_XS, DTYPE_MXFP4,
                   DTYPE_Q2_K, DTYPE_Q3_K, DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q4_K, DTYPE_Q5_0,
                   DTYPE_Q5_1, DTYPE_Q5_K, DTYPE_Q6_K, DTYPE_Q8_0, QUANT_DTYPES)


def _ggml_tables() -> tuple[dict, dict]:
    """(GGML_TYPES, DTYPE_OF_GGML), built on first use: importing the gguf package costs
    seconds (it imports mistral_common where that is installed), and the quantizers do not
    need it."""
    import gguf

    gqt = gguf.GGMLQuantizationType
    types = {DTYPE_F32: gqt.F32, DTYPE_F16: gqt.F16, DTYPE_BF16: gqt.BF16, DTYPE_Q8_0: gqt.Q8_0,
             DTYPE_Q4_K: gqt.Q4_K, DTYPE_Q5_K: gqt.Q5_K, DTYPE_Q6_K: gqt.Q6_K,
             DTYPE_Q4_0: gqt.Q4_0, DTYPE_Q4_1: gqt.Q4_1, DTYPE_Q5_0: gqt.Q5_0,
             DTYPE_Q5_1: gqt.Q5_1, DTYPE_Q2_K: gqt.Q2_K, DTYPE_Q3_K: gqt.Q3_K,
             DTYPE_IQ4_NL: gqt.IQ4_NL, DTYPE_IQ4_XS: gqt.IQ4_XS,
             **{d: gqt[fmt.DTYPE_NAMES[d].upper()] for d in fmt.GRID_DTYPES}}
    if hasattr(gqt, "MXFP4"):  # GGML_TYPE_MXFP4 = 39 (gguf >= 0.17)
        types[DTYPE_MXFP4] = gqt.MXFP4
    return types, {v: k for k, v in types.items()}


def __getattr__(name: str):
    """`GGML_TYPES` (our dtype id -> gguf.GGMLQuantizationType) and `DTYPE_OF_GGML` (the
    inverse), imported from gguf on first access."""
    if name in ("GGML_TYPES", "DTYPE_OF_GGML"):
        types, inverse = _ggml_tables()
        globals().update(GGML_TYPES=types, DTYPE_OF_GGML=inverse)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


QK_K = 256
QK8_0 = 32
GROUP_MAX_EPS = np.float32(1e-15)
_F0 = np.float32(0.0)
_MAGIC = np.float32(12582912.0)   # 1.5 * 2^23, nearest_int's rounding constant

# elements per quantization work item (a multiple of 256); small enough that a work
# item's temporaries stay in the L2 cache
_WORK_ELEMS = 1 << 16
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def default_threads() -> int:
    """Threads `quantize` uses: COLIBRI_QUANT_THREADS, else the CPUs this process may run on
    (at most 8)."""
    env = os.environ.get("COLIBRI_QUANT_THREADS")
    if env:
        return max(1, int(env))
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def _get_pool(n: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < n:
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="colibri-quant")
        return _pool


# --------------------------------------------------------------------------- helpers

def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int for float32 values, exactly: (v + 1.5*2^23) in float32, then the
    low 23 bits of the sum minus 2^22 (round half to even for |v| <= 2^22, and the
    trick's own answer beyond, as in the C code built with NDEBUG). Returns int32."""
    t = (v + _MAGIC).view(np.int32)
    return (t & np.int32(0x7FFFFF)) - np.int32(0x400000)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 -> IEEE binary16 (nearest, ties to even: GGML_FP32_TO_FP16), as 2 bytes each."""
    return np.ascontiguousarray(v.astype("<f2")).view(np.uint8).reshape(v.shape + (2,))


def _f16_round(v: np.ndarray) -> np.ndarray:
    """GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v))."""
    return v.astype("<f2").astype(np.float32)


def _as_rows(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2:
        raise ValueError(f"quantize takes [rows, n] values, got shape {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


# --------------------------------------------------------------------------- Q8_0

def _q8_0_blocks(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_0_ref over blocks [nb, 32] -> [nb, 34]."""
    amax = np.abs(x).max(axis=1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, np.float32(1) / d, _F0).astype(np.float32)
    x0 = x * idv[:, None]
    # roundf: half away from zero (trunc, then the fraction decides; both exact)
    t = np.trunc(x0)
    q = t + np.where(np.abs(x0 - t) >= np.float32(0.5), np.sign(x0), _F0)
    out = np.empty((x.shape[0], 34), np.uint8)
    out[:, :2] = _f16_bytes(d)
    out[:, 2:] = q.astype(np.int8).view(np.uint8)
    return out


# --------------------------------------------------------------------------- Q4_K / Q5_K

def _make_qkx2(X: np.ndarray, W: np.ndarray, nmax: int, rmin: float, rdelta: float,
               nstep: int, use_mad: bool = False):
    """make_qkx2_quants(n, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep,
    use_mad) for every sub-block at once. X, W: [n, ns] (element-major, so that a
    reduction over axis 0 is the C code's element-by-element sum). Returns
    (scale [ns], the_min [ns], L [n, ns] float32 holding 0..nmax)."""
    f32 = np.float32
    add = np.add.reduce
    mn = np.minimum(X.min(axis=0), _F0)          # if (min > 0) min = 0
    mx = X.max(axis=0)
    flat = mx == mn
    sum_w = add(W, axis=0)
    sum_x = add(W * X, axis=0)
    nm = f32(nmax)
    with np.errstate(all="ignore"):
        iscale = nm / (mx - mn)
        scale = f32(1) / iscale
        L = np.rint(iscale * (X - mn))
        np.clip(L, 0, nm, out=L)
        diff = scale * L
        diff += mn
        diff -= X
        if use_mad:
            np.abs(diff, out=diff)
        else:
            diff *= diff
        diff *= W
        best = add(diff, axis=0)
        # The L of the best step is recomputed at the end from that step's iscale and
        # min (the same float32 operations), so that a step only updates vectors.
        b_isc, b_mn = iscale, mn
        T = np.empty_like(X)
        La = np.empty_like(X)
        for i in range(nstep + 1):
            c = f32(rmin) + f32(rdelta) * f32(i) + nm
            isc = c / (mx - mn)
            np.subtract(X, mn, out=La)
            La *= isc
            np.rint(La, out=La)
            np.clip(La, 0, nm, out=La)
            np.multiply(W, La, out=T)                 # w*l
            s_l = add(T, axis=0)
            s_xl = add(np.multiply(T, X, out=diff), axis=0)
            T *= La                                   # (w*l)*l
            s_l2 = add(T, axis=0)
            D = sum_w * s_l2 - s_l * s_l
            ts = (sum_w * s_xl - sum_x * s_l) / D
            tm = (s_l2 * sum_x - s_l * s_xl) / D
            pos = tm > 0
            if pos.any():
                tm[pos] = 0
                ts[pos] = (s_xl / s_l2)[pos]
            np.multiply(La, ts, out=diff)
            diff += tm
            diff -= X
            if use_mad:
                np.abs(diff, out=diff)
            else:
                diff *= diff
            diff *= W
            cur = add(diff, axis=0)
            better = (D > 0) & (cur < best)
            if better.any():
                best = np.where(better, cur, best)
                scale = np.where(better, ts, scale)
                b_isc = np.where(better, isc, b_isc)
                b_mn = np.where(better, mn, b_mn)
                mn = np.where(better, tm, mn)
        np.subtract(X, b_mn, out=L)
        L *= b_isc
        np.rint(L, out=L)
        np.clip(L, 0, nm, out=L)
    if flat.any():
        L[:, flat] = 0
        scale = np.where(flat, _F0, scale)
        mn = np.where(flat, np.minimum(X.min(axis=0), _F0), mn)
    return scale.astype(f32), (-mn).astype(f32), L


def _qk_blocks(x: np.ndarray, nmax: int) -> np.ndarray:
    """quantize_row_q4_K_ref (nmax 15) / quantize_row_q5_K_ref (nmax 31) over blocks
    [nb, 256] -> [nb, 144] / [nb, 176]."""
    f32 = np.float32
    nb = x.shape[0]
    ns = nb * 8
    X = np.ascontiguousarray(x.reshape(ns, 32).T)          # [32, ns]
    sum_x2 = np.add.reduce(X * X, axis=0)
    av_x = np.sqrt(sum_x2 / f32(32))
    W = av_x + np.abs(X)
    if nmax == 15:
        scales, mins, L = _make_qkx2(X, W, 15, -1.0, 0.1, 20)
    else:
        scales, mins, L = _make_qkx2(X, W, 31, -0.5, 0.1, 15)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    max_scale = np.maximum(scales.max(axis=1), _F0)
    max_min = np.maximum(mins.max(axis=1), _F0)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, _F0).astype(f32)
        inv_min = np.where(max_min > 0, f32(63) / max_min, _F0).astype(f32)
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    sc12 = np.empty((nb, 12), np.uint8)
    sc12[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    sc12[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    sc12[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    dq = max_scale / f32(63)
    dmq = max_min / f32(63)
    d16, dm16 = _f16_round(dq), _f16_round(dmq)
    # requantize with the stored scales; a sub-block whose scale is 0 keeps its L
    d = d16[:, None] * ls.astype(f32)                      # [nb, 8]
    dm = dm16[:, None] * lm.astype(f32)
    LT = L.T.reshape(nb, 8, 32)
    xs = x.reshape(nb, 8, 32)
    with np.errstate(all="ignore"):
        lq = _nearest_int((xs + dm[:, :, None]) / d[:, :, None])
    np.clip(lq, 0, nmax, out=lq)
    Lf = np.where((d != 0)[:, :, None], lq, LT.astype(np.int32)).astype(np.uint8)
    Lf = Lf.reshape(nb, 4, 2, 32)                           # [block, pair, half, l]
    lo, hi = Lf[:, :, 0, :], Lf[:, :, 1, :]
    out = np.empty((nb, 144 if nmax == 15 else 176), np.uint8)
    out[:, 0:2] = _f16_bytes(dq)
    out[:, 2:4] = _f16_bytes(dmq)
    out[:, 4:16] = sc12
    if nmax == 15:
        out[:, 16:144] = ((lo & 0xF) | (hi << 4)).reshape(nb, 128)
    else:
        sh = (np.arange(4, dtype=np.uint8) * 2)[None, :, None]
        qh = (((lo >> 4) & 1) << sh) | (((hi >> 4) & 1) << (sh + 1))
        out[:, 16:48] = np.bitwise_or.reduce(qh, axis=1)
        out[:, 48:176] = ((lo & 0xF) | ((hi & 0xF) << 4)).reshape(nb, 128)
    return out


# --------------------------------------------------------------------------- Q2_K / Q3_K

def _q2_k_blocks(x: np.ndarray) -> np.ndarray:
    """quantize_row_q2_K_ref over blocks [nb, 256] -> [nb, 84]: per sub-block of 16,
    make_qkx2_quants(16, 3, weights |x|, rmin -0.5, rdelta 0.1, 15 steps, mean absolute
    error); the scales and mins as 4-bit multiples of max / 15; the codes requantized with
    the stored f16 scales (a sub-block whose scale is 0 keeps its codes)."""
    f32 = np.float32
    nb = x.shape[0]
    ns = nb * 16
    X = np.ascontiguousarray(x.reshape(ns, 16).T)           # [16, ns]
    scales, mins, L = _make_qkx2(X, np.abs(X), 3, -0.5, 0.1, 15, use_mad=True)
    scales = scales.reshape(nb, 16)
    mins = mins.reshape(nb, 16)
    max_scale = np.maximum(scales.max(axis=1), _F0)
    max_min = np.maximum(mins.max(axis=1), _F0)
    q4 = f32(15)
    with np.errstate(divide="ignore", invalid="ignore"):
        isc = np.where(max_scale > 0, q4 / max_scale, _F0).astype(f32)
        imn = np.where(max_min > 0, q4 / max_min, _F0).astype(f32)
    ls = np.where((max_scale > 0)[:, None], _nearest_int(isc[:, None] * scales), 0)
    lm = np.where((max_min > 0)[:, None], _nearest_int(imn[:, None] * mins), 0)
    sc = ((ls & 0xFF) | ((lm << 4) & 0xFF)).astype(np.uint8)
    dq = np.where(max_scale > 0, max_scale / q4, _F0).astype(f32)
    dmq = np.where(max_min > 0, max_min / q4, _F0).astype(f32)
    d = _f16_round(dq)[:, None] * (sc & np.uint8(0xF)).astype(f32)          # [nb, 16]
    dm = _f16_round(dmq)[:, None] * (sc >> np.uint8(4)).astype(f32)
    with np.errstate(all="ignore"):
        lq = _nearest_int((x.reshape(nb, 16, 16) + dm[:, :, None]) / d[:, :, None])
    np.clip(lq, 0, 3, out=lq)
    Lf = np.where((d != 0)[:, :, None], lq, L.T.reshape(nb, 16, 16).astype(np.int32)).astype(np.uint8)
    Lf = Lf.reshape(nb, 2, 4, 32)                                            # [block, half, c, l]
    out = np.empty((nb, 84), np.uint8)
    out[:, 0:16] = sc
    out[:, 16:80] = (Lf[:, :, 0] | (Lf[:, :, 1] << 2) | (Lf[:, :, 2] << 4) | (Lf[:, :, 3] << 6)).reshape(nb, 64)
    out[:, 80:82] = _f16_bytes(dq)
    out[:, 82:84] = _f16_bytes(dmq)
    return out


def _make_q3_rmse(X: np.ndarray, nmax: int):
    """make_q3_quants(16, nmax, x, L, do_rmse=true) for every group at once. X: [16, ng].
    Returns (scale [ng], L [16, ng] int32 holding 0..2*nmax-1; 0 for an all-zero group). The
    element-by-element refinement runs in the C code's order, every group in step, a group
    leaving the loop after a pass that changed none of its codes."""
    f32 = np.float32
    n, ng = X.shape
    A = np.abs(X)
    idx = np.argmax(A, axis=0)                         # the first largest |x| (strict >)
    cols = np.arange(ng)
    amax = A[idx, cols]
    mx = X[idx, cols]
    zero = amax < GROUP_MAX_EPS
    with np.errstate(all="ignore"):
        iscale = f32(-nmax) / mx
        L = np.clip(_nearest_int(iscale * X), -nmax, nmax - 1)      # [16, ng] int32
        Lf = L.astype(f32)
        W = X * X
        sumlx = np.zeros(ng, f32)
        suml2 = np.zeros(ng, f32)
        for i in range(n):
            sumlx = sumlx + (W[i] * X[i]) * Lf[i]
            suml2 = suml2 + (W[i] * Lf[i]) * Lf[i]
        active = ~zero
        for _ in range(5):
            changed = np.zeros(ng, bool)
            for i in range(n):
                w, xi, li = W[i], X[i], Lf[i]
                slx = sumlx - (w * xi) * li
                sl2 = suml2 - (w * li) * li
                new_l = np.clip(_nearest_int((xi * sl2) / slx), -nmax, nmax - 1)
                nl = new_l.astype(f32)
                slx2 = slx + (w * xi) * nl
                sl22 = sl2 + (w * nl) * nl
                take = (active & (slx > 0) & (new_l != L[i]) & (sl22 > 0)
                        & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22))
                if take.any():
                    L[i] = np.where(take, new_l, L[i])
                    Lf[i] = np.where(take, nl, Lf[i])
                    sumlx = np.where(take, slx2, sumlx)
                    suml2 = np.where(take, sl22, suml2)
                    changed |= take
            active &= changed
            if not active.any():
                break
        scale = np.where(suml2 > 0, sumlx / suml2, _F0).astype(f32)
    L = L + nmax
    if zero.any():
        L[:, zero] = 0
        scale = np.where(zero, _F0, scale)
    return scale, L


def _q3_k_blocks(x: np.ndarray) -> np.ndarray:
    """quantize_row_q3_K_ref over blocks [nb, 256] -> [nb, 110]: per sub-block of 16,
    make_q3_quants(16, 4, rmse); the scales as 6-bit multiples of the largest-magnitude one
    / -32; the codes requantized with the stored scales (a zero scale keeps its codes), their
    bit 2 into hmask."""
    f32 = np.float32
    nb = x.shape[0]
    X = np.ascontiguousarray(x.reshape(nb * 16, 16).T)      # [16, nb*16]
    scales, L = _make_q3_rmse(X, 4)
    scales = scales.reshape(nb, 16)
    a = np.abs(scales)
    ib = np.argmax(a, axis=1)
    rows = np.arange(nb)
    max_scale = np.where(a[rows, ib] > 0, scales[rows, ib], _F0)
    has = max_scale != 0
    with np.errstate(all="ignore"):
        iscale = np.where(has, f32(-32) / max_scale, _F0).astype(f32)
        l = np.clip(_nearest_int(iscale[:, None] * scales).astype(np.int8).astype(np.int32), -32, 31) + 32
        l = np.where(has[:, None], l, 0).astype(np.uint8)          # [nb, 16], 0..63
        dq = np.where(has, f32(1) / iscale, _F0).astype(f32)
    sc12 = np.zeros((nb, 12), np.uint8)
    sc12[:, 0:8] = (l[:, 0:8] & 0xF) | ((l[:, 8:16] & 0xF) << 4)
    hi = l >> 4                                                    # [nb, 16], 0..3
    for j in range(16):
        sc12[:, 8 + j % 4] |= hi[:, j] << np.uint8(2 * (j // 4))
    sc12 = np.where(has[:, None], sc12, 0).astype(np.uint8)
    d = _f16_round(dq)[:, None] * (l.astype(np.int32) - 32).astype(f32)    # [nb, 16]
    with np.errstate(all="ignore"):
        lq = _nearest_int(x.reshape(nb, 16, 16) / d[:, :, None])
    lq = np.clip(lq, -4, 3) + 4
    Lf = np.where((d != 0)[:, :, None], lq, L.T.reshape(nb, 16, 16)).astype(np.uint8).reshape(nb, 256)
    hb = (Lf > 3).reshape(nb, 8, 32)                               # bit b of hmask[m]: element 32b + m
    hmask = np.zeros((nb, 32), np.uint8)
    for b in range(8):
        hmask |= hb[:, b].astype(np.uint8) << np.uint8(b)
    Lf = np.where(Lf > 3, Lf - 4, Lf).reshape(nb, 2, 4, 32)
    out = np.empty((nb, 110), np.uint8)
    out[:, 0:32] = hmask
    out[:, 32:96] = (Lf[:, :, 0] | (Lf[:, :, 1] << 2) | (Lf[:, :, 2] << 4) | (Lf[:, :, 3] << 6)).reshape(nb, 64)
    out[:, 96:108] = sc12
    out[:, 108:110] = _f16_bytes(dq)
    return out


# --------------------------------------------------------------------------- Q6_K

def _make_qx_rmse1(X: np.ndarray, nmax: int):
    """make_qx_quants(16, nmax, x, L, rmse_type=1, qw=NULL) for every group at once.
    X: [16, ng]. Returns (scale [ng], L [16, ng] int32 holding 0..2*nmax-1, or 0 for an
    all-zero group)."""
    f32 = np.float32
    add = np.add.reduce
    ng = X.shape[1]
    A = np.abs(X)
    idx = np.argmax(A, axis=0)                    # the first largest |x| (strict >)
    cols = np.arange(ng)
    amax = A[idx, cols]
    mx = X[idx, cols]
    zero = amax < GROUP_MAX_EPS
    W = X * X
    WX = W * X
    lo, hi = f32(-nmax), f32(nmax - 1)
    T = np.empty_like(X)
    with np.errstate(all="ignore"):
        iscale = f32(-nmax) / mx
        lbest = np.rint(iscale * X)
        np.clip(lbest, lo, hi, out=lbest)
        sumlx = add(np.multiply(WX, lbest, out=T), axis=0)
        np.multiply(W, lbest, out=T)
        T *= lbest
        suml2 = add(T, axis=0)
        scale = np.where(suml2 != 0, sumlx / suml2, _F0).astype(f32)
        best = scale * sumlx
        b_isc = iscale
        l = np.empty_like(X)
        for i in range(-9, 10):
            if i == 0:
                continue
            isc = -(f32(nmax) + f32(0.1) * f32(i)) / mx
            np.multiply(X, isc, out=l)
            np.rint(l, out=l)
            np.clip(l, lo, hi, out=l)
            slx = add(np.multiply(WX, l, out=T), axis=0)
            np.multiply(W, l, out=T)
            T *= l
            sl2 = add(T, axis=0)
            better = (sl2 > 0) & (slx * slx > best * sl2)
            if better.any():
                b_isc = np.where(better, isc, b_isc)
                scale = np.where(better, slx / sl2, scale)
                best = np.where(better, scale * slx, best)
        # the L of the best trial, recomputed from its iscale
        np.multiply(X, b_isc, out=lbest)
        np.rint(lbest, out=lbest)
        np.clip(lbest, lo, hi, out=lbest)
    if zero.any():
        lbest[:, zero] = 0
    L = lbest.astype(np.int32) + nmax
    if zero.any():
        L[:, zero] = 0
        scale = np.where(zero, _F0, scale)
    return scale.astype(f32), L


def _q6_k_blocks(x: np.ndarray) -> np.ndarray:
    """quantize_row_q6_K_ref over blocks [nb, 256] -> [nb, 210]."""
    f32 = np.float32
    nb = x.shape[0]
    X = np.ascontiguousarray(x.reshape(nb * 16, 16).T)     # [16, nb*16]
    scales, L = _make_qx_rmse1(X, 32)
    scales = scales.reshape(nb, 16)
    a = np.abs(scales)
    ib = np.argmax(a, axis=1)
    rows = np.arange(nb)
    max_abs = np.maximum(a[rows, ib], _F0)
    max_scale = np.where(max_abs > 0, scales[rows, ib], _F0)
    empty = max_abs < GROUP_MAX_EPS
    with np.errstate(all="ignore"):
        iscale = f32(-128) / max_scale
        dq = f32(1) / iscale
        sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
        d = _f16_round(dq)[:, None] * sc.astype(f32)         # [nb, 16]
        lq = _nearest_int(x.reshape(nb, 16, 16) / d[:, :, None])
    np.clip(lq, -32, 31, out=lq)
    lq += 32
    LT = L.T.reshape(nb, 16, 16)
    Lf = np.where((d != 0)[:, :, None], lq, LT).astype(np.uint8).reshape(nb, 2, 4, 32)
    out = np.empty((nb, 210), np.uint8)
    q1, q2, q3, q4 = Lf[:, :, 0], Lf[:, :, 1], Lf[:, :, 2], Lf[:, :, 3]   # [nb, 2, 32]
    ql = np.empty((nb, 2, 64), np.uint8)
    ql[:, :, :32] = (q1 & 0xF) | ((q3 & 0xF) << 4)
    ql[:, :, 32:] = (q2 & 0xF) | ((q4 & 0xF) << 4)
    qh = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    out[:, 0:128] = ql.reshape(nb, 128)
    out[:, 128:192] = qh.reshape(nb, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = _f16_bytes(dq)
    if empty.any():
        out[empty] = 0
    return out


# --------------------------------------------------------------------------- Q4_0 / Q4_1 / Q5_0 / Q5_1

def _first_absmax(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude of each block [nb, 32] (the first one on a tie: the C
    scan's strict `amax < fabsf(v)`), shape [nb, 1]."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """Codes [nb, 32] (0..31) -> 16 bytes: element j < 16 in the low nibble, j + 16 in the
    high one (the fifth bit dropped: it goes to qh)."""
    return (q[:, :16] & np.uint8(0x0F)) | (q[:, 16:] << np.uint8(4))


def _high_bits(q: np.ndarray) -> np.ndarray:
    """The fifth bit of each of 32 codes as Q5_0/Q5_1's qh: bit j of a little-endian uint32."""
    return np.packbits((q >> np.uint8(4)) & np.uint8(1), axis=1, bitorder="little")


def _legacy_blocks(x: np.ndarray, nbits: int, with_min: bool) -> np.ndarray:
    """quantize_row_q4_0_ref / q4_1 / q5_0 / q5_1 over blocks [nb, 32]: Q4_0 / Q5_0 take
    d = max / -8 (-16) of the value of largest magnitude and q = min(top, (int)(x / d +
    8.5 (16.5))); Q4_1 / Q5_1 d = (max - min) / 15 (31), m = min, q = (int)((x - min) / d +
    0.5); the reciprocal 1 / d multiplies (0 for d = 0), float32 throughout, as the C code
    and gguf-py's quantize_blocks."""
    f32 = np.float32
    top = (1 << nbits) - 1
    with np.errstate(divide="ignore"):
        if with_min:
            mn = x.min(axis=1, keepdims=True)
            mx = x.max(axis=1, keepdims=True)
            d = (mx - mn) / f32(top)
            idv = np.where(d == 0, _F0, f32(1) / d).astype(f32)
            q = np.trunc((x - mn) * idv + f32(0.5))
        else:
            d = _first_absmax(x) / f32(-(1 << (nbits - 1)))
            idv = np.where(d == 0, _F0, f32(1) / d).astype(f32)
            q = np.trunc(x * idv + f32((1 << (nbits - 1)) + 0.5))
    q = np.clip(q, 0, top).astype(np.uint8)
    parts = [_f16_bytes(d[:, 0])]
    if with_min:
        parts.append(_f16_bytes(mn[:, 0]))
    if nbits == 5:
        parts.append(_high_bits(q))
    parts.append(_nibble_pairs(q))
    return np.concatenate(parts, axis=1)



# --------------------------------------------------------------------------- MXFP4

#: e2m1 values doubled, indexed by the 4-bit code (ggml's kvalues_mxfp4): bit 3 is the sign,
#: bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}; code 8 (-0) is 0
MXFP4_K2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
QK_MXFP4 = 32
#: ggml's kvalues_iq4nl: the value of an IQ4_NL / IQ4_XS 4-bit code, times the scale
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def e8m0_to_f32_half(e: np.ndarray) -> np.ndarray:
    """ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128) as float32 (subnormal for e < 2). e = 255,
    NaN in OCP, is 2^127 here, as in ggml and gguf-py. Element = K2[code] * this."""
    e = np.asarray(e, np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _mxfp4_blocks(x: np.ndarray) -> np.ndarray:
    """quantize_row_mxfp4_ref over blocks [nb, 32] -> [nb, 17]: e = floor(log2(amax)) - 2 + 127
    (0 for an all-zero block; float32 log2, as log2f), so the largest magnitude lands in
    [4, 8) * 2^(e - 127) and 6 is the nearest code for it; then each value's code is the
    one of the 16 whose k2 * 2^(e - 128) is nearest in float32, the first on a tie (ggml's
    best_index_mxfp4 scan, numpy's argmin). ggml converts a negative e (amax < 2^-125) to
    uint8 with undefined behaviour; here it is clamped to 0 (the smallest scale)."""
    f32 = np.float32
    amax = np.abs(x).max(axis=1)
    with np.errstate(divide="ignore"):
        lg = np.floor(np.log2(amax))                       # float32 (-inf for 0)
    ef = np.where(amax > 0, lg - f32(2) + f32(127), f32(0))
    e = np.clip(ef, 0, 255).astype(np.uint8)
    d = e8m0_to_f32_half(e)                                # [nb]
    kv = MXFP4_K2.astype(f32)
    err = np.abs((d[:, None] * kv[None, :])[:, None, :] - x[:, :, None])   # [nb, 32, 16]
    code = np.argmin(err, axis=2).astype(np.uint8)         # first minimum, as the C scan
    out = np.empty((x.shape[0], 17), np.uint8)
    out[:, 0] = e
    out[:, 1:] = code[:, :16] | (code[:, 16:] << np.uint8(4))
    return out


def quantize_mxfp4(x: np.ndarray, *, threads: int | None = None) -> np.ndarray:
    """float32 rows [rows, n] (n a multiple of 32) -> MXFP4 block bytes [rows, n / 32 * 17],
    byte for byte ggml's quantize_row_mxfp4_ref (and gguf-py's MXFP4.quantize)."""
    return quantize(x, DTYPE_MXFP4, threads=threads)


def dequantize_mxfp4(raw: np.ndarray, n: int) -> np.ndarray:
    """MXFP4 block bytes -> float32 [rows, n]: K2[code] * 2^(e - 128), one float32 product per
    element, bit for bit ggml's dequantize_row_mxfp4 and the engine's cb_dequant_mxfp4."""
    return dequantize(raw, DTYPE_MXFP4, n)


def mxfp4_from_hf(blocks, scales) -> np.ndarray:
    """A transformers MXFP4 checkpoint tensor pair -> our MXFP4 rows, values unchanged.

    `blocks`: uint8 [..., rows, G, 16] (the `*_blocks` tensor: 32 e2m1 codes per group, the
    even element in the low nibble, the odd one in the high nibble); `scales`: uint8
    [..., rows, G] (`*_scales`: e8m0, value = e2m1 * 2^(scale - 127)), as
    transformers.integrations.mxfp4.convert_moe_packed_tensors reads them. Returns uint8
    [..., rows, G * 17]: row r is the K = 32 G elements of row r (the same rows, in order,
    no transposition) in ggml's block_mxfp4 layout (scale byte, then element j < 16 in the low
    nibble of qs[j] and j + 16 in its high nibble). A pure repack of nibbles and bytes.

    A scale byte of 255 (NaN in OCP; transformers computes 2^128, i.e. inf) is refused: the
    block format reads it as 2^127 (ggml), so its values would not be the checkpoint's."""
    b = np.asarray(blocks)
    sc = np.asarray(scales)
    if b.dtype != np.uint8 or sc.dtype != np.uint8:
        raise ValueError(f"mxfp4_from_hf: blocks and scales must be uint8, got {b.dtype}, {sc.dtype}")
    if b.ndim < 2 or b.shape[-1] != 16 or b.shape[:-1] != sc.shape:
        raise ValueError(f"mxfp4_from_hf: blocks [..., rows, G, 16] and scales [..., rows, G] "
                         f"expected, got {b.shape} and {sc.shape}")
    if (sc == 255).any():
        raise ValueError("mxfp4_from_hf: a scale byte is 255 (NaN in OCP MXFP4), which the "
                         "block format cannot hold with the same value")
    codes = np.stack([b & np.uint8(0x0F), b >> np.uint8(4)], axis=-1).reshape(*b.shape[:-1], 32)
    out = np.empty((*sc.shape, 17), np.uint8)
    out[..., 0] = sc
    out[..., 1:] = codes[..., :16] | (codes[..., 16:] << np.uint8(4))
    return out.reshape(*sc.shape[:-1], sc.shape[-1] * 17)


_BLOCK_FN = {DTYPE_Q8_0: _q8_0_blocks, DTYPE_Q4_K: lambda b: _qk_blocks(b, 15),
             DTYPE_Q5_K: lambda b: _qk_blocks(b, 31), DTYPE_Q6_K: _q6_k_blocks,
             DTYPE_MXFP4: _mxfp4_blocks,
             DTYPE_Q4_0: lambda b: _legacy_blocks(b, 4, False),
             DTYPE_Q4_1: lambda b: _legacy_blocks(b, 4, True),
             DTYPE_Q5_0: lambda b: _legacy_blocks(b, 5, False),
             DTYPE_Q5_1: lambda b: _legacy_blocks(b, 5, True),
             DTYPE_Q2_K: _q2_k_blocks, DTYPE_Q3_K: _q3_k_blocks}
#: the block types `quantize` writes (llama.cpp's reference quantizers); IQ4_NL, IQ4_XS and
#: the grid types are read (GGUF import) but not written here
WRITABLE_DTYPES = tuple(_BLOCK_FN)


# --------------------------------------------------------------------------- public API

def quantize(x: np.ndarray, dtype: int, *, threads: int | None = None) -> np.ndarray:
    """float32 rows [rows, n] -> the stored bytes [rows, row_nbytes] (uint8) of quantized
    `dtype` (one of WRITABLE_DTYPES), byte for byte llama.cpp's reference quantizer (no
    importance matrix); NotImplementedError for a block type only read. n must be a whole number of the dtype's blocks. Values must be
    finite. A float dtype (f32, f16, bf16) gives its storage array instead (`to_stored`).
    `threads`: worker threads (default `default_threads()`); the bytes do not depend on it.
    """
    if dtype not in QUANT_DTYPES:
        return to_stored(x, dtype)
    if dtype not in _BLOCK_FN:
        raise NotImplementedError(f"quantize: {fmt.DTYPE_NAMES[dtype]} blocks are read (GGUF "
                                  f"import) but not written; writable block types: "
                                  f"{', '.join(fmt.DTYPE_NAMES[d] for d in _BLOCK_FN)}")
    x = _as_rows(x)
    rows, n = x.shape
    be, bb = fmt.DTYPE_BLOCKS[dtype]
    rb = fmt.row_nbytes(dtype, n)             # raises for a row that is not whole blocks
    if not np.isfinite(x).all():
        raise ValueError("quantize: the values hold NaN or infinity; a block-quantized "
                         "tensor cannot represent them")
    blocks = x.reshape(-1, be)
    nblk = blocks.shape[0]
    out = np.empty((nblk, bb), np.uint8)
    fn = _BLOCK_FN[dtype]
    per = max(1, _WORK_ELEMS // be)
    items = [(s, min(nblk, s + per)) for s in range(0, nblk, per)]
    nt = default_threads() if threads is None else max(1, int(threads))

    def work(se):
        s, e = se
        out[s:e] = fn(blocks[s:e])

    if nt == 1 or len(items) == 1:
        for it in items:
            work(it)
    else:
        for f in [_get_pool(nt).submit(work, it) for it in items]:
            f.result()
    return out.reshape(rows, rb)


def dequantize(raw: np.ndarray, dtype: int, n: int) -> np.ndarray:
    """Stored bytes of `dtype` ([rows, row_nbytes] or flat uint8) -> float32 [rows, n], bit
    for bit `gguf.quants.dequantize`. Float dtypes are accepted too (`from_stored`)."""
    if dtype not in QUANT_DTYPES:
        return from_stored(raw, dtype, n)
    rb = fmt.row_nbytes(dtype, n)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if raw.size % rb:
        raise ValueError(f"dequantize: {raw.size} bytes is not a whole number of "
                         f"{fmt.DTYPE_NAMES[dtype]} rows of {n} ({rb} bytes)")
    rows = raw.size // rb
    be, bb = fmt.DTYPE_BLOCKS[dtype]
    b = raw.reshape(-1, bb)
    with np.errstate(all="ignore"):      # inf / NaN scales give what they give
        y = _dequantize_blocks(b, dtype)
    return np.ascontiguousarray(y, dtype=np.float32).reshape(rows, n)


def codebook(name: str) -> np.ndarray:
    """ggml's grid of a grid type's codebook (`fmt.CODEBOOK_SHAPES`: "iq2_xxs", ..., "iq1_s"),
    as a .colibri file stores it: int8 [entries, width], the entries' values (IQ1: -1, 0, 1;
    the others' magnitudes, below 128). From the `gguf` package's copy of ggml's grids."""
    import gguf.quants as gq

    cls = getattr(gq, name.upper())
    cls.init_grid()
    return cls.grid.reshape(fmt.CODEBOOK_SHAPES[name]).astype(np.int8)


def _dequantize_blocks(b: np.ndarray, dtype: int) -> np.ndarray:
    nb = b.shape[0]
    f32 = np.float32
    if dtype in fmt.GRID_DTYPES:      # the gguf package's own (its grids and their order)
        import gguf.quants as gq
        return gq.dequantize(b, _ggml_tables()[0][dtype]).reshape(nb, -1)
    if dtype == DTYPE_MXFP4:
        d = e8m0_to_f32_half(b[:, 0])[:, None]                          # [nb, 1]
        qs = b[:, 1:17]
        code = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)
        return MXFP4_K2[code].astype(f32) * d
    if dtype in (DTYPE_Q4_0, DTYPE_Q4_1, DTYPE_Q5_0, DTYPE_Q5_1, DTYPE_IQ4_NL):
        # f16 d [, f16 m] [, qh: bit j of a little-endian uint32] then 16 nibble bytes
        d = b[:, 0:2].copy().view("<f2").astype(f32)                   # [nb, 1]
        one = dtype in (DTYPE_Q4_1, DTYPE_Q5_1)
        five = dtype in (DTYPE_Q5_0, DTYPE_Q5_1)
        o = 4 if one else 2
        qs = b[:, o + (4 if five else 0):]
        q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)     # [nb, 32]
        if five:
            q = q | (np.unpackbits(b[:, o:o + 4], axis=1, bitorder="little") << np.uint8(4))
        if dtype == DTYPE_IQ4_NL:
            return d * IQ4NL_VALUES[q].astype(f32)
        if one:
            return (d * q.astype(f32)) + b[:, 2:4].copy().view("<f2").astype(f32)
        return d * (q.astype(np.int8) - np.int8(16 if five else 8)).astype(f32)
    if dtype == DTYPE_Q2_K:
        sc = b[:, 0:16]
        qs = b[:, 16:80].reshape(nb, 2, 1, 32)
        d = b[:, 80:82].copy().view("<f2").astype(f32)
        dmin = b[:, 82:84].copy().view("<f2").astype(f32)
        dl = (d * (sc & np.uint8(0xF)).astype(f32))[:, :, None]          # [nb, 16, 1]
        ml = (dmin * (sc >> np.uint8(4)).astype(f32))[:, :, None]
        q = (qs >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & np.uint8(3)
        return dl * q.reshape(nb, 16, 16).astype(f32) - ml
    if dtype == DTYPE_Q3_K:
        hm = b[:, 0:32].reshape(nb, 1, 32)
        qs = b[:, 32:96].reshape(nb, 2, 1, 32)
        s = b[:, 96:108]
        d = b[:, 108:110].copy().view("<f2").astype(f32)
        lo = np.concatenate([s[:, 0:8] & np.uint8(0xF), s[:, 0:8] >> np.uint8(4)], axis=1)
        hi = (s[:, None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]) & np.uint8(3)
        scale = (lo | (hi.reshape(nb, 16) << np.uint8(4))).astype(np.int8) - np.int8(32)
        dl = (d * scale.astype(f32))[:, :, None]                          # [nb, 16, 1]
        low = (qs >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & np.uint8(3)
        hbit = (hm >> np.arange(8, dtype=np.uint8)[None, :, None]) & np.uint8(1)   # [nb, 8, 32]
        q = low.reshape(nb, 256).astype(np.int8) - ((hbit ^ np.uint8(1)) << np.uint8(2)).reshape(nb, 256).astype(np.int8)
        return dl * q.reshape(nb, 16, 16).astype(f32)
    if dtype == DTYPE_IQ4_XS:
        d = b[:, 0:2].copy().view("<f2").astype(f32)
        sh = b[:, 2:4].copy().view("<u2")                                  # [nb, 1]
        sl = b[:, 4:8]
        lo = np.stack([sl & np.uint8(0xF), sl >> np.uint8(4)], axis=2).reshape(nb, 8)
        hi = ((sh >> (2 * np.arange(8, dtype=np.uint16))[None, :]) & np.uint16(3)).astype(np.uint8)
        scale = (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)
        dl = (d * scale.astype(f32))[:, :, None]                          # [nb, 8, 1]
        qs = b[:, 8:136].reshape(nb, 8, 16)
        q = np.concatenate([qs & np.uint8(0xF), qs >> np.uint8(4)], axis=2)   # [nb, 8, 32]
        return dl * IQ4NL_VALUES[q].astype(f32)
    if dtype == DTYPE_Q8_0:
        d = b[:, 0:2].copy().view("<f2").astype(f32)                   # [nb, 1]
        q = b[:, 2:].view(np.int8).astype(f32)
        y = q * d
    elif dtype in (DTYPE_Q4_K, DTYPE_Q5_K):
        d = b[:, 0:2].copy().view("<f2").astype(f32)
        dmin = b[:, 2:4].copy().view("<f2").astype(f32)
        s = b[:, 4:16]
        sc = np.empty((nb, 8), np.uint8)
        m = np.empty((nb, 8), np.uint8)
        sc[:, :4] = s[:, 0:4] & 63
        m[:, :4] = s[:, 4:8] & 63
        sc[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
        m[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
        d1 = (d * sc.astype(f32))[:, :, None]                           # [nb, 8, 1]
        m1 = (dmin * m.astype(f32))[:, :, None]
        if dtype == DTYPE_Q4_K:
            qs = b[:, 16:144].reshape(nb, 4, 1, 32)
            q = (qs >> np.array([0, 4], np.uint8)[None, None, :, None]) & 0xF
        else:
            qh = b[:, 16:48].reshape(nb, 1, 1, 32)
            qs = b[:, 48:176].reshape(nb, 4, 1, 32)
            q = (qs >> np.array([0, 4], np.uint8)[None, None, :, None]) & 0xF
            bit = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)
            q = q | (((qh >> bit) & 1) << 4)
        q = q.reshape(nb, 8, 32).astype(f32)
        y = d1 * q - m1
    else:  # Q6_K
        ql = b[:, 0:128].reshape(nb, 2, 1, 64)
        qh = b[:, 128:192].reshape(nb, 2, 1, 32)
        sc = b[:, 192:208].view(np.int8).astype(f32)
        d = b[:, 208:210].copy().view("<f2").astype(f32)
        lo = (ql >> np.array([0, 4], np.uint8)[None, None, :, None]) & 0xF    # [nb,2,2,64]
        lo = lo.reshape(nb, 2, 4, 32)        # c = 0: ql[l], 1: ql[l+32], 2: ql[l]>>4, 3: ql[l+32]>>4
        hi = (qh >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
        q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
        ds = (d * sc)[:, :, None]                                          # [nb, 16, 1]
        y = ds * q.reshape(nb, 16, 16).astype(f32)
    return y


def to_stored(x: np.ndarray, dtype: int, *, threads: int | None = None) -> np.ndarray:
    """float32 values [rows, n] -> what a tensor of `dtype` stores: the quantized bytes
    [rows, row_nbytes] for a block type, else the float storage array (f32, f16 nearest
    even, bf16 bits as uint16), shape [rows, n]."""
    if dtype in QUANT_DTYPES:
        return quantize(x, dtype, threads=threads)
    return fmt.f32_to_stored(np.asarray(x, dtype=np.float32), dtype)


def from_stored(raw: np.ndarray, dtype: int, n: int) -> np.ndarray:
    """The inverse of `to_stored`: stored values of `dtype` -> float32 [rows, n]."""
    if dtype in QUANT_DTYPES:
        return dequantize(raw, dtype, n)
    st = fmt.DTYPE_NUMPY[dtype]
    raw = np.ascontiguousarray(raw)
    if raw.dtype != st:
        raw = raw.view(np.uint8).reshape(-1).view(st)
    return fmt.stored_to_f32(raw.reshape(-1, n), dtype)
