"""Inspect with several prompts, one per line, in a real browser: the per-prompt table and the
figures over all prompts draw, and the prompt selector moves every per-prompt figure."""

import pytest

from browser_kit import (BROWSER_MARKS, IOI_MARY, IOI_TOM, assert_drawn, choose, figure, no_exception, set_prompt,
                         shot)

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = BROWSER_MARKS

SHORT = "Mary and John went to the park ."


def test_several_prompts_draw_over_all_and_the_selector_moves_the_figures(page):
    set_prompt(page, "\n".join([IOI_TOM, SHORT, IOI_MARY]))
    sync_api.expect(page.get_by_text("Over all 3 prompts")).to_be_visible(timeout=60_000)
    assert_drawn(figure(page, "Top-1 accuracy of the lens per layer"), "the lens over all prompts")
    assert_drawn(figure(page, "Head scores"), "head scores over all prompts")
    table = page.locator("[data-testid=stDataFrame]").first
    table.wait_for(state="visible")
    assert_drawn(table, "the per-prompt table", svg=False)
    length = page.locator("[data-testid=stMetric]", has_text="Prompt length").locator("[data-testid=stMetricValue]")
    sync_api.expect(length).to_have_text(f"{len(IOI_TOM.split())} tokens")
    sync_api.expect(figure(page, "direct attribution").locator(".gtitle")).to_contain_text("'Tom'")

    choose(page, "Prompt shown below", f"1: {SHORT}")
    sync_api.expect(length).to_have_text(f"{len(SHORT.split())} tokens", timeout=60_000)
    choose(page, "Prompt shown below", f"2: {IOI_MARY}")
    sync_api.expect(figure(page, "direct attribution").locator(".gtitle")).to_contain_text("'Mary'", timeout=60_000)
    for title in ("Attention L", "Logit lens", "Per-token loss", "Residual-stream norm"):
        assert_drawn(figure(page, title), title)
    no_exception(page)
    shot(page, "inspect-several-prompts")
