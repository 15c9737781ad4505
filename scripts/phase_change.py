"""The induction-head phase change, measured on the shipped snapshots of checkpoints/induction-attn2l.

    python scripts/phase_change.py                    # table + docs/phase_change.html
    python scripts/phase_change.py --run runs/ind     # any run trained with --snapshots

For every snapshot: the best previous-token and induction head scores (``analysis.head_scores``
on repeated random tokens) and the task's own evaluation on plain repeated random tokens
``[r, r]`` with ``r`` longer than any training segment (a layout never trained on): the loss
on the first and on the repeated half, and the best head's induction score. Both analyses run
in one pass (one load per snapshot); the seconds are printed. Writes the figure (score and
losses against step, and the layer x head heatmap with a step slider) as HTML, and prints the
Markdown table docs/reference/training-dynamics.md shows (--check: measured again, row by row).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _doc_tables import check_rows, write_page  # noqa: E402 (scripts/, beside this file)
import workbench as wb  # noqa: E402
from workbench import analysis as an  # noqa: E402
from workbench import viz  # noqa: E402
from workbench.checkpoint import read_meta  # noqa: E402
from workbench.data import get_task  # noqa: E402

DOC = REPO / "docs" / "reference" / "training-dynamics.md"  # the table --check measures again


def measure(run: Path, progress: bool = True):
    """(series, head scores over training, task metrics over training, seconds)."""
    series = wb.load_series(run)
    meta = read_meta(run)
    task = get_task(meta.get("task", "induction"), **meta.get("task_options", {}))
    analyses = {
        "heads": functools.partial(an.head_scores, kinds=("previous_token", "induction")),
        "task": task.evaluate,  # loss on [r, r] first / repeated half, best induction score
    }
    started = time.perf_counter()
    tables = an.over_training(series, analyses, progress=progress)
    return series, tables["heads"], tables["task"], time.perf_counter() - started


def table(heads, task, series) -> str:
    prev = heads[heads.kind == "previous_token"]
    prev = prev.loc[prev.groupby("step").score.idxmax()].set_index("step")
    rows = task.set_index("step").join(series.metrics.set_index("step")[["train_loss"]])
    lines = ["| step | train loss | loss, first half | loss, repeated half | best previous-token head | best induction head |",
             "|---:|---:|---:|---:|---:|---:|"]
    for step, r in rows.iterrows():
        train = "" if r.train_loss != r.train_loss else f"{r.train_loss:.3f}"  # NaN at step 0
        p = prev.loc[step]
        lines.append(f"| {step} | {train} | {r.loss_first_half:.3f} | {r.loss_repeated_half:.3f} | "
                     f"{p['score']:.2f} (L{int(p['layer'])}H{int(p['head'])}) | "
                     f"{r.induction_score_max:.2f} (L{int(r.best_layer)}H{int(r.best_head)}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=REPO / "checkpoints" / "induction-attn2l")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "phase_change.html")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="write no figure; fail unless every row of the table in docs/reference/training-dynamics.md "
                             "is measured again to the printed digits")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    series, heads, task, seconds = measure(args.run)
    print(f"over_training: {len(series)} snapshots, 2 analyses, {seconds:.1f} s")
    measured = table(heads, task, series)
    print(measured)
    if args.check:
        return check_rows(DOC, measured)
    losses = task[["step", "loss_first_half", "loss_repeated_half"]]
    figure = viz.over_training_figure(heads, losses=losses,
                                      title=f"{args.run.name}: head scores and losses over training")
    heatmap = viz.layer_head_over_training(heads, title="head scores")
    html = figure.to_html(include_plotlyjs="cdn", full_html=False) + heatmap.to_html(include_plotlyjs=False, full_html=False)
    write_page(args.out, f"{args.run.name} phase change", html)
    print(f"figure: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
