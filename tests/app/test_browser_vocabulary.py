"""The vocabulary browser on Inspect's model card, in Chromium: search a token, select its row
in the table with a real click, and the direct-path and neighbour figures draw for it."""

import pytest
from browser_kit import BROWSER_MARKS, assert_drawn, figure, no_exception, radio, shot, type_into, wait_idle

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = BROWSER_MARKS


def test_select_a_token_and_see_its_direct_path_and_neighbours(page):
    page.get_by_text("Vocabulary browser").click()
    wait_idle(page)
    type_into(page, "Find a token", "Mary")
    grid = page.locator("[data-testid=stDataFrame]").last
    grid.scroll_into_view_if_needed()
    box = grid.bounding_box()
    # glide-data-grid draws on a canvas: the first row's selection box sits under the header row
    page.mouse.click(box["x"] + 18, box["y"] + 35 + 17)
    wait_idle(page)
    path = figure(page, "Direct path after 'Mary'")
    sync_api.expect(path).to_be_visible(timeout=60_000)
    assert_drawn(path, "direct path")
    assert_drawn(figure(page, "Nearest tokens to 'Mary' (embedding)"), "neighbours")
    radio(page, "unembedding")  # a second click on the same section
    assert_drawn(figure(page, "Nearest tokens to 'Mary' (unembedding)"), "neighbours by unembedding")
    no_exception(page)
    shot(page, "vocabulary")
