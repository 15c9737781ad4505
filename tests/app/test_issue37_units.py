"""The app as a researcher meets it (issue 37), checked on figures and under AppTest; the Chromium
checks are in test_browser_issue37.py.

- Many panels: ``viz.subplot_spacing`` keeps every multi-panel figure inside plotly's limit (a fixed
  gap of 0.12 raised ``ValueError`` at 10 rows: 28 sweep panels, three to a row).
- Shared endpoints: EAP on planted-iit-induction keeps the q, k and v edges L0H2 -> L1H1; the circuit
  figure draws them as three separate named lines (they were one line, the v edge over the others).
- The Graph page: target logits apart, a crowded cell in a grid of clickable points, the QK panel
  following a newly chosen head to its strongest graph entry, circuit-tracer export and a link.
- Defaults: the Features card opens on a feature that fires on the prompt; Build & train's default
  run is 1,500 steps with chance drawn beside the live curve.
- Exposure and noise: the server binds to 127.0.0.1, "Another directory…" opens only the checkpoints
  folder unless allowed, and no page logs a stack trace or a deprecation warning.
"""

import json
import os
import math
import subprocess
import sys
import tomllib
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from plotly.subplots import make_subplots

import workbench as wb
from workbench import analysis as an
from workbench import viz

REPO = Path(__file__).resolve().parents[2]


# ---- 1. any number of panels ------------------------------------------------------------------------
@pytest.mark.parametrize("rows,cols", [(1, 1), (2, 3), (10, 3), (28, 1), (1, 28), (40, 20)])
def test_subplot_spacing_fits_plotlys_limit_at_any_panel_count(rows, cols):
    across, down = viz.subplot_spacing(rows, cols)
    make_subplots(rows=rows, cols=cols, horizontal_spacing=across, vertical_spacing=down)  # raised past 1/(n-1)
    if rows > 1:
        assert 0 < down < 1 / (rows - 1) and (rows - 1) * down <= 0.4 + 1e-9
    if rows <= 4:  # a few rows keep the gap asked for
        assert down == 0.12
    with pytest.raises(ValueError, match="at least one row"):
        viz.subplot_spacing(0, 1)


def _sweep(methods: int, runs: int = 1) -> pd.DataFrame:
    return pd.DataFrame([dict(run=f"run{r}", method=f"m{m}", layer=l, head=h, delta=0.1 * l - 0.01 * h + m)
                         for r in range(runs) for m in range(methods) for l in range(2) for h in range(4)])


