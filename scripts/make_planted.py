"""Build the planted-circuit models in checkpoints/ (deterministic given the seeds in workbench.planted).

    python scripts/make_planted.py                       # all of them
    python scripts/make_planted.py hand-induction        # just one
    python scripts/make_planted.py --out /tmp/ckpts      # somewhere else

hand-induction    weights written by hand (workbench/planted/hand.py), no training: instant
iit-induction     strict IIT on the induction task (workbench/planted/iit.py): about 1-2 min on one core
iit-modular       strict IIT on a + b mod 17: about 1-2 min on one core
induction-attn2l  no new weights: the shipped model's circuit, established by ACDC with exact edge
                  interventions on 64 prompts of seed 1000 (the benchmark uses other seeds), written to
                  checkpoints/induction-attn2l/circuit.json; rerun after scripts/make_checkpoints.py

Threads are pinned to 1, so a rebuild on the same machine and torch build gives the same weights.
Each build prints its acceptance check (accuracy, interchange accuracy, the truth's faithfulness),
which must pass, and each checkpoint stays under 1 MB.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench.analysis.circuits import Circuit, discover_circuit, evaluate_circuit  # noqa: E402
from workbench.planted import ESTABLISHED_CIRCUIT, PLANTED, Planted, checkpoint_dir  # noqa: E402
from workbench.planted.hand import BOS, HALF, TRUTH, build_hand_induction  # noqa: E402
from workbench.planted.iit import SPECS, train_iit  # noqa: E402

HAND_PROMPTS = {"kind": "repeat", "half": HALF, "vocab": BOS, "bos": BOS, "distinct": True}
ATTN2L_PROMPTS = {"kind": "repeat", "half": 16, "vocab": 64, "bos": None, "distinct": True}
ATTN2L_THRESHOLD, ATTN2L_BATCH, ATTN2L_SEED = 0.01, 64, 1000


def _truth_row(model, info: dict, batch: int = 64, seed: int = 1) -> dict:
    """Faithfulness and completeness of the planted truth on fresh prompts (the acceptance check)."""
    planted = Planted("check", model, info["truth"], info.get("unscored", []), info["established_by"], info["prompts"])
    clean, corrupted = planted.prompts(batch, seed)
    row = evaluate_circuit(model, Circuit.from_edges(model, info["truth"]), (clean, corrupted), planted.metric(clean),
                           minimality=False).iloc[0]
    return {"truth_faithfulness": float(row["faithfulness"]), "truth_completeness": float(row["completeness"])}


def build_hand(out: Path) -> bool:
    model = build_hand_induction()
    info = {"truth": TRUTH, "unscored": [], "prompts": HAND_PROMPTS,
            "established_by": "construction: weights written by hand (workbench/planted/hand.py); every other edge "
                              "reads a subspace its sender does not write, or a sender that is the same in both runs"}
    planted = Planted("hand-induction", model, TRUTH, [], info["established_by"], HAND_PROMPTS)
    clean, _ = planted.prompts(64, seed=1)
    with torch.no_grad():
        accuracy = float(torch.exp(planted.metric(clean)(model(clean))))
    metrics = {"answer_prob": accuracy, **_truth_row(model, info)}
    ok = metrics["answer_prob"] > 0.99 and metrics["truth_faithfulness"] > 0.999
    return _save(model, out / checkpoint_dir("hand-induction"), info, metrics, ok)


def build_iit(name: str, out: Path) -> bool:
    spec = SPECS[name]()
    model, metrics = train_iit(spec)
    info = {"truth": spec.truth, "unscored": spec.unscored, "prompts": spec.prompts,
            "nodes": {node: c.label for node, c in spec.nodes.items()},
            "established_by": "strict interchange intervention training (workbench/planted/iit.py) of the high-level "
                              f"graph {sorted(spec.nodes)} onto {[c.label for c in spec.nodes.values()]}"}
    metrics.update(_truth_row(model, info))
    ok = min(metrics["accuracy"], metrics["siit_accuracy_min"], *(metrics[f"iia_{n}"] for n in spec.nodes)) >= 0.98
    return _save(model, out / checkpoint_dir(name), info, metrics, ok, train=spec.train)


def _save(model, path: Path, info: dict, metrics: dict, ok: bool, **meta) -> bool:
    wb.save_checkpoint(model, path, metrics=metrics, meta={"planted": info, **meta})
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    shown = {k: round(v, 4) for k, v in metrics.items()}
    ok = ok and size < 1.0
    print(f"{path.name}: {size:.2f} MB, check {'PASSED' if ok else 'FAILED'}: {shown}", flush=True)
    return ok


def build_attn2l(out: Path, source: Path) -> bool:
    model, _ = wb.load_checkpoint(source / "induction-attn2l")
    planted = Planted("induction-attn2l", model, [], [], "", ATTN2L_PROMPTS)
    clean, corrupted = planted.prompts(ATTN2L_BATCH, ATTN2L_SEED)
    circuit = discover_circuit(model, (clean, corrupted), planted.metric(clean), "acdc", threshold=ATTN2L_THRESHOLD)
    info = {"unscored": [], "prompts": ATTN2L_PROMPTS,
            "established_by": f"exact edge interventions: ACDC at threshold {ATTN2L_THRESHOLD} of the metric's gap on "
                              f"{ATTN2L_BATCH} prompts of seed {ATTN2L_SEED}, pruned (the model was trained, not built)"}
    info.update(_truth_row(model, {**info, "truth": circuit.edges}))
    circuit.meta["planted"] = info
    target = out / "induction-attn2l"
    target.mkdir(parents=True, exist_ok=True)
    circuit.save(target / ESTABLISHED_CIRCUIT)
    ok = info["truth_faithfulness"] > 0.5
    print(f"induction-attn2l/{ESTABLISHED_CIRCUIT}: {len(circuit)} edges, check {'PASSED' if ok else 'FAILED'}: "
          f"faithfulness {info['truth_faithfulness']:.3f}, completeness {info['truth_completeness']:.3f} "
          "(fresh prompts)", flush=True)
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"any of {list(PLANTED)} (default: all)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "checkpoints")
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1] / "checkpoints",
                        help="where induction-attn2l's weights are read from")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in PLANTED]
    if unknown:
        parser.error(f"unknown planted model(s) {unknown}; valid names are {list(PLANTED)}")
    torch.set_num_threads(1)
    ok = True
    for name in args.names or PLANTED:
        started = time.perf_counter()
        if name == "hand-induction":
            ok &= build_hand(args.out)
        elif name == "induction-attn2l":
            if args.out != args.source:  # the circuit file sits beside the weights it was found on
                import shutil
                shutil.copytree(args.source / "induction-attn2l", args.out / "induction-attn2l", dirs_exist_ok=True)
            ok &= build_attn2l(args.out, args.out)
        else:
            ok &= build_iit(name, args.out)
        print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
