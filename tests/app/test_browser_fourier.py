"""The shipped grokking run on the Training page in Chromium: picked in the run selectbox, its Fourier
progress measures drawn, and a real click on the step slider moving the embedding's Fourier norms."""

import pytest

from browser_kit import BROWSER_MARKS, assert_drawn, choose, figure, no_exception, shot, wait_idle, widget

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = BROWSER_MARKS


@pytest.mark.page("Training")
def test_the_grokking_run_opens_and_scrubs_on_the_training_page(page, checkpoints_dir):
    if not (checkpoints_dir / "modular-grokking" / "snapshots").is_dir():
        pytest.skip("checkpoints/modular-grokking is missing: scripts/make_grokking_checkpoint.py builds it")
    choose(page, "Run", "modular-grokking")
    assert_drawn(figure(page, "modular-grokking: losses over training, step 800 marked"), "the four losses")
    assert_drawn(figure(page, "Embedding norm per frequency at step 800"), "the Fourier norms at the last step")
    slider = widget(page, "stSlider", "Step")
    thumb = slider.get_by_role("slider")
    thumb.scroll_into_view_if_needed()
    track = slider.locator("[data-orientation=horizontal]").first.bounding_box()
    page.mouse.click(track["x"] + track["width"] / 4, track["y"] + track["height"] / 2)  # an early snapshot
    wait_idle(page)
    step = thumb.get_attribute("aria-valuetext")
    assert step not in (None, "800"), step
    assert_drawn(figure(page, f"Embedding norm per frequency at step {step}"), "the Fourier norms at the new step")
    no_exception(page)
    shot(page, "training-grokking")
