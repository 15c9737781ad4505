"""An outside review of the app on the real model (SmolLM2-135M-Instruct): each defect it found, checked
in a unit or under AppTest on the shipped checkpoints (the real model only where the defect needs it)."""

from pathlib import Path
from urllib.parse import parse_qsl, urlsplit


REPO = Path(__file__).resolve().parents[2]


# ---- 1. a Graph link naming a checkpoint the page cannot open ----------------------------------------
def test_a_graph_link_names_the_pretrained_model_by_its_short_name_and_reads_it_back():
    """The docs' link said ``graph_ckpt=smollm2-135m``, which the parser dropped (the picker's name is the
    long label), so the page opened stories-2026 silently. The builder now writes the short name and the
    parser maps it back to the picker's entry."""
    from ui import graph as page
    from ui.common import pretrained

    state = {"graph_ckpt": pretrained.LABEL, "graph_target": "top"}
    link = page.view_link(state)
    params = dict(parse_qsl(urlsplit(link).query, keep_blank_values=True))
    assert params["graph_ckpt"] == "smollm2-135m" == pretrained.NAME
    assert page.link_state(params, ["stories-2026", pretrained.LABEL]) == state
    assert page.link_refusal(params, ["stories-2026", pretrained.LABEL], {}) is None


def test_a_graph_link_to_a_missing_checkpoint_is_one_message_naming_it_and_what_is_offered():
    from ui import graph as page

    names = ["stories-2026", "planted-hand-induction"]
    said = page.link_refusal({"graph_ckpt": "nowhere-9"}, names, {})
    assert "`nowhere-9`" in said and "`stories-2026`" in said and "`planted-hand-induction`" in said
    said = page.link_refusal({"graph_ckpt": "plain"}, names, {"plain": "/x/plain"})
    assert "`plain`" in said and "no transcoder" in said and "none of that name" not in said
    assert page.link_refusal({"page": "Graph"}, names, {}) is None


def test_the_graph_page_opened_by_a_link_to_a_missing_checkpoint_says_so(checkpoints_dir, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("WORKBENCH_CHECKPOINTS", str(checkpoints_dir))
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=180)
    at.query_params["page"] = "Graph"
    at.query_params["graph_ckpt"] = "no-such-model"
    at.query_params["graph_target"] = "top"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    said = [w.value for w in at.warning if "no-such-model" in w.value]
    assert len(said) == 1 and "stories-2026" in said[0], [w.value for w in at.warning]
    at.run()  # still there on the next run, while the fallback stays picked
    assert any("no-such-model" in w.value for w in at.warning)


# ---- 2. the Graph page's held positions and its edge count ------------------------------------------
def test_a_pretrained_tokenizer_without_bos_holds_position_0_and_one_with_bos_does_not():
    """SmolLM2's tokenizer adds no BOS: its first token is the attention sink, and the default graph had a
    cluster of features there. The same tokenizer file given a BOS post-processor keeps position 0."""
    from tokenizers.processors import TemplateProcessing

    from ui import graph as page
    from ui.common import pretrained
    from workbench.tokenizer import WordTokenizer, load_tokenizer

    folder = pretrained.cache_dir()
    if folder is None or not pretrained.converted(folder):
        import pytest

        pytest.skip("the pretrained model is not converted here (its tokenizer.json is what is read)")
    tok = load_tokenizer(folder)
    assert tok.encode("a")[0] != tok.token_id("bos_token")  # independently: no BOS in front
    assert page.adds_bos(tok) is False and page.default_held(tok) == 1
    bos = tok.special_tokens["bos_token"]
    tok.hf.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_id("bos_token"))])
    assert tok.encode("a")[0] == tok.token_id("bos_token")
    assert page.adds_bos(tok) is True and page.default_held(tok) == 0
    assert page.default_held(WordTokenizer(["a", "b"])) == 0  # the workbench's own models: unchanged


def test_the_edge_count_fits_its_metric():
    from ui import graph as page

    assert [page.compact(n) for n in (7, 999, 2709, 27130, 1_234_567)] == ["7", "999", "2.7k", "27.1k", "1.2M"]


