"""Every page of the app under Streamlit's AppTest, on the shipped default checkpoint.

Each page renders without an exception; widgets change what is drawn (asserted on the
figures' content and the metrics); bad input produces a message in the page; and no
widget ever reloads the model (``ui.common.LOADS`` counts real loads from disk).
"""

import io
import json
import shutil
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from ui import build_train, common, sweeps
from ui.common import uploads
from workbench.tokenizer import load_tokenizer

DEFAULT = "stories-2026"


def figures(at) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


def titles(at) -> list[str]:
    out = []
    for fig in figures(at):
        title = fig.get("layout", {}).get("title", {})
        out.append(title.get("text", "") if isinstance(title, dict) else str(title))
    return out


def figure(at, title_part: str) -> dict:
    for fig, title in zip(figures(at), titles(at)):
        if title_part in title:
            return fig
    raise AssertionError(f"no figure titled *{title_part}* among {titles(at)}")


def before_after(at, label: str) -> tuple[float, float]:
    """The two numbers of a metric card reading "1.234 → 2.345" (units after them ignored)."""
    value = next(m.value for m in at.metric if m.label == label)
    before, after = value.split("→")
    return float(before.split()[0]), float(after.split()[0])


def messages(at) -> str:
    return " | ".join(str(e.value) for e in [*at.warning, *at.error, *at.info])


# ---- configuration ------------------------------------------------------------------------------
def test_checkpoints_folder_from_flag_then_env_then_default(monkeypatch, tmp_path):
    monkeypatch.setenv(common.ENV_VAR, str(tmp_path / "env"))
    assert common.checkpoints_root(["--checkpoints", str(tmp_path / "flag")]) == tmp_path / "flag"
    assert common.checkpoints_root([]) == tmp_path / "env"
    monkeypatch.delenv(common.ENV_VAR)
    assert common.checkpoints_root([]) == common.REPO / "checkpoints"


# ---- Inspect --------------------------------------------------------------------------------------
def test_inspect_opens_on_the_default_checkpoint_and_prompt(app, checkpoints_dir):
    at = app("Inspect")
    assert at.selectbox(key="ckpt").value == DEFAULT
    assert at.text_area(key="prompt").value == common.DEFAULT_PROMPT
    assert not at.warning and not at.error, messages(at)
    shown = " ".join(titles(at))
    for part in ("Per-token loss", "Attention L0H0", "Logit lens", ": direct attribution", "Residual-stream norm",
                 "Training curve"):
        assert part in shown, (part, titles(at))
    # Token strings on the axes, position-prefixed so repeated tokens stay apart.
    attention = figure(at, "Attention L0H0")["data"][0]
    assert attention["x"][1] == "1: upon" and attention["y"][0] == "0: Once"
    n_tokens = len(load_tokenizer(checkpoints_dir / DEFAULT).encode(common.DEFAULT_PROMPT))
    assert at.metric[0].value == f"{n_tokens} tokens"


def test_inspect_widgets_change_the_figures_but_never_reload_the_model(app):
    at = app("Inspect")
    loads = sum(common.LOADS.values())
    at.selectbox(key="attn_layer").set_value(1)
    at.selectbox(key="attn_head").set_value(2).run()
    assert "Attention L1H2" in " ".join(titles(at))
    before = figure(at, "Logit lens")["data"][0]["colorbar"]["title"]["text"]
    at.selectbox(key="lens_value").set_value("rank of the next token").run()
    after = figure(at, "Logit lens")["data"][0]["colorbar"]["title"]["text"]
    assert (before, after) == ("next-token probability", "log10 rank of the next token")
    at.text_area(key="prompt").set_value("Mary and John went to the park .").run()
    assert [m.value for m in at.metric][0] == "8 tokens"
    assert figure(at, "Per-token loss")["data"][0]["x"][0] == "1: and"
    at.session_state["attn_tab"] = "Every head"
    at.run()
    assert "Attention patterns" in " ".join(titles(at))
    assert not at.exception
    assert sum(common.LOADS.values()) == loads, "a widget change reloaded the model"


