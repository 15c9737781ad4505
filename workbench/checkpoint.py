"""Checkpoints: a directory of safetensors weights and JSON, written atomically.

    model.safetensors   the weights (tied weights stored once)
    config.json         the ModelConfig
    tokenizer.json      the tokenizer, when there is one
    meta.json           format marker and version, the files this save wrote, library version,
                        step, metrics, anything JSON

Loading never unpickles; every way a checkpoint can be broken raises ``CheckpointError``
with one message that says what is wrong and what to do.

Whatever folder a user points us at, we never delete what we did not write. A directory is
replaced only when it is absent, empty, or marked as the workbench's own: a checkpoint by
``meta.json``'s ``format`` (``"workbench.checkpoint"``), any other output (an HF export) by a
small ``workbench.json`` manifest. Only the files that marker lists are replaced; anything else
found in the folder (a user's notes beside a checkpoint) is carried into the new version
untouched, and a save that would overwrite such a file is refused. Checkpoints written before
the marker existed (``meta.json`` with ``format_version`` and ``library_version``) count as ours
for the file names the workbench has always written.

Concurrent writers serialise on ``fcntl.flock`` of ``.<name>.lock`` beside the target, and the
temporary ``.<name>.tmp-<pid>-*`` / ``.<name>.old-<pid>-*`` folders a killed writer leaves behind
are cleaned (or, when the target itself is missing, the old version restored) by the next save.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
from safetensors.torch import save_file

from workbench.config import FORMAT_VERSION, ModelConfig
from workbench.overwrite import current_umask, write_atomic

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; saves still go through the atomic rename
    fcntl = None

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
META_FILE = "meta.json"
MANIFEST_FILE = "workbench.json"  # the ownership marker of directories that are not checkpoints
CHECKPOINT_FORMAT = "workbench.checkpoint"
# What save_checkpoint, train() and TunedLens.save wrote before meta.json listed its files.
LEGACY_CHECKPOINT_FILES = frozenset({
    WEIGHTS_FILE, CONFIG_FILE, META_FILE, "tokenizer.json", "metrics.csv", "train_state.safetensors",
    "train_state.json", "tuned_lens.safetensors", "tuned_lens.json",
})
LOCK_TIMEOUT_S = 300.0  # a writer of a multi-GB checkpoint may hold the lock for minutes
STALE_AFTER_S = 3600.0  # a temp folder this old is a leftover even if its pid is alive (reused)


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupt, from an incompatible version, or not ours to replace."""


class NonFiniteWeightsWarning(UserWarning):
    """A loaded checkpoint holds NaN or infinite weights (a diverged run); its outputs will be NaN."""


# ---- what the workbench wrote --------------------------------------------------------------
def owned_files(path: Union[str, Path]) -> Optional[frozenset[str]]:
    """The files (relative POSIX paths) the workbench wrote in directory ``path``, or None when
    the directory carries no workbench marker (it is someone else's)."""
    path = Path(path)
    meta = _read_json_dict(path / META_FILE)
    if meta is not None and meta.get("format") == CHECKPOINT_FORMAT and _is_str_list(meta.get("files")):
        return frozenset(meta["files"]) | {META_FILE}
    if meta is not None and "format" not in meta and isinstance(meta.get("format_version"), int) \
            and "library_version" in meta:
        return LEGACY_CHECKPOINT_FILES
    manifest = _read_json_dict(path / MANIFEST_FILE)
    if manifest is not None and str(manifest.get("format", "")).startswith("workbench.") \
            and _is_str_list(manifest.get("files")):
        return frozenset(manifest["files"]) | {MANIFEST_FILE}
    return None


