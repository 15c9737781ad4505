"""Click-to-settled times of the app in Chromium (``python benchmarks/app.py --browser``).

A fresh ``streamlit run app.py`` for each cold start; Chromium from Debian, driven by the
browser kit the tests use (tests/app/browser_kit.py). A time is from the action (the server's
start, a click, a key press) until the page has settled: the script (or fragment) has run and
finished, and the browser has drawn two frames since. Each line prints the 1-minute load
average (``os.getloadavg``) read beside it, since on a shared machine it moves the numbers more
than anything the app does.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "app"))

# The first page's target is 5 s from launch, for the shipped default and for the real model alike.
TARGETS = {"first page (cold server)": 5.0, "first page once the server is up": 5.0,
           "first page, ui.serve (cold)": 5.0, "first page once ui.serve is up": 5.0,
           "first page, minimal Streamlit app": 5.0, "open a page (new session)": 1.5, "new prompt (Inspect)": 1.0,
           "cached widget (Inspect layer)": 0.5, "Patch pairs slider": 0.5, "Patch metric": 0.5,
           "Ablate one head": 0.5, "Cancel a training run": 1.0,
           # the real model as the default (SmolLM2-135M, cached)
           "first page, real model (cold)": 5.0, "first page, real model, server up": 5.0,
           "first page, real model, ui.serve (cold)": 5.0, "first page, real model, ui.serve up": 5.0}

# Marks when the app's script state goes running -> notRunning after the mark is set; then two frames.
ARM = """() => { window.__start = performance.now(); window.__done = null; window.__ran = false;
  const app = document.querySelector('[data-testid=stApp]');
  if (window.__obs) window.__obs.disconnect();
  window.__obs = new MutationObserver(() => {
    const state = app.dataset.testScriptState;
    if (state === 'running') window.__ran = true;
    else if (window.__ran && state === 'notRunning' && window.__done === null)
      requestAnimationFrame(() => requestAnimationFrame(() => { window.__done = performance.now(); }));
  });
  window.__obs.observe(app, {attributes: true, attributeFilter: ['data-test-script-state']}); }"""


def open_options(page, box, option) -> None:
    """Click a selectbox until ``option`` shows (a click right after a redraw can miss), as the
    browser kit's ``choose`` does; the click on the option is what gets timed."""
    from browser_kit import sync_api

    box.scroll_into_view_if_needed()
    for _ in range(4):
        box.click()
        try:
            option.wait_for(state="visible", timeout=5_000)
            return
        except sync_api.TimeoutError:
            page.keyboard.press("Escape")
    option.wait_for(state="visible")


def _load() -> float:
    return os.getloadavg()[0]


def settle(page, action: Callable[[], None], timeout: float = 120_000) -> float:
    """Seconds from ``action`` until the run it starts has finished and two frames are drawn."""
    page.evaluate(ARM)
    action()
    page.wait_for_function("() => window.__done !== null", timeout=timeout)
    seconds = page.evaluate("() => (window.__done - window.__start) / 1000")
    from browser_kit import wait_idle

    wait_idle(page)  # a second run some widgets start right after the first
    return seconds


