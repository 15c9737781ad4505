"""The Steer and Features pages under Streamlit's AppTest, on the shipped stories-2026 and its dictionary.

What the pages show is checked against the library run directly (the steered continuation is
``model.generate`` inside ``model.steer``; the ablated one inside ``feature_edit``); widgets
change what is drawn; bad input (a zero direction, a direction from another model or width,
a dictionary of another width, a token that never occurs) is a message in the page; and no
widget reloads the model.
"""

import base64
import json
import shutil

import numpy as np

import pytest
import torch

import workbench as wb
from ui import common
from ui.steer import DEFAULT_NEGATIVE, DEFAULT_POSITIVE
from workbench import analysis as an

DEFAULT = "stories-2026"
DICTIONARY = "resid-post-1"


def titles(at) -> list[str]:
    out = []
    for chart in at.get("plotly_chart"):
        title = json.loads(chart.proto.spec).get("layout", {}).get("title", {})
        out.append(title.get("text", "") if isinstance(title, dict) else str(title))
    return out


def figure(at, part: str) -> dict:
    for chart, title in zip(at.get("plotly_chart"), titles(at)):
        if part in title:
            return json.loads(chart.proto.spec)
    raise AssertionError(f"no figure titled *{part}* among {titles(at)}")


def messages(at) -> str:
    return " | ".join(str(e.value) for e in [*at.warning, *at.error, *at.info])


def values(array) -> list:
    """A figure's array as plotly serialises it: a list, or a typed array {dtype, bdata (base64)}."""
    if isinstance(array, dict):
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=array["dtype"]).tolist()
    return list(array)


def continuations(at) -> list[str]:
    return [c.value for c in at.code]


@pytest.fixture(scope="module")
def shipped(checkpoints_dir):
    model, tok = wb.load_checkpoint(checkpoints_dir / DEFAULT)
    return model, tok


def _ids(tok, lines: str) -> list[list[int]]:
    return [tok.encode(line) for line in lines.splitlines()]


# ---- Steer ---------------------------------------------------------------------------------------
def test_steer_shows_clean_and_steered_continuations_of_the_library(app, shipped):
    at = app("Steer")
    assert not at.warning and not at.error, messages(at)
    model, tok = shipped
    prompt = torch.tensor([tok.encode(common.DEFAULT_PROMPT)])
    direction = an.steering_vector(model, _ids(tok, DEFAULT_POSITIVE), _ids(tok, DEFAULT_NEGATIVE),
                                   "blocks.1.hook_resid_post")
    n = at.slider(key="steer_new").value
    # the default scale puts 0.75 x the stream's median norm at the hook on the prompt (s = 8 moved nothing
    # on SmolLM2-135M): read independently, within the slider's step
    _, cache = model.run_with_cache(prompt, names_filter=direction.hook)
    share = at.slider(key="steer_scale_add").value * direction.vector.norm() / cache[direction.hook][0].norm(dim=-1).median()
    assert abs(float(share) - 0.75) < 0.02, float(share)
    clean = model.generate(prompt, max_new_tokens=n)[0, prompt.shape[1]:]
    with model.steer(direction, at.slider(key="steer_scale_add").value):
        steered = model.generate(prompt, max_new_tokens=n)[0, prompt.shape[1]:]
    assert continuations(at) == [tok.decode(clean.tolist()), tok.decode(steered.tolist())]
    assert continuations(at)[0] != continuations(at)[1], "the default steering should change the continuation"
    projection = figure(at, "Projection on the direction")
    assert [t["name"] for t in projection["data"]] == ["clean", "steered"]
    assert len(values(projection["data"][0]["y"])) == prompt.shape[1] + n
    assert any(m.label == "Mean loss of the prompt, clean → steered" for m in at.metric)