def _read_json_dict(path: Path) -> Optional[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, unreadable, not JSON, not UTF-8
        return None
    return data if isinstance(data, dict) else None


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _files_in(directory: Path) -> list[str]:
    """Relative POSIX paths of the files (and symlinks) under ``directory``, sorted."""
    out = []
    for root, dirs, files in os.walk(directory):
        rel = Path(root).relative_to(directory)
        out += [(rel / f).as_posix() for f in files]
        out += [(rel / d).as_posix() for d in dirs if Path(root, d).is_symlink()]  # walk does not enter them
    return sorted(out)


def _foreign_entries(path: Path, owned: frozenset[str]) -> list[str]:
    """Files, symlinks and empty folders under ``path`` the workbench did not write."""

    def unreadable(error: OSError) -> None:  # os.walk would skip it silently, and it would not be carried over
        raise CheckpointError(f"cannot read {error.filename} inside {path} ({error.strerror}), so this save cannot "
                              "keep it; fix its permissions or move it out (nothing was changed)")

    folders = tuple(name for name in owned if name.endswith("/"))  # "saes/NAME/": everything under it
    out = []
    for root, dirs, files in os.walk(path, onerror=unreadable):
        rel = Path(root).relative_to(path)
        for name in files + [d for d in dirs if Path(root, d).is_symlink()]:
            entry = (rel / name).as_posix()
            if entry not in owned and not entry.startswith(folders):
                out.append(entry)
        if not dirs and not files and rel != Path(".") and not (rel.as_posix() + "/").startswith(folders):
            out.append(rel.as_posix() + "/")
    return sorted(out)


def _shown(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def usable_path(path: Union[str, Path]) -> Path:
    """``path`` as a Path, or CheckpointError when no file system can hold it (a name over 255
    bytes, which ``stat`` would answer with OSError [Errno 36])."""
    from workbench.utils import check_path

    try:
        return check_path(path, "checkpoint path")
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def check_replaceable(path: Union[str, Path]) -> Path:
    """Raise CheckpointError unless ``path`` is absent, empty, or a directory the workbench wrote.

    A check made before writing (without the folder's lock) can catch another writer half-way
    through its swap: the old version moved away, so the folder is missing or shows no marker for
    an instant. A refusal is therefore confirmed under the lock, where no writer is half-way.
    """
    path = usable_path(path)
    try:
        return _check_replaceable(path)
    except CheckpointError:
        if not path.parent.is_dir():
            raise
        with locked(path):
            return _check_replaceable(path)


def _check_replaceable(path: Path) -> Path:
    """``check_replaceable`` as the folder is at this instant (decisive under its lock)."""
    if path.is_symlink():
        raise CheckpointError(
            f"{path} is a symbolic link; pass the folder it points to ({os.path.realpath(path)}) or another path"
        )
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a directory; choose another output path")
    if path.is_dir() and owned_files(path) is None:
        try:
            entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
        except FileNotFoundError:  # moved away by a writer's swap as we looked: absent is replaceable
            return path
        if entries:
            raise CheckpointError(
                f"{path} is a non-empty directory that is not a checkpoint or export the workbench wrote (no "
                f"{META_FILE} or {MANIFEST_FILE} marker); it holds {_shown(entries)}, which the workbench will not "
                "replace or delete: choose a new or empty output directory"
            )
    return path


# ---- locking and leftovers -------------------------------------------------------------------
@contextlib.contextmanager
def locked(path: Union[str, Path], timeout: Optional[float] = None) -> Iterator[None]:
    """Hold the exclusive write lock of directory ``path`` (``.<name>.lock`` beside it).

    Waits up to ``timeout`` seconds (default ``LOCK_TIMEOUT_S``) for another writer, then raises
    CheckpointError naming it. Not re-entrant: one ``with`` per write.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    lock_path = path.parent / f".{path.name}.lock"
    deadline = time.monotonic() + (LOCK_TIMEOUT_S if timeout is None else timeout)
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                holder = _read_pid(lock_path)
                raise CheckpointError(
                    f"another process{f' (pid {holder})' if holder else ''} is writing {path} and held its lock "
                    f"{lock_path} for longer than {LOCK_TIMEOUT_S if timeout is None else timeout:g} s; wait for it "
                    "to finish or write somewhere else"
                ) from None
            time.sleep(0.05)
            continue
        # The holder before us unlinks the file on release; a lock on an unlinked file guards nothing.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)  # while still holding it: see the samestat check above
        os.close(fd)


def hold_now(path: Union[str, Path], busy: Callable[[str], Exception]) -> contextlib.ExitStack:
    """``path``'s write lock (``locked``), taken without waiting and held by the returned stack.

    When another process holds it, raises ``busy(by)`` at once, ``by`` naming the holder for the
    caller's own message (" (process 123)", or "" when the lock file names none)."""
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(locked(path, timeout=0.0))
    except CheckpointError:
        holder = _read_pid(Path(path).parent / f".{Path(path).name}.lock")
        raise busy(f" (process {holder})" if holder else "") from None
    return stack


def _read_pid(lock_path: Path) -> Optional[int]:
    try:
        return int(lock_path.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # os.kill(pid, 0) would terminate it on Windows; fall back to the age test
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def writer_gone(pid: int, mtime: float) -> bool:
    """Whether the writer (process ``pid``) of a temporary file or folder named ``.<name>.tmp-<pid>-*``,
    last changed at ``mtime``, is gone, so that what it left is a leftover to remove.

    Ask only with the target's lock held: then no live writer of this library owns it, and one of this
    process's pid is a dead process's (the pid reused). The pid and age tests spare a live writer of an
    older version that takes no lock; after ``STALE_AFTER_S`` its pid is taken to be reused."""
    return pid == os.getpid() or not _alive(pid) or time.time() - mtime >= STALE_AFTER_S


def _clean_leftovers(path: Path) -> None:
    """Remove the ``.<name>.tmp-*`` / ``.<name>.old-*`` folders of writers that died mid-save.

    Called with the lock held, so no live writer of ``path`` owns them; the pid and age tests
    only spare a writer of an older library version that takes no lock. A writer killed between
    its two renames leaves ``path`` missing and the previous version in ``.old-*``: that is put back.
    """
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(tmp|old)-(\d+)-(\w+)$")
    stale: list[tuple[str, Path]] = []
    for entry in path.parent.iterdir():
        match = pattern.match(entry.name)
        if not match or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            mtime = entry.stat().st_mtime
        except FileNotFoundError:
            continue
        if not writer_gone(int(match[2]), mtime):
            continue
        stale.append((match[1], entry))
    if not path.exists():
        backups = sorted((e for kind, e in stale if kind == "old" and owned_files(e) is not None),
                         key=lambda e: e.stat().st_mtime)
        if backups:
            os.replace(backups[-1], path)
            stale = [(kind, e) for kind, e in stale if e != backups[-1]]
    for _, entry in stale:
        shutil.rmtree(entry, ignore_errors=True)


# ---- writing -------------------------------------------------------------------------------
def atomic_write_dir(path: Union[str, Path], write: Any, *, marker: Optional[str] = None,
                     lock_timeout: Optional[float] = None, replace: bool = True) -> Path:
    """Call ``write(tmp_dir)`` then move ``tmp_dir`` to ``path``; the old contents survive a failure.

    ``marker`` (e.g. ``"workbench.hf_export"``) makes this write a ``workbench.json`` manifest of
    the files ``write`` produced; without it ``write`` must mark the directory itself (a
    checkpoint's ``meta.json``). An existing ``path`` is replaced only when it is empty or marked
    as ours, and only the files its marker lists go: other files in it are carried into the new
    version (``--out notes/`` must never wipe a folder of the user's files), and a write that
    would overwrite one of them raises CheckpointError.

    ``replace=False`` refuses (CheckpointError) a ``path`` that exists and is not an empty folder.
    That test runs under the same lock as the write: two writers racing for one new name cannot
    both pass it, so one of them fails instead of silently replacing the other's output.
    """
    from workbench import __version__

    path = usable_path(path)
    if not replace:
        _refuse_existing(path)  # fails fast; the test under the lock below decides
    with locked(path, lock_timeout):
        _clean_leftovers(path)
        # Only under the lock: before it, another writer's swap can make one of ours look foreign.
        path = _check_replaceable(path)
        if not replace:
            _refuse_existing(path)  # again, under the lock: it may have appeared since the test above
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent))
        try:
            write(tmp)
            if marker is not None:
                manifest = {"format": marker, "library_version": __version__, "files": _files_in(tmp)}
                (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
            if owned_files(tmp) is None:
                raise RuntimeError(f"internal error: the write of {path} left no {META_FILE} or {MANIFEST_FILE} marker")
            # mkdtemp makes a private (0700) directory; a checkpoint is ordinary shared data.
            umask = current_umask()
            tmp.chmod(0o777 & ~umask)
            for f in tmp.rglob("*"):
                f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)
            backup = None
            if path.exists():
                _carry_foreign(path, tmp)
                backup = path.parent / f".{path.name}.old-{os.getpid()}-{time.time_ns()}"
                os.replace(path, backup)
            os.replace(tmp, path)
            if backup is not None:
                shutil.rmtree(backup, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return path


def _refuse_existing(path: Path) -> None:
    try:
        if path.is_dir() and not any(path.iterdir()):
            return
    except FileNotFoundError:  # gone as we looked (another writer's swap); lexists below says what is there now
        pass
    if os.path.lexists(path):
        raise CheckpointError(f"{path} already exists (another save may have written it a moment ago); choose "
                              "another name, or ask for it to be replaced (replace=True)")


def _carry_foreign(old: Path, new: Path) -> None:
    """Link (or copy) into ``new`` every entry of ``old`` the workbench did not write."""
    foreign = _foreign_entries(old, owned_files(old) or frozenset())
    def clashes_with_new(name: str) -> bool:
        target = new / name.rstrip("/")
        parents = [p for p in target.parents if p != new and new in p.parents]
        return os.path.lexists(target) or any(os.path.lexists(p) and not p.is_dir() for p in parents)

    clashes = [name for name in foreign if clashes_with_new(name)]
    if clashes:
        raise CheckpointError(
            f"{old} holds {_shown(clashes)}, not written by the workbench, and this save would overwrite it; "
            "move or rename it first (nothing was changed)"
        )
    for name in foreign:
        source, target = old / name.rstrip("/"), new / name.rstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith("/"):
            target.mkdir()
        elif source.is_symlink():
            os.symlink(os.readlink(source), target)
        else:
            try:  # a hard link: no copy, and the original stays in the backup until the swap is done
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)


def record_files(directory: Union[str, Path], names: list[str]) -> None:
    """Add ``names`` to the file list of the checkpoint marker in ``directory`` (call under ``locked``).

    For files written into a checkpoint after it was saved (a tuned lens, a dictionary under
    ``saes/``), so that replacing the checkpoint replaces them too; a name ending in ``/`` stands
    for everything under that folder. A folder that is not a marked checkpoint is left as it is.
    """
    directory = Path(directory)
    meta = _read_json_dict(directory / META_FILE)
    if meta is None or meta.get("format") != CHECKPOINT_FORMAT or not _is_str_list(meta.get("files")):
        return
    meta["files"] = sorted(set(meta["files"]) | set(names))
    write_atomic(directory / META_FILE, json.dumps(meta, indent=2, default=str) + "\n")


def save_checkpoint(
    model: torch.nn.Module,
    path: Union[str, Path],
    tokenizer: Any = None,
    *,
    step: Optional[int] = None,
    metrics: Optional[dict] = None,
    meta: Optional[dict] = None,
    extra_files: Optional[dict[str, Union[str, bytes, Path]]] = None,
    replace: bool = True,
) -> Path:
    """Write ``model`` (and its tokenizer) to the directory ``path``, replacing it atomically.

    ``extra_files`` maps file names to contents written beside the weights (e.g. a metrics
    CSV or a training state saved as safetensors by the caller); a ``Path`` value is an
    existing file taken into the new version as it is (hard-linked when it can be: a run's
    weight snapshots are not copied at every save).

    ``path`` must be absent, empty, or a checkpoint the workbench wrote (else CheckpointError,
    naming the files found). Replacing a checkpoint replaces the files its ``meta.json`` lists;
    files someone else put in the folder stay, untouched, in the new version. With
    ``replace=False`` a ``path`` that exists (even one that appeared while this save ran) raises
    CheckpointError and nothing is written.
    """
    from workbench import __version__

    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    info = {
        **(meta or {}),  # first, so a caller's meta cannot overwrite the format version or step
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "step": step,
        "metrics": metrics or {},
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "format": CHECKPOINT_FORMAT,
    }
    for name in extra_files or {}:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"extra file name {name!r} must be a relative path inside the checkpoint")
        if Path(name).as_posix() in (WEIGHTS_FILE, CONFIG_FILE, META_FILE):
            raise ValueError(f"extra file name {name!r} is one the checkpoint itself writes; pick another name")

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        model.cfg.to_json(tmp / CONFIG_FILE)
        if tokenizer is not None:
            tokenizer.save(tmp)
        for name, content in (extra_files or {}).items():
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, Path):
                try:
                    os.link(content, target)
                except OSError:
                    shutil.copy2(content, target)
            else:
                target.write_bytes(content if isinstance(content, bytes) else content.encode())
        _keep_dictionaries_of(model, Path(path), tmp)
        # Last, so its list of files (what a later save may replace) is complete.
        (tmp / META_FILE).write_text(json.dumps({**info, "files": _files_in(tmp)}, indent=2, default=str) + "\n")

    return atomic_write_dir(path, write, replace=replace)


