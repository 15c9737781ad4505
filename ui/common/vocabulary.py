"""The vocabulary browser (a section of the model card, for small vocabularies): every token
with its embedding norm and what the direct path predicts after it; pick one to see the next
tokens it promotes and demotes and its nearest tokens. The arithmetic is
``workbench.analysis.vocab``; this module only draws."""

from __future__ import annotations

import streamlit as st

from workbench import viz
from workbench.analysis import direct_path, token_neighbours, vocabulary_table
from ui.common.analyses import analysis
from ui.common.drawing import show
from ui.common.loading import Checkpoint

MAX_VOCAB = 4096  # a table a person can scroll; larger vocabularies are searched in the prompt instead


def render(ckpt: Checkpoint) -> None:
    if ckpt.cfg.d_vocab > MAX_VOCAB:
        st.caption(f"The vocabulary browser is for vocabularies of up to {MAX_VOCAB:,} tokens; this one has "
                   f"{ckpt.cfg.d_vocab:,}.")
        return
    st.caption("Every token, its embedding norm, and the next tokens the direct path (embedding → final norm → "
               "unembedding, no block in between) predicts after it. Select a row for details.")
    table = analysis(vocabulary_table, ckpt.key, None, k=3)
    search = st.text_input("Find a token", key="vocab_search", persist_state="session",
                           placeholder="a token, or part of one")
    shown = table[table["token"].str.contains(search, regex=False)] if search else table
    if shown.empty:
        st.info(f"No token contains {search!r}.")
        return
    event = st.dataframe(shown, hide_index=True, height=280, on_select="rerun", selection_mode="single-row",
                         key=f"vocab_table_{ckpt.path}", width="stretch")
    rows = event.selection.rows if event is not None else []
    if not rows:
        return
    chosen = shown.iloc[rows[0]]
    token_id, label = int(chosen["id"]), str(chosen["token"])
    space = st.radio("Neighbours by", ["embedding", "unembedding"], horizontal=True, key="vocab_space",
                     persist_state="session")
    space = "embed" if space == "embedding" else "unembed"
    left, right = st.columns(2)
    with left:
        path = analysis(direct_path, ckpt.key, None, token=token_id, k=8)
        show(viz.direct_path_figure(path, label, theme=None), key=f"vocab_path_{token_id}")
    with right:
        near = analysis(token_neighbours, ckpt.key, None, token=token_id, k=10, space=space)
        show(viz.neighbours_figure(near, label, space, theme=None), key=f"vocab_near_{token_id}_{space}")
