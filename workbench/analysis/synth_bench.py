"""SynthSAEBench's pieces: SAE Lens' synthetic generator and evals when importable, faithful stand-ins otherwise.

SAE Lens (MIT licence, https://github.com/jbloomAus/SAELens) ships ``sae_lens.synthetic``: a
generator of activations made of a known feature dictionary (Zipfian firing probabilities,
hierarchy, low-rank correlations, firing magnitudes) and ``synthetic/evals.py``, which scores a
dictionary against that ground truth. ``experiments/synth_sae_bench.py`` uses them through
``import_sae_lens``; this module also holds

- ``evaluate``: the metrics of ``sae_lens.synthetic.evals.eval_sae_on_synthetic_data`` (6.54),
  written from its source: MCC (Hungarian matching of |cosine| between decoder rows and true
  features, mean of the matched pairs), uniqueness (distinct best-matching true features per
  latent), per-latent precision / recall / F1 / accuracy of "latent fires" against "its
  best-matching true feature fires" (averaged over latents, 0 where undefined), L0, dead latents,
  shrinkage (mean ||x_hat|| / ||x||) and explained variance (1 - E||x - x_hat||^2 / total variance);
- ``hungarian``: the assignment SciPy's ``linear_sum_assignment`` returns, for when SciPy is absent;
- ``SimpleSynthModel``: a reduced version of SAE Lens' generator (its Zipfian firing
  probabilities, unit-norm random features plus a bias of norm 1, magnitudes ``relu(mean + std *
  N(0, 1))``; no hierarchy, no correlations), used only when SAE Lens cannot be imported (CI).

SAE Lens 6.x pins transformer-lens < 4, and the workbench runs on TransformerLens 4: its package
is installed beside ours (``pip install --target DIR --no-deps sae-lens==6.54.0`` plus SciPy,
simple-parsing, docstring-parser, babe, python-dotenv and tenacity the same way) and imported with
``PYTHONPATH=DIR``. The names it imports from TransformerLens 3 that 4 removed are only used by its
model-loading code, which the synthetic benchmark never runs; ``import_sae_lens`` stands in
placeholders for them so the import succeeds.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import types
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

SAE_LENS_VERSION = "6.54.0"


# ---- SAE Lens ------------------------------------------------------------------------------------
def import_sae_lens() -> tuple[Optional[types.ModuleType], str]:
    """(``sae_lens``, "") when it can be imported here, else (None, why not)."""
    if importlib.util.find_spec("sae_lens") is None:
        return None, ("sae_lens is not installed (pip install --target DIR --no-deps sae-lens==6.54.0, "
                      "then PYTHONPATH=DIR; see workbench/analysis/synth_bench.py)")
    try:
        _stand_in_for_transformer_lens_3()
        import sae_lens
        import sae_lens.synthetic  # noqa: F401
    except Exception as e:  # any import failure: the caller falls back and says why
        return None, f"sae_lens could not be imported ({type(e).__name__}: {e})"
    return sae_lens, ""


def _stand_in_for_transformer_lens_3() -> None:
    """Placeholders for the TransformerLens 3 names SAE Lens imports at module level (4.0 removed them)."""
    import transformer_lens

    try:
        import transformer_lens.HookedTransformer  # noqa: F401  (TransformerLens 3: nothing to do)
        return
    except ImportError:
        pass
    from transformer_lens.HookedRootModule import HookedRootModule

    class HookedTransformer(HookedRootModule):  # never instantiated by the synthetic benchmark
        pass

    def module(name: str, **names: Any) -> types.ModuleType:
        m = sys.modules.get(name) or types.ModuleType(name)
        m.__path__ = getattr(m, "__path__", [])
        for key, value in names.items():
            setattr(m, key, value)
        sys.modules[name] = m
        return m

    module("transformer_lens.HookedTransformer", HookedRootModule=HookedRootModule, HookedTransformer=HookedTransformer,
           Loss=object, Output=object)
    transformer_lens.HookedTransformer = HookedTransformer
    module("transformer_lens.components")
    module("transformer_lens.components.mlps")
    module("transformer_lens.components.mlps.can_be_used_as_mlp", CanBeUsedAsMLP=type("CanBeUsedAsMLP", (), {}))
    try:
        import transformer_lens.utils  # noqa: F401
    except ImportError:
        module("transformer_lens.utils", USE_DEFAULT_VALUE=None, get_tokens_with_bos_removed=None,
               lm_cross_entropy_loss=None)


# ---- memory ----------------------------------------------------------------------------------------
def available_ram() -> int:
    """Bytes of memory available now (MemAvailable), or the physical total where /proc is absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def planned_bytes(num_features: int, hidden_dim: int, d_sae: int, rows: int, batch_size: int) -> dict[str, int]:
    """The largest float32 allocations of one benchmark run, by name."""
    return {
        "feature dictionary (features x hidden size)": 4 * num_features * hidden_dim,
        "training activations (rows x hidden size)": 4 * rows * hidden_dim,
        "a batch's true feature activations (batch x features)": 4 * batch_size * num_features,
        "a batch's latents (batch x latents)": 4 * batch_size * d_sae,
        "MCC's cosine and cost matrices (latents x features)": 16 * d_sae * num_features,
    }


