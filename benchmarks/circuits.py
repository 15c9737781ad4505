"""Edge-level circuit methods against exact edge patching, as ratios taken in one run.

    python benchmarks/circuits.py [--layers 8 --heads 8 --d-model 64 --repeats 3 --sample 256]

1. Every edge of an 8-layer, 8-head model (q, k and v of every head, every MLP, the logits:
   thousands of edges), scored by EAP (one forward and one backward pass, ``edge_attribution
   (method="eap")``) against exact edge patching of every edge (``method="exact"``, one
   resumed partial forward per edge). Target: EAP >= 100x faster; the Spearman rank
   correlation between the two is printed (the cost of the speed).
2. Exact edge patching of one edge at a time through resume (``edge_patching``'s engine:
   only the receiver is recomputed, from the clean run's cached activations, and the forward
   resumes at the receiver's layer) against a naive ``run_with_hooks`` implementation of the
   same patch (one full hooked forward per edge that overwrites the receiver's q, k, v, MLP
   output or final stream), on a random sample of edges; both are checked equal before the
   timing counts. Target: >= 2x.

Each method's caches (the clean and corrupted runs) are built once, outside the timed loop,
for both contenders in 2. Timings are medians of ``--repeats`` rounds, contenders in turns.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
from _timing import add_model_args, interleaved, random_model  # noqa: E402
from workbench.analysis.circuits import EdgeRunner, edge_attribution  # noqa: E402
from workbench.analysis.circuits.edges import edge_effects  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(pd.Series(a).rank(), pd.Series(b).rank())[0, 1])


def naive_edge_patch(model, runner: EdgeRunner, edge: int) -> torch.Tensor:
    """One full forward of the clean prompts with hooks that give one receiver one sender's corrupted output."""
    g = runner.graph
    sender, receiver = int(g.edge_sender[edge]), g.receivers[int(g.edge_receiver[edge])]
    delta = runner.delta[sender]
    seen = {}

    def keep(act, hook):
        seen["x"] = act

    if receiver[0] == "head":
        _, layer, head, kind = receiver
        block = model.blocks[layer]
        weight, bias = {"q": ("W_Q", "b_Q"), "k": ("W_K", "b_K"), "v": ("W_V", "b_V")}[kind]

        def replace(act, hook):
            act = act.clone()
            act[:, :, head] = block.ln1(seen["x"] + delta) @ getattr(block.attn, weight)[head] + getattr(block.attn, bias)[head]
            return act

        hooks = [(f"blocks.{layer}.hook_resid_pre", keep), (f"blocks.{layer}.attn.hook_{kind}", replace)]
    elif receiver[0] == "mlp":
        layer = receiver[1]
        block = model.blocks[layer]
        source = f"blocks.{layer}.hook_resid_pre" if g.parallel else f"blocks.{layer}.hook_resid_mid"
        hooks = [(source, keep), (f"blocks.{layer}.hook_mlp_out", lambda act, hook: block.mlp(block.ln2(seen["x"] + delta)))]
    else:
        hooks = [(f"blocks.{g.n_layers - 1}.hook_resid_post", lambda act, hook: act + delta)]
    return model.run_with_hooks(runner.clean, fwd_hooks=hooks)


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, d_model=64, vocab=256, batch=4, pos=32)
    parser.add_argument("--sample", type=int, default=256, help="edges in the resume-vs-naive comparison")
    args = parser.parse_args(argv)
    model = random_model(args)
    clean = torch.randint(0, args.vocab, (args.batch, args.pos), device=args.device)
    corrupted = torch.randint(0, args.vocab, (args.batch, args.pos), device=args.device)
    weights = torch.randn(args.vocab, device=args.device)

    def metric(logits):  # moves with every logit, so no edge is trivially zero
        return (logits[:, -1] @ weights).mean()

    ds = (clean, corrupted)
    # 1. EAP against exact patching of every edge (exact once: it is the slow one)
    eap_table = edge_attribution(model, ds, metric, "eap")
    _sync()
    started = time.perf_counter()
    exact_table = edge_attribution(model, ds, metric, "exact")
    _sync()
    exact_s = time.perf_counter() - started
    eap_s = interleaved({"eap": lambda: edge_attribution(model, ds, metric, "eap")}, args.repeats, warmup=False,
                        sync=_sync)["eap"]
    rho = _spearman(eap_table.score.to_numpy(), exact_table.score.to_numpy())
    n_edges = len(exact_table)

    # 2. one edge at a time: resume against a full hooked forward
    runner = EdgeRunner(model, ds)
    sample = np.random.default_rng(0).choice(n_edges, size=min(args.sample, n_edges), replace=False).tolist()
    with torch.no_grad():
        naive_values = np.array([float(metric(naive_edge_patch(model, runner, e))) for e in sample])
    resumed_values = edge_effects(runner, metric, sample)
    max_diff = float(np.abs(naive_values - resumed_values).max())
    if max_diff > 1e-4:
        raise SystemExit(f"resumed and naive edge patches disagree by {max_diff:.2e}: the timing would mean nothing")

    def naive_all():
        with torch.no_grad():
            return [float(metric(naive_edge_patch(model, runner, e))) for e in sample]

    t = interleaved({"naive": naive_all, "resume": lambda: edge_effects(runner, metric, sample)}, args.repeats,
                    sync=_sync)
    rows = [("all edges", f"exact edge patching ({n_edges} edges)", exact_s, 1.0),
            ("all edges", "EAP (1 forward + 1 backward)", eap_s, exact_s / eap_s),
            ("sampled edges", f"naive run_with_hooks, one full forward per edge ({len(sample)} edges)", t["naive"], 1.0),
            ("sampled edges", "exact through resume (receiver only, from its layer)", t["resume"],
             t["naive"] / t["resume"])]
    table = pd.DataFrame(rows, columns=["task", "method", "seconds", "speedup"])
    cfg = model.cfg
    print(f"{cfg.n_layers} layers x {cfg.n_heads} heads, d_model {cfg.d_model}, d_mlp {cfg.d_mlp}, vocab {cfg.d_vocab}, "
          f"batch {args.batch} x {args.pos} tokens, {args.device}, {args.threads} threads")
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"EAP vs exact edge patching over all {n_edges} edges: Spearman rho = {rho:.4f}, "
          f"Pearson r = {np.corrcoef(eap_table.score, exact_table.score)[0, 1]:.4f}")
    print(f"resumed == naive edge patch on {len(sample)} edges: max |difference| = {max_diff:.2e}")
    return table


if __name__ == "__main__":
    main()
