"""Uploaded checkpoints: the sidebar's upload box, each upload unpacked into a private temp folder
named by its hash, and the temp folders' lifetime."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
import re
import shutil
import weakref
from pathlib import Path
from typing import Optional

import streamlit as st

from workbench.archive import read_zip
from workbench.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from ui.common.loading import _load, app_device, weights_stamp


UPLOAD_LIMIT_MB = 200


# ---- uploads -------------------------------------------------------------------------------------
def upload_widget(where=None) -> None:
    """Accept a zipped checkpoint (or its files), unpack it under the temp folder, add it to the pickers.

    Each upload gets a fresh directory named by its content hash under the system temp folder,
    so an upload can never land on a checkpoint in the checkpoints folder. The upload is
    handled in the uploader's callback, before the page draws: the picker then already lists
    the new checkpoint and has it selected. An error names the file at fault, and a
    "Clear" button empties the uploader (a new key: Streamlit offers no other way).
    """
    where = where or st.sidebar
    key = f"upload_{st.session_state.get('upload_round', 0)}"
    error, done = st.session_state.get("upload_error"), st.session_state.get("upload_done")
    with where.expander("Upload a checkpoint", expanded=bool(error or done)):
        st.file_uploader(
            f"A .zip of a checkpoint directory, or its files ({CONFIG_FILE}, {WEIGHTS_FILE}, tokenizer.json, ...); "
            f"at most {UPLOAD_LIMIT_MB} MB",
            accept_multiple_files=True, key=key, max_upload_size=UPLOAD_LIMIT_MB, on_change=_on_upload, args=(key,),
        )
        if error:
            st.error(error)
            st.button("Clear the failed upload", key="upload_clear", on_click=_clear_upload)
        elif done:
            st.success(f"Uploaded as **{done}** and selected; it is in every checkpoint picker.")


def _clear_upload() -> None:
    st.session_state["upload_round"] = st.session_state.get("upload_round", 0) + 1
    st.session_state.pop("upload_error", None)
    st.session_state.pop("upload_done", None)


def _on_upload(key: str) -> None:
    """The uploader's callback: save, check that it loads, add it to the pickers and select it."""
    st.session_state.pop("upload_error", None)
    st.session_state.pop("upload_done", None)
    files = st.session_state.get(key) or []
    if not files:
        return
    names = ", ".join(f.name for f in files)
    try:
        name, path = save_upload([(f.name, f.getvalue()) for f in files])
    except ValueError as e:
        st.session_state["upload_error"] = f"Upload of {names} failed: {e}"
        return
    try:
        _load(str(Path(path).resolve()), weights_stamp(path), app_device())
    except Exception as e:  # a checkpoint that does not load: say which file, not the temp folder
        message = str(e).replace(f"{path}/", "").replace(str(path), "the upload")
        st.session_state["upload_error"] = f"{names} is not a usable checkpoint: {message}"
        if path not in st.session_state.get("uploaded_checkpoints", {}).values():
            shutil.rmtree(path, ignore_errors=True)  # a rejected upload is not kept
        return
    st.session_state.setdefault("uploaded_checkpoints", {})[name] = path
    st.session_state["ckpt"] = name
    st.session_state["upload_done"] = name


class TempFolder:
    """A private temp folder (``<prefix><pid>-*``, mode 0700) that lives as long as this object.

    ``weakref.finalize`` removes it when the object is garbage (the Streamlit session holding it
    in its state ended, a training job was replaced) and, at the latest, when the server stops
    (finalizers run at exit). The pid in the name lets the next server remove what a killed one
    left (``remove_stale_temp_folders``).
    """

    def __init__(self, prefix: str):
        remove_stale_temp_folders()
        self.path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.path), True)

    def remove(self) -> None:
        self._finalizer()


TEMP_PREFIXES = ("workbench-uploads-", "workbench-train-")
_stale_checked = False


