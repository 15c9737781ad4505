"""How good a dictionary is: reconstruction, sparsity, dead and dense features, and the loss when spliced.

    reconstruction_metrics(sae, store)          L0, explained variance, MSE, dead / dense fractions
    ce_loss_recovered(model, sae, tokens)       next-token loss clean, spliced and zero-ablated

``explained_variance`` is ``1 - sum |y - y_hat|^2 / sum |y - mean(y)|^2`` over the rows read.
A feature is ``dead`` when it fired on none of them and ``dense`` when it fired on more than a
tenth of them. ``ce_loss_recovered`` is ``(zero - spliced) / (zero - clean)``: 1 when splicing the
reconstruction in (no error term) costs nothing, 0 when it is as bad as zeroing the activation
(SAELens' definition).
"""

from __future__ import annotations


import torch
from jaxtyping import Int
from torch import Tensor

DENSE_ABOVE = 0.1


@torch.no_grad()
def reconstruction_metrics(sae, source, max_rows: int = 65536, batch_size: int = 8192) -> tuple[dict, Tensor]:
    """Metrics over the first ``max_rows`` rows of ``source`` (in shard order), and each feature's density.

    A cross-layer transcoder reads every layer at once; its metrics are over all layers together
    (``l0`` counts the features of every layer that fire on a token) and per layer
    (``explained_variance_layer{l}``, ``l0_layer{l}``: the layer's own features).
    """
    clt = getattr(sae, "cross_layer", False)
    if clt:
        ins = [sae.hook_in(layer) for layer in range(sae.n_layers)]
        outs = [sae.hook_out(layer) for layer in range(sae.n_layers)]
    else:
        ins, outs = [sae.cfg.hook_name], [sae.cfg.hook_name_out if sae.is_transcoder else sae.cfg.hook_name]
    hooks = ins + [h for h in outs if h not in ins]
    for h, width in [(h, sae.cfg.d_in) for h in ins] + [(h, sae.cfg.d_out) for h in outs]:
        if source.d(h) != width:
            raise ValueError(f"the dictionary's width does not match the source's {h} ({source.d(h)} features)")
    groups, d_out, d_sae = len(outs), sae.cfg.d_out, sae.cfg.d_sae
    fires = torch.zeros(groups * d_sae, dtype=torch.float64)
    n = 0
    sse = torch.zeros(groups, dtype=torch.float64)
    y_sum, y_sq = torch.zeros(groups * d_out, dtype=torch.float64), torch.zeros(groups, dtype=torch.float64)
    shard = 0
    while n < max_rows and (source.n_shards is None or shard < source.n_shards):
        data = source.load_shard(shard, hooks)
        shard += 1
        x_all = torch.cat([data[h] for h in ins], -1)
        y_all = torch.cat([data[h] for h in outs], -1)
        for start in range(0, min(len(x_all), max_rows - n), batch_size):
            stop = min(start + batch_size, len(x_all), start + max_rows - n)
            x = x_all[start:stop].to(sae.device, torch.float32)
            y = y_all[start:stop].to(sae.device, torch.float32)
            if clt:
                acts = sae.activate(sae.pre_acts(x))
                recons = sae.decode_all(acts, x)
            else:
                acts = sae.encode(x)
                recons = sae.decode(acts, x)
            sse += (recons - y).double().pow(2).view(-1, groups, d_out).sum((0, 2)).cpu()
            y_sum += y.double().sum(0).cpu()
            y_sq += y.double().pow(2).view(-1, groups, d_out).sum((0, 2)).cpu()
            fires += (acts > 0).sum(0).double().cpu()
            n += len(x)
        if n >= max_rows:
            break
    if n == 0:
        raise ValueError("no rows to evaluate on")
    sst = y_sq - (y_sum * y_sum).view(groups, d_out).sum(1) / n
    density = fires / n
    metrics = {
        "l0": float(fires.sum()) / n,
        "explained_variance": float(1 - sse.sum() / sst.sum().clamp_min(1e-12)),
        "mse": float(sse.sum()) / n,
        "dead_fraction": float((density == 0).double().mean()),
        "dense_fraction": float((density > DENSE_ABOVE).double().mean()),
        "eval_rows": n,
    }
    if clt:
        for layer in range(groups):
            metrics[f"explained_variance_layer{layer}"] = float(1 - sse[layer] / sst[layer].clamp_min(1e-12))
            metrics[f"l0_layer{layer}"] = float(fires[layer * d_sae : (layer + 1) * d_sae].sum()) / n
    return metrics, density.float()


@torch.no_grad()
def ce_loss_recovered(model, sae, tokens: Int[Tensor, "batch pos"], batch_size: int = 32) -> dict:
    """Next-token loss of ``tokens`` clean, with ``sae`` spliced in (no error term), and zero-ablated.

    For a cross-layer transcoder every MLP is replaced, and the zero-ablated loss zeroes every MLP output.
    """
    from workbench.analysis.splice import spliced

    if getattr(sae, "cross_layer", False):  # every MLP replaced; the baseline zeroes every MLP output
        targets = [sae.hook_out(layer) for layer in range(sae.n_layers)]
    else:
        targets = [sae.cfg.hook_name_out if sae.is_transcoder else sae.cfg.hook_name]
    was_training = model.training
    model.eval()

    def zero(act: Tensor, hook) -> Tensor:
        return torch.zeros_like(act)

    def mean_loss(run) -> float:
        total, count = 0.0, 0
        for start in range(0, len(tokens), batch_size):
            rows = tokens[start : start + batch_size].to(model.device)
            total += float(run(rows)) * len(rows)
            count += len(rows)
        return total / count

    clean = mean_loss(lambda t: model(t, return_type="loss"))
    ablated = mean_loss(lambda t: model.run_with_hooks(t, return_type="loss", fwd_hooks=[(t, zero) for t in targets]))
    with spliced(model, sae, error_term=False):
        with_sae = mean_loss(lambda t: model(t, return_type="loss"))
    model.train(was_training)
    gap = ablated - clean
    return {
        "ce_loss_clean": clean,
        "ce_loss_spliced": with_sae,
        "ce_loss_zero_ablated": ablated,
        "ce_loss_recovered": (ablated - with_sae) / gap if abs(gap) > 1e-9 else float("nan"),
    }
