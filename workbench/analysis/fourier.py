"""The Fourier analyses of Nanda et al. (2023), "Progress measures for grokking via mechanistic interpretability".

A model trained on ``a + b mod p`` (``workbench.data.modular``) learns to compute with waves
``cos(w_k x)``, ``sin(w_k x)``, ``w_k = 2 pi k / p``, for a few key frequencies ``k``. Each function
here takes the model and its ``ModularTask`` and returns a tidy DataFrame (or a one-row dict),
so each maps over a run's snapshots with ``an.over_training``:

    task = ModularTask(seed=0, p=113, layout="paper")
    fourier.embedding_norms(model, task)          # frequency x matrix: norm, fraction of the matrix
    fourier.neuron_frequencies(model, task)       # each MLP neuron: best frequency, variance explained
    keys = fourier.key_frequencies(model, task)   # the frequencies the neurons cluster into
    fourier.logit_fourier_norms(model, task)      # the logits in the 2-D Fourier basis over (a, b)
    fourier.progress_measures(model, task, keys)  # losses, restricted / excluded loss, Gini, sum of w^2
    an.over_training(series, fourier.progress_measures, task=task, key_freqs=keys)

The basis (``fourier_basis``) is the paper's: row 0 the constant, then ``cos k``, ``sin k`` for
k = 1 .. (p - 1) / 2, each of unit norm over x = 0 .. p - 1 (orthonormal for odd p). The logits
are the ``p`` number logits at the ``=`` position over all ``p * p`` pairs, centred over the
pairs for each answer ``c``. The directions a frequency owns in that ``(a, b)`` space are
``cos(w_k (a + b))`` and ``sin(w_k (a + b))`` (unit norm over the grid): the restricted logits keep
the mean and the key frequencies' projections, the excluded logits remove them.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import Tensor

from workbench.data.modular import ModularTask, answer_logits


# ---- the basis ------------------------------------------------------------------------------------
def fourier_basis(p: int) -> Tensor:
    """[p, p]: row 0 the constant 1/sqrt(p), rows 2k-1 and 2k ``cos``/``sin`` of frequency k, unit norm."""
    if not isinstance(p, int) or p < 3 or p % 2 == 0:
        raise ValueError(f"the Fourier basis of Z_p here needs an odd p >= 3 (a prime, as in the paper); got {p!r}")
    x = torch.arange(p, dtype=torch.float64)
    rows = [torch.ones(p, dtype=torch.float64)]
    for k in range(1, (p - 1) // 2 + 1):
        rows += [torch.cos(2 * math.pi * k * x / p), torch.sin(2 * math.pi * k * x / p)]
    basis = torch.stack(rows)
    return (basis / basis.norm(dim=1, keepdim=True)).float()


def basis_labels(p: int) -> pd.DataFrame:
    """One row per basis vector: ``component`` (its row), ``label`` ("const", "cos 3", ...), ``frequency`` and ``kind``."""
    fourier_basis(p)  # the same check
    kinds = ["const"] + ["cos", "sin"] * ((p - 1) // 2)
    freqs = [0] + [k for k in range(1, (p - 1) // 2 + 1) for _ in (0, 1)]
    return pd.DataFrame({"component": range(p), "label": [k if k == "const" else f"{k} {f}" for k, f in zip(kinds, freqs)],
                         "frequency": freqs, "kind": kinds})


def _frequency_of_components(p: int) -> Tensor:
    return torch.tensor(basis_labels(p)["frequency"].to_numpy())


def _task_p(task: ModularTask) -> int:
    if not isinstance(task, ModularTask):
        raise ValueError(f"the Fourier analyses need the model's ModularTask (workbench.data.modular), got {type(task).__name__}")
    fourier_basis(task.p)
    return task.p


# ---- weights in the Fourier basis ------------------------------------------------------------------
def embedding_norms(model: torch.nn.Module, task: ModularTask) -> pd.DataFrame:
    """The norm of the embedding (of the number tokens) and of the unembedding (their logits) per frequency.

    One row per ``matrix`` ("embed", "unembed") and ``frequency`` (0 is the constant): ``norm``
    (the cos and sin rows together) and ``fraction`` (of the matrix's squared norm).
    """
    p = _task_p(task)
    basis = fourier_basis(p)
    freqs = _frequency_of_components(p)
    rows = []
    for name, weight in (("embed", model.embed.W_E[:p]), ("unembed", model.unembed.W_U[:, :p].T)):
        per_component = ((basis.to(weight) @ weight.detach().float()) ** 2).sum(dim=1).cpu()
        per_freq = torch.zeros((p + 1) // 2).index_add_(0, freqs, per_component)
        total = float(per_freq.sum())
        rows += [{"matrix": name, "frequency": k, "norm": float(v.sqrt()), "fraction": float(v) / total if total else 0.0}
                 for k, v in enumerate(per_freq)]
    return pd.DataFrame(rows)


def gini(values) -> float:
    """The Gini coefficient of non-negative ``values``: 0 when all are equal, (n - 1) / n when one holds everything."""
    x = np.sort(np.asarray(values.detach().cpu() if isinstance(values, Tensor) else values, dtype=np.float64).ravel())
    if x.size == 0 or (x < 0).any():
        raise ValueError("gini needs a non-empty array of non-negative values")
    n, total = x.size, x.sum()
    if total == 0:
        return 0.0
    return float(((2 * np.arange(1, n + 1) - n - 1) * x).sum() / (n * total))


def fourier_gini(model: torch.nn.Module, task: ModularTask) -> dict:
    """The paper's sparsity measure: the Gini coefficient of the norms of the ``p`` Fourier components of
    the embedding ``W_E`` (``gini_embed``) and of the neuron-logit map ``W_out W_U`` (``gini_neuron_logit``)."""
    p = _task_p(task)
    basis = fourier_basis(p).to(model.embed.W_E.device)
    embed = model.embed.W_E[:p].detach().float()
    neuron_logit = (model.blocks[0].mlp.W_out.detach().float() @ model.unembed.W_U[:, :p].detach().float()).T
    return {"gini_embed": gini((basis @ embed).norm(dim=1)), "gini_neuron_logit": gini((basis @ neuron_logit).norm(dim=1))}


def sum_squared_weights(model: torch.nn.Module) -> float:
    """The total sum of squares of every parameter (what the weight decay shrinks)."""
    return float(sum((p.detach().double() ** 2).sum() for p in model.parameters()))


# ---- activations and logits over every pair --------------------------------------------------------
def _all_pairs(task: ModularTask) -> Tensor:
    a, b = torch.meshgrid(torch.arange(task.p), torch.arange(task.p), indexing="ij")
    return torch.stack([a.flatten(), b.flatten()], dim=1)  # row a * p + b


def all_logits(model: torch.nn.Module, task: ModularTask) -> Tensor:
    """[p * p, p]: the number logits at ``=`` for every pair (row ``a * p + b``), in fp32."""
    p = _task_p(task)
    prompts = task.sequences(_all_pairs(task))[:, :-1].to(model.device)
    with torch.no_grad():
        return answer_logits(model, prompts)[:, :p].float().cpu()


def neuron_activations(model: torch.nn.Module, task: ModularTask, layer: int = 0) -> Tensor:
    """[p * p, d_mlp]: the MLP's activations (``mlp.hook_post``) at ``=`` for every pair (row ``a * p + b``)."""
    _task_p(task)
    prompts = task.sequences(_all_pairs(task))[:, :-1].to(model.device)
    name = f"blocks.{layer}.mlp.hook_post"
    with torch.no_grad():
        _, cache = model.run_with_cache(prompts, names_filter=name)
    return cache[name][:, -1].float().cpu()


def fourier_2d(values: Tensor, p: int) -> Tensor:
    """``values`` [p * p, n] over the (a, b) grid in the 2-D Fourier basis: [p, p, n] (component of a, of b)."""
    basis = fourier_basis(p).to(values)
    grid = values.reshape(p, p, -1)
    return torch.einsum("ia,abn,jb->ijn", basis, grid, basis)


def frequency_fractions(values: Tensor, p: int) -> pd.DataFrame:
    """How much of each column's variance over the (a, b) grid each frequency explains.

    ``values`` [p * p, n] (row a * p + b). In the 2-D Fourier basis, frequency k explains the
    components built from {const, cos k, sin k} in a and in b (the constant-constant one is the
    mean, left out). One row per column (``unit``): its best ``frequency``, the ``fraction`` of the
    variance that one explains, and the ``variance`` over the grid.
    """
    power = fourier_2d(values.float(), p) ** 2  # [p, p, n]
    power[0, 0] = 0.0
    total = power.sum(dim=(0, 1))
    freqs = _frequency_of_components(p)
    explained = []
    for k in range(1, (p + 1) // 2):
        own = (freqs == k) | (freqs == 0)
        explained.append(power[own][:, own].sum(dim=(0, 1)))
    fraction = torch.stack(explained) / total.clamp_min(1e-30)  # [frequency - 1, n]
    return pd.DataFrame({"unit": range(values.shape[1]), "frequency": (fraction.argmax(dim=0) + 1).numpy(),
                         "fraction": fraction.max(dim=0).values.numpy(), "variance": (total / (p * p)).numpy()})


def neuron_frequencies(model: torch.nn.Module, task: ModularTask, layer: int = 0) -> pd.DataFrame:
    """Each MLP neuron's frequency: the one explaining most of the variance of its activation at ``=``
    over all pairs (``frequency_fractions``). One row per ``neuron``: ``frequency``, ``fraction``, ``variance``."""
    p = _task_p(task)
    return frequency_fractions(neuron_activations(model, task, layer), p).rename(columns={"unit": "neuron"})


def clustered_frequencies(table: pd.DataFrame, *, min_fraction: float = 0.5, min_share: float = 0.02) -> list[int]:
    """The frequencies of a ``neuron_frequencies`` table that at least ``min_share`` of the active neurons
    (variance above 1e-3 of the largest) cluster into, a neuron counting for its best frequency when that
    explains at least ``min_fraction`` of its variance (sorted)."""
    active = table[table.variance > 1e-3 * table.variance.max()]
    counts = active[active.fraction >= min_fraction].frequency.value_counts()
    return sorted(int(k) for k, n in counts.items() if n >= min_share * max(1, len(active)))


def key_frequencies(model: torch.nn.Module, task: ModularTask, *, min_fraction: float = 0.5,
                    min_share: float = 0.02, layer: int = 0) -> list[int]:
    """The key frequencies: those the MLP neurons cluster into (``clustered_frequencies`` of ``neuron_frequencies``)."""
    return clustered_frequencies(neuron_frequencies(model, task, layer), min_fraction=min_fraction, min_share=min_share)


def neuron_clusters(model: torch.nn.Module, task: ModularTask, key_freqs: Optional[Sequence[int]] = None,
                    *, min_fraction: float = 0.5, layer: int = 0) -> pd.DataFrame:
    """Per frequency (and "none"): how many neurons cluster into it (best frequency explaining at least
    ``min_fraction``) and their mean fraction explained; ``key`` marks ``key_freqs``."""
    table = neuron_frequencies(model, task, layer)
    label = table.frequency.where(table.fraction >= min_fraction, -1)
    rows = [{"frequency": int(k) if k >= 0 else "none", "neurons": int((label == k).sum()),
             "mean_fraction": float(table.fraction[label == k].mean()), "key": k in set(key_freqs or [])}
            for k in sorted(label.unique())]
    return pd.DataFrame(rows)


# ---- the logits: 2-D Fourier, restricted and excluded ------------------------------------------------
def logit_fourier_norms(model: torch.nn.Module, task: ModularTask) -> pd.DataFrame:
    """The centred logits in the 2-D Fourier basis over (a, b): one row per pair of components
    (``component_a``, ``component_b`` with their labels and frequencies), ``norm`` over the answers
    and ``fraction`` of the logits' variance."""
    p = _task_p(task)
    logits = all_logits(model, task)
    power = (fourier_2d(logits - logits.mean(dim=0), p) ** 2).sum(dim=2)
    labels = basis_labels(p)
    i, j = np.meshgrid(np.arange(p), np.arange(p), indexing="ij")
    frame = pd.DataFrame({"component_a": i.ravel(), "component_b": j.ravel()})
    for side in ("a", "b"):
        part = labels.set_index("component").loc[frame[f"component_{side}"]]
        frame[f"label_{side}"], frame[f"frequency_{side}"] = part["label"].to_numpy(), part["frequency"].to_numpy()
    flat = power.flatten()
    frame["norm"], frame["fraction"] = flat.sqrt().numpy(), (flat / flat.sum()).numpy()
    return frame


def sum_directions(p: int, freqs: Sequence[int]) -> Tensor:
    """[2 * len(freqs), p * p]: ``cos(w_k (a + b))`` and ``sin(w_k (a + b))`` over the grid (row a * p + b), unit norm."""
    for k in freqs:
        if not (isinstance(k, (int, np.integer)) and 1 <= k <= (p - 1) // 2):
            raise ValueError(f"frequency {k!r} is not one of 1 .. {(p - 1) // 2} (p = {p})")
    a, b = torch.meshgrid(torch.arange(p, dtype=torch.float64), torch.arange(p, dtype=torch.float64), indexing="ij")
    s = (a + b).flatten()
    rows = [f(2 * math.pi * int(k) * s / p) for k in freqs for f in (torch.cos, torch.sin)]
    if not rows:
        return torch.zeros(0, p * p)
    d = torch.stack(rows)
    return (d / d.norm(dim=1, keepdim=True)).float()


def split_logits(logits: Tensor, p: int, key_freqs: Sequence[int]) -> tuple[Tensor, Tensor]:
    """(restricted, excluded) logits [p * p, p]: the mean over the pairs plus the key frequencies'
    ``cos/sin(w_k (a + b))`` projections, and the logits minus those projections."""
    directions = sum_directions(p, key_freqs).to(logits)
    mean = logits.mean(dim=0, keepdim=True)
    along = directions.T @ (directions @ (logits - mean))
    return mean + along, logits - along


def logit_variance_explained(logits: Tensor, p: int, key_freqs: Sequence[int]) -> float:
    """The fraction of the centred logits' variance (over pairs, for every answer) along the key frequencies' directions."""
    centred = logits - logits.mean(dim=0, keepdim=True)
    restricted, _ = split_logits(logits, p, key_freqs)
    total = float((centred**2).sum())
    return float(((restricted - logits.mean(dim=0, keepdim=True)) ** 2).sum()) / total if total else 0.0


def progress_measures(model: torch.nn.Module, task: ModularTask, key_freqs: Sequence[int]) -> dict:
    """One row of the paper's progress measures for ``model``: ``train_loss``, ``test_loss``,
    ``train_accuracy``, ``test_accuracy`` (exact, over every pair of each split), ``restricted_loss``
    (the restricted logits, over every pair), ``excluded_loss`` (the excluded logits, training pairs
    only), ``logit_fraction_key`` (``logit_variance_explained``), ``gini_embed``, ``gini_neuron_logit``
    and ``sum_squared_weights``. ``key_freqs`` are fixed, usually the final model's."""
    p = _task_p(task)
    logits = all_logits(model, task)
    answers = _all_pairs(task).sum(dim=1) % p
    train = torch.zeros(p * p, dtype=torch.bool)
    train[task.train_pairs[:, 0] * p + task.train_pairs[:, 1]] = True
    restricted, excluded = split_logits(logits, p, key_freqs)

    def loss(values: Tensor, rows: Tensor) -> float:
        return float(F.cross_entropy(values[rows].double(), answers[rows]))

    everything = torch.ones_like(train)
    row = {"train_loss": loss(logits, train), "test_loss": loss(logits, ~train),
           "train_accuracy": float((logits[train].argmax(-1) == answers[train]).float().mean()),
           "test_accuracy": float((logits[~train].argmax(-1) == answers[~train]).float().mean()),
           "restricted_loss": loss(restricted, everything), "excluded_loss": loss(excluded, train),
           "logit_fraction_key": logit_variance_explained(logits, p, key_freqs)}
    return {**row, **fourier_gini(model, task), "sum_squared_weights": sum_squared_weights(model)}


def phase_epochs(curve: pd.DataFrame) -> dict:
    """The phase boundaries read off one run's ``progress_measures`` over training (a ``step`` column):

    ``memorised``  the first step with train accuracy >= 99% (train loss near its floor);
    ``excluded_min`` the step of the lowest excluded loss (from there it rises: the circuit forms);
    ``restricted_max`` the step of the highest restricted loss at or after ``memorised`` (from there it falls);
    ``grokked``    the first step with test accuracy >= 50% (the test loss drop);
    ``cleaned``    the first step with test accuracy >= 99%.
    A boundary the run never reached is NaN.
    """
    curve = curve.sort_values("step")

    def first(mask) -> float:
        hit = curve.step[mask]
        return float(hit.iloc[0]) if len(hit) else math.nan

    memorised = first(curve.train_accuracy >= 0.99)
    after = curve[curve.step >= memorised] if not math.isnan(memorised) else curve.iloc[0:0]
    return {"memorised": memorised,
            "excluded_min": float(curve.step.loc[curve.excluded_loss.idxmin()]),
            "restricted_max": float(after.step.loc[after.restricted_loss.idxmax()]) if len(after) else math.nan,
            "grokked": first(curve.test_accuracy >= 0.5), "cleaned": first(curve.test_accuracy >= 0.99)}
