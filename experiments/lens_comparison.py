"""Logit lens vs tuned lens: mean KL to the model's final distribution at every layer.

For each checkpoint, a tuned lens (one affine translator per layer, Belrose et al. 2023) is
trained on the model's own training data (its task's train split), saved into the
checkpoint directory as ``tuned_lens.safetensors`` + ``tuned_lens.json``, and compared with
the logit lens on held-out data (the task's validation split). The claim checked: the tuned
lens has the lower KL at every layer but the last (where both are the model itself).

With ``--seeds N`` the lens is trained N times (seed ``s``: its initialisation, its training
batches and the held-out batch); the summary gives each layer's mean KL with a 95% interval
and tuned minus logit paired by seed. Only the first seed's lens is saved.
"""

from __future__ import annotations

import _common
import pandas as pd
import plotly.graph_objects as go
import torch

NAME = "lens_comparison"
DEFAULT = "checkpoints/stories-2020,checkpoints/stories-2026"


def _data(model, path, n: int, seq_len: int, split: str, seed: int):
    """Token batches of the checkpoint's own task; sampled text from the model when there is none."""
    from workbench.checkpoint import read_meta
    from workbench.data import get_task

    meta = read_meta(path)
    if meta.get("task"):
        task = get_task(meta["task"], **meta.get("task_options", {}))
        step = 10_000 + seed  # a stretch of the train stream beyond what the main run logged
        return task.batch(n, seq_len, step=step, split=split).to(model.device)
    prompt = torch.randint(0, model.cfg.d_vocab, (n, 4), generator=torch.Generator().manual_seed(seed))
    return model.generate(prompt.to(model.device), max_new_tokens=seq_len - 4, temperature=1.0, seed=seed)


def main(argv=None) -> pd.DataFrame:
    p = _common.parser(NAME, __doc__)
    p.add_argument("--checkpoints", default=DEFAULT, help="comma-separated checkpoint directories")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--n-train", type=int, default=256, help="training sequences for the lens")
    p.add_argument("--n-eval", type=int, default=32, help="held-out sequences for the comparison")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's n_ctx")
    p.add_argument("--no-save", action="store_true", help="do not write the lens into the checkpoint directory")
    args = p.parse_args(argv)
    _common.setup(args)
    import workbench as wb
    from workbench import viz
    from workbench.analysis import compare_lenses, logit_lens, train_tuned_lens, tuned_lens

    paths = [_common.REPO / c.strip() if not c.strip().startswith("/") else _common.Path(c.strip())
             for c in args.checkpoints.split(",") if c.strip()]
    paths = [path for path in paths if (path / "config.json").exists()]
    if args.quick:  # a tiny trained-for-a-moment model of its own; shipped checkpoints are never touched
        from workbench.training import TrainConfig, train

        path = args.out / "quick-model"
        cfg = wb.ModelConfig(d_model=32, n_layers=2, n_heads=2, d_vocab=64, n_ctx=16, seed=args.seed)
        train(TrainConfig(task="induction", task_options={"seq_len": 16}, steps=3, batch_size=4, eval_every=0,
                          eval_batches=1, save_train_state=False, device="cpu"), cfg, out_dir=path, progress=False)
        paths, args.steps, args.n_train, args.n_eval, args.batch_size, args.lr = [path], 30, 32, 8, 8, 3e-3
    if not paths:
        raise SystemExit(f"none of {args.checkpoints} exists yet (python scripts/make_checkpoints.py builds the story checkpoints)")

    def one(item):
        path, seed = item
        model, _ = wb.load_checkpoint(path)
        model.eval()
        seq_len = min(args.seq_len or model.cfg.n_ctx, model.cfg.n_ctx)
        train_data = _data(model, path, args.n_train, seq_len, "train", seed)
        held_out = _data(model, path, args.n_eval, seq_len, "val", seed + 1)
        lens = train_tuned_lens(model, train_data, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                                seed=seed, progress=_common.is_main_rank())
        if not args.no_save and seed == args.seed:
            lens.save(path)
        kl = compare_lenses(model, held_out, lens).pivot(index="layer", columns="lens", values="kl").reset_index()
        for row in kl.to_dict("records"):
            yield {"checkpoint": path.name, "seed": seed, "n_layers": model.cfg.n_layers, **row}

    results = _common.run_grid([(path, seed) for seed in _common.seeds(args) for path in paths], one,
                               desc="checkpoints x seeds")
    if results is None:
        return None
    results = results.rename(columns={"logit": "logit_kl", "tuned": "tuned_kl"})
    results["tuned_minus_logit"] = results.tuned_kl - results.logit_kl
    numbers, readable = _common.with_intervals(results, ["checkpoint", "layer"],
                                               ["logit_kl", "tuned_kl", "tuned_minus_logit"], digits=3)
    from workbench.stats import Interval, format_difference

    readable["tuned_minus_logit"] = [format_difference(Interval(m, lo, hi, n)) for m, lo, hi, n in zip(
        numbers.tuned_minus_logit_mean, numbers.tuned_minus_logit_low, numbers.tuned_minus_logit_high, numbers.n)]
    n_layers = results.groupby("checkpoint").n_layers.first()
    numbers["tuned_better"] = numbers.tuned_minus_logit_high < 0  # the whole interval below zero
    if numbers.n.min() < 2:  # one seed: no interval, so compare the means
        numbers["tuned_better"] = numbers.tuned_minus_logit_mean < 0
    inner = numbers[numbers.layer < numbers.checkpoint.map(n_layers)]
    verdict = "tuned lens below logit lens at every layer but the last: " + \
        ("yes" if inner.tuned_better.all() else f"NO (layers {inner[~inner.tuned_better].layer.tolist()})") + \
        f" ({len(_common.seeds(args))} seed(s){'' if numbers.n.min() < 2 else '; 95% interval of the difference below 0'})"
    fig = go.Figure()
    for name, part in numbers.groupby("checkpoint", sort=False):
        for lens_name, dash in (("logit", None), ("tuned", "dash")):
            mean = part[f"{lens_name}_kl_mean"]
            fig.add_trace(go.Scatter(x=part.layer, y=mean, mode="lines+markers", name=f"{name} {lens_name} lens",
                                     line=dict(dash=dash), error_y=dict(
                                         type="data", symmetric=False, array=(part[f"{lens_name}_kl_high"] - mean).fillna(0),
                                         arrayminus=(mean - part[f"{lens_name}_kl_low"]).fillna(0))))
    fig.update_layout(title="Mean KL(final || lens) per layer", xaxis_title="layer (stream entering block; last = final)",
                      yaxis_title="KL, nats", template="plotly_white")
    figures = {"kl_per_layer": fig}
    first = paths[0]
    model, _ = wb.load_checkpoint(first)
    model.eval()
    example = _data(model, first, 1, min(24, model.cfg.n_ctx), "val", args.seed + 2)
    from workbench.analysis import TunedLens

    if (first / "tuned_lens.safetensors").exists():
        lens = TunedLens.load(first, model)
        figures["lens_heatmaps"] = viz.side_by_side(viz.logit_lens_figure(logit_lens(model, example)),
                                                    viz.logit_lens_figure(tuned_lens(model, example, lens)))
    _common.write_run(args.out, {"experiment": NAME, **vars(args), "verdict": verdict}, results, figures, readable,
                      title=verdict, tables={"summary": numbers})
    return results


if __name__ == "__main__":
    main()
