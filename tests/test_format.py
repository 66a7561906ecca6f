"""The .colibri writer and reader against docs/format.md: header round trip, checksums,
alignment, the packed expert layout (odd sizes, blocks that do not divide I), dtype
conversion (bf16 rounding equals torch), int8 routers, and the reader's refusals.

Models are small random Mixtrals made by transformers (save_pretrained), at odd shapes.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri_lab.format import reader as fmt_reader, spec as fmt  # noqa: E402
from colibri_lab.conversion.hf import convert  # noqa: E402
from colibri_lab.format.spec import FormatError  # noqa: E402
from colibri_lab.format.reader import inspect  # noqa: E402

ODD = dict(vocab_size=37, hidden_size=20, intermediate_size=13, num_hidden_layers=2,
           num_attention_heads=5, num_key_value_heads=1, head_dim=4, num_local_experts=3,
           num_experts_per_tok=2, max_position_embeddings=300)  # fmt: skip


def make_hf(folder: Path, *, seed: int = 0, torch_dtype=None, shard: str | None = None,
            **cfg) -> Path:
    """A seeded random MixtralForCausalLM saved with save_pretrained (hub-style keys).
    Norm weights are randomised too."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(**{**ODD, "rms_norm_eps": 1e-5, **cfg})
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kw)
    return Path(folder)


def load_source(folder: Path) -> dict[str, "torch.Tensor"]:
    from safetensors.torch import load_file

    out = {}
    for p in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(p))
    return out


def stored(t: "torch.Tensor", dtype: str) -> np.ndarray:
    """What the file must hold for a source tensor, via torch's own conversion."""
    if dtype == "f32":
        return t.to(torch.float32).numpy()
    if dtype == "f16":
        return t.to(torch.float16).numpy()
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("odd")
    return make_hf(d / "hf")


# ------------------------------------------------------------------------ header / layout

def test_header_round_trip(odd_model, tmp_path):
    out = tmp_path / "m.colibri"
    convert(odd_model, out, dtype="f32", block_size=5, max_seq_len=123, progress=False)
    info = inspect(out)
    h = info.header
    assert (info.version, info.header_size, info.file_size) == (1, 256, out.stat().st_size)
    secs = {s.name: s.offset for s in info.sections}
    assert h == dict(magic="COLIBRI", version=1, header_size=256, file_size=info.file_size,
                     n_experts=3, top_k=2, hidden_size=20, intermediate_size=13, vocab_size=37,
                     max_seq_len=123, n_layers=2, flags=0, alignment=64, block_size=5,
                     router_offset=secs["router"], experts_offset=secs["experts"],
                     tokenizer_offset=secs["tokenizer"])
    m = info.metadata
    want = {"general.architecture": "mixtral", "general.name": "hf", "model.n_layers": 2,
            "model.hidden_size": 20, "model.intermediate_size": 13, "model.vocab_size": 37,
            "model.n_heads": 5, "model.n_kv_heads": 1, "model.head_dim": 4,
            "model.n_experts": 3, "model.top_k": 2, "model.norm_topk_prob": True,
            "model.rms_norm_eps": 1e-5, "model.rope_theta": 1e6, "model.rope_type": "default",
            "model.max_position_embeddings": 300, "model.sliding_window": 0,
            "model.tie_word_embeddings": False, "model.max_seq_len": 123,
            "model.router_dtype": "f32", "model.weight_dtype": "f32",
            "tokenizer.type": "none", "tokenizer.bos_id": -1, "tokenizer.eos_id": -1,
            "tokenizer.unk_id": -1, "tokenizer.pad_id": -1, "convert.block_size": 5}
    for k, v in want.items():
        assert m[k] == v, k
    assert m["convert.source"].startswith("colibri_lab.convert ")
    types = info.metadata_types
    for k in ("model.n_layers", "model.head_dim", "convert.block_size"):
        assert types[k] == "u32"
    for k in ("model.max_position_embeddings", "model.sliding_window", "model.max_seq_len"):
        assert types[k] == "u64"
    for k in ("tokenizer.bos_id", "tokenizer.pad_id"):
        assert types[k] == "i32"
    assert types["model.rms_norm_eps"] == types["model.rope_theta"] == "f64"
    assert types["model.norm_topk_prob"] == "bool"

    raw = out.read_bytes()
    assert raw[:8] == b"COLIBRI\x00"
    assert struct.unpack_from("<I", raw, 252)[0] == zlib.crc32(raw[:252])
    assert raw[208:252] == bytes(44)
    assert [s.name for s in info.sections] == list(fmt.SECTION_NAMES)
    assert info.sections[2].size == 0


