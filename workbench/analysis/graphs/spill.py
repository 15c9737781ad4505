"""A spill folder: where one attribution graph writes its edges while it computes them.

    with open_spill(folder, prompts=None) as spills:   # refuses a folder it cannot own, before any compute
        path = spills[0].path("raw", 0)              # raw-edges-<run>-00000.safetensors, recorded as this run's

A folder is owned by one computation at a time. ``open_spill`` checks everything that can be known
before the computation (a path that is a file or too long for the file system, a folder it cannot
write in, a folder another graph is writing, edge files left there by an earlier run) and refuses
each with one ValueError; then it holds the folder's lock (``checkpoint.locked``: an ``flock`` of
``.workbench-spill.lock`` inside the folder, which serialises threads and processes alike) while the
graph is computed. A second graph into the same folder is refused at once, not made to wait: two
graphs whose chunks shared one folder and one numbering deleted each other's files (an audit ran two
processes into one folder: 7 crashes in 11 trials, and 2 graphs returned with edges that were not
their own).

Every file a run writes carries its run id (``raw-edges-<run>-00000``, ``graph-edges-<run>-00000``)
and is recorded; a run that fails deletes exactly those files and the folders it made, nothing else.
A run killed outright leaves its chunks behind; the next run into that folder is refused, naming
them (they are the caller's to delete: a folder we did not write is never emptied by us).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Union

from workbench.utils import check_path

EDGE_GLOB = "*edges-*.safetensors"  # what a graph writes into a spill folder, of any run or version
LOCK_NAME = "workbench-spill"  # checkpoint.locked puts ".workbench-spill.lock" in the folder


class Spill:
    """One prompt's spill folder within a run: names its files and remembers which it wrote."""

    def __init__(self, folder: Path, run: str):
        self.folder, self.run = folder, run
        self.written: list[Path] = []

    def path(self, kind: str, index: int) -> Path:
        """The file ``{kind}-edges-<run>-{index:05d}.safetensors``, recorded as this run's."""
        path = self.folder / f"{kind}-edges-{self.run}-{index:05d}.safetensors"
        self.written.append(path)
        return path

    def discard(self) -> None:
        """Delete every file this run wrote here (a failed run leaves nothing of its own)."""
        for path in self.written:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self.written.clear()

    def __repr__(self) -> str:
        return f"Spill({str(self.folder)!r}, run={self.run!r})"


@contextlib.contextmanager
def open_spill(spill_dir: Optional[Union[str, Path]], prompts: Optional[int] = None) -> Iterator[list]:
    """The spill folders of one graph computation: ``[Spill]`` for one prompt (``prompts=None``), one
    ``prompt-{i}`` subfolder each for a batch of ``prompts``; ``[None, ...]`` without a ``spill_dir``.

    Everything is checked on entry, before the caller computes anything; the folder's lock is held
    until exit. On an exception the files this run wrote and the folders it made are removed.
    """
    count = 1 if prompts is None else prompts
    if spill_dir is None:
        yield [None] * count
        return
    folder = _usable(spill_dir)
    made = _make(folder)
    try:
        with _lock(folder):
            subs = [folder] if prompts is None else [folder / f"prompt-{b}" for b in range(count)]
            for sub in subs:
                _check_free(sub)
            run = f"{os.getpid():x}{secrets.token_hex(3)}"  # unique per run, in one process or many
            spills = [Spill(sub, run) for sub in subs]
            for sub in subs:
                made += _make(sub)
                _probe(sub)
            try:
                yield spills
            except BaseException:
                for spill in spills:
                    spill.discard()
                raise
    except BaseException:
        for path in reversed(made):  # only folders this run made, and only when nothing else is in them
            with contextlib.suppress(OSError):
                path.rmdir()
        raise


def _usable(spill_dir: Union[str, Path]) -> Path:
    """``spill_dir`` as a Path, or ValueError: a name the file system cannot hold, or not a folder."""
    folder = check_path(spill_dir, "spill_dir")
    if os.path.lexists(folder) and not folder.is_dir():
        raise ValueError(f"spill_dir {folder} exists and is not a folder: give a folder (new or empty) for the "
                         "graph's edge files")
    return folder


def _make(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; the folders this made, outermost first."""
    missing = [p for p in (folder, *folder.parents) if not os.path.lexists(p)][::-1]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, a read-only parent
        raise ValueError(f"spill_dir {folder} cannot be made ({e.strerror or e}): give a folder you can write "
                         "in") from None
    return [p for p in missing if p.is_dir()]


def _lock(folder: Path) -> contextlib.ExitStack:
    """``folder``'s spill lock, held; ValueError at once when another run holds it or the folder is read-only."""
    from workbench.checkpoint import hold_now

    try:
        return hold_now(folder / LOCK_NAME, lambda by: ValueError(
            f"spill_dir {folder} is in use: another graph{by} is writing its edges there now; give each graph its "
            "own folder"))
    except OSError as e:
        raise ValueError(f"spill_dir {folder} is not writable ({e.strerror or e}): give a folder you can write "
                         "in (nothing was computed)") from None


def _check_free(sub: Path) -> None:
    """ValueError unless ``sub`` is absent or a folder holding no edge files (under the lock)."""
    if os.path.lexists(sub) and not sub.is_dir():
        raise ValueError(f"spill_dir {sub} exists and is not a folder: give a folder (new or empty) for the "
                         "graph's edge files")
    taken = sorted(sub.glob(EDGE_GLOB)) if sub.is_dir() else []
    if taken:
        raise ValueError(f"spill_dir {sub} already holds edge files ({taken[0].name}, ...; another graph's, or "
                         "left by a run that was killed): give an empty folder (those files are not deleted or "
                         "overwritten)")


def _probe(sub: Path) -> None:
    """ValueError unless a file can be created in ``sub``: a read-only folder is refused before the
    computation, not after it when the first chunk is written."""
    try:
        fd, name = tempfile.mkstemp(prefix=".workbench-spill-probe-", dir=sub)
    except OSError as e:
        raise ValueError(f"spill_dir {sub} is not writable ({e.strerror or e}): give a folder you can write in "
                         "(nothing was computed)") from None
    os.close(fd)
    os.unlink(name)
