"""The attribution graph of a prompt, cached by value, and the replacement (transcoders) it is built
with: shared by the Graph page and its QK panel, which asks why a head of that graph attended."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import streamlit as st
import torch

from workbench import analysis as an
from workbench.analysis.dictionaries.saelens import CFG_FILE, WEIGHTS_FILE
from ui.common.loading import model_for


def layer_folders(folder: Path) -> list[Path]:
    """The ``layer0``, ``layer1``, ... SAELens folders of a transcoder set (all of them, numbered from 0), else []."""
    layers = sorted((p for p in folder.glob("layer*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    ok = layers and all((p / CFG_FILE).is_file() and (p / WEIGHTS_FILE).is_file() for p in layers)
    return layers if ok and [int(p.name[5:]) for p in layers] == list(range(len(layers))) else []


@st.cache_resource(max_entries=8, show_spinner="Loading the transcoders…")
def load_replacement(folder: str, stamp: int):
    """A CLT, or the list of per-layer transcoders, with gradients off."""
    layers = layer_folders(Path(folder))
    loaded = [an.load_dictionary(str(p)) for p in layers] if layers else an.load_dictionary(folder)
    for module in loaded if isinstance(loaded, list) else [loaded]:
        module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
    return loaded


# ---- the graph, cached --------------------------------------------------------------------------------
@st.cache_resource(max_entries=16, show_spinner="Computing the attribution graph…")
def cached_graph(key: tuple[str, int], ref: tuple[str, int], ids: tuple[int, ...], target: Any, max_nodes: int,
                 held_positions: int = 0):
    """The (bound) attribution graph of ``ids``, its first ``held_positions`` positions held; keyed by value."""
    model, lock = model_for(key)
    with lock:
        return an.attribution_graph(model, load_replacement(*ref) if ref[0] else None,
                                    torch.tensor([ids], device=model.device), target=target, max_feature_nodes=max_nodes,
                                    held_positions=held_positions)
