# Colibri Lab — the two commands of the README, each doing its own set-up from a fresh
# clone (a virtual environment in .venv, the package built and installed into it).
#
#   make demo   convert the tiny Mixtral in data/, show its header, generate, top-5
#   make test   native C tests (ctest, warnings as errors) and the Python tests (pytest)
#
# Both install libmicrohttpd-dev and libjansson-dev (apt-get, as root) when they are missing,
# so that colibri_server is built with the rest.
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
NATIVE_TEST_DIR := build/native-tests

.PHONY: demo test venv native-tests pytest clean help fuzz

help:
	@echo "make demo   - install, convert $(DEMO_SRC), inspect it, generate text and show the top-5"
	@echo "make test   - install with the test extra, run the native C tests and pytest"
	@echo "make fuzz   - long libFuzzer runs by hand (FUZZ_SECONDS=600 per target; tools/fuzz.sh)"
	@echo "make clean  - remove build/ and .venv/"

$(PY):
	$(PYTHON) -m venv $(VENV)

venv: $(PY)

demo: $(PY)
	# colibri_server needs libmicrohttpd and jansson (Debian's -dev packages, found with
	# pkg-config) before pip builds native/; without them it is skipped with a warning
	dpkg -s libmicrohttpd-dev libjansson-dev pkg-config >/dev/null 2>&1 || (apt-get update && apt-get install -y libmicrohttpd-dev libjansson-dev pkg-config)
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

test: $(PY)
	# torch first, pinned: the CPU wheel. An unpinned torch pulled in by another package
	# would download a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
	# colibri_server needs libmicrohttpd and jansson (Debian's -dev packages, found with
	# pkg-config) before pip builds native/; without them it is skipped with a warning
	dpkg -s libmicrohttpd-dev libjansson-dev pkg-config >/dev/null 2>&1 || (apt-get update && apt-get install -y libmicrohttpd-dev libjansson-dev pkg-config)
	$(PIP) install -e ".[test]"
	$(MAKE) native-tests
	# the browser test (tests/test_browser.py) drives Debian's chromium (needs root to install)
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)
	# the fuzz smoke test (tests/test_fuzz.py) builds the libFuzzer harnesses with clang
	dpkg -s clang libclang-rt-14-dev >/dev/null 2>&1 || (apt-get update && apt-get install -y clang libclang-rt-14-dev)
	# the failover test (tests/test_failover.py) runs Debian's haproxy as a child process
	dpkg -s haproxy >/dev/null 2>&1 || (apt-get update && apt-get install -y haproxy)
	# the aarch64 job (tests/test_aarch64.py): Debian's cross compiler, qemu-user, and the arm64
	# libmicrohttpd and jansson for the cross-built colibri_server (multiarch)
	dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
	dpkg -s gcc-aarch64-linux-gnu qemu-user libmicrohttpd-dev:arm64 libjansson-dev:arm64 >/dev/null 2>&1 || (apt-get update && apt-get install -y gcc-aarch64-linux-gnu qemu-user libmicrohttpd-dev:arm64 libjansson-dev:arm64)
	$(MAKE) pytest

native-tests:
	$(CMAKE) -S native -B $(NATIVE_TEST_DIR) -DCMAKE_BUILD_TYPE=Release \
	    -DCOLIBRI_WERROR=ON -DCOLIBRI_BUILD_TESTS=ON
	$(CMAKE) --build $(NATIVE_TEST_DIR) -j $(JOBS)
	cd $(NATIVE_TEST_DIR) && ctest --output-on-failure -j $(JOBS)

# Long libFuzzer runs by hand (tests/test_fuzz.py runs the same targets for seconds in CI).
fuzz:
	tools/fuzz.sh

# The notebooks run under strict nbval: outputs of untagged cells are compared.
pytest:
	$(BIN)/pytest -q --durations=30 tests --nbval --nbval-current-env notebooks

clean:
	rm -rf build $(VENV) colibri_lab/_lib