class Server:
    """``streamlit run app.py`` (or ``python -m ui.serve``, or ``script`` instead of app.py) on a free
    port; ``started`` is when the process was launched, ``launched`` the same in epoch seconds."""

    def __init__(self, env: dict, serve: bool = False, script: str = "app.py"):
        import tempfile

        from browser_kit import _free_port

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # What ./workbench.sh app does before it starts the server (not timed): the app's own modules
        # byte-compiled, which where Python writes no bytecode (PYTHONDONTWRITEBYTECODE=1) every import
        # would otherwise compile again.
        subprocess.run([sys.executable, "-m", "compileall", "-q", "workbench", "ui", "app.py"], cwd=REPO,
                       stdout=subprocess.DEVNULL, check=False)
        launch = ["-m", "ui.serve"] if serve else ["-m", "streamlit", "run", script, "--browser.gatherUsageStats",
                                                   "false"]
        cmd = [sys.executable, *launch, "--server.headless", "true", "--server.port", str(self.port),
               "--server.address", "127.0.0.1"]
        self.log = tempfile.TemporaryFile("w+")
        self.started, self.launched = time.perf_counter(), time.time()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**env, "WORKBENCH_TIMINGS": "1"}, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 120
        while True:
            try:
                if urllib.request.urlopen(f"{self.url}/_stcore/health", timeout=2).status == 200:
                    self.up = time.perf_counter()
                    return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.log.seek(0)
                    raise SystemExit(f"streamlit did not start (exit code {self.proc.poll()}); its output ended:\n"
                                     + self.log.read()[-3000:]) from None
                time.sleep(0.05)

    def timings(self) -> dict[str, float]:
        """The ``timing <phase> <epoch>`` lines the server printed (ui/serve.py, app.py): seconds from launch."""
        self.log.seek(0)
        out = {}
        for line in self.log.read().splitlines():
            if line.startswith("timing "):
                _, *phase, stamp = line.split()
                out.setdefault(" ".join(phase), float(stamp) - self.launched)
        return out

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


# Installed in every new session's page before its scripts: when the page last settled, in epoch
# milliseconds. A change is the script's state going to or from running, or the number of drawn plotly
# figures changing (a figure can finish drawing after the script's run has ended); the page has settled
# when two frames have been drawn after the last change with the script not running. The first page's
# times are read from this instead of from when the polling waits below return: those add their own
# pauses (0.25 s, then 0.2 s twice) that the minimal app and the app both paid, 0.65 s or more.
SETTLE_PROBE = """(() => {
  window.__settledAt = null; window.__firstFigureAt = null;
  const now = () => performance.timeOrigin + performance.now();
  let state = null, figures = -1, generation = 0, queued = false;
  const check = () => {
    queued = false;
    const app = document.querySelector('[data-testid=stApp]');
    const nowState = app ? app.dataset.testScriptState : null;
    const nowFigures = document.querySelectorAll('.js-plotly-plot .main-svg').length;
    if (nowFigures > 0 && window.__firstFigureAt === null) window.__firstFigureAt = now();
    if (nowState === state && nowFigures === figures) return;
    state = nowState; figures = nowFigures;
    const mine = ++generation;
    if (state === 'notRunning')
      requestAnimationFrame(() => requestAnimationFrame(() => {
        if (mine === generation) window.__settledAt = now(); }));
  };
  const observer = new MutationObserver(() => { if (!queued) { queued = true; requestAnimationFrame(check); } });
  const start = () => observer.observe(document.documentElement, {subtree: true, childList: true, attributes: true,
                                                                  attributeFilter: ['data-test-script-state']});
  if (document.documentElement) start(); else document.addEventListener('readystatechange', start, {once: true});
})()"""


def settled_at(tab) -> float:
    """When the page last settled (:data:`SETTLE_PROBE`), in epoch seconds."""
    stamp = tab.evaluate("() => window.__settledAt")
    if stamp is None:
        raise RuntimeError("the page never settled with the script idle")
    return stamp / 1000


def new_session(browser, url: str, name: str):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.add_init_script(SETTLE_PROBE)
    tab = context.new_page()
    tab.set_default_timeout(120_000)
    tab.goto(f"{url}/?page={name.replace(' ', '%20').replace('&', '%26')}", wait_until="domcontentloaded")
    return tab


def settled_page(tab, name: str) -> None:
    """Until the page's header and first figure (if it draws one) show and the script is idle."""
    from browser_kit import heading, wait_idle

    heading(tab, name).wait_for(timeout=300_000)
    wait_idle(tab, timeout=300_000)


