"""Linear probes: does a layer's activation say a label, linearly? One probe per hook, one row per layer.

``train_probe`` reads the activations once (every hook in one forward per length group), splits
the examples by prompt (every token of a prompt lands in the same split, so a probe cannot
pass by memorising a prompt), fits a logistic (or least-squares) probe per hook, and reports
test accuracy and AUC with 95% intervals, beside a control task (Hewitt & Liang 2019) whose
accuracy says how much of the score the probe could get without the label being there.

    AUC        the rank (Mann-Whitney) formula, ties counted half; no sklearn
    intervals  percentile bootstrap over test prompts (seeded): resampling prompts, not tokens,
               because the tokens of one prompt are not independent
    control    "shuffle": labels permuted within each split (chance by construction);
               "type": each token id gets a fixed random label at the task's base rate
               (a probe that memorises token identity scores well on it; selectivity is
               accuracy minus control accuracy)

Labels come from a dataset's column (one value per prompt, read at ``position``; or a list
per prompt, one per token) or from a token predicate (``lambda token: token in NAMES``),
which labels every token (return None to leave a token out).
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from workbench.analysis.common import check_choice
from workbench.analysis.directions import (
    Direction,
    Prompts,
    _read_positions,
    hook_width,
    model_stamp,
    prompt_sequences,
)

PROBE_KINDS = ("logistic", "linear")
CONTROLS = ("shuffle", "type", None)


@dataclass
class Probe:
    """A trained probe per hook: ``results`` (one row per hook) and the weights behind it.

    ``weights[hook]`` and ``biases[hook]`` act on the raw activation: score = x . w + b,
    positive means label 1 (for the logistic kind, the score is the log-odds).
    """

    results: pd.DataFrame
    weights: dict[str, Tensor]
    biases: dict[str, float]
    label: str
    kind: str
    model: dict

    def hook_for(self, layer: Optional[int] = None, hook: Optional[str] = None) -> str:
        if hook is not None:
            if hook not in self.weights:
                raise ValueError(f"hook={hook!r} was not probed; probed hooks: {list(self.weights)}")
            return hook
        rows = self.results[self.results.layer == layer]
        if len(rows) != 1:
            raise ValueError(f"layer={layer!r} matches {len(rows)} probed hooks {rows.hook.tolist()}; "
                             f"pass hook= (one of {list(self.weights)})")
        return str(rows.hook.iloc[0])

    def direction(self, layer: Optional[int] = None, hook: Optional[str] = None) -> Direction:
        """The probe's normal at ``layer`` (or ``hook``) as a unit-length Direction, so a steering
        scale is in the activation's own units."""
        hook = self.hook_for(layer, hook)
        w = self.weights[hook]
        row = self.results[self.results.hook == hook].iloc[0]
        return Direction(w / w.norm(), hook, {
            "kind": "probe", "label": self.label, "probe": self.kind, "weight_norm": float(w.norm()),
            "bias": self.biases[hook], "acc": float(row.acc), "auc": float(row.auc), "model": self.model})

    def score(self, acts: Float[Tensor, "n width"], layer: Optional[int] = None,
              hook: Optional[str] = None) -> Float[Tensor, " n"]:
        """Scores (log-odds for the logistic kind) of activations read at the probe's hook."""
        hook = self.hook_for(layer, hook)
        return acts.float().cpu() @ self.weights[hook] + self.biases[hook]


@dataclass(frozen=True)
class TokenIn:
    """A token predicate for ``train_probe``: 1 where the token (spaces stripped) is one of
    ``words``, else 0. A frozen value rather than a lambda, so a cached caller can key on it."""

    words: tuple[str, ...]

    def __post_init__(self) -> None:
        words = tuple(w.strip() for w in ([self.words] if isinstance(self.words, str) else self.words))
        if not any(words):
            raise ValueError("words is empty: name at least one token that gets label 1")
        object.__setattr__(self, "words", tuple(w for w in words if w))

    @property
    def __name__(self) -> str:  # the label's name in train_probe's messages and results
        return "token in {" + ", ".join(self.words) + "}"

    def __call__(self, token: str) -> int:
        return int(token.strip() in self.words)


def probe_hooks(model, hooks: Union[str, Sequence[str]]) -> list[str]:
    """Hook names from ``"every resid_post"`` (any block site: ``every mlp.hook_post``), one name, or a list."""
    if isinstance(hooks, str) and hooks.startswith("every "):
        site = hooks[len("every "):].strip()
        site = site if "." in site or site.startswith("hook_") else f"hook_{site}"
        names = [f"blocks.{layer}.{site}" for layer in range(model.cfg.n_layers)]
    else:
        names = [hooks] if isinstance(hooks, str) else list(hooks)
    if not names:
        raise ValueError("hooks is empty; pass 'every resid_post', a hook name or a list of them")
    for name in names:
        hook_width(model, name)  # a clear error for a hook this model does not have
    return names