@pytest.mark.parametrize("methods,runs", [(16, 1), (14, 2), (30, 1)])
def test_the_sweeps_heatmap_draws_every_panel(methods, runs):
    from ui.sweeps import heatmap_panels

    table, facet, _ = heatmap_panels(_sweep(methods, runs))
    fig = viz.layer_head_figure(table, value="delta", facet=facet, columns=min(3, table[facet].nunique()))
    assert len([t for t in fig.data if t.type == "heatmap"]) == methods * runs
    # every panel keeps about 200 px whatever the count
    rows = -(-methods * runs // 3)
    assert rows <= 2 or fig.layout.height >= 200 * rows


def test_one_row_of_many_panels_and_many_steps_draw():
    frame = _sweep(16).assign(kind=lambda d: d["method"], step=0)
    viz.layer_head_over_training(frame.rename(columns={"delta": "score"}), "score")  # 16 panels across
    norms = pd.DataFrame([dict(matrix="embed", frequency=f, norm=1.0, step=s) for s in range(20) for f in range(3)])
    assert len(viz.fourier_norms_figure(norms).data) == 20  # 20 panels down


# ---- 2. edges that share their endpoints --------------------------------------------------------------
def _line_between(fig, start, end):
    """The line traces that run from ``start`` to ``end`` (their first and last points)."""
    return [t for t in fig.data if t.mode == "lines" and len(t.x) >= 2
            and np.allclose([t.x[0], t.y[0]], start) and np.allclose([t.x[-1], t.y[-1]], end)]


def test_eap_on_planted_iit_induction_shows_its_q_k_and_v_edges_apart_and_named(checkpoints_dir):
    from workbench.analysis.circuits import circuit_prompts, prompt_sources, run_method
    from workbench.checkpoint import read_meta

    path = checkpoints_dir / "planted-iit-induction"
    model, _ = wb.load_checkpoint(path)
    source = next(iter(prompt_sources(read_meta(path), model.cfg, path)))
    prompts = circuit_prompts(model, read_meta(path), source, n=8, seed=0, path=path)
    run = run_method(model, prompts, prompts.metrics[0], method="eap", top_k=20)  # the Circuit page's defaults
    frame = run.circuit.to_frame()
    pair = frame[(frame["sender"] == "L0H2") & (frame["receiver"].str.startswith("L1H1."))]
    assert sorted(pair["input"]) == ["k", "q", "v"], "EAP keeps the three edges (the K-composition among them)"
    fig = viz.circuit_graph_figure(frame)
    start = (1.0, 2.0)  # L0H2: layer 0 at x = 1, head 2
    end = (3.0, 1.0)  # L1H1
    lines = _line_between(fig, start, end)
    assert sorted(t.name for t in lines) == ["k", "q", "v"]
    middles = [(float(np.interp(0.5, np.linspace(0, 1, len(t.x)), t.x)), float(np.interp(0.5, np.linspace(0, 1, len(t.y)), t.y)))
               for t in lines]
    gaps = [math.dist(a, b) for i, a in enumerate(middles) for b in middles[i + 1:]]
    assert min(gaps) > 0.3, f"the three lines are drawn apart: their middles {middles}"
    named = {a.text for a in fig.layout.annotations if a.text in ("q", "k", "v")}
    assert named == {"q", "k", "v"}, "each of the three is named on its line"
    alone = _line_between(fig, (1.0, 2.0), (3.0, 2.0))  # L0H2 -> L1H2: one edge, straight
    assert len(alone) == 1 and len(alone[0].x) == 2


# ---- 3. the Graph page -------------------------------------------------------------------------------
def _graph_frames(features_in_one_cell: int, logits: int = 3, positions: int = 16):
    rows = [dict(id=f"T{p}", kind="token", layer=-1, pos=p, feature=p, influence=0.1) for p in range(positions)]
    rows += [dict(id=f"F0.{positions - 1}.{f}", kind="feature", layer=0, pos=positions - 1, feature=f,
                  influence=1.0 / (f + 1)) for f in range(features_in_one_cell)]
    rows += [dict(id=f"L{j}", kind="logit", layer=2, pos=positions - 1, feature=j, influence=0.0,
                  logit_weight=0.5 / (j + 1)) for j in range(logits)]
    nodes = pd.DataFrame(rows).fillna({"logit_weight": 0.0}).assign(activation=1.0, label="")
    edges = pd.DataFrame({"source": [0], "target": [positions], "weight": [1.0]})
    return nodes, edges


def _points(fig, kind):
    trace = next(t for t in fig.data if t.name == kind)
    size = np.broadcast_to(np.asarray(trace.marker.size, dtype=float), len(trace.x))
    return np.asarray(trace.x, float), np.asarray(trace.y, float), size


def test_graph_target_logits_do_not_overlap():
    nodes, edges = _graph_frames(1, logits=3)
    fig = viz.attribution_graph_figure(nodes, edges)
    x, y, size = _points(fig, "logit")
    per_position = viz.GRAPH_PLOT_WIDTH / 16
    px = np.sort(x) * per_position
    assert np.all(np.diff(px) > size.max()), f"logit centres {px} px apart, sizes {size}"
    assert x.max() == 15 and x.min() >= 0, "they stay over the prompt, the largest at its position"


def test_graph_nodes_of_a_crowded_cell_stay_apart_at_512_feature_rows():
    nodes, edges = _graph_frames(200)
    fig = viz.attribution_graph_figure(nodes, edges)
    x, y, size = _points(fig, "feature")
    low, high = fig.layout.yaxis.range
    plot_height = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    px = np.stack([x * viz.GRAPH_PLOT_WIDTH / 16, (y - low) / (high - low) * plot_height], 1)
    gaps = np.linalg.norm(px[:, None] - px[None], axis=-1) + np.eye(len(px)) * 1e9
    assert gaps.min() >= size.max(), f"nearest centres {gaps.min():.1f} px, largest node {size.max()} px"
    band = next(s for s in fig.layout.shapes if s.name == "L0")  # layer 0's band (a crowded layer's is taller)
    assert np.all(np.abs(x - 15) < 0.5) and np.all((band.y0 < y) & (y < band.y1)), "inside their (layer, position) cell"
    assert fig.layout.height <= viz.GRAPH_MAX_HEIGHT, "the crowded layer's rows fit in the figure's height"


def test_the_graph_export_is_what_to_circuit_tracer_writes_and_a_link_round_trips(tmp_path):
    from ui import graph as page

    torch.manual_seed(0)
    cfg = wb.ModelConfig(d_model=16, n_layers=2, n_heads=2, d_vocab=12, n_ctx=8, attn_only=True, seed=0)
    model = wb.HookedDecoder(cfg).eval()
    g = an.attribution_graph(model, None, torch.tensor([[1, 2, 3, 1, 2]]))
    written = g.to_circuit_tracer(tmp_path, slug="mine", node_threshold=0.9, edge_threshold=0.95)
    assert json.loads(page.export_json(g, "mine", 0.9, 0.95)) == json.loads(written.read_text())
    state = {"graph_ckpt": "stories-2026", "graph_prompt": "When Mary & John went, ok?", "graph_max_nodes": 512,
             "graph_node_threshold": 0.95, "graph_edge_threshold": 0.98, "graph_node": "F1.3.7", "graph_target": "top"}
    from urllib.parse import parse_qsl, urlsplit

    params = dict(parse_qsl(urlsplit(page.view_link(state)).query))
    assert params["page"] == "Graph"
    back = page.link_state(params, ["stories-2026"])
    assert back == state
    assert page.link_state({**params, "graph_ckpt": "elsewhere", "graph_max_nodes": "7"}, ["stories-2026"]).keys() \
        == state.keys() - {"graph_ckpt", "graph_max_nodes"}, "values that do not fit this server are dropped"


def test_a_link_round_trips_an_empty_minus_token():
    """An empty minus token (the token's logit alone) was left out of the link, and the page filled in
    its suggestion (" the"); the link now carries ``graph_wrong=``, read back as Streamlit parses it."""
    from urllib.parse import parse_qsl, urlsplit

    from ui import graph as page

    state = {"graph_ckpt": "stories-2026", "graph_prompt": "Ella and Ivy", "graph_target": "token",
             "graph_answer": " Ella", "graph_wrong": ""}
    link = page.view_link(state)
    assert "graph_wrong=&" in link + "&"
    params = dict(parse_qsl(urlsplit(link).query, keep_blank_values=True))  # as st.query_params does
    assert page.link_state(params, ["stories-2026"]) == state
    state["graph_wrong"] = " Ivy"
    assert page.link_state(dict(parse_qsl(urlsplit(page.view_link(state)).query, keep_blank_values=True)),
                           ["stories-2026"]) == state
    assert "graph_prompt" not in page.view_link({**state, "graph_prompt": ""})  # an empty prompt is no choice


def test_a_link_with_an_empty_minus_token_opens_the_graph_page_on_the_token_alone(checkpoints_dir, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("WORKBENCH_CHECKPOINTS", str(checkpoints_dir))
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=180)
    for key, value in {"page": "Graph", "graph_ckpt": PLANTED, "graph_target": "token", "graph_answer": "3",
                       "graph_wrong": ""}.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert (at.text_input(key="graph_answer").value, at.text_input(key="graph_wrong").value) == ("3", "")
    at.run()  # and it stays so on the next run
    assert at.text_input(key="graph_wrong").value == ""


PLANTED = "planted-hand-induction"


def test_the_qk_panel_follows_a_newly_chosen_head_to_its_strongest_entry(app, checkpoints_dir):
    at = app("Graph")
    at.selectbox(key="graph_ckpt").set_value(PLANTED).run()
    at.toggle(key="graph_qk_open").set_value(True).run()
    assert not at.exception
    model, _ = wb.load_checkpoint(checkpoints_dir / PLANTED)
    ids = [int(t) for t in at.text_area(key="graph_prompt").value.split()]
    entries = an.attention_entries(an.attribution_graph(model, None, torch.tensor([ids]), max_feature_nodes=128))
    first = entries.iloc[0]
    other = entries[(entries["layer"] != first["layer"]) | (entries["head"] != first["head"])].iloc[0]
    layer, head = int(other["layer"]), int(other["head"])
    at.selectbox(key="graph_qk_query").set_value(1).run()  # a query picked for the first head
    at.selectbox(key="graph_qk_layer").set_value(layer).run()
    at.selectbox(key="graph_qk_head").set_value(head).run()
    assert not at.exception
    state = [at.session_state[f"graph_qk_{w}"] for w in ("layer", "head", "query", "key")]
    assert state == [layer, head, int(other["query_pos"]), int(other["key_pos"])]


def test_a_link_opens_the_graph_page_on_its_view(app, checkpoints_dir, monkeypatch):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("WORKBENCH_CHECKPOINTS", str(checkpoints_dir))
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=180)
    for key, value in {"page": "Graph", "graph_ckpt": PLANTED, "graph_node_threshold": "0.9",
                       "graph_edge_threshold": "0.95"}.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="graph_ckpt").value == PLANTED
    assert at.slider(key="graph_node_threshold").value == pytest.approx(0.9)
    assert at.slider(key="graph_edge_threshold").value == pytest.approx(0.95)


