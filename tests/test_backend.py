"""The backend seam (native/src/backend/backend.h, docs/backends.md) as the CPU sees it.

- the CPU backend's facts: ``config.backend == "cpu"``, ``backend_device`` names the CPU and
  its kernels, no device memory, no experts placed anywhere, no graphs;
- ``Engine(backend="cuda")``, by the kind of library (told apart by the file: a CUDA build
  holds nvcc's device code, and the CUDA driver counts the devices): a CPU-only build raises
  the engine's ColibriUnsupportedError naming -DCOLIBRI_CUDA=ON, a CUDA build without a
  device one saying "no CUDA device", a CUDA build with a device runs the model (its numbers
  are tests/test_gpu.py's);
- bad ``backend`` / ``gpu_memory_fraction`` / ``gpu_device`` values raise ValueError in Python
  before the library is called, and bad raw ``colibri_options`` values through ctypes give
  COLIBRI_E_INVALID_ARG;
- ``StageRun.tensor(name, device=True)`` on the CPU raises the engine's UNSUPPORTED error, and
  ``colibri_stage_tensor_device`` returns it;
- the seam changed nothing: the CPU stages moved into backend/cpu/stages.c and run through a table,
  so the fused forward, the stage-by-stage run, the batch API (alone and beside another
  sequence), a traced forward, a chunked forward (max_batch), incremental decoding and
  forward_last all give bitwise the same logits, on the tiny Mixtral (f32 and bf16, exact
  and fast) and on a Qwen2-MoE with a shared expert and a dense layer (on 2 threads: the
  thread count's invariance is tests/test_threads_kernels.py's);
- the tools: ``--backend``, ``--gpu_memory_fraction`` and ``--gpu_device`` in colibri_cli,
  colibri_bench and colibri_server (usage errors exit 2; ``--backend cuda`` where it cannot
  run fails with one line and exit 1, naming -DCOLIBRI_CUDA=ON for a program without the
  backend; --verbose, the bench's text and JSON, /v1/models and /metrics report the backend
  and its device).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import subprocess
import urllib.request

import numpy as np
import pytest

import colibri_lab
from colibri_lab import ColibriInvalidArgError, ColibriUnsupportedError, Engine
from colibri_lab.runtime import engine as engine_mod

CUDA_FLAG = "-DCOLIBRI_CUDA=ON"


@pytest.fixture(scope="module")
def tiny(make_model):
    return make_model()[1]


@pytest.fixture(scope="module")
def tiny_bf16(make_model):
    return make_model(dtype="bf16")[1]


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


# ---- the CPU backend's facts ---------------------------------------------------------------


def test_cpu_backend_facts(tiny):
    with Engine(tiny, num_threads=2) as eng:
        c = eng.config
        assert c.backend == "cpu"
        assert c.backend_device.startswith("cpu: ") and c.kernels in c.backend_device, c.backend_device
        assert "(2 threads)" in c.backend_device, c.backend_device
        assert (c.backend_device_bytes, c.backend_weight_bytes) == (0, 0)
        assert (c.backend_experts_resident, c.backend_experts_host) == (0, 0)
        eng.forward([1, 2, 3])
        st = eng.backend_stats()
        assert st["backend"] == "cpu" and st["device"] == c.backend_device
        assert st["graphs_captured"] == 0 and st["graph_replays"] == 0
    assert colibri_lab.BACKENDS == ("cpu", "cuda") == engine_mod.BACKENDS
    with Engine(tiny, backend="cpu") as eng:  # the explicit default
        assert eng.config.backend == "cpu"


def _section_names(path) -> set[str]:
    """The section names of an ELF file (empty for anything else, e.g. a Mach-O dylib)."""
    import struct

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # 64-bit little-endian only
        return set()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if not shoff or shstrndx >= shnum:
        return set()

    def header(i):  # (name offset, file offset, size) of section i
        b = shoff + i * shentsize
        return struct.unpack_from("<I", data, b)[0], *struct.unpack_from("<QQ", data, b + 0x18)

    _, stroff, strsize = header(shstrndx)
    strtab = data[stroff:stroff + strsize]
    return {strtab[n:strtab.index(b"\0", n)].decode("ascii", "replace") for n, _, _ in map(header, range(shnum))}


def _has_cuda_backend(path) -> bool:
    """Whether a library or program holds the CUDA backend, read from the file itself rather
    than from what the engine says: nvcc's device code (an .nv_fatbin section), which only a
    -DCOLIBRI_CUDA=ON build links in."""
    return ".nv_fatbin" in _section_names(path)


def _cuda_devices() -> int:
    """CUDA devices the driver reports (cuInit, cuDeviceGetCount); 0 without a driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    n = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return 0
    return n.value


