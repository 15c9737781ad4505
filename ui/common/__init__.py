"""What every page shares, one module per concern: where checkpoints live and the checkpoint picker
(``checkpoints``), cached loading (``loading``), uploads (``uploads``), prompt input (``prompts``),
what a page scores (``targets``), the cached call into the library that every analysis goes
through (``analyses``), the lenses (``lenses``), drawing (``drawing``) and the model card
(``card``, with its vocabulary browser ``vocabulary``), and what a page shares with its panel: the
attribution graph (``graphs``), a training run's snapshots (``runs``), and what two pages share:
the steering widgets (``steering``: Steer and Features) and where the runs live (``runs.runs_root``:
Sweeps and Training). The pages and panels use
them as ``common.<name>``; a panel never imports its page, and a page never imports another page.

Models are cached with ``st.cache_resource`` keyed by the checkpoint directory and the
modification time of its weights, so re-saving a checkpoint reloads it and nothing else
ever does: widgets change the analysis (cached with ``st.cache_data`` by the pages, keyed
by :attr:`Checkpoint.key` and plain values), never the model. Bad input (a directory that
is not a checkpoint, a corrupt file, an unusable prompt) becomes a message in the page.

A module here imports its siblings by their module (``from ui.common.loading import ...``),
never ``from ui import common``: that would be an import cycle.
"""

from __future__ import annotations

import streamlit as st  # noqa: F401  (``common.st``: tests patch ``common.st.session_state``)

from workbench.tokenizer import IdTokenizer  # noqa: F401  (pages and tests use ``common.IdTokenizer``)

from ui.common.checkpoints import (
    ALLOW_ANY_PATH_ENV, DEFAULT_CHECKPOINT, ENV_VAR, OTHER_DIR, PERSISTENT, REPO, all_checkpoints, allow_any_path,
    checkpoint_picker, checkpoints_root, default_checkpoint, is_checkpoint, list_checkpoints, page_checkpoint,
    path_refusal, sidebar_choice,
)
from ui.common.loading import Checkpoint, LOADS, NOTICES, app_device, experiment_run, load, model_for, weights_stamp
from ui.common.uploads import (
    TEMP_PREFIXES, TempFolder, UPLOAD_LIMIT_MB, remove_stale_temp_folders, save_upload, upload_root, upload_widget,
)
from ui.common.prompts import (
    DEFAULT_PROMPT, PATTERN_BUDGET_BYTES, default_prompt, encode_prompt, max_prompt_tokens, prompt_box, prompt_ids,
)
from ui.common.targets import METRICS, Target, default_target, follow_default, suggested, target_picker, token_id
from ui.common.analyses import Ablation, TokenRows, analysis, analysis_with_progress, one_forward
from ui.common.lenses import (LENSES, has_tuned_lens, lens_picker, lens_table, reference_batch,
                              reference_source, tuned_lens_of)
from ui.common.drawing import clicked_node, show, table
from ui.common.card import config_table, model_card, param_counts, training_curve
from ui.common.graphs import cached_graph, layer_folders, load_replacement
from ui.common.runs import snapshot_series
from ui.common.loading import _load  # noqa: F401  (ui.serve warms the model cache with it)
from ui.common.uploads import _on_upload  # noqa: F401  (the tests call the uploader's callback)
from ui.common.analyses import _qualified_name  # noqa: F401  (ui.training hashes functions with it)

__all__ = [
    "ALLOW_ANY_PATH_ENV", "DEFAULT_CHECKPOINT", "ENV_VAR", "OTHER_DIR", "PERSISTENT", "REPO", "all_checkpoints",
    "allow_any_path", "checkpoint_picker", "checkpoints_root", "default_checkpoint", "is_checkpoint",
    "list_checkpoints", "page_checkpoint", "path_refusal", "sidebar_choice", "Checkpoint", "LOADS", "NOTICES", "app_device",
    "experiment_run", "load", "model_for", "weights_stamp", "TEMP_PREFIXES", "TempFolder", "UPLOAD_LIMIT_MB",
    "remove_stale_temp_folders", "save_upload", "upload_root", "upload_widget", "DEFAULT_PROMPT", "default_prompt",
    "encode_prompt", "PATTERN_BUDGET_BYTES", "max_prompt_tokens", "prompt_box", "prompt_ids", "METRICS", "Target", "default_target", "follow_default", "suggested",
    "target_picker", "token_id", "Ablation", "TokenRows", "analysis", "analysis_with_progress", "one_forward", "LENSES",
    "has_tuned_lens", "lens_picker", "lens_table", "reference_batch", "reference_source", "tuned_lens_of", "clicked_node", "show", "table",
    "config_table", "model_card", "param_counts", "training_curve", "cached_graph", "layer_folders", "load_replacement",
    "snapshot_series",
]
