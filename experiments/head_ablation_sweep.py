"""Every head, every ablation kind (zero, mean, resample), on a checkpoint and a task:
how much does the loss rise when that head is knocked out? Draws the layer x head heatmap
per ablation kind.

Tokens: for the induction task, repeated random tokens with the loss on the repeated half
(where induction heads act); for other tasks, held-out batches of the task the checkpoint
was trained on, with the mean next-token loss. Mean and resample ablations take their
reference activations from a second, independent batch of the same kind.

With ``--seeds N`` the sweep runs on N independent token batches (seed ``s`` draws batches
``s + 1`` and ``s + 2``); the heatmap shows the mean loss increase and the summary each top
head's mean and 95% interval over the batches.

With ``--prompts FILE`` (CSV or JSONL: a ``prompt`` column, optional ``answer``/``wrong``, any
other columns) the sweep runs over that prompt set instead, ``--batch`` prompts at a time,
padded (the prompts may have any lengths): each prompt is scored as if it ran alone (the
answer's logit difference against ``wrong`` at its last token when the file gives answers,
else its mean next-token loss), mean and resample ablations draw from the prompt set itself
(over real tokens only), and the summary gives each head's mean effect with its 95% interval
over the prompts. results.csv has one row per (head, method, prompt), with the file's columns.

    python experiments/head_ablation_sweep.py --checkpoint checkpoints/stories-2026 --prompts ioi.csv
"""

from __future__ import annotations

import _common
import pandas as pd

NAME = "head_ablation_sweep"
DEFAULT_CHECKPOINT = _common.REPO / "checkpoints" / "induction-attn2l"


def main(argv=None) -> pd.DataFrame:
    p = _common.parser(NAME, __doc__)
    p.add_argument("--checkpoint", type=_common.Path, default=None,
                   help="default: checkpoints/induction-attn2l (with --prompts and --quick: a random tiny model "
                        "reading the file's words)")
    p.add_argument("--task", default=None, help="task of the tokens (default: the checkpoint's training task)")
    p.add_argument("--methods", default="zero,mean,resample")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's n_ctx)")
    p.add_argument("--prompts", type=_common.Path, default=None,
                   help="a prompt set (.csv or .jsonl: prompt, answer, wrong, + any columns) to sweep over")
    args = p.parse_args(argv)
    _common.setup(args)
    if args.prompts is not None:
        return _over_prompts(args)
    import workbench as wb
    from workbench import viz
    from workbench.analysis import ablation_sweep, repeated_random_tokens, sweep_specs
    from workbench.checkpoint import read_meta
    from workbench.data import get_task

    args.checkpoint = args.checkpoint or DEFAULT_CHECKPOINT
    if (args.checkpoint / "config.json").exists():
        model, _ = wb.load_checkpoint(args.checkpoint)
        meta = read_meta(args.checkpoint)
        task_name = args.task or meta.get("task", "induction")
        task_options = meta.get("task_options", {}) if task_name == meta.get("task") else {}
        source = str(args.checkpoint)
    elif args.quick:  # no checkpoint built yet: a random tiny model still exercises the whole pipeline
        model = wb.HookedDecoder(wb.ModelConfig(d_model=32, n_layers=2, n_heads=4, d_vocab=64, n_ctx=32, seed=args.seed))
        task_name, task_options, source = args.task or "induction", {"seq_len": 32}, "random tiny model"
    else:
        raise SystemExit(f"no checkpoint at {args.checkpoint}; build it (scripts/make_checkpoints.py) or pass --checkpoint")
    model.eval()
    if args.quick:
        args.batch = 4
    seq_len = min(args.seq_len or model.cfg.n_ctx, 16 if args.quick else model.cfg.n_ctx)

    def batches(seed: int):
        """(tokens, reference tokens, metric) of one seed."""
        if task_name == "induction":
            half = seq_len // 2
            tokens = repeated_random_tokens(model, half, args.batch, seed=seed + 1)
            reference = repeated_random_tokens(model, half, args.batch, seed=seed + 2)
            return tokens, reference, lambda logits: model.loss_fn(logits, tokens, per_token=True)[:, half - 1 :].mean()
        task = get_task(task_name, **{**task_options, "seed": seed})
        return (task.batch(args.batch, seq_len, step=0, split="val").to(model.device),
                task.batch(args.batch, seq_len, step=1, split="val").to(model.device), None)

    methods = [m.strip() for m in args.methods.split(",")]
    specs = sweep_specs(model, "head", methods)
    seeds = _common.seeds(args)
    if _common.rank_and_world()[1] > 1:  # split (seed, head) items across torchrun ranks
        def one(item):
            seed, spec = item
            tokens, reference, metric = batches(seed)
            table = ablation_sweep(model, tokens, specs=[spec], metric=metric, reference=reference)
            yield from ({"seed": seed, **row} for row in table.to_dict("records"))

        results = _common.run_grid([(seed, spec) for seed in seeds for spec in specs], one, desc="heads")
    else:  # one process: the resumed sweep over every head at once, per seed
        parts = []
        for seed in seeds:
            tokens, reference, metric = batches(seed)
            parts.append(ablation_sweep(model, tokens, specs=specs, metric=metric, reference=reference,
                                        progress=True).assign(seed=seed))
        results = pd.concat(parts, ignore_index=True)
        results = results[["seed", *[c for c in results.columns if c != "seed"]]]
    if results is None:
        return None
    fig = viz.layer_head_figure(results, "delta", facet="method",
                                title=f"Loss increase when each head is ablated ({source}, {task_name}; mean of "
                                      f"{len(seeds)} batch(es))")
    numbers, readable = _common.with_intervals(results, ["label", "method"], ["delta", "clean"])
    order = numbers.sort_values("delta_mean", ascending=False).index[:10]
    summary = readable.loc[order].reset_index(drop=True)
    _common.write_run(args.out, {"experiment": NAME, **vars(args), "source": source, "task": task_name,
                                 "tokens_shape": [args.batch, seq_len]}, results, {"head_ablation": fig}, summary,
                      title=f"top heads by loss increase ({source}): mean [95% interval] over {len(seeds)} batch(es)",
                      tables={"summary": numbers})
    return results


def _over_prompts(args) -> pd.DataFrame:
    """The sweep over a prompt file: per-prompt effects, summarised with intervals over the prompts."""
    from workbench import viz
    from workbench.analysis import ablation_sweep, sweep_specs

    prompts = _common.read_prompts(args.prompts)
    model, source = _common.model_for_prompts(args, prompts, DEFAULT_CHECKPOINT)
    model.eval()
    specs = sweep_specs(model, "head", [m.strip() for m in args.methods.split(",")])
    results = ablation_sweep(model, prompts, specs=specs, batch_size=args.batch, per_prompt=True, progress=True)
    what = "logit difference" if prompts.answers is not None else "mean loss"
    numbers, readable = _common.with_intervals(results, ["label", "method", "layer", "head"], ["delta", "clean"])
    fig = viz.layer_head_figure(numbers, "delta_mean", facet="method",
                                title=f"Change in {what} when each head is ablated ({source}; mean over "
                                      f"{len(prompts)} prompts)")
    order = numbers["delta_mean"].abs().sort_values(ascending=False).index[:10]
    _common.write_run(args.out, {"experiment": NAME, **vars(args), "source": source, "n_prompts": len(prompts)},
                      results, {"head_ablation": fig}, readable.loc[order].reset_index(drop=True),
                      title=f"top heads by |change in {what}| ({source}): mean [95% interval] over "
                            f"{len(prompts)} prompts", tables={"summary": numbers})
    return results


if __name__ == "__main__":
    main()
