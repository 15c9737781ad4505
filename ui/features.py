"""Features: browse a sparse dictionary's features, and ablate or steer with one on the prompt.

Pick a checkpoint and one of the dictionaries under its ``saes/`` folder (SAELens' format, what
``python -m workbench train-sae`` writes). The feature table (``feature_table``: density, max and
mean activation, strongest context, top logits) is read on the checkpoint's own task's
validation text (on the prompt alone when meta.json names no task); sort it, or keep only the
features that fire on a token (``features_on_token``). A feature's card: its max-activating
contexts with the activating token in ``[[ ]]``, its activation histogram and density, the
tokens its decoder direction promotes and suppresses, its activation along the prompt, and its
direct logit attribution to an answer (``feature_dla``). Below, the prompt's greedy continuation
clean and with the feature ablated (``feature_edit``: spliced with the error term, so nothing
else changes) or steered along its decoder direction (the Steer page's controls), side by side.

Dictionaries are loaded once per file version (``st.cache_resource``); every analysis is cached
with ``st.cache_data`` keyed by the checkpoint's key, the dictionary's path and file stamp, and
plain values. Nothing but values goes into a cached function.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Callable, Optional

import streamlit as st
import torch

from ui import common
from ui.common import steering
from workbench import viz
from workbench.analysis import (
    check_dictionary,
    feature_ablation_comparison,
    feature_direction,
    feature_dla,
    feature_histogram,
    feature_logit_effects,
    feature_table,
    features_on_token,
    load_dictionary,
    max_activating_contexts,
    prompt_feature_activations,
    task_from_meta,
)
from workbench.analysis.dictionaries.saelens import CFG_FILE, WEIGHTS_FILE
from workbench.analysis.features import dataset_tokens, feature_activations

SORTS = {"density": "density", "max activation": "max_activation", "mean activation": "mean_activation",
         "feature id": "feature"}
ACTIONS = ("ablate this feature", "steer with this feature")
SEQUENCES = (16, 32, 64, 128, 256)
MAX_OPTIONS = 2000  # the feature picker lists at most this many (the sorted list's head)


def render() -> None:
    ckpt = common.page_checkpoint("Features")
    if ckpt is None:
        return
    folders = dictionaries(ckpt.path)
    if not folders:
        others = other_dictionaries(ckpt.path)
        held = (f"holds no SAE (a one-hook dictionary, what this page reads), only {' and '.join(others)}, used by "
                "the Graph page" if others else "holds no dictionary")
        st.info(f"`{Path(ckpt.path).name}/saes/` {held}. Train an SAE with `python -m workbench train-sae "
                f"{ckpt.path} --hook blocks.0.hook_resid_post --d-sae 512`; it lands there.")
        return
    name = st.selectbox("Dictionary", list(folders), key="feat_dict", persist_state="session")
    sae_ref = (folders[name], dictionary_stamp(folders[name]))
    sae = _loaded(ckpt, sae_ref)
    if sae is None:
        return
    _summary(sae)
    text = common.prompt_box(ckpt)
    ids = common.prompt_ids(ckpt, text)
    if ids is None:
        return
    data = _dataset(ckpt, ids)
    table = run(feature_table, ckpt.key, sae_ref, data, n_sequences=data[1] if data[0] == "task" else 1)
    chosen = _search(ckpt, sae_ref, data, table, ids)
    if chosen is None:
        return
    _card(ckpt, sae_ref, data, table, chosen, ids)


# ---- finding and loading dictionaries ---------------------------------------------------------------
def dictionaries(checkpoint: str) -> dict[str, str]:
    """Name -> folder of every dictionary (``cfg.json`` + ``sae_weights.safetensors``) under ``<checkpoint>/saes/``."""
    root = Path(checkpoint) / "saes"
    if not root.is_dir():
        return {}
    return {p.name: str(p) for p in sorted(root.iterdir())
            if p.is_dir() and (p / CFG_FILE).is_file() and (p / WEIGHTS_FILE).is_file()}


def other_dictionaries(checkpoint: str) -> list[str]:
    """What else ``<checkpoint>/saes/`` holds, in words: transcoder sets (``<set>/layer{l}``, counted)
    and cross-layer transcoders, which the Graph page reads and this page does not."""
    from workbench.analysis.dictionaries.clt import is_clt_folder

    root = Path(checkpoint) / "saes"
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else ():
        if not folder.is_dir():
            continue
        layers = [p for p in folder.glob("layer*") if p.name[5:].isdigit() and (p / CFG_FILE).is_file()
                  and (p / WEIGHTS_FILE).is_file()]
        if layers:
            found.append(f"{len(layers)} transcoder{'s' * (len(layers) != 1)} in `{folder.name}/`")
        elif is_clt_folder(folder):
            found.append(f"a cross-layer transcoder in `{folder.name}/`")
    return found


def dictionary_stamp(path: str) -> int:
    try:
        return Path(path, WEIGHTS_FILE).stat().st_mtime_ns
    except OSError:
        return 0


@st.cache_resource(max_entries=8, show_spinner="Loading the dictionary…")
def _sae(path: str, stamp: int):
    sae = load_dictionary(path)
    for p in sae.parameters():
        p.requires_grad_(False)
    return sae


def _loaded(ckpt: common.Checkpoint, sae_ref: tuple[str, int]):
    """The dictionary, checked against the model; None with a message when it cannot be used."""
    try:
        sae = _sae(*sae_ref)
        with ckpt.lock:
            warning = check_dictionary(ckpt.model, sae)
    except Exception as e:  # DictionaryError, a width mismatch, a damaged file: one message naming the folder
        st.error(f"The dictionary `{Path(sae_ref[0]).name}` cannot be used with {ckpt.name}: {e}")
        return None
    if warning:
        st.warning(warning)
    return sae


def _summary(sae) -> None:
    m = sae.metrics
    cols = st.columns(5)
    cols[0].metric("Features", f"{sae.cfg.d_sae:,}", help=f"{sae.cfg.kind} at {sae.cfg.hook_name}")
    for col, (label, field, fmt) in zip(cols[1:], (("L0", "l0", "{:.1f}"),
                                                   ("Explained variance", "explained_variance", "{:.3f}"),
                                                   ("CE loss recovered", "ce_loss_recovered", "{:.3f}"),
                                                   ("Dead", "dead_fraction", "{:.1%}"))):
        col.metric(label, fmt.format(m[field]) if isinstance(m.get(field), (int, float)) else "—")
    st.caption(f"{sae.cfg.kind}, {sae.cfg.d_sae} features on `{sae.cfg.hook_name}`"
               + (f" → `{sae.cfg.hook_name_out}`" if sae.cfg.hook_name_out else "")
               + " (metrics as the dictionary's training recorded them).")


def _dataset(ckpt: common.Checkpoint, ids: tuple[int, ...]) -> tuple[str, Any]:
    """("task", n sequences) of the checkpoint's task's validation text, or ("prompt", ids) without a task."""
    try:
        task_from_meta(ckpt.meta)
    except ValueError:
        st.caption("meta.json names no task: the feature table and contexts are read on the prompt alone.")
        return ("prompt", ids)
    n = st.select_slider("Sequences of the task's validation text", SEQUENCES, value=64, key="feat_nseq",
                         persist_state="session",
                         help="What the table, the contexts and the histogram are read on.")
    return ("task", n)


# ---- the cached runner --------------------------------------------------------------------------
def _tokens(model, key: tuple[str, int], data: tuple[str, Any]) -> torch.Tensor:
    if data[0] == "prompt":
        return torch.tensor([data[1]], device=model.device)
    from workbench.checkpoint import read_meta

    return dataset_tokens(model, task_from_meta(read_meta(key[0])), data[1])


@st.cache_data(max_entries=256, show_spinner=False,
               hash_funcs={types.FunctionType: lambda fn: f"{fn.__module__}.{fn.__qualname__}"})
def run(fn: Callable, key: tuple[str, int], sae_ref: tuple[str, int], data: Optional[tuple[str, Any]], **kwargs) -> Any:
    """``fn(model, sae, tokens, **kwargs)`` (``fn(model, sae, **kwargs)`` when ``data`` is None) on the
    cached model and dictionary, under the model's lock. ``data``: ("task", n) for the task's
    first n validation sequences, ("prompt", ids) for one prompt. Keyed by value."""
    model, lock = common.model_for(key)
    sae = _sae(*sae_ref)
    with lock, torch.no_grad():
        if data is None:
            return fn(model, sae, **kwargs)
        return fn(model, sae, _tokens(model, key, data), **kwargs)


# ---- search and sort -----------------------------------------------------------------------------
def most_active(acts: torch.Tensor, options: list[int]) -> Optional[int]:
    """The feature among ``options`` with the largest activation anywhere on the prompt after its
    first token (``feature_activations``' [1, pos, d_sae]); None when none of them fires there."""
    peak = acts[0, 1:] if acts.shape[1] > 1 else acts[0]
    peak = peak.max(dim=0).values
    best = max(options, key=lambda f: float(peak[f]), default=None)
    return best if best is not None and float(peak[best]) > 0 else None


def _search(ckpt: common.Checkpoint, sae_ref, data, table, ids: tuple[int, ...]) -> Optional[int]:
    st.subheader("Find a feature")
    a, b, c = st.columns([2, 1, 2])
    by = SORTS[a.selectbox("Sort by", list(SORTS), key="feat_sort", persist_state="session")]
    descending = b.toggle("Largest first", value=True, key="feat_desc", persist_state="session")
    token = c.text_input("Fires on the token", key="feat_token", persist_state="session", placeholder="to",
                         help="Keep the features that fire where this token stands, most often first.")
    shown = table.sort_values(by, ascending=not descending)
    if token.strip():
        n = data[1] if data[0] == "task" else 1
        try:
            on = run(features_on_token, ckpt.key, sae_ref, data, token=token, n_sequences=n)
        except ValueError as e:
            st.warning(str(e))
            return None
        shown = on[["feature", "fraction", "fires", "occurrences"]].merge(table, on="feature")
        st.caption(f"{len(shown)} features fire on {token.strip()!r} ({int(on.occurrences.iloc[0])} occurrences); "
                   "sorted by how often they fire there.")
    columns = [c for c in ("feature", "fraction", "density", "max_activation", "mean_activation", "top_context",
                           "top_logits") if c in shown]
    common.table(shown[columns].head(200).round(4), height=260)
    with st.expander("Density of every feature"):
        common.show(viz.feature_density_figure(table), key="feat_density")
    if shown.empty:
        st.info("No feature matches.")
        return None
    options = shown.feature.head(MAX_OPTIONS).tolist()
    # The card opens on a feature that fires on the prompt (the first of the list may never fire there),
    # until the user picks one; a new prompt or dictionary opens its own.
    active = most_active(run(feature_activations, ckpt.key, sae_ref, ("prompt", ids)), options)
    common.follow_default("feat_id", active if active is not None else options[0], (sae_ref, ids))
    if st.session_state.get("feat_id") not in options:
        st.session_state["feat_id"] = active if active is not None else options[0]
    labels = {f: f"#{f} · density {d:.2%} · max {m:.2f} · {c[-40:]}" for f, d, m, c in
              zip(table.feature, table.density, table.max_activation, table.top_context)}
    return st.selectbox("Feature", options, key="feat_id", persist_state="session", format_func=labels.__getitem__)


# ---- the card ------------------------------------------------------------------------------------
def _card(ckpt: common.Checkpoint, sae_ref, data, table, feature: int, ids: tuple[int, ...]) -> None:
    row = table.set_index("feature").loc[feature]
    st.subheader(f"Feature {feature}")
    cols = st.columns(3)
    cols[0].metric("Density", f"{row['density']:.3%}", help="Fraction of tokens where it fires")
    cols[1].metric("Max activation", f"{row['max_activation']:.3f}")
    cols[2].metric("Mean activation when firing", f"{row['mean_activation']:.3f}")
    n = data[1] if data[0] == "task" else 1
    contexts = run(max_activating_contexts, ckpt.key, sae_ref, data, feature=feature, k=10, n_sequences=n)
    if contexts.empty:
        st.info(f"Feature {feature} never fires on these {n} sequence(s): a dead feature here.")
    else:
        common.show(viz.feature_contexts_figure(contexts), key="feat_contexts")
        left, right = st.columns(2)
        with left:
            histogram = run(feature_histogram, ckpt.key, sae_ref, data, feature=feature, n_sequences=n)
            common.show(viz.feature_histogram_figure(histogram), key="feat_histogram")
        with right:
            _logits(ckpt, sae_ref, feature)
    st.subheader("On the prompt")
    acts = run(prompt_feature_activations, ckpt.key, sae_ref, ("prompt", ids), feature=feature)
    common.show(viz.token_values_figure(acts, "activation", title=f"Feature {feature}'s activation along the prompt"),
                key="feat_prompt_acts")
    _dla(ckpt, sae_ref, feature, ids)
    _intervene(ckpt, sae_ref, feature, ids)


def _logits(ckpt: common.Checkpoint, sae_ref, feature: int) -> None:
    try:
        effects = run(feature_logit_effects, ckpt.key, sae_ref, None, feature=feature, k=10)
    except ValueError as e:
        st.info(f"No logit effects: {e}")
        return
    common.show(viz.feature_logits_figure(effects), key="feat_logits")


def _dla(ckpt: common.Checkpoint, sae_ref, feature: int, ids) -> None:
    st.markdown("**Direct logit attribution**")
    target = common.target_picker(ckpt, ids, key="feat_target", kinds=False)
    if target is None:
        return
    try:
        dla = run(feature_dla, ckpt.key, sae_ref, ("prompt", ids), answer=target.answer, wrong=target.wrong,
                  pos=target.pos)
    except ValueError as e:
        st.info(f"No direct logit attribution: {e}")
        return
    what = f"logit[{target.answer_str!r}]" + (f" − logit[{target.wrong_str!r}]" if target.wrong is not None else "")
    mine = dla[dla.feature == feature]
    value = float(mine.dla.iloc[0]) if len(mine) else 0.0
    st.metric(f"Feature {feature}'s direct share of {what} at position {target.pos}", f"{value:+.3f}",
              help="Its activation times its decoder direction through the final norm and W_U; "
                   "0 when it does not fire there.")
    if dla.empty:
        st.info(f"No feature fires at position {target.pos}.")
        return
    common.show(viz.feature_dla_figure(dla, feature=feature,
                                       title=f"Features' direct attribution to {what} at position {target.pos}"),
                key="feat_dla")


def _intervene(ckpt: common.Checkpoint, sae_ref, feature: int, ids) -> None:
    st.subheader("Ablate or steer, clean beside")
    action = st.radio("On the prompt", ACTIONS, horizontal=True, key="feat_action", persist_state="session")
    if action == ACTIONS[1]:
        try:
            direction = run(feature_direction, ckpt.key, sae_ref, None, feature=feature)
        except ValueError as e:  # features at a hook with no single vector per position (attn.hook_z)
            st.info(f"Cannot steer with this feature: {e}")
            return
        st.caption(f"Steering along feature {feature}'s decoder row (unit length) at `{direction.hook}`.")
        steering.steer(ckpt, ids, direction, key="feat_steer")
        return
    st.caption(f"Feature {feature} set to 0 at every position, with the dictionary spliced in with its error term, "
               "so nothing else changes.")
    n_new = steering.new_tokens(ckpt, ids, st, key="feat_new")
    if n_new is None:
        return
    out = run(feature_ablation_comparison, ckpt.key, sae_ref, ("prompt", ids), feature=feature, max_new_tokens=n_new)
    steering.side_by_side(ckpt, ids, out, "ablated", key="feat_ablate")
