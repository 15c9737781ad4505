"""The app's round-three rules without a browser: when a patching gap is noise, how Sweeps splits
runs into panels, and default prompts that fit every shipped checkpoint's context."""

import pandas as pd
import pytest

from ui import common, patch, sweeps


def test_a_gap_within_twice_its_standard_error_is_noise_and_one_pair_uses_the_resolution():
    import statistics

    gaps = [-0.0059, -0.0072, -0.0088, 0.0041, 0.0110, -0.0006, 0.0126, 0.0042]  # possession-like
    gap, noise = patch.gap_and_noise(gaps, "logit_diff")
    assert gap == pytest.approx(statistics.fmean(gaps))
    assert noise == pytest.approx(max(0.01, 2 * statistics.stdev(gaps) / len(gaps) ** 0.5)) and abs(gap) <= noise
    gap, noise = patch.gap_and_noise([12.3, 13.6, 5.3, 12.2, 5.6, 9.0, 4.5, 9.7], "logit_diff")  # IOI-like
    assert abs(gap) > noise
    assert patch.gap_and_noise([0.0004], "prob") == (0.0004, 0.001)  # one pair: no spread to measure


def _run(name, layers, heads, methods=("zero", "mean")):
    return pd.DataFrame([dict(layer=l, head=h, method=m, delta=0.1 * l + 0.01 * h, run=name)
                         for l in range(layers) for h in range(heads) for m in methods])


def test_sweeps_put_each_run_and_method_in_its_own_panel_and_say_why():
    table = pd.concat([_run("a", 3, 4), _run("b", 2, 8)], ignore_index=True)
    shown, facet, note = sweeps.heatmap_panels(table)
    assert facet == "panel" and sorted(shown["panel"].unique()) == ["a · mean", "a · zero", "b · mean", "b · zero"]
    assert "never pooled" in note and "a: 3 layers x 4 heads, b: 2 layers x 8 heads" in note
    assert "Each cell is one row" in note
    one, facet, note = sweeps.heatmap_panels(_run("a", 3, 4))
    assert facet == "method" and "never pooled" not in note
    pooled, facet, note = sweeps.heatmap_panels(pd.concat([_run("a", 2, 2, ("zero",))] * 3, ignore_index=True))
    assert facet is None and "averages 3-3 rows" in note


def test_every_shipped_checkpoints_default_prompt_fits_its_context(checkpoints_dir):
    import workbench as wb
    from workbench.checkpoint import read_meta

    for path in sorted(p for p in checkpoints_dir.iterdir() if common.is_checkpoint(p)):
        model, tok = wb.load_checkpoint(path)
        ckpt = common.Checkpoint(path.name, str(path), 0, model, tok or common.IdTokenizer(model.cfg.d_vocab),
                                 read_meta(str(path)), None)
        ids = common.encode_prompt(ckpt, common.default_prompt(ckpt))  # raises "Shorten the prompt" otherwise
        assert 2 <= len(ids) <= model.cfg.n_ctx, path.name
    modular = checkpoints_dir / "planted-iit-modular"
    if modular.is_dir():
        model, _ = wb.load_checkpoint(modular)
        ckpt = common.Checkpoint("m", str(modular), 0, model, common.IdTokenizer(model.cfg.d_vocab),
                                 read_meta(str(modular)), None)
        a, plus, b, equals = (int(t) for t in common.default_prompt(ckpt).split())
        assert (plus, equals) == (17, 18) and 0 <= a < 17 and 0 <= b < 17  # "a + b =" of its task, p = 17


def test_serve_preloads_the_default_checkpoint_into_the_loader_the_pages_use(checkpoints_dir):
    from pathlib import Path

    from ui import serve

    line = serve.preload(["--checkpoints", str(checkpoints_dir)])
    assert "stories-2026" in line
    path = str(Path(checkpoints_dir / "stories-2026").resolve())
    loads = common.LOADS[path]
    assert loads >= 1
    common.load(path, name="stories-2026")  # what the first page does: found in the cache, not read again
    assert common.LOADS[path] == loads


def test_a_prompt_whose_attention_patterns_pass_the_budget_is_refused_with_its_limit(checkpoints_dir):
    """A 2,501-token prompt on SmolLM2-135M (30 layers x 9 heads, context 8,192) got the server killed for
    memory on Inspect; the app now refuses prompts whose every attention pattern would pass 1 GiB, naming
    the limit, and the shipped models keep their whole context."""
    from types import SimpleNamespace

    import workbench as wb

    cfg = SimpleNamespace(n_layers=30, n_heads=9, n_ctx=8192, d_vocab=100)
    ckpt = SimpleNamespace(cfg=cfg, tokenizer=common.IdTokenizer(100))
    limit = common.max_prompt_tokens(cfg)
    assert 4 * 30 * 9 * limit**2 <= common.PATTERN_BUDGET_BYTES < 4 * 30 * 9 * (limit + 1) ** 2
    assert limit == 997
    assert len(common.encode_prompt(ckpt, " ".join(["7"] * limit))) == limit
    with pytest.raises(ValueError, match=r"The prompt is 2,501 tokens; the app analyses at most 997 on this model.*"
                                         r"30 x 9 attention patterns alone would take 6\.3 GiB"):
        common.encode_prompt(ckpt, " ".join(["7"] * 2501))
    for path in sorted(p for p in checkpoints_dir.iterdir() if common.is_checkpoint(p)):
        model, _ = wb.load_checkpoint(path)
        assert common.max_prompt_tokens(model.cfg) == model.cfg.n_ctx, path.name