# ---- 4. defaults that show something -----------------------------------------------------------------
def test_the_features_page_opens_on_the_feature_most_active_on_its_prompt(app, checkpoints_dir):
    from workbench.analysis import load_dictionary
    from workbench.analysis.features import feature_activations

    at = app("Features")
    assert not at.exception
    feature = at.selectbox(key="feat_id").value
    listed = [int(o.split(" ")[0].lstrip("#")) for o in at.selectbox(key="feat_id").options]
    model, tok = wb.load_checkpoint(checkpoints_dir / "stories-2026")
    folder = checkpoints_dir / "stories-2026" / "saes" / at.selectbox(key="feat_dict").value
    sae = load_dictionary(str(folder))
    ids = tok.encode(at.text_area(key="prompt").value)
    with torch.no_grad():
        peak = feature_activations(model, sae, torch.tensor([ids]))[0, 1:].max(dim=0).values
    best = max(listed, key=lambda f: float(peak[f]))
    assert float(peak[best]) > 0 and feature == best, (feature, float(peak[feature]), best, float(peak[best]))


def test_build_and_train_defaults_to_a_run_that_learns_and_draws_chance(app):
    at = app("Build & train")
    assert not at.exception
    assert at.number_input(key="bt_steps").value == 1500
    assert any("chance" in c.value for c in at.caption)
    fig = viz.live_loss_figure([{"step": 1, "train_loss": 4.2}, {"step": 2, "train_loss": 4.1}], 1500,
                               chance=math.log(64))
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert len(lines) == 1 and lines[0].y0 == lines[0].y1 == pytest.approx(math.log(64))


