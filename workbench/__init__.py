"""The decoder-only transformer workbench: build, train and look inside GPT-style models."""

from workbench.accounting import (
    count_params,
    forward_flops_per_token,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    seed_param_formula,
    training_flops,
)
from workbench.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from workbench.config import ModelConfig
from workbench.model import HookedDecoder, KVCache
from workbench.padding import TokenBatch
from workbench.data.prompts import PromptSet
from workbench.snapshots import Series, load_series
from workbench.interop import GGUFImportError, from_hf, open_gguf, open_pretrained, to_hf
from workbench import analysis, viz  # noqa: E402  (the analysis library and its figures)
from workbench import compiled  # noqa: E402  (model.compile(): torch.compile with every hook honoured)
from workbench.compiled import compile_model  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "ModelConfig",
    "HookedDecoder",
    "KVCache",
    "TokenBatch",
    "PromptSet",
    "count_params",
    "seed_param_formula",
    "forward_flops_per_token",
    "training_flops",
    "kv_cache_bytes_per_token",
    "kv_cache_bytes",
    "save_checkpoint",
    "load_checkpoint",
    "CheckpointError",
    "Series",
    "load_series",
    "from_hf",
    "to_hf",
    "open_gguf",
    "open_pretrained",
    "GGUFImportError",
    "analysis",
    "viz",
    "compiled",
    "compile_model",
]
