#!/usr/bin/env bash
# tools/fuzz.sh — build the libFuzzer targets and fuzz each of them for a long while by hand
# (`make fuzz`); tests/test_fuzz.py runs the same binaries for a few seconds in CI.
#
#   tools/fuzz.sh                    build, then run every target for FUZZ_SECONDS (600) each
#   tools/fuzz.sh loader server      only these targets (loader, tokenizer, grammar, server, chat)
#   tools/fuzz.sh build              only build build/fuzz/bin/fuzz_{loader,tokenizer,grammar,server_api,chat_output}
#
# Targets (native/tests/): fuzz_loader.c (the .colibri loader, forward pass, the model's
# tokenizer), fuzz_tokenizer.c (the SentencePiece-BPE and byte-level BPE tokenizers from a
# section), fuzz_grammar.c (the JSON-schema compiler and the grammar's token masks),
# fuzz_server_api.c (colibri_server's request handling, against a tiny model with
# a tokenizer and chat template made from data/tiny-mixtral into build/fuzz/server-model.colibri),
# fuzz_chat_output.c (colibri_server's parser of reasoning and tool calls in a model's output,
# and the constraint of a required call).
#
# Build: clang, -fsanitize=fuzzer,address,undefined (the engine and server sources with
# fuzzer-no-link, i.e. instrumented too), -O1 -g, the SIMD kernel tables compiled out
# (COLIBRI_NO_SIMD_TABLES: the fuzzers exercise parsing on the reference kernels).
# Objects are kept under build/fuzz/obj and rebuilt when a source or header they use changed.
#
# Each run: the committed seeds (native/tests/fuzz_corpus/<target>/) and regression inputs
# (…/<target>/regressions/) are replayed once, then merged into the working corpus
# build/fuzz/corpus-<target> (kept between runs, never written back into the repository), and
# libFuzzer runs one process (no -jobs: one in-process worker) under `nice -n $FUZZ_NICE`,
# with -print_final_stats=1; crash/leak/timeout/oom inputs go to build/fuzz/artifacts-<target>/,
# the log to build/fuzz/fuzz-<target>.log. A summary per target is printed at the end and the
# script fails when a target crashed. A crash found becomes a regression input: fix it, then
# copy the artifact to native/tests/fuzz_corpus/<target>/regressions/ (see the README there).
#
# Environment: FUZZ_SECONDS (600), FUZZ_NICE (10), FUZZ_JOBS (compile jobs, nproc),
# FUZZ_BUILD (build/fuzz), CC (clang), PYTHON (.venv/bin/python), FUZZ_ARGS (extra libFuzzer flags).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${FUZZ_BUILD:-$REPO/build/fuzz}"
FUZZ_SECONDS="${FUZZ_SECONDS:-600}"
FUZZ_NICE="${FUZZ_NICE:-10}"
JOBS="${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 2)}"
CC="${CC:-clang}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
NATIVE="$REPO/native"
SERVER_DIR="$NATIVE/tools/colibri_server"
CORPUS_SRC="$NATIVE/tests/fuzz_corpus"
ALL_TARGETS=(loader tokenizer grammar server chat)
# the commit the binaries are built from (+ "-dirty" with uncommitted changes), for the summary
COMMIT="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
git -C "$REPO" diff --quiet HEAD -- native 2>/dev/null || COMMIT="$COMMIT-dirty"

SAN=(-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g)
CFLAGS=(-std=gnu11 -O1 -Wall -Wextra "${SAN[@]}" -DCOLIBRI_NO_SIMD_TABLES=1
        -I"$NATIVE/include" -I"$NATIVE/src" -pthread)

binary() {
    case "$1" in server) echo "$BUILD/bin/fuzz_server_api" ;; chat) echo "$BUILD/bin/fuzz_chat_output" ;;
                 *) echo "$BUILD/bin/fuzz_$1" ;; esac
}
max_len() { case "$1" in loader) echo 70000 ;; tokenizer) echo 32768 ;; grammar | server | chat) echo 4096 ;; esac; }

have_jansson() { pkg-config --exists jansson 2>/dev/null; }

# stale OBJ: missing, or older than any file its .d lists
stale() {
    local obj="$1" dep="$1.d" f
    [[ -f "$obj" && -f "$dep" ]] || return 0
    for f in $(sed -e 's/^[^:]*://' -e 's/\\$//' "$dep"); do
        [[ "$f" -nt "$obj" ]] && return 0
    done
    return 1
}