# ---- 7. exposure -------------------------------------------------------------------------------------
def test_the_server_binds_to_localhost_by_default():
    config = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "127.0.0.1"


def test_another_directory_opens_only_the_checkpoints_folder_unless_allowed(app, checkpoints_dir, tmp_path,
                                                                          monkeypatch):
    from ui import common

    monkeypatch.delenv(common.ALLOW_ANY_PATH_ENV, raising=False)
    outside = tmp_path / "mine"
    outside.mkdir()
    links = tmp_path / "links"
    links.mkdir()
    (links / "shipped").symlink_to(checkpoints_dir / "stories-2026", target_is_directory=True)
    assert "outside the checkpoints folder" in common.path_refusal(str(outside), root=checkpoints_dir, argv=[])
    assert "--allow-any-path" in common.path_refusal("/etc", root=checkpoints_dir, argv=[])
    assert common.path_refusal(str(checkpoints_dir / "../../etc"), root=checkpoints_dir, argv=[]) is not None
    assert common.path_refusal(str(checkpoints_dir / "stories-2026"), root=checkpoints_dir, argv=[]) is None
    assert common.path_refusal(str(links / "shipped"), root=links, argv=[]) is None  # a link in the folder
    assert common.path_refusal(str(outside), root=checkpoints_dir, uploads=tmp_path, argv=[]) is None
    assert common.path_refusal(str(outside), root=checkpoints_dir, argv=["--allow-any-path"]) is None
    monkeypatch.setenv(common.ALLOW_ANY_PATH_ENV, "1")
    assert common.path_refusal(str(outside), root=checkpoints_dir, argv=[]) is None
    monkeypatch.delenv(common.ALLOW_ANY_PATH_ENV)
    at = app("Inspect")
    at.selectbox(key="ckpt").set_value(common.OTHER_DIR).run()
    at.text_input(key="ckpt_dir").set_value(str(checkpoints_dir.resolve().parent)).run()
    assert not at.exception
    assert any("outside the checkpoints folder" in e.value for e in at.error)
    at.text_input(key="ckpt_dir").set_value(str(checkpoints_dir / "stories-2020")).run()
    assert not at.error and at.session_state["ckpt_dir"].endswith("stories-2020")


