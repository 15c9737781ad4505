"""What every experiment script shares: its command line, its run directory, and grid splitting.

Each experiment is a loop over library calls. It parses the common flags (``--quick``,
``--out``, ``--seed``, ``--seeds``, ``--threads``), runs its grid (split across ``torchrun``
ranks when launched that way: rank r takes items r, r + W, ...; rank 0 gathers the rows over
gloo), and writes ``runs/<name>/``: ``config.json``, ``results.csv``, one HTML file per figure,
and prints a summary table.

A single run is an anecdote: ``--seeds N`` runs every cell with seeds ``seed .. seed+N-1``
(the grid is cells x seeds, split over ranks like any grid), and the summary reports each
cell's mean and 95% t-interval (``workbench.stats``), with "no difference detected" wherever
the interval of a difference covers zero.

A long grid loses nothing when it stops: every finished item's rows are appended to
``<out>/grid.rank<r>.jsonl`` as they come, and the same command run again (same flags, same
number of ranks) takes those items from the journal and runs only the rest. The journal is
removed once the run directory is written.

``--out`` must be new, empty, or a run directory (``workbench.json`` lists the files the runs
wrote; older runs are known by ``config.json``'s ``experiment``): any other folder is refused
before the grid runs, and a run never overwrites a file it did not write.

    torchrun --nproc_per_node=2 experiments/norm_placement_depth.py --quick
"""

from __future__ import annotations

import argparse
import json
import math
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
    p.add_argument("--seed", type=int, default=0, help="first seed of models and data")
    p.add_argument("--seeds", type=int, default=1, help="seeds per cell (seed, seed+1, ...); tables report the mean "
                                                       "and a 95%% t-interval over them")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return p


_JOURNAL: dict = {}  # set by setup: the run directory and the flags a journal must match to be resumed


def setup(args: argparse.Namespace) -> None:
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be >= 1, got {args.seeds}")
    check_run_dir(args.out)  # now, not after an hour of grid
    _JOURNAL.clear()
    _JOURNAL.update(out=args.out, key={k: str(v) for k, v in sorted(vars(args).items()) if k not in ("threads",)})
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)


def seeds(args: argparse.Namespace) -> list[int]:
    """The seeds every cell runs with: ``--seed`` and the ``--seeds - 1`` after it."""
    return list(range(args.seed, args.seed + args.seeds))


