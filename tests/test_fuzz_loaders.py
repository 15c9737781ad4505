"""Fuzzing the loaders: every damaged file either loads to what the original loads to, or is
refused with one of the workbench's errors (all ValueErrors: CheckpointError, DictionaryError,
StoreError, ArchiveError, ...), never another exception, a hang or unbounded memory.

The files are the shipped ones (checkpoints/stories-2026 with its tokenizer and dictionary,
checkpoints/induction-attn2l's circuit and weight snapshots) plus a direction and an
activation store made here. Each case copies one target, damages one file (a truncation, a few
flipped bytes, or a JSON field set to a hostile value or deleted) and loads it, in a subprocess
whose peak memory is read with ``resource.getrusage`` at the end.

Flipped bytes land in a safetensors file's header, not its tensor data: nothing records a
checksum of a checkpoint's weights, so a changed weight loads as a changed weight (an activation
store's shards are checksummed, and there the flips go anywhere).

    python tests/test_fuzz_loaders.py --worker SEED SECONDS OUT.json    # one run by hand
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from factories import json_paths

REPO = Path(__file__).resolve().parents[1]
HOSTILE = [None, -1, 0, 1, 10**12, 2**63, 1.5, float("nan"), "x", "", [], {}, True, [1, 2], {"a": 1}, "../../etc"]


# ---- the worker (its own process) ---------------------------------------------------------------
def _digest(value) -> str:
    import hashlib

    import torch

    h = hashlib.sha256()

    def feed(v):
        if isinstance(v, torch.Tensor):
            h.update(str((tuple(v.shape), str(v.dtype))).encode())
            h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(str(k).encode())
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                feed(x)
        else:
            h.update(repr(v).encode())

    feed(value)
    return h.hexdigest()


def _targets(work: Path) -> dict:
    """name -> (folder, files to damage, load(folder) -> a comparable value)."""
    import shutil

    import torch

    import workbench as wb
    from workbench import analysis as an
    from workbench.analysis.circuits import Circuit
    from workbench.analysis.dictionaries import load_dictionary
    from workbench.analysis.store import ActivationStore
    from workbench.snapshots import load_series
    from workbench.tokenizer import load_tokenizer

    stories, induction = REPO / "checkpoints" / "stories-2026", REPO / "checkpoints" / "induction-attn2l"
    sample = "Once upon a time, Mary and John"

    def checkpoint(d):
        model, tok = wb.load_checkpoint(d)
        return [model.cfg.to_dict(), model.state_dict(), tok.encode(sample) if tok is not None else None]

    def tokenizer(d):
        tok = load_tokenizer(d)
        return None if tok is None else [type(tok).__name__, tok.vocab_size, tok.encode(sample)]

    def dictionary(d):
        sae = load_dictionary(d)
        return [sae.cfg.to_dict(), sae.state_dict()]

    def circuit(d):
        c = Circuit.load(d / "circuit.json")
        return [c.edges, c.model, c.method, c.scores, c.meta]

    def snapshots(d):
        series = load_series(d / "snapshots")
        return [[s.step for s in series], series.load(0).state_dict(), series.load(len(series) - 1).state_dict()]

    def direction(d):
        back = an.Direction.from_bytes((d / "d.zip").read_bytes())
        return [back.vector, back.hook, back.provenance]

    def direction_pair(d):
        back = an.Direction.load(d / "d")
        return [back.vector, back.hook, back.provenance]

    def store(d):
        s = ActivationStore(d)
        s.verify()  # the shards' checksums
        return [s.manifest["hooks"], s.n_rows, s.load_shard(0)]

    out = {}
    ck = work / "src-checkpoint"
    ck.mkdir()
    for name in ("config.json", "meta.json", "tokenizer.json", "model.safetensors"):
        shutil.copy2(stories / name, ck / name)
    out["checkpoint"] = (ck, ["config.json", "meta.json", "tokenizer.json", "model.safetensors"], checkpoint)
    out["tokenizer"] = (ck, ["tokenizer.json"], tokenizer)
    sae = shutil.copytree(stories / "saes" / "resid-post-1", work / "src-dictionary")
    out["dictionary"] = (Path(sae), ["cfg.json", "sae_meta.json", "sae_weights.safetensors"], dictionary)
    circ = work / "src-circuit"
    circ.mkdir()
    shutil.copy2(induction / "circuit.json", circ / "circuit.json")
    out["circuit"] = (circ, ["circuit.json"], circuit)
    snaps = work / "src-snapshots"
    shutil.copytree(induction / "snapshots", snaps / "snapshots")
    out["snapshots"] = (snaps, ["snapshots/snapshots.json", "snapshots/step-000000.safetensors"], snapshots)
    model = wb.load_checkpoint(stories)[0]
    vector = an.Direction(torch.randn(2, model.cfg.d_model), "blocks.1.hook_resid_post", {"kind": "custom"})
    dirs = work / "src-direction"
    dirs.mkdir()
    (dirs / "d.zip").write_bytes(vector.to_bytes("d"))
    vector.save(dirs / "d")
    out["direction"] = (dirs, ["d.zip"], direction)
    out["direction_pair"] = (dirs, ["d.json", "d.safetensors"], direction_pair)
    tokens = torch.randint(0, model.cfg.d_vocab, (8, 16), generator=torch.Generator().manual_seed(0))
    st = ActivationStore.collect(model, tokens, "blocks.0.hook_resid_post", 64, work / "src-store", batch_size=4,
                                 tokens_per_shard=32, progress=False)
    shard = st.manifest["shards"][0]["file"]
    out["store"] = (st.path, ["manifest.json", shard], store)
    return out


def _damage(data: bytes, name: str, rng) -> tuple[bytes, str]:
    kind = rng.choice(["truncate", "flip", "json"] if name.endswith(".json") else ["truncate", "flip"])
    if kind == "truncate":
        at = rng.randrange(0, max(1, len(data)))
        return data[:at], f"truncate at {at} of {len(data)}"
    if kind == "flip":
        region = len(data)
        if name.endswith(".safetensors") and len(data) >= 8:
            region = min(len(data), 8 + int.from_bytes(data[:8], "little"))  # the header (see the docstring)
        out, where = bytearray(data), []
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(0, max(1, region))
            out[i] ^= 1 << rng.randrange(8)
            where.append(i)
        return bytes(out), f"flip bytes {where}"
    try:
        doc = json.loads(data)
    except ValueError:
        return data[:-1], "truncate the last byte"
    paths = [p for p in json_paths(doc, 8) if p]
    if not paths:
        return json.dumps(rng.choice(HOSTILE)).encode(), "replace the document"
    path = rng.choice(paths)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if rng.random() < 0.2 and isinstance(parent, dict):
        del parent[path[-1]]
        return json.dumps(doc).encode(), f"delete {list(path)}"
    value = rng.choice(HOSTILE)
    parent[path[-1]] = value
    return json.dumps(doc).encode(), f"set {list(path)} = {value!r}"


def _parses(data: bytes, name: str) -> bool:
    if not name.endswith(".json"):
        return False
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def worker(seed: int, seconds: float, report: Path) -> None:
    import random
    import resource
    import shutil
    import tempfile
    import time
    import warnings

    work = Path(tempfile.mkdtemp(prefix="workbench-fuzz-"))
    try:
        targets = _targets(work)
        originals = {name: _digest(load(folder)) for name, (folder, _, load) in targets.items()}
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rng = random.Random(seed)
        stats = {name: {"cases": 0, "equal": 0, "refused": 0} for name in targets}
        failures, slowest = [], 0.0
        deadline, case = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            name = list(targets)[case % len(targets)]
            folder, files, load = targets[name]
            victim = rng.choice(files)
            target = work / f"case-{case}"
            shutil.copytree(folder, target, copy_function=os.link)  # links: only the damaged file is new
            original = (folder / victim).read_bytes()
            damaged, how = _damage(original, victim, rng)
            (target / victim).unlink()
            (target / victim).write_bytes(damaged)
            start = time.monotonic()
            try:
                with warnings.catch_warnings(record=True) as said:
                    warnings.simplefilter("always")
                    same = _digest(load(target)) == originals[name]
                if same:
                    outcome = "equal"
                elif _parses(damaged, victim):
                    outcome = "edited"  # a valid document that says something else: it loads as what it says
                elif any(issubclass(w.category, UserWarning) for w in said):
                    outcome = "warned"  # e.g. a series that skipped a broken snapshot and said so
                else:
                    outcome = "wrong"
                    failures.append([name, victim, how, "loaded, silently not what the original loads to"])
                stats[name][outcome] = stats[name].get(outcome, 0) + 1
            except ValueError:
                stats[name]["refused"] += 1
            except Exception as e:  # noqa: BLE001 - exactly what the test looks for
                failures.append([name, victim, how, f"{type(e).__name__}: {str(e)[:300]}"])
            slowest = max(slowest, time.monotonic() - start)
            stats[name]["cases"] += 1
            shutil.rmtree(target, ignore_errors=True)
            case += 1
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        report.write_text(json.dumps({"stats": stats, "failures": failures, "slowest_s": slowest,
                                      "baseline_kib": baseline, "peak_kib": peak, "cases": case}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- the test -------------------------------------------------------------------------------------------
MEMORY_BOUND_KIB = 512 * 1024  # above what loading the originals took


@pytest.mark.slow  # a subprocess, for its own peak memory
def test_damaged_files_load_equal_or_are_refused_with_bounded_memory(tmp_path):
    report = tmp_path / "fuzz.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, "--worker", "0", "5", str(report)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(report.read_text())
    assert not result["failures"], "\n".join(map(str, result["failures"][:20]))
    for name, stats in result["stats"].items():
        assert stats["cases"] >= 3, (name, result["stats"])  # every loader was exercised
    assert sum(s["refused"] for s in result["stats"].values()) > 0
    assert result["peak_kib"] - result["baseline_kib"] < MEMORY_BOUND_KIB, result
    assert result["slowest_s"] < 30, result  # no case hangs


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    sys.path.insert(0, str(REPO))
    worker(int(sys.argv[2]), float(sys.argv[3]), Path(sys.argv[4]))
elif __name__ == "__main__":
    pytest.main([__file__, "-q"])
