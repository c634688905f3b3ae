"""JupyterLab in a real browser: notebook 00 (smoke parameters) run through the UI by headless Chromium.

Starts JupyterLab on the repository, with a copy of notebook 00 in ``notebooks/`` (named
``browser-test-00_container_setup.ipynb``, git-ignored, removed afterwards) holding the smoke
profile's parameters (papermill's own parameter injection, as the runner does) and a temporary
run folder; drives Debian's ``chromium`` with
Playwright: open the notebook, wait for the kernel, Run > Run All Cells, wait until no cell is
queued or running, save (Ctrl+S); then reads the saved notebook: every code cell ran and none
has an error output; then ``make book`` of that run opens in the same browser and shows the
outputs. Screenshots are kept in ``runs/browser-test/``. ``.ci/run`` installs
Chromium (``apt-get install chromium``); without it the test is skipped with that reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = ROOT / "runs" / "browser-test"
TOKEN = "series-browser-test"
NOTEBOOK = "00_container_setup"

pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH: .ci/run installs Debian's (apt-get install chromium)"),
              pytest.mark.timeout(600)]
_DONE = """() => {
  const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent.trim());
  return prompts.length > 0 && !prompts.includes('[*]:') && prompts.some(t => /^\\[\\d+\\]:$/.test(t))
         && document.body.innerText.includes('| Idle');
}"""


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving the repository (notebook 00's copy with smoke parameters); yields (port, copy)."""
    import papermill

    from helpers.runner import launch, series

    source = ROOT / "notebooks" / f"{NOTEBOOK}.ipynb"
    copy = source.with_name(f"browser-test-{source.name}")  # not NN_*.ipynb: never one of the series' notebooks
    for stale in source.parent.glob("browser-test-*.ipynb"):  # left by a run that was killed
        stale.unlink()
    params = series.resolve_parameters([source], "smoke", run_dir=str(tmp_path / "run"))[NOTEBOOK]
    papermill.execute_notebook(str(source), str(copy), parameters=params, prepare_only=True,
                               progress_bar=False)  # the runner's parameter injection, nothing executed
    port = launch.free_port()
    settings = tmp_path / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')  # no news popup over the cells
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings")}
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={ROOT}",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--ServerApp.port_retries=0"],  # no silent move to another port
        cwd=ROOT, env=env, stdout=open(tmp_path / "jupyter.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)  # its kernels are in its process group: killed together below
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={TOKEN}", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail(f"JupyterLab did not start: {(tmp_path / 'jupyter.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield port, copy
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        copy.unlink(missing_ok=True)


def test_notebook_00_runs_through_jupyterlab_in_chromium_without_an_error(lab):
    import nbformat
    from playwright.sync_api import sync_playwright

    port, saved = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    before = saved.stat().st_mtime_ns
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"http://127.0.0.1:{port}/lab/tree/notebooks/{saved.name}?token={TOKEN}")
            page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=90_000)
            page.wait_for_function("() => document.body.innerText.includes('| Idle')", timeout=90_000)
            page.screenshot(path=str(SHOTS / f"{NOTEBOOK}-opened.png"))
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.locator("li[data-command='runmenu:run-all']").click()
            page.wait_for_function(_DONE, timeout=300_000, polling=1000)
            page.keyboard.press("Control+s")
            deadline = time.monotonic() + 30
            while saved.stat().st_mtime_ns == before and time.monotonic() < deadline:
                time.sleep(0.5)
            page.screenshot(path=str(SHOTS / f"{NOTEBOOK}-ran.png"), full_page=True)
            book_text = _open_the_book(page, saved)
        finally:
            browser.close()
    assert saved.stat().st_mtime_ns != before, "the notebook was not saved from the browser"
    nb = nbformat.read(saved, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(code) for o in c.outputs if o.output_type == "error"]
    assert not errors, f"cells with errors in the browser run: {errors} (screenshots: {SHOTS})"
    assert all(c.execution_count for c in code), "a code cell did not run"
    assert any("all_reduce" in o.get("text", "") for c in code for o in c.outputs)  # the torchrun smoke test ran
    assert (SHOTS / f"{NOTEBOOK}-ran.png").stat().st_size > 20_000
    assert "rank 0/2 backend gloo: all_reduce(sum) = 3" in book_text  # the book shows the browser run's outputs


def _open_the_book(page, executed: Path) -> str:
    """``make book`` of a run holding the notebook just run, opened in the same browser: index, then the page."""
    from helpers.runner import book

    run = executed.parent.parent / "runs" / "browser-test" / "run"
    (run / "executed").mkdir(parents=True, exist_ok=True)
    shutil.copy(executed, run / "executed" / f"{NOTEBOOK}.ipynb")
    index = book.build(run)
    page.goto(index.as_uri())
    page.get_by_role("link", name="00 · Container and environment setup").click()
    page.wait_for_selector(".jp-Notebook")
    page.screenshot(path=str(SHOTS / f"{NOTEBOOK}-book.png"))
    return page.inner_text("body")


def test_the_book_renders_math_with_the_network_closed(tmp_path):
    """Issue 30: ``make book`` works offline. A page with TeX in its markdown, opened by Chromium with every
    request that would leave the machine aborted (and recorded): MathJax loads from the book's own ``_static``,
    the math is typeset (MathJax's elements, no raw ``$...$`` left), and no request was made to the network."""
    import nbformat
    from playwright.sync_api import sync_playwright

    from helpers.runner import book

    run = tmp_path / "runs" / "offline"
    (run / "executed").mkdir(parents=True)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 04 · Math\n\nAttention scores $QK^\\top/\\sqrt{d}$, and\n\n"
                                              "$$\\mathrm{softmax}(x)_i = e^{x_i} / \\sum_j e^{x_j}$$")]
    nbformat.write(nb, run / "executed" / "04_math.ipynb")
    index = book.build(run)
    left: list[str] = []

    def stay_on_disk(route):
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            left.append(route.request.url)
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.route("**/*", stay_on_disk)
            page.goto((index.parent / "04_math.html").as_uri())
            page.wait_for_function("() => document.querySelectorAll('.MathJax, .MathJax_Display').length >= 2", timeout=60_000)
            text = page.inner_text("body")
        finally:
            browser.close()
    assert not left, f"requests that left the machine: {left}"
    assert "$QK" not in text and "\\sqrt" not in text