def test_section_reader_sees_the_libraries_sections():
    """_has_cuda_backend reads real section tables (else every build would look CPU-only)."""
    names = _section_names(colibri_lab.runtime._native.lib_path)
    assert {".text", ".dynsym", ".rodata"} <= names, sorted(names)


def test_cuda_backend_opens_or_says_why(tiny):
    """backend="cuda", for each kind of library: a CPU-only build refuses it with one line
    naming -DCOLIBRI_CUDA=ON; a CUDA build on a machine without a CUDA device refuses it with
    one line saying so; a CUDA build with a device runs the model there (tests/test_gpu.py
    checks its numbers)."""
    lib_path = colibri_lab.runtime._native.lib_path
    if not _has_cuda_backend(lib_path):
        with pytest.raises(ColibriUnsupportedError) as ei:
            Engine(tiny, backend="cuda")
        msg = str(ei.value)
        assert "no CUDA backend" in msg and CUDA_FLAG in msg and "\n" not in msg, msg
        assert ei.value.status == colibri_lab.runtime.errors.E_UNSUPPORTED
    elif _cuda_devices() == 0:
        with pytest.raises(ColibriUnsupportedError) as ei:
            Engine(tiny, backend="cuda")
        msg = str(ei.value)
        assert msg.startswith("no CUDA device: ") and "use the cpu backend" in msg and "\n" not in msg, msg
        assert ei.value.status == colibri_lab.runtime.errors.E_UNSUPPORTED
    else:
        with Engine(tiny, backend="cuda", max_seq_len=64) as eng:
            assert eng.config.backend == "cuda", eng.config.backend
            assert eng.config.backend_device and not eng.config.backend_device.startswith("cpu")
            logits = eng.forward([1, 2, 3, 4])
            assert logits.shape == (4, eng.vocab_size) and np.isfinite(logits).all()


# ---- argument checks -----------------------------------------------------------------------


@pytest.mark.parametrize("kw, needle", [
    (dict(backend="gpu"), "backend must be one of 'cpu', 'cuda'"),
    (dict(backend="CUDA"), "backend must be one of"),
    (dict(backend=1), "backend must be one of"),
    (dict(backend=None), "backend must be one of"),
    (dict(backend="cuda", gpu_memory_fraction=0), "gpu_memory_fraction must be"),
    (dict(backend="cuda", gpu_memory_fraction=0.0), "gpu_memory_fraction must be"),
    (dict(backend="cuda", gpu_memory_fraction=-0.5), "gpu_memory_fraction must be"),
    (dict(backend="cuda", gpu_memory_fraction=1.01), "gpu_memory_fraction must be"),
    (dict(backend="cuda", gpu_memory_fraction=math.nan), "gpu_memory_fraction must be"),
    (dict(backend="cuda", gpu_memory_fraction=math.inf), "gpu_memory_fraction must be"),
    (dict(backend="cuda", gpu_memory_fraction="0.5"), "gpu_memory_fraction must be"),
    (dict(backend="cuda", gpu_memory_fraction=True), "gpu_memory_fraction must be"),
    (dict(backend="cuda", gpu_device=-1), "gpu_device must be"),
    (dict(backend="cuda", gpu_device=1.0), "gpu_device must be"),
    (dict(backend="cuda", gpu_device="0"), "gpu_device must be"),
    (dict(backend="cuda", gpu_device=True), "gpu_device must be"),
    (dict(backend="cuda", gpu_device=2**31), "gpu_device must be"),
    (dict(gpu_memory_fraction=0.5), "need backend='cuda'"),
    (dict(backend="cpu", gpu_device=1), "need backend='cuda'"),
])  # fmt: skip
def test_bad_backend_arguments_raise_before_the_library(tiny, monkeypatch, kw, needle):
    def boom(*a):
        raise AssertionError("colibri_init_ex was called")

    monkeypatch.setattr(engine_mod.lib, "colibri_init_ex", boom)
    with pytest.raises(ValueError, match=needle) as ei:
        Engine(tiny, **kw)
    assert isinstance(ei.value, ColibriInvalidArgError)


