"""Nanda et al. (2023), "Progress measures for grokking via mechanistic interpretability", reproduced.

A one-layer ReLU transformer (the ``grokking-1l`` preset: d_model 128, 4 heads, d_mlp 512, no norm,
learned positions, untied) trained full-batch on ``a + b mod 113`` from 30% of the pairs, in the
paper's layout ``[a, b, =]`` with the answer read at ``=``; AdamW with betas (0.9, 0.98), weight decay
1, 10 warmup steps then a constant learning rate, no gradient clipping. Weights are kept at
log-spaced steps and every ``--snapshot-every`` epochs. Each seed (of the weights and of the split)
trains in ``<out>/seed-<s>/``, saved every 200 epochs so a stopped run resumes where it stopped; a seed
whose training finished is not trained again. Then the paper's progress measures run over its
snapshots (``workbench.analysis.fourier`` through ``an.over_training``): train and test loss and
accuracy, restricted and excluded loss, the Gini coefficient of the embedding's Fourier norms, the sum
of squared weights; and at the end the key frequencies and the fraction of the logits' variance they
explain. The phase boundaries (memorisation, circuit formation, cleanup) are read off those curves
(``fourier.phase_epochs``) and reported per seed and as a mean with a 95% interval over the seeds.

The paper trains 40k epochs at lr 1e-3 and weight decay 1. Here the default is 1200 epochs at lr 4e-3
and weight decay 4, what this shared CPU allows for 3 seeds: AdamW shrinks the weights by lr x wd per
step, so that product sets the pace of the weight-decay-driven phases (16x the paper's here), while
lr / wd, which sets the weights' equilibrium scale, stays the paper's 1e-3; see
docs/reference/grokking.md for what that changes.

    python experiments/grokking.py --seeds 3 --threads 1
"""

from __future__ import annotations

import _common

NAME = "grokking"
P, TRAIN_FRACTION = 113, 0.3


def add_flags(p) -> None:
    p.add_argument("--epochs", type=int, default=1200, help="full-batch epochs (the paper: 40000)")
    p.add_argument("--lr", type=float, default=4e-3, help="learning rate after 10 warmup steps (the paper: 1e-3)")
    p.add_argument("--weight-decay", type=float, default=4.0, help="AdamW weight decay (the paper: 1)")
    p.add_argument("--snapshot-every", type=int, default=25, help="a snapshot every N epochs, besides 20 log-spaced")
    p.add_argument("--train-only", action="store_true", help="train the seeds and stop (no analysis, no run files)")
    p.add_argument("--stop-at", type=int, default=None,
                   help="with --train-only: stop each seed at this epoch, resumable (to share seeds between two lanes)")


def recipe(args, seed: int):
    """(TrainConfig, ModelConfig) of one seed."""
    import workbench as wb
    from workbench.data import get_task
    from workbench.snapshots import snapshot_steps
    from workbench.training import TrainConfig

    options = dict(p=P, train_fraction=TRAIN_FRACTION, layout="paper", full_batch=True)
    epochs, every = (12, 4) if args.quick else (args.epochs, args.snapshot_every)
    task = get_task("modular", seed=seed, **options)
    schedule = sorted({0, *snapshot_steps(f"log:{min(20, epochs)}", epochs), *snapshot_steps(f"every:{every}", epochs)})
    config = TrainConfig(task="modular", task_options=options, steps=epochs, batch_size=len(task.train_pairs),
                         lr=args.lr, weight_decay=args.weight_decay, beta1=0.9, beta2=0.98, warmup_steps=10,
                         min_lr_ratio=1.0, grad_clip=0.0, eval_every=25 if not args.quick else 4, eval_batches=1,
                         log_every=10 if not args.quick else 1, save_every=200, snapshots=schedule,
                         snapshot_fp16=True, seed=seed, threads=args.threads or 1)
    return config, wb.ModelConfig.from_preset("grokking-1l", seed=seed)


def train_seed(args, seed: int, stop_at=None):
    """The seed's run folder, trained to the end or to ``stop_at`` (resumed, or left alone when finished)."""
    from workbench.checkpoint import read_meta
    from workbench.training import STATE_JSON_FILE, train

    config, model_config = recipe(args, seed)
    run_dir = args.out / f"seed-{seed}"
    if read_meta(run_dir).get("step") == config.steps and (run_dir / "snapshots").is_dir():
        return run_dir
    resume = (run_dir / STATE_JSON_FILE).exists()
    stop = None if stop_at is None else (lambda row: row["step"] >= stop_at)
    train(config, None if resume else model_config, run_dir, resume=resume, progress=not args.quick, callback=stop)
    return run_dir


def main(argv=None):
    p = _common.parser(NAME, __doc__)
    add_flags(p)
    args = p.parse_args(argv)
    if args.train_only:
        _common.check_run_dir(args.out)
        _common.mark_run_dir(args.out)  # so the full command accepts the seeds' folders trained here
        for seed in _common.seeds(args):
            print("trained", train_seed(args, seed, args.stop_at))
        return None
    raise SystemExit("analysis: not written yet")


if __name__ == "__main__":
    main()