def test_inspect_head_scores_say_which_layout_they_were_measured_on(app, checkpoints_dir):
    at = app("Inspect")
    at.session_state["attn_tab"] = "Head scores"
    at.run()
    ids = load_tokenizer(checkpoints_dir / DEFAULT).encode(common.DEFAULT_PROMPT)
    repeats = sum(ids[q] in ids[:q] for q in range(len(ids)))
    caption = " | ".join(c.value for c in at.caption)
    assert f"Head scores on this prompt: 1 sequence of {len(ids)} tokens" in caption, caption
    assert (f"{repeats} position(s) repeat an earlier token" if repeats else "no position repeats") in caption


def test_inspect_several_prompts_one_per_line(app, checkpoints_dir):
    """Several lines: a row per prompt with its loss as it has alone, figures over all of them,
    and a selector for the prompt the per-prompt figures show; a bad line is named."""
    import torch

    import workbench as wb

    at = app("Inspect")
    texts = ["When Tom and Lily went to the park , Lily gave a ball to", "Mary and John went to the park ."]
    at.text_area(key="prompt").set_value("\n".join(texts) + "\n").run()
    assert not at.exception and not at.warning, messages(at)
    table = next(df.value for df in at.dataframe if "text" in df.value.columns)
    assert table.text.tolist() == texts and table.prompt.tolist() == [0, 1]
    model, _ = wb.load_checkpoint(checkpoints_dir / DEFAULT)
    with torch.no_grad():
        alone = [float(model(model.to_tokens(t), return_type="loss")) for t in texts]
    assert table.loss.tolist() == pytest.approx(alone, abs=1e-4)  # the padded batch: each prompt as it is alone
    shown = " ".join(titles(at))
    assert "Top-1 accuracy of the lens per layer" in shown and "Head scores" in shown
    assert "Head scores on these 2 prompts" in " | ".join(c.value for c in at.caption)
    n_first = len(load_tokenizer(checkpoints_dir / DEFAULT).encode(texts[0]))
    assert at.metric[0].value == f"{n_first} tokens"
    at.selectbox(key="inspect_prompt").set_value(1).run()
    assert at.metric[0].value == "8 tokens"
    assert figure(at, "Per-token loss")["data"][0]["x"][0] == "1: and"
    at.text_area(key="prompt").set_value("Mary and John went\nMary met a zebra ☃ .").run()
    assert not at.exception and "Line 2: This checkpoint's tokenizer cannot encode" in messages(at)
    assert "Per-token loss" not in " ".join(titles(at))


def test_head_score_caption_of_a_repeated_token_probe():
    from ui.inspect import layout_caption

    layout = {"source": "repeated_random_tokens", "seq_len": 20, "seed": 3, "batch": 8, "n_pos": 40, "repeats": 171}
    caption = layout_caption(layout)
    assert "8 sequences of 20 random tokens shown twice (40 tokens, seed 3)" in caption
    assert "171 position(s) repeat" in caption
    assert "no position repeats" in layout_caption({**layout, "repeats": 0})


def test_checkpoint_and_prompt_survive_a_visit_to_another_page(app):
    at = app("Inspect")
    at.text_area(key="prompt").set_value("Mary and John went to the park .").run()
    at.session_state["page"] = "Build & train"
    at.run()
    at.session_state["page"] = "Inspect"
    at.run()
    assert at.text_area(key="prompt").value == "Mary and John went to the park ."
    assert at.selectbox(key="ckpt").value == DEFAULT


def test_inspect_direct_logit_attribution_target_and_difference(app):
    at = app("Inspect")
    title = next(t for t in titles(at) if "direct attribution" in t)
    assert "logit['Mary'] − logit['John']" in title, "the default prompt's answer is the task's: Mary over John"
    at.text_input(key="dla_wrong").set_value("").run()
    assert "logit['Mary'] at position" in next(t for t in titles(at) if "direct attribution" in t)
    at.text_input(key="dla_answer").set_value("zebra").run()
    assert "not in the tokenizer's vocabulary" in messages(at)


