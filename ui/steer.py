"""Steer: push the model along a direction and read the prompt's generation clean and steered.

The direction comes from contrastive prompts typed here (``steering_vector``: the mean
activation over the positive lines minus that over the negative ones), from a saved direction
file (``Direction.load``: the checkpoint's ``directions/`` folder, $WORKBENCH_DIRECTIONS, or an
upload of its .json and .safetensors, or of the .zip this page downloads), or from a linear probe
trained here on a few lines of text whose listed tokens get label 1 (``train_probe`` with
``TokenIn``). A direction made here (prompts or probe) downloads as one .zip of the two files
``Direction.save`` writes (``Direction.to_bytes``), which the upload takes back. The steering edit
(``model.steer``: add, ablate or clamp, at a scale) runs on the prompt's greedy continuation;
clean and steered sit side by side with each text's projection along the direction
(``steering_comparison``). Every number comes from the library; a direction that does not fit
the model (another model, another width, the zero vector) is a message.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Optional

import streamlit as st

from ui import common
from ui.common.steering import MODE_HELP, SCALES, compare, new_tokens, side_by_side, steer  # noqa: F401  (steer.*)
from workbench.analysis import Direction, TokenIn, steering_vector, train_probe

SOURCES = {"contrastive prompts": "contrastive", "a saved direction": "file", "a probe trained here": "probe"}
SITES = {"hook_resid_post": "residual stream, after the block", "hook_resid_pre": "residual stream, before the block",
         "hook_attn_out": "attention output", "hook_mlp_out": "MLP output"}
READ_AT = {"last token": -1, "mean over the tokens": "mean"}
ENV_VAR = "WORKBENCH_DIRECTIONS"
# The stories grammar's IOI sentences: the subject first (positive) against the indirect object
# first (negative), read at the last token: the "subject came first" direction of docs/reference/directions.md.
DEFAULT_POSITIVE = ("When John and Mary went to the store , John gave a drink to\n"
                    "When Tom and Lily went to the park , Tom gave a ball to\n"
                    "When Max and Sara went to the school , Max gave a book to")
DEFAULT_NEGATIVE = ("When Mary and John went to the store , John gave a drink to\n"
                    "When Lily and Tom went to the park , Tom gave a ball to\n"
                    "When Sara and Max went to the school , Max gave a book to")
DEFAULT_PROBE_TEXT = ("Once upon a time , Mary and John lived in a small town .\n"
                      "When Tom and Lily went to the park , Lily gave a ball to Tom .\n"
                      "One day , Max met Sara at the store .\n"
                      "Sam has a pen and Nick has a apple .\n"
                      "When Emma and Ben went to the school , Ben gave a book to Emma .\n"
                      "Amy and Leo lived in a small town with friends .\n"
                      "One day , Nora met Owen at the park .\n"
                      "Ivy has a box and Paul has a cup .")
DEFAULT_WORDS = "Mary, John, Tom, Lily, Max, Sara, Sam, Nick, Emma, Ben, Amy, Leo, Nora, Owen, Ivy, Paul"


def render() -> None:
    ckpt = common.page_checkpoint("Steer")
    if ckpt is None:
        return
    text = common.prompt_box(ckpt)
    ids = common.prompt_ids(ckpt, text)
    if ids is None:
        return
    st.subheader("Direction")
    source = SOURCES[st.radio("From", list(SOURCES), horizontal=True, key="steer_source", persist_state="session")]
    direction = {"contrastive": _contrastive, "file": _from_file, "probe": _from_probe}[source](ckpt)
    if direction is None:
        return
    st.caption(f"{direction.provenance['kind']} direction at `{direction.hook}`, |v| = {direction.vector.norm():.3f}")
    if source != "file":
        _download(ckpt, direction)
    st.subheader("Steering")
    steer(ckpt, ids, direction, key="steer")


def _download(ckpt: common.Checkpoint, direction: Direction) -> None:
    """A button that downloads the direction as the one .zip the upload takes back."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{ckpt.name}-{direction.provenance['kind']}-{direction.hook}").lstrip(".-")
    st.download_button("Download this direction (.zip)", direction.to_bytes(name), file_name=f"{name}.zip",
                       mime="application/zip", key="steer_download", on_click="ignore",
                       help="Its .json and .safetensors (what Direction.save writes), zipped: upload the .zip under "
                            "*a saved direction*, or unzip it and Direction.load the pair.")


