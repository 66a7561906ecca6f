"""INT4 checkpoints in compressed-tensors' pack-quantized format (Kimi-K2-Thinking ships its
routed experts so): a tiny random Kimi-K2 (model_type kimi_k2, DeepseekV3ForCausalLM) is
written as such a checkpoint (int4 values packed by compressed-tensors' own `pack_to_int32`, bf16 group
scales, config.json's quantization_config as Kimi's, attention, shared experts and dense MLP
left in bf16 as its `ignore` list says) and, beside it, as an f32 checkpoint of the values
compressed-tensors' own decompressor gives (`PackedQuantizationCompressor.decompress`).

Converting the INT4 checkpoint gives the very file of the dequantized one (every tensor's
bytes, in f32, bf16 and q4_k); the engine on it gives transformers' logits on the dequantized
weights within 1e-4. Schemes the converter does not read are refused with the reason.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
safetensors_torch = pytest.importorskip("safetensors.torch")

import colibri_lab  # noqa: E402
from colibri_lab.bench.models import DeepseekShape, build_model, load_model, save_checkpoint  # noqa: E402
from colibri_lab.conversion.spec import ConversionError  # noqa: E402
from colibri_lab.format import reader as fmt_reader  # noqa: E402

GROUP = 32
# compressed-tensors takes rows of whole 32-groups: gate/up rows of 64 columns, down rows of 96
SHAPE = DeepseekShape("deepseek_v3", vocab=300, hidden=64, inter=96, dense_inter=80, layers=2,
                      heads=2, q_lora=48, kv_lora=32, nope=16, rope=8, v_dim=16, experts=4,
                      top_k=2, shared=1, first_dense=1, n_group=1, topk_group=1, seed=71)
WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": GROUP, "strategy": "group",
           "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}, "block_structure": None}
QCFG = {  # Kimi-K2-Thinking's
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": WEIGHTS}},
    "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                           "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def _is_int4(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith(".weight")


def _quantize(w: np.ndarray, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values in -8..7, bf16 group scales): amax / 7 per group, negative and tiny
    scales among them."""
    R, C = w.shape
    ng = -(-C // GROUP)
    sc = np.zeros((R, ng), np.float32)
    q = np.zeros((R, C), np.int8)
    for g in range(ng):
        blk = w[:, g * GROUP:(g + 1) * GROUP]
        s = np.maximum(np.abs(blk).max(axis=1), 1e-12) / 7.0
        s *= np.where(rng.random(R) < 0.1, -1.0, 1.0)
        s[rng.random(R) < 0.05] = 3e-39   # subnormal in bf16's range
        sc[:, g] = s
        q[:, g * GROUP:(g + 1) * GROUP] = np.clip(np.rint(blk / s[:, None]), -8, 7)
    return torch.from_numpy(q), torch.from_numpy(sc).to(torch.bfloat16)


def _decompress(packed: torch.Tensor, scale: torch.Tensor, shape) -> np.ndarray:
    """compressed-tensors' own dequantization, as float32 values."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP))
    out = PackedQuantizationCompressor.decompress(
        {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor(shape)}, scheme)
    return out["weight"].float().numpy()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(int4 folder, f32 folder of the dequantized values)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.numpy import load_file, save_file

    work = tmp_path_factory.mktemp("int4")
    ref = work / "deq"
    save_checkpoint(build_model(SHAPE), ref, tokenizer="none")
    sd = load_file(str(ref / "model.safetensors"))
    rng = np.random.default_rng(72)
    packed, deq = {}, {}
    for name, w in sd.items():
        if _is_int4(name):
            q, sc = _quantize(w, rng)
            pk = pack_to_int32(q, 4)
            base = name[:-len("weight")]
            packed[base + "weight_packed"] = pk
            packed[base + "weight_scale"] = sc
            packed[base + "weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
            deq[name] = _decompress(pk, sc, list(w.shape))
        else:   # left in bf16, as Kimi's ignore list
            b = torch.from_numpy(w).to(torch.bfloat16)
            packed[name] = b
            deq[name] = b.float().numpy()
    assert sum(_is_int4(n) for n in sd) == (SHAPE.layers - SHAPE.first_dense) * SHAPE.experts * 3
    save_file(deq, str(ref / "model.safetensors"), metadata={"format": "pt"})
    folder = work / "int4"
    folder.mkdir()
    safetensors_torch.save_file(packed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ref / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps(dict(cfg, model_type="kimi_k2")))
    (folder / "config.json").write_text(json.dumps(dict(cfg, model_type="kimi_k2", quantization_config=QCFG)))
    return folder, ref


def test_the_reference_rounds_to_bf16(ckpts):
    """The library's values are bf16 (q times a bf16 scale, in bf16): some of them differ from
    the unrounded products, which the converter must not keep."""
    from safetensors.numpy import load_file

    _, ref = ckpts
    w = load_file(str(ref / "model.safetensors"))["model.layers.1.mlp.experts.0.gate_proj.weight"]
    assert np.array_equal(w, torch.from_numpy(w).to(torch.bfloat16).float().numpy())


@pytest.mark.parametrize("dtype", ["f32", "bf16", "q4_k"])
def test_int4_converts_to_the_dequantized_file(ckpts, dtype, tmp_path):
    """Every tensor of the INT4 checkpoint's conversion equals, byte for byte, that of the f32
    checkpoint of compressed-tensors' dequantized values (negative and subnormal scales, any
    output dtype)."""
    folder, ref = ckpts
    a = fmt_reader.inspect(colibri_lab.convert(folder, tmp_path / "a.colibri", dtype=dtype, progress=False),
                           verify=True)
    b = fmt_reader.inspect(colibri_lab.convert(ref, tmp_path / "b.colibri", dtype=dtype, progress=False),
                           verify=True)
    assert [(t.name, t.dtype, t.shape, t.crc32) for t in a.tensors] == \
        [(t.name, t.dtype, t.shape, t.crc32) for t in b.tensors]


def test_int4_logits_equal_transformers_on_the_dequantized_weights(ckpts, tmp_path):
    from helpers import hf_logits, random_ids

    folder, ref = ckpts
    out = colibri_lab.convert(folder, tmp_path / "m.colibri", dtype="f32", progress=False)
    ids = random_ids(SHAPE.vocab, 20, seed=73)
    cfg = json.loads((ref / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps(dict(cfg, model_type="deepseek_v3")))  # transformers' class
    try:
        want, _ = hf_logits(load_model("deepseek_v3", ref), ids)
    finally:
        (ref / "config.json").write_text(json.dumps(cfg))
    with colibri_lab.Engine(out) as eng:
        got = eng.forward(ids)
    assert float(np.abs(got - want).max()) <= 1e-4


def test_bad_int4_checkpoints_are_refused(ckpts, tmp_path):
    folder, _ = ckpts
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())

    def refused(qc, match):
        (bad / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc)))
        with pytest.raises(ConversionError, match=match):
            colibri_lab.convert(bad, tmp_path / "x.colibri", dtype="f32", progress=False)

    def group(**w):
        return {**QCFG, "config_groups": {"group_0": {**QCFG["config_groups"]["group_0"], "weights": {**WEIGHTS, **w}}}}

    refused(None, r"stored packed .* no quantization_config")
    refused({**QCFG, "format": "float-quantized"}, "format 'float-quantized'; the converter reads pack-quantized")
    refused(group(symmetric=False), r"\{'symmetric': False\}; the converter reads symmetric INT4")
    refused(group(num_bits=8), r"\{'num_bits': 8\}")
    refused({**QCFG, "config_groups": {"group_0": {**QCFG["config_groups"]["group_0"],
                                                   "input_activations": {"num_bits": 8}}}}, "quantizes activations")
    refused(group(group_size=64), r"needs .*_scale of shape \[96, 1\] \(groups of 64\)")
    assert not (tmp_path / "x.colibri").exists()


def test_kimi_k25_wrapper_converts_its_language_model(ckpts, tmp_path):
    """A Kimi-K2.5-style checkpoint (KimiK25ForConditionalGeneration: the DeepSeek-V3 text
    model's config under text_config, its weights under language_model., a vision tower and a
    projector beside it) converts to the very file of its language model; the vision weights
    are left out with a warning that names them."""
    from safetensors.torch import load_file, save_file

    folder, _ = ckpts
    wrap = tmp_path / "k25"
    wrap.mkdir()
    sd = {"language_model." + k: v for k, v in load_file(str(folder / "model.safetensors")).items()}
    sd["vision_tower.encoder.blocks.0.wqkv.weight"] = torch.zeros(48, 16, dtype=torch.bfloat16)
    sd["mm_projector.proj.0.weight"] = torch.zeros(64, 16, dtype=torch.bfloat16)
    save_file(sd, str(wrap / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (wrap / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": cfg,
        "vision_config": {"hidden_size": 16}, "quantization_config": qc}))
    a = fmt_reader.inspect(colibri_lab.convert(folder, tmp_path / "a.colibri", dtype="bf16", progress=False))
    with pytest.warns(RuntimeWarning, match=r"2 checkpoint tensors .* left out: mm_projector.proj.0.weight, "
                                            r"vision_tower"):
        b = fmt_reader.inspect(colibri_lab.convert(wrap, tmp_path / "b.colibri", dtype="bf16", progress=False))
    assert [(t.name, t.dtype, t.shape, t.crc32) for t in a.tensors] == \
        [(t.name, t.dtype, t.shape, t.crc32) for t in b.tensors]
    assert b.metadata["general.architecture"] == "deepseek_v3"
