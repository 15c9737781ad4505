"""Why the induction head attends, through training: QK attribution at every snapshot of induction-attn2l.

    python scripts/qk_over_training.py                 # table + docs/qk_over_training.html
    python scripts/qk_over_training.py --prompts 32 --seed 1
    python scripts/qk_over_training.py --check         # no figure; fail unless the docs' table is measured again

For every snapshot and every head of ``--layer``, on ``--prompts`` induction prompts ``[r, r[:m]]``
(``graphs.qk_training.induction_qk_prompts``, seed ``--seed``: the query is the last token, the key
the token after its first occurrence), the attribution graph with the model as its own replacement
(the model is attention-only) and the QK attribution of that attention edge (``qk_pairs``, mapped
by ``over_training``). The K-composition pairs are (the current token at the query) x (a
previous-token head's output at the key), for the layer-0 heads whose previous-token score
(``head_scores``) is at least ``--prev-threshold`` at the last snapshot. Prints, per step, for the
head drawn (the best induction head at the last snapshot unless ``--head``): the score, the top
pair and its contribution, the K-composition pairs' summed contribution with its 95% interval over
the prompts, their median rank and the share of prompts where one of them is the top pair; then,
per head, the first step where they are the top pair on at least half the prompts, against the
loss drop of metrics.csv (``loss_drop``).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DOC = REPO / "docs" / "reference" / "qk-over-training.md"  # the table --check measures again

from _doc_tables import check_rows, write_page  # noqa: E402 (scripts/, beside this file)
import workbench as wb  # noqa: E402
from workbench import analysis as an  # noqa: E402
from workbench import viz  # noqa: E402
from workbench.analysis.graphs.qk_training import (induction_qk_prompts, loss_drop, pair_name, qk_pairs,  # noqa: E402
                                                   qk_summary)


def previous_token_heads(model, threshold: float) -> list[int]:
    scores = an.head_scores(model, kinds=("previous_token",))
    rows = scores[(scores["layer"] == 0) & (scores["score"] >= threshold)]
    return sorted(int(h) for h in rows["head"])


def best_induction_head(model, layer: int) -> int:
    scores = an.head_scores(model, kinds=("induction",))
    rows = scores[scores["layer"] == layer]
    return int(rows.loc[rows["score"].idxmax(), "head"])


def measure(run: Path, layer: int, n: int, seed: int, half: int, prev_threshold: float, progress: bool = True):
    """(series, per-pair table, summary, K-composition pairs, phase, seconds)."""
    series = wb.load_series(run)
    last = series.load(len(series) - 1)
    prev = previous_token_heads(last, prev_threshold)
    if not prev:
        raise SystemExit(f"no layer-0 head has a previous-token score >= {prev_threshold} at the last snapshot")
    prompts, queries, keys = induction_qk_prompts(series.config.d_vocab, n=n, half=half, seed=seed,
                                                  n_ctx=series.config.n_ctx)
    analysis = functools.partial(qk_pairs, tokens=prompts, layer=layer, head=list(range(series.config.n_heads)),
                                 query_pos=queries, key_pos=keys)
    started = time.perf_counter()
    table = an.over_training(series, analysis, progress=progress)
    seconds = time.perf_counter() - started
    pairs = [("token", f"L0H{h}") for h in prev]
    summary = qk_summary(table, pair=pairs)
    return series, table, summary, pairs, loss_drop(series.history), seconds, best_induction_head(last, layer)


def first_top(summary, head: int, share: float = 0.5):
    rows = summary[(summary["head"] == head) & (summary["pair_is_top"] >= share)]
    return int(rows["step"].min()) if len(rows) else None


def step_table(summary, head: int) -> str:
    part = summary[summary["head"] == head].sort_values("step")
    lines = ["| step | score | top pair (share of prompts) | its contribution | best K-composition pair's | "
             "K-composition pairs summed (95% interval) | their best rank (median) | share where top |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for _, r in part.iterrows():
        lines.append(f"| {r.step} | {r.score:.2f} | {r.top_pair} ({r.top_pair_share:.0%}) | {r.top_contribution:.3f} | "
                     f"{r.pair_best_contribution:.3f} | {r.pair_contribution:.3f} ({r.pair_contribution_low:.3f} to "
                     f"{r.pair_contribution_high:.3f}) | {r.pair_rank:g} | {r.pair_is_top:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=REPO / "checkpoints" / "induction-attn2l")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "qk_over_training.html")
    parser.add_argument("--layer", type=int, default=1, help="the layer of the induction heads")
    parser.add_argument("--head", type=int, default=None, help="the head drawn (default: best induction head at the end)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--half", type=int, default=16, help="length of the repeated segment r")
    parser.add_argument("--prev-threshold", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--check", action="store_true",
                        help="write no figure; fail unless every row of the table in docs/reference/qk-over-training.md "
                             "is measured again to the printed digits (run with the defaults)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    series, table, summary, pairs, phase, seconds, best = measure(args.run, args.layer, args.prompts, args.seed,
                                                                  args.half, args.prev_threshold)
    head = best if args.head is None else args.head
    print(f"over_training: {len(series)} snapshots x {args.prompts} prompts (seed {args.seed}) x "
          f"{series.config.n_heads} heads of layer {args.layer}: {seconds:.1f} s")
    print(f"K-composition pairs: {pair_name(pairs)}; loss drop (metrics.csv): steps {phase['start']} to "
          f"{phase['end']}, steepest at {phase['steepest']}, {phase['drop']:.2f} nats")
    print(f"\nL{args.layer}H{head} (the best induction head at the last snapshot)\n")
    measured = step_table(summary, head)
    print(measured)
    if args.check:
        return check_rows(DOC, measured)
    print("\n| head | first step where the K-composition pairs are the top pair on >= half the prompts | share at the end |")
    print("|---|---:|---:|")
    for h in sorted(summary["head"].unique()):
        end = summary[(summary["head"] == h)].sort_values("step").iloc[-1]
        print(f"| L{args.layer}H{h} | {first_top(summary, h)} | {end.pair_is_top:.0%} |")
    figure = viz.qk_over_training_figure(summary, head=head, phase=phase, theme="light",
                                         title=f"{args.run.name}, L{args.layer}H{head}: the top QK pair and the "
                                               f"K-composition pairs over training ({args.prompts} prompts, seed "
                                               f"{args.seed})")
    write_page(args.out, f"{args.run.name}: QK over training", figure.to_html(include_plotlyjs="cdn", full_html=False))
    print(f"\nfigure: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
