"""benchmarks/edge_runner.py on its --quick model: the pipeline runs, and both paths agree where it times them."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_edge_runner_benchmark_runs_on_its_quick_model():
    from edge_runner import main

    table = main(["--quick", "--no-memory", "--budgets", "0.05,0.2", "--acdc-edges", "10"])
    assert len(table) == 2 + 1 + table.task.str.startswith("one ACDC trial").sum() + 1
    assert (table.dropna(subset=["max_diff"]).max_diff < 1e-5).all()
    assert np.isfinite(table[["stacked_s", "fast_s", "speedup"]].to_numpy()).all()
