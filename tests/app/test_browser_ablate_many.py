"""The Ablate page over a prompt set, in a real browser: a real click on the toggle, the task's
IOI prompts and then typed prompts of different lengths, the spread figure drawn each time."""

import pytest

from browser_kit import BROWSER_MARKS, assert_drawn, figure, no_exception, pick, radio, shot, type_into, wait_idle

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = BROWSER_MARKS


@pytest.mark.page("Ablate")
def test_ablate_averages_over_ioi_prompts_and_typed_prompts(page):
    pick(page, "Units to ablate", "L1H2")
    toggle = page.locator("[data-testid=stCheckbox], [data-testid=stToggle]",
                          has_text="Average the ablation over a prompt set").first
    toggle.scroll_into_view_if_needed()
    toggle.locator("label").first.click()
    wait_idle(page)
    assert_drawn(figure(page, "per prompt (16 prompts)"), "spread over the task's IOI prompts")
    radio(page, "prompts typed here, one per line")
    type_into(page, "Prompts, one per line",
              "When Mary and John went to the store , John gave a drink to\nTom went home .\nAnne and Bob talked .",
              testid="stTextArea")
    assert_drawn(figure(page, "per prompt (3 prompts)"), "spread over typed prompts of different lengths")
    sync_api.expect(page.locator("[data-testid=stCaptionContainer]", has_text="over 3 prompts")).to_be_visible()
    no_exception(page)
    shot(page, "ablate-prompt-set")
