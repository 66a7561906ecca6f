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
        assert "colibri_lab._native" not in out[key] and "colibri_lab.engine" not in out[key], out
    assert out["heavy"] == []
    assert out["n_tensors"] > 0
    # asking for the engine loads the library, and the missing one is named in the error
    assert "COLIBRI_LIB" in out["engine_error"] and "no-such-libcolibri.so" in out["engine_error"]


def test_engine_names_resolve_lazily():
    import colibri_lab
    from colibri_lab import Engine, Tokenizer, errors

    assert Engine.__module__ == "colibri_lab.engine" and Tokenizer.__module__ == "colibri_lab.engine"
    assert colibri_lab.ColibriError is errors.ColibriError
    assert {"Engine", "viz", "tuning", "native_version"} <= set(dir(colibri_lab))
    assert isinstance(colibri_lab.native_version(), str)