def with_intervals(results: pd.DataFrame, by, values, digits: int = 3) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(numbers, readable): per cell of ``by``, n and each value's mean, low, high over the seeds;
    the readable table folds each into ``"mean [low, high]"``."""
    from workbench.stats import interval_cells, summarize

    numbers = summarize(results, by, values)
    return numbers, interval_cells(numbers, values, digits)


def interval_bars(numbers: pd.DataFrame, x: str, value: str, title: str = ""):
    """A bar per cell at its mean, with its 95% interval as an error bar."""
    import plotly.graph_objects as go

    mean, low, high = numbers[f"{value}_mean"], numbers[f"{value}_low"], numbers[f"{value}_high"]
    fig = go.Figure(go.Bar(x=numbers[x].astype(str), y=mean,
                           error_y=dict(type="data", symmetric=False, array=(high - mean).fillna(0),
                                        arrayminus=(mean - low).fillna(0)),
                           customdata=numbers["n"], hovertemplate="%{x}<br>mean %{y:.4g} (n=%{customdata})<extra></extra>"))
    fig.update_layout(title=title or f"{value}: mean and 95% interval over seeds", yaxis_title=value,
                      template="plotly_white")
    return fig


def planted(name: str, quick: bool, checkpoints: Path):
    """A planted model by name; under --quick the hand-built induction model, which needs no checkpoint."""
    from workbench.planted import Planted, load_planted
    from workbench.planted.hand import BOS, HALF, TRUTH, build_hand_induction

    if quick:
        prompts = {"kind": "repeat", "half": HALF, "vocab": BOS, "bos": BOS, "distinct": True}
        return Planted(name, build_hand_induction(), TRUTH, [], "construction", prompts)
    return load_planted(name, checkpoints)


# ---- prompt files ------------------------------------------------------------------------
def read_prompts(path: Path):
    """A ``--prompts`` file as a ``workbench.PromptSet``: .csv or .jsonl, by its suffix."""
    import workbench as wb

    if not path.is_file():
        raise SystemExit(f"--prompts {path}: no such file")
    if path.suffix.lower() == ".csv":
        return wb.PromptSet.from_csv(path)
    if path.suffix.lower() in (".jsonl", ".json"):
        return wb.PromptSet.from_jsonl(path)
    raise SystemExit(f"--prompts {path}: give a .csv or a .jsonl file")


def word_model(prompts, seed: int):
    """A random tiny model with a word tokenizer of the prompt set's own words (``--quick`` without a
    checkpoint: it runs the whole pipeline over the file; its numbers mean nothing)."""
    import workbench as wb
    from workbench.tokenizer import WordTokenizer

    texts = [*prompts.clean, *(prompts.corrupted or []), *(prompts.answers or []), *(prompts.wrong or [])]
    tok = WordTokenizer.from_text(" ".join(texts))
    longest = max(len(tok.encode(t)) for t in texts)
    cfg = wb.ModelConfig(d_model=32, n_layers=2, n_heads=4, d_vocab=tok.vocab_size, n_ctx=max(32, longest), seed=seed)
    return wb.HookedDecoder(cfg, tokenizer=tok)


def model_for_prompts(args: argparse.Namespace, prompts, default: Path):
    """(model, source) for a prompt-file run: ``--checkpoint`` (else ``default``); with ``--quick``
    and no ``--checkpoint``, ``word_model`` of the prompts (a checkpoint's vocabulary may lack their words)."""
    import workbench as wb

    if args.checkpoint is None and args.quick:
        return word_model(prompts, args.seed), "random tiny model"
    args.checkpoint = args.checkpoint or default
    if not (args.checkpoint / "config.json").exists():
        raise SystemExit(f"no checkpoint at {args.checkpoint}; build it (scripts/make_checkpoints.py) or pass "
                         "--checkpoint")
    return wb.load_checkpoint(args.checkpoint)[0], str(args.checkpoint)


# ---- splitting a grid across torchrun ranks ------------------------------------------------
def rank_and_world() -> tuple[int, int]:
    """This script's place in a torchrun launch (read here, at the entry point; never by the library)."""
    from workbench.distributed import DistInfo

    info = DistInfo.from_env()
    return info.rank, info.world_size


def run_grid(items: list, run_one: Callable[[Any], Iterable[dict]], desc: str = "grid") -> Optional[pd.DataFrame]:
    """Rows of ``run_one(item)`` for every item, this rank's slice only; rank 0 gets all rows
    (in grid order), other ranks get None."""
    from tqdm.auto import tqdm

    rank, world = rank_and_world()
    mine = list(range(rank, len(items), world))
    journal = _open_journal(rank, world, len(items))
    done = journal.done if journal else {}
    if done and rank == 0:
        print(f"resuming: {len(done)} of {len(mine)} items of rank 0 read from {journal.path}")
    rows = []
    # Each rank's items are different models, trained single-process: ``train`` is data-parallel
    # only when handed a ``dist``, which no experiment passes.
    for index in tqdm(mine, desc=desc, disable=rank != 0):
        if index in done:
            item_rows = done[index]
        else:
            item_rows = list(run_one(items[index]))
            if journal:
                journal.append(index, item_rows)
        rows += [{"_item": index, **row} for row in item_rows]
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
RUN_FORMAT = "workbench.run"
JOURNAL_PREFIX = "grid.rank"


class _Journal:
    """One rank's finished grid items, one JSON line each, after a first line naming the run's flags."""

    def __init__(self, path: Path, key: dict):
        self.path, self.key, self.done = path, key, {}
        try:
            lines = path.read_text().splitlines()
        except OSError:
            lines = []
        try:
            if lines and json.loads(lines[0]) == {"key": key}:
                for line in lines[1:]:
                    entry = json.loads(line)
                    self.done[int(entry["item"])] = entry["rows"]
        except (ValueError, KeyError, TypeError):  # a line cut short by the stop: keep what parsed before it
            pass
        if not self.done:
            path.write_text(json.dumps({"key": key}) + "\n")

    def append(self, index: int, rows: list[dict]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"item": index, "rows": rows}, default=_json_scalar) + "\n")


def _json_scalar(value):
    return value.item() if hasattr(value, "item") else str(value)


