"""Writers replace only what is theirs: one check for every file the library writes by name.

    refuse_foreign([folder / "cfg.json", ...], ours=_is_our_dictionary, overwrite=False, what="dictionary")

A writer that puts a file of a fixed name into a folder it was given (a dictionary's ``cfg.json``, a
tokenizer's ``tokenizer.json``, circuit-tracer's ``config.yaml``) used to replace whatever file of that
name was there: a SAELens download, a Hugging Face model's tokenizer, a user's notes. Now a file of
the target name is replaced only when it is one the workbench wrote (each writer knows its own mark:
a format field, a ``workbench.json`` manifest), or when the caller says ``overwrite=True``. Otherwise
one ValueError names the files and nothing is written. A symbolic link at a target name is never
taken as ours: writing through it would write outside the folder. The same rule as checkpoints
(``checkpoint.check_replaceable``), for single files.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Type, Union


def refuse_foreign(targets: Iterable[Union[str, Path]], ours: Callable[[Path], bool], *, overwrite: bool = False,
                   what: str = "this save", error: Type[ValueError] = ValueError) -> None:
    """Raise ``error`` naming every target that exists and is not ``ours`` (nothing is written), unless
    ``overwrite``. ``ours(path)`` is asked only of regular files that exist."""
    if overwrite:
        return
    foreign = []
    for target in map(Path, targets):
        if not os.path.lexists(target):
            continue
        if target.is_symlink() or not target.is_file() or not _safely(ours, target):
            foreign.append(target)
    if foreign:
        shown = ", ".join(str(p) for p in foreign[:5]) + (f", ... ({len(foreign)} in all)" if len(foreign) > 5 else "")
        raise error(f"{what} would overwrite {shown}, which the workbench did not write (or cannot tell that it "
                    "did); nothing was written: move it away, choose another path, or pass overwrite=True to "
                    "replace it")


def _safely(ours: Callable[[Path], bool], path: Path) -> bool:
    try:
        return bool(ours(path))
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return False


def read_json_dict(path: Path) -> Optional[dict]:
    """The JSON object in ``path``, or None (absent, unreadable, not JSON, not an object)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def current_umask() -> int:
    """The process's umask, read without setting it: ``/proc/self/status`` on Linux. ``os.umask`` can
    only be read by setting it (to 0, then back), and the umask is the whole process's: a file another
    thread created in that instant (the app's preload, a background training run) would be
    world-writable. Elsewhere that set-and-restore is the fallback."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(target: Union[str, Path], data: Union[str, bytes, Callable[[Path], Any]],
                 mode: Optional[int] = None) -> Path:
    """Write ``data`` to ``target``: a new file directly, an existing one by rename (a reader sees the old
    file or the new one; a symbolic link at ``target`` is replaced, never written through). The
    temporary file's name carries the process id and a random part, so two writers of one target
    (two processes, or two threads of one) never write into, or rename away, each other's.

    ``data``: text, bytes, or a function that writes the file at the path it is given (``lambda tmp:
    save_file(tensors, str(tmp))``: a large file is never held in memory whole); such a file always
    goes by rename and gets an ordinary file's mode (``0o666`` less the umask, unless ``mode``)
    whatever mode the function gave it (safetensors' ``save_file`` makes ``0o600``)."""
    target = Path(target)
    if not callable(data):
        try:  # "x": fails if anything (a file, a link) is there, or appeared since a check
            with open(target, "xb" if isinstance(data, bytes) else "x", **({} if isinstance(data, bytes) else
                                                                          {"encoding": "utf-8"})) as f:
                f.write(data)
            if mode is not None:
                target.chmod(mode)
            return target
        except FileExistsError:
            pass
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        if callable(data):
            data(tmp)
            if mode is None:
                mode = 0o666 & ~current_umask()  # ordinary shared data, like checkpoints
        elif isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
        if mode is not None:
            tmp.chmod(mode)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return target


def is_json_with(path: Path, **fields: Any) -> bool:
    """Whether ``path`` holds a JSON object with these field values (a writer's own mark)."""
    data = read_json_dict(path)
    return data is not None and all(data.get(k) == v for k, v in fields.items())
