"""What every page shares: where checkpoints live, cached loading, uploads, the pickers, prompt
input, and the cached call into the library that every analysis goes through.

Models are cached with ``st.cache_resource`` keyed by the checkpoint directory and the
modification time of its weights, so re-saving a checkpoint reloads it and nothing else
ever does: widgets change the analysis (cached with ``st.cache_data`` by the pages, keyed
by :attr:`Checkpoint.key` and plain values), never the model. Bad input (a directory that
is not a checkpoint, a corrupt file, an unusable prompt) becomes a message in the page.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import inspect
import json
import os
import sys
import tempfile
import threading
import re
import shutil
import types
import warnings
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd
import streamlit as st
import torch

import workbench as wb
from workbench.accounting import count_model_params
from workbench.analysis import AblationSpec, AnswerMetric, ablation_hooks, logit_lens, suggest_answer, tuned_lens
from workbench.analysis.lens import TUNED_LENS_WEIGHTS, TunedLens
from workbench.analysis.metrics import METRIC_UNITS
from workbench.analysis.reference import reference_batch as library_reference_batch
from workbench.archive import read_zip
from workbench.checkpoint import CONFIG_FILE, WEIGHTS_FILE, NonFiniteWeightsWarning, read_meta
from workbench.padding import TokenBatch
from workbench.tokenizer import IdTokenizer, unknown_pieces
from workbench.training import read_metrics

REPO = Path(__file__).resolve().parent.parent
ENV_VAR = "WORKBENCH_CHECKPOINTS"
DEFAULT_CHECKPOINT = "stories-2026"
# An indirect-object sentence of the stories grammar: the shipped stories models should answer "Mary".
DEFAULT_PROMPT = ("Once upon a time, Mary and John lived in a small town. "
                  "When Mary and John went to the store, John gave a drink to")
UPLOAD_LIMIT_MB = 200
OTHER_DIR = "Another directory…"
# Widget keys shared by several pages, kept while another page is shown (see app.py).
PERSISTENT = ("ckpt", "ckpt_dir", "ckpt_b", "ckpt_b_dir", "prompt")

# How many times each checkpoint was really loaded (read from disk): the tests use it to
# check that changing a widget never reloads a model.
LOADS: Counter = Counter()
# What loading a checkpoint warned about (NaN or inf weights), by Checkpoint.key: every page shows it.
NOTICES: dict[tuple[str, int], list[str]] = {}


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
    folder of links to the shipped checkpoints) or under this session's ``uploads`` folder, unless
    the server was started with ``--allow-any-path``. A Hugging Face hub id that is not a folder
    is let through: it opens the hub's own cache, not a path the user names."""
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
    return (f"`{path}` is outside the checkpoints folder `{root}`: this server opens only folders under it, or "
            "an upload. To open any folder, start the app with `streamlit run app.py -- --allow-any-path` "
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
    """The checkpoints folder plus whatever was uploaded this session."""
    return {**list_checkpoints(checkpoints_root()), **st.session_state.get("uploaded_checkpoints", {})}


def default_checkpoint(options: list[str]) -> Optional[str]:
    if DEFAULT_CHECKPOINT in options:
        return DEFAULT_CHECKPOINT
    return options[0] if options else None


# ---- loading -----------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """A loaded checkpoint: the model, its tokenizer, meta.json, and a cache key for analyses."""

    name: str
    path: str
    stamp: int
    model: Any
    tokenizer: Any
    meta: dict
    lock: threading.Lock = field(repr=False)

    @property
    def key(self) -> tuple[str, int]:
        """Hashable identity for ``st.cache_data`` functions: (directory, weights mtime)."""
        return (self.path, self.stamp)

    @property
    def cfg(self) -> wb.ModelConfig:
        return self.model.cfg


def weights_stamp(path: str) -> int:
    try:
        return Path(path, WEIGHTS_FILE).stat().st_mtime_ns
    except OSError:
        return 0


def app_device() -> str:
    """Where the app runs its models: $WORKBENCH_DEVICE when set (e.g. ``cpu`` to keep a GPU free),
    else CUDA when torch sees a GPU, else the CPU."""
    return os.environ.get("WORKBENCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


@st.cache_resource(max_entries=8, show_spinner="Loading the checkpoint…")
def _load(path: str, stamp: int, device: str = "cpu") -> tuple[Any, Any, dict, threading.Lock]:
    from workbench.interop.hf import looks_like_hf_dir

    LOADS[path] += 1
    with warnings.catch_warnings(record=True) as caught:  # kept for the pages: NaN weights, see load_notices
        warnings.simplefilter("always", NonFiniteWeightsWarning)
        if looks_like_hf_dir(path):  # a Hugging Face model directory, imported with every hook
            model = wb.from_hf(path, device=device)
            tok = model.tokenizer
        else:
            model, tok = wb.load_checkpoint(path, device=device)
    NOTICES[(path, stamp)] = [str(w.message) for w in caught if issubclass(w.category, NonFiniteWeightsWarning)]
    for w in caught:
        if not issubclass(w.category, NonFiniteWeightsWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if tok is None:  # abstract-id tasks (induction, modular): prompts are typed as token ids
        tok = model.tokenizer = IdTokenizer(model.cfg.d_vocab)
    for p in model.parameters():
        p.requires_grad_(False)
    # One lock per model: hooks are attached to the shared module during a forward, so two
    # sessions must not run the same model at once.
    return model, tok, read_meta(path), threading.Lock()


def model_for(key: tuple[str, int]):
    """The cached model of a :attr:`Checkpoint.key`, for use inside ``st.cache_data`` functions."""
    model, _, _, lock = _load(*key, app_device())
    return model, lock


def load(path: str, name: Optional[str] = None, where=st) -> Optional[Checkpoint]:
    """Load (cached) the checkpoint at ``path``; on failure show why in ``where`` and return None."""
    from workbench.interop.hub import HFImportError, looks_like_hub_id, resolve_hf_source
    from workbench.utils import check_path

    try:
        p = check_path(path).expanduser()
    except ValueError as e:  # a name over 255 bytes: stat would raise OSError [Errno 36]
        where.error(f"Cannot open this path: {e}.")
        return None
    hub_id = not p.is_dir() and looks_like_hub_id(path)
    if hub_id:  # its snapshot in the Hugging Face cache (downloaded when online)
        try:
            p = resolve_hf_source(path)
        except HFImportError as e:
            where.error(f"Cannot open `{path}`: {e}")
            return None
    if not p.is_dir():
        where.error(f"`{path}` is not a directory. Pick a checkpoint directory (it holds {CONFIG_FILE} and {WEIGHTS_FILE}) "
                    "or type a Hugging Face hub id such as gpt2.")
        return None
    experiment = experiment_run(p)
    if experiment is not None:
        where.error(f"`{path}` is a run of the experiment {experiment!r}, not a checkpoint: open it on the Sweeps page.")
        return None
    try:
        model, tok, meta, lock = _load(str(p.resolve()), weights_stamp(str(p)), app_device())
    except wb.CheckpointError as e:
        where.error(f"Cannot load this checkpoint: {e}")
        return None
    except Exception as e:  # anything else a damaged directory can raise
        where.error(f"Cannot load `{path}`: {type(e).__name__}: {e}")
        return None
    label = name or (path if hub_id else p.name)
    return Checkpoint(label, str(p.resolve()), weights_stamp(str(p)), model, tok, meta, lock)


def experiment_run(path: Path) -> Optional[str]:
    """The experiment's name when ``path`` holds an experiment run's config.json (what the
    scripts in experiments/ write), not a model's; None otherwise."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and "experiment" in config and "d_model" not in config:
        return str(config["experiment"])
    return None


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


# ---- prompts -------------------------------------------------------------------------------------
def default_prompt(ckpt: Optional[Checkpoint]) -> str:
    """A prompt the checkpoint can read: meta.json's ``default_prompt``, else a stories sentence."""
    if ckpt is None:
        return DEFAULT_PROMPT
    if isinstance(ckpt.meta.get("default_prompt"), str):
        return ckpt.meta["default_prompt"]
    if isinstance(ckpt.tokenizer, IdTokenizer):
        return ckpt.tokenizer.decode(_id_prompt(ckpt))
    return DEFAULT_PROMPT


def _id_prompt(ckpt: Checkpoint) -> list[int]:
    """A prompt of token ids that fits the model's context: the first clean prompt of the task it
    was trained on (``a b = `` for modular addition, a repeated segment for induction), else a
    random segment seen twice (what induction heads copy), at most half the context long."""
    from workbench.analysis.circuits.tasks import prompt_spec
    from workbench.planted import spec_prompts

    try:
        spec = prompt_spec(ckpt.meta, ckpt.cfg, ckpt.path)
        ids = spec_prompts(spec, batch=1, seed=0)[0][0].tolist() if spec else None
    except (ValueError, KeyError, TypeError):
        ids = None
    if ids and len(ids) <= ckpt.cfg.n_ctx and max(ids) < ckpt.cfg.d_vocab:
        return ids
    half = max(1, min(12, ckpt.cfg.n_ctx // 2))
    segment = torch.randint(0, ckpt.cfg.d_vocab, (half,), generator=torch.Generator().manual_seed(0)).tolist()
    return segment * 2


def prompt_box(ckpt: Optional[Checkpoint], key: str = "prompt", label: str = "Prompt", where=st,
               default: Optional[str] = None) -> str:
    """A text area whose default (``default``, else the checkpoint's) follows the checkpoint until the user edits it."""
    default = default if default is not None else default_prompt(ckpt)
    last_default = st.session_state.get(f"{key}__default")
    if key not in st.session_state or st.session_state[key] == last_default:
        st.session_state[key] = default
    st.session_state[f"{key}__default"] = default
    return where.text_area(label, key=key, height=80)


def encode_prompt(ckpt: Checkpoint, text: str, min_tokens: int = 2) -> list[int]:
    """Token ids of ``text`` for this checkpoint, or ValueError with a message for the page."""
    if not text or not text.strip():
        raise ValueError("The prompt is empty: type some text.")
    bad = unknown_pieces(ckpt.tokenizer, text)
    if bad:
        shown = ", ".join(repr(b) for b in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise ValueError(
            f"This checkpoint's tokenizer cannot encode {shown}. "
            + ("Type token ids between 0 and {}, separated by spaces.".format(ckpt.cfg.d_vocab - 1)
               if isinstance(ckpt.tokenizer, IdTokenizer)
               else f"Use only what its vocabulary ({ckpt.tokenizer.vocab_size} tokens) contains.")
        )
    ids = ckpt.tokenizer.encode(text)
    if len(ids) > ckpt.cfg.n_ctx:
        raise ValueError(
            f"The prompt is {len(ids)} tokens; this model's context is {ckpt.cfg.n_ctx} tokens. Shorten the prompt."
        )
    if len(ids) < min_tokens:
        raise ValueError(f"The prompt is {len(ids)} token(s); at least {min_tokens} are needed to score a prediction.")
    return ids


def prompt_ids(ckpt: Checkpoint, text: str, where=st) -> Optional[tuple[int, ...]]:
    """:func:`encode_prompt`, with the message shown in the page instead of raised."""
    try:
        return tuple(encode_prompt(ckpt, text))
    except ValueError as e:
        where.warning(str(e))
        return None


# ---- what a page scores ----------------------------------------------------------------------------
# The metric picker's choices: label -> AnswerMetric kind ("loss": the prompt's mean next-token loss).
METRICS = {
    "logit difference (answer − wrong)": "logit_diff",
    "answer probability": "prob",
    "answer log-probability": "logprob",
    "answer rank": "rank",
    "answer logit": "logit",
    "mean loss over the prompt": "loss",
}


@dataclass(frozen=True)
class Target:
    """What a page scores: the answer (and its rival) at one position, and the metric kind."""

    pos: int
    answer: int
    wrong: Optional[int]
    answer_str: str
    wrong_str: str
    kind: str = "logit_diff"

    def metric(self) -> Optional[AnswerMetric]:
        """The library metric (None for the prompt's mean loss, which the library uses by default)."""
        if self.kind == "loss":
            return None
        kind = self.kind if self.kind != "logit_diff" or self.wrong is not None else "logit"
        return AnswerMetric(kind, self.answer, self.wrong, self.pos)

    @property
    def units(self) -> str:
        return METRIC_UNITS[self.kind if self.kind != "logit_diff" or self.wrong is not None else "logit"]

    def describe(self) -> str:
        if self.kind == "loss":
            return "the prompt's mean loss"
        a, w = repr(self.answer_str), repr(self.wrong_str)
        what = {"logit_diff": f"logit[{a}] − logit[{w}]" if self.wrong is not None else f"logit[{a}]",
                "logit": f"logit[{a}]", "prob": f"p({a})", "logprob": f"log p({a})", "rank": f"rank of {a}"}
        return f"{what[self.kind]} at position {self.pos}"


def follow_default(key: str, default: Any, context: Any) -> None:
    """Set widget ``key`` to ``default`` whenever ``context`` (the prompt, the position) changes,
    or when the widget has no value yet: a default computed for one prompt never outlives it."""
    if key not in st.session_state or st.session_state.get(f"{key}__context") != context:
        st.session_state[key] = default
    st.session_state[f"{key}__context"] = context


def token_id(ckpt: Checkpoint, text: str, what: str) -> int:
    """The id of one token typed as text; ValueError naming ``what`` otherwise."""
    try:
        return ckpt.model.to_single_token(text)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def target_picker(ckpt: Checkpoint, ids: tuple[int, ...], key: str, where=st, kinds: bool = True,
                  kind_default: str = "logit_diff") -> Optional[Target]:
    """Position, answer, wrong token (and, with ``kinds``, the metric) for prompt ``ids``.

    The answer and wrong token default to ``workbench.analysis.suggest_answer`` (the task's
    answer for a task prompt, else the model's top two predictions) and follow the prompt
    and the position: a new prompt never keeps the last one's answer. None (with a message)
    when a typed token is not one token of this vocabulary.
    """
    tokens = [ckpt.tokenizer.token_str(i) for i in ids]
    cols = where.columns([2, 2, 2, 3] if kinds else [2, 2, 2])
    follow_default(f"{key}_pos", len(ids) - 1, ids)
    pos = cols[0].selectbox("At position", range(len(ids)), key=f"{key}_pos", persist_state="session",
                            format_func=lambda p: f"{p}: {tokens[p]!r}" + (" (last)" if p == len(ids) - 1 else ""))
    suggestion = analysis(suggest_answer, ckpt.key, ids, pos=pos, meta=ckpt.meta)
    follow_default(f"{key}_answer", suggestion["answer_str"], (ids, pos))
    follow_default(f"{key}_wrong", suggestion["wrong_str"], (ids, pos))
    answer_text = cols[1].text_input("Answer token", key=f"{key}_answer", persist_state="session",
                                     help=f"Default: {suggestion['source']}.")
    wrong_text = cols[2].text_input("Wrong token (optional)", key=f"{key}_wrong", persist_state="session",
                                    help="The rival of the logit difference; empty: the answer's logit alone.")
    kind = kind_default
    if kinds:
        labels = list(METRICS)
        follow_default(f"{key}_kind", next(k for k, v in METRICS.items() if v == kind_default), None)
        kind = METRICS[cols[3].selectbox("Metric", labels, key=f"{key}_kind", persist_state="session")]
    try:
        answer = token_id(ckpt, answer_text, "Answer token")
        wrong = token_id(ckpt, wrong_text, "Wrong token") if wrong_text.strip() else None
    except ValueError as e:
        where.warning(str(e))
        return None
    where.caption(f"Scored at position {pos} ({tokens[pos]!r}, predicting the next token); default answer: "
                  f"{suggestion['source']}.")
    return Target(int(pos), answer, wrong, answer_text, wrong_text if wrong is not None else "", kind)


# ---- analyses, cached ----------------------------------------------------------------------------
Ablation = tuple[AblationSpec, ...]  # frozen dataclasses: hashable, so they key the cache as they are


def _qualified_name(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


@dataclass(frozen=True)
class TokenRows:
    """A batch of token ids as nested tuples: a hashable argument for :func:`analysis`, handed
    to ``fn`` as a tensor (e.g. the corrupted prompts of activation patching)."""

    rows: tuple[tuple[int, ...], ...]

    def to_data(self, model) -> Any:
        """A tensor when the rows are equally long, else a left-padded ``TokenBatch`` (prompts of
        different lengths, each computed as it is alone)."""
        if len({len(r) for r in self.rows}) == 1:
            return torch.tensor(self.rows, device=model.device)
        pad_id = getattr(model.tokenizer, "pad_id", 0)
        return TokenBatch.from_ids(self.rows, pad_id, "left", model.device)


def _run(fn: Callable, key: tuple[str, int], ids: Optional[tuple[int, ...]], ablation: Ablation,
         reference: Optional[tuple[tuple[int, ...], ...]], progress: Optional[Callable[[int, int], Any]],
         kwargs: dict) -> Any:
    """The body of :func:`analysis` and :func:`analysis_with_progress`: ``fn`` on the cached model."""
    model, lock = model_for(key)
    params = inspect.signature(fn).parameters
    kwargs = {k: v.to_data(model) if isinstance(v, TokenRows) else v for k, v in kwargs.items()}
    if progress is not None and "progress" in params:
        kwargs["progress"] = progress
    with lock, torch.no_grad():
        if ids is None:
            return fn(model, **kwargs)
        # one prompt (a tuple of ids), or a batch of equally long ones (a tuple of such tuples)
        tokens = torch.tensor(ids if isinstance(ids[0], tuple) else [ids], device=model.device)
        ref = torch.tensor(reference, device=model.device) if reference is not None else None
        if "reference" in params:
            kwargs["reference"] = ref
        hooks = [hook for spec in ablation for hook in ablation_hooks(model, tokens, spec, ref)]
        with model.hooks(fwd_hooks=hooks):
            return fn(model, tokens, **kwargs)


@st.cache_data(max_entries=256, show_spinner=False, hash_funcs={types.FunctionType: _qualified_name})
def analysis(
    fn: Callable,
    key: tuple[str, int],
    ids: Optional[tuple[int, ...]],
    ablation: Ablation = (),
    reference: Optional[tuple[tuple[int, ...], ...]] = None,
    **kwargs,
) -> Any:
    """``fn(model, tokens, **kwargs)`` (a ``workbench.analysis`` function) on the cached model
    ``key`` and prompt ``ids``; ``fn(model, **kwargs)`` when ``ids`` is None.

    Cached by value (the function's qualified name, checkpoint identity, token ids,
    arguments), so a rerun with the same widgets costs nothing and a widget that changes
    only the drawing recomputes nothing. With ``ablation``, ``fn`` runs on the model with
    those units ablated (the hooks of ``workbench.analysis.ablation_hooks`` stay attached
    while it runs). ``reference`` is the batch that mean and resample ablations draw from:
    the ablation's, and ``fn``'s own when it takes a ``reference`` (as ``ablation_sweep``
    does). No callback ever goes in here: Streamlit replays the elements a cached function
    drew on a cache hit, and a progress bar made outside it cannot be replayed (see
    :func:`analysis_with_progress`).
    """
    return _run(fn, key, ids, ablation, reference, None, kwargs)


class _ResultStore:
    """A small process-wide LRU of results, shared by every session (as ``st.cache_data`` is)."""

    def __init__(self, max_entries: int = 32):
        self.max_entries = max_entries
        self.lock = threading.Lock()
        self.items: OrderedDict = OrderedDict()

    def get(self, key) -> Any:
        with self.lock:
            if key not in self.items:
                return None
            self.items.move_to_end(key)
            return copy.deepcopy(self.items[key])

    def put(self, key, value) -> None:
        with self.lock:
            self.items[key] = copy.deepcopy(value)
            self.items.move_to_end(key)
            while len(self.items) > self.max_entries:
                self.items.popitem(last=False)


@st.cache_resource(show_spinner=False)
def _progress_results() -> _ResultStore:
    return _ResultStore()


def analysis_with_progress(
    fn: Callable,
    key: tuple[str, int],
    ids: Optional[tuple[int, ...]],
    progress: Callable[[int, int], Any],
    reference: Optional[tuple[tuple[int, ...], ...]] = None,
    **kwargs,
) -> Any:
    """:func:`analysis` for a long ``fn`` that reports ``progress(done, total)`` (the sweep).

    The callback draws into the page, so this is not an ``st.cache_data`` function (a cache
    hit there replays the drawing into a block that no longer exists: CacheReplayClosureError);
    results are kept in a store of their own, keyed by the same values, and shared by
    every session. A hit returns at once without calling ``progress``.
    """
    cache_key = (_qualified_name(fn), key, ids, reference, tuple(sorted(kwargs.items())))
    store = _progress_results()
    result = store.get(cache_key)
    if result is None:
        result = _run(fn, key, ids, (), reference, progress, dict(kwargs))
        store.put(cache_key, result)
    return result


# ---- lenses ----------------------------------------------------------------------------------------
LENSES = {"logit lens": "logit", "tuned lens": "tuned"}


def has_tuned_lens(ckpt: Checkpoint) -> bool:
    """Whether the checkpoint ships a tuned lens (``tuned_lens.safetensors`` beside its weights)."""
    return (Path(ckpt.path) / TUNED_LENS_WEIGHTS).is_file()


@st.cache_resource(max_entries=8, show_spinner=False)
def _tuned_lens(path: str, stamp: int) -> TunedLens:
    model, _, _, _ = _load(path, weights_stamp(path), app_device())
    return TunedLens.load(path, model)


def tuned_lens_of(model, tokens, path: str, k: int = 3):
    """``workbench.analysis.tuned_lens`` with the lens the checkpoint at ``path`` ships
    (loaded once per file version); a plain function of values, so :func:`analysis` caches it."""
    stamp = Path(path, TUNED_LENS_WEIGHTS).stat().st_mtime_ns
    return tuned_lens(model, tokens, _tuned_lens(path, stamp), k=k)


def lens_picker(ckpt: Checkpoint, key: str, where=st) -> str:
    """'logit' or 'tuned': a choice offered wherever a lens is drawn, when the checkpoint has a tuned lens."""
    if not has_tuned_lens(ckpt):
        where.caption("Logit lens (this checkpoint ships no tuned lens: `python -m workbench tuned-lens` trains one).")
        return "logit"
    return LENSES[where.radio("Lens", list(LENSES), horizontal=True, key=key, persist_state="session",
                              help="The tuned lens passes each layer's stream through a learned affine map "
                                   "first (Belrose et al. 2023), which removes most of the logit lens' "
                                   "bias at early layers.")]


def lens_table(ckpt: Checkpoint, ids, which: str, ablation: Ablation = (), reference=None, k: int = 3):
    """The logit or tuned lens of prompt ``ids`` (cached), optionally ablated."""
    if which == "tuned":
        return analysis(tuned_lens_of, ckpt.key, ids, ablation=ablation, reference=reference, path=ckpt.path, k=k)
    return analysis(logit_lens, ckpt.key, ids, ablation=ablation, reference=reference, k=k)


@st.cache_data(max_entries=32, show_spinner=False)
def reference_batch(key: tuple[str, int], ids: tuple[int, ...], rows: int = 16) -> tuple[tuple[int, ...], ...]:
    """``workbench.analysis.reference_batch`` for checkpoint ``key`` (its meta.json names the
    task), as tuples so it can key ``analysis``."""
    model, _, meta, _ = _load(*key, app_device())
    return tuple(tuple(row) for row in library_reference_batch(model, meta, ids, rows=rows).tolist())


# ---- drawing --------------------------------------------------------------------------------------
def show(fig, key: Optional[str] = None, **kwargs) -> Any:
    """Draw a plotly figure in the app's own light or dark theme.

    Streamlit's chart theme sets backgrounds, fonts and grid colours from the theme the user
    picked, over whatever plotly template the figure carries; the fixed template of
    ``workbench.viz`` is dropped so it is not sent to the browser at all. The data's colour
    scales (perceptually uniform, chosen by viz) stay.
    """
    fig.layout.template = None
    _colorbar_titles_aside(fig)
    return st.plotly_chart(fig, theme="streamlit", key=key, **kwargs)


def _colorbar_titles_aside(fig) -> None:
    """Colour-bar titles along the bar's right side: on top (plotly's default) a title wider than
    the bar runs into the top tick label."""
    for trace in fig.data:  # only bars a figure has: reading trace.colorbar would create one
        spec = trace.to_plotly_json()
        if "colorbar" in spec:
            trace.colorbar.title.side = "right"
        if "colorbar" in spec.get("marker", {}):
            trace.marker.colorbar.title.side = "right"
    for name, value in fig.layout.to_plotly_json().items():
        if name.startswith("coloraxis") and "colorbar" in value:
            fig.layout[name].colorbar.title.side = "right"


def table(df, **kwargs) -> None:
    st.dataframe(df, hide_index=True, **kwargs)


# ---- the model card ---------------------------------------------------------------------------------
@st.cache_data(max_entries=32, show_spinner=False)
def _read_metrics(path: str, stamp: int) -> pd.DataFrame:
    return read_metrics(path)


def _metrics_stamp(path) -> int:
    p = Path(path)
    csv = p / "metrics.csv" if p.is_dir() else p
    try:
        return csv.stat().st_mtime_ns
    except OSError:
        return 0


def training_curve(path, where=st) -> Optional[pd.DataFrame]:
    """metrics.csv under ``path`` (``workbench.training.read_metrics``, cached per file version);
    None, with a message in ``where`` when it is unreadable, when there is none or it is empty."""
    try:
        metrics = _read_metrics(str(path), _metrics_stamp(path))
    except ValueError as e:
        where.warning(f"Cannot draw the training curve: {e}")
        return None
    if metrics.attrs.get("skipped_rows"):
        where.warning(f"metrics.csv has {metrics.attrs['skipped_rows']} malformed row(s) (not numbers); "
                      "they are left out of the curve.")
    return None if metrics.empty or "step" not in metrics else metrics


@st.cache_data(max_entries=64, show_spinner=False)
def param_counts(cfg: wb.ModelConfig) -> dict[str, int]:
    """``workbench.count_params`` (it builds the model on the meta device), cached per config."""
    return wb.count_params(cfg)


def config_table(cfg: wb.ModelConfig) -> pd.DataFrame:
    return pd.DataFrame({"field": list(cfg.to_dict()), "value": [str(v) for v in cfg.to_dict().values()]})


def model_card(ckpt: Checkpoint) -> None:
    """Config, parameter counts, what meta.json says, and the training curve."""
    from workbench import viz

    counts = count_model_params(ckpt.model)  # the loaded model: nothing to build
    cols = st.columns(4)
    cols[0].metric("Parameters", f"{counts['total']:,}")
    cols[1].metric("Non-embedding", f"{counts['non_embedding']:,}")
    cols[2].metric("Layers × heads", f"{ckpt.cfg.n_layers} × {ckpt.cfg.n_heads}")
    cols[3].metric("Context", f"{ckpt.cfg.n_ctx} tokens")
    left, right = st.columns([1, 2])
    with left:
        table(config_table(ckpt.cfg), height=300)
    with right:
        metrics = training_curve(ckpt.path)
        if metrics is not None:
            show(viz.loss_curves(metrics, title=f"Training curve of {ckpt.name}"), key=f"curve_{ckpt.path}")
        else:
            st.info("This checkpoint has no metrics.csv, so there is no training curve.")
    shown = {k: v for k, v in ckpt.meta.items() if k not in ("metrics",)}
    with st.expander("meta.json"):
        st.json(shown, expanded=False)
    from ui import vocabulary  # here, not at the top: ui.vocabulary imports this module

    with st.expander("Vocabulary browser"):
        vocabulary.render(ckpt)
