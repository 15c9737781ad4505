"""The QK panel of the Graph page and the QK figure of the Training page, in Chromium with real clicks.

Graph: on planted-hand-induction (attention-only: the model is its own replacement) a click on the
toggle opens the QK panel at the graph's largest attention entry, the induction head reading the
token after the earlier occurrence, whose top pair is the K-composition the weights were written
for; a real click on another cell of the head's attention pattern picks that edge, and the
selectors, the entry list (none of its entries, since the graph does not list that one), the
heatmap's title and the removal follow; a real click on the QK heatmap's top cell picks
that pair for the removal, after another was picked in its list. Training: a click on the toggle draws the top
QK pair and the K-composition pairs over the snapshots of induction-attn2l, above the loss curve.
"""

import pytest

from browser_kit import BROWSER_MARKS, assert_drawn, choose, figure, no_exception, shot, wait_idle, widget

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = BROWSER_MARKS

TRACES = """(title) => {
  const plot = [...document.querySelectorAll('.js-plotly-plot')].find(p => (p.layout.title.text || '').includes(title));
  return plot ? plot.data.map(t => t.name) : null;
}"""


# The page coordinates of a heatmap cell's centre (category index -> pixel, by plotly's own axes).
CELL = """([title, x, y]) => {
  const plot = [...document.querySelectorAll('.js-plotly-plot')].find(p => (p.layout.title.text || '').includes(title));
  const xa = plot._fullLayout.xaxis, ya = plot._fullLayout.yaxis, box = plot.getBoundingClientRect();
  return [box.left + xa._offset + xa.l2p(x), box.top + ya._offset + ya.l2p(y)];
}"""


ROW = """([title, y]) => {
  const plot = [...document.querySelectorAll('.js-plotly-plot')].find(p => (p.layout.title.text || '').includes(title));
  const cells = plot.data.find(t => t.name === 'cells').customdata;  // [query, key, weight] per cell
  const row = [];
  cells.filter(c => c[0] === y).forEach(c => { row[c[1]] = c[2]; });
  return row;
}"""


# The QK heatmap's axes and its pair of largest |contribution| (the table's first row).
PAIRS = """(title) => {
  const plot = [...document.querySelectorAll('.js-plotly-plot')].find(p => (p.layout.title.text || '').includes(title));
  const cells = plot.data.find(t => t.name === 'cells').customdata;  // [query node, key node, contribution]
  const top = cells.reduce((a, c) => Math.abs(c[2]) > Math.abs(a[2]) ? c : a);
  return {queries: [...plot.data[0].y], keys: [...plot.data[0].x], top: [top[0], top[1]]};
}"""


def selected(page, label: str) -> str:
    return widget(page, "stSelectbox", label).get_by_role("combobox").input_value()


def toggle(page, label: str) -> None:
    page.locator("[data-testid=stCheckbox]", has_text=label).first.locator("label").click()
    wait_idle(page)


@pytest.mark.page("Graph")
def test_qk_panel_opens_on_a_click_and_follows_a_clicked_attention_cell(page):
    choose(page, "Checkpoint (with transcoders, or attention-only)", "planted-hand-induction")
    no_exception(page)
    toggle(page, "Open the QK panel")
    heatmap = figure(page, "QK pairs")
    assert_drawn(heatmap, "the QK heatmap")
    title = heatmap.locator(".gtitle").text_content()
    assert title.startswith("L1H0, query 14 -> key 8"), title  # the graph's largest attention entry
    assert selected(page, "Head") == "0" and selected(page, "Query position").startswith("14")
    assert selected(page, "Attention edge of the graph").startswith("L1H0: query 14 -> key 8 ")
    removal = page.locator("[data-testid=stMetric]", has_text="at the key").first
    assert "L0 H0 @8" in removal.inner_text()  # the K-composition pair's key node: the previous-token head
    # a real click on another cell of the pattern: query 12, at the key it attends to most
    pattern = figure(page, "Attention L1H0")
    pattern.scroll_into_view_if_needed()
    row = page.evaluate(ROW, ["Attention L1H0", 12])
    key = max(range(len(row)), key=lambda k: row[k])
    assert key != 8 and row[key] > 0.5, row  # an induction step of its own, not the edge open before
    x, y = page.evaluate(CELL, ["Attention L1H0", key, 12])
    page.mouse.move(x, y)
    page.wait_for_timeout(300)
    page.mouse.click(x, y)
    wait_idle(page)
    no_exception(page)
    assert selected(page, "Query position").startswith("12") and selected(page, "Key position").startswith(f"{key}:")
    # the entry list agrees with the clicked cell: the graph's targets (at the last position) flow through
    # query 14 alone, so query 12 is none of its listed entries and none is shown picked, the edge named
    picker = widget(page, "stSelectbox", "Attention edge of the graph").get_by_role("combobox")
    assert picker.input_value() == "" and f"query 12 -> key {key} is not among" in picker.get_attribute("placeholder")
    after = figure(page, "QK pairs")
    assert_drawn(after, "the QK heatmap of the clicked edge")
    assert after.locator(".gtitle").text_content().startswith(f"L1H0, query 12 -> key {key}")
    assert f"L0 H0 @{key}" in page.locator("[data-testid=stMetric]", has_text="at the key").first.inner_text()
    # another pair picked in the list (keys), then a real click on the QK heatmap's top cell picks that one
    box = widget(page, "stSelectbox", "Remove the key-side node of")
    box.scroll_into_view_if_needed()
    box.click()
    page.keyboard.press("ArrowDown")
    page.keyboard.press("Enter")
    wait_idle(page)
    pairs = page.evaluate(PAIRS, "QK pairs")
    query_node, key_node = pairs["top"]
    assert selected(page, "Remove the key-side node of") != f"{query_node} x {key_node}"
    after.scroll_into_view_if_needed()
    x, y = page.evaluate(CELL, ["QK pairs", pairs["keys"].index(key_node), pairs["queries"].index(query_node)])
    page.mouse.move(x, y)
    page.wait_for_timeout(300)
    page.mouse.click(x, y)
    wait_idle(page)
    no_exception(page)
    assert selected(page, "Remove the key-side node of") == f"{query_node} x {key_node}"
    assert key_node in page.locator("[data-testid=stMetric]", has_text="at the key").first.inner_text()
    shot(page, "graph-qk")


@pytest.mark.page("Training")
def test_training_draws_the_qk_pairs_over_the_snapshots_on_a_click(page):
    toggle(page, "QK pairs of a head's induction edge")
    fig = figure(page, "the top QK pair and")
    assert_drawn(fig, "the QK pairs over training")
    names = page.evaluate(TRACES, "the top QK pair and")
    assert {"top pair", "train_loss"} <= set(names) and any(n.endswith("median rank") for n in names), names
    assert any(n.startswith("best of token x L0H") for n in names), names  # the K-composition pairs followed
    no_exception(page)
    shot(page, "training-qk")
