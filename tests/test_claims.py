"""The documented claims that were corrected, checked against what they claim (docs/reference/).

Each runs the quick form of a script under scripts/ that remeasures a results table, or checks
the claim itself against an independent computation.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

import workbench as wb

ROOT = Path(__file__).resolve().parents[1]


def _script(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_ce_recovered_baseline_is_a_uniform_predictor_on_the_bias_free_stories_model():
    # The dictionary table's zero-ablated loss (4.727) is ln(d_vocab): zeroing blocks.1.hook_resid_post
    # of a model without biases leaves every logit at 0.
    model, _ = wb.load_checkpoint("checkpoints/stories-2026")
    assert not model.cfg.bias and not getattr(model.cfg, "qkv_bias", False)
    tokens = torch.randint(0, model.cfg.d_vocab, (4, 32), generator=torch.Generator().manual_seed(0))
    zero = [("blocks.1.hook_resid_post", lambda x, hook: torch.zeros_like(x))]
    logits = model.run_with_hooks(tokens, fwd_hooks=zero)
    assert logits.abs().max() < 1e-6
    loss = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=zero)
    assert abs(loss.item() - math.log(model.cfg.d_vocab)) < 1e-5
    assert f"{math.log(model.cfg.d_vocab):.3f}" in (ROOT / "docs/reference/dictionaries.md").read_text()


def test_planted_docstring_says_what_circuit_json_records():
    import workbench.planted as planted

    meta = json.loads((ROOT / "checkpoints/induction-attn2l/circuit.json").read_text())
    doc = " ".join(planted.__doc__.split())
    assert meta["method"] == "acdc" and "ACDC" in doc and "5%" not in doc
    assert f"threshold {meta['meta']['threshold']}" in doc
    assert f"{meta['meta']['batch']} prompts of seed 1000" in doc and "seed 1000" in meta["meta"]["planted"]["established_by"]
    assert f"{len(meta['edges'])} of {meta['model']['graph']['n_edges']} edges" in doc


def test_the_two_induction_scores_coincide_without_repeats_and_part_with_them():
    from workbench import analysis as an
    from workbench.data import get_task
    from workbench.data.induction import induction_scores

    model, _ = wb.load_checkpoint("checkpoints/induction-attn2l")
    gen = torch.Generator().manual_seed(0)
    r = torch.stack([torch.randperm(model.cfg.d_vocab, generator=gen)[:16] for _ in range(8)])
    distinct = torch.cat([r, r], dim=1)
    a = an.head_scores(model, distinct, kinds=["induction"]).score.to_numpy()
    b = induction_scores(model, distinct).score.to_numpy()
    assert abs(a - b).max() < 1e-5
    tokens = get_task("induction").repeated_tokens(32, 32)  # r of 32 from 64 ids: repeats within r
    a = an.head_scores(model, tokens, kinds=["induction"]).score.to_numpy()
    b = induction_scores(model, tokens).score.to_numpy()
    assert 0.05 < abs(a - b).max() < 0.2  # documented: 0.136


def test_induction_claims_script_measures_the_documented_ranges():
    out = _script("scripts/induction_claims.py", "--check")
    assert "every documented claim holds" in out
    page = (ROOT / "docs/reference/checkpoints.md").read_text()
    assert "1.19-1.32 over six prompt sets" in page and "0.29-0.34" in page


def test_phase_change_table_is_measured_again():
    out = _script("scripts/phase_change.py", "--check", "--threads", "1")
    assert re.search(r"(\d+) of \1 documented rows measured again", out), out[-2000:]


def test_shipped_dictionary_features_are_measured_again():
    out = _script("scripts/make_dictionaries.py", "--check-only")
    assert " ok " in out or "ok   feature" in out