def _keep_dictionaries_of(model: torch.nn.Module, old: Path, new: Path) -> None:
    """Link into ``new`` the dictionaries under ``old/saes/`` trained on exactly these weights.

    A dictionary saved into a checkpoint is one of its recorded files, so replacing the checkpoint
    drops it (it was trained on the old weights) unless its recorded fingerprint is that of the
    weights being saved (a re-save of the same model): then it is taken into the new version.
    """
    owned = owned_files(old) if old.is_dir() else None
    # Only those recorded as the checkpoint's: any other folder there is carried over as it is anyway.
    folders = [d for d in sorted(old.glob("saes/*")) if d.is_dir() and not d.is_symlink()
               and f"saes/{d.name}/" in (owned or ())]
    # sae_meta.json: a dictionary's; clt.json: a cross-layer transcoder's (both keep a "config").
    recorded = {d: (_read_json_dict(d / "sae_meta.json") or _read_json_dict(d / "clt.json") or {}).get("config", {})
                for d in folders}
    if not any(isinstance(c, dict) and c.get("model_fingerprint") for c in recorded.values()):
        return
    mine = model_fingerprint(model)
    for folder, config in recorded.items():
        if isinstance(config, dict) and config.get("model_fingerprint") == mine:
            for name in _files_in(folder):
                source, target = folder / name, new / "saes" / folder.name / name
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copy2(source, target)


