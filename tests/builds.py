"""The engine's other builds the test jobs need, in one place: the ASan + UBSan build
(tests/test_sanitizers.py), the CUDA build (tests/test_cuda_build.py) and the aarch64 cross
build (tests/test_aarch64.py), each configured and built into its own folder under build/.

Each build holds a lock on its folder while CMake runs (two builds at once in one folder
corrupt it), so `make test` can start them in the background while it installs the package,
and the tests' fixtures, calling the same functions, wait for them and then find them current
(an incremental build: seconds). A build's compiler output is kept in `<folder>/build.log`
whenever something was compiled, so a test can still read its warnings.

    python3 tests/builds.py asan cuda      # what `make test` starts in the background

Standard library only: it runs before the package is installed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NATIVE = REPO / "native"
JOBS = str(os.cpu_count() or 2)


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """One CMake run at a time in a build folder (test workers and `make test`'s background
    builds share them)."""
    build_dir = Path(build_dir)
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f".{build_dir.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class BuildError(RuntimeError):
    """A configure or build step failed; the message holds the command and its output's tail."""


def _run(build_dir: Path, configure: list[str], build: list[str], env: dict | None = None) -> Path:
    """Configure and build under the folder's lock; keep the output of a build that compiled
    something in build_dir/build.log."""
    with build_lock(build_dir):
        out = []
        for cmd in (["cmake", "-S", str(NATIVE), "-B", str(build_dir), *configure],
                    ["cmake", "--build", str(build_dir), "-j", JOBS, *build]):
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            out.append(r.stdout + r.stderr)
            if r.returncode != 0:
                raise BuildError(f"{' '.join(cmd)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
        if "Building" in out[-1]:
            (build_dir / "build.log").write_text(out[-1])
    return build_dir


# ---- ASan + UBSan ---------------------------------------------------------------------

ASAN = REPO / "build" / "asan"


def asan() -> Path:
    """The library and every C test with -fsanitize=address,undefined, at -O1 -g1: the SIMD
    kernel files take 6 min to compile at -O2 under ASan on 2 cores, 1 min at -O1; -g1 keeps
    the line tables the reports are symbolized with (file:line in every frame) and drops the
    rest of the debug information (143 against 204 CPU-seconds for the whole build)."""
    tests = sorted(p.stem for p in (NATIVE / "tests").glob("test_*.c"))
    return _run(ASAN, ["-DCOLIBRI_SANITIZE=ON", "-DCOLIBRI_BUILD_TESTS=ON", "-DCOLIBRI_WERROR=ON",
                       "-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1"],
                ["--target", "colibri_shared", *tests])


# ---- CUDA -------------------------------------------------------------------------------

CUDA = REPO / "build" / "cuda-ci"


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/cuda-13.0/bin/nvcc"):
        if Path(p).is_file():
            return p
    return None


def cuda_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(nvcc()).parent) + os.pathsep + env.get("PATH", "")
    env["CUDACXX"] = nvcc()
    return env


NATIVE_BUILD = REPO / "build" / "native"   # `make test`'s own build (pip's)


def _same_compiler_as(build_dir: Path) -> list[str]:
    """-DCMAKE_C_COMPILER as another build folder found it: ccache keys on the compiler's name,
    and one CMake finds /usr/bin/gcc where another finds /usr/bin/cc, the same compiler."""
    cache = build_dir / "CMakeCache.txt"
    if cache.is_file():
        for line in cache.read_text().splitlines():
            if line.startswith("CMAKE_C_COMPILER:"):
                return [f"-DCMAKE_C_COMPILER={line.split('=', 1)[1]}"]
    return []


def cuda() -> Path:
    """The library with the CUDA backend, warnings as errors, for sm_80 and sm_90. Its C files
    but one compile exactly as the default build's: through ccache (where installed; `make
    test` installs it and builds the package through it too) they are cache hits."""
    launcher = ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", *_same_compiler_as(NATIVE_BUILD)] if shutil.which("ccache") else []
    return _run(CUDA, ["-DCOLIBRI_CUDA=ON", "-DCOLIBRI_WERROR=ON", "-DCMAKE_BUILD_TYPE=Release",
                       "-DCMAKE_CUDA_ARCHITECTURES=80;90", *launcher], ["--target", "colibri_shared"],
                env=cuda_env())


# ---- aarch64 ----------------------------------------------------------------------------

AARCH64 = REPO / "build" / "aarch64"
TOOLCHAIN = NATIVE / "cmake" / "aarch64-linux-gnu.cmake"


def aarch64() -> Path:
    """Everything the aarch64 job runs under qemu (the library, colibri_cli, colibri_bench,
    colibri_server, every C test), cross-compiled with Debian's gcc-aarch64-linux-gnu at -O1:
    the job checks what the code computes under emulation, not its speed, and -O1 compiles in
    less than half the time of a release build (43 against 109 CPU-seconds on 2 cores; the
    emulated kernel tests run 35 s instead of 31)."""
    return _run(AARCH64, [f"-DCMAKE_TOOLCHAIN_FILE={TOOLCHAIN}", "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                          "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1", "-DCOLIBRI_BUILD_TESTS=ON",
                          "-DCOLIBRI_WERROR=ON"], [])


BUILDS = {"asan": asan, "cuda": cuda, "aarch64": aarch64}
NEEDS = {"asan": ("cc",), "cuda": (), "aarch64": ("aarch64-linux-gnu-gcc",)}


def main(argv: list[str]) -> int:
    """Build each named folder whose tools are here; say what was done. Exit 1 on a failed
    build (the tests that need it fail with the same message)."""
    rc = 0
    for name in argv:
        missing = [t for t in NEEDS[name] if not shutil.which(t)] + (["nvcc"] if name == "cuda" and not nvcc() else [])
        if missing:
            print(f"{name}: not built here ({', '.join(missing)} missing)", flush=True)
            continue
        try:
            print(f"{name}: {BUILDS[name]()}", flush=True)
        except BuildError as e:
            print(f"{name}: {e}", flush=True)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