def test_steer_widgets_change_the_run_but_never_reload_the_model(app, shipped):
    at = app("Steer")
    loads = sum(common.LOADS.values())
    at.slider(key="steer_scale_add").set_value(0.0).run()
    clean, steered = continuations(at)
    assert clean == steered, "adding zero times the vector changes nothing"
    at.radio(key="steer_mode").set_value("ablate").run()
    assert at.slider(key="steer_scale_ablate").value == 1.0
    at.slider(key="steer_new").set_value(5).run()
    n_prompt = len(shipped[1].encode(common.DEFAULT_PROMPT))
    assert len(values(figure(at, "Projection")["data"][0]["y"])) == n_prompt + 5
    at.selectbox(key="steer_c_layer").set_value(2).run()
    at.radio(key="steer_read").set_value("mean over the tokens").run()
    assert "blocks.2.hook_resid_post" in " ".join(c.value for c in at.caption)
    assert not at.exception and not at.error, messages(at)
    assert sum(common.LOADS.values()) == loads, "a widget change reloaded the model"


def test_steer_downloads_the_direction_it_built_as_a_zip_the_library_reads(app, shipped, monkeypatch):
    import streamlit as st

    sent = {}  # what the page hands to the download button, by file name
    original = st.download_button

    def spy(label, data, file_name=None, *args, **kwargs):
        sent[file_name] = data
        return original(label, data, file_name, *args, **kwargs)

    monkeypatch.setattr(st, "download_button", spy)
    model, tok = shipped
    at = app("Steer")
    assert not at.exception
    name = f"{DEFAULT}-contrastive-blocks.1.hook_resid_post.zip"
    assert list(sent) == [name] and at.get("download_button")[0].label == "Download this direction (.zip)"
    back = an.Direction.from_bytes(sent[name])
    direction = an.steering_vector(model, _ids(tok, DEFAULT_POSITIVE), _ids(tok, DEFAULT_NEGATIVE),
                                   "blocks.1.hook_resid_post")
    torch.testing.assert_close(back.vector, direction.vector)
    assert back.hook == direction.hook and back.provenance == json.loads(json.dumps(direction.provenance))
    back.check(model)  # made on this model: the page takes it back
    sent.clear()
    at.radio(key="steer_source").set_value("a probe trained here").run()
    assert [n for n in sent if "-probe-" in n] and an.Direction.from_bytes(next(iter(sent.values()))).check(model)
    sent.clear()
    at.radio(key="steer_source").set_value("a saved direction").run()
    assert not sent and not at.get("download_button")  # nothing made here to download

def test_steer_refuses_a_zero_direction_and_unreadable_lines(app):
    at = app("Steer")
    at.text_area(key="steer_negative").set_value(DEFAULT_POSITIVE).run()
    assert "same mean activation" in messages(at) and not at.code
    at.text_area(key="steer_negative").set_value("").run()
    assert "The negative box is empty" in messages(at)
    at.text_area(key="steer_negative").set_value("When Mary and John went to the zeppelin").run()
    assert "Negative line 1" in messages(at) and "zeppelin" in messages(at)
    assert not at.exception


def test_steer_with_a_saved_direction_and_bad_files(app, shipped, checkpoints_dir, tmp_path, monkeypatch):
    model, tok = shipped
    folder = tmp_path / "directions"
    an.Direction.from_weight(model, "W_U", tok.encode(" Mary")[0], "blocks.2.hook_resid_post").save(folder / "mary")
    other, _ = wb.load_checkpoint(checkpoints_dir / "stories-2020")
    an.Direction.from_weight(other, "W_U", 3, "blocks.2.hook_resid_post").save(folder / "other_model")
    an.Direction(torch.ones(112), "blocks.0.hook_resid_post").save(folder / "narrow")
    from safetensors.torch import save_file  # a zero vector, written by hand: Direction refuses to make one

    save_file({"vector": torch.zeros(128)}, str(folder / "zero.safetensors"))
    (folder / "zero.json").write_text(json.dumps({"format_version": 1, "hook": "blocks.1.hook_resid_post",
                                                  "shape": [128], "provenance": {"kind": "custom"}}))
    monkeypatch.setenv("WORKBENCH_DIRECTIONS", str(folder))
    at = app("Steer")
    at.radio(key="steer_source").set_value("a saved direction").run()
    options = at.selectbox(key="steer_file").options
    assert [o.split(" ")[0] for o in options] == ["mary", "narrow", "other_model", "zero"]
    at.selectbox(key="steer_file").set_value(next(o for o in options if o.startswith("mary"))).run()
    assert not at.error, messages(at)
    assert len(continuations(at)) == 2 and "weight_row" in " ".join(c.value for c in at.caption)
    at.selectbox(key="steer_file").set_value(next(o for o in options if o.startswith("narrow"))).run()
    assert "`narrow` cannot steer this model" in messages(at) and "112 wide" in messages(at)
    at.selectbox(key="steer_file").set_value(next(o for o in options if o.startswith("other_model"))).run()
    assert "made on model 'stories-2020'" in messages(at)
    at.selectbox(key="steer_file").set_value(next(o for o in options if o.startswith("zero"))).run()
    assert "`zero` cannot steer this model" in messages(at) and "zero vector" in messages(at)
    assert not at.exception