def test_answer_defaults_follow_the_prompt_and_the_position(app):
    at = app("Inspect")
    at.text_area(key="prompt").set_value("When Tom and Lily went to the park , Lily gave a ball to").run()
    assert at.text_input(key="dla_answer").value == "Tom" and at.text_input(key="dla_wrong").value == "Lily"
    at.text_area(key="prompt").set_value("When Mary and John went to the store , John gave a drink to").run()
    assert at.text_input(key="dla_answer").value == "Mary", "a new prompt of the same length keeps no old answer"
    at.selectbox(key="dla_pos").set_value(3).run()
    assert at.text_input(key="dla_answer").value != "Mary"  # another position: the model's own top prediction
    assert "at position 3" in next(t for t in titles(at) if "direct attribution" in t)


@pytest.mark.parametrize("prompt, message", [
    ("", "The prompt is empty"),
    ("   ", "The prompt is empty"),
    ("Mary met a zebra ☃ .", "cannot encode 'zebra', '☃'"),
    ("Mary " * 200, "this model's context is"),
    ("Mary", "at least 2 are needed"),
])
def test_inspect_bad_prompts_give_a_message(app, prompt, message):
    at = app("Inspect")
    at.text_area(key="prompt").set_value(prompt).run()
    assert not at.exception
    assert message in messages(at)
    assert "Per-token loss" not in " ".join(titles(at))