# ---- 8. a clean terminal -----------------------------------------------------------------------------
@pytest.fixture
def logged(monkeypatch):
    """What Streamlit's widget-policy and deprecation loggers print (each warning every time)."""
    import streamlit.deprecation_util as deprecation
    import streamlit.elements.lib.policies as policies

    records = []

    class Logger:
        def warning(self, message, *args, **kwargs):
            records.append(message % args if args else message)
            policies._shown_default_value_warning = False  # once per process in Streamlit: every time here

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(policies, "_LOGGER", Logger())
    monkeypatch.setattr(deprecation, "_LOGGER", Logger())
    return records


@pytest.mark.parametrize("name", ["Inspect", "Circuit", "Graph"])
def test_pages_log_no_stack_trace_or_deprecation_when_used_and_revisited(app, logged, name):
    at = app(name)
    at.run()
    at.session_state["page"] = "Ablate"
    at.run()
    at.session_state["page"] = name
    at.run()
    assert not at.exception
    assert logged == []


def test_compare_opens_with_the_same_checkpoint_as_a_and_b(app):
    at = app("Compare")
    at.selectbox(key="ckpt_b").set_value(at.selectbox(key="ckpt").value).run()  # raised StreamlitDuplicateElementKey
    assert not at.exception, [e.value for e in at.exception]


@pytest.mark.parametrize("args,address,watcher", [
    ([], "127.0.0.1", "none"), (["--server.address", "0.0.0.0"], "0.0.0.0", "none"),
    (["--server.fileWatcherType=auto"], "127.0.0.1", None), (["--server.fileWatcherType", "poll"], "127.0.0.1", "poll")])
def test_workbench_sh_app_binds_to_localhost_and_watches_no_files_unless_told(monkeypatch, args, address, watcher):

    from streamlit.web import cli

    from ui import serve

    seen = {}
    monkeypatch.setattr(serve, "_preload", None)  # main starts a thread: not left behind for other tests
    monkeypatch.setattr(serve, "preload", lambda argv: "preloaded")
    monkeypatch.setattr(cli, "main", lambda: seen.setdefault("argv", list(sys.argv)) and 0)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit):
        serve.main([*args, "--", "--checkpoints", "x"])
    argv = seen["argv"]
    assert argv[argv.index("--server.address") + 1] == address and argv.count("--server.address") == 1
    watching = [arg for arg in argv if arg.startswith("--server.fileWatcherType")]
    assert len(watching) == 1
    if watcher is not None:  # given as two words (or set by the launcher)
        assert argv[argv.index("--server.fileWatcherType") + 1] == watcher
    assert argv[-3:] == ["--", "--checkpoints", "x"]


def test_the_apps_config_watches_no_files():
    """Plain ``streamlit run app.py`` from the repository reads .streamlit/config.toml: no file watcher,
    whose walk of the app's folder (.venv/ included) held the first session back 1.5-2 s."""
    config = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    assert config["server"]["fileWatcherType"] == "none" and config["server"]["address"] == "127.0.0.1"


