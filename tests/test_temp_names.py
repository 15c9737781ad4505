"""Two writers of one file keep to their own temporary files (``.<name>.tmp-<pid>-<random hex>``, from
``workbench.overwrite.write_atomic``), and the store's stray cleanup finds a dead writer's and spares a
live one's.

Before, the store wrote its shards and manifest through one fixed name (``.<name>.tmp``) and the other
writers here through one name per process (``.<name>.tmp-<pid>``): a second writer of the same file (a
second collection, another thread, a process without flock locks) wrote into the first one's temporary
file and renamed it away under it, so the first failed with FileNotFoundError. Each test below runs the
second writer in the middle of the first (just before the first one's rename, as ``_interleaved`` in
test_writers.py does) and fails that way on the old code. Writers that hold a folder's lock run here
as on a system without flock (``fcntl`` None), where the lock is no lock and only the names keep them apart.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from factories import tiny
from test_writers import _interleaved

import workbench as wb
from workbench import checkpoint
from workbench.analysis import store as store_module
from workbench.analysis.directions import Direction
from workbench.analysis.lens import TunedLens
from workbench.analysis.store import ActivationStore
from workbench.snapshots import SnapshotWriter, load_series

HOOK = "blocks.0.hook_resid_post"


def _no_temporaries(folder) -> None:
    assert not [p.name for p in folder.rglob("*") if ".tmp" in p.name]


@pytest.fixture()
def no_flock(monkeypatch):
    monkeypatch.setattr(checkpoint, "fcntl", None)


def _collect(out, tokens=64):
    model = wb.HookedDecoder(tiny(d_vocab=40)).eval()
    ids = torch.randint(0, 40, (16, 8), generator=torch.Generator().manual_seed(0))
    return ActivationStore.collect(model, ids, HOOK, tokens, out, batch_size=4, tokens_per_shard=32, progress=False)


@pytest.mark.parametrize("what", ["shard", "manifest"])
def test_two_writers_of_a_store_file_each_write_their_own(tmp_path, monkeypatch, what):
    """A second writer of the same shard (the same rows: a second collection of the store) or of the manifest
    runs while the first waits to rename its file: the store ends whole, equal to one collected alone."""
    reference = _collect(tmp_path / "reference")
    real_shard, calls = store_module._collect_shard, []

    def collect_shard(*args):
        calls.append(args)
        return real_shard(*args)

    monkeypatch.setattr(store_module, "_collect_shard", collect_shard)
    real_replace, renamed = os.replace, []

    def replace(src, dst):  # at the first rename of a shard (or of the manifest after one), the other writer runs
        name = os.path.basename(src)
        if not renamed and name.startswith(".shard_" if what == "shard" else ".manifest") and calls:
            renamed.append(name)
            monkeypatch.setattr(os, "replace", real_replace)
            if what == "shard":
                real_shard(*calls[-1])
            else:
                out = calls[-1][5]
                store_module._write_manifest(out, json.loads((out / "manifest.json").read_text()))
            monkeypatch.setattr(os, "replace", replace)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    store = _collect(tmp_path / "s")
    monkeypatch.undo()
    assert renamed and renamed[0].startswith(f".{'shard_00000.safetensors' if what == 'shard' else 'manifest.json'}"
                                             f".tmp-{os.getpid()}-")
    store = ActivationStore(tmp_path / "s")
    store.verify()  # every shard matches its checksum in the manifest
    assert store.manifest["tokens"] == 64
    torch.testing.assert_close(store.activations(), reference.activations(), rtol=0, atol=0)
    _no_temporaries(tmp_path / "s")


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


def test_the_stores_cleanup_removes_a_dead_writers_strays_and_spares_a_live_ones(tmp_path):
    """A resumed collection removes the temporary files of a killed one, under the new names too (before, only
    ``.<name>.tmp``), but not one whose process is alive and which is not an hour old (a writer of an older
    version, which takes no lock), nor a user's file."""
    out = tmp_path / "s"
    _collect(out, tokens=32)
    dead, live = _dead_pid(), os.getppid()  # the process that runs pytest's parent: alive, not us
    strays = {"dead": out / f".shard_00001.safetensors.tmp-{dead}-0a1b2c3d",
              "dead manifest": out / f".manifest.json.tmp-{dead}-0a1b2c3d",
              "old": out / f".shard_00001.safetensors.tmp-{live}-99aa99aa",  # alive, but its pid taken again since
              "legacy": out / ".manifest.json.tmp"}
    kept = {"live": out / f".shard_00001.safetensors.tmp-{live}-0a1b2c3d",
            "user": out / f".notes.json.tmp-{dead}-0a1b2c3d"}
    for path in [*strays.values(), *kept.values()]:
        path.write_bytes(b"half a file")
    hour_ago = time.time() - checkpoint.STALE_AFTER_S - 60
    os.utime(strays["old"], (hour_ago, hour_ago))
    assert _collect(out, tokens=64).manifest["tokens"] == 64
    assert [k for k, p in strays.items() if p.exists()] == []
    assert all(p.read_bytes() == b"half a file" for p in kept.values())


