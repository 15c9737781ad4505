"""Fuzzing the graph readers: every damaged graph file either loads to a consistent graph or is
refused with a ValueError, never another exception.

Two documents are damaged: a graph ``Graph.save`` wrote and the circuit-tracer JSON
``Graph.to_circuit_tracer`` wrote, both of a real attribution graph of a tiny model. Each case
damages one copy (a truncation, a few flipped bytes, a field deleted or set to a hostile value:
a wrong type, a huge number, NaN, infinity, deep nesting, a list one longer or shorter or nested
one level more) and reads it with ``Graph.load`` or ``Graph.from_circuit_tracer``. A graph that
loads must answer for itself: its influence and scores are finite and in range, it prunes, makes
its frames and its circuit-tracer dict, and saves and loads again unchanged. (The loaders' own
size cap and memory are tested in tests/test_graph_io.py.)

    python tests/test_fuzz_graph_files.py SEED CASES    # a longer run by hand
"""

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from factories import json_paths

from workbench.analysis.graphs import Graph

HOSTILE = [None, -1, 0, 1, 10**12, 2**63, -2**70, 1.5, 1e308, -1e300, float("nan"), "x", "", [], {}, True,
           [1, 2], {"a": 1}, "../../etc", [[1.0]], "__DEEP__", "__DEEP500__", "__INF__"]
DEEP = "[" * 100000 + "]" * 100000


def _damage(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    kind = rng.choice(["truncate", "flip", "json", "json", "json", "shape"])
    if kind == "truncate":
        at = rng.randrange(0, len(data))
        return data[:at], f"truncate at {at} of {len(data)}"
    if kind == "flip":
        out, where = bytearray(data), []
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(0, len(data))
            out[i] ^= 1 << rng.randrange(8)
            where.append(i)
        return bytes(out), f"flip bytes {where}"
    doc = json.loads(data)
    paths = [p for p in json_paths(doc, 6) if p]
    if kind == "shape":
        lists = [p for p in paths if isinstance(_at(doc, p), list) and _at(doc, p)]
        path = rng.choice(lists)
        value = _at(doc, path)
        how = rng.choice(["longer", "shorter", "nested", "scalar"])
        new = {"longer": value + value[-1:], "shorter": value[:-1], "nested": [[value[0]]] + value[1:], "scalar": value[0]}[how]
        _at(doc, path[:-1])[path[-1]] = new
        return json.dumps(doc).encode(), f"{how} {list(path)}"
    path = rng.choice(paths)
    parent = _at(doc, path[:-1])
    if rng.random() < 0.25 and isinstance(parent, dict):
        del parent[path[-1]]
        return json.dumps(doc).encode(), f"delete {list(path)}"
    value = rng.choice(HOSTILE)
    parent[path[-1]] = value
    text = json.dumps(doc).replace('"__DEEP__"', DEEP).replace('"__INF__"', "1e400")  # json.loads: inf
    text = text.replace('"__DEEP500__"', "[" * 500 + "]" * 500)  # parses: deeper than a graph, within Python's limit
    return text.encode(), f"set {list(path)} = {value!r:.40}"


def _at(doc, path):
    for key in path:
        doc = doc[key]
    return doc


def _consistent(g: Graph, work: Path) -> None:
    """What a loaded graph must do without raising anything."""
    inf = g.influence()
    assert torch.isfinite(inf).all() and (inf >= 0).all()
    scores = g.scores()
    assert all(math.isfinite(v) and -1e-6 <= v <= 1 + 1e-6 for v in scores.values()), scores
    nodes, edges = g.to_frame()
    assert len(nodes) == g.n_nodes and len(edges) == g.n_edges and len(set(g.node_ids())) == g.n_nodes
    json.dumps(g.to_circuit_tracer_dict(), allow_nan=False)  # prunes
    back = Graph.load(g.save(work / "again.json"))
    assert torch.equal(back.edge_target, g.edge_target) and torch.equal(back.kind, g.kind)


def run(graph: Graph, seed: int, cases: int, work: Path) -> dict:
    saved = graph.save(work / "graph.json").read_bytes()
    exported = graph.to_circuit_tracer(work / "ct", slug="tiny").read_bytes()
    readers = {"ours": (saved, Graph.load), "circuit-tracer": (exported, Graph.from_circuit_tracer)}
    rng = random.Random(seed)
    stats = {name: {"cases": 0, "loaded": 0, "refused": 0} for name in readers}
    failures = []
    for case in range(cases):
        name = list(readers)[case % 2]
        original, load = readers[name]
        damaged, how = _damage(original, rng)
        path = work / f"case-{case}.json"
        path.write_bytes(damaged)
        stats[name]["cases"] += 1
        try:
            g = load(path)
        except ValueError:
            stats[name]["refused"] += 1
            continue
        except Exception as e:  # noqa: BLE001 - exactly what the test looks for
            failures.append([name, how, f"{type(e).__name__}: {str(e)[:300]}"])
            continue
        finally:
            path.unlink()
        try:
            _consistent(g, work)
            stats[name]["loaded"] += 1
        except Exception as e:  # noqa: BLE001
            failures.append([name, how, f"loaded, then {type(e).__name__}: {str(e)[:300]}"])
    return {"stats": stats, "failures": failures}


@pytest.fixture(scope="module")
def graph() -> Graph:
    from test_graph_io import small_graph

    return small_graph(max_feature_nodes=24, max_n_logits=3)


def test_damaged_graph_files_load_consistent_or_are_refused(graph, tmp_path):
    result = run(graph, seed=0, cases=600, work=tmp_path)
    assert not result["failures"], "\n".join(map(str, result["failures"][:20]))
    for name, stats in result["stats"].items():
        assert stats["refused"] > 20 and stats["loaded"] > 5, result["stats"]  # both outcomes exercised


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_graph_io import small_graph

    out = run(small_graph(max_feature_nodes=24, max_n_logits=3), int(sys.argv[1]), int(sys.argv[2]), Path(tempfile.mkdtemp()))
    print(json.dumps(out["stats"]), *out["failures"][:30], sep="\n")