def _fresh_python(code: str) -> str:
    """What ``code`` prints in a fresh interpreter started in the repository (it must exit cleanly)."""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_serve_imports_streamlit_whole_before_the_preload_thread_starts():
    """Importing Streamlit sets up its plotly theme, and plotly looks pandas up in sys.modules: with the
    preload thread halfway through importing pandas, the server's start raised AttributeError (a
    partially initialized pandas) and never came up. In a fresh process, when ``main`` starts the
    preload, Streamlit (its plotly element, the theme) must already be in."""
    code = ("import sys; sys.path.insert(0, '.'); from ui import serve\n"
            "seen = []\n"
            "serve.start_preload = lambda args, after=None: seen.append('streamlit.elements.plotly_chart' in sys.modules)\n"
            "try:\n    serve.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(seen)\n")
    assert _fresh_python(code).splitlines()[-1] == "[True]"


def test_workbench_sh_apps_launcher_starts_with_a_clean_terminal(tmp_path):
    """``python -m ui.serve`` (what ./workbench.sh app runs) up to its preload's line: the server comes up,
    and its output has no warning and no stack trace. The preload fills the pages' caches outside a
    script run on purpose; Streamlit's "missing ScriptRunContext! ... bare mode" warning printed on
    every launch."""
    import time

    from browser_kit import _free_port

    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "ui.serve", "--server.headless", "true", "--server.port", str(_free_port()),
           "--", "--checkpoints", str(REPO / "checkpoints")]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "WORKBENCH_TIMINGS": "1"})
        try:
            deadline = time.time() + 240
            while "preload" not in log_path.read_text() and proc.poll() is None and time.time() < deadline:
                time.sleep(0.2)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    out = log_path.read_text()
    assert "preloaded the app's imports and stories-2026" in out, out[-3000:]
    assert "Uvicorn server started" in out or "You can now view" in out, out[-3000:]
    assert "WARNING" not in out and "Traceback" not in out and "missing ScriptRunContext" not in out, out[-3000:]
    # The preload began once the server listened: beside the server's own start, both took turns at the
    # interpreter and the server answered later.
    phases = [line.split()[1] for line in out.splitlines() if line.startswith("timing ")]
    assert phases.index("server") < phases.index("pandas"), out[-3000:]


def test_wait_for_light_returns_once_a_preload_ends_however_it_ended(monkeypatch):
    """A preload that ends without importing pandas (it failed first, or a stand-in replaced it) must not
    leave app.py's first run waiting for ever: a later AppTest run in the same process hung there."""
    import threading

    from ui import serve

    monkeypatch.setattr(serve, "_preload", None)
    monkeypatch.setattr(serve, "_light", threading.Event())
    monkeypatch.setattr(serve, "preload", lambda argv: "preloaded, nothing imported")
    serve.start_preload([]).join(timeout=30)
    waiter = threading.Thread(target=serve.wait_for_light, daemon=True)
    waiter.start()
    waiter.join(timeout=10)
    assert not waiter.is_alive()


def test_the_preload_has_pandas_and_plotly_whole_before_torch():
    """app.py's first figure waits only for these two (``serve.wait_for_light``): in a fresh process, when
    that wait returns, both are whole (not half-imported), and the preload is still at work."""
    code = ("import sys; sys.path.insert(0, '.'); from ui import serve\n"
            "serve.start_preload(['--checkpoints', 'checkpoints'])\n"
            "serve.wait_for_light()\n"
            "whole = [not getattr(sys.modules[m].__spec__, '_initializing', False) for m in ('pandas', 'plotly.io')]\n"
            "print(whole, serve._preload.is_alive())\n"
            "serve.wait_for_preload()\n")
    assert _fresh_python(code).splitlines()[0] == "[True, True] True"


# ---- 6. the first page: preloaded while the server starts, nothing heavy left for it --------------
def test_serve_starts_the_server_while_preloading_and_the_first_run_waits_for_the_preload(monkeypatch):
    import threading

    from streamlit.web import cli

    from ui import serve

    from streamlit.web import bootstrap

    release, seen, listening = threading.Event(), {}, threading.Event()

    def slow_preload(argv):
        seen["the server listened before the preload began"] = listening.is_set()
        release.wait(timeout=2)  # the server must start before this ends (it waited for all of it before)
        seen["preloaded"] = argv
        return "preloaded"

    def fake_cli():
        time.sleep(0.3)  # the server's start: the preload waits for it
        listening.set()
        bootstrap._on_server_start(None)  # what Streamlit's bootstrap calls once the server listens
        seen["server started before the preload ended"] = "preloaded" not in seen
        release.set()
        serve.wait_for_preload()  # what app.py does first
        seen["preloaded before the script went on"] = seen.get("preloaded")
        return 0

    monkeypatch.setattr(serve, "_preload", None)
    monkeypatch.setattr(serve, "preload", slow_preload)
    monkeypatch.setattr(cli, "main", fake_cli)
    monkeypatch.setattr(bootstrap, "_on_server_start", lambda server: None)  # serve.main wraps this
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit):
        serve.main(["--", "--checkpoints", "x"])
    assert seen["the server listened before the preload began"] is True
    assert seen["server started before the preload ended"] is True
    assert seen["preloaded before the script went on"] == ["--checkpoints", "x"]
    assert "serve.wait_for_preload()" in (REPO / "app.py").read_text().split("import torch")[0]