def remove_stale_temp_folders() -> None:
    """Once per process: delete this user's ``workbench-uploads-<pid>-*`` / ``workbench-train-<pid>-*``
    folders whose server process is gone (killed before its finalizers could run)."""
    global _stale_checked
    if _stale_checked:
        return
    _stale_checked = True
    from workbench.checkpoint import _alive

    pattern = re.compile(rf"^({'|'.join(map(re.escape, TEMP_PREFIXES))})(\d+)-")
    with contextlib.suppress(OSError):
        for entry in Path(tempfile.gettempdir()).iterdir():
            match = pattern.match(entry.name)
            with contextlib.suppress(OSError):
                if match and int(match[2]) != os.getpid() and not _alive(int(match[2])) \
                        and entry.is_dir() and not entry.is_symlink() and entry.stat().st_uid == os.getuid():
                    shutil.rmtree(entry, ignore_errors=True)


_upload_root: Optional[TempFolder] = None
_upload_root_lock = threading.Lock()


def upload_root() -> Path:
    """This session's private upload folder (a ``TempFolder`` in its session state: removed when
    the session ends or the server stops); outside a session, one for the process.

    A fixed name such as /tmp/workbench-uploads could be created beforehand by another local
    user, or be a symlink to somewhere else; a fresh random folder of our own cannot.
    """
    global _upload_root
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    with _upload_root_lock:
        if get_script_run_ctx(suppress_warning=True) is not None:
            folder = st.session_state.get("_upload_folder")
            if folder is None or not folder.path.is_dir():
                folder = st.session_state["_upload_folder"] = TempFolder("workbench-uploads-")
            return folder.path
        if _upload_root is None or not _upload_root.path.is_dir():
            _upload_root = TempFolder("workbench-uploads-")
        return _upload_root.path


def save_upload(files: list[tuple[str, bytes]], root: Optional[Path] = None) -> tuple[str, str]:
    """Write uploaded files to a folder named by their hash under ``root`` (default :func:`upload_root`).

    Returns (picker name, directory). The same upload twice lands in the same folder; a folder
    or file on the way that is a symlink is refused rather than followed.
    """
    root = upload_root() if root is None else Path(root)
    total = sum(len(data) for _, data in files)
    if total > UPLOAD_LIMIT_MB * 2**20:
        raise ValueError(f"the upload is {total / 2**20:.0f} MB; the limit is {UPLOAD_LIMIT_MB} MB")
    digest = hashlib.sha256(b"".join(n.encode() + d for n, d in sorted(files))).hexdigest()[:12]
    target = root / digest
    contents: dict[str, bytes] = {}
    for fname, data in files:
        if fname.endswith(".zip"):
            contents.update(_unzip(data, fname))
        else:
            contents[Path(fname).name] = data
    contents = _strip_common_folder(contents)
    if CONFIG_FILE not in contents or WEIGHTS_FILE not in contents:
        raise ValueError(
            f"this upload is not a checkpoint: it needs {CONFIG_FILE} and {WEIGHTS_FILE} "
            f"(got {sorted(contents) or 'nothing'})"
        )
    for folder in (root, target):
        if folder.is_symlink():
            raise ValueError(f"refusing to write the upload through the symlink {folder}")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    existed = target.is_dir()
    target.mkdir(mode=0o700, exist_ok=True)
    for fname, data in contents.items():
        try:  # O_NOFOLLOW: a symlink planted in place of a file is refused, never written through
            fd = os.open(target / fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            if not existed:
                shutil.rmtree(target, ignore_errors=True)
            raise ValueError(f"cannot write the uploaded {fname} into {target}: {e.strerror}") from None
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    stem = next((Path(n).stem for n, _ in files if n.endswith(".zip")), "checkpoint")
    return f"upload: {stem} ({digest[:6]})", str(target)


def _unzip(data: bytes, name: str = "the .zip file") -> dict[str, bytes]:
    """The zip's files, inflated under the upload limit as they are read (``workbench.archive``)."""
    return read_zip(data, name=name, max_total=UPLOAD_LIMIT_MB * 2**20,
                    keep=lambda info: "__MACOSX" not in info.filename)


def _strip_common_folder(contents: dict[str, bytes]) -> dict[str, bytes]:
    """A zip of a folder holds 'name/config.json': keep only the files of the checkpoint itself."""
    if CONFIG_FILE in contents:
        return {k: v for k, v in contents.items() if "/" not in k}
    tops = {k.split("/")[0] for k in contents if "/" in k}
    for top in sorted(tops):
        inner = {k[len(top) + 1:]: v for k, v in contents.items() if k.startswith(top + "/")}
        if CONFIG_FILE in inner:
            return {k: v for k, v in inner.items() if "/" not in k}
    return contents
