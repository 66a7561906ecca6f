"""The GGUFs tests/test_gguf_import.py and tests/test_gguf_families.py share, made once per
pytest session: both files' checkpoints, then one convert_hf_to_gguf.py process for all
their GGUFs (its imports of torch and transformers dominate a conversion's time).

Under pytest-xdist every worker runs a session fixture once: the first worker to ask builds
into a folder of the session's temporary root (shared by its workers), keyed by the content
of the code that builds it, under a file lock; the others wait on the lock and then read the
folder's state.json (written last, so a folder without it is an interrupted build, redone).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the code whose output the folder holds
SOURCES = (HERE / "gguf_shared.py", HERE / "test_gguf_import.py", HERE / "test_gguf_families.py",
           HERE.parent / "colibri_lab" / "bench" / "models.py")


def session_root(tmp_path_factory) -> Path:
    """The session's temporary root: shared by all xdist workers of one run."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_ggufs(tmp_path_factory) -> dict:
    """{"src": the llama.cpp source tree, "import": test_gguf_import's state, "families":
    test_gguf_families' state} (each file's load_models turns its state into its models)."""
    from builds import build_lock

    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES if p.is_file())).hexdigest()[:16]
    work = session_root(tmp_path_factory) / f"gguf-shared-{key}"
    with build_lock(work):
        done = work / "state.json"
        if not done.is_file():
            if work.exists():
                shutil.rmtree(work)
            work.mkdir(parents=True)
            state = _build(work)
            done.write_text(json.dumps(state))
    state = json.loads(done.read_text())
    state["src"] = Path(state["src"])
    return state


def _build(work: Path) -> dict:
    import test_gguf_families
    import test_gguf_import

    src = test_gguf_import.llama_cpp_source(test_gguf_import._llama_root())   # skips if it cannot
    (work / "import").mkdir()
    (work / "families").mkdir()
    jobs_i, state_i = test_gguf_import.model_jobs(work / "import")
    jobs_f, state_f = test_gguf_families.model_jobs(work / "families")
    test_gguf_import.make_ggufs(src, jobs_i + jobs_f, work)
    return {"src": str(src), "import": state_i, "families": state_f}
