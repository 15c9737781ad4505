"""An attribution graph of stories-2026 on one IOI prompt, read and checked by interventions.

    python experiments/graph_ioi.py [--out /tmp/stories-2026-transcoders] [--steps 1500]

1. A set of three skip-transcoders (one per MLP: ``blocks.{l}.ln2.hook_normalized`` ->
   ``blocks.{l}.hook_mlp_out``, 512 features each, ReLU + L1) is trained with ``train_sae`` on an
   activation store of the stories task (reused from ``--out`` when it is already there).
2. The graph of the held-out IOI prompt (seed 0), target: logit(IO) - logit(S), pruned as
   circuit-tracer prunes (node 0.8, edge 0.98).
3. Its reading is checked: the most influential features are zeroed (a) in the graph's own frozen
   model with every other feature held, where the target must move by minus their direct edges,
   and (b) in the live replacement model (attention, norms and downstream features recomputed,
   errors held), against the graph's prediction along every path through features,
   ``A (I - A_ff)^-1``, which holds exactly only while attention and the features' on/off pattern stay put.
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
    p.add_argument("--top", type=int, default=3, help="features zeroed together in the check")
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
    pruned = graph.prune(0.8, 0.98)
    print(f"pruned: {pruned}")
    nodes, _ = graph.to_frame()
    strs = graph.str_tokens
    feats = nodes[nodes.kind == "feature"].sort_values("influence", ascending=False)
    feats = feats.assign(token=[strs[p] for p in feats.pos])
    print(feats.head(10)[["id", "layer", "pos", "token", "feature", "activation", "influence"]].to_string(index=False))
    logit = int(graph.nodes_of("logit")[0])
    with torch.no_grad():
        clean = graph.intervene([], direct_only=True)[-1]
    diff = lambda logits: float(logits[io] - logits[s])  # noqa: E731
    top = [int(i) for i in feats.index[: args.top]]
    # the graph's linear prediction: total effect of the top features on the target through all paths
    A = graph.adjacency().double()
    total = A @ torch.linalg.inv(torch.eye(graph.n_nodes, dtype=torch.float64) - _feature_only(A, graph))
    predicted = -sum(float(total[logit, i]) for i in top)
    frozen = diff(graph.intervene(top, 0.0, direct_only=True)[-1]) - diff(clean)
    live = diff(graph.intervene(top, 0.0)[-1]) - diff(clean)
    real = diff(model(tokens)[0, -1])
    print(f"logit difference IO - S: model {real:.3f}, replacement model {diff(clean):.3f}")
    print(f"zeroing the top {args.top} features {[graph.node_ids()[i] for i in top]}:")
    print(f"  graph's prediction (all paths through features) {predicted:+.3f}")
    print(f"  frozen replacement model, downstream features held (direct edges only) {frozen:+.3f}"
          f" = -sum of direct edges {-sum(graph.edge(logit, i) for i in top):+.3f}")
    print(f"  live replacement model (attention, norms, features recomputed) {live:+.3f}")
    return dict(graph=graph, pruned=pruned, predicted=predicted, frozen=frozen, live=live)


def _feature_only(A: torch.Tensor, graph) -> torch.Tensor:
    """The adjacency restricted to feature -> feature edges (the paths a zeroed feature's effect travels)."""
    f = graph.kind == 0
    return A * (f[:, None] & f[None, :])


if __name__ == "__main__":
    main()
