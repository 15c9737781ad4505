"""Sparse dictionaries: SAEs (ReLU+L1, TopK, BatchTopK, JumpReLU) and transcoders, their trainer and metrics.

    base.py         DictionaryConfig, Dictionary: encoder, activation, unit-norm decoder
    relu.py topk.py batchtopk.py jumprelu.py matryoshka.py transcoder.py    one architecture each
    clt.py          CrossLayerTranscoder: one per model, features of layer l write every MLP l..L-1
    registry.py     DICTIONARIES by kind, and SAELens' names for them
    saelens.py      save_dictionary / load_dictionary in SAELens' cfg.json + sae_weights.safetensors
    trainer.py      SAETrainConfig, train_sae: a run folder with metrics.csv, resume, NaN stop, DDP
    evaluate.py     L0, explained variance, dead / dense features, CE loss recovered
"""

from workbench.analysis.dictionaries.base import Dictionary, DictionaryConfig
from workbench.analysis.dictionaries.batchtopk import BatchTopKSAE
from workbench.analysis.dictionaries.clt import CrossLayerTranscoder, load_clt, save_clt
from workbench.analysis.dictionaries.evaluate import ce_loss_recovered, reconstruction_metrics
from workbench.analysis.dictionaries.jumprelu import JumpReLUSAE
from workbench.analysis.dictionaries.matryoshka import MatryoshkaBatchTopKSAE
from workbench.analysis.dictionaries.registry import DICTIONARIES, make_dictionary
from workbench.analysis.dictionaries.relu import ReLUSAE
from workbench.analysis.dictionaries.saelens import DictionaryError, load_dictionary, save_dictionary
from workbench.analysis.dictionaries.topk import TopKSAE
from workbench.analysis.dictionaries.trainer import SAETrainConfig, train_sae
from workbench.analysis.dictionaries.transcoder import SkipTranscoder, Transcoder

__all__ = [
    "Dictionary", "DictionaryConfig", "DICTIONARIES", "make_dictionary", "ReLUSAE", "TopKSAE", "BatchTopKSAE",
    "JumpReLUSAE", "MatryoshkaBatchTopKSAE", "Transcoder", "CrossLayerTranscoder", "load_clt", "save_clt", "SkipTranscoder", "DictionaryError", "load_dictionary", "save_dictionary",
    "SAETrainConfig", "train_sae", "ce_loss_recovered", "reconstruction_metrics",
]