def test_good_backend_arguments_reach_the_options(tiny, monkeypatch):
    """numpy scalars are numbers too; the values land in colibri_options as given."""
    seen = {}
    real = engine_mod.lib.colibri_init_ex

    def spy(path, opt, out, err, n):
        o = ctypes.cast(opt, ctypes.POINTER(colibri_lab.runtime._native.ColibriOptions)).contents
        seen.update(backend=o.backend, frac=o.gpu_memory_fraction, dev=o.gpu_device)
        return real(path, opt, out, err, n)

    monkeypatch.setattr(engine_mod.lib, "colibri_init_ex", spy)
    for kw, want in [(dict(), (0, 0.0, 0)),
                     (dict(backend="cuda", gpu_memory_fraction=np.float32(0.25), gpu_device=np.int64(3)),
                      (1, 0.25, 3)),
                     (dict(backend="cuda", gpu_memory_fraction=1), (1, 1.0, 0))]:  # fmt: skip
        try:
            Engine(tiny, **kw).close()
        except ColibriUnsupportedError:
            pass  # no CUDA backend / device here: the options were still handed over
        assert (seen["backend"], seen["frac"], seen["dev"]) == want, kw


def _raw_init(path, **fields) -> tuple[int, str]:
    lib = colibri_lab.runtime._native.lib
    opt = colibri_lab.runtime._native.ColibriOptions()
    lib.colibri_options_init(ctypes.byref(opt))
    for k, v in fields.items():
        setattr(opt, k, v)
    ctx = colibri_lab.runtime._native.ctx_p()
    err = ctypes.create_string_buffer(1024)
    st = lib.colibri_init_ex(os.fsencode(path), ctypes.byref(opt), ctypes.byref(ctx), err, len(err))
    if ctx:
        lib.colibri_free(ctx)
    return st, err.value.decode()


def test_options_init_defaults(tiny):
    opt = colibri_lab.runtime._native.ColibriOptions()
    colibri_lab.runtime._native.lib.colibri_options_init(ctypes.byref(opt))
    assert (opt.backend, opt.gpu_device, opt.gpu_memory_fraction) == (0, 0, 0.0)


@pytest.mark.parametrize("fields", [
    dict(backend=2), dict(backend=-1), dict(backend=99),
    dict(backend=1, gpu_memory_fraction=1.5), dict(backend=1, gpu_memory_fraction=-0.1),
    dict(backend=1, gpu_memory_fraction=math.nan), dict(backend=1, gpu_device=-1),
    dict(gpu_memory_fraction=2.0), dict(gpu_device=-3),
])  # fmt: skip
def test_bad_raw_options_are_invalid_arg(tiny, fields):
    st, msg = _raw_init(tiny, **fields)
    assert st == colibri_lab.runtime.errors.E_INVALID_ARG, (st, msg)
    assert msg.startswith("invalid options:"), msg


def test_raw_cpu_backend_ignores_the_gpu_fields(tiny):
    """Valid GPU fields are only read by the CUDA backend: the CPU opens as usual."""
    st, msg = _raw_init(tiny, backend=0, gpu_memory_fraction=0.5, gpu_device=7)
    assert st == 0, msg


# ---- device tensors ------------------------------------------------------------------------


def test_stage_tensor_device_on_cpu_raises(tiny):
    with Engine(tiny, num_threads=2) as eng:
        run = eng.stages([1, 2, 3, 4])
        run.embedding()
        host = run.tensor("x")
        assert host.shape == (4, eng.config.hidden_size)
        with pytest.raises(ColibriUnsupportedError, match="cpu backend keeps 'x' on the host"):
            run.tensor("x", device=True)
        # the raw call: E_UNSUPPORTED, nothing written
        p = ctypes.c_void_p(1234)
        st = colibri_lab.runtime._native.lib.colibri_stage_tensor_device(eng._c(), b"x", ctypes.byref(p))
        assert st == colibri_lab.runtime.errors.E_UNSUPPORTED and p.value == 1234
        # the run goes on as if nothing happened
        logits = run.finish()
        assert np.array_equal(logits, eng.forward([1, 2, 3, 4]))


def test_device_array_without_cupy_says_how_to_get_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_cupy(name, *a, **k):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    shape = (ctypes.c_int64 * 4)(2, 3, 0, 0)
    with pytest.raises(ImportError, match=r"pip install colibri-lab\[gpu\]"):
        engine_mod._device_array(0x1000, 0, 2, shape, owner=None)


# ---- the seam changed nothing: every path gives the same bits ------------------------------