def test_the_graph_page_holds_the_positions_it_is_told_and_writes_them_in_its_link(app, checkpoints_dir):
    """stories-2026 (a word tokenizer, no BOS of its own) keeps every position by default, as before; held
    positions set on the page are the graph's (``held_positions``), counted against the library's graph."""
    import torch

    import workbench as wb
    from ui.graph import IOI_PROMPT
    from workbench import analysis as an

    at = app("Graph")
    assert at.number_input(key="graph_held").value == 0
    assert not [c for c in at.caption if "attention sink" in c.value]
    model, _ = wb.load_checkpoint(checkpoints_dir / "stories-2026")
    tcs = [an.load_dictionary(str(checkpoints_dir / "stories-2026" / "saes" / "transcoders" / f"layer{layer}"))
           for layer in range(model.cfg.n_layers)]
    graph = an.attribution_graph(model, tcs, torch.tensor([model.tokenizer.encode(IOI_PROMPT)]), max_feature_nodes=128,
                                 held_positions=2)
    at.number_input(key="graph_held").set_value(2).run()
    assert not at.exception, [e.value for e in at.exception]
    metrics = {m.label: m.value for m in at.metric}
    pruned = graph.prune(0.8, 0.98)
    assert metrics["Nodes kept"] == f"{pruned.n_nodes} of {graph.n_nodes}"
    assert metrics["Edges kept"] == f"{page_compact(pruned.n_edges)} of {page_compact(graph.n_edges)}"
    assert any("graph_held=2" in m.value for m in at.markdown)


def page_compact(n: int) -> str:
    from ui.graph import compact

    return compact(n)


# ---- 3. the Features page on a checkpoint with transcoders but no SAE --------------------------------
def test_the_features_page_says_what_saes_holds_when_it_holds_no_sae(tmp_path):
    """SmolLM2's ``saes/`` holds transcoders/layer0..29 and no SAE: the page said it "holds no dictionary"."""
    import shutil

    from ui import features as page

    shipped = REPO / "checkpoints" / "stories-2026" / "saes"
    for layer in (0, 1):
        shutil.copytree(shipped / "transcoders" / f"layer{layer}", tmp_path / "saes" / "transcoders" / f"layer{layer}")
    shutil.copytree(shipped / "clt", tmp_path / "saes" / "clt")
    assert page.dictionaries(str(tmp_path)) == {}
    assert page.other_dictionaries(str(tmp_path)) == ["a cross-layer transcoder in `clt/`", "2 transcoders in `transcoders/`"]
    assert page.other_dictionaries(str(tmp_path / "nowhere")) == []


# ---- 4. a spinner saying what the long first computations are ----------------------------------------
def _spinner_texts(monkeypatch) -> list[str]:
    """Record what every ``st.spinner`` on a page says (the pages call ``streamlit.spinner``)."""
    import streamlit

    said, real = [], streamlit.spinner

    def spinner(text="", *args, **kwargs):
        said.append(text)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(streamlit, "spinner", spinner)
    return said


def test_patch_ablate_and_compare_say_what_they_compute_while_they_compute(app, monkeypatch):
    """SmolLM2's Patch page took 28.5 s to open under Streamlit's small "Running" icon alone."""
    said = _spinner_texts(monkeypatch)
    app("Patch")
    assert any(t.startswith("Exact activation patching") for t in said), said
    assert any(t.startswith("Attribution patching") for t in said), said
    said.clear()
    at = app("Ablate")
    at.multiselect(key="ablate_units").set_value(["L0H0"]).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("clean and ablated" in t for t in said), said
    said.clear()
    app("Compare")
    assert any("per-token losses" in t for t in said), said
    said.clear()
    at = app("Inspect")  # re-picking SmolLM2 on Inspect took 12.5 s with no word of what ran
    assert not at.exception, [e.value for e in at.exception]
    assert any(t.startswith("Running ") and "on the prompt (" in t and "layers)" in t for t in said), said


