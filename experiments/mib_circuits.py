"""MIB's circuit-localization metrics (CPR, CMD, AUROC) for every circuit method, on the planted models.

MIB (the Mechanistic Interpretability Benchmark) scores a circuit-finding method by the
faithfulness of its circuits at 0.1% .. 100% of the edges: CPR, the area under faithfulness
(higher is better, circuits by signed score), and CMD, the area under |1 - faithfulness|
(lower is better, circuits by |score|); on a model whose circuit is known, also the AUROC of
its edge ranking. ``workbench.analysis.circuits.mib`` implements them as MIB's code does, and
its docstring says which reading we took where the code leaves a choice.

Here every method of the workbench (exact edge patching, path patching, EAP, EAP-IG, ACDC, and
the node-level activation and attribution patching) runs on the planted models (their truth
is known: ``workbench.planted``) and induction-attn2l. Each seed draws a discovery prompt set
(seed) and a held-out evaluation set (seed + 1000): MIB finds circuits on one split and scores
them on another. The table reports the mean and a 95% t-interval over ``--seeds``.

A new method is a function ``(model, ds, metric) -> one score per edge``; see
``score_method`` in ``workbench.analysis.circuits.mib`` and docs/reference/mib.md.
"""

from __future__ import annotations

import time

import _common
import pandas as pd

NAME = "mib_circuits"
METHODS = ("exact", "path-patching", "eap", "eap-ig", "acdc", "activation", "attribution")


def main(argv=None) -> pd.DataFrame:
    from workbench.planted import PLANTED

    p = _common.parser(NAME, __doc__)
    p.add_argument("--models", default=",".join(PLANTED), help=f"comma-separated, from {list(PLANTED)}")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {list(METHODS)}")
    p.add_argument("--batch", type=int, default=16, help="prompts per prompt set")
    p.add_argument("--checkpoints", type=_common.Path, default=_common.REPO / "checkpoints")
    args = p.parse_args(argv)
    from workbench.analysis.circuits import mib

    models = [m for m in args.models.split(",") if m]
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in models if m not in PLANTED]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; models: {list(PLANTED)}")
    bad = [m for m in methods if m not in mib.METHODS]
    if bad:
        raise SystemExit(f"unknown method(s) {bad}; registered: {sorted(mib.METHODS)}")
    _common.setup(args)

    if args.quick:  # the hand-built model needs no checkpoint
        models, methods, args.batch = ["hand-induction"], ["eap", "activation"], 4

    loaded = {name: _common.planted(name, args.quick, args.checkpoints) for name in models}
    curves = []

    def one(item):
        name, method, seed = item
        info = loaded[name]
        clean, corrupted = info.prompts(args.batch, seed=seed)
        held_clean, held_corrupted = info.prompts(args.batch, seed=seed + 1000)
        started = time.perf_counter()
        result = mib.score_method(info.model, (clean, corrupted), info.metric(clean), method, truth=info.truth,
                                  exclude=info.unscored, eval_ds=(held_clean, held_corrupted),
                                  eval_metric=info.metric(held_clean))
        for kind in ("signed", "absolute"):
            curve = result[f"curve_{kind}"].assign(model=name, method=method, seed=seed, ranking=kind)
            curves.append(curve)
        yield {"model": name, "method": method, "seed": seed, "cpr": result["cpr"], "cmd": result["cmd"],
               "auroc_mib": result.get("auroc_mib"), "auroc_rank": result.get("auroc_rank"),
               "level": "node" if method in mib.NODE_LEVEL else "edge", "seconds": time.perf_counter() - started}

    items = [(name, method, seed) for name in models for method in methods for seed in _common.seeds(args)]
    results = _common.run_grid(items, one, desc="model x method x seed")
    if results is None:
        return None
    numbers, readable = _common.with_intervals(results, ["model", "method"], ["cpr", "cmd", "auroc_mib", "auroc_rank"])
    figures = {value: _common.interval_bars(numbers.assign(cell=numbers.model + " / " + numbers.method), "cell",
                                            value, title=f"MIB {value.upper()}: mean and 95% interval over seeds")
               for value in ("cpr", "cmd")}
    tables = {"summary": numbers}
    if curves:
        tables["curves"] = pd.concat(curves, ignore_index=True)
    _common.write_run(args.out, {"experiment": NAME, **vars(args)}, results, figures, readable, tables=tables)
    return results


if __name__ == "__main__":
    main()
