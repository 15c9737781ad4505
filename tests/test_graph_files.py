"""An attribution graph's spill folder, and the inputs a graph refuses before it computes anything.

A spill folder belongs to one computation: two graphs into one folder at once either both give
their own graph or one is refused with a ValueError (an audit ran two processes into one folder
and got crashes, and graphs whose edges were another prompt's). A path that is a file, a name too
long, a read-only folder, a busy folder or one holding another run's chunks, transcoders of the
wrong width and an empty target list are each one ValueError raised before the clean run
(``capture`` is replaced by a trap that fails the test if it is reached).
"""

import os
import threading
from pathlib import Path

import pytest
import torch
from factories import tiny
from test_graphs import _transcoders

import workbench as wb
import workbench.analysis.graphs.attribute as attribute
from workbench.analysis.dictionaries import DictionaryConfig
from workbench.analysis.dictionaries.registry import make_dictionary
from workbench.analysis.graphs import attribution_graph
from workbench.checkpoint import locked


def _model():
    return wb.HookedDecoder(tiny(init_std=0.1, d_vocab=40, norm="rmsnorm", positional="rope")).eval()


def _prompt(seed: int) -> torch.Tensor:
    return torch.randint(0, 40, (1, 8), generator=torch.Generator().manual_seed(seed))


def _edges(graph) -> tuple:
    return graph.edge_target.long(), graph.edge_source.long(), graph.edge_weight


def _trap_capture(monkeypatch) -> None:
    """Fail the test if the graph gets as far as its clean run (every refusal here comes before it)."""
    def computed(*args, **kwargs):
        raise AssertionError("the graph computed before refusing")

    monkeypatch.setattr(attribute, "capture", computed)


@pytest.fixture(scope="module")
def setup():
    model = _model()
    return model, _transcoders(model)


def test_two_graphs_into_one_spill_folder_never_give_a_wrong_graph(tmp_path, monkeypatch, setup):
    """Two threads (the lock is an flock, which holds between threads and processes alike) compute the
    graphs of two different prompts into one folder, both let into their computation together. Each
    gives its own prompt's graph (edges equal to the in-memory graph, read after both finished) or a
    ValueError; before, they shared chunk names (raw-edges-00000 ...) and deleted or overwrote each
    other's files."""
    model, tcs = setup
    kw = dict(edge_chunk=150, max_feature_nodes=20, batch_size=4)
    prompts = {0: _prompt(1), 1: _prompt(2)}
    expected = {i: _edges(attribution_graph(model, tcs, p, **kw)) for i, p in prompts.items()}
    folder = tmp_path / "shared"
    inside, done, cond = [0], [0], threading.Condition()
    real = attribute.capture

    def capture(*args, **kwargs):  # wait for the other graph to start computing too, or to be done
        with cond:
            inside[0] += 1
            cond.notify_all()
            cond.wait_for(lambda: inside[0] == 2 or done[0], timeout=30)
        return real(*args, **kwargs)

    monkeypatch.setattr(attribute, "capture", capture)
    results, barrier = {}, threading.Barrier(2)

    def work(i: int) -> None:
        barrier.wait()
        try:
            results[i] = attribution_graph(model, tcs, prompts[i], spill_dir=folder, **kw)
        except Exception as e:  # noqa: BLE001 - judged below
            results[i] = e
        finally:
            with cond:
                done[0] += 1
                cond.notify_all()

    threads = [threading.Thread(target=work, args=(i,)) for i in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a graph hung"
    graphs = {i: r for i, r in results.items() if not isinstance(r, Exception)}
    refused = {i: r for i, r in results.items() if isinstance(r, Exception)}
    assert graphs, f"no graph was made: {refused}"
    for i, e in refused.items():
        assert isinstance(e, ValueError) and "in use" in str(e), repr(e)
    for i, graph in graphs.items():
        assert graph.edge_files and all(p.parent == folder for p in graph.edge_files)
        for got, want in zip(_edges(graph), expected[i]):
            assert torch.equal(got, want), f"graph {i} holds edges that are not its own"
    # only the finished graphs' edge files are left: no raw chunk, no lock file, no probe
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for g in graphs.values() for p in g.edge_files)


def test_a_busy_spill_folder_is_refused_at_once(tmp_path, monkeypatch, setup):
    """Another graph holds the folder's lock: refused before any compute, not made to wait, not let in."""
    model, tcs = setup
    folder = tmp_path / "busy"
    folder.mkdir()
    _trap_capture(monkeypatch)
    with locked(folder / "workbench-spill", timeout=1.0):
        with pytest.raises(ValueError, match=r"spill_dir .*busy.* is in use"):
            attribution_graph(model, tcs, _prompt(0), spill_dir=folder)
    assert sorted(os.listdir(folder)) == []


