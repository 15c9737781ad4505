"""Ablation sweeps and patching: the fast paths against the naive loops, as ratios.

    python benchmarks/sweep.py [--layers 8 --heads 8 --repeats 3 --device cpu]

1. Every head zero-ablated, loss measured: the naive loop (one full ``run_with_hooks``
   forward per head) against ``ablation_sweep``, which starts each ablated run from the
   clean run's cached activations at that layer and recomputes only ``z W_O`` of the
   ablated layer's attention (target >= 1.5x on CPU at 8 layers x 8 heads; on a GPU the
   sweep also stacks 16 ablations per forward, target >= 5x).
2. Per-head activation patching, exact (TransformerLens' ``get_act_patch_attn_head_out_all_pos``,
   one full forward per head) against attribution patching (one forward and backward),
   target >= 10x, with the correlation between the two.

Both results are checked equal (sweep) or correlated (patching) before timing counts.
Figures are medians of ``--repeats`` runs, the methods timed in turns within one process
(the machines are shared, so only ratios taken this way mean much).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from transformer_lens import patching as tl_patching

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
from _timing import add_model_args, interleaved, random_model  # noqa: E402
from workbench.analysis import ablation_sweep, activation_patching, attribution_patching, logit_diff_metric


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, d_model=128, vocab=512, batch=8, pos=64)
    args = parser.parse_args(argv)
    model = random_model(args)
    tokens = torch.randint(0, args.vocab, (args.batch, args.pos), device=args.device)

    # warm-up, and the exactness check the timings rely on
    naive = ablation_sweep(model, tokens, unit="head", naive=True)
    fast = ablation_sweep(model, tokens, unit="head")
    max_diff = float((naive.metric - fast.metric).abs().max())
    sweeps = {"naive": lambda: ablation_sweep(model, tokens, unit="head", naive=True),
              "resume": lambda: ablation_sweep(model, tokens, unit="head", stack=1)}
    if args.device != "cpu":
        sweeps["stacked"] = lambda: ablation_sweep(model, tokens, unit="head", stack=16)
    t = interleaved(sweeps, args.repeats, warmup=False, sync=_sync)
    rows = [("head ablation sweep", "naive run_with_hooks loop", t["naive"], 1.0),
            ("head ablation sweep", "resume at layer, z W_O only", t["resume"], t["naive"] / t["resume"])]
    if "stacked" in t:
        rows.append(("head ablation sweep", "resume + 16 stacked per forward", t["stacked"], t["naive"] / t["stacked"]))

    clean = tokens
    corrupted = tokens.clone()
    corrupted[:, args.pos // 2] = (corrupted[:, args.pos // 2] + 1) % args.vocab
    answer, wrong = int(tokens[0, -1]), int((tokens[0, -1] + 1) % args.vocab)
    metric = logit_diff_metric(answer, wrong)
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean)

    outs: dict = {}
    t = interleaved({
        "tl": lambda: tl_patching.get_act_patch_attn_head_out_all_pos(model, corrupted, clean_cache, metric),
        "ours": lambda: activation_patching(model, clean, corrupted, metric, sites="head"),
        "attribution": lambda: attribution_patching(model, clean, corrupted, metric),
    }, args.repeats, warmup=False, sync=_sync, outputs=outs)
    with torch.no_grad():
        corrupted_value = float(metric(model(corrupted)))
    exact_effect = outs["tl"].flatten().cpu().numpy() - corrupted_value
    corr = float(np.corrcoef(outs["attribution"].attribution.to_numpy(), exact_effect)[0, 1])
    rows += [("per-head patching", "exact, TL get_act_patch (one forward per head)", t["tl"], 1.0),
             ("per-head patching", "exact, workbench resume", t["ours"], t["tl"] / t["ours"]),
             ("per-head patching", "attribution patching (1 fwd + 1 bwd)", t["attribution"], t["tl"] / t["attribution"])]
    table = pd.DataFrame(rows, columns=["task", "method", "seconds", "speedup"])
    cfg = model.cfg
    print(f"{cfg.n_layers} layers x {cfg.n_heads} heads, d_model {cfg.d_model}, vocab {cfg.d_vocab}, "
          f"batch {args.batch} x {args.pos} tokens, {args.device}, {args.threads} threads")
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"sweep == naive loop: max |difference| = {max_diff:.2e}")
    print(f"attribution vs exact patching: Pearson r = {corr:.4f}")
    return table


if __name__ == "__main__":
    main()
