"""The Graph page in a real browser (the server, Chromium and click helpers of browser_kit.py).

The page loads on stories-2026's IOI prompt, the attribution graph is drawn with pixels, a real
drag-free slider change (a click on the thumb, then keys) re-renders it with another node count
and no Streamlit exception, and a real mouse click on a feature node opens that node's card.
"""

import pytest

from browser_kit import BROWSER_MARKS, assert_drawn, figure, no_exception, shot, wait_idle, widget

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = BROWSER_MARKS

GRAPH = "features,"  # every graph figure's title: "12 features, 93 edges (node 0.8, edge 0.98)"

# The graph figure's feature trace: its index among the figure's scatter traces and its node ids.
FEATURE_TRACE = """() => {
  const plot = [...document.querySelectorAll('.js-plotly-plot')].find(p => (p.layout.title.text || '').includes('features,'));
  const i = plot.data.findIndex(t => t.name === 'feature');
  return {index: i, ids: plot.data[i].customdata.map(row => row[0])};
}"""


def title(page) -> str:
    return figure(page, GRAPH).locator(".gtitle").text_content()


def nodes_kept(page) -> str:
    return page.locator("[data-testid=stMetric]", has_text="Nodes kept").locator("[data-testid=stMetricValue]").inner_text()


def node_picker(page) -> str:
    return widget(page, "stSelectbox", "Feature node").get_by_role("combobox").input_value()


@pytest.mark.page("Graph")
def test_graph_page_draws_re_renders_on_a_slider_and_opens_a_clicked_feature(page):
    assert_drawn(figure(page, GRAPH), "the attribution graph")
    no_exception(page)
    before, kept = title(page), nodes_kept(page)
    thumb = widget(page, "stSlider", "Node threshold").locator("[data-testid=stSliderThumbValue]").locator("..").first
    thumb.scroll_into_view_if_needed()
    thumb.click()
    for _ in range(10):  # 0.8 -> 0.9
        page.keyboard.press("ArrowRight")
    figure(page, "(node 0.9,").wait_for(timeout=60_000)  # the slider's value reaches the script a moment later
    wait_idle(page)
    no_exception(page)
    assert_drawn(figure(page, GRAPH), "the graph after the slider")
    assert nodes_kept(page) != kept and title(page) != before
    # a real click on a feature node that is not the one open
    trace = page.evaluate(FEATURE_TRACE)
    assert len(trace["ids"]) >= 2
    target = next(i for i, node in enumerate(trace["ids"]) if node != node_picker(page))
    fig = figure(page, GRAPH)
    fig.scroll_into_view_if_needed()
    point = fig.locator(".scatterlayer .trace").nth(trace["index"]).locator("path.point").nth(target)
    box = point.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.wait_for_timeout(300)
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    wait_idle(page)
    no_exception(page)
    assert node_picker(page) == trace["ids"][target]
    assert_drawn(figure(page, "max-activating contexts"), "the clicked feature's contexts")
    shot(page, "graph")