def check_fits(num_features: int, hidden_dim: int, d_sae: int, rows: int, batch_size: int,
               ram: Optional[int] = None) -> None:
    """MemoryError naming the sizes when the run's allocations pass the available RAM (nothing allocated)."""
    for name, value in dict(num_features=num_features, hidden_dim=hidden_dim, d_sae=d_sae, rows=rows,
                            batch_size=batch_size).items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    sizes = planned_bytes(num_features, hidden_dim, d_sae, rows, batch_size)
    ram = available_ram() if ram is None else ram
    total = sum(sizes.values())
    if total > ram:
        worst = max(sizes, key=sizes.get)
        raise MemoryError(
            f"synthetic settings need {total / 2**30:.1f} GiB (the largest: {worst} = {sizes[worst] / 2**30:.1f} GiB, "
            f"{num_features} features x hidden size {hidden_dim}, {d_sae} latents, {rows} rows) but only "
            f"{ram / 2**30:.1f} GiB of RAM is available; lower --features, --hidden, --latents or the rows "
            "(nothing was allocated)")


# ---- a stand-in generator ----------------------------------------------------------------------------
def zipfian_probabilities(n: int, exponent: float = 1.0, max_prob: float = 0.3, min_prob: float = 0.01) -> Tensor:
    """SAE Lens' ``zipfian_firing_probabilities``: 1 / rank^exponent rescaled onto [min_prob, max_prob]."""
    if n == 1:
        return torch.tensor([max_prob])
    p = 1.0 / torch.arange(1, n + 1, dtype=torch.float32) ** exponent
    return min_prob + (max_prob - min_prob) * (p - p.min()) / (p.max() - p.min())


class SimpleSynthModel:
    """Features fire independently (Zipfian probabilities) at ``relu(mean + std * N(0,1))``; hidden
    activations are ``acts @ features + bias`` (unit-norm random features, a bias of norm 1)."""

    def __init__(self, num_features: int, hidden_dim: int, seed: int = 0, std_magnitude: float = 0.1,
                 max_prob: float = 0.3, min_prob: float = 0.01):
        g = torch.Generator().manual_seed(seed)
        F = torch.randn(num_features, hidden_dim, generator=g)
        self.feature_vectors = F / F.norm(dim=1, keepdim=True)
        b = torch.randn(hidden_dim, generator=g)
        self.bias = b / b.norm()
        self.probabilities = zipfian_probabilities(num_features, max_prob=max_prob, min_prob=min_prob)
        self.std = std_magnitude
        self.generator = torch.Generator().manual_seed(seed + 1_000_003)

    def sample_with_features(self, n: int) -> tuple[Tensor, Tensor]:
        fires = torch.rand(n, len(self.probabilities), generator=self.generator) < self.probabilities
        mags = (1.0 + self.std * torch.randn(fires.shape, generator=self.generator)).relu()
        acts = mags * fires
        return acts @ self.feature_vectors + self.bias, acts