def read_meta(path: Union[str, Path]) -> dict:
    """meta.json of a checkpoint ({} when absent)."""
    meta_path = Path(path, META_FILE)
    if not meta_path.exists():
        return {}
    try:
        return json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path} is not valid JSON ({e}); the checkpoint is corrupt") from None


def load_config(path: Union[str, Path]) -> ModelConfig:
    config_path = Path(path, CONFIG_FILE)
    if not config_path.exists():
        raise CheckpointError(f"{path} is not a checkpoint: {CONFIG_FILE} is missing")
    try:
        return ModelConfig.from_dict(json.loads(config_path.read_text()))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path} is not valid JSON ({e}); the checkpoint is corrupt") from None
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{config_path} does not describe a valid model: {e}") from None


def load_checkpoint(
    path: Union[str, Path],
    device: Union[str, torch.device, None] = None,
    *,
    dtype: Union[torch.dtype, str] = torch.float32,
    fold_ln: bool = False,
    center_writing_weights: bool = False,
    center_unembed: bool = False,
    fold_value_biases: bool = False,
):
    """Load ``(model, tokenizer)`` from a directory written by ``save_checkpoint``.

    A save that replaces ``path`` while it is read (another process re-saving the checkpoint)
    cannot hand back a mixture of two versions: the folder's identity is compared before and
    after the read, and a load that saw it change, or found it missing while a writer held its
    lock, reads it again holding the lock that saves take (the version it then finds, whole).

    The weights are read one tensor at a time straight onto ``device`` (default: torch's default
    device, cpu) in ``dtype`` (default float32, whatever the file holds), so the peak is the
    model's bytes plus about one tensor (on the CPU in the file's dtype the weights are the
    file's mapped pages: ``interop.streaming``); a device or dtype the machine lacks raises
    ValueError naming it. The
    tokenizer is None when the checkpoint has none. The model is in eval mode. The four
    switches (all off: the weights as saved) run ``model.process_weights`` after loading, in
    float32 before the cast to ``dtype``.
    """
    from workbench.interop.streaming import check_placement

    device, dtype = check_placement(device, dtype)
    path = usable_path(path)
    options = dict(fold_ln=fold_ln, center_writing_weights=center_writing_weights, center_unembed=center_unembed,
                   fold_value_biases=fold_value_biases)
    before = _identity(path)
    if before is not None or not _being_written(path):
        try:  # without the lock first: reading never waits for anyone, nor needs a writable folder
            loaded = _load_once(path, device, dtype, **options)
        except Exception:
            # Any failure (a CheckpointError, or safetensors' own RuntimeError "unable to open file"
            # when a writer moved the folder away between our listing and our open) is ours to
            # report only if the folder stayed the one we started on; otherwise read again below.
            if _identity(path) == before:
                raise
        else:
            if _identity(path) == before:
                return loaded
    try:  # replaced while we read it (or missing while a writer works): read it again under its lock
        with locked(path):
            return _load_once(path, device, dtype, **options)
    except OSError:  # a folder we cannot write a lock file into: nobody saves there either, read as it is
        return _load_once(path, device, dtype, **options)


