#!/usr/bin/env bash
# tools/gpu_check.sh — the one prepared check of the CUDA backend on a lent GPU machine
# (docs/backends.md, "Running the GPU checks"). From the repository root:
#
#   bash tools/gpu_check.sh --prepare               # here, on the CPU machine: build/gpu-carry
#                                                   # and build/pydeps, the two folders to carry
#   PREBUILT=build/gpu-carry OUT=/some/folder bash tools/gpu_check.sh     # on the GPU machine
#
# One overall deadline, DEADLINE seconds from the start (default 540: the run ends within 10
# minutes, the machine's start and the transfers included, and leaves room for a second run in
# a 15-minute lease). Each phase runs under `timeout` with the smaller of its own limit and what
# is left of the deadline (less a reserve for the summary), and is skipped, with a line saying
# so, when less than a useful minimum is left; a hang in one phase still returns the others'
# results. Tests come before the bench. Phases and their own limits:
#   1. facts      nvidia-smi, nvcc, python3 and its torch / transformers / cupy   (55 s)
#   2. build      with PREBUILT: the carried build (seconds); without: cmake -DCOLIBRI_CUDA=ON
#                 -DCMAKE_CUDA_ARCHITECTURES=90 -G Ninja -j16 (T_BUILD, 170 s each for the
#                 configure and the compile); then the CLI on the tiny model with
#                 --backend cuda (60 s + 60 s)
#   3. tests      python3 -m pytest -q tests/test_gpu.py with COLIBRI_LIB=COLIBRI_CUDA_LIB
#                 (T_TESTS, 200 s)
#   4. bench      python3 tools/gpu_bench.py --layers 4 --profile (a random Mixtral-8x7B shape,
#                 bf16, exact and fast)                   (T_BENCH, 220 s; T_BENCH=0: none)
#   5. products   the PREBUILT mma_bench (tools/mma_bench.cu), when carried      (60 s)
# No pip install (the machine has no network): PYTHONPATH=$PWD and the machine's python3.
# Files under $OUT (at most 8): facts.txt, build.log, test_gpu.log, gpu_bench.log,
# gpu_bench.json, profile.txt, mma_bench.txt, summary.txt.
set -u
cd "$(dirname "$0")/.."

# ---- --prepare: the build to carry, made here with this machine's nvcc --------------------
if [ "${1:-}" = --prepare ]; then
    set -e
    cmake -S native -B build/cuda-local -G Ninja -DCOLIBRI_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DCMAKE_BUILD_TYPE=Release
    cmake --build build/cuda-local
    mkdir -p build/gpu-carry build/pydeps
    cp build/cuda-local/libcolibri.so build/cuda-local/colibri_cli build/cuda-local/colibri_bench build/gpu-carry/
    nvcc -O3 -std=c++17 -arch=sm_90 -Inative/src -o build/gpu-carry/mma_bench tools/mma_bench.cu
    # gguf (pure Python) for the split-layout tests: the lent machine has no network
    py=${PYTHON:-.venv/bin/python}
    gg=$("$py" -c "import gguf, os; print(os.path.dirname(gguf.__file__))")
    rm -rf build/pydeps/gguf && cp -r "$gg" build/pydeps/
    du -sh build/gpu-carry build/pydeps
    echo "carry build/gpu-carry and build/pydeps; run: PREBUILT=build/gpu-carry OUT=\$OUT bash tools/gpu_check.sh"
    exit 0
fi
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# pure-Python packages the machine lacks (gguf, for the split-layout tests), carried in
[ -d build/pydeps ] && PYTHONPATH=$PYTHONPATH:$PWD/build/pydeps
# PREBUILT=dir: a build made elsewhere with the same nvcc (static cudart), carried in; its
# libcolibri.so, colibri_cli and colibri_bench are used when the library loads here, else
# the sources are built as below.
BUILD=$PWD/build/cuda
LIB=$BUILD/libcolibri.so
T_BUILD=${T_BUILD:-170} T_TESTS=${T_TESTS:-200} T_BENCH=${T_BENCH:-220} BENCH_LAYERS=${BENCH_LAYERS:-4}
DEADLINE=${DEADLINE:-540}
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"
t0=$(date +%s)
# cap LIMIT [MIN]: the smaller of LIMIT and what is left of the deadline (10 s kept for the
# summary); 0 when that is under MIN (default 20 s): the phase is skipped
cap() {
    local left=$((DEADLINE - ($(date +%s) - t0) - 10)) lim=$1 min=${2:-20}
    [ "$left" -lt "$lim" ] && lim=$left
    [ "$lim" -lt "$min" ] && lim=0
    echo "$lim"
}
# capped LIMIT MIN CMD...: CMD under `timeout` of cap LIMIT MIN, or skipped (status 124)
capped() {
    local lim
    lim=$(cap "$1" "$2")
    shift 2
    if [ "$lim" = 0 ]; then echo "skipped: too little of the deadline left: $*"; return 124; fi
    timeout "$lim" "$@"
}