def test_sections_tensors_alignment_and_crcs(odd_model, tmp_path):
    out = tmp_path / "m.colibri"
    convert(odd_model, out, dtype="bf16", progress=False)
    info = inspect(out, verify=True)
    raw = out.read_bytes()
    secs = info.sections
    # order, no overlap, zero gaps, alignment of section starts
    assert secs[0].offset == 256
    prev = 256
    for i, s in enumerate(secs):
        assert s.offset >= prev
        assert raw[prev:s.offset] == bytes(s.offset - prev), f"gap before {s.name} not zero"
        if i in fmt.WEIGHT_SECTIONS:
            assert s.offset % 4096 == 0
        else:
            assert s.offset % 64 == 0
        assert zlib.crc32(raw[s.offset:s.offset + s.size]) == s.crc32
        prev = s.offset + s.size
    assert prev == len(raw) == info.file_size
    # every tensor aligned, inside its section, CRC and L2 norm of the stored values
    where = {}
    for t in info.tensors:
        assert t.offset % 64 == 0
        sec = next(s for s in secs if s.offset <= t.offset < s.offset + s.size)
        where[t.name] = sec.name
        assert t.offset + t.nbytes <= sec.offset + sec.size
        data = raw[t.offset:t.offset + t.nbytes]
        assert zlib.crc32(data) == t.crc32
        vals = info.read_tensor(t.name, as_float32=True).astype(np.float64)
        assert t.l2norm == pytest.approx(math.sqrt(float((vals * vals).sum())), rel=1e-12)
    # names, dtypes, shapes, sections as in the spec table
    L, H, I, V, E, nq, nkv = 2, 20, 13, 37, 3, 20, 4
    spec = {"token_embd.weight": ("bf16", (V, H), "dense"),
            "output_norm.weight": ("f32", (H,), "dense"),
            "output.weight": ("bf16", (V, H), "dense")}
    for n in range(L):
        spec |= {f"blk.{n}.attn_norm.weight": ("f32", (H,), "dense"),
                 f"blk.{n}.attn_q.weight": ("bf16", (nq, H), "dense"),
                 f"blk.{n}.attn_k.weight": ("bf16", (nkv, H), "dense"),
                 f"blk.{n}.attn_v.weight": ("bf16", (nkv, H), "dense"),
                 f"blk.{n}.attn_output.weight": ("bf16", (H, nq), "dense"),
                 f"blk.{n}.ffn_norm.weight": ("f32", (H,), "dense"),
                 f"blk.{n}.ffn_gate_inp.weight": ("bf16", (E, H), "router"),
                 f"blk.{n}.ffn_experts": ("bf16", (E, 3 * I, H), "experts")}
    assert {t.name for t in info.tensors} == set(spec)
    for t in info.tensors:
        dt, shape, sec = spec[t.name]
        assert (t.dtype, t.shape, where[t.name]) == (dt, shape, sec), t.name
        want_layout = "experts_packed" if t.name.endswith("ffn_experts") else "row_major"
        assert t.layout == want_layout
    # expert stride
    for n in range(L):
        assert info.expert_stride(n) == 3 * I * H * 2
        assert info.tensor(f"blk.{n}.ffn_experts").nbytes == E * info.expert_stride(n)


