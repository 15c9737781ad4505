"""Looking inside a model: every question one call that returns a tidy pandas DataFrame.

    lens.py         logit lens and tuned lens, per layer x position
    heads.py        attention patterns and how they change; previous-token / induction / duplicate /
                    first-token scores
    composition.py  copying_scores (each head's OV copying score), k_composition (an induction head's
                    attention score split over what wrote its keys)
    attribution.py  direct logit attribution to heads, layers and embeddings
    ablation.py     AblationSpec, ablate, ablation_sweep (resumes from cached activations)
    reference.py    the reference batch mean and resample ablation draw from
    patching.py     activation patching and attribution patching
    metrics.py      the answer metrics (logit difference, probability, rank at a position), logit_diff per
                    prompt of a dataset, and
                    clean-minus-changed views of a lens, an attribution, the patterns
    batching.py     iter_batches: any data (texts of any lengths, tokens, TokenBatch, PromptSet) in padded
                    batches with their row numbers; the conventions of dataset-scale analyses
    tokens.py       per-position tables of a prompt: next-token losses (and their change), residual norms
    shared.py       one_forward: several analyses of one prompt answered from one run_with_cache
    resume.py       the engine both use: replace one activation, run only what follows (Block.resume)
    per_prompt.py   what both need over a dataset: scores per prompt, positions aligned per row (from the
                    end, or named per row: IO, S2, END), clean/corrupted pairs in batches
    common.py       token and unit labels (L1H4), metrics, argument checks
    directions.py   Direction (a vector at a hook), steering_vector, steering hooks, project
    probes.py       train_probe: a linear probe per layer, accuracy and AUC with intervals
    store.py        ActivationStore: activations at hooks as sharded safetensors, resumable, streamed
    dictionaries/   sparse dictionaries (SAEs, transcoders): architectures, trainer, SAELens format
    splice.py       a dictionary spliced in at its hook; its features become hooks
    features.py     per-feature tables: contexts, histograms, logit effects, DLA
    dynamics.py     any of these over a run's training snapshots: one table with a step column
    vocab.py        the vocabulary: embedding neighbours, the direct path (embed -> unembed) per token
    batching.py     iter_batches: any data (texts, tensors, TokenBatch, PromptSet) as padded batches
    circuits/       edges: the computation graph, exact edge patching, EAP / EAP-IG, ACDC, path patching,
                    circuits (save, load, faithfulness) and AUROC against known circuits
    graphs/         attribution graphs: the replacement model (transcoders, frozen attention and norms),
                    direct-effect edges, influence pruning, circuit-tracer's graph JSON
"""