def test_a_failed_graph_deletes_its_own_files_and_nothing_else(tmp_path, monkeypatch, setup):
    """A run that fails after writing its edge files removes exactly those (and the folders it made);
    a user's file beside them is untouched. Before, its chunks stayed and blocked the next run."""
    model, tcs = setup
    folder = tmp_path / "mine"
    folder.mkdir()
    note = folder / "notes.txt"
    note.write_bytes(b"my notes\n")
    fresh = tmp_path / "new" / "deeper"

    def boom(graph, **kwargs):
        assert graph.edge_files  # written by now
        raise RuntimeError("failed after the edges were written")

    monkeypatch.setattr("workbench.analysis.graphs.qk.qk_table", boom)
    for spill in (folder, fresh):
        with pytest.raises(RuntimeError, match="after the edges"):
            attribution_graph(model, tcs, _prompt(0), spill_dir=spill, edge_chunk=300, max_feature_nodes=10, qk=True)
    assert sorted(os.listdir(folder)) == ["notes.txt"] and note.read_bytes() == b"my notes\n"
    assert not (tmp_path / "new").exists()  # the folders this run made, removed again
    monkeypatch.undo()
    graph = attribution_graph(model, tcs, _prompt(0), spill_dir=folder, edge_chunk=100)  # not blocked
    assert graph.n_edges > 0 and note.read_bytes() == b"my notes\n"


def _read_only(folder: Path, monkeypatch) -> None:
    """Make ``folder`` read-only: its mode, and where that does not bind (root), its file creation."""
    folder.chmod(0o555)
    if os.geteuid() == 0:
        real = os.open

        def refuse(path, flags, *args, **kwargs):
            if flags & os.O_CREAT and Path(os.fspath(path)).parent == folder:
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refuse)


@pytest.mark.parametrize("case", ["file", "too-long", "read-only", "leftover-chunk", "batch-leftover", "parent-file"])
def test_a_spill_folder_it_cannot_use_is_refused_before_any_compute(tmp_path, monkeypatch, setup, case):
    model, tcs = setup
    prompt, spill, match = _prompt(0), tmp_path / "spill", None
    if case == "file":
        spill.write_text("a user's file")
        match = "is not a folder"
    elif case == "parent-file":
        (tmp_path / "afile").write_text("a user's file")
        spill, match = tmp_path / "afile" / "spill", "cannot be made"
    elif case == "too-long":
        spill, match = tmp_path / ("x" * 300), "at most 255"
    elif case == "read-only":
        spill.mkdir()
        _read_only(spill, monkeypatch)
        match = "not writable"
    elif case == "leftover-chunk":  # what a run killed with kill -9 leaves
        spill.mkdir()
        (spill / "raw-edges-00000.safetensors").write_bytes(b"x")
        match = "already holds edge files"
    else:
        (spill / "prompt-1").mkdir(parents=True)
        (spill / "prompt-1" / "graph-edges-abc-00000.safetensors").write_bytes(b"x")
        prompt, match = torch.cat([_prompt(0), _prompt(1)]), "already holds edge files"
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    _trap_capture(monkeypatch)
    try:
        with pytest.raises(ValueError, match=match):
            attribution_graph(model, tcs, prompt, spill_dir=spill)
    finally:
        if case == "read-only":
            spill.chmod(0o755)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_transcoders_of_the_wrong_width_are_one_clear_error(monkeypatch, setup):
    """Layer 1's transcoder was made for a 48-wide model: one ValueError naming the layer and both widths
    (before: a raw RuntimeError from a matmul, after the clean run)."""
    model, tcs = setup
    d = 48
    other = make_dictionary(DictionaryConfig(kind="skip_transcoder", d_in=d, d_sae=16, d_out=d,
                                             hook_name="blocks.1.ln2.hook_normalized",
                                             hook_name_out="blocks.1.hook_mlp_out"))
    _trap_capture(monkeypatch)
    with pytest.raises(ValueError, match=r"layer 1: the transcoder's d_in is 48, but the model's "
                                         r"blocks\.1\.ln2\.hook_normalized is 32 wide"):
        attribution_graph(model, [tcs[0], other], _prompt(0))


def test_an_empty_target_list_is_one_clear_error(monkeypatch, setup):
    model, tcs = setup
    _trap_capture(monkeypatch)
    with pytest.raises(ValueError, match="target is an empty list"):
        attribution_graph(model, tcs, _prompt(0), target=[])