def test_steer_without_saved_directions_says_where_it_looked(app, monkeypatch):
    monkeypatch.delenv("WORKBENCH_DIRECTIONS", raising=False)
    at = app("Steer")
    at.radio(key="steer_source").set_value("a saved direction").run()
    assert "No saved directions in" in messages(at) and f"{DEFAULT}/directions" in messages(at)


def test_steer_with_a_probe_trained_in_the_page(app):
    at = app("Steer")
    at.radio(key="steer_source").set_value("a probe trained here").run()
    assert not at.error, messages(at)
    results = at.dataframe[0].value
    assert list(results.layer) == [0, 1, 2] and (results.auc > 0.9).all(), results
    assert "probe direction" in " ".join(c.value for c in at.caption)
    assert len(continuations(at)) == 2
    at.text_input(key="steer_probe_words").set_value("zebra").run()
    assert "one class only" in messages(at)
    at.text_input(key="steer_probe_words").set_value(" , ").run()
    assert "words is empty" in messages(at)
    assert not at.exception


# ---- Features ----------------------------------------------------------------------------------------
def test_features_page_draws_the_card_of_the_first_feature(app):
    at = app("Features")
    assert not at.warning and not at.error, messages(at)
    assert at.selectbox(key="feat_dict").value == DICTIONARY
    feature = at.selectbox(key="feat_id").value
    shown = " ".join(titles(at))
    for part in (f"Feature {feature}: max-activating contexts", f"Feature {feature}: activations when firing",
                 f"Feature {feature}: logit effects", f"Feature {feature}'s activation along the prompt",
                 "Features' direct attribution"):
        assert part in shown, (part, titles(at))
    contexts = figure(at, "max-activating contexts")["data"][0]
    assert any("[[" in cell for row in contexts["text"] for cell in row), "the activating token is highlighted"
    # Sorted by density, largest first; the card opens on a listed feature (the one most active on the
    # prompt: test_issue37_units.py checks which).
    table = at.dataframe[0].value
    assert table.density.is_monotonic_decreasing and feature in set(table.feature)


