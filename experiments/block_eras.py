"""The 2020 block against the 2026 block on the stories grammar, with seeds and intervals.

The two recipes are the shipped checkpoints' (scripts/make_checkpoints.py), the same parameter
count within 1%:

    2020   LayerNorm, GELU MLP, learned absolute positions, multi-head attention, tied head
    2026   RMSNorm, SwiGLU, RoPE, grouped-query attention (2 KV heads), untied head

each trained with its own recipe (``--recipe own``: the 2020 block at lr 2e-3 cosine, the 2026 block
at a constant 3e-3, the settings each was shipped with) or both with the 2020 one (``--recipe
same``: the fairer comparison of the blocks alone, where the 2026 block is known to be slower).
Scored by the stories task's own evaluation: validation loss, and on held-out IOI prompts (unseen
name pairs and templates) the accuracy of the indirect object over the subject and the logit
difference. The 2026 - 2020 difference of each is paired by seed, with its 95% interval.
"""

from __future__ import annotations

import importlib.util

import _common
import pandas as pd

NAME = "block_eras"
METRICS = ["final_val_loss", "ioi_accuracy", "ioi_logit_diff"]


def _recipes():
    """The shipped recipes, read from scripts/make_checkpoints.py (one place for them)."""
    path = _common.REPO / "scripts" / "make_checkpoints.py"
    spec = importlib.util.spec_from_file_location("make_checkpoints", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {era: module.RECIPES[f"stories-{era}"] for era in ("2020", "2026")}


def main(argv=None) -> pd.DataFrame:
    p = _common.parser(NAME, __doc__)
    p.add_argument("--recipe", choices=["own", "same"], default="own",
                   help="own: each block with the recipe it was shipped with; same: both with the 2020 recipe")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's, 800)")
    args = p.parse_args(argv)
    _common.setup(args)
    import workbench as wb
    from workbench.stats import Interval, compare, format_difference
    from workbench.training import TrainConfig, build_task, train

    recipes = _recipes()
    grid = [(era, seed) for seed in _common.seeds(args) for era in recipes]

    def one(item):
        era, seed = item
        recipe = recipes[era if args.recipe == "own" else "2020"]
        train_options = {**recipe["train"], "seed": seed, "threads": args.threads or 1}
        if args.steps is not None:
            train_options["steps"] = args.steps
        if args.quick:
            train_options.update(steps=3, batch_size=4, eval_every=0, log_every=1, warmup_steps=1)
        config = TrainConfig(**train_options)
        preset, overrides = recipes[era]["model"]
        task = build_task(config)
        cfg = wb.ModelConfig.from_preset(preset, **{**overrides, "d_vocab": task.vocab_size, "seed": seed})
        result = train(config, cfg, task=task, progress=False)
        yield {"table": "summary", "block": era, "seed": seed, "params": wb.count_params(cfg)["total"],
               "final_val_loss": result.metrics["val_loss"],
               **{k: result.metrics[k] for k in ("ioi_accuracy", "ioi_logit_diff") if k in result.metrics}}
        for row in result.history.to_dict("records"):
            yield {"table": "curve", "run": f"{era} seed {seed}", **row}

    gathered = _common.run_grid(grid, one, desc="blocks x seeds")
    if gathered is None:
        return None
    tables = _common.split_rows(gathered)
    results, curves = tables["summary"], tables["curve"]
    metrics = [m for m in METRICS if m in results]
    numbers, readable = _common.with_intervals(results, "block", metrics)
    for metric in metrics:
        row = compare(results, "block", metric, "2020").iloc[0]
        text = "2026 - 2020: " + format_difference(Interval(row.diff_mean, row.diff_low, row.diff_high, int(row.n)))
        readable[f"diff_{metric}"] = [text if str(b) == "2026" else "" for b in readable.block]
    from workbench import viz

    figures = {m: _common.interval_bars(numbers, "block", m, f"{m}, {args.seeds} seed(s), recipe {args.recipe}")
               for m in metrics}
    figures["loss_curves"] = viz.loss_curves(curves, title="The 2020 and the 2026 block on stories")
    _common.write_run(args.out, {"experiment": NAME, **vars(args)}, results, figures, readable,
                      title=f"2020 vs 2026 block, {args.seeds} seed(s), recipe {args.recipe}: mean [95% interval]",
                      tables={"summary": numbers, "loss_curves": curves})
    return results


if __name__ == "__main__":
    main()