#: Waits until MathJax 2.7 has typeset the page (or the page has no MathJax).
_MATH_DONE = ("() => !window.MathJax || (window.MathJax.isReady && MathJax.Hub.queue.pending === 0 "
              "&& MathJax.Hub.queue.running === 0)")


def crawl_offline(index: Path) -> dict[str, list]:
    """Open ``index`` in Chromium with every request that would leave the machine aborted, then every page it
    links to (transitively, inside the book's run folder), as a reader clicking through would.

    Returns lists: ``pages`` opened, ``left`` (URLs of requests aborted because they would leave the machine),
    ``failed`` (local requests that failed: a missing file), ``dead`` (``(page, href)`` of links to a local file
    that does not exist), ``broken_images`` (``(page, src)`` of images that did not decode), ``raw_math``
    (pages whose text still holds TeX after MathJax finished), ``typeset`` (pages with typeset math),
    ``external`` (links to the web: not followed, not requests).
    """
    from urllib.parse import unquote, urldefrag, urlparse

    from playwright.sync_api import sync_playwright

    root = index.parent.parent.resolve()  # the run folder: the book links to its figures/
    found: dict[str, list] = {k: [] for k in ("pages", "left", "failed", "dead", "broken_images", "raw_math",
                                              "typeset", "external")}
    todo, seen = [index.resolve()], set()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file://")
                       else (found["left"].append(route.request.url), route.abort()))
            page.on("requestfailed", lambda r: None if not r.url.startswith("file://") else found["failed"].append(r.url))
            while todo:
                path = todo.pop(0)
                if path in seen:
                    continue
                seen.add(path)
                found["pages"].append(str(path.relative_to(root)))
                page.goto(path.as_uri())
                page.wait_for_function(_MATH_DONE, timeout=60_000)
                if page.evaluate("() => document.querySelectorAll('.MathJax, .MathJax_Display').length") > 0:
                    found["typeset"].append(path.name)
                text = page.inner_text("body")
                if re.search(r"\$[^$\n]*\\(?:frac|sqrt|top|mathrm|sum|cdot)", text):
                    found["raw_math"].append(path.name)
                found["broken_images"] += [(path.name, s) for s in page.evaluate(
                    "() => [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)")]
                for href in page.evaluate("() => [...document.querySelectorAll('a[href]')].map(a => a.href)"):
                    url, _ = urldefrag(href)
                    if not url.startswith("file://"):
                        found["external"].append(url)
                        continue
                    target = Path(unquote(urlparse(url).path))
                    if not target.exists():
                        found["dead"].append((path.name, href))
                    elif target.suffix == ".html" and target.resolve().is_relative_to(root):
                        todo.append(target.resolve())
        finally:
            browser.close()
    return found


@pytest.mark.slow
def test_the_whole_book_of_the_smoke_series_works_offline(series_run):
    """Issue 30's acceptance: ``make book`` of the smoke series, read page by page in Chromium with the network
    closed: every notebook page is reached from the index, no request leaves the machine, every local request,
    link and image resolves, and the math of notebook 04 is typeset (no raw TeX left anywhere)."""
    from helpers.runner import book, series

    run_dir, _, _ = series_run
    found = crawl_offline(book.build(run_dir))
    pages = {Path(p).name for p in found["pages"]}
    assert {f"{n.stem}.html" for n in series.notebooks()} <= pages and "index.html" in pages
    assert not found["left"], f"requests that left the machine: {found['left'][:5]}"
    assert not found["failed"] and not found["dead"] and not found["broken_images"], \
        (found["failed"][:5], found["dead"][:5], found["broken_images"][:5])
    assert "04_fused_kernels.html" in found["typeset"] and not found["raw_math"], found["raw_math"]