# ------------------------------------------------------------------------ values

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_dense_values_match_torch_conversion(odd_model, tmp_path, dtype):
    out = tmp_path / "m.colibri"
    convert(odd_model, out, dtype=dtype, progress=False)
    info = inspect(out)
    src = load_source(odd_model)
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
             "output_norm.weight": "model.norm.weight"}
    for n in range(2):
        p = f"model.layers.{n}"
        pairs |= {f"blk.{n}.attn_q.weight": f"{p}.self_attn.q_proj.weight",
                  f"blk.{n}.attn_k.weight": f"{p}.self_attn.k_proj.weight",
                  f"blk.{n}.attn_v.weight": f"{p}.self_attn.v_proj.weight",
                  f"blk.{n}.attn_output.weight": f"{p}.self_attn.o_proj.weight",
                  f"blk.{n}.attn_norm.weight": f"{p}.input_layernorm.weight",
                  f"blk.{n}.ffn_norm.weight": f"{p}.post_attention_layernorm.weight",
                  f"blk.{n}.ffn_gate_inp.weight": f"{p}.block_sparse_moe.gate.weight"}
    for name, hf in pairs.items():
        got = info.read_tensor(name)
        want = stored(src[hf], "f32" if got.ndim == 1 else dtype)
        np.testing.assert_array_equal(got, want, err_msg=name)


def unpack_experts(packed: np.ndarray, I: int, B: int):
    """From [E, 3I, H] packed rows back to (w1 [E,I,H], w3 [E,I,H], w2 [E,H,I]), written
    from the spec's text independently of the converter."""
    E, _, H = packed.shape
    w1 = np.empty((E, I, H), packed.dtype)
    w3 = np.empty((E, I, H), packed.dtype)
    for b in range((I + B - 1) // B):
        lo, hi = b * B, min((b + 1) * B, I)
        nb = hi - lo
        start = 2 * b * B
        w1[:, lo:hi] = packed[:, start:start + nb]
        w3[:, lo:hi] = packed[:, start + nb:start + 2 * nb]
    w2 = packed[:, 2 * I:].transpose(0, 2, 1)
    return w1, w3, w2


@pytest.mark.parametrize("inter,block", [(13, 4), (13, 32), (13, 1), (12, 5), (13, 13), (7, 3)])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_packed_experts_reproduce_w1_w3_w2(tmp_path, inter, block, dtype):
    hf = make_hf(tmp_path / "hf", intermediate_size=inter, num_hidden_layers=1, seed=inter)
    out = tmp_path / "m.colibri"
    convert(hf, out, dtype=dtype, block_size=block, progress=False)
    info = inspect(out)
    src = load_source(hf)
    packed = info.read_tensor("blk.0.ffn_experts")
    assert packed.shape == (3, 3 * inter, 20)
    # raw bytes of expert e at offset + e * stride
    raw = out.read_bytes()
    t = info.tensor("blk.0.ffn_experts")
    stride = info.expert_stride(0)
    for e in range(3):
        chunk = raw[t.offset + e * stride: t.offset + (e + 1) * stride]
        assert chunk == packed[e].tobytes()
    w1, w3, w2 = unpack_experts(packed, inter, block)
    p = "model.layers.0.block_sparse_moe.experts"
    for e in range(3):
        np.testing.assert_array_equal(w1[e], stored(src[f"{p}.{e}.w1.weight"], dtype))
        np.testing.assert_array_equal(w3[e], stored(src[f"{p}.{e}.w3.weight"], dtype))
        np.testing.assert_array_equal(w2[e], stored(src[f"{p}.{e}.w2.weight"], dtype))
    # the gate and up rows of one unit are never more than B rows apart
    B = block
    for i in range(inter):
        b = i // B
        nb = min(B, inter - b * B)
        gate_row, up_row = 2 * b * B + (i - b * B), 2 * b * B + nb + (i - b * B)
        assert up_row - gate_row == nb <= B
        np.testing.assert_array_equal(packed[0, gate_row], stored(src[f"{p}.0.w1.weight"], dtype)[i])
        np.testing.assert_array_equal(packed[0, up_row], stored(src[f"{p}.0.w3.weight"], dtype)[i])


def test_bf16_rounding_equals_torch():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(200_000).astype(np.float32) * np.float32(3.0)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    y = bits.view(np.float32)                       # every kind of bit pattern
    ties = (rng.integers(0, 2**16, 5000).astype(np.uint32) << 16) | np.uint32(0x8000)
    near = np.concatenate([ties, ties + 1, ties - 1]).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1e-45,
                        -1e-45, 1.1754942e-38, 3.3961775e38, 3.3961776e38, 65504.0, 1.0,
                        1.00390625, 1.01171875], dtype=np.float32)
    a = np.concatenate([x, y, near, special])
    got = fmt.f32_to_bf16_bits(a)
    want = torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(a)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # NaN stays NaN (torch's payload/sign for NaN is not part of the contract)
    back = fmt.bf16_bits_to_f32(got[nan])
    assert np.isnan(back).all()
    # and bf16 -> f32 is exact
    np.testing.assert_array_equal(
        fmt.bf16_bits_to_f32(got[~nan]),
        torch.from_numpy(a[~nan]).to(torch.bfloat16).to(torch.float32).numpy())