# ---- where the direction comes from ---------------------------------------------------------------
def _hook_picker(ckpt: common.Checkpoint, key: str, layer: bool = True) -> tuple[Optional[int], str]:
    sites = [s for s in SITES if s != "hook_mlp_out" or not ckpt.cfg.attn_only]
    cols = st.columns(2)
    chosen = None
    if layer:
        default = min(1, ckpt.cfg.n_layers - 1)
        chosen = cols[0].selectbox("Layer", range(ckpt.cfg.n_layers), index=default, key=f"{key}_layer",
                                   persist_state="session")
    site = cols[1 if layer else 0].selectbox("Hook", sites, format_func=lambda s: f"{s} ({SITES[s]})",
                                             key=f"{key}_site", persist_state="session")
    return chosen, site


def _lines(ckpt: common.Checkpoint, text: str, what: str) -> Optional[tuple[tuple[int, ...], ...]]:
    """Each non-empty line as token ids; None (with a message naming the line) when one is unusable."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        st.warning(f"The {what} box is empty: type one prompt per line.")
        return None
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out.append(tuple(common.encode_prompt(ckpt, line, min_tokens=1)))
        except ValueError as e:
            st.warning(f"{what.capitalize()} line {n} ({line[:40]!r}): {e}")
            return None
    return tuple(out)


def _contrastive(ckpt: common.Checkpoint) -> Optional[Direction]:
    layer, site = _hook_picker(ckpt, "steer_c")
    a, b = st.columns(2)
    positive = a.text_area("Positive prompts (one per line)", DEFAULT_POSITIVE, key="steer_positive",
                           persist_state="session", height=120)
    negative = b.text_area("Negative prompts (one per line)", DEFAULT_NEGATIVE, key="steer_negative",
                           persist_state="session", height=120)
    read_at = READ_AT[st.radio("Read each prompt at", list(READ_AT), horizontal=True, key="steer_read",
                               persist_state="session")]
    pos_ids, neg_ids = _lines(ckpt, positive, "positive"), _lines(ckpt, negative, "negative")
    if pos_ids is None or neg_ids is None:
        return None
    try:
        return common.analysis(steering_vector, ckpt.key, None, positive=pos_ids, negative=neg_ids,
                               hook=f"blocks.{layer}.{site}", position=read_at)
    except ValueError as e:
        st.error(f"No direction from these prompts: {e}")
        return None


def _from_probe(ckpt: common.Checkpoint) -> Optional[Direction]:
    _, site = _hook_picker(ckpt, "steer_p", layer=False)
    a, b = st.columns([3, 2])
    text = a.text_area("Labelled text (one prompt per line)", DEFAULT_PROBE_TEXT, key="steer_probe_text",
                       persist_state="session", height=160)
    words = b.text_input("Tokens labelled 1 (comma-separated); every other token is 0", DEFAULT_WORDS,
                         key="steer_probe_words", persist_state="session")
    prompts = _lines(ckpt, text, "labelled text")
    if prompts is None:
        return None
    try:
        label = TokenIn(tuple(words.split(",")))
        probe = common.analysis(train_probe, ckpt.key, None, dataset=prompts, label=label, hooks=f"every {site}",
                                control="shuffle", n_boot=100)
    except ValueError as e:
        st.error(f"Cannot train the probe: {e}")
        return None
    shown = [c for c in ("layer", "acc", "acc_lo", "acc_hi", "auc", "control_acc", "selectivity", "n_train", "n_test")
             if c in probe.results]
    b.caption("A logistic probe per layer; test split by prompt; 95% bootstrap intervals; control: labels shuffled.")
    common.table(probe.results[shown].round(3))
    best = int(probe.results.sort_values("auc", ascending=False).layer.iloc[0])
    layer = st.selectbox("Steer with the probe's normal at layer", probe.results.layer.tolist(),
                         index=probe.results.layer.tolist().index(best), key="steer_probe_layer",
                         persist_state="session",
                         help="Unit length: the scale is in the activation's own units.")
    return probe.direction(layer=layer)


def direction_folders(ckpt: common.Checkpoint) -> list[Path]:
    """Where saved directions are looked for: the checkpoint's ``directions/``, then $WORKBENCH_DIRECTIONS."""
    folders = [Path(ckpt.path) / "directions"]
    if os.environ.get(ENV_VAR):
        folders.append(Path(os.environ[ENV_VAR]).expanduser())
    return folders


def saved_directions(folders: list[Path]) -> dict[str, str]:
    """Label -> file stem for every ``<stem>.json`` beside a ``<stem>.safetensors`` in ``folders``."""
    found = {}
    for folder in folders:
        if folder.is_dir():
            for meta in sorted(folder.glob("*.json")):
                if meta.with_suffix(".safetensors").is_file():
                    found[f"{meta.stem} ({folder})"] = str(meta.with_suffix(""))
    return found


