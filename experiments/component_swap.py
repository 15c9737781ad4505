"""Component swap: variants that differ from a reference in one component, trained at the same
budget (steps, batch, learning rate, data) with several seeds each, and scored on a layout
never trained on. Each variant is compared with its own reference, and the difference is
reported with its 95% interval ("no difference detected" when that covers zero).

The baseline is the shipped induction recipe (2-layer attention-only, d 128, 8 heads, RoPE,
LayerNorm, pre-norm, untied; random segments of 6-16 tokens recurring with filler). The score:
``InductionTask.evaluate`` on plain repeated random tokens ``[r, r]`` with ``r`` as long as half
the context (longer than any training segment): the best head's induction score and the loss
on the repeated half. The variants and what each is compared with:

    positions=learned    learned absolute positions instead of RoPE        vs baseline
    norm=rmsnorm         RMSNorm instead of LayerNorm                      vs baseline
    embeddings=tied      W_U = W_E^T                                       vs baseline
    kv=GQA               2 KV heads, 14 query heads (equal parameters)     vs baseline
    kv=MQA               1 KV head, 15 query heads (equal parameters)      vs baseline
    ffn=gelu             an MLP (d_mlp 4 d) in every block                 vs baseline
    ffn=swiglu           SwiGLU with d_mlp 8 d / 3 (equal parameters)      vs ffn=gelu
    layers=6             6 layers, pre-norm                                vs baseline
    layers=6/post        6 layers, post-norm                               vs layers=6

Query heads for GQA / MQA: attention weights are d (2 H + 2 G) d_head, so H' = 2 H - G keeps
them equal to MHA's with G key/value heads.
"""

from __future__ import annotations

import _common
import pandas as pd

NAME = "component_swap"
METRICS = ["induction_score_max", "loss_repeated_half", "final_val_loss"]


def _kv(groups: int):
    return lambda b: {"n_heads": 2 * b.n_heads - groups, "n_kv_heads": groups, "d_head": b.d_head}


# name -> (changes to the baseline config, given the baseline; the reference it is compared with)
VARIANTS = {
    "baseline": (lambda b: {}, None),
    "positions=learned": (lambda b: {"positional": "learned"}, "baseline"),
    "norm=rmsnorm": (lambda b: {"norm": "rmsnorm"}, "baseline"),
    "embeddings=tied": (lambda b: {"tie_embeddings": True}, "baseline"),
    "kv=GQA": (_kv(2), "baseline"),
    "kv=MQA": (_kv(1), "baseline"),
    "ffn=gelu": (lambda b: {"attn_only": False, "ffn": "gelu", "d_mlp": 4 * b.d_model}, "baseline"),
    "ffn=swiglu": (lambda b: {"attn_only": False, "ffn": "swiglu", "d_mlp": round(8 * b.d_model / 3)}, "ffn=gelu"),
    "layers=6": (lambda b: {"n_layers": 6}, "baseline"),
    "layers=6/post": (lambda b: {"n_layers": 6, "norm_placement": "post"}, "layers=6"),
}


def main(argv=None) -> pd.DataFrame:
    p = _common.parser(NAME, __doc__)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-ctx", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size, args.d_model, args.n_heads, args.n_ctx, args.warmup_steps = 4, 4, 16, 2, 16, 1
    _common.setup(args)
    import workbench as wb
    from workbench import viz
    from workbench.analysis import head_scores
    from workbench.data import get_task
    from workbench.stats import compare, format_difference, Interval
    from workbench.training import TrainConfig, train

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {list(VARIANTS)}")
    task_options = {"seq_len": args.n_ctx}
    vocab = get_task("induction", **task_options).vocab_size
    baseline = wb.ModelConfig.from_preset("attn-only-2l", d_model=args.d_model, n_heads=args.n_heads, d_vocab=vocab,
                                          n_ctx=args.n_ctx)
    train_cfg = TrainConfig(task="induction", task_options=task_options, steps=args.steps, batch_size=args.batch_size,
                            lr=args.lr, warmup_steps=args.warmup_steps, eval_every=0,
                            log_every=max(1, args.steps // 50), eval_batches=2 if args.quick else 4,
                            save_train_state=False, device="cpu" if args.quick else "auto")
    grid = [(name, seed) for seed in _common.seeds(args) for name in names]  # every variant at seed 0 first

    def one(item):
        name, seed = item
        cfg = baseline.replace(**VARIANTS[name][0](baseline), name=name, seed=seed)
        result = train(train_cfg.replace(seed=seed), cfg, progress=False)
        model = result.model.cpu()
        scores = head_scores(model, kinds=("previous_token", "induction"), seq_len=min(20, cfg.n_ctx // 2), batch=8)
        yield {"table": "summary", "variant": name, "seed": seed, "params": wb.count_params(cfg)["total"],
               "final_train_loss": result.metrics["train_loss"], "final_val_loss": result.metrics["val_loss"],
               **{k: v for k, v in result.metrics.items() if k not in ("train_loss", "val_loss")},
               "max_previous_token": float(scores[scores.kind == "previous_token"].score.max())}
        for row in result.history.to_dict("records"):
            yield {"table": "curve", "run": f"{name} seed {seed}", **row}
        for row in scores.to_dict("records"):
            yield {"table": "heads", "variant": name, "seed": seed, **row}

    gathered = _common.run_grid(grid, one, desc="variants x seeds")
    if gathered is None:
        return None
    tables = _common.split_rows(gathered)
    results, curves, heads = tables["summary"], tables["curve"], tables["heads"]
    numbers, readable = _common.with_intervals(results, "variant", METRICS + ["max_previous_token"])
    params = results.groupby("variant", sort=False).params.first()
    readable.insert(1, "params", readable.variant.map(params))
    for metric in ("induction_score_max", "loss_repeated_half"):  # each variant against its own reference
        cells = []
        for name in readable.variant:
            reference = VARIANTS[name][1]
            if reference is None or reference not in set(results.variant):
                cells.append("")
                continue
            row = compare(results[results.variant.isin([name, reference])], "variant", metric, reference).iloc[0]
            cells.append(f"vs {reference}: " + format_difference(Interval(row.diff_mean, row.diff_low, row.diff_high,
                                                                          int(row.n))))
        readable[f"diff_{metric}"] = cells
    figures = {
        "induction_score": _common.interval_bars(numbers, "variant", "induction_score_max",
                                                 f"Best induction score on [r, r] (never trained on), {args.seeds} seed(s)"),
        "repeated_loss": _common.interval_bars(numbers, "variant", "loss_repeated_half",
                                               f"Loss on the repeated half, {args.seeds} seed(s)"),
        "loss_curves": viz.loss_curves(curves, title=f"Component swap: same budget, {args.steps} steps"),
        "induction_scores": viz.layer_head_figure(heads[heads.kind == "induction"], "score", facet="variant",
                                                  title="Induction score per head (mean over seeds)"),
    }
    _common.write_run(args.out, {"experiment": NAME, **vars(args), "baseline": baseline.to_dict(),
                                 "train": train_cfg.to_dict()}, results, figures, readable,
                      title=f"component swap, {args.seeds} seed(s) per variant, {args.steps} steps: mean [95% interval]",
                      tables={"summary": numbers, "loss_curves": curves, "head_scores": heads})
    return results


if __name__ == "__main__":
    main()