def test_bf16_source_is_copied_bit_exactly(tmp_path):
    hf = make_hf(tmp_path / "hf", torch_dtype=torch.bfloat16, num_hidden_layers=1)
    out = tmp_path / "m.colibri"
    convert(hf, out, dtype="bf16", progress=False)
    info = inspect(out, verify=True)
    src = load_source(hf)
    np.testing.assert_array_equal(info.read_tensor("token_embd.weight"),
                                  stored(src["model.embed_tokens.weight"], "bf16"))
    np.testing.assert_array_equal(info.read_tensor("output_norm.weight"),
                                  src["model.norm.weight"].float().numpy())
    # f32 output from a bf16 source is exact too
    out32 = tmp_path / "m32.colibri"
    convert(hf, out32, dtype="f32", progress=False)
    np.testing.assert_array_equal(inspect(out32).read_tensor("blk.0.attn_q.weight"),
                                  src["model.layers.0.self_attn.q_proj.weight"].float().numpy())


# ------------------------------------------------------------------------ int8 router

def test_int8_router(odd_model, tmp_path):
    out = tmp_path / "m.colibri"
    convert(odd_model, out, dtype="f32", quantize_router="int8", progress=False)
    info = inspect(out, verify=True)
    assert info.header["flags"] & fmt.FLAG_ROUTER_INT8
    assert info.metadata["model.router_dtype"] == "int8"
    assert info.metadata["model.weight_dtype"] == "f32"
    src = load_source(odd_model)
    router = info.section("router")
    for n in range(2):
        q = info.tensor(f"blk.{n}.ffn_gate_inp.weight")
        s = info.tensor(f"blk.{n}.ffn_gate_inp.scale")
        z = info.tensor(f"blk.{n}.ffn_gate_inp.zero")
        assert (q.dtype, q.shape, s.dtype, s.shape, z.dtype, z.shape) == \
            ("i8", (3, 20), "f32", (3,), "f32", (3,))
        for t in (q, s, z):
            assert router.offset <= t.offset < router.offset + router.size
        qv, sv, zv = (info.read_tensor(t.name) for t in (q, s, z))
        w = src[f"model.layers.{n}.block_sparse_moe.gate.weight"].numpy()
        assert np.all(zv == np.rint(zv)) and zv.min() >= -128 and zv.max() <= 127
        deq = (qv.astype(np.float32) - zv[:, None]) * sv[:, None]
        # the writer's choice of scale, and the error bound it gives
        np.testing.assert_allclose(sv, (w.max(1) - w.min(1)) / 255, rtol=1e-6)
        err = np.abs(deq - w).max(axis=1)
        assert np.all(err <= sv * 0.5 * (1 + 1e-5) + 1e-9), (err, sv)
        assert q.l2norm == pytest.approx(float(np.linalg.norm(deq.astype(np.float64))), rel=1e-12)
        # the spec's formulas, re-derived here
        zero = np.clip(np.rint(-128 - w.min(1).astype(np.float64) / sv), -128, 127)
        qq = np.clip(np.rint(w / sv[:, None].astype(np.float64)) + zero[:, None], -128, 127)
        np.testing.assert_array_equal(zv, zero)
        np.testing.assert_array_equal(qv, qq.astype(np.int8))


def test_int8_quantiser_constant_row_and_extremes():
    w = np.array([[0.5] * 6, [-1, 0, 1, 2, 3, 4], [0, 0, 0, 0, 0, 1e-3], [0.0] * 6,
                  [2.0, 3.0, 4.0, 2.5, 3.5, 2.25]], dtype=np.float32)
    q, scale, zero = fmt.quantize_router_int8(w)
    assert scale[3] == 1.0  # an all-zero row: empty range
    deq = fmt.dequantize_router_int8(q, scale, zero)
    # The range always contains 0, so even an all-positive row keeps error <= scale/2.
    assert np.all(np.abs(deq - w) <= scale[:, None] * 0.5 * (1 + 1e-6) + 1e-7)
    assert np.all(deq[3] == 0)
    assert q[1].min() == -128 and q[1].max() == 127
    assert np.all((zero >= -128) & (zero <= 127))