# compile SRC to OBJ with the extra flags given, in the background, JOBS at a time
PIDS=()
compile() {
    local src="$1" obj="$2"
    shift 2
    stale "$obj" || return 0
    mkdir -p "$(dirname "$obj")"
    while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n || true; done
    echo "  cc $(realpath --relative-to="$REPO" "$src")"
    "$CC" "${CFLAGS[@]}" "$@" -MMD -MF "$obj.d" -c "$src" -o "$obj" &
    PIDS+=($!)
}
wait_all() {
    local pid fail=0
    for pid in "${PIDS[@]}"; do wait "$pid" || fail=1; done
    PIDS=()
    (( fail == 0 )) || { echo "fuzz.sh: compilation failed" >&2; exit 1; }
}

build() {
    command -v "$CC" >/dev/null || { echo "fuzz.sh: $CC not found (apt-get install clang libclang-rt-14-dev)" >&2; exit 1; }
    echo "fuzz.sh: building into $BUILD/bin"
    local engine=() server=() src obj
    for src in "$NATIVE"/src/*/*.c "$NATIVE"/src/*/*/*.c; do
        obj="$BUILD/obj/engine/$(realpath --relative-to="$NATIVE/src" "$src" | tr / _)"
        obj="${obj%.c}.o"
        compile "$src" "$obj" -fsanitize=fuzzer-no-link
        engine+=("$obj")
    done
    local jcflags=() jlibs=()
    if have_jansson; then
        read -r -a jcflags <<< "$(pkg-config --cflags jansson)"
        read -r -a jlibs <<< "$(pkg-config --libs jansson)"
        for src in api scheduler metrics engine chat tools; do
            obj="$BUILD/obj/server/$src.o"
            compile "$SERVER_DIR/$src.c" "$obj" -fsanitize=fuzzer-no-link -I"$SERVER_DIR" "${jcflags[@]}"
            server+=("$obj")
        done
    else
        echo "fuzz.sh: jansson not found (apt-get install libjansson-dev pkg-config): no server target" >&2
    fi
    for t in loader tokenizer grammar; do
        compile "$NATIVE/tests/fuzz_$t.c" "$BUILD/obj/fuzz_$t.o" -fsanitize=fuzzer -DCOLIBRI_FUZZ_LIBFUZZER=1
    done
    if have_jansson; then
        compile "$NATIVE/tests/fuzz_server_api.c" "$BUILD/obj/fuzz_server_api.o" -fsanitize=fuzzer \
                -DCOLIBRI_FUZZ_LIBFUZZER=1 -I"$SERVER_DIR" "${jcflags[@]}"
        compile "$NATIVE/tests/fuzz_chat_output.c" "$BUILD/obj/fuzz_chat_output.o" -fsanitize=fuzzer \
                -DCOLIBRI_FUZZ_LIBFUZZER=1 -I"$SERVER_DIR" "${jcflags[@]}"
    fi
    wait_all
    mkdir -p "$BUILD/bin"
    for t in loader tokenizer grammar; do
        "$CC" "${SAN[@]}" -fsanitize=fuzzer -pthread "$BUILD/obj/fuzz_$t.o" "${engine[@]}" -lm -o "$BUILD/bin/fuzz_$t"
    done
    if have_jansson; then
        "$CC" "${SAN[@]}" -fsanitize=fuzzer -pthread "$BUILD/obj/fuzz_server_api.o" "${server[@]}" "${engine[@]}" \
              "${jlibs[@]}" -lm -o "$BUILD/bin/fuzz_server_api"
        "$CC" "${SAN[@]}" -fsanitize=fuzzer -pthread "$BUILD/obj/fuzz_chat_output.o" "$BUILD/obj/server/chat.o" \
              "$BUILD/obj/server/tools.o" "${engine[@]}" "${jlibs[@]}" -lm -o "$BUILD/bin/fuzz_chat_output"
    fi
    echo "fuzz.sh: built $(ls "$BUILD/bin" | tr '\n' ' ')"
}

# the server target's model: data/tiny-mixtral (SentencePiece, 32000 pieces) with the
# Mixtral-Instruct chat template, converted to bf16
server_model() {
    local out="$BUILD/server-model.colibri"
    if [[ ! -f "$out" ]]; then
        echo "fuzz.sh: converting data/tiny-mixtral to $out" >&2
        (cd "$REPO/tests" && "$PYTHON" - "$out" >&2 <<'PY'
import json, shutil, sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path.cwd().parent))
import colibri_lab
from test_chat_template import MIXTRAL_8X7B_INSTRUCT
with tempfile.TemporaryDirectory() as td:
    hf = Path(td) / "hf"
    shutil.copytree(Path.cwd().parent / "data" / "tiny-mixtral", hf)
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    cfg["chat_template"] = MIXTRAL_8X7B_INSTRUCT
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    colibri_lab.convert(hf, sys.argv[1], dtype="bf16", progress=False)
PY
        )
    fi
    echo "$out"
}

SUMMARY=()
FAILED=0
run_target() {
    local t="$1" bin corpus artifacts log seeds=() regs=()
    bin="$(binary "$t")"
    [[ -x "$bin" ]] || { echo "fuzz.sh: $bin not built, skipping $t" >&2; SUMMARY+=("$t|not built"); return; }
    corpus="$BUILD/corpus-$t"
    artifacts="$BUILD/artifacts-$t"
    log="$BUILD/fuzz-$t.log"
    mkdir -p "$corpus" "$artifacts"
    local env=()
    [[ "$t" == server ]] && env=(COLIBRI_FUZZ_MODEL="$(server_model)")
    local common=(-max_len="$(max_len "$t")" -rss_limit_mb=3072 -timeout=60 -artifact_prefix="$artifacts/")
    # the committed seeds and regression inputs, each run once: a regression must not come back
    mapfile -t regs < <(find "$CORPUS_SRC/$t/regressions" -type f ! -name '.*' ! -name '*.md' 2>/dev/null | sort)
    mapfile -t seeds < <(find "$CORPUS_SRC/$t" -maxdepth 1 -type f | sort)
    echo "fuzz.sh: $t: replaying ${#seeds[@]} seeds and ${#regs[@]} regression inputs"
    if ! env "${env[@]}" "$bin" "${common[@]}" "${seeds[@]}" "${regs[@]}" > "$log" 2>&1; then
        echo "fuzz.sh: $t: a seed or regression input fails, see $log" >&2
        tail -n 40 "$log" >&2
        SUMMARY+=("$t|replay failed")
        FAILED=1
        return
    fi
    # merge the seeds into the working corpus (only inputs adding coverage are kept)
    env "${env[@]}" "$bin" -merge=1 "${common[@]}" "$corpus" "$CORPUS_SRC/$t" >> "$log" 2>&1
    echo "fuzz.sh: $t: fuzzing $FUZZ_SECONDS s (corpus $corpus, log $log)"
    local rc=0
    # shellcheck disable=SC2086
    env "${env[@]}" nice -n "$FUZZ_NICE" "$bin" "$corpus" "${common[@]}" -max_total_time="$FUZZ_SECONDS" \
        -print_final_stats=1 ${FUZZ_ARGS:-} >> "$log" 2>&1 || rc=$?
    local execs eps last cov ft nfiles bytes crashes
    execs="$(awk '/^stat::number_of_executed_units:/ {v = $2} END {print v}' "$log")"
    eps="$(awk '/^stat::average_exec_per_sec:/ {v = $2} END {print v}' "$log")"
    last="$(grep -E '^#[0-9]+' "$log" | tail -1)"
    cov="$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<< "$last")"
    ft="$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<< "$last")"
    nfiles="$(find "$corpus" -type f | wc -l)"
    bytes="$(du -sk "$corpus" | awk '{print $1}')"
    crashes="$(find "$artifacts" -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' \
               -o -name 'oom-*' -o -name 'slow-unit-*' \) -newer "$log.start" 2>/dev/null | wc -l)"
    SUMMARY+=("$t|$FUZZ_SECONDS|${execs:-?}|${eps:-?}|${cov:-?}|${ft:-?}|$nfiles files, $bytes KiB|$crashes|rc $rc")
    if (( rc != 0 || crashes != 0 )); then
        FAILED=1
        echo "fuzz.sh: $t: libFuzzer exited $rc; artifacts in $artifacts:" >&2
        grep -A30 -m1 -E 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error' "$log" >&2 || tail -n 40 "$log" >&2
    fi
}

if [[ "${1:-}" == build ]]; then
    build
    exit 0
fi
targets=("$@")
(( ${#targets[@]} )) || targets=("${ALL_TARGETS[@]}")
for t in "${targets[@]}"; do
    [[ " ${ALL_TARGETS[*]} " == *" $t "* ]] || { echo "fuzz.sh: unknown target $t (${ALL_TARGETS[*]})" >&2; exit 2; }
done
build
for t in "${targets[@]}"; do
    mkdir -p "$BUILD"
    : > "$BUILD/fuzz-$t.log.start"
    run_target "$t"
done
echo
echo "fuzz.sh: summary ($(date -u +%Y-%m-%dT%H:%MZ), built from $COMMIT)"
printf '%-10s %8s %12s %8s %7s %7s %-22s %8s %s\n' target seconds executions exec/s cov ft corpus crashes status
for row in "${SUMMARY[@]}"; do
    IFS='|' read -r t s e r c f corp cr st <<< "$row"
    printf '%-10s %8s %12s %8s %7s %7s %-22s %8s %s\n' "$t" "$s" "${e:-}" "${r:-}" "${c:-}" "${f:-}" "${corp:-}" \
           "${cr:-}" "${st:-}"
done
exit "$FAILED"