def _identity(path: Path) -> Optional[tuple[int, int, int]]:
    """(device, inode, mtime) of the folder: a replacing save puts another folder at ``path``."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


def _being_written(path: Path) -> bool:
    return os.path.lexists(path.parent / f".{path.name}.lock")


def _load_once(path: Path, device: torch.device, dtype: torch.dtype, *, fold_ln: bool,
               center_writing_weights: bool, center_unembed: bool, fold_value_biases: bool):
    from workbench.interop.streaming import ShardedSafetensors, fill_model, float32_weights, prefetched, unfilled_model
    from workbench.tokenizer import load_tokenizer

    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist (or is not a directory)")
    meta = read_meta(path)
    version = meta.get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {version!r}, newer than this library's "
            f"{FORMAT_VERSION}: upgrade the workbench to load it"
        )
    cfg = load_config(path)
    weights = path / WEIGHTS_FILE
    if not weights.exists():
        raise CheckpointError(f"{path} is not a complete checkpoint: {WEIGHTS_FILE} is missing")
    source = ShardedSafetensors(path, error=CheckpointError)  # reads the header: a broken file fails here
    processing = fold_ln or center_writing_weights or center_unembed or fold_value_biases
    load_dtype = torch.float32 if processing else dtype
    # On the CPU a tensor already in the file's dtype is the file's mapped pages, not a new allocation.
    mapped = frozenset(k for k in source.names() if device.type == "cpu" and source.dtype(k) == load_dtype)
    shaped = []  # the model the check builds on the meta device, made the loaded one below
    expected = check_config_matches_weights(path, cfg, {k: source.shape(k) for k in source.names()},
                                            load_dtype, device, mapped, shaped)
    model = unfilled_model(cfg, shaped[0])  # only now: the sizes are those of the file, and they fit
    not_finite: list[str] = []

    wide = float32_weights(model)  # DeepSeek's router: float32 whatever the dtype

    def tensors():  # (name, tensor), each read once onto the target device and dtype
        names = list(expected)
        read = prefetched(lambda n: source.tensor(n, device, torch.float32 if n in wide else load_dtype), names)
        for name, tensor in zip(names, read):
            _check_finite(name, tensor, not_finite)
            yield name, tensor

    with source:
        model = fill_model(model, tensors(), [], device, load_dtype)
    if not_finite:
        _warn_not_finite(path, not_finite)
    try:
        model.tokenizer = load_tokenizer(path)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the tokenizer file is corrupt ({e})") from None
    if processing:
        model.process_weights(fold_ln, center_writing_weights, center_unembed, fold_value_biases)
        model.to(dtype=dtype)
    model.eval()
    return model, model.tokenizer


def check_config_matches_weights(path: Path, cfg: ModelConfig, got: dict[str, tuple[int, ...]],
                                 dtype: torch.dtype, device: torch.device,
                                 mapped: frozenset[str] = frozenset(),
                                 shaped: Optional[list] = None) -> dict[str, tuple[int, ...]]:
    """The state-dict shapes ``cfg`` implies, checked against the safetensors header ``got``
    (name -> shape) and against the memory free on ``device``, before anything is allocated
    (``mapped``: tensors that will be the file's pages, not new memory). ``shaped``: a list the
    meta-device model is appended to once the checks pass, for the caller to fill (no second build).

    A config.json that lies about its sizes (n_layers = 10^6 beside a 2-layer file) must fail
    here with a message naming the field, not build the model it describes: the layer count and
    the embedding are read from the header first (no model built), then the model is built on
    the meta device (as ``count_params`` does: shapes, no memory) and compared tensor by tensor.
    """
    from workbench.accounting import meta_model
    from workbench.utils import available_memory_bytes

    def refuse(field: str, claim: Any, truth: str) -> None:
        raise CheckpointError(f"{path}: {CONFIG_FILE} says {field}={claim!r}, but {WEIGHTS_FILE} {truth}: the config "
                              "does not describe these weights (restore the config.json saved with them)")

    layers = sorted({int(m[1]) for k in got if (m := re.match(r"blocks\.(\d+)\.", k))})
    if layers and (len(layers) != cfg.n_layers or layers[-1] != cfg.n_layers - 1):
        refuse("n_layers", cfg.n_layers, f"holds {len(layers)} layer(s) (blocks.{layers[0]} to blocks.{layers[-1]})")
    embed = got.get("embed.W_E")
    if embed is not None and len(embed) == 2:
        for field, have in (("d_vocab", embed[0]), ("d_model", embed[1])):
            if getattr(cfg, field) != have:
                refuse(field, getattr(cfg, field), f"holds embed.W_E of shape {list(embed)} ({field} {have})")
    model = meta_model(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems = [f"missing {k}" for k in sorted(set(expected) - set(got))]
    problems += [f"unexpected {k}" for k in sorted(set(got) - set(expected))]
    problems += [
        f"{k}: config expects {expected[k]}, file has {got[k]}" for k in sorted(set(expected) & set(got)) if expected[k] != got[k]
    ]
    if problems:
        shown = "; ".join(problems[:6]) + (f"; ... ({len(problems)} problems)" if len(problems) > 6 else "")
        raise CheckpointError(f"{path}: weights do not match {CONFIG_FILE}: {shown}")
    # Buffers too (RoPE tables are n_ctx long and not in the file): all of it is allocated below.
    tensors = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    size = {k: t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
            for k, t in tensors.items() if k not in mapped}
    free = available_memory_bytes(device)
    if free is not None and size and sum(size.values()) > free:
        largest = max(size, key=size.get)
        fields = [f"{f}={getattr(cfg, f)}" for f in ("n_ctx", "d_model", "d_mlp", "d_vocab", "n_heads", "d_head")
                  if getattr(cfg, f, None) in tuple(tensors[largest].shape)]
        raise CheckpointError(
            f"{path}: the model {CONFIG_FILE} describes needs {sum(size.values()) / 2**30:.1f} GiB in {dtype} "
            f"({largest} alone {size[largest] / 2**30:.1f} GiB{', from ' + ', '.join(fields) if fields else ''}), "
            f"and {device} has {free / 2**30:.1f} GiB free: load it in a smaller dtype or on a larger machine, "
            "or fix the config if those sizes are wrong")
    if shaped is not None:
        shaped.append(model)
    return expected


def _check_finite(name: str, tensor: torch.Tensor, bad: list[str]) -> None:
    """Append ``name`` (with its counts) to ``bad`` when ``tensor`` holds NaN or inf."""
    # The sum is NaN or inf whenever an element is, and costs a tenth of isfinite(t).all() (no bool
    # tensor): 0.9 s of a 135M-parameter load. A sum that is not finite (or finite values that
    # overflow it) falls through to the exact test.
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor.sum())) and not bool(torch.isfinite(tensor).all()):
        nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        bad.append(f"{name} ({nan} NaN, {inf} inf of {tensor.numel()})")


def _warn_not_finite(path: Path, bad: list[str]) -> None:
    """Warn (NonFiniteWeightsWarning) naming the tensors that hold NaN or inf."""
    warnings.warn(
        f"{path}: {len(bad)} weight tensor(s) are not finite: {_shown(bad, 8)}; the model will produce NaN "
        "(the run that saved it probably diverged: re-train with a lower learning rate or an earlier checkpoint)",
        NonFiniteWeightsWarning, stacklevel=3,
    )


def model_fingerprint(model) -> str:
    """A short hash of the config (its non-default fields) and every parameter's shape, sum and
    sum of squares.

    Cheap (one pass, no copies), and two different trainings of one config differ in it. It is what
    the dictionaries, stores and checkpoints record as "the weights they were made on".
    """
    digest = hashlib.sha256(json.dumps(model.cfg.identity_dict(), sort_keys=True, default=str).encode())
    return weights_fingerprint(model.state_dict(), digest)


def weights_fingerprint(tensors, digest=None) -> str:
    """``model_fingerprint``'s hash of named tensors (a state dict) alone: each one's name, shape, sum
    and sum of squares, into ``digest`` (a fresh sha256 when None). What an attribution graph records
    of its transcoders' weights, beside the model's."""
    digest = hashlib.sha256() if digest is None else digest
    with torch.no_grad():
        for name, p in sorted(tensors.items()):
            q = p.detach().double()
            digest.update(f"{name}:{tuple(p.shape)}:{float(q.sum()):.10e}:{float((q * q).sum()):.10e}".encode())
    return digest.hexdigest()[:16]
