"""The app in a real browser: `streamlit run app.py` driven by Chromium, every page.

The server, the browser and the helpers that click are in browser_kit.py (session fixtures,
registered by conftest.py): one Streamlit server and one Chromium serve every browser test
module, each page's tests in its own module (test_browser_<page>.py) or here.

What AppTest cannot see is checked here: figures that really draw (a plotly div with an
SVG, pixels that are not all one colour), a click on a heatmap cell, a second sweep (a
cache hit replays what the cached function drew), a second browser session, and a
real click on each kind of control. Screenshots of every page land in artifacts/.
"""

import re

import pytest

from browser_kit import (ARTIFACTS, BROWSER_MARKS, IOI_MARY, IOI_TOM, assert_drawn, choose, click_cell, figure, go_to,
                         no_exception, open_app, pick, radio, run_sweep, set_prompt, shot, type_into, wait_idle, widget)

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
# slow: a real Streamlit server and browser; deselect with -m "not slow".
pytestmark = BROWSER_MARKS


# ---- Inspect -----------------------------------------------------------------------------------
def test_inspect_draws_in_light_and_dark_and_its_controls_respond(browser, server):
    for scheme in ("light", "dark"):
        tab = open_app(browser, server, "Inspect", scheme)
        try:
            for title in ("Attention L", "Logit lens", "Per-token loss", "direct attribution", "Residual-stream norm"):
                assert_drawn(figure(tab, title), title)
            no_exception(tab)
            assert "cannot encode" not in tab.inner_text("body")
            figure(tab, "Attention L").scroll_into_view_if_needed()
            tab.screenshot(path=str(ARTIFACTS / f"inspect-{scheme}.png"))
            figure(tab, "Logit lens").scroll_into_view_if_needed()
            tab.screenshot(path=str(ARTIFACTS / f"inspect-{scheme}-lens.png"))
            if scheme == "dark":
                continue
            choose(tab, "Layer", "1")  # a selectbox
            sync_api.expect(figure(tab, "Attention L1H0")).to_be_visible()
            radio(tab, "tuned lens")  # a radio
            assert_drawn(figure(tab, "Tuned lens"), "tuned lens")
            type_into(tab, "Wrong token", "")  # a text input: the answer's logit alone
            sync_api.expect(figure(tab, "direct attribution").locator(".gtitle")).to_contain_text("logit['Mary'] at")
            tab.get_by_role("tab", name="Every head").click()  # a tab
            wait_idle(tab)
            assert_drawn(figure(tab, "Attention patterns"), "every head")
            tab.get_by_role("tab", name="Head scores").click()
            wait_idle(tab)
            assert_drawn(figure(tab, "Head scores"), "head scores")
            no_exception(tab)
            shot(tab, "inspect-after-clicks")
        finally:
            tab.context.close()


def test_inspect_new_prompt_moves_the_attribution_target(page):
    """The DLA answer follows the prompt: after a new prompt of the same length, the title
    names the new prompt's answer, never the old one's."""
    set_prompt(page, IOI_TOM)  # a text area
    tokens = page.locator("[data-testid=stMetric]", has_text="Prompt length").locator("[data-testid=stMetricValue]")
    sync_api.expect(tokens).to_have_text(f"{len(IOI_TOM.split())} tokens", timeout=60_000)
    sync_api.expect(figure(page, "direct attribution").locator(".gtitle")).to_contain_text("'Tom'")
    set_prompt(page, IOI_MARY)
    title = figure(page, "direct attribution").locator(".gtitle")
    sync_api.expect(title).to_contain_text("'Mary'", timeout=60_000)
    assert "Tom" not in title.text_content()
    no_exception(page)


def test_an_upload_is_selected_in_the_picker(page, checkpoints_dir, tmp_path):
    import zipfile

    archive = tmp_path / "small.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in (checkpoints_dir / "stories-2020").iterdir():
            z.write(f, f"stories-2020/{f.name}")
    page.get_by_text("Upload a checkpoint").click()  # an expander
    page.locator("[data-testid=stFileUploader] input[type=file]").set_input_files(str(archive))  # a file uploader
    wait_idle(page)
    chosen = widget(page, "stSelectbox", "Checkpoint").get_by_role("combobox")
    sync_api.expect(chosen).to_have_value(re.compile(r"^upload: small"), timeout=60_000)
    sync_api.expect(page.locator("[data-testid=stAlertContentSuccess]")).to_contain_text("selected")
    assert_drawn(figure(page, "Per-token loss"), "the uploaded model's loss")
    no_exception(page)


# ---- Ablate ------------------------------------------------------------------------------------
@pytest.mark.page("Ablate")
def test_head_sweep_twice_and_in_a_second_session(page, browser, server):
    run_sweep(page)  # a button
    run_sweep(page)  # the second sweep is a cache hit: it must not replay the progress bar
    assert_drawn(figure(page, "when each head is ablated"), "sweep heatmap")
    other = open_app(browser, server, "Inspect")
    try:
        go_to(other, "Ablate")  # the sidebar's page radio
        run_sweep(other)  # another session, the same prompt: a hit in the shared cache
        assert_drawn(figure(other, "when each head is ablated"), "sweep heatmap, second session")
    finally:
        other.context.close()