FIRST_RUN = """
import json, os, sys
sys.path.insert(0, os.getcwd())
from ui import serve
serve.preload([])
from streamlit.testing.v1 import AppTest
from ui import common
path, = common.LOADS  # the default checkpoint, which the preload loaded
model = common._load(path, common.weights_stamp(path), common.app_device())[0]
forwards = []
model.register_forward_pre_hook(lambda module, args: forwards.append(1))
before = set(sys.modules)
at = AppTest.from_file(os.path.join(os.getcwd(), "app.py"), default_timeout=300)
at.run()
assert not at.exception, [e.value for e in at.exception]
print(json.dumps({"new": sorted(set(sys.modules) - before), "loads": list(common.LOADS.values()),
                  "forwards": len(forwards), "all": sorted(sys.modules)}))
"""


def test_after_the_preload_the_first_page_imports_nothing_heavy_loads_the_model_once_and_runs_no_forward(
        checkpoints_dir):
    """In a fresh process, as ``python -m ui.serve`` runs: the preload then the first Inspect run.
    The preload left out the Graph page (and its QK panel and vocabulary browser), which the first run
    then imported; any library, page or torch module still imported there is time the first page pays.
    The preload also computes the page's analyses of the default prompt (``inspect.precompute``), so
    the first run makes no forward of the model (it made five, one per analysis, then one shared)."""
    import os

    env = {**os.environ, "WORKBENCH_CHECKPOINTS": str(checkpoints_dir)}
    out = subprocess.run([sys.executable, "-c", FIRST_RUN], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    heavy = [m for m in seen["new"] if m.split(".")[0] in ("ui", "workbench", "torch", "transformer_lens",
                                                           "transformers", "scipy", "sklearn")]
    assert heavy == []
    assert seen["loads"] == [1]  # the default checkpoint, read once (by the preload), found by the page
    assert seen["forwards"] == 0  # every analysis of the default prompt found in the cache the page reads
    # TransformerLens's hook points came without the package's datasets and transformers (ui/tl_import.py)
    assert [m for m in ("datasets", "transformers", "pytest") if m in seen["all"]] == []


def test_workbench_sh_app_byte_compiles_the_apps_modules_before_starting(tmp_path):
    """Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE=1, as on the project's machines), each start
    of the app compiled the workbench and ui sources again (0.2 s of the first page). ``./workbench.sh app``
    compiles them first, as pip does for the packages it installs: its command, run on a copy of ui/
    with bytecode writing off, leaves a .pyc per module, and comes before the server's start."""
    import os
    import shlex
    import shutil

    branch = (REPO / "workbench.sh").read_text().split("\n  app)")[1].split(";;")[0]
    compile_line = next(line for line in branch.splitlines() if "compileall" in line).strip()
    assert branch.index("compileall") < branch.index("-m ui.serve")
    argv = shlex.split(compile_line.split(">")[0])
    assert argv[0] == '$VENV/bin/python' and argv[1:4] == ["-m", "compileall", "-q"] and "ui" in argv
    shutil.copytree(REPO / "ui", tmp_path / "ui", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", "ui"], cwd=tmp_path, env=env, check=True)
    sources = sorted(p.stem for p in (tmp_path / "ui").glob("*.py"))
    compiled = sorted(p.name.split(".")[0] for p in (tmp_path / "ui" / "__pycache__").glob("*.pyc"))
    assert sources and compiled == sources