@st.cache_data(max_entries=32, show_spinner=False)
def _load_direction(stem: str, stamp: int) -> Direction:
    return Direction.load(stem)


def _stamp(stem: str) -> int:
    return sum(Path(stem + s).stat().st_mtime_ns for s in (".json", ".safetensors") if Path(stem + s).exists())


def _from_file(ckpt: common.Checkpoint) -> Optional[Direction]:
    folders = direction_folders(ckpt)
    round_ = st.session_state.get("steer_upload_round", 0)
    st.file_uploader("Upload a direction: its .json and .safetensors (what Direction.save writes), or the .zip "
                     "this page downloads", type=["json", "safetensors", "zip"], accept_multiple_files=True, key=f"steer_upload_{round_}",
                     on_change=_on_upload, args=(f"steer_upload_{round_}", ckpt.cfg))
    if st.session_state.get("steer_upload_error"):
        st.error(st.session_state["steer_upload_error"])
    options = {**saved_directions(folders), **st.session_state.get("steer_uploaded", {})}
    if not options:
        st.info("No saved directions in " + ", ".join(f"`{f}`" for f in folders)
                + f" (set ${ENV_VAR} for another folder). Save one with `Direction.save(...)` there, or upload one.")
        return None
    if st.session_state.get("steer_file") not in options:
        st.session_state["steer_file"] = list(options)[0]
    name = st.selectbox("Saved direction", list(options), key="steer_file", persist_state="session")
    stem = options[name]
    try:
        direction = _load_direction(stem, _stamp(stem))
        with ckpt.lock:
            direction.check(ckpt.model)
    except Exception as e:  # a width or model mismatch, a zero vector, a missing or corrupt file
        st.error(f"`{Path(stem).name}` cannot steer this model: {e}")
        return None
    made = direction.provenance.get("model") or {}
    st.caption(f"Made on {made.get('name') or 'an unrecorded model'}; provenance: "
               + ", ".join(f"{k}={v}" for k, v in direction.provenance.items() if k != "model" and not isinstance(v, list)))
    return direction


def _on_upload(key: str, cfg=None) -> None:
    """Save an uploaded pair under the private upload folder and select it; a message otherwise.
    Either way the uploader is emptied (a new key), so a failed file never lingers in it."""
    st.session_state.pop("steer_upload_error", None)
    files = st.session_state.get(key) or []
    if files:
        try:
            _save_upload(files, cfg)
        except ValueError as e:
            st.session_state["steer_upload_error"] = str(e)
    st.session_state["steer_upload_round"] = st.session_state.get("steer_upload_round", 0) + 1


def _save_upload(files, cfg=None) -> None:
    by_suffix = {Path(f.name).suffix: f for f in files}
    names = ", ".join(f.name for f in files)
    if len(files) == 1 and ".zip" in by_suffix:
        data = files[0].getvalue()
        try:
            direction = Direction.from_bytes(data, cfg)  # members capped at what this model's widths need
        except ValueError as e:  # not a zip, the wrong members, a zero or NaN vector
            raise ValueError(f"{names} is not a usable direction: {e}") from None
        folder = common.upload_root() / "directions" / hashlib.sha256(data).hexdigest()[:12]
        _register_upload(direction.save(folder / Path(files[0].name).stem))
        return
    if set(by_suffix) != {".json", ".safetensors"} or len(files) != 2:
        raise ValueError(f"Upload of {names}: a direction is two files, its .json and its .safetensors "
                         "(Direction.save writes both), or the one .zip this page downloads; upload the pair "
                         "together, or the .zip alone.")
    data = {suffix: f.getvalue() for suffix, f in by_suffix.items()}
    folder = common.upload_root() / "directions" / hashlib.sha256(data[".json"] + data[".safetensors"]).hexdigest()[:12]
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / Path(by_suffix[".json"].name).stem
    for suffix, content in data.items():
        stem.with_name(stem.name + suffix).write_bytes(content)
    try:
        Direction.load(stem)
    except Exception as e:  # bad JSON, a corrupt safetensors file, a zero or NaN vector
        raise ValueError(f"{names} is not a usable direction: {e}") from None
    _register_upload(stem)


def _register_upload(stem: Path) -> None:
    """Offer the saved upload in the picker and select it."""
    digest = stem.parent.name
    label = f"upload: {stem.name} ({digest[:6]})"
    st.session_state.setdefault("steer_uploaded", {})[label] = str(stem)
    st.session_state["steer_file"] = label