# ---- 1. facts ----------------------------------------------------------------------------
{
    echo "== date"; date -u
    echo "== deadline ${DEADLINE} s"
    echo "== nvidia-smi"; timeout 15 nvidia-smi
    echo "== nvidia-smi query"
    timeout 10 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.mem,compute_cap \
        --format=csv
    echo "== nvcc"; timeout 10 nvcc --version
    echo "== cmake / ninja"; cmake --version | head -1; ninja --version
    echo "== cpu"; nproc; free -g; df -h /dev/shm /tmp . 2>/dev/null
    echo "== python"
    timeout 20 python3 -c "
import sys, torch, transformers, numpy
print(sys.version)
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
print('transformers', transformers.__version__, 'numpy', numpy.__version__)
try:
    import cupy; print('cupy', cupy.__version__)
except Exception as e: print('cupy missing:', e)
import importlib.util  # the package is found; its library is loaded after the build
print('colibri_lab at', importlib.util.find_spec('colibri_lab').origin)
" 2>&1
} >"$OUT/facts.txt" 2>&1
summary "facts: $(grep -m1 -o 'NVIDIA [A-Z0-9]*[^|]*' "$OUT/facts.txt" | head -1 | sed 's/  */ /g') ($(($(date +%s) - t0)) s)"

# ---- 2. build ----------------------------------------------------------------------------
tb=$(date +%s)
if [ -n "${PREBUILT:-}" ] && [ -f "$PREBUILT/libcolibri.so" ] &&
    python3 -c "import ctypes, sys; ctypes.CDLL(sys.argv[1])" "$PWD/$PREBUILT/libcolibri.so" >"$OUT/build.log" 2>&1; then
    BUILD=$PWD/$PREBUILT LIB=$PWD/$PREBUILT/libcolibri.so
    echo "using the prebuilt $LIB" >>"$OUT/build.log"
    rc_build=0
elif [ "$(cap "$T_BUILD" 60)" = 0 ]; then
    echo "no carried build and too little of the deadline left to build" >>"$OUT/build.log"
    rc_build=124
else
(
    set -e
    capped "$T_BUILD" 60 cmake -S native -B build/cuda -G Ninja -DCOLIBRI_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release
    capped "$T_BUILD" 60 cmake --build build/cuda -j16
) >>"$OUT/build.log" 2>&1
rc_build=$?
fi
summary "build: rc=$rc_build in $(($(date +%s) - tb)) s ($(ls -la "$LIB" 2>/dev/null | awk '{print $5}') bytes libcolibri.so)"
if [ $rc_build -ne 0 ] || [ ! -f "$LIB" ]; then
    tail -40 "$OUT/build.log"
    summary "build failed: no tests, no bench"
    exit 1
fi
export COLIBRI_LIB=$LIB COLIBRI_CUDA_LIB=$LIB
export COLIBRI_CLI=$BUILD/colibri_cli COLIBRI_BENCH=$BUILD/colibri_bench

# a first look: the CLI on the tiny model through the CUDA backend (converted by the tests too)
capped 60 10 python3 -c "
import colibri_lab, tempfile, os
p = os.path.join(tempfile.gettempdir(), 'tiny-f32.colibri')
colibri_lab.convert('data/tiny-mixtral', p, dtype='f32', progress=False)
" >>"$OUT/build.log" 2>&1 &&
    capped 60 10 "$COLIBRI_CLI" --model /tmp/tiny-f32.colibri --prompt "The quick brown fox" --max_new_tokens 8 \
        --backend cuda --verbose >>"$OUT/build.log" 2>&1
summary "cli --backend cuda: rc=$? ($(grep -m1 '^backend:' "$OUT/build.log"))"

# ---- 3. tests ----------------------------------------------------------------------------
tt=$(date +%s)
lim=$(cap "$T_TESTS" 30)
if [ "$lim" = 0 ]; then
    echo "skipped: too little of the deadline left" >"$OUT/test_gpu.log"
    rc_tests=124
else
    timeout "$lim" python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -s >"$OUT/test_gpu.log" 2>&1
    rc_tests=$?
fi
summary "tests: rc=$rc_tests in $(($(date +%s) - tt)) s: $(tail -1 "$OUT/test_gpu.log")"

# ---- 4. bench (T_BENCH=0: a tests-only run, no bench and no mma_bench) ---------------------
lim=$(cap "$T_BENCH" 60)
if [ "$T_BENCH" = 0 ] || [ "$lim" = 0 ]; then
    summary "bench: skipped (T_BENCH=$T_BENCH, $lim s of the deadline for it)"
else
tn=$(date +%s)
timeout "$lim" python3 tools/gpu_bench.py --layers "$BENCH_LAYERS" --out "$OUT" --budget-s $((lim - 25)) --profile \
    >"$OUT/gpu_bench.log" 2>&1
rc_bench=$?
summary "bench: rc=$rc_bench in $(($(date +%s) - tn)) s"
tail -14 "$OUT/gpu_bench.log" | tee -a "$OUT/summary.txt"
rm -rf /dev/shm/colibri_gpu_bench /tmp/colibri_gpu_bench

# ---- 5. the tensor-core products alone (tools/mma_bench.cu), when built ------------------
if [ -x "$BUILD/mma_bench" ]; then
    capped 60 20 "$BUILD/mma_bench" >"$OUT/mma_bench.txt" 2>&1
    summary "mma_bench: rc=$?"
fi
fi
summary "total $(($(date +%s) - t0)) s of a ${DEADLINE} s deadline"
echo "== test failures / skips"; grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT/test_gpu.log" | head -30