def _all_paths(path, ids, **kw) -> dict[str, np.ndarray]:
    """The logits of `ids` from each way of running them, on fresh engines."""
    n = len(ids)
    out = {}
    with Engine(path, num_threads=2, max_seqs=2, **kw) as eng:
        out["fused"] = eng.forward(ids)
        out["last"] = np.concatenate([eng.forward(ids[:k], last_only=True) for k in range(1, n + 1)])
        out["staged"] = eng.stages(ids).finish()
        run = eng.stages(ids)  # stage by stage, reading every output on the way
        while not run.done:
            for v in run.run().values():
                np.asarray(v).sum()
        out["staged_read"] = run.logits
        with eng.trace() as tr:
            out["traced"] = eng.forward(ids)
        assert tr.topk_ids.shape[1] == n
        with eng.trace():
            out["traced_staged"] = eng.stages(ids).finish()
        eng.sequence(0).clear()
        out["batch"] = eng.batch([(0, ids)], logits="all")[0]
        for s in (0, 1):
            eng.sequence(s).clear()
        other = [(7 * i + 5) % eng.vocab_size for i in range(n + 3)]
        out["batch_beside"] = eng.batch([(1, other), (0, ids)], logits="all")[1]
        # incremental: a prefix, then one token at a time
        rows = [eng.forward(ids[:3])]
        for p in range(3, n):
            rows.append(eng.forward(ids[p:p + 1], p))
        out["incremental"] = np.concatenate(rows)
        st = eng.stages(ids[:3]).finish()  # a stage run continued by forwards and stage runs
        rest = [eng.stages(ids[p:p + 1], p).finish() if p % 2 else eng.forward(ids[p:p + 1], p) for p in range(3, n)]
        out["staged_incremental"] = np.concatenate([st, *rest])
    with Engine(path, num_threads=2, max_batch=4, **kw) as eng:
        out["chunked"] = eng.forward(ids)
    return out


def _assert_bitwise(out: dict[str, np.ndarray]):
    ref = out["fused"]
    assert np.isfinite(ref).all()
    for k, v in out.items():
        assert v.shape == ref.shape and v.dtype == np.float32, k
        bad = np.flatnonzero(v.view(np.uint32) != ref.view(np.uint32))
        assert bad.size == 0, f"{k}: {bad.size} logits differ from the fused forward (max |Δ| " \
                              f"{float(np.max(np.abs(v - ref))):.3g})"


