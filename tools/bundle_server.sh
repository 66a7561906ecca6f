#!/usr/bin/env bash
# tools/bundle_server.sh — a self-contained folder for colibri_server (and colibri_cli) to copy
# onto a Linux machine that has neither Python nor the server's libraries: the binaries, every
# shared library they need (libmicrohttpd, jansson, GnuTLS and theirs, the C library) found
# through their DT_NEEDED entries, the dynamic loader, and a launcher that runs the server
# with that loader and that library folder only. (A fully static colibri_server cannot be
# linked from Debian's packages: GnuTLS needs p11-kit, which ships no static library;
# colibri_cli can: docs/portability.md.)
#
#   tools/bundle_server.sh BUILD_DIR OUT_DIR [LIB_DIRS...]
#     BUILD_DIR  a build with colibri_server (e.g. build/aarch64 from the cross toolchain)
#     LIB_DIRS   where the target's libraries are (default: Debian's aarch64 multiarch folders)
#
# Then on the target: OUT_DIR/colibri_server --model m.colibri --host 0.0.0.0:8080
set -euo pipefail
build=${1:?usage: tools/bundle_server.sh BUILD_DIR OUT_DIR [LIB_DIRS...]}
out=${2:?usage: tools/bundle_server.sh BUILD_DIR OUT_DIR [LIB_DIRS...]}
shift 2
dirs=("$@")
[ ${#dirs[@]} -gt 0 ] || dirs=(/usr/lib/aarch64-linux-gnu /lib/aarch64-linux-gnu /usr/aarch64-linux-gnu/lib)
readelf=${READELF:-readelf}

mkdir -p "$out/lib" "$out/bin"
cp "$build/colibri_server" "$build/colibri_cli" "$out/bin/"

needed() { "$readelf" -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
find_lib() {
    for d in "${dirs[@]}"; do
        if [ -e "$d/$1" ]; then readlink -f "$d/$1"; return 0; fi
    done
    echo "bundle_server.sh: $1 not found in ${dirs[*]}" >&2
    return 1
}
# the loader named in the binary's PT_INTERP (e.g. /lib/ld-linux-aarch64.so.1)
interp=$("$readelf" -l "$build/colibri_server" | sed -n 's/.*Requesting program interpreter: \(.*\)\]/\1/p')
loader=$(basename "$interp")
cp "$(find_lib "$loader")" "$out/lib/$loader"

queue=("$out/bin/colibri_server" "$out/bin/colibri_cli")
declare -A seen=()
while [ ${#queue[@]} -gt 0 ]; do
    f=${queue[0]}
    queue=("${queue[@]:1}")
    for n in $(needed "$f"); do
        [ -n "${seen[$n]:-}" ] && continue
        seen[$n]=1
        [ "$n" = "$loader" ] && continue
        src=$(find_lib "$n")
        cp "$src" "$out/lib/$n"
        queue+=("$out/lib/$n")
    done
done

for tool in colibri_server colibri_cli; do
    cat >"$out/$tool" <<LAUNCH
#!/bin/sh
# runs bin/$tool with the bundled loader and libraries only (tools/bundle_server.sh)
here=\$(dirname "\$(readlink -f "\$0")")
exec "\$here/lib/$loader" --inhibit-cache --library-path "\$here/lib" "\$here/bin/$tool" "\$@"
LAUNCH
    chmod +x "$out/$tool"
done
echo "bundle_server.sh: $out: bin/ (colibri_server, colibri_cli), lib/ ($(ls "$out/lib" | wc -l) files, $(du -sh "$out" | cut -f1))"
