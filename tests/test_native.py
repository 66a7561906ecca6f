"""The C test programs that need a model file, run on freshly converted models.

`make test` builds them (ctest alone skips them: it has no model); the `native_tests`
fixture (conftest.py) rebuilds them from the tree under test, and each runs on files in every weight dtype, with and without
the int8 router, so the zero-allocation proof and the file checks cover every code path
of the forward pass.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import colibri_lab

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["f32", "bf16", "f16-int8"])
def model_file(request, tmp_path_factory) -> Path:
    dtype, _, router = request.param.partition("-")
    out = tmp_path_factory.mktemp("native") / f"tiny-{request.param}.colibri"
    colibri_lab.convert(REPO / "data" / "tiny-mixtral", out, dtype=dtype,
                        quantize_router=router or None, progress=False)
    return out


def run_ok(program: Path, model: Path, *args: str):
    proc = subprocess.run([str(program), str(model), *args], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout and "SKIP" not in proc.stdout, proc.stdout


def test_no_allocation_in_forward(native_tests, model_file):
    run_ok(native_tests / "test_noalloc", model_file)


def test_no_allocation_in_fast_forward(native_tests, model_file):
    """The fast numeric mode (bf16-rounded activations on this bf16 model) allocates nothing either."""
    run_ok(native_tests / "test_noalloc", model_file, "fast")


def test_no_allocation_under_interventions(native_tests, model_file):
    """Expert masks (both meanings), a router bias, forced routing and activation patches set
    before the forward: the forward, batches and sequence calls still allocate nothing."""
    run_ok(native_tests / "test_noalloc", model_file, "interv")


def test_no_allocation_with_expert_cache(native_tests, model_file):
    """Through a 1-slot expert cache with prefetch: misses wait for the I/O thread's reads,
    and neither thread allocates."""
    run_ok(native_tests / "test_noalloc", model_file, "cache")


def test_file_checks(native_tests, tmp_path):
    """test_format mutates its model many times: a small one without a tokenizer keeps it
    quick (the tokenizer section has its own C and Python tests)."""
    pytest.importorskip("torch")
    from colibri_lab.bench.models import MixtralShape, build_model, save_checkpoint

    folder = save_checkpoint(build_model(MixtralShape(vocab=300, hidden=32, inter=24, layers=2,
                                                heads=4, kv_heads=2, experts=4, top_k=2)),
                             tmp_path / "hf")
    out = tmp_path / "small.colibri"
    colibri_lab.convert(folder, out, dtype="bf16", quantize_router="int8", progress=False)
    run_ok(native_tests / "test_format", out)
