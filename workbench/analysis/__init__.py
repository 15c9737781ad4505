"""Looking inside a model: every question one call that returns a tidy pandas DataFrame.

    lens.py         logit lens and tuned lens, per layer x position
    heads.py        attention patterns and how they change; previous-token / induction / duplicate /
                    first-token scores
    attribution.py  direct logit attribution to heads, layers and embeddings
    ablation.py     AblationSpec, ablate, ablation_sweep (resumes from cached activations)
    reference.py    the reference batch mean and resample ablation draw from
    patching.py     activation patching and attribution patching
    metrics.py      the answer metrics (logit difference, probability, rank at a position) and
                    clean-minus-changed views of a lens, an attribution, the patterns
    tokens.py       per-position tables of a prompt: next-token losses (and their change), residual norms
    resume.py       the engine both use: replace one activation, run only what follows (Block.resume)
    common.py       token and unit labels (L1H4), metrics, argument checks
"""

from workbench.analysis.ablation import AblationSpec, ablate, ablation_hooks, ablation_sweep, sweep_specs
from workbench.analysis.attribution import direct_logit_attribution
from workbench.analysis.common import (
    head_label,
    logit_diff_metric,
    loss_metric,
    parse_head,
    parse_unit,
    str_tokens,
    unique_labels,
    unit_label,
)
from workbench.analysis.heads import (
    SCORE_KINDS,
    attention_change,
    attention_patterns,
    detection_mask,
    head_scores,
    repeated_random_tokens,
)
from workbench.analysis.lens import TunedLens, compare_lenses, logit_lens, train_tuned_lens, tuned_lens
from workbench.analysis.metrics import (
    METRIC_KINDS,
    AnswerMetric,
    answer_change,
    answer_table,
    dla_difference,
    lens_difference,
    pattern_difference,
    suggest_answer,
    task_answer,
)
from workbench.analysis.patching import (
    PATCH_SITES,
    TASK_PAIRS,
    PatchingPairs,
    activation_patching,
    attribution_patching,
    patching_agreement,
    task_pairs,
)
from workbench.analysis.reference import reference_batch, task_from_meta
from workbench.analysis.tokens import residual_norms, token_loss_change, token_losses

__all__ = [
    "AblationSpec", "ablate", "ablation_hooks", "ablation_sweep", "sweep_specs",
    "direct_logit_attribution",
    "logit_diff_metric", "loss_metric", "str_tokens", "unique_labels",
    "unit_label", "head_label", "parse_unit", "parse_head",
    "SCORE_KINDS", "attention_change", "attention_patterns", "detection_mask", "head_scores", "repeated_random_tokens",
    "TunedLens", "compare_lenses", "logit_lens", "train_tuned_lens", "tuned_lens",
    "METRIC_KINDS", "AnswerMetric", "answer_change", "answer_table", "dla_difference", "lens_difference",
    "pattern_difference", "suggest_answer", "task_answer",
    "PATCH_SITES", "TASK_PAIRS", "PatchingPairs", "activation_patching", "attribution_patching",
    "patching_agreement", "task_pairs",
    "reference_batch", "task_from_meta",
    "residual_norms", "token_loss_change", "token_losses",
]