def test_two_record_files_at_once_leave_a_whole_marker(tmp_path, monkeypatch):
    path = wb.save_checkpoint(wb.HookedDecoder(tiny()), tmp_path / "c")
    renamed = _interleaved(monkeypatch, lambda: checkpoint.record_files(path, ["b.txt"]))
    checkpoint.record_files(path, ["a.txt"])
    monkeypatch.undo()
    assert renamed[1].startswith(f".meta.json.tmp-{os.getpid()}-")
    assert "a.txt" in checkpoint.read_meta(path)["files"]
    _no_temporaries(path)


def test_two_snapshot_writers_at_once_write_whole_snapshots(tmp_path, monkeypatch, no_flock):
    first, second = (wb.HookedDecoder(tiny(seed=s)).eval() for s in (0, 1))
    renamed = _interleaved(monkeypatch, lambda: SnapshotWriter(tmp_path, [3]).write(second, 3, {"loss": 2.0}))
    SnapshotWriter(tmp_path, [3]).write(first, 3, {"loss": 1.0})
    monkeypatch.undo()
    assert renamed[1].startswith(f".step-000003.safetensors.tmp-{os.getpid()}-")
    series = load_series(tmp_path)
    assert series.steps == [3] and series.metrics["loss"].tolist() == [1.0]
    for name, tensor in series.load(0).state_dict().items():
        torch.testing.assert_close(tensor, first.state_dict()[name], rtol=0, atol=0)
    _no_temporaries(tmp_path)


def test_two_tuned_lens_saves_at_once_leave_one_whole_lens(tmp_path, monkeypatch, no_flock):
    first, second = TunedLens(2, 32), TunedLens(2, 32)
    with torch.no_grad():
        first.bias.add_(1.0)
    renamed = _interleaved(monkeypatch, lambda: second.save(tmp_path))
    first.save(tmp_path)
    monkeypatch.undo()
    assert renamed[1].startswith(f".tuned_lens.safetensors.tmp-{os.getpid()}-")
    loaded = TunedLens.load(tmp_path)
    torch.testing.assert_close(loaded.bias, first.bias, rtol=0, atol=0)
    _no_temporaries(tmp_path)


def test_two_direction_saves_at_once_leave_one_whole_direction(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    first, second = (Direction(torch.randn(32, generator=gen), HOOK) for _ in range(2))
    renamed = _interleaved(monkeypatch, lambda: second.save(tmp_path / "d", overwrite=True))
    first.save(tmp_path / "d", overwrite=True)
    monkeypatch.undo()
    assert renamed[1].startswith(f".d.safetensors.tmp-{os.getpid()}-")
    torch.testing.assert_close(Direction.load(tmp_path / "d").vector, first.vector, rtol=0, atol=0)
    _no_temporaries(tmp_path)


def test_a_saved_graph_is_an_ordinary_file(tmp_path):
    """Graph files went through their own mkstemp writer, which left them readable by their owner only
    (0600); through write_atomic they get an ordinary file's mode, as the other files the workbench writes."""
    from test_graph_io import small_graph

    graph = small_graph()
    umask = os.umask(0)
    os.umask(umask)
    paths = [graph.save(tmp_path / "g.json"), graph.to_circuit_tracer(tmp_path / "ct", slug="ioi"),
             tmp_path / "ct" / "graph-metadata.json"]
    assert [oct(p.stat().st_mode & 0o777) for p in paths] == [oct(0o666 & ~umask)] * 3
    _no_temporaries(tmp_path)
