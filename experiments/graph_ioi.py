"""An attribution graph of stories-2026 on one IOI prompt, read and checked by interventions.

    python experiments/graph_ioi.py [--out /tmp/stories-2026-transcoders] [--steps 1500]

1. A set of three skip-transcoders (one per MLP: ``blocks.{l}.ln2.hook_normalized`` ->
   ``blocks.{l}.hook_mlp_out``, 512 features each, ReLU + L1) is trained with ``train_sae`` on an
   activation store of the stories task (reused from ``--out`` when it is already there).
2. The graph of the held-out IOI prompt (seed 0), target: logit(IO) - logit(S), pruned as
   circuit-tracer prunes (node 0.8, edge 0.98).
3. Its reading is checked by interventions: the features whose predicted effect on the target is
   largest (along every path through features, ``A (I - A_ff)^-1``) are zeroed one at a time in
   the replacement model with attention and norms frozen (features re-encoded, errors held) and
   in the live replacement model (attention and norms recomputed too).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench import analysis as an  # noqa: E402
from workbench.data import get_task  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COLLECT = dict(tokens=4 * 32 * 63 * 16, batch_size=32, seq_len=64, tokens_per_shard=32 * 63 * 16)


def transcoders(model, out: Path, steps: int) -> list:
    layers = range(model.cfg.n_layers)
    if all((out / f"layer-{l}").exists() for l in layers):
        return [an.load_dictionary(out / f"layer-{l}") for l in layers]
    hooks = [h for l in layers for h in (f"blocks.{l}.ln2.hook_normalized", f"blocks.{l}.hook_mlp_out")]
    tmp = Path(tempfile.mkdtemp(prefix="acts-"))
    try:
        store = an.ActivationStore.collect(model, get_task("stories", seed=0), hooks, COLLECT["tokens"], tmp / "store",
                                           batch_size=COLLECT["batch_size"], seq_len=COLLECT["seq_len"],
                                           tokens_per_shard=COLLECT["tokens_per_shard"], progress=False)
        tcs = []
        for l in layers:
            tc = an.train_sae(store, kind="skip_transcoder", d_sae=512, hook=f"blocks.{l}.ln2.hook_normalized",
                              hook_out=f"blocks.{l}.hook_mlp_out", steps=steps, batch_size=2048, seed=0, threads=1,
                              out=out / f"layer-{l}", model=model, save_train_state=False, progress=False,
                              eval_sequences=64)
            shown = {k: round(v, 3) for k, v in tc.metrics.items() if k in ("l0", "explained_variance", "ce_loss_recovered")}
            print(f"layer {l}: {shown}", flush=True)
            tcs.append(tc)
        return tcs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "stories-2026-transcoders")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--top", type=int, default=20, help="features zeroed in the check")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, _ = wb.load_checkpoint(ROOT / "checkpoints" / "stories-2026")
    model.eval()
    tcs = transcoders(model, args.out, args.steps)
    ioi = get_task("stories", seed=0).ioi_prompts(1, split="heldout", seed=0)
    tokens = ioi.tokens[:1]
    io, s = int(ioi.correct[0]), int(ioi.wrong[0])
    print("prompt:", repr(model.to_string(tokens[0])), f" IO={model.to_string([io])!r} S={model.to_string([s])!r}")
    started = time.perf_counter()
    graph = an.attribution_graph(model, tcs, tokens, target=(io, s))
    print(f"graph: {graph} in {time.perf_counter() - started:.1f} s; scores {graph.scores()}")
    nodes, _ = graph.to_frame()
    strs = graph.str_tokens
    feats = nodes[nodes.kind == "feature"].sort_values("influence", ascending=False)
    feats = feats.assign(token=[strs[p] for p in feats.pos])
    print(feats.head(10)[["id", "layer", "pos", "token", "feature", "activation", "influence"]].to_string(index=False))
    logit = int(graph.nodes_of("logit")[0])
    ids = graph.node_ids()
    into = graph.edge_target == logit
    src, w = graph.edge_source[into], graph.edge_weight[into]
    print("largest edges into the target:", [(ids[int(src[i])], strs[int(graph.pos[src[i]])], round(float(w[i]), 3))
                                             for i in w.abs().argsort(descending=True)[:8]])
    influence = graph.influence()
    for k, kind in enumerate(("feature", "error", "token")):
        print(f"  {kind}s: direct edges sum {float(w[graph.kind[src] == k].sum()):+.3f}, "
              f"influence share {float(influence[graph.kind == k].sum() / influence.sum()):.3f}")
    diff = lambda logits: float(logits[io] - logits[s])  # noqa: E731
    # the graph's prediction for zeroing a feature: minus its effect along every path through features
    A = graph.adjacency().double()
    total = A @ torch.linalg.inv(torch.eye(graph.n_nodes, dtype=torch.float64) - _feature_only(A, graph))
    feature_nodes = graph.nodes_of("feature")
    top = feature_nodes[total[logit, feature_nodes].abs().argsort(descending=True)[: args.top]].tolist()
    with torch.no_grad():
        clean = diff(graph.intervene([])[-1])
        predicted = torch.tensor([-float(total[logit, i]) for i in top])
        frozen = torch.tensor([diff(graph.intervene([i], 0.0, freeze_attention=True)[-1]) - clean for i in top])
        live = torch.tensor([diff(graph.intervene([i], 0.0)[-1]) - clean for i in top])
        together = diff(graph.intervene(top, 0.0)[-1]) - clean
        real = diff(model(tokens)[0, -1])
    print(f"logit difference IO - S: model {real:.4f}, replacement model {clean:.4f}")
    print(f"zeroing each of the {len(top)} features of largest predicted effect, one at a time:")
    for i, p_, f_, l_ in zip(top, predicted.tolist(), frozen.tolist(), live.tolist()):
        print(f"  {ids[i]:>10} {strs[int(graph.pos[i])]!r:>8} act {float(graph.activation[i]):6.2f}  "
              f"graph {p_:+.3f}  frozen attention {f_:+.3f}  live {l_:+.3f}")
    r = lambda x, y: float(torch.corrcoef(torch.stack([x, y]))[0, 1])  # noqa: E731
    print(f"graph vs frozen attention: r = {r(predicted, frozen):.2f}, same sign {int(((predicted > 0) == (frozen > 0)).sum())}"
          f"/{len(top)};  graph vs live: r = {r(predicted, live):.2f}, same sign "
          f"{int(((predicted > 0) == (live > 0)).sum())}/{len(top)}")
    print(f"all {len(top)} zeroed together: graph {float(predicted.sum()):+.3f}, live {together:+.3f}")
    for node_threshold in (0.8, 0.9, 0.95):
        print(f"pruned at node threshold {node_threshold}, edge 0.98: {graph.prune(node_threshold, 0.98)}")
    return dict(graph=graph, predicted=predicted, frozen=frozen, live=live)


def _feature_only(A: torch.Tensor, graph) -> torch.Tensor:
    """The adjacency restricted to feature -> feature edges (the paths a zeroed feature's effect travels)."""
    f = graph.kind == 0
    return A * (f[:, None] & f[None, :])


if __name__ == "__main__":
    main()
