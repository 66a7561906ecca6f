"""The CUDA backend (docs/backends.md) against the CPU backend and transformers on the GPU.

Runs only when COLIBRI_CUDA_LIB names a libcolibri.so built with -DCOLIBRI_CUDA=ON AND a CUDA
device answers (a probe opens data/tiny-mixtral with backend="cuda"; "no CUDA device" and the
like skip the module with that one line). The library is loaded from COLIBRI_CUDA_LIB: this
module sets COLIBRI_LIB to it before colibri_lab loads its library, and skips when another
library was loaded first (run it alone: `COLIBRI_LIB=$COLIBRI_CUDA_LIB pytest tests/test_gpu.py`;
tools/gpu_check.sh does).

Models: data/tiny-mixtral, a random Mixtral shape (8 experts top-2, GQA) and a random
Qwen2-MoE with a gated shared expert and a dense-MLP layer; each in f32 and bf16 weights. Plus
data/tiny-mixtral through a bf16 GGUF (written here with the gguf package) and
colibri_lab.conversion.gguf: split-layout experts (separate gate, up and down matrices), which the
converter never writes.

Models also include one of a realistic shape: a Qwen3-MoE with hidden 1024, head_dim 128,
64 experts top-8, q/k norms, in Q8_0 weights (the converter's q8_0 mix).

Tolerances (docs/backends.md, "Accuracy"):
- exact precision, whatever the weights (f32, bf16, Q8_0: both backends compute in f32 on the
  same stored values): max |Δ logits| <= 1e-3 against the CPU backend and against transformers
  float32 on the GPU (TF32 off, bf16 weights upcast), and the same top-1 token wherever the
  reference's first and second logits are further apart than twice that. Both runs are traced:
  from the first position whose experts differ on, nothing is compared (a flipped expert
  changes that token and, through attention, every later one), and such a flip must sit where
  the reference's k-th and (k+1)-th router probabilities are within 1e-4 (a tie that f32
  rounding may decide either way).
- fast precision (bf16 weights on the tensor cores, activations rounded to bf16), judged at its
  worst position: over the positions whose experts (the top-k set of every MoE layer, from
  traces) are the reference's, max |Δ logits| / the reference row's range <= 1e-2 against the
  CPU's exact mode and its fast mode (the CPU's fast mode measures <= 7e-3 against exact on
  these models), and the same top-1 wherever the reference's top two are further apart than
  twice that; at most 5 % of positions may route differently (flips at near-ties, counted and
  printed). Against transformers bf16 on the GPU (which also rounds the residual stream, the
  norms and the attention to bf16; measured <= 1.8e-2 against the CPU's fast mode) the bound is
  3e-2, with transformers' routing read from its router logits.
Fast precision's invariances are bitwise like the exact mode's, across the two tile shapes
(cuda_mma.cuh: a prompt of 80 rows takes the large one, a decode step the small one).
Bitwise on the CUDA backend: a sequence batched with others = alone; three runs (and a
fresh engine) = each other; decode steps replayed from CUDA graphs = the eager stage-by-stage
run = a traced run; device stage tensors = their host copies; 520 decode steps after a
600-token prompt (1120 positions, both precisions) = the full forward.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
CUDA_LIB = os.environ.get("COLIBRI_CUDA_LIB", "")

if not CUDA_LIB:
    pytest.skip("COLIBRI_CUDA_LIB is not set (a libcolibri.so built with -DCOLIBRI_CUDA=ON)",
                allow_module_level=True)  # fmt: skip
if not Path(CUDA_LIB).is_file():
    pytest.skip(f"COLIBRI_CUDA_LIB={CUDA_LIB!r} is not a file", allow_module_level=True)
if "colibri_lab.runtime._native" in sys.modules:
    _loaded = sys.modules["colibri_lab.runtime._native"].lib_path
    if Path(_loaded).resolve() != Path(CUDA_LIB).resolve():
        pytest.skip(f"colibri_lab already loaded {_loaded}; run tests/test_gpu.py alone with "
                    f"COLIBRI_LIB=$COLIBRI_CUDA_LIB", allow_module_level=True)  # fmt: skip
else:
    os.environ["COLIBRI_LIB"] = CUDA_LIB

import colibri_lab  # noqa: E402
from colibri_lab import ColibriError, Engine  # noqa: E402

EXACT_TOL = 1e-3              # max |Δ logits| of the exact precision, any weight dtype
FLIP_GAP = 1e-4              # exact precision may route differently only this close to a tie
FAST_WORST_REL_TOL = 2e-2    # fast precision, worst position with the reference's experts
FAST_MAX_FLIPPED = 0.05      # share of positions that may route differently in fast precision
FAST_HF_BF16_WORST_REL_TOL = 3e-2


# ---- the probe and the models ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    out = {}
    for dt in ("f32", "bf16"):
        out[dt] = colibri_lab.convert(REPO / "data" / "tiny-mixtral", d / f"tiny-{dt}.colibri", dtype=dt,
                                      progress=False)
    return out


@pytest.fixture(scope="module", autouse=True)
def cuda_device(tiny_files):
    """Skip the module unless the CUDA backend opens the tiny model here."""
    try:
        with Engine(tiny_files["f32"], backend="cuda", max_seq_len=64) as eng:
            dev = eng.config.backend_device
    except ColibriError as e:
        pytest.skip(f"the CUDA backend does not open here: {e}")
    print(f"CUDA backend device: {dev}")
    return dev


def _hf_models():
    from colibri_lab.bench.models import FamilyShape, MixtralShape, build_model

    return {
        "mixtral": (lambda: build_model(MixtralShape(vocab=1000, hidden=128, inter=192, layers=3, heads=8, kv_heads=2,
                                              experts=8, top_k=2, max_pos=512, std=0.05, seed=11)), 2),
        "qwen2_moe": (lambda: build_model(FamilyShape("qwen2_moe", vocab=997, hidden=96, inter=64,
                                                             dense_inter=128, shared_inter=80, layers=3, heads=6,
                                                             kv_heads=2, experts=8, top_k=2, mlp_only_layers=(1,),
                                                             std=0.05, seed=12)), 2),
        # a realistic shape: hidden 1024, head_dim 128, 64 experts top-8, q/k norms (Qwen3-MoE)
        "qwen3_big": (lambda: build_model(FamilyShape("qwen3_moe", vocab=2003, hidden=1024, inter=256,
                                                             dense_inter=512, layers=2, heads=8, kv_heads=4,
                                                             head_dim=128, experts=64, top_k=8, norm_topk=True,
                                                             bias=False, std=0.05, seed=13)), 8),
    }  # fmt: skip


class _Models:
    """name -> (HF model in float32 on the CPU, {dtype: .colibri path}, top_k, vocab)."""

    def __init__(self, tmp):
        self.tmp, self.cache = tmp, {}

    def __call__(self, name: str, dtype: str):
        from colibri_lab.bench.models import save_checkpoint

        if name not in self.cache:
            build, top_k = _hf_models()[name]
            model = build()
            folder = save_checkpoint(model, self.tmp.mktemp(name), tokenizer="none")
            self.cache[name] = (model, folder, {}, top_k)
        model, folder, files, top_k = self.cache[name]
        if dtype not in files:
            files[dtype] = colibri_lab.convert(folder, folder.parent / f"{name}-{dtype}.colibri", dtype=dtype,
                                               progress=False)
        return model, files[dtype], top_k, model.config.vocab_size


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _Models(tmp_path_factory)


def _path(models, tiny_files, name, dtype):
    if name == "tiny":
        return tiny_files[dtype]
    return models(name, dtype)[1]


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


def _safetensors_bf16(path: Path) -> dict[str, np.ndarray]:
    """A BF16 safetensors file's tensors as their bits (uint16: numpy has no bfloat16)."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for name, t in load_file(str(path)).items():
        assert t.dtype == torch.bfloat16, (name, t.dtype)
        out[name] = t.view(torch.int16).numpy().view(np.uint16)
    return out


