"""The browser kit for the app tests: one Streamlit server and one Chromium for the whole session.

Chromium comes from Debian (/usr/bin/chromium, installed by .ci/run from .ci/system-packages)
and Playwright from PyPI; Playwright's own browser download is never used. One Streamlit
server and one browser serve every browser test module (session fixtures): the server starts once,
on a checkpoints folder of links to the shipped checkpoints (so saving a trained model
never touches the shipped folder) and a runs folder with one experiment run.

What AppTest cannot see is checked here: figures that really draw (a plotly div with an
SVG, pixels that are not all one colour), a click on a heatmap cell, a second sweep (a
cache hit replays what the cached function drew), a second browser session, and a
real click on each kind of control. Screenshots of every page land in artifacts/.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest

try:
    from playwright import sync_api
except ImportError:  # the tests that need it skip (pytestmark below names why)
    sync_api = None

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
DEFAULT = "stories-2026"
# Two IOI prompts of the same length (so a widget keyed by position alone keeps its value),
# with different names: the answer of the first (Tom) is not in the second.
IOI_TOM = "When Tom and Lily went to the park , Lily gave a ball to"
IOI_MARY = "When Mary and John went to the store , John gave a drink to"

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path, error=RuntimeError,
                 poll: float = 0.3) -> None:
    """Until the Streamlit server at ``url`` answers its health check; ``error`` naming ``log`` when the
    process ends first or ``timeout`` seconds pass."""
    deadline = time.time() + timeout
    while True:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).status == 200:
                return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise error(f"streamlit did not start; see {log}") from None
            time.sleep(poll)


def _make_runs(root: Path) -> Path:
    """A runs folder as the experiments write it: results.csv, config.json, and figures as HTML
    that load plotly.min.js by a relative path (one plotly figure, and one page with two)."""
    import pandas as pd
    import plotly.graph_objects as go

    run = root / "head_sweep"
    run.mkdir(parents=True)
    rows = [dict(layer=l, head=h, method=m, delta=0.1 * l - 0.05 * h + (0.02 if m == "mean" else 0))
            for l in range(3) for h in range(4) for m in ("zero", "mean")]
    pd.DataFrame(rows).to_csv(run / "results.csv", index=False)
    (run / "config.json").write_text(json.dumps({"experiment": "head_ablation_sweep", "checkpoint": DEFAULT}))
    fig = go.Figure(go.Heatmap(z=[[0.1, 0.5], [0.9, 0.3]]), layout=dict(title="Sweep figure"))
    fig.write_html(run / "a_figure.html", include_plotlyjs="directory")
    two = fig.to_html(include_plotlyjs="directory", full_html=True)
    two = two.replace("</body>", go.Figure(go.Bar(y=[1, 3, 2])).to_html(include_plotlyjs=False, full_html=False)
                      + "</body>")
    (run / "b_page.html").write_text(two)
    return root


@pytest.fixture(scope="session")
def server(checkpoints_dir, tmp_path_factory):
    ckpts = tmp_path_factory.mktemp("checkpoints")
    for shipped in checkpoints_dir.iterdir():
        if shipped.is_dir():
            (ckpts / shipped.name).symlink_to(shipped.resolve(), target_is_directory=True)
    runs = _make_runs(tmp_path_factory.mktemp("runs"))
    port = _free_port()
    env = {**os.environ, "WORKBENCH_CHECKPOINTS": str(ckpts), "WORKBENCH_RUNS": str(runs)}
    cmd = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.port", str(port),
           "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false"]
    ARTIFACTS.mkdir(exist_ok=True)
    for stale in ARTIFACTS.glob("failure-*.png"):  # from an earlier run: only this run's failures stay
        stale.unlink()
    log = open(ARTIFACTS / "streamlit.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 60, ARTIFACTS / "streamlit.log", RuntimeError, poll=0.3)
        yield {"url": url, "checkpoints": ckpts, "runs": runs}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


@pytest.fixture(scope="session")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def open_app(browser, server, name: str = "Inspect", scheme: str = "light"):
    """A fresh browser session (its own Streamlit session) opened on page ``name`` (``?page=``)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, color_scheme=scheme)
    tab = context.new_page()
    tab.set_default_timeout(60_000)
    tab.goto(f"{server['url']}/?page={quote(name)}", wait_until="domcontentloaded")
    heading(tab, name).wait_for(timeout=180_000)
    wait_idle(tab)
    return tab


@pytest.fixture
def page(browser, server, request):
    """A browser session on the page the test names with ``@pytest.mark.page("Ablate")`` (Inspect
    by default); a screenshot of it when the test fails."""
    marker = request.node.get_closest_marker("page")
    tab = open_app(browser, server, marker.args[0] if marker else "Inspect")
    yield tab
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        shot(tab, f"failure-{request.node.name}")
    tab.context.close()


# ---- helpers -----------------------------------------------------------------------------------
def wait_idle(page, timeout: float = 120_000) -> None:
    """Until the script has finished its run: Streamlit marks the app's root with its state."""
    page.wait_for_timeout(250)
    for _ in range(2):  # twice: a widget change can start a second run right after the first
        page.wait_for_function(
            "() => { const app = document.querySelector('[data-testid=stApp]');"
            " return app && app.dataset.testScriptState === 'notRunning'; }", timeout=timeout)
        page.wait_for_timeout(200)


