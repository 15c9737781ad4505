"""Weight snapshots taken during training, and a run's snapshots read back as a lazy series.

    train(TrainConfig(task="induction", steps=4000, snapshots="log:24"), cfg, "runs/ind")
    series = wb.load_series("runs/ind")      # reads headers only; no model is built yet
    series.steps, series.metrics             # the snapshot steps, and the training metrics at each
    model = series.load(-1)                  # one model, built when asked for (eval mode)

``TrainConfig.snapshots`` says when: ``"every:N"`` (steps N, 2N, ...), ``"log:K"`` (K
log-spaced steps from 1 to ``steps``, each distinct), or explicit steps (``"0,100,250"`` or a
list; step 0 is the initial weights). A run folder with snapshots holds

    snapshots/step-000123.safetensors   the weights only (fp32, or fp16 with snapshot_fp16);
                                        header metadata: format, step, the model config (JSON)
    snapshots/snapshots.json            the index: one entry per snapshot with its step, file
                                        and the training metrics at that step

Each file carries its own config, so a snapshot is readable without the run around it and
a series whose files disagree on the model is refused rather than silently mixed.

The files belong to the run: they are listed in the checkpoint's ``meta.json`` (or, before
the first checkpoint exists, in a ``workbench.json`` manifest), every later save of the run
carries them into its new version (hard links, not copies), a resumed run keeps those up to
the step it resumes from, and a fresh run in the same folder starts a new series.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from workbench.checkpoint import (
    CHECKPOINT_FORMAT,
    MANIFEST_FILE,
    META_FILE,
    CheckpointError,
    locked,
    owned_files,
    record_files,
)
from workbench.config import ModelConfig
from workbench.overwrite import write_atomic

SNAPSHOT_DIR = "snapshots"
INDEX_FILE = "snapshots.json"
SNAPSHOT_FORMAT = "workbench.snapshot"
SNAPSHOTS_MANIFEST_FORMAT = "workbench.snapshots"
SnapshotSpec = Union[str, Sequence[int], None]


class SnapshotError(CheckpointError):
    """A snapshot file is missing, corrupt, or does not match its series."""


def snapshot_file(step: int) -> str:
    return f"step-{step:06d}.safetensors"


# ---- when -------------------------------------------------------------------------------------
def snapshot_steps(spec: Any, steps: int) -> list[int]:
    """The steps ``spec`` (a ``SnapshotSpec``; anything else is refused with the valid forms)
    names for a run of ``steps`` optimizer steps, sorted and distinct."""
    usage = (f"TrainConfig.snapshots={spec!r} is not a schedule: use 'every:N' (N >= 1), 'log:K' "
             f"(1 <= K <= steps={steps}), or steps in 0..{steps} as '0,100,250' or a list")
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return []
    if isinstance(spec, str):
        text = spec.strip().replace(" ", "")
        kind, _, number = text.partition(":")
        if kind in ("every", "log"):
            try:
                n = int(number)
            except ValueError:
                raise ValueError(usage) from None
            if kind == "every":
                if n < 1:
                    raise ValueError(usage)
                return list(range(n, steps + 1, n))
            if not 1 <= n <= steps:
                raise ValueError(usage)
            return _log_spaced(n, steps)
        try:
            chosen = [int(part) for part in text.split(",") if part]
        except ValueError:
            raise ValueError(usage) from None
    elif isinstance(spec, (list, tuple)) and all(isinstance(s, (int, np.integer)) for s in spec):
        chosen = [int(s) for s in spec]
    else:
        raise ValueError(usage)
    outside = [s for s in chosen if not 0 <= s <= steps]
    if outside:
        raise ValueError(f"{usage} (got {outside} outside 0..{steps})")
    return sorted(set(chosen))


def _log_spaced(k: int, steps: int) -> list[int]:
    """``k`` distinct steps in 1..steps, as close to geometric spacing as integers allow."""
    out: list[int] = []
    for i in range(k):
        target = steps ** (i / (k - 1)) if k > 1 else steps
        step = max(int(round(target)), out[-1] + 1 if out else 1)
        out.append(min(step, steps - (k - 1 - i)))  # leave room for the ones still to come
    return out


# ---- writing (one run, main process) ------------------------------------------------------------
class SnapshotWriter:
    """Writes one run's snapshots into ``out_dir/snapshots`` and keeps its index and ownership."""

    def __init__(self, out_dir: Path, steps: Sequence[int], fp16: bool = False, resume_from: Optional[int] = None):
        self.out_dir, self.dir = Path(out_dir), Path(out_dir) / SNAPSHOT_DIR
        self.steps, self.fp16 = frozenset(steps), fp16
        self.entries: list[dict] = []
        if resume_from is not None:  # keep what the run had up to the step it resumes from
            try:
                entries = read_index(self.dir)
            except SnapshotError:  # the files still say what they are; only their metrics are lost
                entries = [{"step": step, "file": f.name} for f in sorted(self.dir.glob("step-*.safetensors"))
                           for step in [_step_of(f)] if step is not None]
            self.entries = [e for e in entries if e["step"] <= resume_from]
        elif not self.steps:
            return  # a fresh run without snapshots leaves an old series to the first save, which drops it
        keep = {e["file"] for e in self.entries}

        def stale() -> list[str]:  # the old series' files the marker lists, that this run does not keep
            ours = owned_files(self.out_dir) if self.out_dir.is_dir() else None
            return sorted(name for name in (ours or ()) if name.startswith(SNAPSHOT_DIR + "/")
                          and name.split("/", 1)[1] not in keep | {INDEX_FILE} and (self.out_dir / name).exists())

        if stale() or (self.dir / INDEX_FILE).exists():
            with locked(self.out_dir):  # looked at again: another writer may have replaced the folder since
                for name in stale():
                    with contextlib.suppress(FileNotFoundError):
                        (self.out_dir / name).unlink()
                self._write_index()

    def due(self, step: int) -> bool:
        return step in self.steps

    def write(self, model: torch.nn.Module, step: int, metrics: dict) -> None:
        """Save the weights at ``step`` (cast to fp16 if asked) with ``metrics`` in the index."""
        state = {}
        for name, tensor in model.state_dict().items():
            tensor = tensor.detach()
            if self.fp16 and tensor.is_floating_point():
                tensor = tensor.to(torch.float16)
            state[name] = tensor.to("cpu").contiguous()
        name = snapshot_file(step)
        metadata = {"format": SNAPSHOT_FORMAT, "step": str(step),
                    "config": json.dumps(model.cfg.to_dict(), sort_keys=True)}
        with locked(self.out_dir):
            self.dir.mkdir(parents=True, exist_ok=True)
            # an interrupt mid-write leaves the previous file (if any), never half of one
            write_atomic(self.dir / name, lambda tmp: save_file(state, str(tmp), metadata=metadata))
            entry = {"step": step, "file": name, **{k: _plain(v) for k, v in metrics.items() if k != "step"}}
            self.entries = sorted([e for e in self.entries if e["step"] != step] + [entry], key=lambda e: e["step"])
            self._write_index()
            self._own([f"{SNAPSHOT_DIR}/{name}", f"{SNAPSHOT_DIR}/{INDEX_FILE}"])

    def update(self, step: int, **metrics: float) -> None:
        """Add metrics measured after the snapshot (the final validation loss) to its index entry."""
        entry = next((e for e in self.entries if e["step"] == step), None)
        if entry is not None:
            entry.update({k: _plain(v) for k, v in metrics.items()})
            with locked(self.out_dir):
                self._write_index()

    def checkpoint_files(self) -> dict[str, Union[Path, bytes]]:
        """What a checkpoint save of the run must carry: the snapshot files it owns, and the index.

        Files no marker of the folder lists (a checkpoint from before markers) are left out:
        the save carries those along as files it did not write.
        """
        if not self.entries:
            return {}
        owned = owned_files(self.out_dir) or frozenset()
        files: dict[str, Union[Path, bytes]] = {}
        for entry in self.entries:
            rel = f"{SNAPSHOT_DIR}/{entry['file']}"
            if rel in owned and (self.dir / entry["file"]).exists():
                files[rel] = self.dir / entry["file"]
        if f"{SNAPSHOT_DIR}/{INDEX_FILE}" in owned:
            files[f"{SNAPSHOT_DIR}/{INDEX_FILE}"] = self._index_json().encode()
        return files

    def _index_json(self) -> str:
        return json.dumps({"format": SNAPSHOTS_MANIFEST_FORMAT, "snapshots": self.entries}, indent=1) + "\n"

    def _write_index(self) -> None:
        path = self.dir / INDEX_FILE
        if not self.entries:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return
        text = self._index_json()
        write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))  # by rename: never half an index

    def _own(self, names: list[str]) -> None:
        """List ``names`` in the folder's marker, so saves carry them and a fresh run replaces them."""
        meta = _read_json(self.out_dir / META_FILE)
        if meta is not None and meta.get("format") == CHECKPOINT_FORMAT:
            record_files(self.out_dir, names)
            return
        if meta is not None:  # a checkpoint from before markers: the files stay unlisted (see checkpoint_files)
            return
        manifest = _read_json(self.out_dir / MANIFEST_FILE) or {"format": SNAPSHOTS_MANIFEST_FORMAT, "files": []}
        manifest["files"] = sorted(set(manifest.get("files", [])) | set(names))
        text = json.dumps(manifest, indent=2) + "\n"
        write_atomic(self.out_dir / MANIFEST_FILE, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _step_of(path: Path) -> Optional[int]:
    try:
        return read_header(path)[0]
    except SnapshotError:
        return None


def _read_json(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _plain(value):
    """A JSON-friendly number (NaN and None become null)."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else None


def read_index(directory: Union[str, Path]) -> list[dict]:
    """The entries of ``directory/snapshots.json`` (SnapshotError when it is missing or corrupt)."""
    path = Path(directory) / INDEX_FILE
    data = _read_json(path)
    entries = data.get("snapshots") if data is not None else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("step"), int)
                                                and isinstance(e.get("file"), str) for e in entries):
        raise SnapshotError(f"{path} is missing or is not a snapshot index")
    return entries


# ---- reading ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Snapshot:
    """One snapshot: its step, its file, and the training metrics recorded at that step."""

    step: int
    path: Path
    metrics: dict = field(default_factory=dict, compare=False, hash=False)


def read_header(path: Union[str, Path]) -> tuple[int, ModelConfig]:
    """The step and model config a snapshot file records, from its header only (no weights read)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        if metadata.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"format is {metadata.get('format')!r}, not {SNAPSHOT_FORMAT!r}")
        return int(metadata["step"]), ModelConfig.from_dict(json.loads(metadata["config"]))
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise SnapshotError(f"{path} is not a readable snapshot ({e})") from None


def load_snapshot(path: Union[str, Path], config: ModelConfig, device: Union[str, torch.device, None] = None):
    """The model of one snapshot file (weights cast back to the model's dtype), in eval mode."""
    from workbench.model import HookedDecoder

    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise SnapshotError(f"{path} is truncated or corrupt ({e})") from None
    model = HookedDecoder(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise SnapshotError(f"{path} does not match its config: {str(e).splitlines()[0]}") from None
    if device is not None:
        model.to(device)
    return model.eval()


class Series(Sequence[Snapshot]):
    """A run's snapshots in step order; models are built one at a time, when asked for.

    ``history`` is the run's ``metrics.csv`` (the full loss curve; empty when there is none),
    ``metrics`` the index's metrics at the snapshot steps. ``over_training`` keeps the
    results of analyses per snapshot here, so a second analysis never reloads a snapshot
    whose results it already has.
    """

    def __init__(self, snapshots: Sequence[Snapshot], config: ModelConfig, tokenizer=None,
                 history: Optional[pd.DataFrame] = None, source: str = "", device=None):
        self.snapshots, self.config, self.tokenizer = list(snapshots), config, tokenizer
        self.history = history if history is not None else pd.DataFrame(columns=["step", "train_loss"])
        self.source, self.device = source, device
        self.results: dict = {}  # (step, analysis key) -> DataFrame, filled by over_training

    def __len__(self) -> int:
        return len(self.snapshots)

    def __getitem__(self, index):
        if isinstance(index, slice):
            part = Series(self.snapshots[index], self.config, self.tokenizer, self.history, self.source, self.device)
            part.results = self.results  # one cache for the run, whichever part of it is analysed
            return part
        return self.snapshots[index]

    def __repr__(self) -> str:
        shown = ", ".join(map(str, self.steps[:6])) + (", ..." if len(self) > 6 else "")
        return f"Series({self.source!r}, {len(self)} snapshots at steps {shown})"

    @property
    def steps(self) -> list[int]:
        return [s.step for s in self.snapshots]

    @property
    def metrics(self) -> pd.DataFrame:
        return pd.DataFrame([{"step": s.step, **s.metrics} for s in self.snapshots])

    def nearest(self, step: Union[int, float]) -> Snapshot:
        """The snapshot whose step is closest to ``step`` (the earlier one on a tie): how two runs
        with different snapshot steps are aligned."""
        if not self.snapshots:
            raise ValueError("the series has no snapshots")
        return min(self.snapshots, key=lambda s: (abs(s.step - step), s.step))

    def load(self, which: Union[int, Snapshot]):
        """The model at snapshot ``which`` (an index, or a Snapshot), with the run's tokenizer."""
        snapshot = which if isinstance(which, Snapshot) else self.snapshots[which]
        model = load_snapshot(snapshot.path, self.config, self.device)
        model.tokenizer = self.tokenizer
        return model

    def models(self) -> Iterator[tuple[Snapshot, torch.nn.Module]]:
        """``(snapshot, model)`` in step order, one model alive at a time."""
        for snapshot in self.snapshots:
            yield snapshot, self.load(snapshot)


def load_series(source: Union[str, Path, Sequence[Union[str, Path]]], device=None) -> Series:
    """The snapshots of a run folder (or of its ``snapshots/`` folder, or a list of snapshot files).

    Missing or unreadable snapshots are skipped with one warning naming them; a folder with no
    snapshots, or files that disagree on the model config, raise ValueError.
    """
    run_dir, entries, skipped = _entries(source)
    found: list[tuple[Snapshot, ModelConfig]] = []
    for path, metrics in entries:
        if not path.exists():
            skipped.append(f"{path.name} (missing)")
            continue
        try:
            step, config = read_header(path)
        except SnapshotError as e:
            skipped.append(f"{path.name} (corrupt: {str(e).split('(', 1)[-1].rstrip(')')})")
            continue
        found.append((Snapshot(step, path, metrics), config))
    if skipped:
        warnings.warn(f"skipped {len(skipped)} snapshot(s) of {source}: {', '.join(skipped)}", stacklevel=2)
    if not found:
        raise ValueError(f"{source}: none of its snapshots could be read ({', '.join(skipped)})")
    configs: dict[str, list[str]] = {}
    for snapshot, config in found:
        configs.setdefault(config.to_json(), []).append(snapshot.path.name)
    if len(configs) > 1:
        first, *others = [ModelConfig.from_dict(json.loads(c)) for c in configs]
        differ = sorted({k for other in others for k, v in other.to_dict().items() if first.to_dict().get(k) != v})
        groups = "; ".join(f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}" for names in configs.values())
        raise ValueError(f"{source}: the snapshots are of {len(configs)} different models (they differ in "
                         f"{differ}: {groups}); a series is one model's training, so load each run separately")
    steps = [s.step for s, _ in found]
    if len(set(steps)) != len(steps):
        raise ValueError(f"{source}: several snapshots claim the same step ({sorted(s for s in steps if steps.count(s) > 1)})")
    snapshots = sorted((s for s, _ in found), key=lambda s: s.step)
    tokenizer, history = None, None
    if run_dir is not None:
        from workbench.tokenizer import load_tokenizer
        from workbench.training import read_metrics

        with contextlib.suppress(ValueError, KeyError, OSError):
            tokenizer = load_tokenizer(run_dir)
        history = read_metrics(run_dir)
    return Series(snapshots, found[0][1], tokenizer, history, str(source), device)


def _entries(source) -> tuple[Optional[Path], list[tuple[Path, dict]], list[str]]:
    """(run folder or None, [(file, metrics)], skipped) for a folder or a list of files."""
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("load_series got an empty list of snapshot files")
        return None, [(Path(p), {}) for p in source], []
    path = Path(source)
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder: pass a run folder trained with TrainConfig(snapshots=...), "
                         "its snapshots/ folder, or a list of snapshot files")
    folder, run_dir = (path / SNAPSHOT_DIR, path) if (path / SNAPSHOT_DIR).is_dir() else (path, None)
    if run_dir is None and path.name == SNAPSHOT_DIR:
        run_dir = path.parent
    files = sorted(folder.glob("step-*.safetensors"))
    if not (folder / INDEX_FILE).exists() and not files:
        raise ValueError(f"{path} has no snapshots (no {SNAPSHOT_DIR}/{INDEX_FILE}): train with "
                         "TrainConfig(snapshots='log:24') (or --snapshots log:24) to record them")
    try:
        entries = read_index(folder)
    except SnapshotError:
        warnings.warn(f"{folder / INDEX_FILE} is missing or corrupt; reading the {len(files)} snapshot files "
                      "themselves (their training metrics are lost)", stacklevel=3)
        return run_dir, [(f, {}) for f in files], []
    return run_dir, [(folder / e["file"], {k: v for k, v in e.items() if k not in ("step", "file")})
                     for e in entries], []
