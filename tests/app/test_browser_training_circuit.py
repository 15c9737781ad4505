"""The Training and Circuit pages in Chromium: real clicks on the step slider, the run pickers,
the method selectboxes, the Run button and a node of a drawn circuit; figures checked to draw
pixels (``assert_drawn``) and screenshots saved in artifacts/.

The server, browser and click helpers are tests/app/browser_kit.py's (session fixtures). The
circuit tests use the small planted models and ACDC / EAP-IG with few prompts, so each test
stays well under a minute once the server is up.
"""

import pytest

from browser_kit import BROWSER_MARKS, assert_drawn, choose, figure, no_exception, shot, wait_idle, widget

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = BROWSER_MARKS


# ---- Training --------------------------------------------------------------------------------------
@pytest.mark.page("Training")
def test_training_slider_scrubs_the_snapshots(page):
    for title in ("head scores and loss over training", "Loss, step 1500 marked", "Head scores at step 1500",
                  "Attention L0H0 at step 1500", "Logit lens at step 1500"):
        assert_drawn(figure(page, title), title)
    slider = widget(page, "stSlider", "Step")
    thumb = slider.get_by_role("slider")
    thumb.scroll_into_view_if_needed()
    # A real click on the slider's track, a third of the way along: the thumb jumps there.
    track = slider.locator("[data-orientation=horizontal]").first.bounding_box()
    page.mouse.click(track["x"] + track["width"] / 3, track["y"] + track["height"] / 2)
    wait_idle(page)
    step = thumb.get_attribute("aria-valuetext")
    assert step not in (None, "1500"), step
    for title in (f"Head scores at step {step}", f"Loss, step {step} marked", f"Attention L0H0 at step {step}"):
        assert_drawn(figure(page, title), title)
    choose(page, "Layer", "1")  # a selectbox
    assert_drawn(figure(page, f"Attention L1H0 at step {step}"), "attention at the step, layer 1")
    no_exception(page)
    shot(page, "training-after-drag")


@pytest.mark.page("Training")
def test_training_without_snapshots_says_so(page):
    choose(page, "Run", "stories-2026")
    sync_api.expect(page.get_by_text("has no snapshots", exact=False).first).to_be_visible(timeout=60_000)
    assert page.locator(".js-plotly-plot").count() == 0
    no_exception(page)
    shot(page, "training-no-snapshots")


# ---- Circuit ----------------------------------------------------------------------------------------
@pytest.mark.page("Circuit")
def test_circuit_run_draws_both_methods_and_a_node_click_opens_it(page):
    assert_drawn(figure(page, "Known circuit of planted-iit-induction"), "the known circuit")
    choose(page, "Method", "ACDC")
    choose(page, "Compare with", "EAP-IG")
    page.get_by_role("button", name="Run", exact=True).click()  # the run button (progress bars while it runs)
    wait_idle(page)
    acdc = figure(page, "ACDC (greedy pruning): 5 edges")
    assert_drawn(acdc, "ACDC's circuit")
    assert_drawn(figure(page, "EAP-IG (integrated gradients)"), "EAP-IG's circuit")
    sync_api.expect(page.get_by_text("Edge AUROC against the known circuit", exact=False).first).to_be_visible()
    # A real click on a node: the nodes are the last scatter layer (embed, L0H2, L1H1, logits).
    acdc.scroll_into_view_if_needed()
    node = acdc.locator(".scatterlayer .trace").last.locator(".point").nth(2)
    box = node.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    page.mouse.move(x, y)
    page.wait_for_timeout(300)
    page.mouse.click(x, y)
    wait_idle(page)
    attention = figure(page, "Attention L1H1 on the first clean prompt")
    assert_drawn(attention, "the clicked node's attention")
    assert_drawn(figure(page, "direct attribution (L1H1 among them)"), "the clicked node's DLA")
    no_exception(page)
    shot(page, "circuit-node-L1H1")


@pytest.mark.page("Circuit")
def test_circuit_top_k_draws_edges_where_a_threshold_keeps_none(page):
    choose(page, "Method", "EAP")  # top k edges is the default (the box says EAP; the title the full name)
    page.get_by_role("button", name="Run", exact=True).click()
    wait_idle(page)
    eap = figure(page, "EAP (edge attribution patching): ")
    assert_drawn(eap, "EAP's top-k circuit")
    title = eap.locator(".gtitle").first.text_content()
    assert 0 < int(title.split(": ")[1].split(" ")[0]) <= 20, title
    page.locator("[data-testid=stMain] [data-testid=stRadio] label", has_text="score threshold").first.click()
    wait_idle(page)
    box = widget(page, "stNumberInput", "Threshold").locator("input").first
    box.fill("10")
    box.press("Enter")
    wait_idle(page)
    page.get_by_role("button", name="Run", exact=True).click()
    wait_idle(page)
    sync_api.expect(page.get_by_text("kept 0 edges", exact=False).first).to_be_visible(timeout=60_000)
    assert page.locator(".js-plotly-plot", has=page.locator(".gtitle", has_text="EAP (edge")).count() == 0
    no_exception(page)
    shot(page, "circuit-top-k")

@pytest.mark.page("Circuit")
def test_circuit_on_the_hand_built_model_and_induction_attn2l(page):
    choose(page, "Checkpoint", "planted-hand-induction")
    choose(page, "Method", "EAP-IG")
    page.get_by_role("button", name="Run", exact=True).click()
    wait_idle(page)
    assert_drawn(figure(page, "EAP-IG (integrated gradients)"), "EAP-IG on the hand-built model")
    choose(page, "Checkpoint", "induction-attn2l")
    assert_drawn(figure(page, "Known circuit of induction-attn2l: 53 edges"), "the shipped circuit.json")
    no_exception(page)
    shot(page, "circuit-induction-attn2l")
