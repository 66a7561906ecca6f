"""Notebook 02 in a real browser: JupyterLab on 127.0.0.1 (no token) over a temporary root
holding a copy of the notebook and the model it reads, driven by headless Debian chromium
through playwright. Runs every cell, waits for the plotly charts and the explorer widget
to render, moves the explorer's layer control and checks that its heatmap changed, and
saves a screenshot to build/test-artifacts/notebook02.png.

Skipped only when chromium or playwright/jupyterlab are not installed (`make test`
installs them). Never runs `playwright install`: the browser is /usr/bin/chromium.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = "02_inference_and_routing.ipynb"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
ARTIFACT = REPO / "build" / "test-artifacts" / "notebook02.png"
RUN_TIMEOUT_S = 300


def _require_tools():
    if not os.path.isfile(CHROMIUM) or not os.access(CHROMIUM, os.X_OK):
        pytest.skip("chromium is not installed (apt-get install -y chromium; `make test` does it)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; part of the test extra)")
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        pytest.skip("jupyterlab is not installed (part of the test extra)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"jupyter lab did not answer {url} in {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server over tmp_path/root: notebooks/<NOTEBOOK> and data/tiny-mixtral."""
    _require_tools()
    root = tmp_path / "root"
    (root / "notebooks").mkdir(parents=True)
    shutil.copy(REPO / "notebooks" / NOTEBOOK, root / "notebooks" / NOTEBOOK)
    (root / "data").mkdir()
    shutil.copytree(REPO / "data" / "tiny-mixtral", root / "data" / "tiny-mixtral")
    # fresh Lab settings: no restored workspace, every cell kept in the DOM (no windowing),
    # no news pop-up over the screenshot
    settings = tmp_path / "lab-settings"
    tracker = settings / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    news = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env = dict(os.environ)
    env.update({
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "jupyter-runtime"),
        # the kernel imports colibri_lab from this checkout (or the installed package)
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
    })
    port = _free_port()
    log = tmp_path / "jupyter.log"
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", "--ServerApp.token=",
           "--ServerApp.password=", f"--ServerApp.root_dir={root}",
           "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")      # CI containers run as root
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=root)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{base}/api/status", proc, log)
        yield base, tmp_path
    finally:  # SIGTERM: the server stops its kernels and exits (its /api/shutdown wants an
        # XSRF token, and waiting on it cost 20 s a run)
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


_HEATMAP_STATE = """() => {
  const el = document.querySelector('.colibri-explorer .js-plotly-plot');
  if (!el || !el.data || !el.data.length) return null;
  const t = el.querySelector('.gtitle');
  return {title: t ? t.textContent : '', z: JSON.stringify(el.data[0].z),
          svg: el.querySelector('svg.main-svg') ? el.querySelector('svg.main-svg').innerHTML.length : 0};
}"""


def test_notebook02_in_chromium(lab):
    from playwright.sync_api import sync_playwright

    base, tmp = lab
    profile = tmp / "chromium-profile"
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1600})
        try:
            page = ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{base}/lab/tree/notebooks/{NOTEBOOK}", wait_until="domcontentloaded")
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell"
                                   " && document.querySelector('.jp-Notebook .jp-Cell')",
                                   timeout=90_000)
            # the kernel must be up before running all cells
            page.wait_for_function(
                """() => { const w = window.jupyterapp.shell.currentWidget;
                           return w && w.sessionContext && w.sessionContext.session &&
                                  w.sessionContext.session.kernel &&
                                  w.sessionContext.session.kernel.connectionStatus === 'connected'; }""",
                timeout=90_000)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            # the last cell prints this once everything above it ran; a cell that raises
            # stops the run and shows a traceback instead
            errors_js = """() => [...document.querySelectorAll(
                '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
                .map(e => e.textContent).filter(t => /Error|Traceback/.test(t))"""
            page.wait_for_function(
                f"""() => [...document.querySelectorAll('.jp-OutputArea-output')]
                         .some(e => e.textContent.includes('explorer traced the prompt: True'))
                         || ({errors_js})().length > 0""",
                timeout=RUN_TIMEOUT_S * 1000)
            failed = page.evaluate(errors_js)
            assert not failed, f"a cell raised: {failed[0][:2000]}"
            # plotly charts: the static figures and the explorer's three FigureWidgets
            page.wait_for_function(
                "() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= 8",
                timeout=60_000)
            page.wait_for_function(
                """() => { const ex = document.querySelector('.colibri-explorer');
                           return ex && ex.querySelectorAll('.js-plotly-plot').length === 3 &&
                                  ex.querySelectorAll('select').length >= 2; }""",
                timeout=60_000)
            before = page.evaluate(_HEATMAP_STATE)
            assert before and before["title"].startswith("Routing:"), before
            explorer = page.locator(".colibri-explorer")
            explorer.scroll_into_view_if_needed()
            layer = explorer.locator("select").first
            layer.select_option(label="layer 1")
            # the widget sends the new layout and the new traces as separate messages:
            # wait until both have arrived
            page.wait_for_function(
                f"(z0) => {{ const s = ({_HEATMAP_STATE})(); "
                f"return s && s.title.includes('layer 1') && s.z !== z0; }}",
                arg=before["z"], timeout=60_000)
            after = page.evaluate(_HEATMAP_STATE)
            assert after["title"].startswith("Router probabilities, layer 1"), after["title"]
            assert after["z"] != before["z"]
            # the token control redraws the probabilities figure
            probs_before = page.evaluate(
                "() => document.querySelectorAll('.colibri-explorer .js-plotly-plot')[2]"
                ".querySelector('.gtitle').textContent")
            explorer.locator("select").nth(1).select_option(index=3)
            page.wait_for_function(
                "(t) => document.querySelectorAll('.colibri-explorer .js-plotly-plot')[2]"
                ".querySelector('.gtitle').textContent !== t", arg=probs_before, timeout=30_000)
            page.wait_for_timeout(500)
            ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
            explorer.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACT))
            assert ARTIFACT.stat().st_size > 10_000
            assert not [e for e in errors if "plotly" in e.lower() or "widget" in e.lower()], errors
        finally:
            ctx.close()
