"""Bad arguments to the public API: one row per bad input, each a ValueError naming the argument.

Every argument that counts, indexes or scales is checked at the boundary (``workbench.utils``);
the rows below cover the configs, the model's forward and generate, the analyses, the tasks
and the accounting. A row passes only if the call raises ``ValueError`` whose message
contains the argument's name as a word, so a raw ``IndexError`` from torch, an overflow
``RuntimeError`` or a silently accepted value all fail it.
"""

import dataclasses
import re
import typing
from functools import lru_cache

import pytest
import torch
from factories import tiny

import workbench as wb
from workbench import accounting
from workbench import config as config_module
from workbench.analysis import (
    AblationSpec,
    ablate,
    ablation_sweep,
    activation_patching,
    attention_patterns,
    direct_logit_attribution,
    head_scores,
    logit_diff_metric,
    logit_lens,
    repeated_random_tokens,
    train_tuned_lens,
)
from workbench.data import get_task
from workbench.training import TrainConfig


@lru_cache(maxsize=None)
def _model():
    return wb.HookedDecoder(tiny()).eval()  # d_model 32, 2 layers, 4 heads, d_mlp 128, vocab 50, ctx 24


TOKENS = torch.tensor([[1, 2, 3, 4, 5]])  # one sequence of 5 tokens
BATCH = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])


def _config(**kw):
    return wb.ModelConfig(**{**dict(d_model=32, n_layers=2, n_heads=4, d_vocab=50, n_ctx=24), **kw})


def _train(**kw):
    return TrainConfig(**kw)


def _text(tmp_path, **kw):
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    return get_task("text", path=path, tokenizer="byte", **kw)


