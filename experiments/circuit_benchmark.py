"""Every circuit-finding method on every planted circuit: edge AUROC against the truth, faithfulness
of the top-k circuit, time.

Models (workbench.planted): hand-induction (weights written by hand: the truth is exact),
iit-induction and iit-modular (strict IIT onto chosen heads: the truth is what the training
objective forces), induction-attn2l (an ordinarily trained model: the truth was established by
ACDC with exact edge interventions on other prompts, so it is a reference, not a fact).

Methods (workbench.analysis.circuits): exact edge patching, EAP, EAP-IG, ACDC (edge methods,
scored on every edge the truth decides), and the node-level activation and attribution patching
(scored on heads only).

Method ``qk`` (workbench.analysis.graphs.planted_qk) scores QK attribution instead of edges: at every
induction entry of an induction head the truth gives both a query and a key edge, the planted QK pairs
(query-side sender x key-side sender, both from the truth) against the top pairs of ``an.qk_attribution``
(every pair at least half the largest contribution there): qk_precision, qk_recall (pooled over entries
and prompts) and qk_top1 (the share of entries whose largest pair is planted). A model whose truth names
no query and key edges of one head (iit-modular: its heads' q and k inputs are unscored) gets no qk row.

Columns: edge_auroc (|score| ranks the truth's edges above the rest; ACDC ranks by the distance
each edge added when tried), node_auroc (the same for heads, an edge method scoring a head by
its largest edge), faithfulness_topk (the share of the behaviour kept by the k best-scored edges,
k = the truth's size, pruned), n_found and faithfulness_found (ACDC's own circuit at --threshold),
seconds (the method's own time on the prompt set).
"""

from __future__ import annotations

import time

import _common
import numpy as np
import pandas as pd

NAME = "circuit_benchmark"
EDGE_METHODS = ("exact", "eap", "eap-ig", "acdc")
NODE_METHODS = ("activation", "attribution")
QK_METHODS = ("qk",)


def main(argv=None) -> pd.DataFrame:
    from workbench.planted import PLANTED

    p = _common.parser(NAME, __doc__)
    p.add_argument("--models", default=",".join(PLANTED), help=f"comma-separated, from {list(PLANTED)}")
    p.add_argument("--methods", default=",".join(EDGE_METHODS + NODE_METHODS + QK_METHODS))
    p.add_argument("--batch", type=int, default=32, help="prompts per prompt set")
    p.add_argument("--steps", type=int, default=16, help="EAP-IG steps")
    p.add_argument("--threshold", type=float, default=0.01, help="ACDC threshold, a fraction of the metric's gap")
    p.add_argument("--checkpoints", type=_common.Path, default=_common.REPO / "checkpoints")
    args = p.parse_args(argv)
    _common.setup(args)
    from workbench import viz
    from workbench.analysis.circuits import (
        Circuit, ComputationGraph, discover_circuit, edge_attribution, edge_auroc, faithfulness, node_attribution,
        node_scores, prune, truth_nodes,
    )
    from workbench.analysis.circuits.circuit import auroc

    models = [m for m in args.models.split(",") if m]
    methods = [m for m in args.methods.split(",") if m]
    every = EDGE_METHODS + NODE_METHODS + QK_METHODS
    unknown = [m for m in models if m not in PLANTED] + [m for m in methods if m not in every]
    if unknown:
        raise SystemExit(f"unknown model(s) or method(s) {unknown}; models: {list(PLANTED)}, methods: {list(every)}")
    if args.quick:  # the hand-built model needs no checkpoint: build it here
        models, args.batch, args.steps = ["hand-induction"], 8, 4

    loaded = {name: _common.planted(name, args.quick, args.checkpoints) for name in models}

    def one(item):
        name, method = item
        model_info = loaded[name]
        model = model_info.model
        clean, corrupted = model_info.prompts(args.batch, seed=args.seed)
        metric, ds = model_info.metric(clean), (clean, corrupted)
        truth, unscored = model_info.truth, model_info.unscored
        heads = [f"L{l}H{h}" for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]
        row = {"model": name, "method": method, "truth_edges": len(truth), "truth_by": model_info.established_by}
        if method in QK_METHODS:
            from workbench.analysis.graphs.planted_qk import planted_qk_pairs, score_planted_qk

            if not planted_qk_pairs(truth, unscored):
                return  # no head of the truth has both a query and a key edge: no planted QK pair
            started = time.perf_counter()
            summary, _ = score_planted_qk(model_info, n_prompts=args.batch, seed=args.seed)
            row.update({k: summary[k] for k in ("qk_precision", "qk_recall", "qk_top1")},
                       qk_entries=summary["entries"], seconds=time.perf_counter() - started)
            yield row
            return
        if method in NODE_METHODS:
            table = node_attribution(model, ds, metric, method)
            row.update(edge_auroc=np.nan, node_auroc=auroc(table.abs_score, table.node.isin(truth_nodes(truth))),
                       faithfulness_topk=np.nan, seconds=table.attrs["seconds"])
            yield row
            return
        if method == "acdc":
            found = discover_circuit(model, ds, metric, "acdc", threshold=args.threshold)
            table = Circuit.from_edges(model, list(found.scores)).to_frame().drop(columns="score")
            table["score"] = table.edge.map(found.scores)
            table["abs_score"] = table["score"]  # the distance an edge added: larger is more needed
            row.update(n_found=len(found), faithfulness_found=faithfulness(model, found, ds, metric),
                       seconds=found.meta["seconds"])
        else:
            table = edge_attribution(model, ds, metric, method, steps=args.steps)
            row["seconds"] = table.attrs["seconds"]
        g = ComputationGraph(model)
        top = g.mask_of(table.nlargest(len(truth), "abs_score").edge.tolist())
        pruned = Circuit.from_mask(model, g, prune(g, top))
        nodes = node_scores(table)
        row.update(edge_auroc=edge_auroc(table, truth, unscored),
                   node_auroc=auroc(nodes.set_index("node").abs_score.reindex(heads, fill_value=0.0),
                                    pd.Index(heads).isin(truth_nodes(truth))),
                   faithfulness_topk=faithfulness(model, pruned, ds, metric))
        yield row

    items = [(name, method) for name in models for method in methods]
    results = _common.run_grid(items, one, desc="model x method")
    if results is None:
        return None
    columns = ["model", "method", "edge_auroc", "node_auroc", "faithfulness_topk", "n_found", "faithfulness_found",
               "qk_precision", "qk_recall", "qk_top1", "qk_entries", "seconds", "truth_edges", "truth_by"]
    results = results.reindex(columns=columns)
    figures = {"edge_auroc": viz.circuit_benchmark_figure(results, "edge_auroc", title="Edge AUROC against the truth"),
               "faithfulness_topk": viz.circuit_benchmark_figure(results, "faithfulness_topk",
                                                                 title="Faithfulness of the top-k edges")}
    qk_rows = results[results.method.isin(QK_METHODS)]
    for value in ("qk_precision", "qk_recall") if len(qk_rows) else ():
        figures[value] = viz.circuit_benchmark_figure(qk_rows, value, title=f"QK attribution: {value[3:]} of the "
                                                      "planted QK pairs among the top pairs")
    for name, info in loaded.items():
        truth = Circuit.from_edges(info.model, info.truth).to_frame()
        figures[f"truth_{name}"] = viz.circuit_figure(truth, title=f"{name}: the planted circuit")
    summary = results.drop(columns=["truth_by"])
    _common.write_run(args.out, {"experiment": NAME, **vars(args)}, results, figures, summary)
    return results


if __name__ == "__main__":
    main()
