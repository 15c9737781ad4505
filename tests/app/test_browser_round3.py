"""The app in a browser, round three: views that must not mislead, defaults that fit their model,
widget choices that survive tab and page switches, and figures whose text never overlaps.

Each test here failed on the app before its fix (the issue "The app, round three" lists them):
Patch drew "fraction restored" maps for pairs whose clean and corrupted prompts score the same;
Sweeps pooled runs of different models into one heatmap cell; the context-4 and context-16
models got a 24-token default prompt; Inspect's layer and head went back to L0H0 after a tab
switch; the Circuit page opened on ACDC with "top k" selected. The overlap test reads the
bounding box of every text element of every plotly figure (its SVG) on every page.
"""

import pandas as pd
import pytest

from browser_kit import BROWSER_MARKS, choose, figure, go_to, heading, no_exception, open_app, pick, radio, wait_idle

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = BROWSER_MARKS

# Every text element of every figure on the page that is visible: its text, classes, font size and
# the four corners of its box on the screen (rotated with it: tick labels are often turned).
# Hover labels are transient and are left out; so are empty strings and zero-size boxes.
TEXT_BOXES = """() => [...document.querySelectorAll('.js-plotly-plot')].map((plot, i) => {
  const title = plot.querySelector('.gtitle');
  const texts = [...plot.querySelectorAll('svg.main-svg text')].filter(t => !t.closest('.hoverlayer'));
  return {figure: title ? title.textContent : `figure ${i}`, texts: texts.map(t => {
    const style = getComputedStyle(t);
    const b = t.getBBox(), m = t.getScreenCTM();
    const corners = [[b.x, b.y], [b.x + b.width, b.y], [b.x + b.width, b.y + b.height], [b.x, b.y + b.height]]
      .map(([x, y]) => [m.a * x + m.c * y + m.e, m.b * x + m.d * y + m.f]);
    return {text: t.textContent, cls: (t.getAttribute('class') || '') + ' < ' +
            (t.parentNode.getAttribute('class') || ''), corners, w: b.width, h: b.height,
            size: parseFloat(style.fontSize), cell: !!t.closest('.heatmaplayer, .hm'),
            shown: style.visibility !== 'hidden' && style.display !== 'none' && +style.opacity !== 0
                   && t.getBoundingClientRect().width > 0};
  }).filter(t => t.text.trim() && t.w > 0 && t.h > 0 && t.shown)};
})"""


def _penetration(a: list, b: list) -> float:
    """How deep two convex quadrilaterals overlap (px): the least overlap of their projections on
    the edge normals of both (separating axis theorem); <= 0 when they do not touch."""
    depth = float("inf")
    for quad in (a, b):
        for i in range(4):
            (x0, y0), (x1, y1) = quad[i], quad[(i + 1) % 4]
            nx, ny = y0 - y1, x1 - x0
            norm = (nx * nx + ny * ny) ** 0.5 or 1.0
            pa = [(x * nx + y * ny) / norm for x, y in a]
            pb = [(x * nx + y * ny) / norm for x, y in b]
            depth = min(depth, min(max(pa), max(pb)) - max(min(pa), min(pb)))
    return depth


def overlaps(page, slack: float = 1.5) -> list[str]:
    """Pairs of text elements of one figure that overlap by more than ``slack`` px, and cell
    texts smaller than 10 px; as readable lines."""
    found = []
    for fig in page.evaluate(TEXT_BOXES):
        texts = fig["texts"]
        for t in texts:
            if t["cell"] and t["size"] < 10:
                found.append(f"{fig['figure']!r}: cell text {t['text']!r} is {t['size']:.0f} px")
        for i, a in enumerate(texts):
            for b in texts[i + 1:]:
                if _penetration(a["corners"], b["corners"]) > slack:
                    found.append(f"{fig['figure']!r}: {a['text']!r} ({a['cls']}) overlaps {b['text']!r} ({b['cls']})")
    return found


def _summary(found: list[str]) -> str:
    """One line per figure: how many overlaps, and the first."""
    first: dict = {}
    for line in found:
        where = line.split("': ", 1)[0]
        first.setdefault(where, [0, line])[0] += 1
    return "\n".join(f"{n} x {line}" for n, line in first.values())


def page_text(page) -> str:
    return page.locator("[data-testid=stMain]").inner_text()


def plot_titles(page) -> list[str]:
    return page.locator(".js-plotly-plot .gtitle").all_text_contents()


def _value(page, label: str) -> str:
    """What a selectbox shows."""
    box = page.locator("[data-testid=stSelectbox]", has=page.locator("label", has_text=label)).first
    box.wait_for(timeout=120_000)  # on a loaded machine a rerun can take this long to redraw
    return box.get_by_role("combobox").input_value(timeout=120_000)


