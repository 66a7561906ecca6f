"""The aarch64 job: the engine, colibri_cli, colibri_server and the C tests cross-compiled
with Debian's gcc-aarch64-linux-gnu (native/cmake/aarch64-linux-gnu.cmake) into
build/aarch64 and run under qemu-user's aarch64 emulation (`make test` installs both, and
the arm64 libmicrohttpd and jansson for the server).

What runs under emulation: the C tests through ctest (test_kernels checks the neon table and
the neon, neon-dotprod, neon-i8mm and neon-bf16 fast tables against the references on odd
sizes: qemu's default CPU has every extension), test_kernels again on a CPU model without
dotprod/i8mm/bf16 (the run-time choice must then skip those tables), the file checks and the
zero-allocation test on the embedded model, and colibri_cli and colibri_server on it: the
same top-5 ids as the x86 build with probabilities equal to 1e-5, and the same greedy text;
the self-contained server bundle.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

import colibri_lab
from colibri_lab.runtime.serving import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[1]
TOOLCHAIN = REPO / "native" / "cmake" / "aarch64-linux-gnu.cmake"


def _qemu_argv() -> list[str]:
    """qemu-aarch64, pointed at the cross libc only where Debian's multiarch arm64 libc is
    absent (as the toolchain file's emulator: mixing the two hangs)."""
    argv = [shutil.which("qemu-aarch64") or "qemu-aarch64"]
    if not Path("/lib/ld-linux-aarch64.so.1").exists():
        argv += ["-L", "/usr/aarch64-linux-gnu"]
    return argv


@pytest.fixture(scope="module")
def a64() -> Path:
    missing = [t for t in ("aarch64-linux-gnu-gcc", "qemu-aarch64") if not shutil.which(t)]
    if missing:
        msg = f"{', '.join(missing)} missing: make test installs gcc-aarch64-linux-gnu and qemu-user"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    import builds

    try:
        return builds.aarch64()
    except builds.BuildError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("a64") / "tiny-bf16.colibri"
    colibri_lab.convert(REPO / "data" / "tiny-mixtral", out, dtype="bf16", progress=False)
    return out


def _file_type(path: Path) -> str:
    head = path.read_bytes()[:20]
    assert head[:4] == b"\x7fELF", path
    machine = int.from_bytes(head[18:20], "little")
    return {0xB7: "aarch64", 0x3E: "x86_64"}.get(machine, hex(machine))


def test_everything_is_built_for_aarch64(a64):
    """The engine (both libraries), the CLI, the bench tool and the server, all aarch64 ELF."""
    for name in ("libcolibri.so", "colibri_cli", "colibri_bench", "colibri_server", "test_kernels"):
        assert (a64 / name).is_file(), f"{name} was not cross-built (colibri_server needs libmicrohttpd-dev:arm64)"
        assert _file_type(a64 / name) == "aarch64", name


def test_ctest_under_qemu(a64):
    # test_kernels runs in test_kernel_tables_under_qemu below, on two emulated CPUs, with
    # each table's line checked; running it here too cost 15-20 s of emulation
    r = subprocess.run(["ctest", "--output-on-failure", "-j", "2", "-E", "^test_kernels$"], cwd=a64,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "100% tests passed" in r.stdout, r.stdout[-3000:]


def test_kernel_tables_under_qemu(a64):
    """Every AArch64 table is checked where the emulated CPU has it (qemu's default, "max",
    has dotprod, i8mm and bf16); on a Cortex-A57 (plain ARMv8.0) the run-time check must find
    the dotprod, i8mm and bf16 tables unusable and the plain ones usable (`--probe`: the same
    tables' checks again would only repeat the run above)."""
    r = subprocess.run([*_qemu_argv(), str(a64 / "test_kernels")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:]
    for table in ("table neon checked (ok)", "fast table neon checked (ok)", "fast table neon-dotprod checked (ok)",
                  "fast table neon-i8mm checked (ok)", "fast table neon-bf16 checked (ok)"):
        assert table in r.stdout, r.stdout[-3000:]
    r = subprocess.run([*_qemu_argv(), "-cpu", "cortex-a57", str(a64 / "test_kernels"), "--probe"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "table neon usable" in r.stdout and "fast table neon usable" in r.stdout, r.stdout
    for table in ("neon-dotprod", "neon-i8mm", "neon-bf16"):
        assert f"fast table {table} skipped" in r.stdout, r.stdout[-3000:]


@pytest.mark.parametrize("args", [(), ("fast",)], ids=["exact", "fast"])
def test_noalloc_under_qemu(a64, tiny, args):
    r = subprocess.run([*_qemu_argv(), str(a64 / "test_noalloc"), str(tiny), *args], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout and "SKIP" not in r.stdout, r.stdout + r.stderr


def test_file_checks_under_qemu(a64, tmp_path):
    pytest.importorskip("torch")
    from colibri_lab.bench.models import MixtralShape, build_model, save_checkpoint

    folder = save_checkpoint(build_model(MixtralShape(vocab=300, hidden=32, inter=24, layers=2, heads=4, kv_heads=2,
                                               experts=4, top_k=2)), tmp_path / "hf")
    out = tmp_path / "small.colibri"
    colibri_lab.convert(folder, out, dtype="bf16", quantize_router="int8", progress=False)
    r = subprocess.run([*_qemu_argv(), str(a64 / "test_format"), str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


TOP5 = re.compile(r"^\s*(\d)\s+id=(\d+)\s+p=([0-9.]+)", re.M)


def _cli(argv: list[str], model: Path, *extra: str, env: dict | None = None) -> str:
    r = subprocess.run([*argv, "--model", str(model), "--prompt", "def", *extra], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.parametrize("mode", ["best", "ref", "fast"])
def test_cli_same_as_x86(a64, tiny, cli_path, mode):
    """colibri_cli on the embedded model: the same top-5 ids as on x86, probabilities equal
    to 1e-5, and the same greedy text (24 tokens), with the best tables of each machine (neon
    here, avx2/avx512 there) and with the reference kernels on both. In fast mode (bf16
    activations: BFDOT here, AMX/vdpbf16ps/f32 there) the same ids and text, probabilities
    to 1e-4."""
    env = dict(os.environ)
    env.pop("COLIBRI_KERNELS", None)
    env.pop("COLIBRI_FAST_KERNELS", None)
    if mode == "ref":
        env["COLIBRI_KERNELS"] = "ref"
    extra = ("--precision", "fast") if mode == "fast" else ()
    tol = 1e-4 if mode == "fast" else 1e-5
    arm = _cli([*_qemu_argv(), str(a64 / "colibri_cli")], tiny, "--max_new_tokens", "1", *extra, env=env)
    x86 = _cli([cli_path], tiny, "--max_new_tokens", "1", *extra, env=env)
    a5, x5 = TOP5.findall(arm), TOP5.findall(x86)
    assert len(a5) == len(x5) == 5, (arm, x86)
    assert [a[1] for a in a5] == [x[1] for x in x5], (arm, x86)
    for a, x in zip(a5, x5):
        assert abs(float(a[2]) - float(x[2])) <= tol + 1e-12, (a, x)
    arm_text = _cli([*_qemu_argv(), str(a64 / "colibri_cli")], tiny, "--max_new_tokens", "24", *extra, env=env)
    x86_text = _cli([cli_path], tiny, "--max_new_tokens", "24", *extra, env=env)
    assert arm_text == x86_text and arm_text.strip(), (arm_text, x86_text)


def test_server_under_qemu(a64, tiny, cli_path):
    """The cross-built colibri_server, emulated, on loopback: /health, then a greedy
    completion equal to the x86 CLI's text."""
    port = free_port()
    proc = subprocess.Popen([*_qemu_argv(), str(a64 / "colibri_server"), "--model", str(tiny), "--host",
                             f"127.0.0.1:{port}", "--num_threads", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, port, 60, "colibri_server under qemu")
        body = json.dumps({"prompt": "def", "max_tokens": 24, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            text = json.load(r)["choices"][0]["text"]
        x86_text = _cli([cli_path], tiny, "--max_new_tokens", "24")
        assert text.strip() and text.strip() == x86_text.strip(), (text, x86_text)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stdout.read() if proc.stdout else ""


def test_self_contained_bundle(a64, tiny, tmp_path):
    """tools/bundle_server.sh: colibri_server and colibri_cli with every library they load
    (found through DT_NEEDED) and the loader, for a board without Python or the libraries.
    Under qemu the bundled loader must load every library from the bundle (LD_DEBUG=libs)
    and the bundled CLI must give the unbundled one's top-5."""
    out = tmp_path / "bundle"
    r = subprocess.run(["bash", str(REPO / "tools" / "bundle_server.sh"), str(a64), str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lib = out / "lib"
    loader = lib / "ld-linux-aarch64.so.1"
    assert loader.is_file() and (lib / "libmicrohttpd.so.12").is_file() and (lib / "libjansson.so.4").is_file()
    bundled_run = [str(loader), "--inhibit-cache", "--library-path", str(lib)]
    r = subprocess.run([*_qemu_argv(), "-E", "LD_DEBUG=libs", *bundled_run, str(out / "bin" / "colibri_server"),
                        "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage: colibri_server" in r.stdout, r.stdout + r.stderr
    inits = re.findall(r"calling init: (\S+)", r.stderr)
    assert inits and all(p.startswith(str(lib)) for p in inits), inits
    bundled = subprocess.run([*_qemu_argv(), *bundled_run, str(out / "bin" / "colibri_cli"), "--model", str(tiny), "--prompt",
                              "def", "--max_new_tokens", "1"], capture_output=True, text=True, timeout=120)
    plain = subprocess.run([*_qemu_argv(), str(a64 / "colibri_cli"), "--model", str(tiny), "--prompt", "def",
                            "--max_new_tokens", "1"], capture_output=True, text=True, timeout=120)
    assert bundled.returncode == 0 and bundled.stdout == plain.stdout, bundled.stdout + bundled.stderr
