# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 8. A tour of the app
#
# `./workbench.sh app` runs `python -m ui.serve`: `streamlit run app.py` on the shipped checkpoints,
# with the imports, the default checkpoint and its first page's analyses loaded while the server
# starts (plain `.venv/bin/streamlit run app.py` works too, and pays those on the first page). Every page reads
# widgets, calls the library and draws its tables; nothing is computed in the page. This tutorial
# starts the app headless, opens four pages in Chromium (Debian's `/usr/bin/chromium`, driven by
# Playwright, as the app's browser tests do) and shows what they draw on first load. Without a
# Chromium it says so and shows nothing.

# %%
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from IPython.display import Image, display

import workbench as wb

ROOT = Path(wb.__file__).resolve().parents[1]      # the repository root: app.py and checkpoints/ lie there
CHROMIUM = Path("/usr/bin/chromium")
try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None
can_drive = CHROMIUM.exists() and sync_playwright is not None
print("Chromium:", CHROMIUM if CHROMIUM.exists() else "not installed", "| playwright:", sync_playwright is not None)

# %% [markdown]
# ## Start the app
# The same command `./workbench.sh app` runs, headless, on a free local port.

# %%
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
url = f"http://127.0.0.1:{port}"
server = None
if can_drive:
    server = subprocess.Popen(
        [sys.executable, "-m", "ui.serve", "--server.headless", "true", "--server.port", str(port)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while True:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).status == 200:
                break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError("streamlit did not start") from None
            time.sleep(0.3)
    print("the app is up at", url)

# %% [markdown]
# ## Four pages
# **Inspect**: per-token loss, attention, head scores, the lens and direct logit attribution of one
# prompt (one per line for several). **Ablate**: heads, layers or neurons zeroed, mean- or
# resample-ablated, and a sweep over every head. **Patch**: activation and attribution patching over
# the stories task's clean/corrupted pairs. **Circuit**: a method's circuit drawn as a layered graph,
# scored against a planted model's known circuit.

# %%
shots = Path(tempfile.mkdtemp())


def screenshot(browser, name):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(120_000)
    tab.goto(f"{url}/?page={name}", wait_until="domcontentloaded")
    tab.locator("[data-testid=stMain]").get_by_role("heading", name=name, exact=True).first.wait_for()
    for _ in range(2):  # twice, as the app's browser tests do: a first run can start a second
        tab.wait_for_timeout(500)
        tab.wait_for_function("() => { const a = document.querySelector('[data-testid=stApp]');"
                              " return a && a.dataset.testScriptState === 'notRunning'; }")
    tab.wait_for_timeout(2500)  # let the widgets and plotly finish drawing
    path = shots / f"{name}.png"
    tab.screenshot(path=str(path))
    context.close()
    return path


def take_screenshots(names):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu"])
        try:
            return [screenshot(browser, name) for name in names]
        finally:
            browser.close()


if can_drive:
    names = ("Inspect", "Ablate", "Patch", "Circuit")
    try:
        # Playwright's sync API refuses to run where an asyncio loop already runs (a Jupyter kernel's):
        # a worker thread has none.
        with ThreadPoolExecutor(1) as pool:
            paths = pool.submit(take_screenshots, names).result()
    finally:
        server.terminate()
        server.wait(timeout=20)
    for name, path in zip(names, paths):
        print(name)
        display(Image(filename=str(path), width=900))

# %% [markdown]
# The other pages: **Steer** (directions, steering and probes), **Features** (a dictionary's
# features), **Compare** (two checkpoints side by side), **Build & train** (every component as a
# widget, training in the background), **Sweeps** (what `experiments/` wrote), **Training** (a run's
# snapshots under a step slider) and **Graph** (a prompt's attribution graph through a checkpoint's
# transcoders, with QK attribution of a chosen head). `docs/reference/app.md` describes each.