def test_bad_checkpoint_directories_give_a_message(app, checkpoints_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_ALLOW_ANY_PATH", "1")  # the folders are under tmp_path, outside the checkpoints
    at = app("Inspect")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(checkpoints_dir / DEFAULT, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    (tmp_path / "empty").mkdir()
    cases = {str(tmp_path / "missing"): "is not a directory", str(tmp_path / "empty"): "is not a checkpoint",
             str(corrupt): "truncated or corrupt"}
    at.selectbox(key="ckpt").set_value(common.OTHER_DIR).run()
    for path, message in cases.items():
        at.text_input(key="ckpt_dir").set_value(path).run()
        assert not at.exception
        assert message in messages(at), (path, messages(at))


def _zipped(folder: Path, name: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in folder.iterdir():
            z.write(f, f"{name}/{f.name}")
    return buf.getvalue()


def test_an_upload_is_selected_at_once_and_a_failed_one_names_its_file_and_clears(app, checkpoints_dir, tmp_path,
                                                                                monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(uploads, "_upload_root", None)
    at = app("Inspect")
    at.file_uploader(key="upload_0").set_value(("mine.zip", _zipped(checkpoints_dir / "stories-2020", "x"),
                                                "application/zip")).run()
    assert not at.exception
    chosen = at.selectbox(key="ckpt").value
    assert chosen.startswith("upload: mine"), "the new checkpoint is selected in the same run"
    assert f"**{chosen}**" in at.success[0].value
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints_dir / DEFAULT, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    at.file_uploader(key="upload_0").set_value(("broken.zip", _zipped(broken, "broken"), "application/zip")).run()
    assert "broken.zip is not a usable checkpoint" in messages(at) and "model.safetensors" in messages(at)
    assert str(tmp_path) not in messages(at), "the message names the file, not the temp folder"
    at.button(key="upload_clear").click().run()
    assert "not a usable" not in messages(at) and at.file_uploader(key="upload_1") is not None
    at.file_uploader(key="upload_1").set_value(("notes.txt", b"hello", "text/plain")).run()
    assert "Upload of notes.txt failed: this upload is not a checkpoint" in messages(at)


def test_an_experiment_run_directory_says_so_in_one_line(app, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_ALLOW_ANY_PATH", "1")  # the run is under tmp_path, outside the checkpoints
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"experiment": "head_ablation_sweep", "quick": True, "seed": 0}))
    (run / "model.safetensors").write_bytes(b"")
    at = app("Inspect")
    at.selectbox(key="ckpt").set_value(common.OTHER_DIR).run()
    at.text_input(key="ckpt_dir").set_value(str(run)).run()
    assert "is a run of the experiment 'head_ablation_sweep', not a checkpoint: open it on the Sweeps page" in messages(at)
    assert "quick" not in messages(at)


def test_uploads_land_in_a_temp_folder_with_limits(checkpoints_dir, tmp_path, monkeypatch):
    source = checkpoints_dir / DEFAULT
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f in source.iterdir():
            z.write(f, f"{DEFAULT}/{f.name}")
    name, path = common.save_upload([("mine.zip", buf.getvalue())], root=tmp_path / "uploads")
    assert Path(path).parent == tmp_path / "uploads" and (Path(path) / "model.safetensors").is_file()
    assert common.load(path).cfg == common.load(str(source)).cfg
    assert not Path(path).is_relative_to(checkpoints_dir)

    evil = io.BytesIO()
    with zipfile.ZipFile(evil, "w") as z:
        z.writestr("../../config.json", "{}")
    with pytest.raises(ValueError, match="unsafe path"):
        common.save_upload([("evil.zip", evil.getvalue())], root=tmp_path / "uploads")
    with pytest.raises(ValueError, match="not a checkpoint"):
        common.save_upload([("notes.txt", b"hello")], root=tmp_path / "uploads")
    with pytest.raises(ValueError, match="corrupt or not a zip"):
        common.save_upload([("broken.zip", b"PK\x03\x04 nope")], root=tmp_path / "uploads")
    monkeypatch.setattr(uploads, "UPLOAD_LIMIT_MB", 0)  # where save_upload reads it
    with pytest.raises(ValueError, match="the limit is 0 MB"):
        common.save_upload([("mine.zip", buf.getvalue())], root=tmp_path / "uploads")


def test_uploads_go_to_a_private_random_folder_and_never_through_a_symlink(tmp_path, monkeypatch):
    import os
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # mkdtemp lands here, cleaned up by pytest
    monkeypatch.setattr(uploads, "_upload_root", None)
    files = [("config.json", b"{}"), ("model.safetensors", b"weights")]
    _, path = common.save_upload(files)
    root = Path(path).parent
    assert root.parent == tmp_path and root.name.startswith("workbench-uploads-") and root.name != "workbench-uploads"
    assert root.stat().st_mode & 0o777 == 0o700 and Path(path).stat().st_mode & 0o077 == 0
    assert common.save_upload(files)[1] == path  # the same upload twice: the same folder
    assert common.upload_root() == root

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted = tmp_path / "planted"
    planted.mkdir()
    os.symlink(elsewhere, planted / Path(path).name)  # a folder pre-created as a symlink
    with pytest.raises(ValueError, match="symlink"):
        common.save_upload(files, root=planted)
    linked_root = tmp_path / "linked"
    os.symlink(elsewhere, linked_root)
    with pytest.raises(ValueError, match="symlink"):
        common.save_upload(files, root=linked_root)
    target = tmp_path / "files" / Path(path).name
    target.mkdir(parents=True)
    os.symlink(elsewhere / "stolen", target / "config.json")  # a file planted as a symlink
    with pytest.raises(ValueError, match="cannot write"):
        common.save_upload(files, root=tmp_path / "files")
    assert not any(elsewhere.iterdir())


def test_reference_batch_is_the_checkpoints_own_task(checkpoints_dir):
    # the library's reference_batch (tests/test_analysis_reference.py), as tuples, for the checkpoint's meta.json
    from workbench.analysis import reference_batch

    ckpt = common.load(str(checkpoints_dir / DEFAULT))
    ids = tuple(range(3, 13))
    rows = common.reference_batch(ckpt.key, ids, rows=3)
    assert rows == tuple(map(tuple, reference_batch(ckpt.model, ckpt.meta, ids, rows=3).tolist()))
    assert len(rows) == 3 and all(sorted(row) != sorted(ids) for row in rows)  # task text, not shuffles


def test_ablate_changes_the_loss_and_the_sweep_draws_the_heatmap(app):
    at = app("Ablate")
    assert "Choose units to ablate" in messages(at)
    at.multiselect(key="ablate_units").set_value(["L0H0", "L1 mlp"]).run()
    clean, ablated = before_after(at, "Mean loss, clean → ablated")
    assert ablated != clean
    assert "Per-token loss" in titles(at)
    at.radio(key="ablate_lens_view").set_value("side by side").run()
    lens = [f for f in figures(at) if len(f["data"]) == 2 and f["data"][0]["type"] == "heatmap"]
    assert lens, "no side-by-side logit lens"
    at.radio(key="ablate_kind").set_value("mean (over reference text)").run()
    assert before_after(at, "Mean loss, clean → ablated")[1] != ablated and not at.exception
    at.text_input(key="ablate_neurons").set_value("L0 3, 4").run()
    assert "Cannot read neurons" in messages(at)
    at.text_input(key="ablate_neurons").set_value("").run()

    at.selectbox(key="ablate_target_kind").set_value("mean loss over the prompt").run()
    at.button(key="ablate_sweep").click().run()
    heatmap = figure(at, "Change in the prompt's mean loss when each head is ablated")
    assert heatmap["data"][0]["y"] == ["L0", "L1", "L2"][: len(heatmap["data"][0]["y"])]


def test_ablate_averages_over_a_prompt_set_with_each_prompts_spread(app):
    at = app("Ablate")
    at.multiselect(key="ablate_units").set_value(["L0H0", "L1 mlp"]).run()
    at.toggle(key="ablate_set_on").set_value(True).run()
    assert not at.exception, at.exception
    spread = figure(at, "per prompt (16 prompts)")
    assert [trace["name"] for trace in spread["data"]] == ["L0H0 (zero)", "L1 mlp (zero)"]
    assert all(trace["boxpoints"] == "all" for trace in spread["data"])  # every prompt a point
    summary = next(d.value for d in at.dataframe if "delta" in d.value.columns and "n" in d.value.columns)
    assert summary.n.tolist() == [16, 16] and summary.label.tolist() == ["L0H0 (zero)", "L1 mlp (zero)"]
    at.radio(key="ablate_set_source").set_value("typed").run()
    at.text_area(key="ablate_set_text").set_value("Mary and John went to the park .\nTom went home .").run()
    assert not at.exception and "per prompt (2 prompts)" in " ".join(titles(at))
    at.radio(key="ablate_kind").set_value("mean (over reference text)").run()
    at.text_area(key="ablate_set_text").set_value("Tom went home .").run()
    assert "single sequence" in messages(at)  # one prompt is its own reference: refused, not silently zero


def test_a_sweep_cell_click_event_names_the_head():
    from ui import ablate

    # what the browser sends: the clicked scatter point, its customdata a list or a typed array's row
    assert ablate.clicked_head({"selection": {"points": [{"x": "H3", "y": "L1", "customdata": [1, 3, 0.2]}]}}) == (1, 3)
    assert ablate.clicked_head({"selection": {"points": [{"customdata": {"0": 2, "1": 0, "2": 0.1}}]}}) == (2, 0)
    assert ablate.clicked_head({"selection": {"points": []}}) is None and ablate.clicked_head(None) is None


def test_ablate_measures_the_answer_at_the_last_position(app):
    """Zero-ablating every head of the last layer at the last position leaves the mean loss
    (which never scores the last position) unchanged, and moves the logit difference."""
    at = app("Ablate")
    assert at.text_input(key="ablate_target_answer").value == "Mary"
    n = len(at.selectbox(key="ablate_target_pos").options)
    last_layer = [f"L2H{h}" for h in range(4)]
    at.multiselect(key="ablate_units").set_value(last_layer)
    at.multiselect(key="ablate_positions").set_value([n - 1]).run()
    assert not at.exception, [e.value for e in at.exception]
    cards = {m.label: m for m in at.metric}
    loss = cards["Mean loss, clean → ablated"]
    assert float(loss.delta.split()[0]) == 0.0
    answer = next(m for label, m in cards.items() if label.startswith("logit['Mary'] − logit['John']"))
    assert abs(float(answer.delta.split()[0])) > 0.01
    assert "lens, clean − ablated" in " ".join(titles(at))
    assert any("Direct logit attribution: clean" in t for t in titles(at))
    at.button(key="ablate_sweep").click().run()
    heatmap = figure(at, "Change in logit['Mary'] − logit['John']")
    assert heatmap["layout"]["coloraxis"]["colorbar"]["title"]["text"] == "Δ logits"


# ---- Compare -------------------------------------------------------------------------------------------
def test_compare_shows_the_config_diff_curves_and_per_model_views(app, checkpoints_dir):
    b = "stories-2020"
    if not (checkpoints_dir / b).is_dir():
        pytest.skip(f"the shipped {b} checkpoint (the 2020 block to compare with) is missing")
    at = app("Compare")
    assert at.selectbox(key="ckpt_b").value == b, "B defaults to the other model of the family"
    assert not at.warning and not at.error, messages(at)
    diff = at.dataframe[0].value
    swapped = diff[diff["differs"] & diff["component"]]["field"].tolist()
    assert swapped and swapped == diff["field"].tolist()[: len(swapped)], "swapped components come first"
    curves = figure(at, "Training loss")
    assert {t["name"].split()[0] for t in curves["data"]} == {DEFAULT, b}
    at.session_state["compare_tab"] = "Attention grids"
    at.run()
    assert sum("Every head of" in t for t in titles(at)) == 2
    at.session_state["compare_tab"] = "Lens"
    at.run()
    assert not at.exception
    assert {f"Logit lens of {DEFAULT}", f"Logit lens of {b}"} <= set(titles(at))
    answers = at.dataframe[1].value
    assert answers["model"].tolist() == [DEFAULT, b] and set(answers["answer"]) == {"Mary"}


def test_compare_says_which_model_cannot_read_the_prompt(app, checkpoints_dir):
    other = "induction-attn2l"
    if not (checkpoints_dir / other).is_dir():
        pytest.skip(f"the shipped {other} checkpoint (a model with another tokenizer) is missing")
    at = app("Compare")
    at.selectbox(key="ckpt_b").set_value(other).run()
    # A's default prompt is no mistake of the user's: B reads its own default, and a caption says why.
    assert f"**{other}** cannot read A's default prompt" in " ".join(c.value for c in at.caption)
    assert at.text_area(key="prompt_b").value.split()[0].isdigit()  # its own default: token ids
    assert sum("Per-token loss, " in t for t in titles(at)) == 2 and not at.exception
    assert f"{other} cannot score the answer" in messages(at)
    at.text_area(key="prompt").set_value("Once upon a time Mary and John went to the park").run()  # typed
    assert f"**{other}** cannot read this prompt" in messages(at)


# ---- Patch -------------------------------------------------------------------------------------------
def test_patch_runs_on_the_tasks_abc_pairs_and_on_typed_pairs(app):
    at = app("Patch")
    assert not at.exception and not at.warning, messages(at)
    cards = {m.label: m.value for m in at.metric}
    clean, corrupted = (float(cards[k].split()[0]) for k in ("Metric on the clean prompts",
                                                             "Metric on the corrupted prompts"))
    assert clean > corrupted, "the ABC corruption lowers the logit difference"
    shown = " ".join(titles(at))
    for part in ("Patching resid_pre by layer and position", "Patching each head's output",
                 "Attribution patching"):
        assert part in shown, (part, titles(at))
    resid = figure(at, "Patching resid_pre")["data"][0]
    assert resid["x"][-1].endswith(": to") and "%{z:.4f}" in resid["hovertemplate"]
    assert any("r = " in c.value for c in at.caption)
    at.selectbox(key="patch_task_kind").set_value("answer probability").run()
    assert "probability" in " ".join(m.value for m in at.metric)
    at.radio(key="patch_source").set_value("typed here").run()
    assert not at.exception and at.text_area(key="patch_corrupted").value
    at.text_area(key="patch_corrupted").set_value("Mary and John went home .").run()
    # pairs of different lengths: patched at the positions from the end that both prompts have
    assert not at.exception and "counted from each prompt's end" in " ".join(c.value for c in at.caption)
    resid = figure(at, "Patching resid_pre")["data"][0]
    n_clean = len(at.text_area(key="patch_clean").value.split())
    assert len(resid["x"]) < n_clean and resid["x"][-1].endswith(": to")


# ---- Build & train ------------------------------------------------------------------------------------
def test_build_updates_costs_live_trains_and_saves(app, checkpoints_dir, tmp_path, monkeypatch):
    root = tmp_path / "ckpts"
    root.mkdir()
    (root / DEFAULT).symlink_to(checkpoints_dir / DEFAULT, target_is_directory=True)
    monkeypatch.setenv("WORKBENCH_CHECKPOINTS", str(root))
    at = app("Build & train")
    params = at.metric[0].value
    at.number_input(key="bt_n_layers").set_value(3).run()
    assert at.metric[0].value != params
    at.number_input(key="bt_n_kv_heads").set_value(3).run()
    assert "must divide n_heads" in messages(at)
    at.number_input(key="bt_n_kv_heads").set_value(2).run()
    at.number_input(key="bt_steps").set_value(6)
    at.number_input(key="bt_batch").set_value(4)
    at.number_input(key="bt_seq_len").set_value(16).run()
    at.button(key="bt_train").click().run()
    finish_training(at)
    assert not at.exception and not at.error, messages(at)
    assert "Done: 6 steps" in messages(at) or any("Done: 6 steps" in s.value for s in at.success)
    assert "Loss during training" in " ".join(titles(at))
    at.text_input(key="bt_name").set_value(DEFAULT).run()
    at.button(key="bt_save").click().run()
    assert "already exists" in messages(at)
    at.text_input(key="bt_name").set_value("tiny-run").run()
    at.button(key="bt_save").click().run()
    assert (root / "tiny-run" / "model.safetensors").is_file()
    at.session_state["page"] = "Inspect"
    at.run()
    assert "tiny-run" in at.selectbox(key="ckpt").options


def finish_training(at, timeout: float = 120) -> None:
    """Rerun until the background training run has ended (AppTest does not tick fragments)."""
    import time

    deadline = time.time() + timeout
    while at.session_state["bt_job"].running:
        assert time.time() < deadline, "training did not finish"
        time.sleep(0.2)
    at.run()


def test_build_greys_out_the_ffn_when_attention_only_and_refuses_what_cannot_fit(app, monkeypatch):
    at = app("Build & train")
    at.toggle(key="bt_attn_only").set_value(False).run()
    assert not at.number_input(key="bt_d_mlp").disabled and not at.selectbox(key="bt_ffn").disabled
    at.toggle(key="bt_attn_only").set_value(True).run()
    assert at.number_input(key="bt_d_mlp").disabled and at.selectbox(key="bt_ffn").disabled
    assert at.button(key="bt_train")
    monkeypatch.setattr(build_train, "free_memory_bytes", lambda: 10 * 2**20)  # a machine with 10 MB free
    at.number_input(key="bt_d_model").set_value(512).run()
    assert "Too large to train here" in messages(at)
    assert not [b for b in at.button if b.key == "bt_train"], "no Train button for a run that cannot fit"


def test_build_offers_qk_norm_and_the_output_norm_placements(app):
    at = app("Build & train")
    assert {"none", "head", "projection"} == set(at.selectbox(key="bt_qk_norm").options)
    assert {"sandwich", "reordered"} <= set(at.selectbox(key="bt_norm_placement").options)
    params = at.metric[0].value
    at.selectbox(key="bt_qk_norm").set_value("projection").run()
    at.selectbox(key="bt_norm_placement").set_value("sandwich").run()
    assert not at.exception and "not a valid model" not in messages(at)
    assert at.metric[0].value != params  # the q/k norm and output norm weights are counted


def test_training_runs_in_the_background_and_can_be_cancelled(app, checkpoints_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_CHECKPOINTS", str(tmp_path))
    at = app("Build & train")
    at.number_input(key="bt_steps").set_value(100_000)
    at.number_input(key="bt_batch").set_value(2)
    at.number_input(key="bt_seq_len").set_value(8).run()
    at.button(key="bt_train").click().run()
    job = at.session_state["bt_job"]
    assert job.running, "the script returned while training goes on"
    at.session_state["page"] = "Inspect"  # another page draws meanwhile
    at.run()
    assert not at.exception
    at.session_state["page"] = "Build & train"
    at.run()
    assert at.number_input(key="bt_steps").value == 100_000, "the settings outlive a visit to another page"
    assert at.number_input(key="bt_seq_len").value == 8
    at.button(key="bt_cancel").click().run()
    finish_training(at)
    assert job.status == "cancelled" and 0 < job.result["step"] < 100_000
    assert "Cancelled at step" in messages(at) and (Path(job.result["dir"]) / "model.safetensors").is_file()


def test_save_trained_refuses_bad_names(tmp_path):
    with pytest.raises(ValueError, match="not a usable checkpoint name"):
        build_train.save_trained(tmp_path, tmp_path, "../escape")


# ---- Sweeps ----------------------------------------------------------------------------------------------
def test_sweeps_tables_filter_and_compare(app, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "none"))
    at = app("Sweeps")
    assert "No runs under" in messages(at)

    runs = tmp_path / "runs"
    (runs / "head_sweep").mkdir(parents=True)
    rows = [dict(layer=l, head=h, method=m, delta=0.1 * l - 0.05 * h) for l in range(2) for h in range(3)
            for m in ("zero", "mean")]
    pd.DataFrame(rows).to_csv(runs / "head_sweep" / "results.csv", index=False)
    (runs / "head_sweep" / "config.json").write_text(json.dumps({"checkpoint": DEFAULT}))
    (runs / "swap").mkdir()
    pd.DataFrame({"variant": ["pre", "post"], "final_loss": [1.0, 1.4]}).to_csv(runs / "swap" / "results.csv", index=False)
    pd.DataFrame({"step": [1, 2], "train_loss": [3.0, 2.0]}).to_csv(runs / "swap" / "metrics.csv", index=False)
    monkeypatch.setenv("WORKBENCH_RUNS", str(runs))
    at = app("Sweeps")
    at.multiselect(key="sweeps_runs").set_value(["head_sweep"]).run()
    assert "12 of 12 rows" in [c.value for c in at.caption]
    at.multiselect(key="sweeps_f_method").set_value(["zero"]).run()
    assert "6 of 6 rows" not in [c.value for c in at.caption] and "6 of 12 rows" in [c.value for c in at.caption]
    at.toggle(key="sweeps_lh").set_value(True).run()
    assert figure(at, "delta")["data"][0]["type"] == "heatmap"
    at.multiselect(key="sweeps_runs").set_value(["head_sweep", "swap"]).run()
    assert not at.exception
    assert "Loss" in " ".join(titles(at))
    assert sweeps.list_runs(runs).keys() == {"head_sweep", "swap"}


def test_build_offers_mla_with_its_sizes_and_its_smaller_kv_cache(app):
    at = app("Build & train")  # the attn-only-2l preset: RoPE, 8 heads of 16
    kv_mha = at.metric[2].value
    assert not [w for w in at.number_input if w.key == "bt_kv_lora_rank"], "MLA widgets only for attention='mla'"
    at.selectbox(key="bt_attention").set_value("mla").run()
    assert not at.exception and not at.warning, messages(at)
    assert at.number_input(key="bt_kv_lora_rank").value == 64 and at.number_input(key="bt_q_lora_rank").value == 0
    assert at.number_input(key="bt_n_kv_heads").disabled
    n_ctx = int(at.metric[2].label.split(" at ")[1].split()[0])  # "KV cache at 128 tokens (bf16)"
    # per token: 2 layers x (latent 64 + RoPE key 8) x bf16, against MHA's 2 x 2 x 8 heads x 16 x bf16
    assert (at.metric[2].value, kv_mha) == (f"{288 * n_ctx:,} B", f"{1024 * n_ctx:,} B")
    assert "288 B per token" in at.metric[2].help
    at.number_input(key="bt_qk_rope_head_dim").set_value(3).run()
    assert "qk_rope_head_dim must be even" in messages(at)
    at.number_input(key="bt_qk_rope_head_dim").set_value(4)
    at.number_input(key="bt_q_lora_rank").set_value(16).run()
    assert not at.warning and at.metric[2].value == f"{272 * n_ctx:,} B"
