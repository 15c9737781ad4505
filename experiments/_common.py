"""What every experiment script shares: its command line, its run directory, and grid splitting.

Each experiment is a loop over library calls. It parses the common flags (``--quick``,
``--out``, ``--seed``, ``--threads``), runs its grid (split across ``torchrun`` ranks when
launched that way: rank r takes items r, r + W, ...; rank 0 gathers the rows over gloo), and
writes ``runs/<name>/``: ``config.json``, ``results.csv``, one HTML file per figure, and
prints a summary table.

    torchrun --nproc_per_node=2 experiments/norm_placement_depth.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import pandas as pd
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python experiments/x.py` from anywhere
    sys.path.insert(0, str(REPO))


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"experiments/{name}.py", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny version that runs in seconds (used by the tests)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / name, help=f"run directory (default: runs/{name})")
    p.add_argument("--seed", type=int, default=0, help="seed of models and data")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return p


def setup(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)


# ---- splitting a grid across torchrun ranks ------------------------------------------------
def rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


@contextlib.contextmanager
def single_process():
    """Hide torchrun's variables, so a library call (e.g. ``train``) does not start DDP:
    each rank runs its own grid items, which are different models."""
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def run_grid(items: list, run_one: Callable[[Any], Iterable[dict]], desc: str = "grid") -> Optional[pd.DataFrame]:
    """Rows of ``run_one(item)`` for every item, this rank's slice only; rank 0 gets all rows
    (in grid order), other ranks get None."""
    from tqdm.auto import tqdm

    rank, world = rank_and_world()
    mine = list(range(rank, len(items), world))
    rows = []
    for index in tqdm(mine, desc=desc, disable=rank != 0):
        with single_process():
            rows += [{"_item": index, **row} for row in run_one(items[index])]
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend="gloo")
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(rows, gathered, dst=0)
        dist.destroy_process_group()
        if rank != 0:
            return None
        rows = [row for part in gathered for row in part]
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    return frame.sort_values("_item", kind="stable").drop(columns="_item").reset_index(drop=True)


# ---- the run directory -------------------------------------------------------------------
def write_run(out: Path, config: dict, results: pd.DataFrame, figures: dict, summary: Optional[pd.DataFrame] = None,
              title: str = "", tables: Optional[dict] = None) -> None:
    """Write config.json, results.csv (and <name>.csv for ``tables``) and <figure>.html under
    ``out``; print the summary."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    results.to_csv(out / "results.csv", index=False)
    for name, table in (tables or {}).items():
        table.to_csv(out / f"{name}.csv", index=False)
    for name, fig in figures.items():
        # plotly.min.js written once next to the figures: they open offline, and stay small
        fig.write_html(out / f"{name}.html", include_plotlyjs="directory")
    table = results if summary is None else summary
    print(f"\n{title or out.name}: {len(results)} rows -> {out}")
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))


def is_main_rank() -> bool:
    return rank_and_world()[0] == 0


def split_rows(frame: pd.DataFrame, column: str = "table") -> dict[str, pd.DataFrame]:
    """Rows of several kinds gathered together, split by ``column`` (its NaN columns dropped)."""
    return {kind: part.drop(columns=column).dropna(axis=1, how="all").reset_index(drop=True)
            for kind, part in frame.groupby(column, sort=False)}
