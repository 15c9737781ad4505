"""The first page's analyses (issue 37 item 6, issue 35's first page on the real model): Inspect's
per-prompt analyses share one forward (``workbench.analysis.one_forward``), equal to each analysis
run alone; the first Inspect run makes one forward where it made five. The preload computing them
before the first session is checked in test_issue37_units.py (a fresh process).
"""

import json

import numpy as np
import pandas as pd
import pytest
import torch

import workbench as wb
from workbench import analysis as an
from workbench.analysis.shared import inspect_hooks, one_forward
from workbench.checkpoint import read_meta
from ui import common


def _forward_counter(model):
    """A list that grows by one on every forward of ``model`` (run_with_cache included); its handle."""
    calls = []
    return calls, model.register_forward_pre_hook(lambda module, args: calls.append(1))


def _inspect_analyses(model, tokens, meta) -> dict:
    """The six analyses Inspect's first run shows for one prompt, with the page's arguments."""
    pos = tokens.shape[1] - 1
    out = {"losses": an.token_losses(model, tokens), "patterns": an.attention_patterns(model, tokens),
           "norms": an.residual_norms(model, tokens), "lens": an.logit_lens(model, tokens, k=3),
           "suggestion": an.suggest_answer(model, tokens, pos=pos, meta=meta)}
    if model.cfg.norm_placement == "pre":
        s = out["suggestion"]
        out["dla"] = an.direct_logit_attribution(model, tokens, answer=s["answer"], wrong=s["wrong"], pos=pos)
    return out


def assert_same_table(alone: pd.DataFrame, shared: pd.DataFrame, what: str) -> None:
    """Same columns, rows and labels; floats equal to float32 rounding. A forward that caches the
    attention pattern or the final norm's scale takes the explicit kernels, not the fused ones an
    unhooked forward takes: up to 2.1e-6 apart (relative to max(|x|, 1)) on the shipped checkpoints."""
    assert list(alone.columns) == list(shared.columns) and len(alone) == len(shared), what
    for column in alone.columns:
        a, b = alone[column].to_numpy(), shared[column].to_numpy()
        if pd.api.types.is_float_dtype(alone[column]):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, equal_nan=True, err_msg=f"{what}.{column}")
        else:
            assert (a == b).all(), f"{what}.{column}"


@pytest.mark.parametrize("name", ["stories-2026", "induction-attn2l"])
def test_one_forward_gives_every_inspect_analysis_from_one_run(checkpoints_dir, name):
    path = checkpoints_dir / name
    model, tok = wb.load_checkpoint(path)
    if tok is None:
        model.tokenizer = common.IdTokenizer(model.cfg.d_vocab)
    meta = read_meta(str(path))
    ckpt = common.Checkpoint(name, str(path), 0, model, model.tokenizer, meta, None)
    tokens = torch.tensor([common.encode_prompt(ckpt, common.default_prompt(ckpt))])
    calls, handle = _forward_counter(model)
    try:
        alone = _inspect_analyses(model, tokens, meta)
        separate = len(calls)
        calls.clear()
        shared = one_forward(model, tokens, inspect_hooks(model))
        together = _inspect_analyses(shared, tokens, meta)
        assert (len(calls), shared.forwards) == (1, 1) and separate >= 4
        assert together["suggestion"] == alone["suggestion"]
        for what in alone.keys() - {"suggestion"}:
            assert_same_table(alone[what], together[what], what)
        # anything else goes to the model: other tokens, a hook the run did not cache, another option
        shared(tokens[:, :-1])
        shared.run_with_cache(tokens, names_filter="blocks.0.attn.hook_q")
        shared(tokens, return_type="loss")
        assert len(calls) == 4 and shared.forwards == 1
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="no hook point named"):
        one_forward(model, tokens, ["blocks.99.hook_resid_pre"])


def test_the_first_inspect_run_makes_one_forward(app, checkpoints_dir):
    """Inspect's first run on a prompt no analysis has seen: one forward of the model (it made five:
    the loss, the attention, the norms, the lens and the attribution each ran their own), and what
    the page cached equals each analysis run alone."""
    path = str((checkpoints_dir / "stories-2026").resolve())
    key = (path, common.weights_stamp(path))
    model, _, meta, _ = common._load(*key, common.app_device())
    common.analysis.clear()  # nothing cached from an earlier test: every analysis is computed
    calls, handle = _forward_counter(model)
    try:
        at = app("Inspect")
    finally:
        handle.remove()
    assert len(calls) == 1
    ids = tuple(model.tokenizer.encode(at.text_area(key="prompt").value))
    with torch.no_grad():
        alone = _inspect_analyses(model, torch.tensor([ids]), meta)
    cached = {"losses": common.analysis(an.token_losses, key, ids),
              "patterns": common.analysis(an.attention_patterns, key, ids),
              "norms": common.analysis(an.residual_norms, key, ids),
              "lens": common.analysis(an.logit_lens, key, ids, ablation=(), reference=None, k=3)}
    for what, table in cached.items():
        assert_same_table(alone[what], table, what)


def test_a_sessions_first_run_sends_plotly_warm_figure_first_and_takes_it_away(app):
    """The browser loads plotly.js (4.7 MB) only when a figure arrives: under ``streamlit run`` a
    session's first run sends a 10-pixel figure before anything heavy (the imports), so Chromium loads
    plotly.js while the script works, and removes it once the page is drawn. Later runs send none. Under
    ui.serve too: there the figure waits for the preload's pandas and plotly (``serve.wait_for_light``; a
    figure built while that thread imported pandas found it half-imported), not for torch."""
    head = (common.REPO / "app.py").read_text().split("serve.wait_for_preload()")[0]
    assert "_plotly_warm.plotly_chart(WARM_FIGURE" in head and "import torch" not in head
    assert -1 < head.index("serve.wait_for_light()") < head.index("_plotly_warm.plotly_chart(")
    at = app("Inspect")
    assert at.session_state["_plotly_warmed"] is True
    specs = [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]
    assert len(specs) == 7 and all(spec["layout"].get("height") != 10 for spec in specs)  # Inspect's own, no more
    at.run()
    assert len(at.get("plotly_chart")) == 7
