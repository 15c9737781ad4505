"""Ship one seed of experiments/grokking.py as checkpoints/modular-grokking: its final weights, its
metrics.csv and a few of its fp16 snapshots, so the Training page scrubs the grokking run offline.

    python experiments/grokking.py --seeds 3 --threads 1          # trains runs/grokking/seed-0 ...
    python scripts/make_grokking_checkpoint.py --run runs/grokking/seed-0

The snapshots kept are those nearest to ``--steps`` (each about 0.45 MB in fp16), copied as they
are, with the run's own index entries (their training metrics); nothing is retrained.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEPS = (0, 50, 100, 200, 300, 400, 500, 600, 700, 800)


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="a trained seed folder of experiments/grokking.py")
    p.add_argument("--out", type=Path, default=REPO / "checkpoints" / "modular-grokking")
    p.add_argument("--steps", type=str, default=",".join(map(str, STEPS)), help="snapshot steps to keep (nearest)")
    args = p.parse_args(argv)
    import workbench as wb
    from workbench.checkpoint import read_meta
    from workbench.snapshots import INDEX_FILE, SNAPSHOT_DIR, SNAPSHOTS_MANIFEST_FORMAT, read_index
    from workbench.training import METRICS_FILE

    model, tokenizer = wb.load_checkpoint(args.run)
    meta = read_meta(args.run)
    entries = read_index(args.run / SNAPSHOT_DIR)
    wanted = [int(s) for s in args.steps.split(",") if s.strip()]
    kept = sorted({min(entries, key=lambda e: abs(e["step"] - s))["step"] for s in wanted})
    chosen = [e for e in entries if e["step"] in kept]
    files = {f"{SNAPSHOT_DIR}/{e['file']}": args.run / SNAPSHOT_DIR / e["file"] for e in chosen}
    files[f"{SNAPSHOT_DIR}/{INDEX_FILE}"] = (json.dumps({"format": SNAPSHOTS_MANIFEST_FORMAT, "snapshots": chosen},
                                                        indent=1) + "\n").encode()
    files[METRICS_FILE] = args.run / METRICS_FILE
    own = {k: meta[k] for k in ("task", "task_options", "train_config") if k in meta}
    own["shipped_from"] = {"command": "python experiments/grokking.py --seeds 3 --threads 1",
                           "snapshots_kept": kept, "snapshots_in_run": len(entries)}
    wb.save_checkpoint(model, args.out, tokenizer, step=meta.get("step"), metrics=meta.get("metrics"), meta=own,
                       extra_files=files)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"{args.out}: {len(chosen)} snapshots (steps {kept}), {size / 1e6:.1f} MB")
    return args.out


if __name__ == "__main__":
    main()