def _layer(hook: str) -> int:
    match = re.match(r"blocks\.(\d+)\.", hook)
    return int(match.group(1)) if match else -1


# ---- examples ----------------------------------------------------------------------------
def _binary(value: Any, where: str) -> Optional[int]:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, numbers.Number) and value in (0, 1)):
        return int(value)
    if isinstance(value, numbers.Number) and value == -1:
        return None  # the "ignore" label of token-label tensors
    raise ValueError(f"labels must be 0/1 or True/False (None or -1 to skip), got {value!r} at {where}")


def _dataset(dataset: Any, label: Any, text_column: Optional[str]) -> tuple[Any, Any, str]:
    """(prompts, labels or a predicate, the label's name) from a DataFrame or plain prompts."""
    if isinstance(dataset, pd.DataFrame):
        if text_column is None:
            found = [c for c in ("prompt", "text", "tokens") if c in dataset.columns]
            if not found:
                raise ValueError(f"the dataset has no 'prompt', 'text' or 'tokens' column (columns: "
                                 f"{list(dataset.columns)}); pass text_column=")
            text_column = found[0]
        elif text_column not in dataset.columns:
            raise ValueError(f"text_column={text_column!r} is not a column: {list(dataset.columns)}")
        prompts = dataset[text_column].tolist()
        if isinstance(label, str):
            if label not in dataset.columns:
                raise ValueError(f"label={label!r} is not a column of the dataset: {list(dataset.columns)}")
            return prompts, dataset[label].tolist(), label
        dataset = prompts
    if callable(label):
        return dataset, label, getattr(label, "__name__", "predicate")
    if isinstance(label, str):
        raise ValueError(f"label={label!r} names a column, but the dataset is not a DataFrame; "
                         "pass a DataFrame, a token predicate, or the labels themselves")
    return dataset, label, "label"


def _token_strings(model, seq: Tensor) -> list[str]:
    if getattr(model, "tokenizer", None) is None:
        return [str(i) for i in seq.tolist()]
    return model.to_str_tokens(seq)


def _examples(model, seqs: list[Tensor], labels: Any, position: Union[int, str], mask) -> list[tuple[int, int, int]]:
    """(prompt, position, label) for every labelled example."""
    if callable(labels):
        return [(i, p, y) for i, seq in enumerate(seqs) for p, tok in enumerate(_token_strings(model, seq))
                if (y := _binary(labels(tok), f"token {p} of prompt {i}")) is not None]
    if isinstance(labels, Tensor) and labels.ndim == 2:
        if mask is not None:
            labels = [row[torch.as_tensor(m, dtype=torch.bool).cpu()] for row, m in zip(labels.cpu(), mask)]
        labels = [row.tolist() for row in labels]
    elif isinstance(labels, Tensor):
        labels = labels.tolist()
    labels = list(labels)
    if len(labels) != len(seqs):
        raise ValueError(f"{len(labels)} labels for {len(seqs)} prompts")
    out = []
    for i, (seq, y) in enumerate(zip(seqs, labels)):
        if isinstance(y, (list, tuple, np.ndarray, Tensor)):  # one label per token
            y = list(y.tolist() if isinstance(y, (np.ndarray, Tensor)) else y)
            if len(y) != len(seq):
                raise ValueError(f"prompt {i} has {len(seq)} tokens but {len(y)} token labels")
            out += [(i, p, v) for p, yp in enumerate(y) if (v := _binary(yp, f"token {p} of prompt {i}")) is not None]
        else:
            if position == "mean" or not isinstance(position, numbers.Integral):
                raise ValueError(f"position must be an int for per-prompt labels, got {position!r}")
            if not -len(seq) <= position < len(seq):
                raise ValueError(f"position={position} is outside prompt {i} ({len(seq)} tokens)")
            if (v := _binary(y, f"prompt {i}")) is not None:
                out.append((i, position % len(seq), v))
    return out