# (id, argument named in the message, call(tmp_path))
ROWS = [
    # ---- ModelConfig: the named cases, then ranges (ints and floats of every kind are swept below)
    ("rope-odd-rotary", "rotary_dim", lambda t: _config(d_model=100, n_heads=4, positional="rope")),
    ("seed-float", "seed", lambda t: _config(seed=1.5)),
    ("seed-negative", "seed", lambda t: _config(seed=-1)),
    ("rope_original_n_ctx-negative", "rope_original_n_ctx", lambda t: _config(rope_original_n_ctx=-1)),
    ("d_head-zero", "d_head", lambda t: _config(d_head=0)),
    ("n_kv_heads-negative", "n_kv_heads", lambda t: _config(n_kv_heads=-2)),
    ("rotary_dim-zero", "rotary_dim", lambda t: _config(rotary_dim=0)),
    ("n_experts-zero", "n_experts", lambda t: _config(n_experts=0)),
    ("experts_per_token-zero", "experts_per_token", lambda t: _config(experts_per_token=0)),
    ("norm_eps-inf", "norm_eps", lambda t: _config(norm_eps=float("inf"))),
    ("rope_beta_fast-negative", "rope_beta_fast", lambda t: _config(rope_beta_fast=-1.0)),
    ("rope_base-nan", "rope_base", lambda t: _config(rope_base=float("nan"))),
    ("name-int", "name", lambda t: _config(name=3)),
    # ---- TrainConfig
    ("lr-overflow", "lr", lambda t: _train(lr=1e40)),
    ("lr-zero", "lr", lambda t: _train(lr=0.0)),
    ("lr-nan", "lr", lambda t: _train(lr=float("nan"))),
    ("steps-zero", "steps", lambda t: _train(steps=0)),
    ("steps-bool", "steps", lambda t: _train(steps=True)),
    ("batch_size-zero", "batch_size", lambda t: _train(batch_size=0)),
    ("grad_accum-zero", "grad_accum", lambda t: _train(grad_accum=0)),
    ("warmup_steps-negative", "warmup_steps", lambda t: _train(warmup_steps=-1)),
    ("grad_clip-inf", "grad_clip", lambda t: _train(grad_clip=float("inf"))),
    ("grad_clip-negative", "grad_clip", lambda t: _train(grad_clip=-1.0)),
    ("weight_decay-nan", "weight_decay", lambda t: _train(weight_decay=float("nan"))),
    ("beta1-one", "beta1", lambda t: _train(beta1=1.0)),
    ("beta2-negative", "beta2", lambda t: _train(beta2=-0.1)),
    ("min_lr_ratio-above-one", "min_lr_ratio", lambda t: _train(min_lr_ratio=1.5)),
    ("eval_every-negative", "eval_every", lambda t: _train(eval_every=-1)),
    ("eval_batches-zero", "eval_batches", lambda t: _train(eval_batches=0)),
    ("log_every-zero", "log_every", lambda t: _train(log_every=0)),
    ("save_every-negative", "save_every", lambda t: _train(save_every=-5)),
    ("threads-negative", "threads", lambda t: _train(threads=-1)),
    ("seq_len-one", "seq_len", lambda t: _train(seq_len=1)),
    ("train-seed-negative", "seed", lambda t: _train(seed=-1)),
    # ---- the model
    ("forward-float-tokens", "tokens", lambda t: _model()(TOKENS.float())),
    ("forward-out-of-vocab", "token", lambda t: _model()(torch.tensor([[1, 50]]))),
    ("max_new_tokens-negative", "max_new_tokens", lambda t: _model().generate(TOKENS, max_new_tokens=-3)),
    ("max_new_tokens-bool", "max_new_tokens", lambda t: _model().generate(TOKENS, max_new_tokens=True)),
    ("temperature-nan", "temperature", lambda t: _model().generate(TOKENS, 2, temperature=float("nan"))),
    ("temperature-inf", "temperature", lambda t: _model().generate(TOKENS, 2, temperature=float("inf"))),
    ("temperature-negative", "temperature", lambda t: _model().generate(TOKENS, 2, temperature=-1.0)),
    ("top_k-zero", "top_k", lambda t: _model().generate(TOKENS, 2, temperature=1.0, top_k=0)),
    ("top_p-zero", "top_p", lambda t: _model().generate(TOKENS, 2, temperature=1.0, top_p=0.0)),
    ("top_p-above-one", "top_p", lambda t: _model().generate(TOKENS, 2, temperature=1.0, top_p=1.5)),
    ("generate-seed-negative", "seed", lambda t: _model().generate(TOKENS, 2, temperature=1.0, seed=-1)),
    ("stop_tokens-out-of-vocab", "stop_tokens", lambda t: _model().generate(TOKENS, 2, stop_tokens=[50])),
    # ---- direct logit attribution
    ("dla-answer-negative", "answer", lambda t: direct_logit_attribution(_model(), TOKENS, answer=-1)),
    ("dla-answer-out-of-vocab", "answer", lambda t: direct_logit_attribution(_model(), TOKENS, answer=50)),
    ("dla-wrong-out-of-vocab", "wrong", lambda t: direct_logit_attribution(_model(), TOKENS, 1, wrong=99)),
    ("dla-answer-tensor", "answer", lambda t: direct_logit_attribution(_model(), BATCH, torch.tensor([1, 50]))),
    ("dla-pos-past-end", "pos", lambda t: direct_logit_attribution(_model(), TOKENS, 1, pos=5)),
    ("dla-pos-before-start", "pos", lambda t: direct_logit_attribution(_model(), TOKENS, 1, pos=-6)),
    # ---- lenses
    ("lens-k-zero", "k", lambda t: logit_lens(_model(), TOKENS, k=0)),
    ("lens-k-above-vocab", "k", lambda t: logit_lens(_model(), TOKENS, k=51)),
    ("lens-targets-out-of-vocab", "targets", lambda t: logit_lens(_model(), TOKENS, targets=torch.full((1, 5), 50))),
    ("tuned-steps-negative", "steps", lambda t: train_tuned_lens(_model(), BATCH, steps=-1, progress=False)),
    ("tuned-batch_size-zero", "batch_size", lambda t: train_tuned_lens(_model(), BATCH, batch_size=0, progress=False)),
    ("tuned-lr-zero", "lr", lambda t: train_tuned_lens(_model(), BATCH, lr=0.0, progress=False)),
    ("tuned-seed-negative", "seed", lambda t: train_tuned_lens(_model(), BATCH, seed=-1, progress=False)),
    # ---- heads
    ("patterns-layer-out-of-range", "layers", lambda t: attention_patterns(_model(), TOKENS, layers=[2])),
    ("patterns-head-out-of-range", "heads", lambda t: attention_patterns(_model(), TOKENS, heads=[4])),
    ("patterns-head-negative", "heads", lambda t: attention_patterns(_model(), TOKENS, heads=[-1])),
    ("patterns-batch_index", "batch_index", lambda t: attention_patterns(_model(), TOKENS, batch_index=1)),
    ("patterns-batch_index-negative", "batch_index", lambda t: attention_patterns(_model(), BATCH, batch_index=-1)),
    ("head_scores-seq_len-too-long", "seq_len", lambda t: head_scores(_model(), seq_len=13)),
    ("head_scores-seq_len-zero", "seq_len", lambda t: head_scores(_model(), seq_len=0)),
    ("head_scores-batch-zero", "batch", lambda t: head_scores(_model(), batch=0)),
    ("head_scores-seed-negative", "seed", lambda t: head_scores(_model(), seed=-1)),
    ("repeated-prefix-out-of-vocab", "prefix", lambda t: repeated_random_tokens(_model(), 4, prefix=50)),
    # ---- ablation
    # A float layer never reaches the check under pytest (the jaxtyping hook refuses it first), a bool does.
    ("spec-layer-bool", "layer", lambda t: AblationSpec("attn", True)),
    ("spec-layer-out-of-range", "layer", lambda t: ablate(_model(), TOKENS, AblationSpec("attn", 2))),
    ("spec-head-bool", "head", lambda t: AblationSpec("head", 0, head=True)),
    ("spec-head-out-of-range", "head", lambda t: ablate(_model(), TOKENS, AblationSpec("head", 0, head=4))),
    ("spec-head-negative", "head", lambda t: ablate(_model(), TOKENS, AblationSpec("head", 0, head=-1))),
    ("spec-head-missing", "head", lambda t: ablate(_model(), TOKENS, AblationSpec("head", 0))),
    ("spec-neuron-out-of-range", "neurons", lambda t: ablate(_model(), TOKENS, AblationSpec("neurons", 0, neurons=[128]))),
    ("spec-neuron-negative", "neurons", lambda t: ablate(_model(), TOKENS, AblationSpec("neurons", 0, neurons=[-1]))),
    ("spec-position-past-end", "positions", lambda t: ablate(_model(), TOKENS, AblationSpec("attn", 0, positions=[5]))),
    ("spec-position-negative", "positions", lambda t: ablate(_model(), TOKENS, AblationSpec("attn", 0, positions=[-1]))),
    ("spec-seed-bool", "seed", lambda t: AblationSpec("attn", 0, seed=False)),
    ("sweep-stack-zero", "stack", lambda t: ablation_sweep(_model(), TOKENS, stack=0)),
    ("sweep-positions-past-end", "positions", lambda t: ablation_sweep(_model(), TOKENS, positions=[7])),
    # ---- patching and its metric
    ("patching-stack-zero", "stack",
     lambda t: activation_patching(_model(), BATCH, BATCH.flip(0), logit_diff_metric(1, 2), stack=0)),
    ("metric-answer-negative", "answer", lambda t: logit_diff_metric(-1, 2)),
    ("metric-wrong-out-of-vocab", "wrong", lambda t: logit_diff_metric(1, 50)(_model()(TOKENS))),
    ("metric-pos-past-end", "pos", lambda t: logit_diff_metric(1, 2, pos=5)(_model()(TOKENS))),
    # ---- tasks
    ("task-seed-negative", "seed", lambda t: get_task("induction", seed=-1)),
    ("induction-vocab-one", "vocab", lambda t: get_task("induction", vocab=1)),
    ("induction-seq_len-one", "seq_len", lambda t: get_task("induction", seq_len=1)),
    ("induction-segment_min-one", "segment_min", lambda t: get_task("induction", segment_min=1)),
    ("induction-segment_max-below-min", "segment_max", lambda t: get_task("induction", segment_min=8, segment_max=4)),
    ("induction-gap_max-negative", "gap_max", lambda t: get_task("induction", gap_max=-1)),
    ("batch-batch_size-zero", "batch_size", lambda t: get_task("induction").batch(0, 8)),
    ("batch-seq_len-zero", "seq_len", lambda t: get_task("induction").batch(2, 0)),
    ("batch-step-negative", "step", lambda t: get_task("induction").batch(2, 8, step=-1)),
    ("repeated-half_len-zero", "half_len", lambda t: get_task("induction").repeated_tokens(2, 0)),
    ("induction-evaluate-half_len", "half_len", lambda t: get_task("induction", vocab=50).evaluate(_model(), half_len=13)),
    ("val_loss-n_batches-zero", "n_batches", lambda t: get_task("induction", vocab=50).val_loss(_model(), 2, 8, n_batches=0)),
    ("modular-p-one", "p", lambda t: get_task("modular", p=1)),
    ("modular-train_fraction-one", "train_fraction", lambda t: get_task("modular", train_fraction=1.0)),
    ("modular-train_fraction-leaves-nothing", "train_fraction", lambda t: get_task("modular", p=2, train_fraction=0.99)),
    ("modular-evaluate-batch_size", "batch_size", lambda t: get_task("modular", p=7).evaluate(_model(), batch_size=0)),
    ("stories-heldout_fraction-tiny", "heldout_fraction", lambda t: get_task("stories", heldout_fraction=0.001)),
    ("stories-ioi-n-zero", "n", lambda t: get_task("stories").ioi_prompts(0)),
    ("stories-possession-n-negative", "n", lambda t: get_task("stories").possession_prompts(-1)),
    ("text-val_fraction-one", "val_fraction", lambda t: _text(t, val_fraction=1.0)),
    ("text-vocab_size-zero", "vocab_size", lambda t: _text(t, vocab_size=0)),
    ("text-evaluate-seq_len-one", "seq_len", lambda t: _text(t).evaluate(_model(), seq_len=1)),
    ("text-evaluate-max_windows-zero", "max_windows", lambda t: _text(t).evaluate(_model(), max_windows=0)),
    # ---- accounting
    ("flops-context-negative", "context", lambda t: accounting.forward_flops_per_token(tiny(), context=-1)),
    ("flops-n_tokens-negative", "n_tokens", lambda t: accounting.training_flops(tiny(), -5)),
    ("kv-bytes_per_value-zero", "bytes_per_value", lambda t: accounting.kv_cache_bytes_per_token(tiny(), 0)),
]