# ------------------------------------------------------------------------ reader refusals

@pytest.fixture(scope="module")
def good_file(odd_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("good") / "m.colibri"
    convert(odd_model, out, dtype="f16", progress=False)
    return out


def _patched(src: Path, dst: Path, at: int, data: bytes, fix_header_crc: bool = False) -> Path:
    raw = bytearray(src.read_bytes())
    raw[at:at + len(data)] = data
    if fix_header_crc:
        struct.pack_into("<I", raw, 252, zlib.crc32(bytes(raw[:252])))
    dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("at,data,fix,match", [
    (0, b"GGUF", False, "a llama.cpp GGUF, not a .colibri file.*colibri-convert"),
    (0, b"GGML", False, "not a .colibri file"),
    (8, struct.pack("<I", 3), True, "version 3"),
    (12, struct.pack("<I", 128), True, "header_size"),
    (40, b"\x01", False, "header CRC"),
    (28, struct.pack("<I", 9), True, "top_k"),
    (52, struct.pack("<I", 4), True, "flags"),
    (200, struct.pack("<I", 96), True, "alignment"),
    (204, struct.pack("<I", 0), True, "block_size"),
    (56 + 8, struct.pack("<Q", 1 << 62), True, "past the end"),
    (56 + 24, struct.pack("<Q", 300), True, "overlaps"),
    (56 + 3 * 24, struct.pack("<Q", 4096 * 1000 + 64), True, "past the end|multiple of 4096"),
    (56 + 16, struct.pack("<I", 0xDEAD), True, "metadata: CRC mismatch"),
])  # fmt: skip
def test_reader_refuses_damage(good_file, tmp_path, at, data, fix, match):
    bad = _patched(good_file, tmp_path / "bad.colibri", at, data, fix)
    with pytest.raises(FormatError, match=match):
        inspect(bad)


def test_reader_refuses_damaged_sections_and_size(good_file, tmp_path):
    info = inspect(good_file)
    md = info.section("metadata")
    bad = _patched(good_file, tmp_path / "a.colibri", md.offset + 20, b"\xff")
    with pytest.raises(FormatError, match="metadata: CRC mismatch"):
        inspect(bad)
    td = info.section("tensor_directory")
    bad = _patched(good_file, tmp_path / "b.colibri", td.offset + 30, b"\xff")
    with pytest.raises(FormatError, match="tensor_directory: CRC mismatch"):
        inspect(bad)
    raw = good_file.read_bytes()
    (tmp_path / "c.colibri").write_bytes(raw[:-1])
    with pytest.raises(FormatError, match="header says"):
        inspect(tmp_path / "c.colibri")
    (tmp_path / "d.colibri").write_bytes(raw[:100])
    with pytest.raises(FormatError, match="too short"):
        inspect(tmp_path / "d.colibri")
    # a flipped weight byte passes the start-up checks and fails verify
    t = info.tensor("blk.1.ffn_experts")
    bad = _patched(good_file, tmp_path / "e.colibri", t.offset + 7,
                   bytes([raw[t.offset + 7] ^ 1]))
    inspect(bad)
    with pytest.raises(FormatError, match="experts: CRC mismatch"):
        inspect(bad, verify=True)


def _with_record_change(good_file, out, change: dict):
    """good_file with the fourth tensor record re-encoded with `change` (and the CRCs fixed)."""
    info = inspect(good_file)
    raw = bytearray(good_file.read_bytes())
    td = info.section("tensor_directory")
    recs = []
    for i, t in enumerate(info.tensors):
        d = dict(dtype_id=t.dtype_id, layout_id=t.layout_id, offset=t.offset, nbytes=t.nbytes)
        if i == 3:
            d |= change
        recs.append(fmt.encode_tensor_record(t.name, d["dtype_id"], d["layout_id"], t.shape,
                                             t.crc32, d["offset"], d["nbytes"], t.l2norm))
    body = struct.pack("<Q", len(recs)) + b"".join(recs)
    assert len(body) == td.size
    b = bytearray(raw)
    b[td.offset:td.offset + td.size] = body
    struct.pack_into("<I", b, 56 + 24 + 16, zlib.crc32(body))
    struct.pack_into("<I", b, 252, zlib.crc32(bytes(b[:252])))
    out.write_bytes(bytes(b))
    return out


def test_reader_refuses_bad_directory_record(good_file, tmp_path):
    """Re-encode the directory with one wrong field (and fix the CRCs): each is refused."""
    for change, match in [({"dtype_id": 27}, "unknown dtype id 27"),
                          ({"dtype_id": fmt.DTYPE_Q4_K}, "not a multiple"),
                          ({"layout_id": 7}, "unknown layout id 7"),
                          ({"offset": 1}, "not a multiple of the alignment"),
                          ({"nbytes": 2}, "nbytes"),
                          ({"offset": 0}, "not inside a weight section")]:
        p = _with_record_change(good_file, tmp_path / "x.colibri", change)
        with pytest.raises(FormatError, match=match):
            inspect(p)


@pytest.mark.parametrize("dtype_id", [4, 5, 6, 27, 200])
def test_engine_refuses_array_only_and_unknown_dtypes(good_file, tmp_path, dtype_id):
    """colibri_dtype is one name space: ids 4-6 (I32, I64, U64) name the API's arrays and are
    refused in a file exactly like an id the engine has never heard of."""
    from colibri_lab import ColibriUnsupportedError, Engine

    p = _with_record_change(good_file, tmp_path / "x.colibri", {"dtype_id": dtype_id})
    with pytest.raises(ColibriUnsupportedError, match=f"has dtype {dtype_id}, which this build does not know"):
        Engine(p)


def test_engine_refuses_quantized_dtype_in_a_version_1_file(good_file, tmp_path):
    """A version 1 file cannot hold a block type: the engine says so instead of reading it
    (the good file is version 1: float weights)."""
    from colibri_lab import ColibriFormatError, Engine

    assert inspect(good_file).version == 1
    p = _with_record_change(good_file, tmp_path / "x.colibri", {"dtype_id": fmt.DTYPE_Q8_0})
    with pytest.raises(ColibriFormatError, match="version 1 files cannot hold"):
        Engine(p)


def test_metadata_codec_round_trip():
    M = fmt.MetaValue
    entries = [("a.u32", M(fmt.MT_U32, 7)), ("a.i32", M(fmt.MT_I32, -3)),
               ("a.f32", M(fmt.MT_F32, 0.5)), ("a.bool", M(fmt.MT_BOOL, True)),
               ("a.str", M(fmt.MT_STRING, "héllo")), ("a.u64", M(fmt.MT_U64, 2**40)),
               ("a.i64", M(fmt.MT_I64, -2**40)), ("a.f64", M(fmt.MT_F64, 1e-300)),
               ("a.arr", M(fmt.MT_ARRAY, [1, 2, 3], fmt.MT_U32))]
    meta, types = fmt_reader._parse_metadata(fmt.encode_metadata(entries))
    assert meta == {"a.u32": 7, "a.i32": -3, "a.f32": 0.5, "a.bool": True, "a.str": "héllo",
                    "a.u64": 2**40, "a.i64": -2**40, "a.f64": 1e-300, "a.arr": [1, 2, 3]}
    assert types["a.arr"] == "array[u32]"
    with pytest.raises(FormatError, match="twice"):
        fmt.encode_metadata(entries + entries[:1])
    with pytest.raises(FormatError):
        fmt.encode_metadata([("x", M(fmt.MT_ARRAY, ["a"], fmt.MT_STRING))])


def test_summary_and_html(good_file):
    info = inspect(good_file)
    s = str(info)
    assert "mixtral" in s and "blk.0.ffn_experts" in s and "experts_packed" in s
    assert "tensor_directory" in s and "model.rope_theta" in s
    h = info._repr_html_()
    assert h.count("<table>") >= 3 and "blk.1.ffn_experts" in h and "<th>block_size</th>" in h
    json.dumps({"x": info.metadata})   # metadata is plain Python values