def _open_journal(rank: int, world: int, n_items: int) -> Optional[_Journal]:
    """This rank's journal under the run directory ``setup`` checked (None when no setup ran)."""
    from workbench.checkpoint import MANIFEST_FILE

    out = _JOURNAL.get("out")
    if out is None:
        return None
    from workbench.checkpoint import locked
    from workbench.overwrite import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    name = f"{JOURNAL_PREFIX}{rank}.jsonl"
    # torchrun's ranks all start here at once: one at a time reads and rewrites the manifest (the
    # folder's lock, ``.<out>.lock`` beside it, as a checkpoint's), and the rewrite is atomic, so no
    # rank reads it half-written or writes over another rank's name.
    with locked(out):
        ours = run_files(out) or set()
        if name not in ours:  # listed before it is written, so the folder stays a run directory
            manifest = {"format": RUN_FORMAT, "files": sorted((ours | {name}) - {MANIFEST_FILE})}
            write_atomic(out / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
    return _Journal(out / name, {**_JOURNAL["key"], "world": world, "items": n_items})


def run_files(out: Path) -> Optional[set[str]]:
    """The files of ``out`` that runs wrote, or None when ``out`` is not a run directory."""
    from workbench.checkpoint import MANIFEST_FILE

    def read(name: str) -> Optional[dict]:
        try:
            data = json.loads((out / name).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    manifest = read(MANIFEST_FILE)
    if manifest is not None and manifest.get("format") == RUN_FORMAT and isinstance(manifest.get("files"), list):
        return {str(f) for f in manifest["files"]} | {MANIFEST_FILE}
    config = read("config.json")
    # A run from before manifests: its config.json is {"experiment": ..., **vars(args)} (this parser's flags).
    if config is not None and {"experiment", "quick", "out", "seed", "threads"} <= set(config):
        return {f.name for f in out.iterdir() if f.is_file() and
                (f.suffix in (".csv", ".html") or f.name in ("config.json", "plotly.min.js"))}
    return None


def mark_run_dir(out: Path) -> None:
    """Make ``out`` a run directory (an empty manifest) unless it is one, before a run writes into it."""
    from workbench.checkpoint import MANIFEST_FILE

    if run_files(out) is None:
        out.mkdir(parents=True, exist_ok=True)
        (out / MANIFEST_FILE).write_text(json.dumps({"format": RUN_FORMAT, "files": []}, indent=2) + "\n")


def check_run_dir(out: Path) -> None:
    """Exit with one message unless ``out`` is absent, empty, or a run directory."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out} exists and is not a folder; choose another path")
    if out.is_dir() and run_files(out) is None:
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
        if entries:
            shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} in all)" if len(entries) > 5 else "")
            raise SystemExit(f"--out {out} is a non-empty folder that is not an experiment run directory (it holds "
                             f"{shown}); nothing in it is overwritten: choose a new or empty folder")


def write_run(out: Path, config: dict, results: pd.DataFrame, figures: dict, summary: Optional[pd.DataFrame] = None,
              title: str = "", tables: Optional[dict] = None) -> None:
    """Write config.json, results.csv (and <name>.csv for ``tables``) and <figure>.html under
    ``out``; print the summary. A file of those names that a run did not write is never overwritten."""
    from workbench.checkpoint import MANIFEST_FILE

    names = ["config.json", "results.csv", *(f"{n}.csv" for n in tables or {}), *(f"{n}.html" for n in figures)]
    ours = run_files(out) if out.is_dir() else set()
    ours = set() if ours is None else ours  # a folder holding only what this run made (lens_comparison's model)
    foreign = [n for n in names + [MANIFEST_FILE] if os.path.lexists(out / n) and n not in ours]
    if foreign:
        raise SystemExit(f"--out {out} already holds {', '.join(foreign)}, not written by an experiment run; "
                         "choose a new or empty folder (nothing was written)")
    had_plotly = os.path.lexists(out / "plotly.min.js")  # plotly reuses one that is there, never overwrites it
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    results.to_csv(out / "results.csv", index=False)
    for name, table in (tables or {}).items():
        table.to_csv(out / f"{name}.csv", index=False)
    for name, fig in figures.items():
        # plotly.min.js written once next to the figures: they open offline, and stay small
        fig.write_html(out / f"{name}.html", include_plotlyjs="directory")
    written = set(names) | (set() if had_plotly else {"plotly.min.js"})
    journals = {n for n in ours if n.startswith(JOURNAL_PREFIX) and n.endswith(".jsonl")}
    for name in journals:  # every rank's rows are in results.csv now
        (out / name).unlink(missing_ok=True)
    manifest = {"format": RUN_FORMAT, "files": sorted((ours | written) - {MANIFEST_FILE} - journals)}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    table = results if summary is None else summary
    print(f"\n{title or out.name}: {len(results)} rows -> {out}")
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))


def is_main_rank() -> bool:
    return rank_and_world()[0] == 0


def split_rows(frame: pd.DataFrame, column: str = "table") -> dict[str, pd.DataFrame]:
    """Rows of several kinds gathered together, split by ``column`` (its NaN columns dropped, and
    whole-number columns that only the other kinds' gaps had made float turned back into ints)."""
    out = {}
    for kind, part in frame.groupby(column, sort=False):
        part = part.drop(columns=column).dropna(axis=1, how="all").reset_index(drop=True)
        for name in part.columns:
            values = part[name]
            if values.dtype.kind == "f" and values.map(math.isfinite).all() and (values == values.round()).all():
                part[name] = values.astype("int64")
        out[kind] = part
    return out