def _split(n_prompts: int, test_fraction: float, seed: int) -> Tensor:
    """A bool [n_prompts]: True for test prompts."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    n_test = int(round(test_fraction * n_prompts))
    if n_prompts < 2 or not 1 <= n_test < n_prompts:
        raise ValueError(f"{n_prompts} prompts cannot be split into train and test at test_fraction={test_fraction}; "
                         "pass more prompts")
    order = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(seed))
    test = torch.zeros(n_prompts, dtype=torch.bool)
    test[order[:n_test]] = True
    return test


# ---- fitting and scoring --------------------------------------------------------------------
def fit_probe(x: Float[Tensor, "n width"], y: Tensor, kind: str = "logistic", l2: float = 1e-2) -> tuple[Tensor, float]:
    """(w, b) on raw activations: score = x . w + b. The fit runs on centred features divided
    by their overall RMS (float64; Newton steps for the logistic kind, closed-form ridge for the
    linear kind on +-1 targets), then maps back to raw units: ``w`` is the decision plane's normal."""
    check_choice("kind", kind, PROBE_KINDS)
    x, y = x.double(), y.double()
    # One scale for every feature, not one per feature: a per-feature scale would make the L2
    # penalty anisotropic in activation space and tilt the normal away from the true direction.
    mu = x.mean(0)
    sd = (x - mu).pow(2).mean().sqrt().clamp_min(1e-12)
    z = (x - mu) / sd
    if kind == "linear":
        t = 2 * y - 1
        gram = z.T @ z / len(z) + l2 * torch.eye(z.shape[1], dtype=z.dtype)
        w = torch.linalg.solve(gram, z.T @ (t - t.mean()) / len(z))
        b = t.mean()
    else:
        w, b = _newton_logistic(z, y, l2)
    w_raw = w / sd
    return w_raw.float(), float(b - (mu * w_raw).sum())


def _newton_logistic(z: Tensor, y: Tensor, l2: float, max_iter: int = 50) -> tuple[Tensor, Tensor]:
    """L2-regularised logistic regression (intercept not penalised) by damped Newton steps:
    strongly convex, so it converges in a few steps, deterministically. (torch.optim would
    import torch._dynamo, seconds of start-up for a fit that takes milliseconds.)"""
    n, d = z.shape
    z1 = torch.cat([z, torch.ones(n, 1, dtype=z.dtype)], dim=1)
    penalty = torch.full((d + 1,), l2, dtype=z.dtype)
    penalty[-1] = 0.0

    def objective(theta: Tensor) -> Tensor:
        logits = z1 @ theta
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, y) + 0.5 * (penalty * theta * theta).sum()

    theta = torch.zeros(d + 1, dtype=z.dtype)
    for _ in range(max_iter):
        p = torch.sigmoid(z1 @ theta)
        grad = z1.T @ (p - y) / n + penalty * theta
        if float(grad.abs().max()) < 1e-10:
            break
        hess = (z1 * (p * (1 - p))[:, None]).T @ z1 / n + torch.diag(penalty + 1e-12)
        step = torch.linalg.solve(hess, grad)
        t, before = 1.0, objective(theta)
        while objective(theta - t * step) > before - 0.25 * t * (grad @ step) and t > 1e-8:
            t *= 0.5
        theta = theta - t * step
    return theta[:-1], theta[-1]


def auc(scores: Tensor, labels: Tensor, weights: Optional[Tensor] = None) -> Tensor:
    """Area under the ROC curve by the rank (Mann-Whitney) formula, ties counted half.

    ``weights`` [n_boot, n] counts each example (bootstrap resamples); the result is then
    [n_boot]; NaN where a resample holds one class only.
    """
    levels, inverse = torch.unique(scores, return_inverse=True)
    w = torch.ones(1, len(scores), dtype=torch.float64) if weights is None else weights.double()
    y = labels.bool()
    pos = torch.zeros(len(w), len(levels), dtype=torch.float64).index_add_(1, inverse, w * y)
    neg = torch.zeros(len(w), len(levels), dtype=torch.float64).index_add_(1, inverse, w * ~y)
    below = neg.cumsum(1) - neg
    value = (pos * (below + 0.5 * neg)).sum(1) / (pos.sum(1) * neg.sum(1))
    return value if weights is not None else value[0]


def _metrics(scores: Tensor, y: Tensor, prompt: Tensor, n_boot: int, seed: int) -> dict:
    """Accuracy and AUC with percentile-bootstrap 95% intervals over prompts."""
    correct = ((scores > 0).long() == y).double()
    prompts, index = torch.unique(prompt, return_inverse=True)
    draws = torch.randint(0, len(prompts), (n_boot, len(prompts)), generator=torch.Generator().manual_seed(seed))
    counts = torch.zeros(n_boot, len(prompts), dtype=torch.float64)
    counts.scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64))
    weights = counts[:, index]
    boot_acc = (weights * correct).sum(1) / weights.sum(1)
    boot_auc = auc(scores, y, weights)
    out = {"acc": float(correct.mean()), "auc": float(auc(scores, y))}
    for name, boot in (("acc", boot_acc), ("auc", boot_auc)):
        lo, hi = torch.nanquantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        out[f"{name}_lo"], out[f"{name}_hi"] = lo, hi
    return out