def test_feature_206_ablated_and_steered_as_the_library_says(app, shipped, checkpoints_dir):
    """206 is the README's "to where the indirect object is due": zeroing it flips the answer."""
    model, tok = shipped
    sae = an.load_dictionary(checkpoints_dir / DEFAULT / "saes" / DICTIONARY)
    at = app("Features")
    loads = sum(common.LOADS.values())
    at.selectbox(key="feat_id").set_value(206).run()
    assert "Feature 206: max-activating contexts" in " ".join(titles(at))
    prompt = torch.tensor([tok.encode(common.DEFAULT_PROMPT)])
    n = at.slider(key="feat_new").value
    with an.feature_edit(model, sae, 206, 0.0):
        ablated = model.generate(prompt, max_new_tokens=n)[0, prompt.shape[1]:]
    clean = model.generate(prompt, max_new_tokens=n)[0, prompt.shape[1]:]
    assert continuations(at) == [tok.decode(clean.tolist()), tok.decode(ablated.tolist())]
    assert continuations(at)[0].startswith("Mary") and continuations(at)[1].startswith("John")
    dla = an.feature_dla(model, sae, prompt, tok.encode(" Mary")[0], tok.encode(" John")[0])
    metric = next(m for m in at.metric if m.label.startswith("Feature 206's direct share"))
    assert float(metric.value) == pytest.approx(float(dla[dla.feature == 206].dla.iloc[0]), abs=2e-3)
    at.toggle(key="feat_ablate_show_loss").set_value(True).run()
    losses = figure(at, "Per-token loss, clean and ablated")
    assert [t["name"] for t in losses["data"]] == ["clean", "ablated"]
    at.radio(key="feat_action").set_value("steer with this feature").run()
    assert [t["name"] for t in figure(at, "Projection on the direction")["data"]] == ["clean", "steered"]
    assert not at.exception and not at.error, messages(at)
    assert sum(common.LOADS.values()) == loads, "a widget change reloaded the model"


def test_features_search_by_token_and_sort(app):
    at = app("Features")
    at.text_input(key="feat_token").set_value("to").run()
    table = at.dataframe[0].value
    assert "fraction" in table and table.fraction.is_monotonic_decreasing and 206 in set(table.feature)
    assert at.selectbox(key="feat_id").value in set(table.feature)  # the open feature stays while it matches
    assert "features fire on 'to'" in " ".join(c.value for c in at.caption)
    at.text_input(key="feat_token").set_value("zeppelin").run()  # not a word of this model's vocabulary
    assert "not in this tokenizer's vocabulary" in messages(at)
    at.text_input(key="feat_token").set_value("").run()
    opened = at.selectbox(key="feat_id").value
    at.selectbox(key="feat_sort").set_value("feature id").run()
    at.toggle(key="feat_desc").set_value(False).run()
    assert at.dataframe[0].value.feature.iloc[0] == 0 and at.selectbox(key="feat_id").options[0].startswith("#0 ")
    assert at.selectbox(key="feat_id").value == opened, "sorting keeps the open feature"
    at.selectbox(key="feat_sort").set_value("max activation").run()
    assert at.dataframe[0].value.max_activation.is_monotonic_increasing
    assert not at.exception


def test_features_bad_dictionaries_give_a_message(app, checkpoints_dir, tmp_path, monkeypatch):
    from workbench.analysis.dictionaries import DictionaryConfig, make_dictionary, save_dictionary

    root = tmp_path / "ckpts"
    for name in (DEFAULT, "stories-2020"):
        target = root / name
        target.mkdir(parents=True)
        for f in (checkpoints_dir / name).iterdir():
            if f.is_file():
                (target / f.name).symlink_to(f)
    save_dictionary(make_dictionary(DictionaryConfig(kind="relu", d_in=64, d_sae=16,
                                                     hook_name="blocks.1.hook_resid_post")), root / DEFAULT / "saes" / "wide")
    shutil.copytree(checkpoints_dir / DEFAULT / "saes" / DICTIONARY, root / "stories-2020" / "saes" / DICTIONARY)
    monkeypatch.setenv(common.ENV_VAR, str(root))
    at = app("Features")
    at.selectbox(key="feat_dict").set_value("wide").run()
    assert "The dictionary `wide` cannot be used" in messages(at) and "64 wide" in messages(at)
    at.selectbox(key="ckpt").set_value("stories-2020").run()
    assert "trained on 'stories-2026', not on 'stories-2020'" in messages(at)
    (root / DEFAULT / "saes" / "wide" / "sae_weights.safetensors").write_bytes(b"not safetensors")
    at.selectbox(key="ckpt").set_value(DEFAULT).run()
    at.selectbox(key="feat_dict").set_value("wide").run()
    assert "The dictionary `wide` cannot be used" in messages(at)
    shutil.rmtree(root / DEFAULT / "saes")
    at.run()
    assert "holds no dictionary" in messages(at)
    assert not at.exception
