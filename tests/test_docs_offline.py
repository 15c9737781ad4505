"""The documentation site draws its figures with no internet (scripts/docs_offline.py).

A site is built with the project's mkdocs.yml (inherited: its theme, plugins and hooks) over one
small tutorial written as the real ones are (a jupytext percent script whose figures use the
`notebook_connected` renderer), executed by mkdocs-jupyter as `./workbench.sh docs --build` does.
The real tutorials take minutes to execute; this one takes seconds. The page, and a standalone
figure page as scripts/ write them, are opened in Chromium over a local HTTP server with every
request to another host aborted, and their figures must draw. One test needs no browser: the hook's
rewrite of what plotly writes for its CDN.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "app"))
from browser_kit import BROWSER_MARKS, CHROMIUM, CHROMIUM_ARGS, sync_api  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import docs_offline  # noqa: E402


def browser_test(test):
    return functools.reduce(lambda t, mark: mark(t), BROWSER_MARKS, test)

TUTORIAL = '''# %% [markdown]
# # Offline figures
#
# Two figures drawn as the tutorials draw theirs, the second titled in LaTeX (MathJax).

# %%
import plotly.graph_objects as go
import plotly.io as pio

pio.renderers.default = "notebook_connected"

# %%
go.Figure(go.Bar(x=["a", "b", "c"], y=[1, 3, 2]), layout=dict(title="bars"))

# %%
go.Figure(go.Heatmap(z=[[0.1, 0.5], [0.9, 0.3]]), layout=dict(title=r"$\\alpha^2 + \\beta$"))
'''


def _hooks(config: str) -> list[str]:
    """The `hooks:` entries of mkdocs.yml (a plain list of paths), absolute."""
    block = re.search(r"^hooks:\n((?:[ \t]+-[^\n]*\n)+)", config, re.M)
    return [str(REPO / line.strip()[1:].strip()) for line in block.group(1).splitlines()] if block else []


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("docs-offline")
    (root / "docs" / "tutorials").mkdir(parents=True)
    (root / "docs" / "index.md").write_text("# Offline\n\nSee the tutorial.\n")
    (root / "docs" / "tutorials" / "01-figures.py").write_text(TUTORIAL)
    # a standalone figure page as scripts/grokking_docs.py writes them (plotly from its CDN)
    import plotly.graph_objects as go

    go.Figure(go.Scatter(y=[1, 3, 2])).write_html(root / "docs" / "standalone.html", include_plotlyjs="cdn")
    # INHERIT keeps the project's theme and plugins; the hook paths are relative to mkdocs.yml,
    # so they are given here absolute
    hooks = "".join(f"\n  - {h}" for h in _hooks((REPO / "mkdocs.yml").read_text()))
    (root / "mkdocs.yml").write_text(f"INHERIT: {REPO / 'mkdocs.yml'}\ndocs_dir: docs\nsite_dir: site\n"
                                     f"hooks:{hooks or ' []'}\n")
    # cwd=root: mkdocs-jupyter's execution cache (.cache/) lands there, not in the repository's
    env = {**os.environ, "WORKBENCH_DOCS_EXECUTE": "true", "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return root / "site"


@pytest.fixture(scope="module")
def http_url(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def offline_tab():
    """A Chromium tab whose requests to any host but this one are aborted; yields (tab, page
    errors, blocked urls)."""
    blocked, errors = [], []

    def local_only(route):
        if urlparse(route.request.url).hostname in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort("internetdisconnected")

    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            tab = chromium.new_context(viewport={"width": 1200, "height": 900}).new_page()
            tab.route("**/*", local_only)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            yield tab, errors, blocked
        finally:
            chromium.close()


@browser_test
def test_tutorial_figures_draw_with_the_network_blocked(http_url):
    with offline_tab() as (tab, errors, blocked):
        tab.goto(f"{http_url}/tutorials/01-figures/", wait_until="load")
        graphs = tab.locator(".plotly-graph-div")
        assert graphs.count() == 2  # the two figures are on the page, drawn or not
        # drawn: the bar chart's three bars, the heatmap's image
        tab.wait_for_function("document.querySelectorAll('.js-plotly-plot .bars .point').length == 3"
                              " && document.querySelector('.js-plotly-plot .hm image') !== null",
                              timeout=30_000)
        # the LaTeX title typeset by MathJax (an SVG in place of the $...$ text)
        graphs.nth(1).locator(".gtitle-math-group svg").wait_for(timeout=30_000)
        assert not errors, errors
    # the page asked no other host for anything: not a font, not a script
    assert not blocked, blocked


@browser_test
def test_standalone_figure_page_draws_with_the_network_blocked(http_url):
    with offline_tab() as (tab, errors, blocked):
        tab.goto(f"{http_url}/standalone.html", wait_until="load")
        tab.wait_for_function("document.querySelectorAll('.js-plotly-plot .scatterlayer .trace').length == 1",
                              timeout=30_000)
        assert not errors, errors
    assert not blocked, blocked


def test_plotly_cdn_loads_become_site_paths():
    """Without a browser: what plotly writes for a CDN (a page, and the notebook renderer's
    first output) loads nothing from another host after the rewrite, each file once."""
    import plotly.graph_objects as go

    fig = go.Figure(go.Bar(y=[1, 2]), layout=dict(title="$x^2$"))
    page = fig.to_html(include_plotlyjs="cdn", include_mathjax="cdn") * 2
    page = '<script type="module">import "https://cdn.plot.ly/plotly-4.1.1.min"</script>' + page
    assert docs_offline.external_loads(page)  # the check sees what the rewrite must remove
    new = docs_offline.make_offline(page, "../../")
    assert docs_offline.external_loads(new) == []
    assert new.count('src="../../assets/offline/plotly.min.js"') == 1
    assert new.count('src="../../assets/offline/tex-svg.js"') == 1
    assert "import" not in new  # the renderer's module import is the one plain script left
    assert new.index("plotly.min.js") < new.index("Plotly.newPlot")
    assert "integrity=" not in new and "crossorigin" not in new  # a file:// page cannot fetch with CORS
