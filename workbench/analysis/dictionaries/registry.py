"""The dictionary kinds by name (one class per file), and how each is written for SAELens.

    DICTIONARIES["topk"](DictionaryConfig(kind="topk", d_in=128, d_sae=512, k=16))
"""

from __future__ import annotations

from typing import Union

from workbench.analysis.dictionaries.base import Dictionary, DictionaryConfig
from workbench.analysis.dictionaries.batchtopk import BatchTopKSAE
from workbench.analysis.dictionaries.clt import CrossLayerTranscoder
from workbench.analysis.dictionaries.jumprelu import JumpReLUSAE
from workbench.analysis.dictionaries.matryoshka import MatryoshkaBatchTopKSAE
from workbench.analysis.dictionaries.relu import ReLUSAE
from workbench.analysis.dictionaries.topk import TopKSAE
from workbench.analysis.dictionaries.transcoder import SkipTranscoder, Transcoder

DICTIONARIES: dict[str, type] = {
    "relu": ReLUSAE,
    "topk": TopKSAE,
    "batchtopk": BatchTopKSAE,
    "jumprelu": JumpReLUSAE,
    "matryoshka_batchtopk": MatryoshkaBatchTopKSAE,
    "transcoder": Transcoder,
    "skip_transcoder": SkipTranscoder,
    "clt": CrossLayerTranscoder,  # not a Dictionary subclass: one per model, not per hook (clt.py)
}
# Kinds that read and write one hook each (every kind but the cross-layer transcoder).
PER_LAYER = [kind for kind, cls in DICTIONARIES.items() if not getattr(cls, "cross_layer", False)]
# SAELens architecture name -> our kind, for reading its files (BatchTopK and Matryoshka are saved as jumprelu).
FROM_SAELENS = {"standard": "relu", "topk": "topk", "jumprelu": "jumprelu", "transcoder": "transcoder",
                "skip_transcoder": "skip_transcoder", "topk_transcoder": "transcoder",
                "topk_skip_transcoder": "skip_transcoder"}
# TopK transcoders: SAELens (6.54) has no class for them, so their cfg.json names these, which it refuses
# to load instead of reading the file as a ReLU transcoder (saelens.py says more).
TOPK_TRANSCODER_ARCHITECTURES = {"transcoder": "topk_transcoder", "skip_transcoder": "topk_skip_transcoder"}


def make_dictionary(cfg: DictionaryConfig) -> Union[Dictionary, CrossLayerTranscoder]:
    """A new dictionary of ``cfg.kind`` (unit-norm random decoder rows)."""
    if cfg.kind not in DICTIONARIES:
        raise ValueError(f"unknown dictionary kind {cfg.kind!r}; valid kinds are {list(DICTIONARIES)}")
    return DICTIONARIES[cfg.kind](cfg)
