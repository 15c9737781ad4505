"""Every public analysis runs on a bf16 and an fp16 model and gives the fp32 model's answer to
within the precision of the format.

The reference is the same model in float32 (the same weights, cast): each table's numeric columns
must be finite wherever fp32's are, and within a relative error of the format (the norm of the
difference over the norm of the fp32 column). A reduced-precision model must not fail on a dtype
mismatch (a float32 hook value added to a bf16 stream, a float32 probe reading bf16 activations)
and must not silently compute its statistics in bf16 where fp32 is needed (losses, softmaxes,
means over a dataset).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import workbench as wb
import workbench.analysis as an
from factories import tiny

# relative error of a column (||low - fp32|| / ||fp32||): bf16 keeps 8 bits of mantissa, fp16 11
REL = {torch.bfloat16: 0.06, torch.float16: 0.01}
# A difference of two values (an ablation's delta, a patched metric minus the corrupted one) is
# off by the rounding of the values it subtracts, not by a fraction of itself: its error is
# bounded by ULPS roundings of the table's largest values in that row.
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
ULPS = 8
# ``restored`` is a ratio of two differences, (patched - corrupted) / (clean - corrupted): on a
# random model clean and corrupted differ by about one bf16 rounding, so the ratio's error has no
# bound; its inputs (metric, corrupted, clean) are compared instead.
RATIOS = {"restored"}
CONFIGS = {
    "llama-like": dict(positional="rope", norm="rmsnorm", ffn="swiglu", n_kv_heads=2, bias=False),
    "gpt2-like": dict(positional="learned", norm="layernorm", ffn="gelu", tie_embeddings=True),
}


@pytest.fixture(scope="module", params=[(c, d) for c in CONFIGS for d in REL],
                ids=[f"{c}-{str(d).split('.')[-1]}" for c in CONFIGS for d in REL])
def pair(request):
    name, dtype = request.param
    reference = wb.HookedDecoder(tiny(**CONFIGS[name])).eval()
    low = wb.HookedDecoder(tiny(**CONFIGS[name])).eval()
    low.load_state_dict(reference.state_dict())
    low.to(dtype)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, reference.cfg.d_vocab, (3, 12), generator=gen)
    tokens[:, 8:11] = tokens[:, 2:5]  # repeats: induction and duplicate scores are not all zero
    corrupted = tokens.clone()
    corrupted[:, 3] = (corrupted[:, 3] + 7) % reference.cfg.d_vocab
    return reference, low, dtype, tokens, corrupted


def assert_close_tables(low: pd.DataFrame, ref: pd.DataFrame, dtype, label: str) -> None:
    assert list(low.columns) == list(ref.columns), label
    assert len(low) == len(ref), label
    floats = [c for c in ref.columns if pd.api.types.is_float_dtype(ref[c]) and c not in RATIOS]
    magnitude = ref[floats].abs().fillna(0).to_numpy().max(axis=1) if floats else np.zeros(len(ref))
    for column in floats:
        a, b = low[column].to_numpy().astype(float), ref[column].to_numpy().astype(float)
        finite = np.isfinite(b)
        assert np.isfinite(a[finite]).all(), f"{label}: {column} not finite in {dtype}"
        error = np.linalg.norm(a[finite] - b[finite])
        allowed = REL[dtype] * np.linalg.norm(b[finite]) + ULPS * EPS[dtype] * np.linalg.norm(magnitude[finite])
        assert error <= allowed, f"{label}: {column} error {error:.3g} > {allowed:.3g} in {dtype}"


def both(pair, fn):
    reference, low, dtype, tokens, corrupted = pair
    return fn(low, tokens, corrupted), fn(reference, tokens, corrupted), dtype


ANSWER, WRONG = 5, 9
TABLES = {
    "logit_lens": lambda m, t, c: an.logit_lens(m, t, k=2).drop(columns=["top_tokens"], errors="ignore"),
    "residual_norms": lambda m, t, c: an.residual_norms(m, t),
    "token_losses": lambda m, t, c: an.token_losses(m, t),
    "loss_summary": lambda m, t, c: an.loss_summary(an.token_losses(m, t)),
    "attention_patterns": lambda m, t, c: an.attention_patterns(m, t, batch_index=None),
    "head_scores": lambda m, t, c: an.head_scores(m, t),
    "direct_logit_attribution": lambda m, t, c: an.direct_logit_attribution(m, t, ANSWER, WRONG),
    "answer_table": lambda m, t, c: an.answer_table(m, t, ANSWER, WRONG),
    "ablate": lambda m, t, c: an.ablate(m, t, an.AblationSpec("head", 1, head=2, method="mean"),
                                        return_type="metric"),
    "ablation_sweep": lambda m, t, c: an.ablation_sweep(m, t, unit="head", methods=("zero", "mean")),
    "activation_patching": lambda m, t, c: an.activation_patching(
        m, t, c, an.logit_diff_metric(ANSWER, WRONG), sites=("resid_pre", "head")),
    "attribution_patching": lambda m, t, c: an.attribution_patching(
        m, t, c, an.logit_diff_metric(ANSWER, WRONG)),
    "vocabulary_table": lambda m, t, c: an.vocabulary_table(m),
    "direct_path": lambda m, t, c: an.direct_path(m, 4),
    "token_neighbours": lambda m, t, c: an.token_neighbours(m, 4),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_analysis_in_low_precision_matches_fp32(pair, name):
    low, ref, dtype = both(pair, TABLES[name])
    assert_close_tables(low, ref, dtype, name)


def test_tuned_lens_trains_and_reads_in_low_precision(pair):
    reference, low, dtype, tokens, _ = pair
    torch.manual_seed(0)
    lens_low = an.train_tuned_lens(low, tokens, steps=5, batch_size=3)
    torch.manual_seed(0)
    lens_ref = an.train_tuned_lens(reference, tokens, steps=5, batch_size=3)
    # the translators stay float32 whatever the model's dtype (their updates are tiny)
    assert all(p.dtype == torch.float32 for p in lens_low.parameters())
    assert_close_tables(an.tuned_lens(low, tokens, lens_low), an.tuned_lens(reference, tokens, lens_ref), dtype,
                        "tuned_lens")


def test_directions_and_probes_in_low_precision(pair):
    reference, low, dtype, tokens, _ = pair
    hook = "blocks.1.hook_resid_pre"
    vectors = [an.steering_vector(m, tokens[:2], tokens[1:], hook) for m in (low, reference)]
    assert torch.allclose(vectors[0].vector.float(), vectors[1].vector.float(), atol=0.05, rtol=REL[dtype])
    assert_close_tables(an.project(low, tokens, vectors[1]), an.project(reference, tokens, vectors[1]), dtype,
                        "project")
    out_low = an.steered_generate(low, tokens[:1, :6], vectors[1], [0.0, 1.0], max_new_tokens=3)
    assert len(out_low) == 2
