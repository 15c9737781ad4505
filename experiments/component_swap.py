"""Component swap: train variants that differ from a baseline in exactly one component
(norm, norm placement, positions, KV sharing, FFN, embedding tying) at the same budget
(same steps, batch, learning rate, data and seed), then compare final loss, loss curves and
head scores side by side.

Every variant is one ``ModelConfig.replace(...)`` of the baseline; training is
``workbench.training.train``; head scores are ``workbench.analysis.head_scores``.
"""

from __future__ import annotations

import _common
import pandas as pd

NAME = "component_swap"
VARIANTS = {
    "baseline": {},
    "norm=rmsnorm": {"norm": "rmsnorm"},
    "placement=post": {"norm_placement": "post"},
    "positions=learned": {"positional": "learned"},
    "kv=MQA": {"n_kv_heads": 1},
    "ffn=swiglu": {"ffn": "swiglu"},
    "embeddings=untied": {"tie_embeddings": False},
}


def main(argv=None) -> pd.DataFrame:
    p = _common.parser(NAME, __doc__)
    p.add_argument("--task", default="induction", help="training task (workbench.data: induction, stories, modular, text)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-ctx", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size, args.d_model, args.n_heads, args.n_ctx = 4, 4, 16, 2, 16
    _common.setup(args)
    import workbench as wb
    from workbench import viz
    from workbench.analysis import head_scores
    from workbench.data import get_task
    from workbench.training import TrainConfig, train

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {list(VARIANTS)}")
    task_options = {"seq_len": args.n_ctx} if args.task == "induction" else {}
    vocab = get_task(args.task, seed=args.seed, **task_options).vocab_size
    baseline = wb.ModelConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, d_vocab=vocab,
                              n_ctx=args.n_ctx, norm="layernorm", positional="rope", ffn="gelu", seed=args.seed)
    train_cfg = TrainConfig(task=args.task, task_options=task_options, steps=args.steps, batch_size=args.batch_size,
                            lr=args.lr, warmup_steps=min(100, args.steps // 10), eval_every=0,
                            log_every=max(1, args.steps // 50), eval_batches=2 if args.quick else 4,
                            save_train_state=False, seed=args.seed, device="cpu" if args.quick else "auto")

    def one(name: str):
        cfg = baseline.replace(**VARIANTS[name], name=name)
        result = train(train_cfg, cfg, progress=False)
        yield {"table": "summary", "variant": name, "params": wb.count_params(cfg)["total"],
               "final_train_loss": result.metrics["train_loss"], "final_val_loss": result.metrics["val_loss"],
               **{f"task_{k}": v for k, v in result.metrics.items() if k not in ("train_loss", "val_loss")}}
        for row in result.history.to_dict("records"):
            yield {"table": "curve", "run": name, **row}
        for row in head_scores(result.model.cpu(), seq_len=min(20, cfg.n_ctx // 2), batch=8).to_dict("records"):
            yield {"table": "heads", "variant": name, **row}

    gathered = _common.run_grid(names, one, desc="variants")
    if gathered is None:
        return None
    tables = _common.split_rows(gathered)
    results, curves, heads = tables["summary"], tables["curve"], tables["heads"]
    best = heads.groupby(["variant", "kind"], sort=False).score.max().unstack()
    results = results.merge(best.add_prefix("max_").reset_index(), on="variant")
    figures = {
        "loss_curves": viz.loss_curves(curves, title=f"Component swap on {args.task}: same budget"),
        "induction_scores": viz.layer_head_figure(heads[heads.kind == "induction"], "score", facet="variant",
                                                  title="Induction score per head"),
        "previous_token_scores": viz.layer_head_figure(heads[heads.kind == "previous_token"], "score", facet="variant",
                                                       title="Previous-token score per head"),
    }
    summary = results[["variant", "params", "final_train_loss", "final_val_loss", "max_induction", "max_previous_token"]]
    _common.write_run(args.out, {"experiment": NAME, **vars(args), "baseline": baseline.to_dict(),
                                 "train": train_cfg.to_dict()}, results, figures, summary,
                      tables={"loss_curves": curves, "head_scores": heads})
    return results


if __name__ == "__main__":
    main()
