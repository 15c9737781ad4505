"""Steering scale x layer: can one contrastive direction flip IOI toward the subject, and what does
it cost on ordinary text?

The direction, at each layer's ``hook_resid_post``: the mean residual at the last token of BABA
IOI prompts ("When John and Mary ..., John gave a drink to" -> Mary, the subject came first)
minus that of ABBA prompts (the subject came second), on training name pairs. Added to held-out
ABBA prompts, it says "the subject came first", so a model that uses it should swap its answer:
the logit difference (indirect object - subject) falls and turns negative. The side effect is
the next-token loss on held-out stories text under the same steering. Every scale of one layer
runs as one batched forward (``steering_sweep``).

Seeds draw fresh prompt sets (direction-building prompts, evaluation prompts, text); intervals
are 95% percentile bootstraps over the evaluation prompts (logit difference, flip rate) and text
sequences (loss), pooled over seeds.
"""

from __future__ import annotations

import _common
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

NAME = "steering_sweep"


def _interval(values: np.ndarray, n_boot: int, seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (n_boot, len(values)))].mean(1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def main(argv=None) -> pd.DataFrame:
    p = _common.parser(NAME, __doc__)
    p.add_argument("--checkpoint", type=_common.Path, default=_common.REPO / "checkpoints" / "stories-2026")
    p.add_argument("--scales", default="0,1,2,4,6,8,12,16")
    p.add_argument("--positions", default="all", help="'all', or 'end' (the last prompt token only)")
    p.add_argument("--n-direction", type=int, default=256, help="IOI prompts that build the direction")
    p.add_argument("--n-eval", type=int, default=128, help="held-out IOI prompts steered (about half are ABBA)")
    p.add_argument("--n-text", type=int, default=32, help="held-out text sequences for the loss")
    p.set_defaults(seeds=3)  # --seeds comes from _common.parser
    p.add_argument("--n-boot", type=int, default=1000)
    args = p.parse_args(argv)
    _common.setup(args)
    import workbench as wb
    from workbench.analysis import steering_sweep, steering_vector
    from workbench.data import get_task

    if args.quick:
        args.scales, args.n_direction, args.n_eval, args.n_text, args.seeds, args.n_boot = "0,4", 16, 16, 4, 1, 100
    if not (args.checkpoint / "config.json").exists():
        raise SystemExit(f"no checkpoint at {args.checkpoint}; build it (scripts/make_checkpoints.py) "
                         "or pass --checkpoint")
    if args.positions not in ("all", "end"):
        raise SystemExit(f"--positions must be 'all' or 'end', got {args.positions!r}")
    model, _ = wb.load_checkpoint(args.checkpoint)
    model.eval()
    task = get_task("stories")
    scales = [float(s) for s in args.scales.split(",")]
    text_len = min(model.cfg.n_ctx, 32 if args.quick else model.cfg.n_ctx)

    per_prompt = []
    for seed in range(args.seed, args.seed + args.seeds):
        build = task.ioi_prompts(args.n_direction, split="train", seed=1000 + seed)
        evaluate = task.ioi_prompts(args.n_eval, split="heldout", seed=2000 + seed)
        text = task.batch(args.n_text, text_len, step=seed, split="val").to(model.device)
        first = torch.tensor([t == "BABA" for t in build.templates])
        target = torch.tensor([t == "ABBA" for t in evaluate.templates])
        tokens, io, subject = evaluate.tokens[target], evaluate.correct[target], evaluate.wrong[target]
        positions = "all" if args.positions == "all" else [tokens.shape[1] - 1]

        def logit_diff(logits):
            last = logits[:, -1]
            rows = torch.arange(len(last), device=last.device)
            return last[rows, io.to(last.device)] - last[rows, subject.to(last.device)]  # noqa: B023 (called within this iteration)

        for layer in range(model.cfg.n_layers):
            hook = f"blocks.{layer}.hook_resid_post"
            direction = steering_vector(model, build.tokens[first], build.tokens[~first], hook)
            ioi = steering_sweep(model, tokens, direction, scales, metric=logit_diff, positions=positions)
            loss = steering_sweep(model, text, direction, scales, positions=positions)
            common = {"seed": seed, "layer": layer, "direction_norm": float(direction.vector.norm())}
            per_prompt += [{**common, "measure": "logit_diff", **row} for row in ioi.to_dict("records")]
            per_prompt += [{**common, "measure": "loss", **row} for row in loss.to_dict("records")]

    rows = pd.DataFrame(per_prompt)
    summary = []
    for (layer, scale), part in rows.groupby(["layer", "scale"], sort=True):
        diff = part[part.measure == "logit_diff"].metric.to_numpy()
        loss = part[part.measure == "loss"].metric.to_numpy()
        flips = (diff < 0).astype(float)
        entry = {"layer": layer, "scale": scale, "direction_norm": part.direction_norm.mean(), "n_prompts": len(diff),
                 "logit_diff": diff.mean(), "flip_rate": flips.mean(), "loss": loss.mean()}
        for name, values in (("logit_diff", diff), ("flip_rate", flips), ("loss", loss)):
            entry[f"{name}_lo"], entry[f"{name}_hi"] = _interval(values, args.n_boot, args.seed)
        summary.append(entry)
    results = pd.DataFrame(summary)
    if results.empty:
        raise SystemExit("no ABBA prompt in the evaluation set; pass a larger --n-eval")

    figures = {}
    for measure, title in (("logit_diff", "IOI logit difference (indirect object - subject) under steering"),
                           ("loss", "Next-token loss on held-out text under the same steering")):
        fig = go.Figure()
        for layer, part in results.groupby("layer"):
            fig.add_trace(go.Scatter(
                x=part.scale, y=part[measure], mode="lines+markers", name=f"layer {layer}",
                error_y=dict(type="data", symmetric=False, array=part[f"{measure}_hi"] - part[measure],
                             arrayminus=part[measure] - part[f"{measure}_lo"])))
        fig.update_layout(title=title, xaxis_title="steering scale (x the contrastive vector)", yaxis_title=measure)
        figures[measure] = fig
    shown = results[["layer", "scale", "logit_diff", "logit_diff_lo", "logit_diff_hi", "flip_rate", "loss",
                     "loss_lo", "loss_hi"]]
    _common.write_run(args.out, {"experiment": NAME, **vars(args), "checkpoint": str(args.checkpoint)}, results,
                      figures, shown,
                      title=f"steering scale x layer ({args.checkpoint.name}, positions={args.positions})",
                      tables={"per_prompt": rows})
    return results


if __name__ == "__main__":
    main()