def _control_labels(y: Tensor, tokens: Tensor, test: Tensor, control: str, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    if control == "shuffle":
        out = y.clone()
        for part in (~test, test):
            idx = part.nonzero().flatten()
            out[idx] = y[idx[torch.randperm(len(idx), generator=gen)]]
        return out
    rate = float(y[~test].double().mean())
    vocab = int(tokens.max()) + 1
    per_type = (torch.rand(vocab, generator=gen) < rate).long()
    return per_type[tokens]


# ---- the entry point ---------------------------------------------------------------------------
def train_probe(
    model,
    dataset: Union[pd.DataFrame, Prompts],
    label: Union[str, Callable[[str], Any], Sequence, Tensor],
    hooks: Union[str, Sequence[str]] = "every resid_post",
    position: int = -1,
    kind: str = "logistic",
    test_fraction: float = 0.25,
    control: Optional[str] = "shuffle",
    l2: float = 1e-2,
    n_boot: int = 200,
    seed: int = 0,
    mask: Optional[Tensor] = None,
    text_column: Optional[str] = None,
    batch_size: int = 32,
) -> Probe:
    """Fit one probe per hook for a binary label; ``probe.results`` has one row per hook.

    dataset: a DataFrame with a ``prompt``/``text``/``tokens`` column (or ``text_column``), or
    prompts (strings of any lengths, token ids ``[batch, pos]`` with an optional ``mask``).
    label: a column name; a token predicate (called with each token's string); or the labels
    (``[n_prompts]`` read at ``position``, or ``[n_prompts, pos]`` per token, -1 to skip).
    Columns: hook, layer, n_train, n_test, acc, AUC and their 95% intervals, majority (the
    majority-class accuracy), control_acc, control_auc, selectivity (acc - control_acc).
    """
    check_choice("kind", kind, PROBE_KINDS)
    check_choice("control", control, CONTROLS)
    names = probe_hooks(model, hooks)
    prompts, labels, label_name = _dataset(dataset, label, text_column)
    seqs = prompt_sequences(model, prompts, mask)
    examples = _examples(model, seqs, labels, position, mask)
    if not examples:
        raise ValueError(f"label {label_name!r} labels no example")
    prompt = torch.tensor([e[0] for e in examples])
    where = torch.tensor([e[1] for e in examples])
    y = torch.tensor([e[2] for e in examples])
    if len(y.unique()) < 2:
        raise ValueError(f"label {label_name!r} has one class only (every example is {int(y[0])}); "
                         "a probe needs examples of both classes")
    test = _split(len(seqs), test_fraction, seed)[prompt]
    if len(y[~test].unique()) < 2:
        raise ValueError(f"the training split of label {label_name!r} has one class only; pass more prompts "
                         "or another seed")
    tokens = torch.stack([seqs[i][p] for i, p in zip(prompt.tolist(), where.tolist())])
    y_control = _control_labels(y, tokens, test, control, seed) if control else None
    acts = _read_positions(model, seqs, names, batch_size)
    rows, weights, biases = [], {}, {}
    for name in names:
        x = torch.stack([acts[name][i][p] for i, p in zip(prompt.tolist(), where.tolist())])
        w, b = fit_probe(x[~test], y[~test], kind, l2)
        weights[name], biases[name] = w, b
        row = {"hook": name, "layer": _layer(name), "kind": kind, "n_train": int((~test).sum()),
               "n_test": int(test.sum()),
               **_metrics(x[test] @ w + b, y[test], prompt[test], n_boot, seed),
               "majority": float((y[test] == int(y[~test].double().mean() >= 0.5)).double().mean())}
        if control:
            wc, bc = fit_probe(x[~test], y_control[~test], kind, l2)
            scores = x[test] @ wc + bc
            row["control_acc"] = float(((scores > 0).long() == y_control[test]).double().mean())
            row["control_auc"] = float(auc(scores, y_control[test]))
            row["selectivity"] = row["acc"] - row["control_acc"]
        rows.append(row)
    return Probe(pd.DataFrame(rows), weights, biases, label_name, kind, model_stamp(model))