# ---- 5. the Steer page's default scale, relative to the stream -----------------------------------------
def _median_norm(model, ids, hook: str) -> float:
    import torch

    with torch.no_grad():
        _, cache = model.run_with_cache(torch.tensor([ids]), names_filter=hook)
    return float(cache[hook][0].norm(dim=-1).median())


def test_add_scale_puts_a_share_of_the_stream_on_a_round_step():
    from ui.common import steering

    lo, hi, default, step = steering.add_scale(74.0, 0.169)  # SmolLM2's blocks.1 stream and default direction
    assert step == 10 and default == 330 and (lo, hi) == (-1320, 1320)
    assert abs(default * 0.169 - steering.STREAM_SHARE * 74.0) < step * 0.169
    lo, hi, default, step = steering.add_scale(39.0, 6.0)  # stories-2026's
    assert step == 0.1 and default == 4.9 and (lo, hi) == (-20.0, 20.0)
    assert steering.add_scale(float("nan"), 1.0) == (-20.0, 20.0, 8.0, 0.5)


def test_the_default_steering_changes_the_real_models_text(real_model):
    """SmolLM2-135M at the Steer page's defaults (layer 1, the IOI contrastive direction): s = 8 left the
    steered text equal to the clean one; the stream-relative default changes it."""
    import torch

    from ui.common import steering
    from ui.common.pretrained import PROMPT
    from ui.steer import DEFAULT_NEGATIVE, DEFAULT_POSITIVE
    from workbench import analysis as an

    tok = real_model.tokenizer
    lines = lambda text: [tok.encode(line) for line in text.splitlines()]  # noqa: E731
    direction = an.steering_vector(real_model, lines(DEFAULT_POSITIVE), lines(DEFAULT_NEGATIVE),
                                   "blocks.1.hook_resid_post")
    ids = tok.encode(PROMPT)
    _, _, default, _ = steering.add_scale(_median_norm(real_model, ids, direction.hook), float(direction.vector.norm()))
    prompt = torch.tensor([ids])
    clean = real_model.generate(prompt, max_new_tokens=12)[0, len(ids):].tolist()
    with real_model.steer(direction, 8.0):
        assert real_model.generate(prompt, max_new_tokens=12)[0, len(ids):].tolist() == clean  # the old default
    with real_model.steer(direction, default):
        assert real_model.generate(prompt, max_new_tokens=12)[0, len(ids):].tolist() != clean


# ---- 6. the Circuit page's prompt set for a pretrained text model -------------------------------------
def test_the_circuit_pages_english_ioi_pairs_are_ioi_prompts(real_model):
    """SmolLM2 records no task, and the page said it had no prompt set; it now offers ``ioi_prompts``."""
    from ui import circuit as page
    from workbench.analysis.circuits.ioi import ioi_prompts
    from workbench.tokenizer import CharTokenizer

    assert page.text_ioi_offered(real_model.tokenizer)
    assert not page.text_ioi_offered(CharTokenizer.from_text("abc MaryJohn"))
    prompts = page.text_ioi(real_model, 4, seed=3)
    reference = ioi_prompts(real_model, 4, seed=3)  # SmolLM2's five templates are of one length
    assert (prompts.clean, prompts.corrupted, prompts.answer, prompts.wrong) == \
        (reference.clean, reference.corrupted, reference.io, reference.s)
    assert prompts.target(0) == (len(reference.clean[0]) - 1, reference.io[0], reference.s[0])


def test_a_link_to_a_page_the_app_does_not_have_says_so(checkpoints_dir, monkeypatch):
    """``?page=Nowhere`` opened Inspect with no word; a known page opens as before, with no warning."""
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("WORKBENCH_CHECKPOINTS", str(checkpoints_dir))
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=180)
    at.query_params["page"] = "Nowhere"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    said = [w.value for w in at.warning if "'Nowhere'" in w.value]
    assert len(said) == 1 and "Inspect" in said[0] and "Graph" in said[0], [w.value for w in at.warning]
    known = AppTest.from_file(str(REPO / "app.py"), default_timeout=180)
    known.query_params["page"] = "Ablate"
    known.run()
    assert known.session_state["page"] == "Ablate" and not any("link asks" in w.value for w in known.warning)