@pytest.mark.page("Ablate")
def test_clicking_a_sweep_cell_ablates_that_head(page):
    run_sweep(page)
    heatmap = figure(page, "when each head is ablated")
    click_cell(page, heatmap, layer=1, head=2, n_layers=3, n_heads=4)  # a click on a plotly heatmap cell
    units = page.locator("[data-testid=stMultiSelect]", has_text="Units to ablate")
    sync_api.expect(units).to_contain_text("L1H2", timeout=60_000)
    sync_api.expect(page.locator("[data-testid=stMetric]", has_text="clean → ablated").first).to_be_visible()
    no_exception(page)
    shot(page, "ablate-after-click")


@pytest.mark.page("Ablate")
def test_ablate_controls_and_difference_views(page):
    pick(page, "Units to ablate", "L2H1")  # a multiselect
    pick(page, "Units to ablate", "L2H3")
    sync_api.expect(page.locator("[data-testid=stMetric]", has_text="logit['Mary'] − logit['John']")).to_be_visible()
    for title in ("clean − ablated", "Direct logit attribution: clean", "Per-token loss"):
        assert_drawn(figure(page, title), title)
    radio(page, "side by side")
    radio(page, "mean (over reference text)")
    choose(page, "Metric", "answer probability")
    sync_api.expect(page.locator("[data-testid=stMetric]", has_text="p('Mary')")).to_be_visible()
    type_into(page, "MLP neurons", "L0: 3, 17")
    no_exception(page)
    shot(page, "ablate")


# ---- Patch -------------------------------------------------------------------------------------
@pytest.mark.page("Patch")
def test_patch_page_draws_patching_and_attribution(page):
    for title in ("Patching resid_pre", "Patching each head", "Attribution patching"):
        assert_drawn(figure(page, title), title)
    slider = widget(page, "stSlider", "Pairs").locator("input[type=range]")
    slider.focus()
    slider.press("ArrowRight")  # a slider: 8 -> 9 pairs
    wait_idle(page)
    sync_api.expect(page.get_by_text("; 9 pairs.")).to_be_visible()
    radio(page, "two prompts typed here")
    # a corrupted prompt of another length: positions are aligned from each prompt's end
    type_into(page, "Corrupted prompt", "Mary and John went home .", testid="stTextArea")
    sync_api.expect(page.get_by_text("positions are counted from each prompt's end")).to_be_visible()
    assert_drawn(figure(page, "Patching each head"), "head patching of a pair of different lengths")
    no_exception(page)
    shot(page, "patch")


# ---- Compare -----------------------------------------------------------------------------------
@pytest.mark.page("Compare")
def test_compare_page_draws_both_models(page):
    assert_drawn(figure(page, "Training loss"), "loss curves")
    assert_drawn(figure(page, "Per-token loss"), "per-token loss")
    page.get_by_role("tab", name="Attention grids").click()
    wait_idle(page)
    assert page.locator(".js-plotly-plot", has=page.locator(".gtitle", has_text="Every head of")).count() == 2
    assert_drawn(figure(page, "Every head of"), "attention grid")
    choose(page, "Checkpoint B", "induction-attn2l")
    # A's untouched default prompt that B cannot read: B gets its own default, and a caption says why
    sync_api.expect(page.get_by_text("cannot read A's default prompt")).to_be_visible()
    no_exception(page)
    shot(page, "compare")


# ---- Build & train -----------------------------------------------------------------------------
@pytest.mark.page("Build & train")
def test_build_and_train_trains_in_the_background_and_saves(page, server):
    toggle = page.locator("[data-testid=stCheckbox] label", has_text="attn_only").first
    d_mlp = widget(page, "stNumberInput", "d_mlp").locator("input")
    was = d_mlp.is_disabled()
    toggle.click()  # a toggle
    wait_idle(page)
    sync_api.expect(d_mlp).to_be_disabled() if not was else sync_api.expect(d_mlp).to_be_enabled()
    for label, value in (("steps", "30"), ("batch size", "4"), ("sequence length", "16")):
        type_into(page, label, value, testid="stNumberInput")  # number inputs
    page.get_by_role("button", name="Train", exact=True).click()
    page.get_by_text("training, step").or_(page.get_by_text("Done:")).first.wait_for(timeout=60_000)
    go_to(page, "Sweeps")  # another page draws while the model trains
    no_exception(page)
    go_to(page, "Build & train")
    page.get_by_text("Done: 30 steps").wait_for(timeout=120_000)
    assert_drawn(figure(page, "Loss during training"), "training curve")
    type_into(page, "Save as", "browser-trained")
    page.get_by_role("button", name="Save").click()
    wait_idle(page)
    sync_api.expect(page.get_by_text("it is now in every checkpoint picker")).to_be_visible()
    assert (server["checkpoints"] / "browser-trained" / "model.safetensors").is_file()
    no_exception(page)
    shot(page, "build-train")


# ---- Sweeps ------------------------------------------------------------------------------------
@pytest.mark.page("Sweeps")
def test_sweeps_figures_are_not_blank(page):
    assert_drawn(figure(page, "delta by layer and head"), "the results as a heatmap")
    assert_drawn(figure(page, "Sweep figure"), "the run's plotly figure")
    choose(page, "Figure", "b_page.html")
    frame_el = page.locator("iframe").last
    frame_el.scroll_into_view_if_needed()
    frame = frame_el.content_frame
    frame.locator(".main-svg").first.wait_for(state="visible", timeout=60_000)
    assert frame.locator(".js-plotly-plot").count() == 2
    assert_drawn(frame_el, "the run's HTML page", svg=False)
    page.locator("[data-testid=stCheckbox] label", has_text="As a layer x head heatmap").first.click()
    wait_idle(page)
    sync_api.expect(page.get_by_text("each bar is their mean")).to_be_visible()
    no_exception(page)
    shot(page, "sweeps")
