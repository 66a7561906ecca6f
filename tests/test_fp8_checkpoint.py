"""FP8 checkpoints (DeepSeek-V3/R1, Kimi, Qwen3 "-FP8"): float8_e4m3fn weights with
128x128 block scales (`*_scale_inv`, config.json quantization_config). A tiny random
DeepSeek-V3 whose widths leave partial edge blocks is written as such a checkpoint (torch's
float8_e4m3fn, safetensors F8_E4M3) and, beside it, as an f32 checkpoint of the same values
dequantized with numpy (the e4m3fn value times the block's scale, in float32).

Converting the FP8 checkpoint gives the very file of the dequantized one (every tensor's
bytes, in f32, bf16 and q8_0), and the engine on it gives transformers' logits on the
dequantized weights within 1e-4. Bad FP8 checkpoints are refused with the reason.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import colibri_lab  # noqa: E402
from colibri_lab.bench.models import DeepseekShape, build_model, load_model, save_checkpoint  # noqa: E402
from colibri_lab.conversion.checkpoint import e4m3fn_table  # noqa: E402
from colibri_lab.conversion.spec import ConversionError  # noqa: E402
from colibri_lab.format import reader as fmt_reader  # noqa: E402

BLOCK = (128, 128)
# hidden 160 and the dense width 144: one whole and one partial 128-block each way
SHAPE = DeepseekShape("deepseek_v3", vocab=300, hidden=160, inter=48, dense_inter=144, layers=2,
                      heads=2, q_lora=136, kv_lora=40, nope=16, rope=8, v_dim=16, experts=4,
                      top_k=2, shared=1, first_dense=1, n_group=2, topk_group=1, seed=51)
QCFG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK),
        "activation_scheme": "dynamic"}


def _is_fp8(name: str, t) -> bool:
    """As DeepSeek-V3's release: every linear weight of the layers but the router."""
    return name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2 \
        and not name.endswith("mlp.gate.weight")


def _quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn bytes, f32 scales [ceil(R/bm), ceil(C/bn)]): amax / 448 per block."""
    R, C = w.shape
    bm, bn = BLOCK
    sc = np.zeros((-(-R // bm), -(-C // bn)), np.float32)
    q = np.zeros((R, C), np.uint8)
    for i in range(sc.shape[0]):
        for j in range(sc.shape[1]):
            blk = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            s = np.float32(max(float(np.abs(blk).max()), 1e-12) / 448.0)
            sc[i, j] = s
            f8 = torch.from_numpy(blk / s).to(torch.float8_e4m3fn)
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = f8.view(torch.uint8).numpy()
    return q, sc


def _dequantize(q: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """numpy: the e4m3fn decode table times the block's scale, one float32 product."""
    bm, bn = BLOCK
    full = np.repeat(np.repeat(sc, bm, axis=0), bn, axis=1)[:q.shape[0], :q.shape[1]]
    return (e4m3fn_table()[q] * full).astype(np.float32)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(fp8 folder, f32 folder of the dequantized values)."""
    work = tmp_path_factory.mktemp("fp8")
    model = build_model(SHAPE)
    ref = work / "deq"
    save_checkpoint(model, ref, tokenizer="none")
    from safetensors.numpy import load_file

    sd = load_file(str(ref / "model.safetensors"))
    fp8, deq = {}, {}
    for name, w in sd.items():
        if _is_fp8(name, torch.from_numpy(w)):
            q, sc = _quantize(w)
            fp8[name] = torch.from_numpy(q).view(torch.float8_e4m3fn)
            fp8[name + "_scale_inv"] = torch.from_numpy(sc)
            deq[name] = _dequantize(q, sc)
        else:
            fp8[name] = torch.from_numpy(w)
            deq[name] = w
    from safetensors.numpy import save_file

    save_file(deq, str(ref / "model.safetensors"), metadata={"format": "pt"})
    folder = work / "fp8"
    folder.mkdir()
    safetensors_torch.save_file(fp8, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ref / "config.json").read_text())
    cfg["quantization_config"] = QCFG
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, ref


def test_decode_table_is_torchs():
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(e4m3fn_table(), ref)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "q8_0"])
def test_fp8_converts_to_the_dequantized_file(ckpts, dtype, tmp_path):
    """Every tensor of the FP8 checkpoint's conversion equals, byte for byte, that of the
    f32 checkpoint of its numpy-dequantized values (streamed row blocks, partial edge
    blocks, any output dtype)."""
    folder, ref = ckpts
    a = fmt_reader.inspect(colibri_lab.convert(folder, tmp_path / "a.colibri", dtype=dtype,
                                               progress=False), verify=True)
    b = fmt_reader.inspect(colibri_lab.convert(ref, tmp_path / "b.colibri", dtype=dtype,
                                               progress=False), verify=True)
    assert [(t.name, t.dtype, t.shape, t.crc32) for t in a.tensors] == \
        [(t.name, t.dtype, t.shape, t.crc32) for t in b.tensors]
    if dtype == "f32":   # the values themselves: the numpy dequantization
        from safetensors.numpy import load_file

        deq = load_file(str(ref / "model.safetensors"))
        got = a.read_tensor("blk.0.attn_output.weight")
        np.testing.assert_array_equal(got, deq["model.layers.0.self_attn.o_proj.weight"])


def test_fp8_logits_equal_transformers_on_the_dequantized_weights(ckpts, tmp_path):
    from helpers import hf_logits, random_ids

    folder, ref = ckpts
    out = colibri_lab.convert(folder, tmp_path / "m.colibri", dtype="f32", progress=False)
    ids = random_ids(SHAPE.vocab, 20, seed=52)
    want, _ = hf_logits(load_model("deepseek_v3", ref), ids)
    with colibri_lab.Engine(out) as eng:
        got = eng.forward(ids)
    assert float(np.abs(got - want).max()) <= 1e-4


def test_bad_fp8_checkpoints_are_refused(ckpts, tmp_path):
    folder, _ = ckpts
    bad = tmp_path / "noq"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["quantization_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="float8_e4m3fn but config.json has no "
                                              "quantization_config"):
        colibri_lab.convert(bad, tmp_path / "x.colibri", dtype="f32", progress=False)
    cfg["quantization_config"] = dict(QCFG, weight_block_size=[64, 64])
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match=r"needs .*_scale_inv of shape .*blocks of 64x64"):
        colibri_lab.convert(bad, tmp_path / "x.colibri", dtype="f32", progress=False)
    cfg["quantization_config"] = dict(QCFG, fmt="e5m2")
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="fmt 'e5m2'"):
        colibri_lab.convert(bad, tmp_path / "x.colibri", dtype="f32", progress=False)
    assert not (tmp_path / "x.colibri").exists()
