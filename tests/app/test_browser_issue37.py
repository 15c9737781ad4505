"""Issue 37 in Chromium (the server, browser and click helpers of browser_kit.py): every page on every
shipped checkpoint without an exception, a sweep of 30 panels, the Circuit page's q, k and v edges
L0H2 -> L1H1 drawn apart, the Graph page opened by a link at 512 feature rows and node threshold 0.95
(target logits apart, feature nodes apart and one clicked, the export downloaded), and a server log
with no deprecation warning and no stack trace. The figure-level checks are test_issue37_units.py.
"""

import json
import math
import shutil
from urllib.parse import quote

import pandas as pd
import pytest

from browser_kit import (ARTIFACTS, BROWSER_MARKS, assert_drawn, choose, figure, go_to, heading, no_exception, pick,
                         shot, wait_idle, widget)

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = BROWSER_MARKS

PAGES = ("Inspect", "Ablate", "Patch", "Steer", "Features", "Compare", "Build & train", "Sweeps", "Training", "Circuit",
         "Graph")


def test_every_page_opens_on_every_shipped_checkpoint(page, server):
    names = sorted(p.name for p in server["checkpoints"].iterdir() if (p / "config.json").is_file())
    assert "stories-2026" in names
    for name in names:
        go_to(page, "Inspect")
        choose(page, "Checkpoint", name)  # the sidebar's picker, shared by the pages that use it
        for title in PAGES:
            go_to(page, title)
            try:
                no_exception(page)
            except AssertionError as e:
                shot(page, f"failure-issue37-{name}-{title}")
                raise AssertionError(f"{title} on {name}: {e}") from None


def test_a_sweep_of_thirty_panels_draws(page, server):
    run = server["runs"] / "zz_many_panels"
    run.mkdir()
    try:
        pd.DataFrame([dict(layer=l, head=h, method=f"m{m:02d}", delta=0.1 * l - 0.02 * h + 0.01 * m)
                      for m in range(30) for l in range(2) for h in range(4)]).to_csv(run / "results.csv", index=False)
        go_to(page, "Sweeps")
        pick(page, "Runs", "zz_many_panels")
        no_exception(page)
        fig = figure(page, "by layer and head")
        assert_drawn(fig, "the 30-panel heatmap")
        assert fig.locator(".heatmaplayer .hm").count() >= 30 or page.evaluate(
            "() => [...document.querySelectorAll('.js-plotly-plot')].some(p => p.data.filter(t => t.type === 'heatmap')"
            ".length === 30)")
    finally:
        shutil.rmtree(run, ignore_errors=True)


EDGES = """() => {
  const plot = [...document.querySelectorAll('.js-plotly-plot')].find(
    p => (p.querySelector('.gtitle') || {}).textContent?.startsWith('EAP (edge attribution patching)'));
  const near = (a, b) => Math.abs(a - b) < 1e-6;
  const lines = plot.data.filter(t => t.mode === 'lines' && t.x.length >= 2 && near(t.x[0], 1) && near(t.y[0], 2)
                                 && near(t.x[t.x.length - 1], 3) && near(t.y[t.y.length - 1], 1));
  return {names: lines.map(t => t.name), middles: lines.map(t => [t.x[Math.floor(t.x.length / 2)], t.y[Math.floor(t.y.length / 2)]]),
          labels: (plot.layout.annotations || []).map(a => a.text)};
}"""


@pytest.mark.page("Circuit")
def test_circuit_shows_the_q_k_and_v_edges_apart_and_named(page):
    page.get_by_role("button", name="Run", exact=True).click()  # EAP, top 20 edges, on planted-iit-induction
    wait_idle(page)
    fig = figure(page, "EAP (edge attribution patching)")
    assert_drawn(fig, "EAP's circuit")
    no_exception(page)
    found = page.evaluate(EDGES)
    assert sorted(found["names"]) == ["k", "q", "v"], found
    a, b, c = found["middles"]
    assert min(math.dist(a, b), math.dist(b, c), math.dist(a, c)) > 0.3, found
    assert {"q", "k", "v"} <= set(found["labels"])
    shot(page, "issue37-circuit")


NODES = """(kind) => {
  const plot = [...document.querySelectorAll('.js-plotly-plot')].find(p => (p.layout.title.text || '').includes('features,'));
  const i = plot.data.findIndex(t => t.name === kind);
  const points = [...plot.querySelectorAll('.scatterlayer .trace')][i].querySelectorAll('path.point');
  return {ids: plot.data[i].customdata.map(row => row[0]),
          boxes: [...points].map(p => { const r = p.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2, r.width]; })};
}"""


def test_graph_link_at_512_rows_keeps_nodes_apart_clickable_and_exports(browser, server):
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    tab = context.new_page()
    tab.set_default_timeout(180_000)
    try:
        tab.goto(f"{server['url']}/?page=Graph&graph_max_nodes=512&graph_node_threshold={quote('0.95')}",
                 wait_until="domcontentloaded")
        heading(tab, "Graph").wait_for(timeout=180_000)
        wait_idle(tab, timeout=300_000)
        no_exception(tab)
        fig = figure(tab, "(node 0.95,")
        assert_drawn(fig, "the graph opened by the link")
        fig.scroll_into_view_if_needed()
        logits = tab.evaluate(NODES, "logit")["boxes"]
        for i, (x, y, w) in enumerate(logits):
            for x2, y2, w2 in logits[i + 1:]:
                assert math.dist((x, y), (x2, y2)) >= (w + w2) / 2, f"target logits overlap: {logits}"
        features = tab.evaluate(NODES, "feature")
        boxes = features["boxes"]
        assert len(boxes) >= 2
        nearest = min(math.dist(a[:2], b[:2]) for i, a in enumerate(boxes) for b in boxes[i + 1:])
        largest = max(w for *_, w in boxes)
        crowded = [w for *_, w in boxes if w <= 13]
        assert nearest >= min(largest, 12) * 0.9, f"feature nodes {nearest:.1f} px apart (largest {largest:.1f} px)"
        # a real click on the least influential feature (drawn last, at the edge of its cell) opens it
        target = len(boxes) - 1
        x, y, _ = boxes[target]
        tab.mouse.move(x, y)
        tab.wait_for_timeout(300)
        tab.mouse.click(x, y)
        wait_idle(tab)
        no_exception(tab)
        assert widget(tab, "stSelectbox", "Feature node").get_by_role("combobox").input_value() == features["ids"][target]
        with tab.expect_download() as download:
            tab.get_by_role("button", name="Export (circuit-tracer JSON)").click()
        exported = json.loads(open(download.value.path()).read())
        assert exported["metadata"]["node_threshold"] == pytest.approx(0.95)
        assert {"nodes", "links", "qParams"} <= set(exported) and len(exported["nodes"]) >= len(boxes)
        link = tab.get_by_role("link", name="Link to this view").get_attribute("href")
        assert "graph_max_nodes=512" in link and "graph_node_threshold=0.95" in link
        shot(tab, f"issue37-graph-512-{len(crowded)}-crowded")
    finally:
        context.close()


def test_the_server_log_has_no_deprecation_warning_or_stack_trace(server):
    log = (ARTIFACTS / "streamlit.log").read_text()
    assert "use_container_width" not in log
    assert "Stack (most recent call last)" not in log and "Traceback" not in log