def no_exception(page) -> None:
    errors = page.locator("[data-testid=stException]")
    assert errors.count() == 0, errors.first.inner_text()[:2000]


def figure(page, title: str):
    return page.locator(".js-plotly-plot", has=page.locator(".gtitle", has_text=title)).first


def assert_drawn(locator, what: str, svg: bool = True) -> None:
    """The figure is visible, has its SVG (``svg``; an iframe's is checked inside its frame),
    and its pixels are not one flat colour."""
    from io import BytesIO

    from PIL import Image, ImageStat

    # 120 s, as wait_idle: a figure behind a sweep on a loaded 2-core machine once took longer than 60
    locator.wait_for(state="visible", timeout=120_000)
    locator.scroll_into_view_if_needed()
    if svg:
        assert locator.locator(".main-svg").count() > 0, f"{what}: no plot"
    try:
        shot = locator.screenshot()
    except Exception as e:  # Streamlit redrew the figure mid-shot: the locator finds the new one, shoot it
        if "not attached to the DOM" not in str(e):
            raise
        locator.wait_for(state="visible", timeout=120_000)
        shot = locator.screenshot()
    image = Image.open(BytesIO(shot)).convert("L")
    assert max(ImageStat.Stat(image).stddev) > 8, f"{what}: the figure is blank"


def go_to(page, name: str) -> None:
    """A real click on the sidebar's page radio."""
    page.locator("[data-testid=stSidebar] label", has_text=name).first.click()
    wait_idle(page)
    heading(page, name).wait_for(timeout=60_000)


def heading(page, name: str):
    """The page's own header (``st.header``), not a subheader or the sidebar's title."""
    return page.locator("[data-testid=stMain]").get_by_role("heading", name=name, exact=True).first


def widget(page, testid: str, label: str):
    return page.locator(f"[data-testid={testid}]", has=page.locator("label", has_text=label)).first


def choose(page, label: str, option: str) -> None:
    """A selectbox: click it (again if the list did not open: a click right after a scroll can
    land while the page still moves), click the option."""
    box = widget(page, "stSelectbox", label)
    box.scroll_into_view_if_needed()
    item = page.get_by_role("option", name=option, exact=True)
    for _ in range(3):
        box.click()
        try:
            item.wait_for(state="visible", timeout=3_000)
            break
        except sync_api.TimeoutError:
            page.keyboard.press("Escape")
    item.click()
    wait_idle(page)


def pick(page, label: str, option: str) -> None:
    """A multiselect: click it, type, choose the option."""
    box = widget(page, "stMultiSelect", label)
    box.click()
    page.keyboard.type(option)
    page.get_by_role("option", name=option, exact=True).click()
    page.keyboard.press("Escape")
    wait_idle(page)


def radio(page, label: str) -> None:
    page.locator("[data-testid=stRadio] label", has_text=label).first.click()
    wait_idle(page)


def type_into(page, label: str, text: str, testid: str = "stTextInput") -> None:
    box = widget(page, testid, label).locator("input, textarea").first
    box.fill(text)
    box.press("Enter" if testid != "stTextArea" else "Control+Enter")
    wait_idle(page)


def set_prompt(page, text: str) -> None:
    box = page.locator("[data-testid=stTextArea] textarea").first
    box.fill(text)
    box.press("Control+Enter")
    wait_idle(page)


def shot(page, name: str) -> None:
    """A screenshot of the whole page: Streamlit scrolls its main block, not the document, so the
    window is made as tall as that block first (then put back)."""
    height = page.evaluate("() => (document.querySelector('[data-testid=stMain]') || document.body).scrollHeight")
    page.set_viewport_size({"width": 1400, "height": min(max(1000, int(height)), 8000)})
    page.wait_for_timeout(500)  # plotly redraws at the new size
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))
    page.set_viewport_size({"width": 1400, "height": 1000})


def run_sweep(page) -> None:
    page.get_by_role("button", name="Run the head sweep").click()
    wait_idle(page)
    heatmap = figure(page, "when each head is ablated")
    page.locator("[data-testid=stException]").or_(heatmap).first.wait_for(state="visible", timeout=120_000)
    no_exception(page)
    wait_idle(page)


def click_cell(page, fig, layer: int, head: int, n_layers: int, n_heads: int) -> None:
    """A real mouse click at the centre of cell (layer, head) of a layer x head heatmap."""
    fig.scroll_into_view_if_needed()
    box = fig.locator(".nsewdrag").first.bounding_box()
    x = box["x"] + (head + 0.5) * box["width"] / n_heads
    y = box["y"] + (layer + 0.5) * box["height"] / n_layers  # layer 0 at the top
    page.mouse.move(x, y)
    page.wait_for_timeout(200)
    page.mouse.click(x, y)
    wait_idle(page)



# Every browser test module starts with these marks.
BROWSER_MARKS = [pytest.mark.slow,
                 pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is missing: apt-get install chromium"),
                 pytest.mark.skipif(sync_api is None, reason="playwright is not installed (pip install playwright)")]