def _names(message: str, argument: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(argument)}(?![\w])", message) is not None


@pytest.mark.parametrize("argument, call", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_argument_is_a_value_error_naming_it(argument, call, tmp_path):
    with pytest.raises(ValueError) as err:
        call(tmp_path)
    assert _names(str(err.value), argument), str(err.value)


# ---- ModelConfig: every int and float field refuses the wrong type, bool included -------------
def _fields_of(kind) -> list[str]:
    hints = {f.name: f.type for f in dataclasses.fields(wb.ModelConfig)}
    return [name for name, hint in hints.items() if re.fullmatch(rf"(Optional\[)?{kind.__name__}\]?", hint)]


INT_FIELDS, FLOAT_FIELDS = _fields_of(int), _fields_of(float)


def test_the_field_sweep_sees_every_numeric_field():
    assert {"d_model", "n_ctx", "d_head", "rotary_dim", "rope_original_n_ctx", "n_experts", "seed"} <= set(INT_FIELDS)
    assert {"norm_eps", "rope_base", "rope_scaling_factor", "init_std"} <= set(FLOAT_FIELDS)
    resolved = {f.name: eval(f.type, vars(config_module)) for f in dataclasses.fields(wb.ModelConfig)}
    numeric = {name for name, hint in resolved.items() if {int, float} & {hint, *typing.get_args(hint)}}
    assert numeric == set(INT_FIELDS) | set(FLOAT_FIELDS)


@pytest.mark.parametrize("value", [True, 2.5, "8"], ids=["bool", "float", "str"])
@pytest.mark.parametrize("field", INT_FIELDS)
def test_int_fields_refuse_non_integers(field, value):
    with pytest.raises(ValueError) as err:
        _config(**{field: value})
    assert _names(str(err.value), f"ModelConfig.{field}"), str(err.value)


@pytest.mark.parametrize("value", [True, float("nan"), float("inf"), "1e-5"], ids=["bool", "nan", "inf", "str"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_float_fields_refuse_non_finite_numbers(field, value):
    with pytest.raises(ValueError) as err:
        _config(**{field: value})
    assert _names(str(err.value), f"ModelConfig.{field}"), str(err.value)


# ---- the named cases that must now be accepted -----------------------------------------------
def test_odd_head_size_is_fine_without_rope():
    cfg = _config(d_model=100, n_heads=4)  # d_head 25: only RoPE needs it even
    assert cfg.d_head == 25
    assert wb.HookedDecoder(cfg)(TOKENS).shape == (1, 5, 50)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_any_integer_dtype_gives_the_same_logits(dtype):
    model = _model()
    expected = model(TOKENS)
    torch.testing.assert_close(model(TOKENS.to(dtype)), expected, rtol=0, atol=0)
    assert torch.equal(model.generate(TOKENS.to(dtype), 3), model.generate(TOKENS, 3))


def test_zero_new_tokens_returns_the_prompt():
    assert torch.equal(_model().generate(TOKENS, max_new_tokens=0), TOKENS)


def test_python_style_negative_positions_are_normalised_where_documented():
    model = _model()
    last = direct_logit_attribution(model, TOKENS, answer=3, pos=-1)
    explicit = direct_logit_attribution(model, TOKENS, answer=3, pos=4)
    torch.testing.assert_close(torch.tensor(last["attribution"].to_numpy()), torch.tensor(explicit["attribution"].to_numpy()))
    with torch.no_grad():
        logits = model(TOKENS)
    assert float(logit_diff_metric(1, 2, pos=-5)(logits)) == float(logit_diff_metric(1, 2, pos=0)(logits))
    assert AblationSpec("attn", -1).validate(model).layer == 1
