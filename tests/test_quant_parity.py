"""Quantized models run exactly: the logits of a .colibri file converted with a quantized
mix (q8_0, q4_k, q4_k_m, q4_1, q5_0) equal, within float32 rounding (max |Δ| <= 1e-4), the logits
transformers computes for the same model with every quantized tensor replaced by its
dequantized values (read back from the file). So any difference from the f32 model is the
quantization's, never the engine's. Shapes have rows of whole 256-element blocks, so the K
types are really used (not their fallbacks), checked from the file's tensor directory."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from colibri_lab.bench.models import FamilyShape, MixtralShape, build_model, save_checkpoint  # noqa: E402
from helpers import compare_logits, hf_logits, random_ids  # noqa: E402

import colibri_lab  # noqa: E402
from colibri_lab.format import reader as fmt_reader, spec as fmt  # noqa: E402

MIXTRAL = MixtralShape(vocab=1003, hidden=256, inter=512, heads=4, kv_heads=2, experts=4, top_k=2, layers=2, seed=3)
QWEN2 = FamilyShape("qwen2_moe", vocab=1003, hidden=256, inter=256, dense_inter=512, shared_inter=256,
                    layers=2, heads=4, kv_heads=4, experts=4, top_k=2, mlp_only_layers=(1,), seed=4)

# colibri tensor (per layer N) -> transformers state-dict key
_PLAIN = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "ffn_gate": "mlp.gate_proj.weight", "ffn_up": "mlp.up_proj.weight", "ffn_down": "mlp.down_proj.weight",
          "ffn_gate_shexp": "mlp.shared_expert.gate_proj.weight",
          "ffn_up_shexp": "mlp.shared_expert.up_proj.weight",
          "ffn_down_shexp": "mlp.shared_expert.down_proj.weight",
          "ffn_down_exps": "mlp.experts.down_proj"}


def _dequantized_state(info, state: dict) -> tuple[dict, dict]:
    """The state dict with every quantized tensor of the file dequantized in place; and the
    dtype name of each quantized tensor used."""
    out = {k: v.clone() for k, v in state.items()}
    used = {}

    def put(key, arr):
        assert key in out, key
        assert tuple(out[key].shape) == arr.shape, (key, out[key].shape, arr.shape)
        out[key] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))

    deq = {t.name: t for t in info.tensors if t.dtype_id in fmt.QUANT_DTYPES}
    for name, t in deq.items():
        used[name] = t.dtype
        val = info.read_tensor(name, as_float32=True)
        if name == "token_embd.weight":
            put("model.embed_tokens.weight", val)
            continue
        if name == "output.weight":
            put("lm_head.weight", val)
            continue
        _, n, rest = name.split(".", 2)
        p = f"model.layers.{n}."
        if rest in ("ffn_gate_exps", "ffn_up_exps"):
            continue  # below, fused as transformers keeps them
        put(p + _PLAIN[rest], val)
    for name in deq:
        if name.endswith("ffn_gate_exps"):
            n = name.split(".")[1]
            g = info.read_tensor(name, as_float32=True)
            u = info.read_tensor(f"blk.{n}.ffn_up_exps", as_float32=True)
            put(f"model.layers.{n}.mlp.experts.gate_up_proj", np.concatenate([g, u], axis=1))
    return out, used


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    torch.manual_seed(0)
    mix = build_model(MIXTRAL)
    qwen = build_model(QWEN2)
    return {"mixtral": (mix, save_checkpoint(mix, tmp_path_factory.mktemp("mixtral"))),
            "qwen2_moe": (qwen, save_checkpoint(qwen, tmp_path_factory.mktemp("qwen2")))}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("mix", ["q8_0", "q4_k", "q4_k_m", "q4_1", "q5_0"])
def test_quantized_logits_equal_transformers_on_dequantized_weights(checkpoints, family, mix, tmp_path):
    model, folder = checkpoints[family]
    out = tmp_path / f"{family}-{mix}.colibri"
    colibri_lab.convert(folder, out, dtype=mix, progress=False)
    info = fmt_reader.inspect(out, verify=True)
    assert info.version == 2
    deq_state, used = _dequantized_state(info, model.state_dict())
    kinds = set(used.values())
    want = {"q8_0": {"q8_0"}, "q4_k": {"q4_k"}, "q4_k_m": {"q4_k", "q6_k"}, "q4_1": {"q4_1"},
            "q5_0": {"q5_0"}}[mix]
    assert want <= kinds, f"{mix}: the file holds {sorted(kinds)}"
    ref = type(model)(model.config).eval()
    ref.load_state_dict(deq_state)
    ids = random_ids(model.config.vocab_size, 40, seed=7)
    want_logits, router_logits = hf_logits(ref, ids)
    with colibri_lab.Engine(out, num_threads=2) as eng:
        got = eng.forward(ids)
        # incremental decoding equals the full forward, bit for bit
        eng2 = colibri_lab.Engine(out, num_threads=2)
        try:
            first = eng2.forward(ids[:25])
            rest = np.stack([eng2.forward([t], start_pos=25 + i)[0] for i, t in enumerate(ids[25:])])
        finally:
            eng2.close()
    top_k = model.config.num_experts_per_tok
    compare_logits(want_logits, got, router_logits, top_k, f"{family} {mix}")
    assert np.array_equal(np.concatenate([first, rest]), got), "incremental decoding differs from the full forward"


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("mix", ["q8_0", "q4_k_m"])
def test_no_allocation_in_quantized_forward(native_tests, checkpoints, mix, precision, tmp_path):
    """test_noalloc (forward, batch, fork, truncate with malloc counted) on quantized files
    of a Qwen2-MoE with a dense layer and a shared expert: every split FFN, every quantized
    matmul tile and the dequantized embedding rows run from the arena; in fast mode the
    int8 panels and activation tiles too (they live on the kernels' stacks)."""
    from test_native import run_ok

    _, folder = checkpoints["qwen2_moe"]
    out = tmp_path / f"q-{mix}.colibri"
    colibri_lab.convert(folder, out, dtype=mix, progress=False)
    run_ok(native_tests / "test_noalloc", out, *([precision] if precision == "fast" else []))