def first_page(browser, env: dict, serve: bool = False, breakdown: bool = False) -> tuple[float, float]:
    """From launching the server, and from its first healthy answer (when a user could open the
    URL), until Inspect has drawn its figures: (from launch, from up). With ``breakdown``, prints
    when each part ended, in seconds from launch (the server's phases from its ``timing`` lines)."""
    server = Server(env, serve)
    try:
        opened = time.perf_counter()
        tab = new_session(browser, server.url, "Inspect")
        loaded = time.perf_counter()
        tab.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=300_000)
        settled_page(tab, "Inspect")
        done = settled_at(tab) - server.launched  # seconds from launch
        figure = tab.evaluate("() => window.__firstFigureAt") / 1000 - server.launched
        tab.context.close()
        if breakdown:
            parts = {**server.timings(), "server healthy": server.up - server.started,
                     "browser: page loaded (DOMContentLoaded)": loaded - server.started,
                     "browser: first figure drawn": figure, "browser: settled": done}
            print(f"  {'ui.serve' if serve else 'streamlit run'}, seconds from launch: "
                  + "; ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items(), key=lambda kv: kv[1])), flush=True)
        return done, done - (opened - server.started)
    finally:
        server.close()


MINIMAL = "import streamlit as st\nst.header('Inspect')\nst.plotly_chart({'data': [{'y': [1, 3, 2]}]})\n"


def minimal_page(browser, env: dict) -> float:
    """The floor on this machine: a two-line Streamlit script with one plotly figure, from launch to drawn.

    The script sits in a folder of its own: Streamlit looks through the folder of the script it runs,
    and with the script in /tmp itself (650 entries on the shared machine) the same page took 11-13 s
    against 6.6-7.1 s from its own folder, alternating, at load 9 (2026-12-05)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="workbench-minimal-") as folder:
        script = Path(folder) / "minimal.py"
        script.write_text(MINIMAL)
        server = Server(env, script=str(script))
        try:
            tab = new_session(browser, server.url, "Inspect")
            tab.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=300_000)
            settled_page(tab, "Inspect")
            seconds = settled_at(tab) - server.launched
            tab.context.close()
            return seconds
        finally:
            server.close()


def report(name: str, seconds: list[float], loads: list[float]) -> None:
    target = TARGETS[name]
    median = statistics.median(seconds)
    print(f"{name:32s} median {median:6.2f} s over {len(seconds)} (min {min(seconds):.2f}, max {max(seconds):.2f}); "
          f"target <= {target} s: {'met' if median <= target else 'NOT met'}; load {min(loads):.2f}-{max(loads):.2f}",
          flush=True)


def measure(name: str, repeats: int, step: Callable[[int], float]) -> None:
    seconds, loads = [], []
    for i in range(repeats):
        loads.append(_load())
        seconds.append(step(i))
    report(name, seconds, loads)


def main(repeats: int, cold: int, checkpoints: Path, only_first: bool = False, real_model: bool = False) -> None:
    from playwright import sync_api

    from browser_kit import CHROMIUM, CHROMIUM_ARGS, IOI_MARY, IOI_TOM, widget

    env = {**os.environ, "WORKBENCH_CHECKPOINTS": str(checkpoints)}
    print(f"{os.cpu_count()} CPU cores; Chromium {CHROMIUM}; {repeats} repeats (cold starts: {cold}); "
          f"load average now {os.getloadavg()}", flush=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        for serve, names in ((False, ("first page (cold server)", "first page once the server is up")),
                             (True, ("first page, ui.serve (cold)", "first page once ui.serve is up"))):
            loads = [_load() for _ in range(cold)]
            runs = [first_page(browser, env, serve, breakdown=True) for _ in range(cold)]
            report(names[0], [r[0] for r in runs], loads)
            report(names[1], [r[1] for r in runs], loads)
        if real_model:  # the real model as the default: a checkpoints folder with nothing in it
            import tempfile

            with tempfile.TemporaryDirectory(prefix="workbench-bench-empty-") as empty:
                real_env = {**env, "WORKBENCH_CHECKPOINTS": empty}
                for serve, names in ((False, ("first page, real model (cold)", "first page, real model, server up")),
                                     (True, ("first page, real model, ui.serve (cold)",
                                             "first page, real model, ui.serve up"))):
                    loads = [_load() for _ in range(cold)]
                    runs = [first_page(browser, real_env, serve, breakdown=True) for _ in range(cold)]
                    report(names[0], [r[0] for r in runs], loads)
                    report(names[1], [r[1] for r in runs], loads)
        if only_first:
            loads = [_load() for _ in range(cold)]
            report("first page, minimal Streamlit app", [minimal_page(browser, env) for _ in range(cold)], loads)
            return
        server = Server(env)
        try:
            warm = new_session(browser, server.url, "Inspect")
            settled_page(warm, "Inspect")
            for name in ("Patch", "Ablate"):  # each page once, so what it caches per process is there
                tab = new_session(browser, server.url, name)
                settled_page(tab, name)
                tab.context.close()

            def open_page(i: int) -> float:
                name = ("Patch", "Ablate", "Compare")[i % 3]
                started = time.perf_counter()
                tab = new_session(browser, server.url, name)
                settled_page(tab, name)
                seconds = time.perf_counter() - started
                tab.context.close()
                return seconds

            measure("open a page (new session)", repeats, open_page)
            prompts = [IOI_TOM, IOI_MARY, IOI_TOM.replace("Tom", "Anna"), IOI_MARY.replace("Mary", "Sue"),
                       IOI_TOM.replace("park", "lake"), IOI_MARY.replace("store", "farm")]

            def new_prompt(i: int) -> float:
                box = warm.locator("[data-testid=stTextArea] textarea").first
                box.fill(prompts[(i + 2) % len(prompts)])
                return settle(warm, lambda: box.press("Control+Enter"))

            measure("new prompt (Inspect)", repeats, new_prompt)

            def layer(i: int) -> float:
                option = warm.get_by_role("option", name=str((i + 1) % 2), exact=True)
                open_options(warm, widget(warm, "stSelectbox", "Layer"), option)
                return settle(warm, option.click)

            layer(0), layer(1)  # both layers drawn once: the measured changes are cached
            measure("cached widget (Inspect layer)", repeats, layer)

            patch = new_session(browser, server.url, "Patch")
            settled_page(patch, "Patch")

            def slider(i: int) -> float:
                thumb = patch.get_by_role("slider").first
                thumb.focus()
                return settle(patch, lambda: patch.keyboard.press("ArrowRight" if i % 2 == 0 else "ArrowLeft"))

            slider(0), slider(1)
            measure("Patch pairs slider", repeats, slider)
            metrics = ["answer probability", "logit difference (answer − wrong)"]

            def metric(i: int) -> float:
                option = patch.get_by_role("option", name=metrics[i % 2], exact=True)
                open_options(patch, widget(patch, "stSelectbox", "Metric"), option)
                return settle(patch, option.click)

            metric(0), metric(1)
            measure("Patch metric", repeats, metric)
            patch.context.close()

            ablate = new_session(browser, server.url, "Ablate")
            settled_page(ablate, "Ablate")
            heads = ["L0H1", "L1H2"]

            def one_head(i: int) -> float:
                from browser_kit import wait_idle

                box = widget(ablate, "stMultiSelect", "Units to ablate")
                box.click()
                ablate.keyboard.type(heads[i % 2])
                option = ablate.get_by_role("option", name=heads[i % 2], exact=True)
                option.wait_for()
                seconds = settle(ablate, option.click)
                ablate.keyboard.press("Escape")
                box.click()  # and off again (not timed): Backspace removes the last chosen unit
                ablate.keyboard.press("Backspace")
                ablate.keyboard.press("Escape")
                wait_idle(ablate)
                return seconds

            measure("Ablate one head", repeats, one_head)
            ablate.context.close()

            train = new_session(browser, server.url, "Build & train")
            settled_page(train, "Build & train")
            steps = widget(train, "stNumberInput", "steps").locator("input")
            steps.fill("100000")
            steps.press("Enter")

            def cancel(i: int) -> float:
                train.get_by_role("button", name="Train", exact=True).click()
                button = train.get_by_role("button", name="Cancel", exact=True)
                button.wait_for(timeout=120_000)
                train.get_by_text("training, step", exact=False).first.wait_for(timeout=120_000)
                train.wait_for_timeout(1500)
                started = time.perf_counter()
                button.click()
                train.get_by_text("Cancelled at step", exact=False).first.wait_for(timeout=120_000)
                return time.perf_counter() - started

            measure("Cancel a training run", repeats, cancel)
            train.context.close()
            warm.context.close()
        finally:
            server.close()
        browser.close()

