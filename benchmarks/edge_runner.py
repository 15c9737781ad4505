"""The edge runner's fast path against its stacked reference, on the real model, as ratios taken in one run.

    python benchmarks/edge_runner.py [--prompts 4 --budgets 0.001,0.01,0.05,0.2 --acdc-edges 40 --repeats 1]
    python benchmarks/edge_runner.py --quick      # the same pipeline on a tiny random model, seconds

``EdgeRunner.run`` (the forward behind faithfulness, ACDC, path patching and MIB's curves) used to
stack, at every stage, the corrupted-minus-clean output of every earlier sender with a dropped edge
into it: on SmolLM2-135M (30 layers, 301 senders, 61 stages) most of a run was that copying. It now
writes each sender's change once per run and mixes each stage's rows from there; the old path is
kept as ``EdgeRunner.run_stacked`` (autograd runs use it). On IOI prompts (``ioi_prompts``, seed 0):

1. Faithfulness of circuits of several sizes: the top ``--budgets`` fractions of the edges by |EAP
   score|, pruned (``circuits.prune``), each run by both paths (same metric checked to 1e-3 of the
   logit difference first), timed in turns (median of ``--repeats`` rounds).
2. One ACDC pass (``acdc(..., start=...)``, threshold 0.02 of the clean-ABC gap, as
   experiments/real_ioi.py) over the top ``--acdc-edges`` EAP edges, by both paths: the same edges
   kept, each edge's score to 1e-4.
3. One ACDC trial at receivers early, midway and late in the model (every later edge already pruned
   but those of the smallest circuit of 1., as mid-pass), by both paths; with the trial cost interpolated over the stages,
   the time full-edge ACDC would take if no node were skipped (an upper bound: ACDC skips every node
   none of whose outputs is read any more).
4. Peak memory of one faithfulness run of each size, in a fresh process per path (the peak resident
   memory over the resident memory just before, as benchmarks/eap_memory.py measures).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, no install needed
sys.path.insert(0, str(ROOT / "benchmarks"))
from _memory import peak_growth  # noqa: E402
from _timing import interleaved  # noqa: E402


def open_model(quick: bool):
    import workbench as wb

    if quick:
        sys.path.insert(0, str(ROOT / "experiments"))
        from real_ioi import tiny_model

        return tiny_model(0)
    return wb.open_pretrained("smollm2-135m").eval()


def build(model, n_prompts: int):
    """The runner on ``n_prompts`` IOI prompts (seed 0) and their logit-difference metric."""
    from workbench.analysis.circuits import EdgeRunner
    from workbench.analysis.circuits.ioi import ioi_prompts

    prompts = ioi_prompts(model, n_prompts, seed=0)
    return EdgeRunner(model, prompts.tokens(model.device)), prompts.metric()


def stacked(runner):
    """A shallow copy of ``runner`` whose ``run`` is the stacked reference (so ``metric_of`` and ``acdc`` use it)."""
    import copy

    old = copy.copy(runner)
    old.run = old.run_stacked
    return old


def peak_child(args) -> None:
    """In a fresh process: the peak resident memory of one faithfulness run per mask, over the memory before."""
    from safetensors.torch import load_file

    torch.set_num_threads(args.threads)
    masks = load_file(str(Path(args.memory_child) / "masks.safetensors"))
    model = open_model(args.quick)
    runner, metric = build(model, args.prompts)
    path = runner if args.path == "fast" else stacked(runner)
    path.metric_of(metric, masks[next(iter(masks))])  # first calls allocate for good (thread pools)
    peaks = {}
    for name, keep in masks.items():
        peaks[name] = peak_growth(lambda keep=keep: path.metric_of(metric, keep)) / 2**20
    print(json.dumps(peaks))


class _OutOfTime(Exception):
    pass


def full_acdc(runner, metric, seconds: float) -> str:
    """Full-edge ACDC (threshold 0.02 of the gap, every edge a candidate) on the fast path for at most
    ``seconds``: how many receivers it visited (from the logits back), edges it tried, and time taken."""
    import copy

    from workbench.analysis.circuits.acdc import acdc

    g = runner.graph
    counted = copy.copy(runner)
    trials = [0]

    def metric_of(*a, **k):
        trials[0] += 1
        return runner.metric_of(*a, **k)

    counted.metric_of = metric_of
    started, visited = time.perf_counter(), [0]

    def progress(done, total):
        visited[0] = done
        if time.perf_counter() - started > seconds:
            raise _OutOfTime

    finished = True
    try:
        keep, _ = acdc(counted, metric, 0.02, kl=False, progress=progress)
    except _OutOfTime:
        finished = False
    took = time.perf_counter() - started
    done = f"finished, kept {int(keep.sum())} edges" if finished else f"stopped after {seconds:.0f} s"
    return (f"full-edge ACDC (fast path): {done}; {visited[0]} of {len(g.receivers)} receivers visited (logits "
            f"first), {trials[0] - 1} edges tried of {g.n_edges}, {took:.0f} s")


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4, help="IOI prompt pairs (seed 0)")
    parser.add_argument("--budgets", default="0.001,0.01,0.05,0.2", help="circuit sizes, fractions of the edges")
    parser.add_argument("--acdc-edges", type=int, default=40, help="ACDC prunes the top N EAP edges")
    parser.add_argument("--repeats", type=int, default=1, help="timing rounds per contender (median)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a tiny random model (seconds; the CI check)")
    parser.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory measurement")
    parser.add_argument("--full-acdc", type=float, default=0.0, metavar="SECONDS",
                        help="also run full-edge ACDC (fast path) for at most this long and report how far it got")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=("fast", "stacked"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        peak_child(args)
        return pd.DataFrame()
    torch.set_num_threads(args.threads)
    from workbench.analysis.circuits import edge_attribution, prune
    from workbench.analysis.circuits.acdc import acdc

    started = time.perf_counter()
    model = open_model(args.quick)
    runner, metric = build(model, args.prompts)
    old = stacked(runner)
    g = runner.graph
    clean, corrupted = runner.endpoints(metric)
    eap = edge_attribution(model, (runner.clean, runner.corrupted), metric, "eap", graph=g)
    order = np.argsort(-np.abs(eap["score"].to_numpy()), kind="stable")

    def top(n: int) -> torch.Tensor:
        chosen = torch.zeros(g.n_edges)
        chosen[torch.from_numpy(order[:n].copy())] = 1.0
        return g.mask_from_vector(chosen)

    rows, masks = [], {}
    # 1. faithfulness at each budget
    for b in [float(x) for x in args.budgets.split(",") if x]:
        keep = prune(g, top(max(1, int(b * g.n_edges))))
        masks[f"{100 * b:g}%"] = keep
        values = {}
        t = interleaved({"stacked": lambda keep=keep: old.metric_of(metric, keep),
                         "fast": lambda keep=keep: runner.metric_of(metric, keep)}, args.repeats, warmup=False,
                        outputs=values)
        diff = abs(values["fast"] - values["stacked"])
        if diff > 1e-3:
            raise SystemExit(f"the fast and stacked runs disagree by {diff:.2e} at {b}: the timing would mean nothing")
        rows.append({"task": f"faithfulness, top {100 * b:g}% of edges by |EAP| ({int(keep.sum())} after pruning)",
                     "stacked_s": t["stacked"], "fast_s": t["fast"], "speedup": t["stacked"] / t["fast"],
                     "max_diff": diff, "faithfulness": (values["fast"] - corrupted) / (clean - corrupted)})
    # 2. one restricted ACDC pass
    start = top(args.acdc_edges)
    results = {}
    t = interleaved({"stacked": lambda: acdc(old, metric, 0.02, kl=False, start=start),
                     "fast": lambda: acdc(runner, metric, 0.02, kl=False, start=start)}, 1, warmup=False,
                    outputs=results)
    (keep_old, scores_old), (keep_new, scores_new) = results["stacked"], results["fast"]
    diff = float(np.abs(scores_old - scores_new).max())
    if not torch.equal(keep_old, keep_new) or diff > 1e-4:
        raise SystemExit(f"ACDC by the two paths differs (scores by {diff:.2e}): the timing would mean nothing")
    rows.append({"task": f"ACDC over the top {args.acdc_edges} EAP edges (kept {int(keep_new.sum())})",
                 "stacked_s": t["stacked"], "fast_s": t["fast"], "speedup": t["stacked"] / t["fast"], "max_diff": diff})
    # 3. single ACDC trials across the model, and the full-edge upper bound
    pruned = masks[min(masks, key=lambda k: float(k[:-1]))]  # the smallest circuit: what ACDC leaves, about
    probes = sorted({g.receiver_index(("head", layer, 0, "q")) for layer in
                     (0, g.n_layers // 3, 2 * g.n_layers // 3, g.n_layers - 1)} | {len(g.receivers) - 1})
    trial_s = {}
    for r in probes:
        keep = g.full_mask()
        later = torch.from_numpy(g.receiver_stage > g.receiver_stage[r])
        keep[:, later] = pruned[:, later]
        keep[0, r] = 0.0
        values = {}
        t = interleaved({"stacked": lambda keep=keep: old.metric_of(metric, keep),
                         "fast": lambda keep=keep: runner.metric_of(metric, keep)}, args.repeats, warmup=False,
                        outputs=values)
        trial_s[int(g.receiver_stage[r])] = t
        rows.append({"task": f"one ACDC trial into {g.receiver_labels[r]} (stage {g.receiver_stage[r]})",
                     "stacked_s": t["stacked"], "fast_s": t["fast"], "speedup": t["stacked"] / t["fast"],
                     "max_diff": abs(values["fast"] - values["stacked"])})
    stages = sorted(trial_s)
    incoming = g.adjacency.sum(0).numpy()
    full = {path: float(np.sum(incoming * np.interp(g.receiver_stage, stages, [trial_s[s][path] for s in stages])))
            for path in ("stacked", "fast")}
    rows.append({"task": f"full-edge ACDC, {g.n_edges} trials, no node skipped (estimate from the trials above)",
                 "stacked_s": full["stacked"], "fast_s": full["fast"], "speedup": full["stacked"] / full["fast"]})
    table = pd.DataFrame(rows)
    progress = full_acdc(runner, metric, args.full_acdc) if args.full_acdc > 0 else None
    # 4. memory, a fresh process per path
    memory = None
    if not args.no_memory:
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory() as tmp:
            save_file({k: v.contiguous() for k, v in masks.items()}, str(Path(tmp) / "masks.safetensors"))
            peaks = {}
            for path in ("stacked", "fast"):
                cmd = [sys.executable, __file__, "--memory-child", tmp, "--path", path, "--prompts", str(args.prompts),
                       "--threads", str(args.threads)] + (["--quick"] if args.quick else [])
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                peaks[path] = json.loads(out.strip().splitlines()[-1])
        memory = pd.DataFrame({"circuit": list(masks), "stacked_MB": [peaks["stacked"][k] for k in masks],
                               "fast_MB": [peaks["fast"][k] for k in masks]})
    n_batch, n_pos = runner.clean.shape
    resident = sum(t.numel() * t.element_size() for t in (runner.clean_out, runner.corrupted_out, runner.delta))
    print(f"{model.cfg.name or 'model'}: {g.n_layers} layers, {len(g.senders)} senders, {len(g.receivers)} receivers, "
          f"{g.n_edges} edges; {n_batch} IOI prompts x {n_pos} tokens (seed 0), {args.threads} thread(s); "
          f"clean {clean:.3f}, ABC {corrupted:.3f}; the runner's sender outputs and changes {resident / 2**20:.0f} MB")
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    if memory is not None:
        print("peak memory of one faithfulness run over the resident memory before it (fresh process per path):")
        print(memory.to_string(index=False, float_format=lambda x: f"{x:.0f}"))
    if progress is not None:
        print(progress)
    print(f"total {time.perf_counter() - started:.0f} s")
    return table


if __name__ == "__main__":
    main()
