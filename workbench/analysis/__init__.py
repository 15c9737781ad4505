"""Looking inside a model: every question one call that returns a tidy pandas DataFrame.

    lens.py         logit lens and tuned lens, per layer x position
    heads.py        attention patterns; previous-token / induction / duplicate / first-token scores
    attribution.py  direct logit attribution to heads, layers and embeddings
    ablation.py     AblationSpec, ablate, ablation_sweep (resumes from cached activations)
    patching.py     activation patching and attribution patching
    tokens.py       per-position tables of a prompt: next-token losses, residual-stream norms
    resume.py       the engine both use: replace one activation, run only what follows
    dynamics.py     any of these over a run's training snapshots: one table with a step column
"""

from workbench.analysis.ablation import AblationSpec, ablate, ablation_hooks, ablation_sweep, sweep_specs
from workbench.analysis.attribution import direct_logit_attribution
from workbench.analysis.dynamics import over_training
from workbench.analysis.common import logit_diff_metric, loss_metric, str_tokens, unique_labels
from workbench.analysis.heads import (
    SCORE_KINDS,
    attention_patterns,
    detection_mask,
    head_scores,
    repeated_random_tokens,
)
from workbench.analysis.lens import TunedLens, compare_lenses, logit_lens, train_tuned_lens, tuned_lens
from workbench.analysis.patching import PATCH_SITES, activation_patching, attribution_patching
from workbench.analysis.tokens import residual_norms, token_losses

__all__ = [
    "AblationSpec", "ablate", "ablation_hooks", "ablation_sweep", "sweep_specs",
    "direct_logit_attribution",
    "logit_diff_metric", "loss_metric", "str_tokens", "unique_labels",
    "SCORE_KINDS", "attention_patterns", "detection_mask", "head_scores", "repeated_random_tokens",
    "TunedLens", "compare_lenses", "logit_lens", "train_tuned_lens", "tuned_lens",
    "PATCH_SITES", "activation_patching", "attribution_patching",
    "residual_norms", "token_losses",
    "over_training",
]