@pytest.mark.parametrize("dtype, precision", [("f32", "exact"), ("bf16", "exact"), ("bf16", "fast")])
def test_every_path_is_bitwise_the_fused_forward(make_model, dtype, precision):
    path = make_model(dtype=dtype)[1]
    ids = _ids(32000, 11, seed=3)
    _assert_bitwise(_all_paths(path, ids, precision=precision))


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """A Qwen2-MoE with a gated shared expert and a dense-MLP layer (layer 1)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from colibri_lab.bench.models import FamilyShape, build_model, save_checkpoint

    shape = FamilyShape("qwen2_moe", vocab=301, hidden=48, inter=20, dense_inter=30, shared_inter=24, layers=3,
                        heads=4, kv_heads=2, experts=6, top_k=2, mlp_only_layers=(1,))
    folder = save_checkpoint(build_model(shape), tmp_path_factory.mktemp("qwen2moe"))
    out = folder.parent / "qwen2moe-f32.colibri"
    colibri_lab.convert(folder, out, dtype="f32", progress=False)
    return out


def test_shared_expert_paths_are_bitwise(qwen2_moe):
    with Engine(qwen2_moe) as eng:
        assert eng.config.family == "qwen2_moe" and not eng._layer_is_moe()[1]
    _assert_bitwise(_all_paths(qwen2_moe, _ids(301, 9, seed=1)))


def test_stage_outputs_are_what_the_trace_records(tiny):
    """The stage run's router outputs are the trace's, layer by layer (both read host memory)."""
    ids = _ids(32000, 6, seed=9)
    with Engine(tiny, num_threads=2) as eng:
        with eng.trace() as tr:
            eng.forward(ids)
        run = eng.stages(ids)
        run.embedding()
        for layer in range(eng.config.n_layers):
            run.attention()
            r = run.router()
            assert np.array_equal(r["topk_ids"], tr.topk_ids[layer])
            assert np.array_equal(r["topk_weights"].view(np.uint32), tr.topk_weights[layer].view(np.uint32))
            assert np.array_equal(r["router_probs"].view(np.uint32), tr.router_probs[layer].view(np.uint32))
            run.run_layer()
        run.finish()


# ---- the tools -----------------------------------------------------------------------------


def _tool(name: str, env: str) -> str:
    from conftest import find_tool

    return find_tool(name, env, "install the package with `pip install -e .`")


@pytest.fixture(scope="module")
def bench_path() -> str:
    return _tool("colibri_bench", "COLIBRI_BENCH")


@pytest.fixture(scope="module")
def server_path() -> str:
    return _tool("colibri_server", "COLIBRI_SERVER")


def _run(exe, *args, timeout=120):
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=timeout)


TOOL_ARGS = {"colibri_cli": ["--prompt", "hi"], "colibri_bench": [], "colibri_server": []}


def _tool_paths(cli_path, bench_path, server_path):
    return {"colibri_cli": cli_path, "colibri_bench": bench_path, "colibri_server": server_path}


@pytest.mark.parametrize("tool", ["colibri_cli", "colibri_bench", "colibri_server"])
@pytest.mark.parametrize("flags, needle", [
    (["--backend", "gpu"], "--backend must be 'cpu' or 'cuda', got 'gpu'"),
    (["--backend", ""], "--backend must be 'cpu' or 'cuda', got ''"),
    (["--backend"], "needs a value"),
    (["--backend", "cuda", "--gpu_memory_fraction", "1.5"], "--gpu_memory_fraction must be a number in (0, 1]"),
    (["--backend", "cuda", "--gpu_memory_fraction", "-0.5"], "--gpu_memory_fraction must be a number in (0, 1]"),
    (["--backend", "cuda", "--gpu_memory_fraction", "half"], "--gpu_memory_fraction must be"),
    (["--backend", "cuda", "--gpu_memory_fraction", "nan"], "--gpu_memory_fraction must be"),
    (["--backend", "cuda", "--gpu_device", "-1"], "--gpu_device must be an integer in 0..1023"),
    (["--backend", "cuda", "--gpu_device", "x"], "--gpu_device must be"),
    (["--gpu_device", "1"], "give --backend cuda too"),
    (["--backend", "cpu", "--gpu_memory_fraction", "0.5"], "give --backend cuda too"),
])  # fmt: skip
def test_backend_usage_errors_exit_2(cli_path, bench_path, server_path, tool, flags, needle):
    exe = _tool_paths(cli_path, bench_path, server_path)[tool]
    r = _run(exe, "--model", "m.colibri", *TOOL_ARGS[tool], *flags)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr and f"Try '{tool} --help'" in r.stderr, r.stderr


def test_cli_gpu_fraction_zero_is_a_usage_error_but_the_server_takes_it(cli_path, server_path):
    """colibri_server took --gpu_memory_fraction 0 before there was a GPU backend (vLLM-style
    scripts): it still means "the default"; the other tools want (0, 1]."""
    r = _run(cli_path, "--model", "m.colibri", "--prompt", "hi", "--backend", "cuda", "--gpu_memory_fraction", "0")
    assert r.returncode == 2 and "--gpu_memory_fraction must be" in r.stderr
    r = _run(server_path, "--model", "/nonexistent.colibri", "--port", "0", "--gpu_memory_fraction", "0")
    assert r.returncode == 1 and "cannot open model" in r.stderr, r.stderr


def _runs_on_cuda(exe, tool, model):
    """The program with --backend cuda on a machine with a CUDA device: it runs there."""
    flags = ["--backend", "cuda", "--gpu_memory_fraction", "0.5"]
    if tool == "colibri_cli":
        r = _run(exe, "--model", model, "--prompt", "hi", "--max_new_tokens", 2, "--verbose", *flags)
        assert r.returncode == 0, r.stderr
        assert any(x.startswith("backend: cuda (") for x in r.stderr.splitlines()), r.stderr
    elif tool == "colibri_bench":
        r = _run(exe, "--model", model, "--seq_len", 5, "--max_new_tokens", 2, "--num_requests", 1, "--warmup", 0,
                 "--json", *flags)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["backend"] == "cuda", r.stdout
    else:
        from colibri_lab.runtime.serving import free_port, wait_healthy

        port = free_port()
        proc = subprocess.Popen([exe, "--model", str(model), "--host", f"127.0.0.1:{port}", "--parallel", "1",
                                 "--max_seq_len", "64", *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_healthy(proc, port, 60)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
                assert json.loads(resp.read())["data"][0]["backend"] == "cuda"
        finally:
            proc.terminate()
            proc.wait(timeout=20)


@pytest.mark.parametrize("tool", ["colibri_cli", "colibri_bench", "colibri_server"])
def test_backend_cuda_in_the_tools_runs_or_is_one_clear_line(cli_path, bench_path, server_path, tiny, tool):
    """--backend cuda, by the kind of program (told apart as the library is): without the
    CUDA backend it fails with one line naming -DCOLIBRI_CUDA=ON, with it on a machine without
    a CUDA device with one line saying so (exit 1 either way); with the backend and a device
    it runs on the GPU."""
    exe = _tool_paths(cli_path, bench_path, server_path)[tool]
    cuda = _has_cuda_backend(exe)
    if cuda and _cuda_devices() > 0:
        _runs_on_cuda(exe, tool, tiny)
        return
    extra = ["--port", "0"] if tool == "colibri_server" else []
    r = _run(exe, "--model", tiny, *TOOL_ARGS[tool], *extra, "--backend", "cuda", "--gpu_memory_fraction", "0.5")
    assert r.returncode == 1, (r.returncode, r.stderr)
    errors = [x for x in r.stderr.splitlines() if "error" in x]
    assert len(errors) == 1, r.stderr
    line = errors[0]
    assert line.startswith(f"{tool}: error: cannot open model: "), line
    if cuda:
        assert "no CUDA device: " in line, line
    else:
        assert "no CUDA backend" in line and CUDA_FLAG in line, line
    if tool != "colibri_server":  # the server says where it listens first
        assert r.stderr.strip() == line, r.stderr


def test_cli_verbose_reports_the_backend(cli_path, tiny):
    r = _run(cli_path, "--model", tiny, "--prompt", "The quick brown fox", "--max_new_tokens", "3",
             "--num_threads", "2", "--verbose", "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("backend:"))
    with Engine(tiny, num_threads=2) as eng:
        assert line == f"backend: cpu ({eng.config.backend_device})", line
        assert "cpu: " in line and eng.config.kernels in line
    plain = _run(cli_path, "--model", tiny, "--prompt", "The quick brown fox", "--max_new_tokens", "3",
                 "--num_threads", "2")
    assert plain.stdout == r.stdout  # --backend cpu is the default


def test_bench_reports_the_backend(bench_path, tiny):
    args = ["--model", tiny, "--seq_len", 5, "--max_new_tokens", 2, "--num_requests", 1, "--warmup", 0,
            "--num_threads", 2, "--backend", "cpu"]
    r = _run(bench_path, *args, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["backend"] == "cpu" and d["backend_device"].startswith("cpu: ") and d["kernels"] in d["backend_device"]
    assert d["backend_memory"] == {"device_bytes": 0, "weight_bytes": 0, "experts_resident": 0, "experts_host": 0,
                                   "graphs_captured": 0, "graph_replays": 0}
    t = _run(bench_path, *args)
    assert t.returncode == 0, t.stderr
    assert f"backend: cpu ({d['backend_device']})\n" in t.stdout, t.stdout


def test_help_texts_name_the_flags(cli_path, bench_path, server_path):
    for exe in (cli_path, bench_path, server_path):
        r = _run(exe, "--help")
        assert r.returncode == 0
        for flag in ("--backend", "--gpu_memory_fraction", "--gpu_device", "cpu or cuda", CUDA_FLAG):
            assert flag in r.stdout, (exe, flag)


def test_server_reports_the_backend(server_path, tiny, tmp_path):
    from colibri_lab.runtime.serving import free_port, parse_metrics, wait_healthy

    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([server_path, "--model", str(tiny), "--host", f"127.0.0.1:{port}", "--num_threads", "2",
                             "--parallel", "1", "--max_seq_len", "64", "--backend", "cpu"],
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_healthy(proc, port, 60)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
            m = json.loads(resp.read())["data"][0]
        with Engine(tiny, num_threads=2) as eng:
            device = eng.config.backend_device
        assert m["backend"] == "cpu" and m["backend_device"] == device, m
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        info = [x for x in text.splitlines() if x.startswith("colibri_backend_info{")]
        assert info == [f'colibri_backend_info{{backend="cpu",device="{device}"}} 1'], info
        assert "# TYPE colibri_backend_info gauge" in text
        met = parse_metrics(text)
        for k in ("colibri_backend_device_bytes", "colibri_backend_experts_resident", "colibri_backend_experts_host"):
            assert met[k] == 0, (k, met.get(k))
        log.flush()
        assert f"backend cpu ({device})" in (tmp_path / "server.log").read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
