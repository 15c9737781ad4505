"""The figures of docs/reference/grokking.md from a finished `experiments/grokking.py` run directory.

    python experiments/grokking.py --seeds 3 --threads 1
    python scripts/grokking_docs.py                      # reads runs/grokking, writes docs/grokking/

Writes the run's figures as HTML (plotly loaded from its CDN, so each file is small) and one static
SVG of seed 0's losses with the phase boundaries, which a markdown viewer shows inline.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))

COLOURS = {"train_loss": "#1f77b4", "test_loss": "#ff7f0e", "restricted_loss": "#2ca02c", "excluded_loss": "#d62728"}


def losses_svg(curve: pd.DataFrame, phases: dict, title: str, width: int = 720, height: int = 360) -> str:
    """A log-y line chart of the four losses against epoch, dashed lines at the phases (no plotting library)."""
    left, right, top, bottom = 60, 150, 30, 40
    x0, x1 = float(curve.step.min()), float(curve.step.max())
    values = curve[list(COLOURS)].to_numpy().ravel()
    values = values[values > 0]
    y0, y1 = math.floor(math.log10(values.min())), math.ceil(math.log10(values.max()))

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0 or 1) * (width - left - right)

    def py(y: float) -> float:
        return top + (y1 - math.log10(max(y, 10.0**y0))) / (y1 - y0 or 1) * (height - top - bottom)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13">{title}</text>']
    for e in range(y0, y1 + 1):
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{py(10.0**e):.1f}" y2="{py(10.0**e):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{py(10.0**e) + 4:.1f}" text-anchor="end">1e{e}</text>')
    for x in range(0, int(x1) + 1, 200):
        out.append(f'<text x="{px(x):.1f}" y="{height - bottom + 16}" text-anchor="middle">{x}</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle">epoch</text>')
    for name, step in phases.items():
        if step == step:  # not NaN
            out.append(f'<line x1="{px(step):.1f}" x2="{px(step):.1f}" y1="{top}" y2="{height - bottom}" '
                       f'stroke="#888" stroke-dasharray="4 3"/><text x="{px(step) + 3:.1f}" y="{top + 10}" '
                       f'fill="#555">{name}</text>')
    for i, (column, colour) in enumerate(COLOURS.items()):
        points = " ".join(f"{px(s):.1f},{py(v):.1f}" for s, v in zip(curve.step, curve[column]))
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.6" points="{points}"/>')
        out.append(f'<line x1="{width - right + 10}" x2="{width - right + 30}" y1="{top + 14 * i + 20}" '
                   f'y2="{top + 14 * i + 20}" stroke="{colour}" stroke-width="2"/><text x="{width - right + 34}" '
                   f'y="{top + 14 * i + 24}">{column}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, default=REPO / "runs" / "grokking")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "grokking")
    args = p.parse_args(argv)
    import grokking

    curves, norms = pd.read_csv(args.run / "curves.csv"), pd.read_csv(args.run / "norms.csv")
    results = pd.read_csv(args.run / "results.csv")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, fig in grokking.figures_of(curves, norms, results).items():
        fig.write_html(args.out / f"{name}.html", include_plotlyjs="cdn")
    config = json.loads((args.run / "config.json").read_text())
    table = grokking.compare_with_paper(results, argparse.Namespace(lr=config["lr"], weight_decay=config["weight_decay"]))
    table.to_csv(args.out / "comparison.csv", index=False)
    print(table.to_string(index=False))
    first = int(results.seed.iloc[0])
    row = results[results.seed == first].iloc[0]
    phases = {label: float(row[key]) for key, label in (("memorised", "memorised"), ("excluded_min", "circuit"),
                                                         ("grokked", "grokked"), ("cleaned", "clean")) if key in row}
    svg = losses_svg(curves[curves.seed == first].sort_values("step"), phases, f"seed {first}: losses over training")
    (args.out / "losses.svg").write_text(svg)
    print(f"wrote {sorted(f.name for f in args.out.iterdir())} to {args.out}")


if __name__ == "__main__":
    main()
