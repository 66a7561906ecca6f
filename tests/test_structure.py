"""The engine's file structure, read from the build's object files: no two C files call into
each other, directly or around a longer circle (the symbols each object defines and the ones
it leaves undefined, from `nm`, make the file-level call graph), and the container reader
(format/) sees neither the context nor the thread pool nor the model (its objects' header
dependencies, from the compiler's depfiles)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "native" / "src"


def _objects(build: Path) -> dict[str, Path]:
    """Every engine source file (native/src/**/*.c, as CMake globs them) and its object."""
    objdir = build / "CMakeFiles" / "colibri_objects.dir" / "src"
    out = {}
    for src in sorted(list(SRC.glob("*/*.c")) + list(SRC.glob("*/*/*.c"))):
        rel = src.relative_to(SRC).as_posix()
        obj = objdir / (rel + ".o")
        assert obj.is_file(), f"{obj} is missing: the build did not compile {rel}"
        out[rel] = obj
    return out


def _symbols(obj: Path) -> tuple[set[str], set[str]]:
    """(global symbols defined, symbols left undefined) of one object file."""
    def names(*flags):
        r = subprocess.run(["nm", *flags, str(obj)], capture_output=True, text=True, check=True)
        return {line.split()[-1] for line in r.stdout.splitlines() if line.strip()}
    return names("-g", "--defined-only"), names("-u")


def call_graph(symbols: dict[str, tuple[set[str], set[str]]]) -> dict[str, set[str]]:
    """File -> the files whose symbols it uses (library symbols, defined by no file, are left out)."""
    owner = {s: f for f, (defined, _) in symbols.items() for s in defined}
    return {f: {owner[s] for s in undefined if s in owner and owner[s] != f}
            for f, (_, undefined) in symbols.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_circles_are_found():
    """The reader finds a pair calling each other and a longer circle, and nothing else."""
    syms = {"a.c": ({"fa"}, {"fb", "memcpy"}), "b.c": ({"fb"}, {"fa"}), "c.c": ({"fc"}, {"fd"}),
            "d.c": ({"fd"}, {"fe"}), "e.c": ({"fe"}, {"fc", "fa"}), "f.c": ({"ff"}, {"fa", "fe"})}
    assert circles(call_graph(syms)) == [["a.c", "b.c"], ["c.c", "d.c", "e.c"]]
    syms["b.c"] = ({"fb"}, set())
    assert circles(call_graph(syms)) == [["c.c", "d.c", "e.c"]]


@pytest.fixture(scope="module")
def objects(native_tests) -> dict[str, Path]:
    if not shutil.which("nm"):
        pytest.fail("nm (binutils) is missing")
    return _objects(native_tests)


def test_no_two_files_call_each_other(objects):
    graph = call_graph({f: _symbols(o) for f, o in objects.items()})
    found = circles(graph)
    assert not found, "C files that call into each other (directly or around a circle): " + "; ".join(
        " <-> ".join(c) for c in found)


def _headers(src: Path) -> set[str]:
    """The engine headers a source file includes, directly or not (`cc -MM`: the preprocessor
    only), relative to native/src."""
    r = subprocess.run(["cc", "-MM", "-I", str(REPO / "native" / "include"), "-I", str(SRC), str(src)],
                       capture_output=True, text=True, check=True)
    out = set()
    for w in r.stdout.replace("\\\n", " ").split():
        p = (SRC / w) if not Path(w).is_absolute() else Path(w)
        if p.suffix == ".h":
            try:
                out.add(p.resolve().relative_to(SRC.resolve()).as_posix())
            except ValueError:
                pass
    return out


def test_container_reader_knows_no_model():
    """format/ reads the container only: no context, thread pool, model, backend or kernels."""
    srcs = sorted(SRC.glob("format/*.c"))
    assert srcs
    for src in srcs:
        got = _headers(src)
        assert "format/container.h" in got or src.name == "crc32.c", (src, got)
        bad = sorted(h for h in got
                     if h in ("core/context.h", "core/threadpool.h") or h.split("/")[0] in ("model", "backend", "cpu"))
        assert not bad, f"{src.relative_to(SRC)} includes {bad}"
