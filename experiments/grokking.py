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

The paper trains 40k epochs at lr 1e-3 and weight decay 1. Here the default is 800 epochs at lr 4e-3
and weight decay 4, what this shared CPU allows for 3 seeds: AdamW shrinks the weights by lr x wd per
step, so that product sets the pace of the weight-decay-driven phases (16x the paper's here), while
lr / wd, which sets the weights' equilibrium scale, stays the paper's 1e-3; see
docs/reference/grokking.md for what that changes.

    python experiments/grokking.py --seeds 3 --threads 1
"""

from __future__ import annotations

import os
import time

import _common

NAME = "grokking"
P, TRAIN_FRACTION = 113, 0.3


def add_flags(p) -> None:
    p.add_argument("--epochs", type=int, default=800, help="full-batch epochs (the paper: 40000)")
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

    options = dict(p=23 if args.quick else P, train_fraction=TRAIN_FRACTION, layout="paper", full_batch=True)
    epochs, every = (12, 4) if args.quick else (args.epochs, args.snapshot_every)
    task = get_task("modular", seed=seed, **options)
    schedule = sorted({0, *snapshot_steps(f"log:{min(20, epochs)}", epochs), *snapshot_steps(f"every:{every}", epochs)})
    config = TrainConfig(task="modular", task_options=options, steps=epochs, batch_size=len(task.train_pairs),
                         lr=args.lr, weight_decay=args.weight_decay, beta1=0.9, beta2=0.98, warmup_steps=10,
                         min_lr_ratio=1.0, grad_clip=0.0, eval_every=25 if not args.quick else 4, eval_batches=1,
                         log_every=10 if not args.quick else 1, save_every=200, snapshots=schedule,
                         snapshot_fp16=True, seed=seed, threads=args.threads or 1)
    return config, wb.ModelConfig.from_preset("grokking-1l", d_vocab=task.vocab_size, seed=seed)


def train_seed(args, seed: int, stop_at=None):
    """The seed's run folder, trained to the end or to ``stop_at`` (resumed, or left alone when finished)."""
    from workbench.checkpoint import read_meta
    from workbench.training import STATE_JSON_FILE, train

    config, model_config = recipe(args, seed)
    run_dir = args.out / f"seed-{seed}"
    _wait_for_other_trainer(run_dir)
    if read_meta(run_dir).get("step", -1) >= config.steps and (run_dir / "snapshots").is_dir():
        return run_dir
    resume = (run_dir / STATE_JSON_FILE).exists()
    stop = None if stop_at is None else (lambda row: row["step"] >= stop_at)
    marker = args.out / f"seed-{seed}.training"  # beside the run folder, which holds only the run's own files
    marker.write_text(str(os.getpid()))
    try:
        train(config, None if resume else model_config, run_dir, resume=resume, progress=not args.quick, callback=stop)
    finally:
        marker.unlink(missing_ok=True)
    return run_dir


def _wait_for_other_trainer(run_dir) -> None:
    """Wait while another live process of this script trains the seed (two commands sharing the seeds)."""
    marker = run_dir.parent / f"{run_dir.name}.training"
    while marker.exists():
        try:
            pid = int(marker.read_text())
            os.kill(pid, 0)
        except (ValueError, OSError):  # a stale marker: its process is gone
            marker.unlink(missing_ok=True)
            return
        if pid == os.getpid():
            return
        time.sleep(10)


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
    _common.setup(args)
    gathered = _common.run_grid(_common.seeds(args), lambda seed: analyse_seed(args, seed), desc="seeds")
    if gathered is None:
        return None
    tables = _common.split_rows(gathered)
    results, curves, norms = tables["summary"], tables["curve"], tables["norms"]
    comparison = compare_with_paper(results, args)
    figures = figures_of(curves, norms, results)
    _common.write_run(args.out, {"experiment": NAME, **vars(args)}, results, figures, comparison,
                      title=f"grokking, {args.seeds} seed(s): the paper beside ours (mean [95% interval])",
                      tables={"comparison": comparison, "curves": curves, "norms": norms})
    return results


# The paper's reported values (Nanda et al. 2023, its main run: 40k epochs at lr 1e-3, wd 1, one seed).
PAPER = {"n_key": 5, "memorised": 1400, "circuit": 1400, "grokked": 9400, "cleaned": 13000}
PHASES = ["memorised", "excluded_min", "restricted_max", "grokked", "cleaned"]


def analyse_seed(args, seed: int):
    """Train (or reuse) one seed, then its progress measures over the snapshots, its key frequencies and
    phase epochs, and the embedding's Fourier norms at three points; rows of three tables."""
    import workbench as wb
    from workbench.analysis import fourier, over_training
    from workbench.checkpoint import read_meta
    from workbench.data.modular import ModularTask

    config, _ = recipe(args, seed)
    run_dir = train_seed(args, seed)
    task = ModularTask(seed=seed, **config.task_options)
    series = wb.load_series(run_dir)
    # A seed trained further than --epochs (an earlier, longer command) is analysed up to --epochs, like the rest.
    series = series[: sum(1 for step in series.steps if step <= config.steps)]
    final = series.load(-1)
    keys = fourier.key_frequencies(final, task)
    clusters = fourier.neuron_clusters(final, task, keys)
    started = time.perf_counter()
    curve = over_training(series, fourier.progress_measures, task=task, key_freqs=keys, progress=False)
    phases = fourier.phase_epochs(curve)
    end = curve.iloc[-1]
    meta = read_meta(run_dir)
    yield {"table": "summary", "seed": seed, "epochs": config.steps, "n_key": len(keys),
           "key_freqs": " ".join(map(str, keys)),
           "neurons_in_key": int(clusters[clusters.key].neurons.sum()), "neurons": int(clusters.neurons.sum()),
           **phases, "logit_fraction_key": float(end.logit_fraction_key), "test_accuracy": float(end.test_accuracy),
           "train_loss": float(end.train_loss), "test_loss": float(end.test_loss),
           "restricted_loss": float(end.restricted_loss), "excluded_loss": float(end.excluded_loss),
           "gini_embed": float(end.gini_embed), "saved_at": meta.get("saved_at", ""),
           "analysis_s": round(time.perf_counter() - started, 1)}
    for row in curve.to_dict("records"):
        yield {"table": "curve", "seed": seed, **row}
    points = [0, phases["memorised"], phases["grokked"], config.steps]
    chosen = sorted({series.nearest(s).step for s in points if s == s})  # NaN != NaN: a phase never reached
    for step in chosen:
        model = series.load(series.nearest(step))
        for row in fourier.embedding_norms(model, task).to_dict("records"):
            yield {"table": "norms", "seed": seed, "step": step, **row}


def compare_with_paper(results, args):
    """The paper's reported quantities beside ours: mean [95% interval] over the seeds, in our epochs and
    in paper epochs by two clocks: x lr ratio (the step size's pace, which memorisation follows) and
    x lr*wd ratio (the weight decay's pace, which circuit formation and cleanup follow); the difference
    from the paper's value is read on the lr*wd clock for the later phases and the lr clock for memorisation."""
    import pandas as pd

    from workbench.stats import Interval, format_difference, format_interval, t_interval

    by_lr, by_decay = args.lr / 1e-3, (args.lr * args.weight_decay) / (1e-3 * 1.0)
    measures = [("key frequencies (count)", "n_key", PAPER["n_key"], None),
                ("memorisation: train accuracy 99% (epoch)", "memorised", PAPER["memorised"], by_lr),
                ("circuit formation: excluded loss at its lowest (epoch)", "excluded_min", PAPER["circuit"], by_decay),
                ("circuit formation: restricted loss at its highest (epoch)", "restricted_max", PAPER["circuit"], by_decay),
                ("grokking: test accuracy 50% (epoch)", "grokked", PAPER["grokked"], by_decay),
                ("cleanup done: test accuracy 99% (epoch)", "cleaned", PAPER["cleaned"], by_decay),
                ("logit variance along the key frequencies, end", "logit_fraction_key", None, None)]
    rows = []
    for label, column, paper, clock in measures:
        values = results[column].astype(float) if column in results else pd.Series([float("nan")] * len(results))
        iv = t_interval(values)

        def scaled(factor, iv=iv):
            return Interval(iv.mean * factor, iv.low * factor, iv.high * factor, iv.n)

        read = scaled(clock or 1.0)
        vs = "" if paper is None else format_difference(
            Interval(read.mean - paper, read.low - paper, read.high - paper, iv.n), digits=3)
        rows.append({"measure": label, "paper": "" if paper is None else paper, "ours": format_interval(iv, 3),
                     "ours_x_lr": format_interval(scaled(by_lr), 3) if clock else "",
                     "ours_x_lr_wd": format_interval(scaled(by_decay), 3) if clock else "",
                     "ours_minus_paper": vs, "per_seed": " ".join(f"{v:.4g}" for v in values)})
    return pd.DataFrame(rows)


def figures_of(curves, norms, results) -> dict:
    from workbench import viz

    first = int(results.seed.iloc[0])
    phases = {k: float(v) for k, v in results[results.seed == first].iloc[0].items() if k in PHASES}  # absent: never reached
    one = curves[curves.seed == first]
    return {
        "losses": viz.grokking_figure(curves, title="Train and test loss, every seed (dashes: seeds)"),
        "losses_seed": viz.grokking_figure(one, phases, title=f"Train and test loss with the phase boundaries, seed {first}"),
        "restricted_excluded": viz.grokking_figure(
            one, phases, columns=["train_loss", "test_loss", "restricted_loss", "excluded_loss"],
            title=f"Restricted and excluded loss, seed {first}"),
        "fourier_norms": viz.fourier_norms_figure(norms[norms.seed == first],
                                                  title=f"Norm of the embedding per frequency, seed {first}"),
    }


if __name__ == "__main__":
    main()
