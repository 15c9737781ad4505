"""A real browser on the page a user first sees: `streamlit run app.py` driven by Chromium.

Chromium comes from Debian (/usr/bin/chromium, installed by .ci/run from .ci/system-packages)
and Playwright from PyPI; Playwright's own browser download is never used. The test types
a prompt, checks that the attention and logit-lens figures render and that no exception
is shown, and saves screenshots (light and dark) under artifacts/.
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]

# slow: a real Streamlit server and browser; deselect with -m "not slow".
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is missing: apt-get install chromium")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(checkpoints_dir):
    port = _free_port()
    env = {**os.environ, "WORKBENCH_CHECKPOINTS": str(checkpoints_dir)}
    cmd = [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true", "--server.port", str(port),
           "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false"]
    ARTIFACTS.mkdir(exist_ok=True)
    log = open(ARTIFACTS / "streamlit.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).status == 200:
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"streamlit did not start; see {ARTIFACTS / 'streamlit.log'}") from None
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def _figure(page, title: str):
    return page.locator(".js-plotly-plot", has=page.locator(".gtitle", has_text=title)).first


def _wait_idle(page) -> None:
    """Streamlit shows a 'running' status widget while the script runs; wait until it is gone."""
    page.wait_for_timeout(300)
    page.wait_for_function("() => !document.querySelector('[data-testid=stStatusWidget]')", timeout=60_000)


def _new_prompt(checkpoints_dir) -> tuple[str, int]:
    """A prompt the default checkpoint can read (the first words of its default), and its length in tokens."""
    from ui import common
    from workbench.checkpoint import read_meta
    from workbench.tokenizer import load_tokenizer

    path = checkpoints_dir / "stories-2026"
    default = read_meta(path).get("default_prompt") or common.DEFAULT_PROMPT
    words = default.split()
    prompt = " ".join(words[: max(3, len(words) // 2)])
    return prompt, len(load_tokenizer(path).encode(prompt))


def test_first_page_in_a_real_browser(server, checkpoints_dir):
    prompt, n_tokens = _new_prompt(checkpoints_dir)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            for scheme in ("light", "dark"):
                page = browser.new_page(viewport={"width": 1400, "height": 1000}, color_scheme=scheme)
                page.goto(server, wait_until="domcontentloaded")
                page.wait_for_selector(".js-plotly-plot", timeout=90_000)
                _wait_idle(page)
                if scheme == "light":
                    box = page.locator("[data-testid=stTextArea] textarea").first
                    box.fill(prompt)
                    box.press("Control+Enter")
                    _wait_idle(page)
                    tokens = page.locator("[data-testid=stMetric]", has_text="Prompt length").locator("[data-testid=stMetricValue]")
                    sync_api.expect(tokens).to_have_text(f"{n_tokens} tokens", timeout=60_000)
                for title in ("Attention L", "Logit lens", "Per-token loss"):
                    figure = _figure(page, title)
                    figure.wait_for(state="visible", timeout=30_000)
                    assert figure.locator(".main-svg").count() > 0, f"figure {title!r} has no plot"
                assert page.locator("[data-testid=stException]").count() == 0
                assert "cannot encode" not in page.inner_text("body")
                _figure(page, "Attention L").scroll_into_view_if_needed()
                page.screenshot(path=str(ARTIFACTS / f"inspect-{scheme}.png"), full_page=False)
                _figure(page, "Logit lens").scroll_into_view_if_needed()
                page.screenshot(path=str(ARTIFACTS / f"inspect-{scheme}-lens.png"))
                page.close()
        except Exception:
            for i, open_page in enumerate(browser.contexts[-1].pages if browser.contexts else []):
                open_page.screenshot(path=str(ARTIFACTS / f"failure-{i}.png"), full_page=True)
            raise
        finally:
            browser.close()