@pytest.fixture(scope="module")
def split_tiny(tmp_path_factory):
    """data/tiny-mixtral (BF16) as llama.cpp's convert_hf_to_gguf.py --outtype bf16 lays it
    out (q/k rows permuted, stacked experts ffn_{gate,up,down}_exps in BF16, norms and routers
    F32, tied embeddings: no output.weight, no vocabulary), written with gguf.GGUFWriter and
    imported with colibri_lab.conversion.gguf: a .colibri with split-layout experts (format version
    2; cb_ffn.packed NULL), where the converter writes packed ones."""
    import json

    gguf = pytest.importorskip("gguf")
    from colibri_lab.conversion.gguf import convert_gguf
    from test_gguf_import import permute  # llama.cpp's LlamaModel.permute of q and k rows

    src = REPO / "data" / "tiny-mixtral"
    cfg = json.loads((src / "config.json").read_text())
    w = _safetensors_bf16(src / "model.safetensors")
    L, H, I = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, E = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_local_experts"]
    hd = cfg.get("head_dim") or H // nh
    theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    assert not cfg.get("sliding_window") and cfg.get("tie_word_embeddings"), cfg
    BF16 = gguf.GGMLQuantizationType.BF16

    def f32(bits):  # bf16 bits widened: the same values in F32
        return (bits.astype(np.uint32) << 16).view(np.float32)

    d = tmp_path_factory.mktemp("split")
    gpath = d / "tiny-bf16.gguf"
    g = gguf.GGUFWriter(str(gpath), "llama")
    for key, v in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", H),
                   ("block_count", L), ("feed_forward_length", I), ("attention.head_count", nh),
                   ("attention.head_count_kv", nkv), ("rope.dimension_count", hd),
                   ("attention.key_length", hd), ("attention.value_length", hd), ("expert_count", E),
                   ("expert_used_count", cfg["num_experts_per_tok"])):  # fmt: skip
        g.add_uint32(f"llama.{key}", int(v))
    g.add_float32("llama.rope.freq_base", float(theta))
    g.add_float32("llama.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    g.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_BF16))

    def bf16(name, bits):
        g.add_tensor(name, np.ascontiguousarray(bits), raw_dtype=BF16)

    bf16("token_embd.weight", w["model.embed_tokens.weight"])
    for n in range(L):
        p, b = f"model.layers.{n}", f"blk.{n}"
        moe = f"{p}.block_sparse_moe"
        g.add_tensor(f"{b}.attn_norm.weight", f32(w[f"{p}.input_layernorm.weight"]))
        bf16(f"{b}.attn_q.weight", permute(w[f"{p}.self_attn.q_proj.weight"], nh))
        bf16(f"{b}.attn_k.weight", permute(w[f"{p}.self_attn.k_proj.weight"], nkv))
        bf16(f"{b}.attn_v.weight", w[f"{p}.self_attn.v_proj.weight"])
        bf16(f"{b}.attn_output.weight", w[f"{p}.self_attn.o_proj.weight"])
        g.add_tensor(f"{b}.ffn_norm.weight", f32(w[f"{p}.post_attention_layernorm.weight"]))
        g.add_tensor(f"{b}.ffn_gate_inp.weight", f32(w[f"{moe}.gate.weight"]))
        for x, proj in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            bf16(f"{b}.ffn_{x}_exps.weight", np.stack([w[f"{moe}.experts.{e}.{proj}.weight"] for e in range(E)]))
    g.add_tensor("output_norm.weight", f32(w["model.norm.weight"]))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return Path(convert_gguf(gpath, d / "tiny-bf16-split.colibri", progress=False))


# ---- comparison --------------------------------------------------------------------------


def _compare(ref: np.ndarray, got: np.ndarray, dtype: str, what: str, cut: int | None = None) -> float:
    """The exact precision against a reference computed in f32 on the same weights (any stored
    dtype): max |Δ logits| <= EXACT_TOL before `cut`, the same top-1 wherever it is clear."""
    assert got.shape == ref.shape and got.dtype == np.float32, what
    assert np.isfinite(got).all(), f"{what}: non-finite logits"
    if cut is not None:
        assert cut > 0, f"{what}: the first token routes differently (a router near-tie): choose other ids"
        ref, got = ref[:cut], got[:cut]
    delta = np.abs(ref - got).max(axis=-1)
    worst = int(np.argmax(delta))
    assert delta[worst] <= EXACT_TOL, (f"{what} ({dtype} weights): max |Δ logits| {delta[worst]:.3g} at position "
                                       f"{worst} > {EXACT_TOL}")  # fmt: skip
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * EXACT_TOL
    same = ref.argmax(-1) == got.argmax(-1)
    assert same[clear].all(), f"{what}: top-1 differs at positions {np.flatnonzero(clear & ~same).tolist()}"
    print(f"{what} ({dtype} weights): max |Δ logits| {float(delta.max()):.3g}, "
          f"top-1 equal at {int(clear.sum())}/{len(ref)} clear positions")  # fmt: skip
    return float(delta.max())


class _Run(NamedTuple):
    """A run's logits and the routing of its MoE layers: expert ids [layers, tokens, k] and
    router probabilities [layers, tokens, experts]."""
    logits: np.ndarray
    topk: np.ndarray
    probs: np.ndarray


def _traced(eng, run) -> _Run:
    """run(eng) -> logits, under a trace."""
    with eng.trace() as tr:
        out = run(eng)
    moe = np.asarray(eng._layer_is_moe(), dtype=bool)
    return _Run(out, np.asarray(tr.topk_ids)[moe], np.asarray(tr.router_probs)[moe])


def _hf_run(model, ids, device="cuda") -> _Run:
    """transformers' logits and routing (from its router logits: the families here choose the
    top-k of the softmax) in float32 (TF32 off); the model goes back to the CPU after."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    m = model.to(device)
    try:
        with torch.no_grad():
            out = m(torch.tensor([list(ids)], dtype=torch.long, device=device), output_router_logits=True)
        k = model.config.num_experts_per_tok
        probs = np.stack([torch.softmax(r.float(), -1).cpu().numpy() for r in out.router_logits])
        topk = np.stack([torch.topk(r.float(), k, dim=-1).indices.cpu().numpy() for r in out.router_logits])
        return _Run(out.logits[0].float().cpu().numpy().astype(np.float32), topk, probs)
    finally:
        model.to("cpu")


def _first_flip(ref: _Run, got_topk: np.ndarray, what: str) -> int:
    """The first position routed differently from the reference in some MoE layer (the
    number of positions when none is): from there on the two runs compute different things. A
    difference is only allowed where the reference itself was undecided (its k-th and
    (k+1)-th router probabilities within FLIP_GAP); elsewhere it is a routing bug."""
    assert ref.topk.shape == got_topk.shape, (what, ref.topk.shape, got_topk.shape)
    k = ref.topk.shape[-1]
    differ = (np.sort(ref.topk, axis=-1) != np.sort(got_topk, axis=-1)).any(axis=-1)   # [layers, tokens]
    pos = np.flatnonzero(differ.any(axis=0))
    if pos.size == 0:
        return ref.topk.shape[1]
    p = int(pos[0])
    for layer in np.flatnonzero(differ[:, p]):
        pr = np.sort(ref.probs[layer, p])[::-1]
        assert pr[k - 1] - pr[k] < FLIP_GAP, (f"{what}: experts differ at position {p}, MoE layer {layer}, where "
                                              f"the reference's k-th and (k+1)-th probabilities are "
                                              f"{pr[k - 1] - pr[k]:.3g} apart")  # fmt: skip
    return p


def _bitwise(a: np.ndarray, b: np.ndarray, what: str):
    assert a.shape == b.shape, what
    bad = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert bad.size == 0, f"{what}: {bad.size} logits differ (max |Δ| {float(np.max(np.abs(a - b))):.3g})"


MODELS = ["tiny", "mixtral", "qwen2_moe"]
DTYPES = ["f32", "bf16"]
BIG = "qwen3_big"
PRECISIONS = ["exact", "fast"]


def _fast_agreement(reference: _Run, run: _Run, what: str, worst_tol: float = FAST_WORST_REL_TOL) -> None:
    """Fast precision at its worst position (module docstring): over the positions whose
    experts are the reference's in every MoE layer, max |Δ|/range <= worst_tol and the same
    top-1 wherever the reference's top two are further apart than twice that; positions
    routed differently at most FAST_MAX_FLIPPED of all."""
    ref, ref_topk, got, got_topk = reference.logits, reference.topk, run.logits, run.topk
    assert got.shape == ref.shape and np.isfinite(got).all(), what
    assert ref_topk.shape == got_topk.shape and ref_topk.shape[1] == len(ref), (what, ref_topk.shape, got_topk.shape)
    flipped = (np.sort(ref_topk, axis=-1) != np.sort(got_topk, axis=-1)).any(axis=-1).any(axis=0)
    span = ref.max(axis=-1) - ref.min(axis=-1)
    rel = np.abs(ref - got).max(axis=-1) / span
    kept = np.flatnonzero(~flipped)
    worst = int(kept[np.argmax(rel[kept])])
    print(f"{what}: worst max |Δ|/range {rel[worst]:.3g} at position {worst} of {len(kept)} with the same "
          f"experts; {int(flipped.sum())}/{len(ref)} routed differently (median over all {float(np.median(rel)):.3g})")
    assert flipped.mean() <= FAST_MAX_FLIPPED, f"{what}: {int(flipped.sum())}/{len(ref)} positions routed differently"
    assert rel[worst] <= worst_tol, f"{what}: max |Δ|/range {rel[worst]:.3g} at position {worst} > {worst_tol}"
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = ~flipped & ((top2[:, 1] - top2[:, 0]) > 2 * worst_tol * span)
    same = ref.argmax(-1) == got.argmax(-1)
    assert same[clear].all(), f"{what}: top-1 differs at positions {np.flatnonzero(clear & ~same).tolist()}"


# ---- facts -------------------------------------------------------------------------------


def test_cuda_backend_facts(tiny_files):
    with Engine(tiny_files["f32"], backend="cuda", max_seq_len=128) as eng:
        c = eng.config
        assert c.backend == "cuda" and c.backend_device and not c.backend_device.startswith("cpu"), c.backend_device
        assert c.backend_device_bytes > 0 and c.backend_weight_bytes > 0
        n_moe = int(eng._layer_is_moe().sum())
        assert c.backend_experts_resident == n_moe * c.n_experts and c.backend_experts_host == 0
        st = eng.backend_stats()
        assert st["backend"] == "cuda" and st["device_bytes"] == c.backend_device_bytes
        print(f"tiny on {c.backend_device}: {c.backend_device_bytes / 2**20:.1f} MiB on the device "
              f"({c.backend_weight_bytes / 2**20:.1f} MiB weights)")


# ---- CUDA vs CPU, CUDA vs transformers ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODELS)
def test_cuda_matches_cpu(models, tiny_files, name, dtype):
    path = _path(models, tiny_files, name, dtype)
    with Engine(path) as eng:
        vocab = eng.vocab_size
    ids = _ids(vocab, 40, seed=1)
    what = f"{name} {dtype}: cuda vs cpu"
    with Engine(path) as eng:
        ref = _traced(eng, lambda e: e.forward(ids))
    with Engine(path, backend="cuda") as eng:
        got = _traced(eng, lambda e: e.forward(ids))
        last = eng.forward(ids, last_only=True)
    _compare(ref.logits, got.logits, dtype, what, _first_flip(ref, got.topk, what))
    _bitwise(last[0], got.logits[-1], f"{name} {dtype}: forward_last vs the last row")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_cuda_matches_transformers_on_the_gpu(models, tiny_files, name, dtype):
    """transformers float32 on the GPU from the same weights (for bf16: the bf16-rounded
    weights, upcast, as tests/hf_models.check_bf16_checkpoint does on the CPU)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    import copy

    model, path, top_k, vocab = models(name, dtype)
    ref_model = model
    if dtype == "bf16":
        ref_model = copy.deepcopy(model).to(torch.bfloat16).to(torch.float32)
    ids = _ids(vocab, 40, seed=2)
    ref = _hf_run(ref_model, ids)
    what = f"{name} {dtype}: cuda vs transformers (torch cuda)"
    with Engine(path, backend="cuda") as eng:
        got = _traced(eng, lambda e: e.forward(ids))
    _compare(ref.logits, got.logits, dtype, what, _first_flip(ref, got.topk, what))


@pytest.mark.parametrize("name", MODELS)
def test_fast_precision_agrees_with_exact(models, tiny_files, name):
    """bf16 weights, precision fast on the GPU (tensor cores) against the CPU's exact and fast
    modes, and (the random models) against transformers bf16 on the GPU, each at its worst
    position."""
    path = _path(models, tiny_files, name, "bf16")
    with Engine(path) as eng:
        vocab = eng.vocab_size
    ids = _ids(vocab, 80, seed=21)
    exact, cpu_fast, got = _exact_fast_and_cuda_fast(path, lambda eng: eng.forward(ids))
    _fast_agreement(exact, got, f"{name}: cuda fast vs cpu exact")
    _fast_agreement(cpu_fast, got, f"{name}: cuda fast vs cpu fast")
    if name == "tiny":
        return
    torch = pytest.importorskip("torch")
    import copy

    model = models(name, "bf16")[0]
    ref = _hf_run(copy.deepcopy(model).to(torch.bfloat16), ids)
    _fast_agreement(ref, got, f"{name}: cuda fast vs transformers bf16 (torch cuda)", FAST_HF_BF16_WORST_REL_TOL)


@pytest.mark.parametrize("name", MODELS)
def test_fast_decode_equals_full_forward_bitwise(models, tiny_files, name):
    """80 rows take the large tile shape, a decode step the small one: the same bits."""
    path = _path(models, tiny_files, name, "bf16")
    with Engine(path, backend="cuda", precision="fast") as eng:
        ids = _ids(eng.vocab_size, 80, seed=22)
        full = eng.forward(ids)
        rows = [eng.forward(ids[:40])]
        for p in range(40, len(ids)):
            rows.append(eng.forward(ids[p:p + 1], p))
    _bitwise(np.concatenate(rows), full, f"{name}: fast, incremental (small tiles) vs full (large tiles)")


def _exact_fast_and_cuda_fast(path, run, **kw):
    """run(engine) -> logits under a trace on the CPU's exact and fast modes and on the CUDA
    backend's fast mode (the tensor cores): three _Run."""
    out = []
    for opts in (dict(), dict(precision="fast"), dict(backend="cuda", precision="fast")):
        with Engine(path, **opts, **kw) as eng:
            if opts.get("backend") == "cuda":
                assert "tensor cores" in eng.config.backend_device, eng.config.backend_device
            out.append(_traced(eng, run))
    return out


def _assert_split_experts(path):
    """Every MoE layer's experts are three row-major BF16 tensors (no packed tensor)."""
    from colibri_lab.format import reader as fmt_reader

    info = fmt_reader.inspect(path)
    names = {t.name: t for t in info.tensors}
    packed = [t.name for t in info.tensors if t.layout == "experts_packed"]
    assert not packed, f"packed experts in {path}: {packed}"
    n_layers = int(info.metadata["model.n_layers"])
    for n in range(n_layers):
        for x in ("gate", "up", "down"):
            t = names.get(f"blk.{n}.ffn_{x}_exps")
            assert t is not None and t.layout == "row_major" and t.dtype == "bf16" and len(t.shape) == 3, (n, x, t)


def test_split_layout_experts_match_cpu(split_tiny):
    """Split-layout BF16 experts (a GGUF import) in the exact mode against the CPU backend."""
    _assert_split_experts(split_tiny)
    with Engine(split_tiny) as eng:
        vocab = eng.vocab_size
    ids = _ids(vocab, 40, seed=36)  # no router near-tie in 40 tokens (gaps >= 1.5e-3)
    what = "tiny split-layout bf16: cuda vs cpu"
    with Engine(split_tiny) as eng:
        ref = _traced(eng, lambda e: e.forward(ids))
    with Engine(split_tiny, backend="cuda") as eng:
        got = _traced(eng, lambda e: e.forward(ids))
    _compare(ref.logits, got.logits, "bf16", what, _first_flip(ref, got.topk, what))


def test_fast_split_layout_experts_agree(split_tiny):
    """Split-layout BF16 experts in fast precision: the gate/up tiles read gate and up through
    two pointers (the packed layout's one pointer elsewhere). Against the CPU's exact and fast
    modes on the same file, and decode steps (small tiles) = the full forward (large tiles)
    bitwise."""
    _assert_split_experts(split_tiny)
    with Engine(split_tiny) as eng:
        ids = _ids(eng.vocab_size, 80, seed=32)

    exact, cpu_fast, got = _exact_fast_and_cuda_fast(split_tiny, lambda eng: eng.forward(ids))
    _fast_agreement(exact, got, "tiny split-layout: cuda fast vs cpu exact")
    _fast_agreement(cpu_fast, got, "tiny split-layout: cuda fast vs cpu fast")
    with Engine(split_tiny, backend="cuda", precision="fast") as eng:
        rows = [eng.forward(ids[:40])]
        for p in range(40, len(ids)):
            rows.append(eng.forward(ids[p:p + 1], p))
    _bitwise(np.concatenate(rows), got.logits, "tiny split-layout: fast, incremental (small tiles) vs full (large tiles)")


# ---- a realistic shape: hidden 1024, head_dim 128, 64 experts top-8, q/k norms, Q8_0 --------


def test_realistic_shape_q8_0_exact_matches_cpu(models):
    """Exact precision on Q8_0 weights of the realistic shape: the CUDA backend against the CPU
    backend at the exact tolerance, a prompt and decode steps (graph replays)."""
    _, path, top_k, vocab = models(BIG, "q8_0")
    with Engine(path) as eng:
        assert eng.config.top_k == 8 and eng.config.n_experts == 64, eng.config
    ids, steps = _ids(vocab, 48, seed=41), _ids(vocab, 6, seed=42)

    def prompt_then_steps(eng):
        return np.concatenate([eng.forward(ids)] + [eng.forward([t], len(ids) + k) for k, t in enumerate(steps)])

    with Engine(path) as eng:
        ref = _traced(eng, prompt_then_steps)
    with Engine(path, backend="cuda") as eng:
        got = _traced(eng, prompt_then_steps)
    with Engine(path, backend="cuda") as eng:
        plain = prompt_then_steps(eng)   # decode steps replayed from CUDA graphs (no trace)
        replays = eng.backend_stats()["graph_replays"]
    what = f"{BIG} q8_0: cuda vs cpu, a prompt and {len(steps)} steps"
    _compare(ref.logits, got.logits, "q8_0", what, _first_flip(ref, got.topk, what))
    _bitwise(plain, got.logits, f"{BIG} q8_0: graph replays ({replays}) vs the traced run")


def test_realistic_shape_fast_agrees_and_batches(models):
    """Fast precision on the realistic shape (bf16 weights on the tensor cores) at its worst
    position against the CPU's exact and fast modes; a sequence batched with others = alone."""
    _, path, _, vocab = models(BIG, "bf16")
    ids = _ids(vocab, 64, seed=43)
    exact, cpu_fast, got = _exact_fast_and_cuda_fast(path, lambda eng: eng.forward(ids))
    _fast_agreement(exact, got, f"{BIG}: cuda fast vs cpu exact")
    _fast_agreement(cpu_fast, got, f"{BIG}: cuda fast vs cpu fast")
    with Engine(path, backend="cuda", precision="fast", max_seqs=3) as eng:
        prompts = [ids[:n] for n in (7, 33, 64)]
        alone = []
        for s, p in enumerate(prompts):
            eng.sequence(s).clear()
            alone.append(eng.batch([(s, p)], logits="all")[0])
        for s in range(3):
            eng.sequence(s).clear()
        together = eng.batch(list(enumerate(prompts)), logits="all")
    for s in range(3):
        _bitwise(together[s], alone[s], f"{BIG} fast: prompt {s} batched vs alone")


# ---- the CUDA backend against itself -----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", MODELS)
def test_incremental_decode_equals_full_forward(models, tiny_files, name, dtype):
    path = _path(models, tiny_files, name, dtype)
    with Engine(path, backend="cuda") as eng:
        ids = _ids(eng.vocab_size, 24, seed=3)
        full = eng.forward(ids)
        rows = [eng.forward(ids[:8])]
        for p in range(8, len(ids)):
            rows.append(eng.forward(ids[p:p + 1], p))
        inc = np.concatenate(rows)
        replays = eng.backend_stats()["graph_replays"]
    _compare(full, inc, dtype, f"{name} {dtype}: incremental vs full (cuda, {replays} graph replays)")


LONG_PREFILL, LONG_DECODE = 600, 520


@pytest.mark.parametrize("precision", PRECISIONS)
def test_long_decode_equals_full_forward_bitwise(tiny_files, precision):
    """1120 positions (35 attention chunks of 32 and 35 KV blocks of 32 tokens): a 600-token
    prompt (chunks of 512 and 88 rows) then 520 decode steps replayed from one CUDA graph, bitwise
    the full forward (chunks of 512, 512, 96); the full forward against the CPU's exact mode.
    data/tiny-mixtral, BF16: its 4096 positions allow it (the random Mixtral's config has 512)."""
    path, n = tiny_files["bf16"], LONG_PREFILL + LONG_DECODE
    with Engine(path, backend="cuda", precision=precision, max_seq_len=n, max_batch=512) as eng:
        assert eng.config.max_seq_len == n and eng.config.file_max_seq_len >= n, eng.config
        ids = _ids(eng.vocab_size, n, seed=33)
        full = _traced(eng, lambda e: e.forward(ids))
        rows = [eng.forward(ids[:LONG_PREFILL])]
        for p in range(LONG_PREFILL, n):
            rows.append(eng.forward(ids[p:p + 1], p))
        st = eng.backend_stats()
    with Engine(path, max_seq_len=n) as eng:
        ref = _traced(eng, lambda e: e.forward(ids))
    print(f"tiny {precision}: {LONG_DECODE} decode steps, {st['graphs_captured']} graph(s) captured, "
          f"{st['graph_replays']} replays")
    _bitwise(np.concatenate(rows), full.logits,
             f"tiny {precision}: {LONG_DECODE} decode steps after {LONG_PREFILL} vs full")
    what = f"tiny {precision}: cuda full forward of {n} vs cpu exact"
    if precision == "exact":
        _compare(ref.logits, full.logits, "bf16", what, _first_flip(ref, full.topk, what))
    else:
        _fast_agreement(ref, full, what)


@pytest.mark.parametrize("dtype,precision", [("f32", "exact"), ("bf16", "exact"), ("bf16", "fast")])
@pytest.mark.parametrize("name", MODELS)
def test_batched_equals_alone_bitwise(models, tiny_files, name, dtype, precision):
    path = _path(models, tiny_files, name, dtype)
    with Engine(path, backend="cuda", max_seqs=4, precision=precision) as eng:
        V = eng.vocab_size
        prompts = [_ids(V, n, seed=10 + n) for n in (5, 17, 9, 30)]
        alone = []
        for s, p in enumerate(prompts):
            eng.sequence(s).clear()
            first = eng.batch([(s, p)], logits="all")[0]
            steps = [eng.batch([(s, [int(first[-1].argmax())])])[0]]
            alone.append((first, steps))
        for s in range(4):
            eng.sequence(s).clear()
        together = eng.batch(list(enumerate(prompts)), logits="all")
        for s in range(4):
            _bitwise(together[s], alone[s][0], f"{name} {dtype}: prompt {s} batched vs alone")
        step = eng.batch([(s, [int(together[s][-1].argmax())]) for s in range(4)])
        for s in range(4):
            _bitwise(step[s], alone[s][1][0], f"{name} {dtype}: decode step {s} batched vs alone")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", MODELS)
def test_run_to_run_determinism(models, tiny_files, name, precision):
    path = _path(models, tiny_files, name, "bf16")
    runs = []
    with Engine(path, backend="cuda", precision=precision) as eng:
        ids = _ids(eng.vocab_size, 33, seed=4)
        for _ in range(3):
            runs.append(eng.forward(ids))
            dec = [eng.forward([ids[i]], 33 + i) for i in range(4)]
            runs.append(np.concatenate(dec))
    with Engine(path, backend="cuda", precision=precision) as eng:
        runs.append(eng.forward(ids))
    for i in (2, 4, 6):
        _bitwise(runs[i], runs[0], f"{name}: prefill run {i // 2 + 1} vs run 1")
    for i in (3, 5):
        _bitwise(runs[i], runs[1], f"{name}: decode run {i // 2 + 1} vs run 1")


def _device_total() -> int:
    import torch

    return int(torch.cuda.mem_get_info()[1])


def _partial_fraction(path, **kw) -> tuple[float, dict]:
    """A gpu_memory_fraction under which some but not all routed experts are resident (bisection)."""
    pytest.importorskip("torch")
    with Engine(path, backend="cuda", **kw) as eng:
        full = eng.config.backend_device_bytes
        n_exp = eng.config.backend_experts_resident
    total = _device_total()
    lo, hi = 0.0, min(1.0, 1.5 * full / total + 0.02)
    for _ in range(48):
        f = (lo + hi) / 2
        try:
            with Engine(path, backend="cuda", gpu_memory_fraction=f, **kw) as eng:
                c = eng.config
        except ColibriError:
            lo = f  # not even the dense part fits
            continue
        if c.backend_experts_host == 0:
            hi = f
        elif c.backend_experts_resident == 0:
            lo = f
        else:
            assert c.backend_experts_resident + c.backend_experts_host == n_exp
            return f, {"resident": c.backend_experts_resident, "host": c.backend_experts_host}
    pytest.fail(f"no gpu_memory_fraction in ({lo}, {hi}) leaves some experts on the host ({full} device bytes)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_on_the_host_still_match(models, dtype):
    _, path, top_k, vocab = models("mixtral", dtype)
    f, split = _partial_fraction(path, max_seq_len=256)
    ids, steps = _ids(vocab, 40, seed=5), _ids(vocab, 4, seed=6)

    def prompt_then_steps(eng):
        return np.concatenate([eng.forward(ids)] + [eng.forward([t], len(ids) + k) for k, t in enumerate(steps)])

    with Engine(path, max_seq_len=256) as eng:
        ref = _traced(eng, prompt_then_steps)
    with Engine(path, backend="cuda", gpu_memory_fraction=f, max_seq_len=256) as eng:
        assert eng.config.backend_experts_host > 0 and eng.config.backend_experts_resident > 0
        got = _traced(eng, prompt_then_steps)
    with Engine(path, backend="cuda", max_seq_len=256) as eng:
        full = _traced(eng, prompt_then_steps)
    what = f"mixtral {dtype}: fraction {f:.3g} ({split})"
    _compare(ref.logits, got.logits, dtype, f"{what} vs cpu", _first_flip(ref, got.topk, f"{what} vs cpu"))
    _compare(full.logits, got.logits, dtype, f"{what} vs all resident",
             _first_flip(full, got.topk, f"{what} vs all resident"))


def test_fast_experts_on_the_host_still_agree(models):
    """Fast precision with some experts on the host: the resident ones on the tensor cores, the
    others through the CPU (cb_cpu_expert_rows, its fast mode), no graphs. An 80-token prompt
    and 8 decode steps against the CPU's exact and fast modes and against all experts resident."""
    _, path, _, vocab = models("mixtral", "bf16")
    f, split = _partial_fraction(path, max_seq_len=256, precision="fast")
    ids, steps = _ids(vocab, 80, seed=34), _ids(vocab, 8, seed=35)

    def prompt_then_steps(eng):
        out = [eng.forward(ids)] + [eng.forward([t], len(ids) + k) for k, t in enumerate(steps)]
        return np.concatenate(out)

    exact, cpu_fast, full = _exact_fast_and_cuda_fast(path, prompt_then_steps, max_seq_len=256)
    with Engine(path, backend="cuda", precision="fast", max_seq_len=256, gpu_memory_fraction=f) as eng:
        c = eng.config
        assert "tensor cores" in c.backend_device, c.backend_device
        assert c.backend_experts_resident > 0 and c.backend_experts_host > 0, split
        got = _traced(eng, prompt_then_steps)
    _fast_agreement(exact, got, f"mixtral: cuda fast, fraction {f:.3g} ({split}) vs cpu exact")
    _fast_agreement(cpu_fast, got, f"mixtral: cuda fast, fraction {f:.3g} vs cpu fast")
    _fast_agreement(full, got, f"mixtral: cuda fast, fraction {f:.3g} vs all resident")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", MODELS)
def test_graph_replays_equal_the_eager_stage_run(models, tiny_files, name, precision):
    path = _path(models, tiny_files, name, "bf16")
    with Engine(path, backend="cuda") as eng:
        V = eng.vocab_size
    prompt, steps = _ids(V, 12, seed=7), _ids(V, 8, seed=8)

    def decode(mode):
        with Engine(path, backend="cuda", precision=precision) as eng:
            out = [eng.forward(prompt)]
            for k, t in enumerate(steps):
                pos = len(prompt) + k
                if mode == "graph":
                    out.append(eng.forward([t], pos))
                elif mode == "stages":
                    out.append(eng.stages([t], pos).finish())
                else:
                    with eng.trace():
                        out.append(eng.forward([t], pos))
            return np.concatenate(out), eng.backend_stats()

    graph, st = decode("graph")
    assert st["graphs_captured"] >= 1 and st["graph_replays"] > 0, st
    staged, st2 = decode("stages")
    traced, _ = decode("traced")
    _bitwise(staged, graph, f"{name}: eager stage-by-stage vs graph replay ({st['graph_replays']} replays)")
    _bitwise(traced, graph, f"{name}: traced vs graph replay")
    print(f"{name}: {st['graphs_captured']} graph(s) captured, {st['graph_replays']} replays; stage run: {st2}")


def test_device_stage_tensors_equal_their_host_copies(tiny_files):
    cupy = pytest.importorskip("cupy")
    with Engine(tiny_files["f32"], backend="cuda") as eng:
        ids = _ids(eng.vocab_size, 7, seed=9)
        run = eng.stages(ids)
        checked, absent = set(), set()
        while not run.done:
            outs = run.run()
            for k, host in outs.items():
                if k == "logits":
                    continue
                try:
                    dev = run.tensor(k, device=True)
                except colibri_lab.ColibriUnsupportedError:
                    absent.add(k)
                    continue
                assert isinstance(dev, cupy.ndarray) and dev.shape == host.shape and dev.dtype == host.dtype, k
                assert np.array_equal(cupy.asnumpy(dev).view(np.uint8), np.ascontiguousarray(host).view(np.uint8)), k
                checked.add(k)
        assert "x" in checked, (checked, absent)
        print(f"device tensors equal to host: {sorted(checked)}; host only: {sorted(absent)}")
