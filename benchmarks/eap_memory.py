"""EAP's memory against one forward and backward of the same model, as ratios taken in one run.

    python benchmarks/eap_memory.py [--contexts 256,1024,4096 --old-contexts 256,1024]

A random Llama-shaped model of 8 layers, d_model 256 (8 heads / 4 KV heads, d_mlp 704, vocabulary
8,192, RMSNorm, RoPE, SwiGLU; fp32 on the CPU) and one random prompt pair per context. Each
measurement runs in a subprocess of its own, which builds the model and the tokens, resets the
kernel's peak-RSS mark (``/proc/self/clear_refs``), runs one thing and reads the peak back
(``VmHWM``): the thing's own peak, less the resident memory just before it.

* ``fwd+bwd``: ``model(clean)``, the metric (a logit difference), ``backward()`` into the weights.
* ``eap``: ``edge_attribution(model, pair, metric, "eap")`` as it is now, every edge of the graph.
* ``eap (old)``: the path EAP took before (issue 36): ``EdgeRunner.receiver_grads`` keeps every
  receiver's gradient, [receivers, batch, pos, d_model], the scores are one product with it, and the
  runner holds its clean prefix sums.

Target (issue 36): EAP at most 3x the memory of one forward and backward. The ratio is
device-free: the same tensors are kept on a GPU. A measurement over ``--timeout`` seconds or out
of memory prints as missing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, no install needed
sys.path.insert(0, str(ROOT / "benchmarks"))
from _memory import status_bytes  # noqa: E402

SHAPE = dict(d_model=256, n_layers=8, n_heads=8, n_kv_heads=4, d_mlp=704, d_vocab=8192,
             norm="rmsnorm", positional="rope", ffn="swiglu", bias=False, tie_embeddings=False)
WHAT = ("fwd+bwd", "eap", "eap (old)")


def child(what: str, context: int, threads: int) -> None:
    import gc

    import torch

    import workbench as wb
    from workbench.analysis.circuits import EdgeRunner, edge_attribution
    from workbench.analysis.common import logit_diff_metric

    torch.set_num_threads(threads)
    model = wb.HookedDecoder(wb.ModelConfig(**SHAPE, n_ctx=context, seed=0)).eval()
    gen = torch.Generator().manual_seed(0)
    clean, corrupted = (torch.randint(3, SHAPE["d_vocab"], (1, context), generator=gen) for _ in range(2))
    metric = logit_diff_metric(1, 2)
    with torch.no_grad():  # the first forward's one-off allocations (thread pools, kernels) are not the method's
        model(clean[:, :16])
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the resident memory now
    before = status_bytes("VmRSS")
    if what == "fwd+bwd":
        metric(model(clean)).backward()
    elif what == "eap":
        edge_attribution(model, (clean, corrupted), metric, "eap")
    else:  # the old path, kept as receiver_grads (the reference the tests check receiver_scores against)
        runner = EdgeRunner(model, (clean, corrupted))
        runner._clean_prefix  # noqa: B018 (built eagerly before)
        fn = runner.resolve_metric(metric)
        runner.endpoints(fn)
        grads = runner.receiver_grads(fn)
        full = runner.delta.flatten(1) @ grads.flatten(1).T
        full[runner.graph.edge_sender, runner.graph.edge_receiver].float().cpu()
    print(json.dumps({"bytes": status_bytes("VmHWM") - before}))


def measure(what: str, context: int, args) -> float | None:
    cmd = [sys.executable, __file__, "--child", what, "--context", str(context), "--threads", str(args.threads)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        print(f"  {what} at {context}: exit {out.returncode}: {out.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])["bytes"] / 2**20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="256,1024,4096")
    p.add_argument("--old-contexts", default="256,1024", help="contexts the old path runs at (it needs far more)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--child", choices=WHAT, help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.context, args.threads)
    old = {int(c) for c in args.old_contexts.split(",") if c}
    print("8 layers x d_model 256 (8 heads), fp32, CPU, batch 1; peak memory over the resident memory before, MB")
    print(f"{'tokens':>7} {'fwd+bwd':>9} {'eap':>9} {'eap (old)':>10} {'eap / fwd+bwd':>14} {'old / fwd+bwd':>14}")
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        base = measure("fwd+bwd", context, args)
        new = measure("eap", context, args)
        before = measure("eap (old)", context, args) if context in old else None
        rows.append(dict(tokens=context, fwd_bwd_mb=base, eap_mb=new, eap_old_mb=before))

        def cell(x, width, fmt="{:.0f}"):
            return f"{'-' if x is None else fmt.format(x):>{width}}"

        ratio = None if base is None or new is None else new / base
        old_ratio = None if base is None or before is None else before / base
        print(f"{context:>7} {cell(base, 9)} {cell(new, 9)} {cell(before, 10)} {cell(ratio, 14, '{:.2f}x')} "
              f"{cell(old_ratio, 14, '{:.2f}x')}", flush=True)
    worst = max((r["eap_mb"] / r["fwd_bwd_mb"] for r in rows if r["eap_mb"] and r["fwd_bwd_mb"]), default=None)
    if worst is not None:
        print(f"EAP's largest ratio: {worst:.2f}x one forward and backward (target <= 3)")


if __name__ == "__main__":
    main()
