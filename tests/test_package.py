"""The package's import boundary: what works without the compiled engine.

`import colibri_lab`, the converter and `inspect` are pure Python over numpy; only the
engine and its tokenizer need libcolibri. A machine without the library (or with a wrong
COLIBRI_LIB) can still convert and inspect files, and gets a clear ImportError the moment
it asks for an engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, sys
import colibri_lab
out = {"after_import": sorted(m for m in sys.modules if m.startswith("colibri_lab"))}
path = colibri_lab.convert(sys.argv[1], sys.argv[2], dtype="bf16", progress=False)
info = colibri_lab.inspect(path)
out["n_tensors"] = len(info.tensors)
out["after_convert"] = sorted(m for m in sys.modules if m.startswith("colibri_lab"))
out["heavy"] = sorted(m for m in ("plotly", "ipywidgets", "torch", "transformers") if m in sys.modules)
try:
    colibri_lab.Engine
except ImportError as e:
    out["engine_error"] = str(e)
print(json.dumps(out))
"""


def test_import_convert_inspect_without_the_native_library(tmp_path):
    env = dict(os.environ, COLIBRI_LIB=str(tmp_path / "no-such-libcolibri.so"))
    proc = subprocess.run([sys.executable, "-c", PROBE, str(REPO / "data" / "tiny-mixtral"),
                           str(tmp_path / "tiny.colibri")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("after_import", "after_convert"):
        assert "colibri_lab.runtime._native" not in out[key] and "colibri_lab.runtime.engine" not in out[key], out
    assert out["heavy"] == []
    assert out["n_tensors"] > 0
    # asking for the engine loads the library, and the missing one is named in the error
    assert "COLIBRI_LIB" in out["engine_error"] and "no-such-libcolibri.so" in out["engine_error"]


def test_engine_names_resolve_lazily():
    import colibri_lab
    from colibri_lab import Engine, Tokenizer
    from colibri_lab.runtime import errors

    assert Engine.__module__ == "colibri_lab.runtime.engine" and Tokenizer.__module__ == "colibri_lab.runtime.engine"
    assert colibri_lab.ColibriError is errors.ColibriError
    assert {"Engine", "viz", "tuning", "native_version"} <= set(dir(colibri_lab))
    assert isinstance(colibri_lab.native_version(), str)


def _import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports, read from the source (every import, those
    inside functions included: a lazy import closes a circle as surely as a top-level one)."""
    import ast

    pkg = REPO / "colibri_lab"
    modules = {}
    for f in pkg.rglob("*.py"):
        parts = f.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = (f, parts[-1] == "__init__")
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, (f, is_pkg) in modules.items():
        here = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:   # `from pkg import submodule` names the submodule
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for t in targets:
                while t and t not in modules:   # `import a.b.c` of a name inside a module
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("colibri_lab"):
                    graph[name].add(t)
    return graph


def test_the_package_has_no_import_circle():
    graph = _import_graph()
    assert {"colibri_lab.runtime.engine", "colibri_lab.conversion.gguf", "colibri_lab.format.spec",
            "colibri_lab.analysis.viz", "colibri_lab.bench.models"} <= set(graph)
    # Tarjan's strongly connected components: a component of more than one module is a circle
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == [], f"import circles: {circles}"


def test_the_file_format_spec_is_a_leaf():
    # the format's constants are what every other part shares: they import nothing of the package
    graph = _import_graph()
    assert graph["colibri_lab.format.spec"] == set()
    assert graph["colibri_lab.runtime.errors"] == set()
