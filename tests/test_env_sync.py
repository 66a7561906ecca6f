"""pyproject.toml and environment.yml list the same packages with the same version specs.

Checked: every runtime dependency and every package of the `test` and `lab` extras is in
environment.yml (conda-forge or its pip section) with the same specifier, and every
package environment.yml lists is one of those (or a build tool / python itself).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")
yaml = pytest.importorskip("yaml")  # PyYAML comes with transformers (a test dependency)

REPO = Path(__file__).resolve().parents[1]
IN_ENV_EXTRAS = ("test", "lab")
NOT_IN_ENV_EXTRAS = ("dev", "gpu")  # gpu: CuPy for a CUDA machine, not the CPU environment
# conda-only entries: the interpreter, pip itself, and the native build toolchain
CONDA_ONLY = {"python", "pip", "c-compiler", "cmake", "ninja"}

_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _parse(req: str) -> tuple[str, str]:
    """'protobuf>=5' -> ('protobuf', '>=5'); markers are not used in this project."""
    m = _REQ.match(req)
    assert m and ";" not in req, f"cannot parse requirement {req!r}"
    return _norm(m.group(1)), m.group(3).replace(" ", "")


def _pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _env() -> dict[str, str]:
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    out: dict[str, str] = {}
    for dep in env["dependencies"]:
        items = dep["pip"] if isinstance(dep, dict) else [dep]
        for item in items:
            name, spec = _parse(item)
            assert name not in out, f"{name} listed twice in environment.yml"
            out[name] = spec
    return out


def test_pyproject_packages_are_in_environment_yml():
    proj = _pyproject()["project"]
    env = _env()
    wanted = [_parse(r) for r in proj["dependencies"]]
    for extra in IN_ENV_EXTRAS:
        wanted += [_parse(r) for r in proj["optional-dependencies"][extra]]
    for name, spec in wanted:
        assert name in env, f"{name} is in pyproject.toml but not in environment.yml"
        assert env[name] == spec, f"{name}: pyproject says {spec!r}, environment.yml {env[name]!r}"


def test_environment_yml_lists_nothing_else():
    pp = _pyproject()
    proj = pp["project"]
    known = {_parse(r)[0] for r in proj["dependencies"]}
    for extra in IN_ENV_EXTRAS:
        known |= {_parse(r)[0] for r in proj["optional-dependencies"][extra]}
    build = dict(_parse(r) for r in pp["build-system"]["requires"])
    env = _env()
    for name, spec in env.items():
        if name in CONDA_ONLY:
            continue
        if name in build:
            assert spec == build[name], f"{name}: build-system says {build[name]!r}, env {spec!r}"
            continue
        assert name in known, f"{name} is in environment.yml but not in pyproject.toml"
    assert set(build) <= set(env), "environment.yml lacks a build requirement"


def test_extras_layout():
    proj = _pyproject()["project"]
    extras = proj["optional-dependencies"]
    assert set(IN_ENV_EXTRAS + NOT_IN_ENV_EXTRAS) == set(extras)
    # torch must stay pinned: 2.13.0 is the CPU wheel; any other spec pulls a CUDA build
    assert dict(_parse(r) for r in extras["test"])["torch"] == "==2.13.0"
    assert proj["requires-python"] == ">=3.10"


# How a runtime dependency shows in the package's code: its import name, or (anywidget) the
# plotly class that needs it.
_USE = {"numpy": r"^\s*import numpy", "tqdm": r"^\s*from tqdm import",
        "sentencepiece": r"^\s*import sentencepiece", "plotly": r"^\s*import plotly",
        "ipywidgets": r"^\s*import ipywidgets", "anywidget": r"go\.FigureWidget\(", "gguf": r"^\s*import gguf",
        "numba": r"^\s*import numba"}


def test_every_runtime_dependency_is_used_by_the_package():
    """A dependency is declared because code uses it (and nothing is used undeclared)."""
    code = "\n".join(p.read_text() for p in (REPO / "colibri_lab").rglob("*.py"))
    deps = {_parse(r)[0] for r in _pyproject()["project"]["dependencies"]}
    assert deps == set(_USE), f"declared {sorted(deps)}; this test knows how {sorted(_USE)} are used"
    for name, pattern in _USE.items():
        assert re.search(pattern, code, re.M), f"{name} is a runtime dependency but nothing uses it"
