#!/usr/bin/env bash
# tools/a64_insn_count.sh — guest instructions per decode token of the cross-built
# colibri_cli under qemu-aarch64, for each kernel table given (a speed proxy: wall time under
# emulation means nothing). qemu runs one guest instruction per translation block
# (-singlestep) and logs every block it executes (-d exec,nochain): the log's line count is
# the number of instructions executed. One token's count is the difference between a run
# that generates 2 + K tokens and one that generates 2 (the load, the prompt and the first
# step cancel out; both stream text, so both take the same path), divided by K. One thread, so the counts are those of one core's work.
#
#   tools/a64_insn_count.sh MODEL [TABLE...]      (default tables: neon ref; build/aarch64)
#
# A TABLE is an exact table (COLIBRI_KERNELS: neon, ref) or fast:NAME, the fast mode with that
# fast table (COLIBRI_FAST_KERNELS: fast:neon, fast:neon-dotprod, fast:neon-i8mm, ...).
#
# Environment: A64_BUILD (build/aarch64), K (2), PROMPT ("def").
set -euo pipefail
model=${1:?usage: tools/a64_insn_count.sh MODEL [TABLE...]}
shift
tables=("$@")
[ ${#tables[@]} -gt 0 ] || tables=(neon ref)
build=${A64_BUILD:-build/aarch64}
k=${K:-2}
prompt=${PROMPT:-def}
qemu=(qemu-aarch64)
[ -e /lib/ld-linux-aarch64.so.1 ] || qemu+=(-L /usr/aarch64-linux-gnu)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

count() { # table, new tokens -> instructions executed by the whole run
    local fifo="$tmp/log.${1//[:\/]/_}.$2"
    mkfifo "$fifo"
    wc -l <"$fifo" >"$fifo.n" &
    local wc_pid=$!
    local exact=$1 fast="" precision=exact
    if [[ $1 == fast:* ]]; then exact="" fast=${1#fast:} precision=fast; fi
    COLIBRI_KERNELS=$exact COLIBRI_FAST_KERNELS=$fast "${qemu[@]}" -singlestep -d exec,nochain -D "$fifo" \
        "$build/colibri_cli" --model "$model" --prompt "$prompt" --max_new_tokens "$2" --num_threads 1 \
        --precision "$precision" >/dev/null
    wait "$wc_pid"
    cat "$fifo.n"
}

printf '%-16s %16s %16s %20s\n' table "insns (2 tokens)" "insns (2+$k)" "insns / decode token"
for t in "${tables[@]}"; do
    a=$(count "$t" 2)
    b=$(count "$t" $((2 + k)))
    printf '%-16s %16d %16d %20d\n' "$t" "$a" "$b" $(((b - a) / k))
done
