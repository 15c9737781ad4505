"""An MLA model (multi-head latent attention) built, trained and analysed in Chromium.

Real clicks on the Build & train page choose attention = "mla" (its latent widgets appear, the
KV-head count is disabled), train a few steps in the background and save the model; then the
analysis pages open it from the checkpoint picker and draw every figure with no exception.
MLA has no W_K/W_V of its own (keys and values are read up from the latent), so this is where
an analysis that reaches for them would show it.
"""

import pytest

from browser_kit import (BROWSER_MARKS, assert_drawn, choose, figure, go_to, no_exception, run_sweep, shot, type_into,
                         wait_idle, widget)

from workbench.data import describe_tasks

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = BROWSER_MARKS

NAME = "browser-mla"


@pytest.mark.page("Build & train")
def test_mla_model_builds_trains_and_opens_on_the_analysis_pages(page, server):
    choose(page, "Task", f"stories: {describe_tasks()['stories']}")  # a real tokenizer for the analysis prompts
    choose(page, "attention", "mla")
    for name in ("kv_lora_rank", "qk_rope_head_dim", "q_lora_rank"):  # MLA's own widgets appear
        sync_api.expect(widget(page, "stNumberInput", name)).to_be_visible()
    sync_api.expect(widget(page, "stNumberInput", "n_kv_heads").locator("input")).to_be_disabled()
    type_into(page, "q_lora_rank", "8", testid="stNumberInput")  # with query compression
    for label, value in (("steps", "20"), ("batch size", "4"), ("sequence length", "16")):
        type_into(page, label, value, testid="stNumberInput")
    sync_api.expect(page.get_by_text("This combination is not a valid model")).to_have_count(0)
    page.get_by_role("button", name="Train", exact=True).click()
    page.get_by_text("Done: 20 steps").or_(page.get_by_text("Training stopped")).first.wait_for(timeout=180_000)
    no_exception(page)
    sync_api.expect(page.get_by_text("Training stopped")).to_have_count(0)
    assert_drawn(figure(page, "Loss during training"), "training curve")
    type_into(page, "Save as", NAME)
    page.get_by_role("button", name="Save").click()
    wait_idle(page)
    sync_api.expect(page.get_by_text("it is now in every checkpoint picker")).to_be_visible()
    assert (server["checkpoints"] / NAME / "model.safetensors").is_file()
    shot(page, "mla-build-train")

    go_to(page, "Inspect")
    choose(page, "Checkpoint", NAME)
    for title in ("Attention L", "Logit lens", "Per-token loss", "direct attribution", "Residual-stream norm"):
        assert_drawn(figure(page, title), f"{title} of the MLA model")
    no_exception(page)
    for tab, title in (("Every head", "Attention patterns"), ("Head scores", "Head scores")):
        page.get_by_role("tab", name=tab).click()
        wait_idle(page)
        assert_drawn(figure(page, title), f"{title} of the MLA model")
    no_exception(page)
    shot(page, "mla-inspect")

    go_to(page, "Ablate")
    choose(page, "Checkpoint", NAME)
    run_sweep(page)  # ablates every head of the MLA model in turn
    assert_drawn(figure(page, "when each head is ablated"), "the MLA model's head sweep")
    no_exception(page)
    shot(page, "mla-ablate")
