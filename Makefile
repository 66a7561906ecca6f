# Colibri Lab — the two commands of the README, each doing its own set-up from a fresh
# clone (a virtual environment in .venv, the package built and installed into it).
#
#   make demo   convert the tiny Mixtral in data/, show its header, generate, top-5
#   make test   native C tests (ctest, warnings as errors) and the Python tests (pytest)
#
# Both install libmicrohttpd-dev and libjansson-dev (apt-get, as root) when they are missing,
# so that colibri_server is built with the rest; `make test` also installs the Debian packages
# its jobs drive (TEST_DEBS).
#
# Both are idempotent: re-running them reuses .venv and the CMake build folders.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
BIN    := $(VENV)/bin
CMAKE  ?= cmake
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)

DEMO_SRC    := data/tiny-mixtral
DEMO_MODEL  := build/tiny-mixtral.colibri
DEMO_PROMPT ?= def
# One CMake build serves the test command: pip builds the package's library and tools there
# with the C tests and warnings as errors, and ctest runs in it (tests/conftest.py's
# native_tests fixture rebuilds it incrementally).
NATIVE_BUILD := build/native
# ccache: the CUDA build (tests/builds.py) compiles every C file but one exactly as this one does
PIP_NATIVE   := -C build-dir=$(NATIVE_BUILD) -C cmake.define.COLIBRI_BUILD_TESTS=ON \
                -C cmake.define.COLIBRI_WERROR=ON -C cmake.define.CMAKE_C_COMPILER_LAUNCHER=ccache

# Debian packages: colibri_server's libraries (needed before pip builds native/), and what the
# test jobs drive: chromium (tests/test_browser.py), clang with libFuzzer (tests/test_fuzz.py),
# haproxy (tests/test_failover.py), the aarch64 cross compiler, qemu-user and the arm64
# libmicrohttpd and jansson (tests/test_aarch64.py).
SERVER_DEBS := libmicrohttpd-dev libjansson-dev pkg-config
BUILD_DEBS  := $(SERVER_DEBS) ccache
TEST_DEBS   := chromium clang libclang-rt-14-dev haproxy gcc-aarch64-linux-gnu qemu-user \
               libmicrohttpd-dev:arm64 libjansson-dev:arm64

# pytest on both cores, a file at a time per worker (module fixtures are built once); the
# longest files are handed out first, in the order tests/conftest.py gives (not xdist's own)
PYTEST_ARGS := -q --durations=30 -n $(JOBS) --dist loadfile --no-loadscope-reorder tests --nbval --nbval-current-env notebooks

.PHONY: demo test venv server-debs build-debs test-debs native-tests pytest clean help fuzz

help:
	@echo "make demo   - install, convert $(DEMO_SRC), inspect it, generate text and show the top-5"
	@echo "make test   - install with the test extra, run the native C tests and pytest"
	@echo "make fuzz   - long libFuzzer runs by hand (FUZZ_SECONDS=600 per target; tools/fuzz.sh)"
	@echo "make clean  - remove build/ and .venv/"

$(PY):
	$(PYTHON) -m venv $(VENV)

venv: $(PY)

# colibri_server needs libmicrohttpd and jansson (found with pkg-config) before pip builds
# native/; without them it is skipped with a warning
server-debs:
	dpkg -s $(SERVER_DEBS) >/dev/null 2>&1 || (apt-get update && apt-get install -y $(SERVER_DEBS))

build-debs:
	dpkg -s $(BUILD_DEBS) >/dev/null 2>&1 || (apt-get update && apt-get install -y $(BUILD_DEBS))

test-debs:
	dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
	dpkg -s $(TEST_DEBS) >/dev/null 2>&1 || (apt-get update && apt-get install -y $(TEST_DEBS))

demo: $(PY) server-debs
	$(PIP) install .
	@mkdir -p build
	$(BIN)/colibri-convert --model_name_or_path $(DEMO_SRC) --output_path $(DEMO_MODEL) --dtype bf16
	$(PY) -m colibri_lab inspect $(DEMO_MODEL)
	@echo
	@echo '== colibri_cli: 24 new tokens after "$(DEMO_PROMPT)"'
	$(BIN)/colibri_cli --model $(DEMO_MODEL) --prompt "$(DEMO_PROMPT)" --max_new_tokens 24 --verbose
	@echo
	@echo '== colibri_cli: the 5 most likely next tokens'
	$(BIN)/colibri_cli --model $(DEMO_MODEL) --prompt "$(DEMO_PROMPT)" --max_new_tokens 1

test: $(PY) build-debs
	@mkdir -p build && rm -f build/test-debs.rc && : > build/side-builds.log
	# In the background while pip works: the test jobs' other builds (tests/builds.py: ASan now,
	# aarch64 once its cross compiler is installed, CUDA once pip's build has filled the compiler
	# cache; build/side-builds.log) and their Debian packages (build/test-debs.log). The tests
	# wait for a build still running.
	@( nice -n 10 $(PYTHON) tests/builds.py asan >> build/side-builds.log 2>&1 ) &
	@( $(MAKE) --no-print-directory test-debs > build/test-debs.log 2>&1; echo $$? > build/test-debs.rc; \
	   nice -n 10 $(PYTHON) tests/builds.py aarch64 >> build/side-builds.log 2>&1 ) &
	# torch first, pinned: the CPU wheel. An unpinned torch pulled in by another package
	# would download a multi-GB CUDA build. --no-compile: Python compiles what it imports.
	$(PIP) install --no-compile torch==2.13.0
	$(PIP) install --no-compile -e ".[test]" $(PIP_NATIVE)
	@( nice -n 10 $(PYTHON) tests/builds.py cuda >> build/side-builds.log 2>&1 ) &
	cd $(NATIVE_BUILD) && ctest --output-on-failure -j $(JOBS)
	@while [ ! -f build/test-debs.rc ]; do sleep 1; done; tail -n 3 build/test-debs.log; \
	  [ "$$(cat build/test-debs.rc)" = 0 ] || { cat build/test-debs.log; echo "installing $(TEST_DEBS) failed"; exit 1; }
	$(MAKE) pytest

# The C tests alone, in the same build folder as `make test` (configured here when pip has not).
native-tests:
	$(CMAKE) -S native -B $(NATIVE_BUILD) -DCMAKE_BUILD_TYPE=Release \
	    -DCOLIBRI_WERROR=ON -DCOLIBRI_BUILD_TESTS=ON
	$(CMAKE) --build $(NATIVE_BUILD) -j $(JOBS)
	cd $(NATIVE_BUILD) && ctest --output-on-failure -j $(JOBS)

# Long libFuzzer runs by hand (tests/test_fuzz.py runs the same targets for seconds in CI).
fuzz:
	tools/fuzz.sh

# The notebooks run under strict nbval: outputs of untagged cells are compared.
pytest:
	$(BIN)/pytest $(PYTEST_ARGS)

clean:
	rm -rf build $(VENV) colibri_lab/_lib