# ---- the evals -------------------------------------------------------------------------------------
def cosine_similarities(a: Tensor, b: Tensor) -> Tensor:
    """SAE Lens' ``util.cosine_similarities``: rows normalised with norms clamped at 1e-8."""
    a = a / a.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    b = b / b.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    return a @ b.T


def hungarian(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of a minimum-cost matching of min(n, m) pairs, as ``scipy.optimize.linear_sum_assignment``.

    The shortest-augmenting-path form of the Hungarian algorithm (O(n^2 m), one row at a time, with
    potentials), its inner scan vectorised over columns.
    """
    cost = np.asarray(cost, dtype=np.float64)
    transposed = cost.shape[0] > cost.shape[1]
    if transposed:
        cost = cost.T
    n, m = cost.shape
    u, v = np.zeros(n + 1), np.zeros(m + 1)
    match = np.zeros(m + 1, dtype=np.int64)  # match[j]: the row (1-based) on column j; column 0 is the root
    for i in range(1, n + 1):
        match[0] = i
        j0 = 0
        minv = np.full(m + 1, np.inf)
        way = np.zeros(m + 1, dtype=np.int64)
        used = np.zeros(m + 1, dtype=bool)
        while True:
            used[j0] = True
            i0 = match[j0]
            cur = cost[i0 - 1] - u[i0] - v[1:]
            free = ~used[1:]
            better = free & (cur < minv[1:])
            minv[1:][better] = cur[better]
            way[1:][better] = j0
            candidates = np.where(free, minv[1:], np.inf)
            j1 = int(np.argmin(candidates)) + 1
            delta = candidates[j1 - 1]
            u[match[used]] += delta
            v[used] -= delta
            minv[1:][free] -= delta
            j0 = j1
            if match[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            match[j0] = match[j1]
            j0 = j1
    cols = np.nonzero(match[1:])[0]
    rows = match[1:][cols] - 1
    order = np.argsort(rows)
    rows, cols = rows[order], cols[order]
    if transposed:
        rows, cols = cols, rows
        order = np.argsort(rows)
        rows, cols = rows[order], cols[order]
    return rows, cols


def _assignment(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError:
        return hungarian(cost)
    return linear_sum_assignment(cost)


def mean_correlation_coefficient(features_a: Tensor, features_b: Tensor) -> float:
    cos = cosine_similarities(features_a.float(), features_b.float()).abs()
    rows, cols = _assignment(1 - cos.cpu().numpy())
    return float(cos[torch.as_tensor(rows), torch.as_tensor(cols)].mean())


def feature_uniqueness(sae_features: Tensor, gt_features: Tensor) -> float:
    if sae_features.shape[0] == 0:
        return 0.0
    best = cosine_similarities(sae_features.float(), gt_features.float()).abs().argmax(dim=1)
    return len(best.unique()) / sae_features.shape[0]


def classification_counts(latents: Tensor, gt_acts: Tensor, best_matches: Tensor) -> Tensor:
    """[4, latents] true positives, false positives, false negatives, true negatives."""
    fires = latents != 0
    truth = gt_acts[:, best_matches] > 0
    return torch.stack([(fires & truth).sum(0), (fires & ~truth).sum(0), (~fires & truth).sum(0),
                        (~fires & ~truth).sum(0)]).double()


def classification_metrics(counts: Tensor) -> dict[str, float]:
    tp, fp, fn, tn = counts
    zero = torch.zeros_like(tp)
    precision = torch.where(tp + fp > 0, tp / (tp + fp).clamp_min(1e-30), zero)
    recall = torch.where(tp + fn > 0, tp / (tp + fn).clamp_min(1e-30), zero)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp_min(1e-30), zero)
    accuracy = (tp + tn) / (tp + fp + fn + tn).clamp_min(1e-8)
    return {"precision": float(precision.mean()), "recall": float(recall.mean()), "f1_score": float(f1.mean()),
            "accuracy": float(accuracy.mean())}


@torch.no_grad()
def evaluate(sae, gt_features: Tensor, hidden: Tensor, gt_acts: Tensor, batch_size: int = 8192) -> dict[str, float]:
    """``eval_sae_on_synthetic_data``'s numbers for ``sae`` (anything with ``encode``, ``decode``,
    ``W_dec``) on the given samples, as one flat dict (``classification/`` folded in)."""
    W_dec = sae.W_dec.detach().float()
    best = cosine_similarities(W_dec, gt_features.float()).abs().argmax(dim=1)
    counts = torch.zeros(4, W_dec.shape[0], dtype=torch.float64)
    fired = torch.zeros(W_dec.shape[0], dtype=torch.bool)
    true_l0 = sae_l0 = shrink = 0.0
    shrink_n = 0
    sum_x = torch.zeros(hidden.shape[1], dtype=torch.float64)
    sum_sq = sum_res = 0.0
    for start in range(0, len(hidden), batch_size):
        x, acts = hidden[start:start + batch_size].float(), gt_acts[start:start + batch_size]
        latents = sae.encode(x)
        out = sae.decode(latents)
        true_l0 += float((acts != 0).sum())
        sae_l0 += float((latents != 0).sum())
        fired |= (latents != 0).any(0)
        norms = x.norm(dim=-1)
        valid = norms > 1e-6
        shrink += float((out.norm(dim=-1)[valid] / norms[valid]).sum())
        shrink_n += int(valid.sum())
        sum_x += x.sum(0).double()
        sum_sq += float(x.double().pow(2).sum())
        sum_res += float((x - out).double().pow(2).sum())
        counts += classification_counts(latents, acts, best)
    n = len(hidden)
    variance = sum_sq / n - float((sum_x / n).pow(2).sum())
    return {
        "true_l0": true_l0 / n, "sae_l0": sae_l0 / n, "dead_latents": int((~fired).sum()),
        "shrinkage": shrink / max(shrink_n, 1), "explained_variance": 1 - (sum_res / n) / variance if variance > 0 else 0.0,
        "mcc": mean_correlation_coefficient(W_dec, gt_features), "uniqueness": feature_uniqueness(W_dec, gt_features),
        **{f"classification/{k}": v for k, v in classification_metrics(counts).items()},
    }


def saelens_result_dict(result) -> dict[str, float]:
    """SAE Lens' ``SyntheticDataEvalResult`` in ``evaluate``'s flat form."""
    flat = result.to_log_dict()
    return {k: (float(v) if k != "dead_latents" else int(v)) for k, v in flat.items()}


def finite(values: dict) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values.values())


def at_l0(runs: list[dict], target: float, metrics: list[str]) -> Optional[dict[str, float]]:
    """``metrics`` at L0 = ``target``, linear in log L0 between the two runs (dicts with ``sae_l0``)
    whose L0s bracket it, nearest first; None when no pair brackets ``target``.

    How dictionaries trained at different sparsity coefficients are compared at one L0: each side's
    coefficient sweep is read at the common L0, rather than each side's default coefficient.
    """
    if not target > 0:
        raise ValueError(f"target L0 must be positive, got {target!r}")
    points = sorted((r for r in runs if r["sae_l0"] > 0), key=lambda r: r["sae_l0"])
    for lo, hi in zip(points, points[1:]):
        a, b = lo["sae_l0"], hi["sae_l0"]
        if a <= target <= b:
            t = 0.0 if b == a else (math.log(target) - math.log(a)) / (math.log(b) - math.log(a))
            return {m: float(lo[m] + t * (hi[m] - lo[m])) for m in metrics}
    return None