from workbench.analysis.ablation import AblationSpec, ablate, ablation_hooks, ablation_sweep, sweep_specs
from workbench.analysis.attribution import direct_logit_attribution
from workbench.analysis.dynamics import over_training
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
from workbench.analysis.composition import copying_scores, k_composition
from workbench.analysis.heads import (
    SCORE_KINDS,
    attention_change,
    attention_patterns,
    detection_mask,
    head_scores,
    repeated_random_tokens,
)
from workbench.analysis.vocab import direct_path, token_neighbours, vocabulary_table
from workbench.analysis.lens import (
    TunedLens, compare_lenses, logit_lens, residual_stack, train_tuned_lens, tuned_lens,
)
from workbench.analysis.metrics import (
    METRIC_KINDS,
    AnswerMetric,
    answer_change,
    answer_table,
    dla_difference,
    logit_diff,
    lens_difference,
    pattern_difference,
    ioi_answer,
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
from workbench.analysis.per_prompt import END, PromptScorer
from workbench.analysis.reference import reference_batch, reference_source, task_from_meta
from workbench.analysis.tokens import loss_summary, residual_norms, token_loss_change, token_losses
from workbench.analysis.shared import SharedForward, inspect_hooks, one_forward
from workbench.analysis.directions import (
    Direction,
    edit_comparison,
    model_fingerprint,
    project,
    read_activations,
    steered_generate,
    steering_comparison,
    steering_hooks,
    steering_sweep,
    steering_vector,
)
from workbench.analysis.probes import Probe, TokenIn, auc, fit_probe, train_probe
from workbench.analysis.store import ActivationStore, LiveActivations, StoreError, TensorActivations
from workbench.analysis.dictionaries import (
    DICTIONARIES, CrossLayerTranscoder, Dictionary, DictionaryConfig, DictionaryError, SAETrainConfig, load_dictionary,
    save_dictionary, train_sae,
)
from workbench.analysis.splice import add_sae, remove_sae, spliced, spliced_saes
from workbench.analysis.features import (
    check_dictionary, feature_ablation_comparison, feature_activations, feature_direction, feature_dla, feature_edit,
    feature_histogram, feature_logit_effects, feature_table, features_on_token, max_activating_contexts,
    prompt_feature_activations,
)
from workbench.analysis.circuits import (
    Circuit,
    ComputationGraph,
    discover_circuit,
    edge_attribution,
    edge_auroc,
    edge_patching,
    evaluate_circuit,
    faithfulness,
    node_attribution,
    path_patching,
)

__all__ = [
    "direct_path", "token_neighbours", "vocabulary_table",
    "AblationSpec", "ablate", "ablation_hooks", "ablation_sweep", "sweep_specs",
    "direct_logit_attribution",
    "logit_diff_metric", "loss_metric", "str_tokens", "unique_labels",
    "unit_label", "head_label", "parse_unit", "parse_head",
    "copying_scores", "k_composition",
    "SCORE_KINDS", "attention_change", "attention_patterns", "detection_mask", "head_scores", "repeated_random_tokens",
    "TunedLens", "compare_lenses", "logit_lens", "residual_stack", "train_tuned_lens", "tuned_lens",
    "METRIC_KINDS", "AnswerMetric", "answer_change", "answer_table", "dla_difference", "lens_difference", "logit_diff",
    "pattern_difference", "suggest_answer", "task_answer", "ioi_answer",
    "PATCH_SITES", "TASK_PAIRS", "PatchingPairs", "activation_patching", "attribution_patching",
    "patching_agreement", "task_pairs",
    "END", "PromptScorer",
    "reference_batch", "reference_source", "task_from_meta",
    "loss_summary", "residual_norms", "token_loss_change", "token_losses",
    "SharedForward", "inspect_hooks", "one_forward",
    "Direction", "edit_comparison", "model_fingerprint", "project", "read_activations", "steered_generate",
    "steering_comparison", "steering_hooks",
    "steering_sweep", "steering_vector",
    "Probe", "TokenIn", "auc", "fit_probe", "train_probe",
    "ActivationStore", "LiveActivations", "StoreError", "TensorActivations",
    "DICTIONARIES", "CrossLayerTranscoder", "Dictionary", "DictionaryConfig", "DictionaryError", "SAETrainConfig", "load_dictionary",
    "save_dictionary", "train_sae",
    "add_sae", "remove_sae", "spliced", "spliced_saes",
    "check_dictionary", "feature_ablation_comparison", "feature_activations", "feature_direction", "feature_dla", "feature_edit", "feature_histogram",
    "feature_logit_effects", "feature_table", "features_on_token", "max_activating_contexts",
    "prompt_feature_activations",
    "over_training",
    "Circuit", "ComputationGraph", "discover_circuit", "edge_attribution", "edge_auroc", "edge_patching",
    "evaluate_circuit", "faithfulness", "node_attribution", "path_patching",
]

from workbench.analysis.graphs import (Graph, Supernode, attention_entries, attribution_graph,  # noqa: E402
                                       collapse_frames, head_loadings, measured_edge, qk_attribution, widest_path)

__all__ += ["Graph", "Supernode", "attribution_graph", "collapse_frames", "qk_attribution", "attention_entries",
            "head_loadings", "widest_path", "measured_edge"]


from workbench.analysis.graphs.qk_training import induction_qk_prompts, loss_drop, qk_pairs, qk_summary  # noqa: E402

__all__ += ["qk_pairs", "qk_summary", "induction_qk_prompts", "loss_drop"]