# ---- never misleading ------------------------------------------------------------------------------
@pytest.mark.page("Patch")
def test_patch_does_not_draw_fractions_of_a_gap_within_noise(page):
    radio(page, "the task's possession pairs")
    sync_api.expect(page.get_by_text("within noise", exact=False).first).to_be_visible(timeout=60_000)
    titles = plot_titles(page)
    assert titles and not any("fraction restored" in t for t in titles), titles
    assert any("metric (" in t for t in titles), titles  # the raw metric is drawn instead
    radio(page, "the task's ioi pairs")  # a real gap: the fractions are drawn
    sync_api.expect(figure(page, "fraction restored")).to_be_visible(timeout=60_000)
    assert "within noise" not in page_text(page)
    no_exception(page)


def _second_run(server) -> str:
    """A run of another model shape (2 layers x 8 heads; the kit's run has 3 x 4) with the same columns."""
    run = server["runs"] / "head_sweep_8h"
    if not run.is_dir():
        run.mkdir()
        rows = [dict(layer=l, head=h, method=m, delta=0.3 + 0.01 * h) for l in range(2) for h in range(8)
                for m in ("zero", "mean")]
        pd.DataFrame(rows).to_csv(run / "results.csv", index=False)
    return run.name


def test_sweeps_never_pool_runs_of_different_models_into_one_cell(browser, server):
    name = _second_run(server)
    page = open_app(browser, server, "Sweeps")
    try:
        pick(page, "Runs", name)
        heatmap = figure(page, "by layer and head")
        heatmap.wait_for(state="visible", timeout=60_000)
        panels = heatmap.locator(".annotation-text").all_text_contents()
        assert sum(name in p for p in panels) >= 1 and sum("head_sweep ·" in p for p in panels) >= 1, panels
        assert "never pooled" in page_text(page) and "8 heads" in page_text(page)
        no_exception(page)
    finally:
        page.context.close()


# ---- defaults that fit -------------------------------------------------------------------------------
def test_default_prompts_fit_the_context_and_circuit_opens_on_a_method_that_uses_top_k(page):
    for name in ("planted-iit-modular", "planted-hand-induction"):  # contexts of 4 and 16 tokens
        choose(page, "Checkpoint", name)
        figure(page, "Attention L0H0").wait_for(state="visible", timeout=20_000)
        assert "Shorten the prompt" not in page_text(page), name
    go_to(page, "Compare")
    choose(page, "Checkpoint B", "planted-iit-modular")
    assert "Shorten the prompt" not in page_text(page)
    go_to(page, "Circuit")
    assert "ACDC" not in _value(page, "Method")
    choose(page, "Method", "ACDC")  # ACDC alone: no "top k" to pick
    assert page.locator("[data-testid=stNumberInput]", has=page.locator("label", has_text="Top k")).count() == 0
    no_exception(page)


# ---- state that stays -----------------------------------------------------------------------------------
def test_choices_survive_tab_and_page_switches(page):
    choose(page, "Layer", "1")
    choose(page, "Head", "2")
    choose(page, "Colour", "rank of the next token")
    page.get_by_role("tab", name="Every head").click()
    wait_idle(page)
    page.get_by_role("tab", name="One head").click()
    wait_idle(page)
    assert (_value(page, "Layer"), _value(page, "Head")) == ("1", "2")
    sync_api.expect(figure(page, "Attention L1H2")).to_be_visible()
    page.get_by_role("tab", name="Head scores").click()
    wait_idle(page)
    go_to(page, "Patch")
    radio(page, "the task's possession pairs")
    go_to(page, "Inspect")
    assert page.get_by_role("tab", name="Head scores").get_attribute("aria-selected") == "true"
    page.get_by_role("tab", name="One head").click()
    wait_idle(page)
    assert (_value(page, "Layer"), _value(page, "Head")) == ("1", "2")
    assert "rank of the next token" in _value(page, "Colour")
    go_to(page, "Patch")
    checked = page.locator("[data-testid=stRadio] label", has_text="possession pairs").locator("input")
    assert checked.first.is_checked()
    no_exception(page)


# ---- legible ---------------------------------------------------------------------------------------------
PAGES = ["Inspect", "Ablate", "Patch", "Steer", "Features", "Compare", "Build & train", "Sweeps", "Training",
         "Circuit", "Graph"]


def test_no_figure_text_overlaps_on_any_page(page):
    found, seen = [], 0
    for name in PAGES:
        if name != "Inspect":
            go_to(page, name)
        heading(page, name).wait_for()
        page.wait_for_timeout(500)  # plotly lays out its text after the script has finished
        seen += page.locator(".js-plotly-plot").count()
        found += [f"{name}: {line}" for line in overlaps(page)]
        if name == "Inspect":  # the lazy tabs' figures too
            for tab in ("Every head", "Head scores"):
                page.get_by_role("tab", name=tab).click()
                wait_idle(page)
                page.wait_for_timeout(500)
                seen += page.locator(".js-plotly-plot").count()
                found += [f"{name} ({tab}): {line}" for line in overlaps(page)]
    assert seen >= 15, f"only {seen} figures were drawn"
    assert not found, _summary(found)
