"""The Steer and Features pages in a real browser (the server, Chromium and click helpers of browser_kit.py).

A real click or keypress on each kind of control the pages have (radio, selectbox, slider,
text area, text input, toggle, expander, file uploader), the figures drawn with pixels, a
second change of the same control (a cache hit must draw as the first run did), and a
screenshot of each page in artifacts/.
"""

import pytest

import re

from browser_kit import BROWSER_MARKS, assert_drawn, choose, figure, no_exception, shot, type_into, wait_idle, widget

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = BROWSER_MARKS


def continuations(page) -> list[str]:
    return [c.inner_text() for c in page.locator("[data-testid=stMain] [data-testid=stCode]").all()]


def radio(page, option: str) -> None:
    """A radio option of the page itself, matched whole ("ablate" is also a page in the sidebar)."""
    page.locator("[data-testid=stMain] [data-testid=stRadio] label", has_text=re.compile(rf"^{option}$")).first.click()
    wait_idle(page)


def slide(page, label: str, key: str) -> None:
    """A slider: a click on its thumb (which focuses it), then a key (Home, End, ArrowLeft, ...)."""
    thumb = widget(page, "stSlider", label).locator("[data-testid=stSliderThumbValue]").locator("..").first
    thumb.scroll_into_view_if_needed()
    thumb.click()
    page.keyboard.press(key)
    wait_idle(page)


def pick_feature(page, feature: int) -> None:
    """The feature selectbox: click it, type the feature's id, take the match."""
    box = widget(page, "stSelectbox", "Feature")
    box.scroll_into_view_if_needed()
    box.click()
    page.keyboard.type(f"#{feature} ")
    page.get_by_role("option", name=f"#{feature} ·").first.click()
    wait_idle(page)


@pytest.mark.page("Steer")
def test_steer_controls_and_figures(page):
    projection = figure(page, "Projection on the direction")
    assert_drawn(projection, "projection")
    clean, steered = continuations(page)
    assert clean != steered
    slide(page, "Scale", "Home")  # -20: the other way
    no_exception(page)
    assert continuations(page)[1] != steered
    slide(page, "Scale", "End")  # a second change of the same control
    slide(page, "Scale", "Home")  # back to a value drawn before: a cache hit
    assert_drawn(figure(page, "Projection on the direction"), "projection after a cache hit")
    radio(page, "ablate")  # a radio
    assert_drawn(figure(page, "Projection on the direction"), "projection, ablate")
    choose(page, "Layer", "2")  # a selectbox
    sync_api.expect(page.get_by_text("blocks.2.hook_resid_post").first).to_be_visible()
    box = widget(page, "stTextArea", "Negative prompts").locator("textarea").first  # a text area
    box.fill(widget(page, "stTextArea", "Positive prompts").locator("textarea").first.input_value())
    box.press("Control+Enter")
    wait_idle(page)
    sync_api.expect(page.get_by_text("same mean activation").first).to_be_visible()
    no_exception(page)
    shot(page, "steer-zero-direction")


@pytest.mark.page("Steer")
def test_steer_with_a_probe_and_an_uploaded_direction(page, server, tmp_path):
    import workbench as wb
    from workbench import analysis as an

    radio(page, "a probe trained here")
    assert_drawn(figure(page, "Projection on the direction"), "projection of the probe's direction")
    type_into(page, "Tokens labelled 1", "zebra")  # a text input
    sync_api.expect(page.get_by_text("one class only").first).to_be_visible()
    radio(page, "a saved direction")
    sync_api.expect(page.get_by_text("No saved directions in").first).to_be_visible()
    model, tok = wb.load_checkpoint(server["checkpoints"] / "stories-2026")
    stem = an.Direction.from_weight(model, "W_U", tok.encode(" John")[0], "blocks.2.hook_resid_post").save(
        tmp_path / "john")
    uploader = page.locator("[data-testid=stMain] [data-testid=stFileUploader] input[type=file]")
    uploader.set_input_files([str(stem) + ".json"])  # a file uploader: half a direction first
    wait_idle(page)
    sync_api.expect(page.get_by_text("a direction is two files").first).to_be_visible()
    uploader = page.locator("[data-testid=stMain] [data-testid=stFileUploader] input[type=file]")
    uploader.set_input_files([str(stem) + ".json", str(stem) + ".safetensors"])  # then the pair
    wait_idle(page)
    sync_api.expect(widget(page, "stSelectbox", "Saved direction").get_by_role("combobox")).to_have_value(
        re.compile(r"^upload: john \("), timeout=60_000)
    assert_drawn(figure(page, "Projection on the direction"), "projection of the uploaded direction")
    no_exception(page)
    shot(page, "steer-uploaded")


