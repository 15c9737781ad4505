"""Graph files, read and written as a careless or hostile user would (issue 34, items 2 and 7).

Writing: ``Graph.save`` and ``Graph.to_circuit_tracer`` write only the files they name, inside the
folder given, and replace a file only when it is one of theirs (or ``overwrite=True`` names it);
a damaged listing is reported before anything is written. Reading: ``Graph.load`` and
``Graph.from_circuit_tracer`` refuse a damaged or inconsistent file with one ValueError naming the
field (never a KeyError, TypeError or RecursionError), and a file over the size cap before reading it.
Each test fails on the code before the fix.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from factories import tiny

import workbench as wb
from workbench.analysis.dictionaries import DictionaryConfig
from workbench.analysis.dictionaries.registry import make_dictionary
from workbench.analysis.graphs import Graph, attribution_graph


def small_graph(**settings) -> Graph:
    """A real attribution graph of a tiny model with random transcoders (a second or two)."""
    model = wb.HookedDecoder(tiny(init_std=0.1, d_vocab=40)).eval()
    g = torch.Generator().manual_seed(0)
    tcs = []
    for layer in range(model.cfg.n_layers):
        tc = make_dictionary(DictionaryConfig(kind="skip_transcoder", d_in=32, d_sae=24, d_out=32,
                                              hook_name=f"blocks.{layer}.ln2.hook_normalized",
                                              hook_name_out=f"blocks.{layer}.hook_mlp_out"))
        tc.init_weights(g)
        with torch.no_grad():
            tc.W_enc.mul_(1.5)
            tc.b_enc.copy_(-0.4 * torch.rand(24, generator=g))
            tc.W_dec.mul_(0.3)
        tcs.append(tc.eval())
    return attribution_graph(model, tcs, torch.randint(0, 40, (1, 6), generator=g), **settings)


@pytest.fixture(scope="module")
def graph() -> Graph:
    return small_graph()


def _hand_graph(edges=((3, 0, 0.5), (4, 0, 0.25), (4, 1, 0.25), (4, 2, 0.5), (3, 2, 0.1))) -> Graph:
    """Two positions, two layers: feature 1 of layer 0 at position 1 (node 0), the error of layer 1 at
    position 1 (node 1: circuit-tracer calls it "0_1_1", the id of node 0 too), a token (node 2),
    a feature of layer 1 (node 3) and a logit (node 4)."""
    t, s, w = zip(*edges)
    return Graph(kind=torch.tensor([0, 1, 2, 0, 3]), layer=torch.tensor([0, 1, -1, 1, 2]),
                 pos=torch.tensor([1, 1, 1, 1, 1]), feature=torch.tensor([1, -1, 7, 5, 9]),
                 activation=torch.tensor([1.0, 0.5, 0.0, 2.0, 3.0]), logit_weight=torch.tensor([0, 0, 0, 0, 1.0]),
                 logit_labels=["x"], edge_target=torch.tensor(t), edge_source=torch.tensor(s),
                 edge_weight=torch.tensor(w), tokens=torch.tensor([3, 7]), str_tokens=["a", "b"], n_layers=2,
                 meta={"d_vocab": 40})


def _same(a: Graph, b: Graph) -> None:
    for name in ("kind", "layer", "pos", "feature", "edge_target", "edge_source", "tokens"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("activation", "logit_weight", "edge_weight"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name))
    assert (a.logit_labels, a.str_tokens, a.n_layers) == (b.logit_labels, b.str_tokens, b.n_layers)


# ---- writing ------------------------------------------------------------------------------------------------
def test_save_refuses_a_file_it_did_not_write(graph, tmp_path):
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "notes"}')
    with pytest.raises(ValueError, match="overwrite=True"):
        graph.save(mine)
    assert mine.read_text() == '{"my": "notes"}'
    folder = tmp_path / "a-folder"
    folder.mkdir()
    with pytest.raises(ValueError, match="folder"):
        graph.save(folder, overwrite=True)
    graph.save(mine, overwrite=True)  # named: replaced
    again = graph.save(mine)  # our own file: replaced without asking
    _same(Graph.load(again), graph)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-folder", "notes.json"]  # no temporary left


def test_export_refuses_a_user_file_of_the_slugs_name(graph, tmp_path):
    folder = tmp_path / "ct"
    folder.mkdir()
    (folder / "ioi.json").write_text("my own ioi notes")
    with pytest.raises(ValueError, match="overwrite=True"):
        graph.to_circuit_tracer(folder, slug="ioi")
    assert (folder / "ioi.json").read_text() == "my own ioi notes"
    assert not (folder / "graph-metadata.json").exists()
    graph.to_circuit_tracer(folder, slug="ioi", overwrite=True)
    graph.to_circuit_tracer(folder, slug="ioi")  # its own earlier export: replaced
    listing = json.loads((folder / "graph-metadata.json").read_text())
    assert [g["slug"] for g in listing["graphs"]] == ["ioi"]
    assert sorted(p.name for p in folder.iterdir()) == ["graph-metadata.json", "ioi.json"]


@pytest.mark.parametrize("slug", ["../outside", "sub/inner", "/tmp/abs", "..", "graph-metadata", "Graph-Metadata",
                                  "", ".hidden", "a\x00b"])
def test_export_refuses_a_slug_that_is_not_a_plain_name(graph, tmp_path, slug):
    folder = tmp_path / "ct"
    folder.mkdir()
    (folder / "graph-metadata.json").write_text(json.dumps({"graphs": []}))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="slug"):
        graph.to_circuit_tracer(folder, slug=slug)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert json.loads((folder / "graph-metadata.json").read_text()) == {"graphs": []}


@pytest.mark.parametrize("listing", ["{not json", '{"graphs": {}}', '["graphs"]', '{"graphs": [{"name": 1}]}',
                                     '{"graphs": [' * 100000])
def test_a_damaged_listing_is_reported_before_anything_is_written(graph, tmp_path, listing):
    folder = tmp_path / "ct"
    folder.mkdir()
    (folder / "graph-metadata.json").write_text(listing)
    with pytest.raises(ValueError, match="graph-metadata.json"):
        graph.to_circuit_tracer(folder, slug="ioi")
    assert not (folder / "ioi.json").exists()
    assert (folder / "graph-metadata.json").read_text() == listing


def test_export_into_a_file_is_refused(graph, tmp_path):
    (tmp_path / "ct").write_text("a file")
    with pytest.raises(ValueError, match="not a folder"):
        graph.to_circuit_tracer(tmp_path / "ct", slug="ioi")


def test_error_node_ids_never_clash_with_feature_ids():
    """circuit-tracer names the error of layer l at position p "0_l_p": the id of feature l of layer 0 there."""
    g = _hand_graph()
    d = g.to_circuit_tracer_dict(prune=False)
    ids = [n["node_id"] for n in d["nodes"]]
    assert len(ids) == len(set(ids)) == 5
    assert "0_1_1" in ids  # the feature keeps circuit-tracer's id
    back = Graph.from_circuit_tracer(d)
    assert sorted(back.kind.tolist()) == [0, 0, 1, 2, 3]
    assert sorted(zip(back.kind[back.edge_source].tolist(), back.edge_weight.tolist())) == \
        sorted(zip(g.kind[g.edge_source].tolist(), g.edge_weight.tolist()))
    lone = _hand_graph(edges=((3, 1, 0.5), (4, 3, 1.0), (4, 2, 0.5)))  # no feature 0_1_1 kept: circuit-tracer's id
    lone_ids = {n["node_id"] for n in lone.to_circuit_tracer_dict(prune=False)["nodes"] if n["feature"] == -1}
    assert lone_ids == {"0_1_1"}


# ---- reading ------------------------------------------------------------------------------------------------
def test_round_trips_keep_everything_and_unknown_meta(graph, tmp_path):
    graph.meta["someone_elses_key"] = {"nested": [1, 2, {"x": None}]}
    try:
        back = Graph.load(graph.save(tmp_path / "g.json"))
    finally:
        del graph.meta["someone_elses_key"]
    _same(back, graph)
    assert back.meta["someone_elses_key"] == {"nested": [1, 2, {"x": None}]}
    torch.testing.assert_close(back.logit_vectors, graph.logit_vectors)
    path = graph.to_circuit_tracer(tmp_path / "ct", slug="tiny")
    pruned, again = graph.prune(), Graph.from_circuit_tracer(path)
    assert again.n_edges == pruned.n_edges
    assert sorted(again.edge_weight.tolist()) == pytest.approx(sorted(pruned.edge_weight.tolist()))


def _saved(graph, tmp_path, edit) -> Path:
    d = graph.to_dict()
    edit(d)
    path = tmp_path / "g.json"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.pop("edge_weight"), "edge_weight"),  # was KeyError
    (lambda d: d.update(kind=5), "kind"),  # was TypeError
    (lambda d: d.update(n_layers="2"), "n_layers"),
    (lambda d: d.update(logit_labels=None), "logit_labels"),
    (lambda d: d["edge_target"].__setitem__(0, 10**6), "edge_target"),  # was a graph whose influence raised IndexError
    (lambda d: d["edge_weight"].__setitem__(0, float("nan")), "edge_weight"),
    (lambda d: d["activation"].__setitem__(0, 1e300), "activation"),  # was inf in float32
    (lambda d: d["logit_weight"].__setitem__(-1, -3e29), "logit_weight"),  # was a replacement score of ~-2e29
    (lambda d: d["pos"].__setitem__(0, 99), "pos"),
    (lambda d: d["edge_source"].append(0), "edge_target, edge_source and edge_weight"),
    (lambda d: d.update(kind=d["kind"][:-1]), "kind has"),
    (lambda d: d["layer"].__setitem__(0, [1]), "layer"),
    (lambda d: d.update(meta=[1]), "meta"),
    (lambda d: d.update(qk={"columns": ["a"], "rows": [[1, 2]]}), "qk.rows"),
    (lambda d: d.update(logit_vectors=[[1.0]]), "logit_vectors"),
    (lambda d: d.update(format="other"), "format"),
])
def test_a_damaged_graph_file_is_one_value_error_naming_the_field(graph, tmp_path, edit, field):
    path = _saved(graph, tmp_path, edit)
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        Graph.load(path)


def test_inconsistent_edges_are_refused(tmp_path):
    for edges, what in [(((3, 0, 0.5), (3, 0, 0.5)), "twice"), (((0, 3, 0.5),), "later layer"),
                        (((2, 0, 0.5),), "into a token"), (((3, 4, 0.5),), "out of a logit")]:
        d = _hand_graph(edges).to_dict()
        with pytest.raises(ValueError, match=what):
            Graph.from_dict(d)
    d = _hand_graph().to_dict()
    d["feature"][3] = 1
    d["layer"][3] = 0
    with pytest.raises(ValueError, match="appears twice"):  # two nodes F0.1.1
        Graph.from_dict(d)


def test_deep_nesting_is_a_value_error_not_a_recursion_error(graph, tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200000 + "]" * 200000)
    with pytest.raises(ValueError, match="nested too deeply"):
        Graph.load(path)
    with pytest.raises(ValueError, match="nested too deeply"):
        Graph.from_circuit_tracer(path)
    d = graph.to_dict()
    deep: list = []
    for _ in range(500):  # under Python's recursion limit when parsed, over the graph file's depth
        deep = [deep]
    d["meta"] = {"deep": deep}
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="meta is nested"):
        Graph.load(path)


def test_a_file_over_the_size_cap_is_refused_before_it_is_read(graph, tmp_path, monkeypatch):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(300 * 2**20)  # sparse: 300 MiB on paper, nothing on disk
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k))
    with pytest.raises(ValueError, match="max_bytes"):
        Graph.load(big)
    with pytest.raises(ValueError, match="max_bytes"):
        Graph.from_circuit_tracer(big)
    assert str(big) not in opened
    path = graph.save(tmp_path / "g.json")
    with pytest.raises(ValueError, match="max_bytes"):
        Graph.load(path, max_bytes=os.stat(path).st_size - 1)
    _same(Graph.load(path, max_bytes=None), graph)


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.pop("nodes"), "nodes"),  # was KeyError
    (lambda d: d["links"].append({"source": "nowhere", "target": d["links"][0]["target"], "weight": 1.0}),
     "links"),  # was silently dropped
    (lambda d: d["nodes"].append(dict(d["nodes"][0])), "names two nodes"),
    (lambda d: d["nodes"][0].update(ctx_idx="3"), "ctx_idx"),  # was a str position
    (lambda d: d["nodes"][0].update(ctx_idx=99), "ctx_idx"),
    (lambda d: d["nodes"][0].pop("feature_type"), "feature_type"),
    (lambda d: d["links"][0].update(weight=None), "weight"),  # was TypeError
    (lambda d: d["metadata"].pop("prompt_tokens"), "prompt_tokens"),
    (lambda d: [n.update(token_prob=-3e29) for n in d["nodes"] if n["feature_type"] == "logit"], "logit_weight"),
    (lambda d: [n.update(node_id="5_x_y") for n in d["nodes"] if n["feature_type"] == "cross layer transcoder"],
     "node_id"),
])
def test_a_damaged_circuit_tracer_file_is_one_value_error_naming_the_field(graph, tmp_path, edit, field):
    d = graph.to_circuit_tracer_dict("tiny")
    edit(d)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=field):
        Graph.from_circuit_tracer(path)


def test_a_graph_without_edges_loads_prunes_and_exports(graph, tmp_path):
    d = graph.to_circuit_tracer_dict("tiny")
    d["links"] = []
    back = Graph.from_circuit_tracer(d)
    assert back.n_edges == 0 and back.prune().n_edges == 0  # was an IndexError in pruning
    assert {n["feature_type"] for n in back.to_circuit_tracer_dict()["nodes"]} == {"embedding", "logit"}


def test_concurrent_exports_into_one_folder_keep_every_listing_entry(graph, tmp_path, monkeypatch):
    """Each export reads the listing, adds its slug and writes it back; a slowed read makes two at once overlap."""
    import threading
    import time

    real_loads = json.loads

    def slow_loads(*args, **kwargs):
        time.sleep(0.05)
        return real_loads(*args, **kwargs)

    graph.prune_masks()  # warm
    dicts = {f"g{i}": graph.to_circuit_tracer_dict(f"g{i}") for i in range(4)}
    monkeypatch.setattr(Graph, "to_circuit_tracer_dict", lambda self, slug, *a, **k: dicts[slug])
    monkeypatch.setattr(json, "loads", slow_loads)
    errors = []

    def export(slug):
        try:
            graph.to_circuit_tracer(tmp_path / "ct", slug=slug)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=export, args=(slug,)) for slug in dicts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    listing = real_loads((tmp_path / "ct" / "graph-metadata.json").read_text())
    assert sorted(g["slug"] for g in listing["graphs"]) == sorted(dicts)
    assert sorted(p.name for p in (tmp_path / "ct").iterdir()) == ["g0.json", "g1.json", "g2.json", "g3.json",
                                                                  "graph-metadata.json"]


def test_save_refuses_a_graph_the_loader_would_refuse(tmp_path):
    g = _hand_graph()
    g.edge_weight[0] = float("nan")
    with pytest.raises(ValueError, match="edge_weight"):
        g.save(tmp_path / "g.json")  # was written, and then no reader could take it back
    assert not list(tmp_path.iterdir())
