"""Pre-norm vs post-norm from 2 to 16 layers at one fixed learning rate (no warmup, no decay):
where does post-norm's loss diverge? (The seeds' claim: the 2017 post-norm layout needs
warmup and small steps when deep; pre-norm trains at the same rate.)

A run counts as diverged when training stops on a non-finite loss (``TrainingDiverged``) or
its final loss ends more than 0.5 nats above its first logged loss. With ``--seeds N`` every
(placement, depth) cell runs N seeds: the summary gives the final loss's mean and 95% interval
over the seeds that finished, how many of the N diverged, and post minus pre at each depth
(paired by seed; "no difference detected" when the interval covers zero).
"""

from __future__ import annotations

import math

import _common
import pandas as pd
import plotly.graph_objects as go

NAME = "norm_placement_depth"


def main(argv=None) -> pd.DataFrame:
    p = _common.parser(NAME, __doc__)
    p.add_argument("--task", default="induction")
    p.add_argument("--depths", default="2,4,8,16")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-ctx", type=int, default=64)
    p.add_argument("--grad-clip", type=float, default=0.0, help="0: no clipping (clipping hides the divergence)")
    args = p.parse_args(argv)
    if args.quick:
        args.depths, args.steps, args.batch_size, args.d_model, args.n_ctx = "2,4", 3, 4, 16, 16
    _common.setup(args)
    import workbench as wb
    from workbench import viz
    from workbench.data import get_task
    from workbench.training import TrainConfig, TrainingDiverged, train

    depths = [int(d) for d in args.depths.split(",")]
    task_options = {"seq_len": args.n_ctx} if args.task == "induction" else {}
    vocab = get_task(args.task, seed=args.seed, **task_options).vocab_size
    train_cfg = TrainConfig(task=args.task, task_options=task_options, steps=args.steps, batch_size=args.batch_size,
                            lr=args.lr, warmup_steps=0, min_lr_ratio=1.0, grad_clip=args.grad_clip, eval_every=0,
                            log_every=max(1, args.steps // 50), eval_batches=2, save_train_state=False,
                            seed=args.seed, device="cpu" if args.quick else "auto")
    grid = [(placement, depth, seed) for seed in _common.seeds(args) for depth in depths for placement in ("pre", "post")]

    def one(item):
        placement, depth, seed = item
        cfg = wb.ModelConfig(d_model=args.d_model, n_layers=depth, n_heads=4, d_vocab=vocab, n_ctx=args.n_ctx,
                             norm_placement=placement, positional="learned", seed=seed,
                             name=f"{placement}-{depth}")
        run = f"{placement}-norm, {depth} layers, seed {seed}"
        try:
            result = train(train_cfg.replace(seed=seed), cfg, progress=False)
            history, error = result.history, ""
            final = result.metrics["train_loss"]
        except TrainingDiverged as exc:  # the loss went non-finite: that is the finding
            history, error, final = pd.DataFrame(), str(exc).split(".")[0], math.inf
        first = float(history.train_loss.iloc[0]) if len(history) else math.nan
        yield {"table": "summary", "placement": placement, "n_layers": depth, "seed": seed, "first_loss": first,
               "final_loss": final, "min_loss": float(history.train_loss.min()) if len(history) else math.nan,
               "diverged": bool(error) or not final < first + 0.5, "error": error}
        for row in history.to_dict("records"):
            yield {"table": "curve", "run": run, **row}

    gathered = _common.run_grid(grid, one, desc="placement x depth")
    if gathered is None:
        return None
    tables = _common.split_rows(gathered)
    results = tables["summary"]
    curves = tables.get("curve", pd.DataFrame(columns=["run", "step", "train_loss"]))
    finite = results.assign(final_loss=results.final_loss.where(results.final_loss.apply(math.isfinite)))
    numbers, readable = _common.with_intervals(finite, ["placement", "n_layers"], ["final_loss"])
    diverged = results.groupby(["placement", "n_layers"], sort=False).diverged.sum().astype(int)
    readable["diverged"] = [f"{diverged[(p, d)]} of {n}" for p, d, n in zip(readable.placement, readable.n_layers, readable.n)]
    from workbench.stats import Interval, compare, format_difference

    post_minus_pre = {}
    for depth in depths:
        part = finite[finite.n_layers == depth].dropna(subset=["final_loss"])
        if {"pre", "post"} <= set(part.placement):
            row = compare(part, "placement", "final_loss", baseline="pre").iloc[0]
            post_minus_pre[depth] = format_difference(Interval(row.diff_mean, row.diff_low, row.diff_high, int(row.n)))
    readable["post_minus_pre"] = [post_minus_pre.get(d, "") if p == "post" else "" for p, d in
                                  zip(readable.placement, readable.n_layers)]
    post = results[(results.placement == "post") & results.diverged]
    n_seeds = len(_common.seeds(args))
    verdict = (f"post-norm diverged from {int(post.n_layers.min())} layers at lr={args.lr} "
               f"(in {int(diverged[('post', int(post.n_layers.min()))])} of {n_seeds} seeds)" if len(post)
               else f"post-norm did not diverge up to {max(depths)} layers at lr={args.lr} ({n_seeds} seed(s))")
    fig = go.Figure()
    for placement, part in numbers.groupby("placement"):
        mean = part.final_loss_mean
        fig.add_trace(go.Scatter(x=part.n_layers, y=mean, mode="lines+markers", name=f"{placement}-norm",
                                 error_y=dict(type="data", symmetric=False, array=(part.final_loss_high - mean).fillna(0),
                                              arrayminus=(mean - part.final_loss_low).fillna(0))))
    fig.update_layout(title=f"Final loss vs depth at a fixed lr (mean, 95% interval): {verdict}", xaxis_title="layers",
                      yaxis_title="final train loss", xaxis_type="log", template="plotly_white")
    figures = {"final_loss_vs_depth": fig, "loss_curves": viz.loss_curves(curves, title="Loss curves")}
    _common.write_run(args.out, {"experiment": NAME, **vars(args), "train": train_cfg.to_dict(), "verdict": verdict},
                      results, figures, readable, title=f"{verdict}; final loss: mean [95% interval]",
                      tables={"summary": numbers, "loss_curves": curves})
    return results


if __name__ == "__main__":
    main()