@pytest.mark.page("Steer")
def test_steer_downloads_a_built_direction_and_uploads_it_back(page, server, tmp_path):
    import workbench as wb
    from workbench import analysis as an

    button = page.get_by_role("button", name="Download this direction (.zip)")
    button.scroll_into_view_if_needed()
    with page.expect_download() as download:  # a real click: the browser receives the file
        button.click()
    path = tmp_path / download.value.suggested_filename
    download.value.save_as(path)
    assert path.name == "stories-2026-contrastive-blocks.1.hook_resid_post.zip"
    model, _ = wb.load_checkpoint(server["checkpoints"] / "stories-2026")
    direction = an.Direction.from_bytes(path.read_bytes()).check(model)
    assert direction.hook == "blocks.1.hook_resid_post" and direction.provenance["kind"] == "contrastive"
    radio(page, "a saved direction")  # then the same file through the page's own upload
    uploader = page.locator("[data-testid=stMain] [data-testid=stFileUploader] input[type=file]")
    uploader.set_input_files([str(path)])
    wait_idle(page)
    sync_api.expect(widget(page, "stSelectbox", "Saved direction").get_by_role("combobox")).to_have_value(
        re.compile(r"^upload: stories-2026-contrastive-blocks\.1\.hook_resid_post \("), timeout=60_000)
    assert_drawn(figure(page, "Projection on the direction"), "projection of the downloaded direction, uploaded")
    sync_api.expect(page.get_by_text("contrastive direction at").first).to_be_visible()
    no_exception(page)
    shot(page, "steer-download-upload")

@pytest.mark.page("Features")
def test_features_card_search_and_interventions(page):
    for title in ("max-activating contexts", "activations when firing", "logit effects", "activation along the prompt",
                  "direct attribution"):
        assert_drawn(figure(page, title), title)
    pick_feature(page, 206)
    sync_api.expect(figure(page, "Feature 206: max-activating contexts")).to_be_visible()
    clean, ablated = continuations(page)
    assert clean.startswith("Mary") and ablated.startswith("John")
    type_into(page, "Fires on the token", "to")
    sync_api.expect(page.get_by_text("features fire on 'to'").first).to_be_visible()
    page.locator("[data-testid=stMain] label", has_text="Largest first").first.click()  # a toggle
    wait_idle(page)
    page.get_by_text("Density of every feature").click()  # an expander
    wait_idle(page)
    assert_drawn(figure(page, "Feature density"), "density histogram")
    radio(page, "steer with this feature")
    assert_drawn(figure(page, "Projection on the direction"), "feature steering projection")
    slide(page, "Scale", "ArrowLeft")
    slide(page, "Scale", "ArrowLeft")  # a second change
    no_exception(page)
    radio(page, "ablate this feature")
    # the steering mode's continuation stays on screen until the ablation's replaces it: wait for that one
    sync_api.expect(page.locator("[data-testid=stMain] [data-testid=stCode]").nth(1)).to_have_text(
        re.compile(r"^\s*John"), timeout=60_000)
    page.locator("[data-testid=stMain] label", has_text="Per-token loss of the prompt").first.click()  # a toggle
    wait_idle(page)
    assert_drawn(figure(page, "Per-token loss, clean and ablated"), "per-token loss")
    no_exception(page)
    shot(page, "features")
