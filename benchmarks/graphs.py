"""Attribution graphs at long context: peak memory and time against the context length.

    python benchmarks/graphs.py --contexts 256,512,1024,2048,4096 [--features 128 --batch 16]

A stories-size model (stories-2026's shape: 3 layers, d_model 128, 4 heads / 2 KV heads,
RoPE, RMSNorm, MoE SwiGLU MLPs; random weights, ``n_ctx`` raised to the longest context) with
TopK-16 skip transcoders of 512 features per layer (the shape circuit-tracer's cost was
measured on). Each context runs in a subprocess of its own, so its peak resident memory (Linux's
``VmHWM``, which an exec starts afresh; not ``getrusage``'s ru_maxrss, which Linux carries over from
the parent) is that graph's alone; a baseline subprocess that builds the same model, the
transcoders and the tokens but computes no graph is subtracted to give the graph's own memory,
whose growth with the context is fitted as ``memory ~ context^p`` (target p <= 1.2; a 4,096-token
graph within 4 GB). The graph: the top logits' rows, then ``--features`` feature rows chosen by
influence, each row kept sparse (its largest edges up to 99.9% of its absolute mass, at most
``--edges`` of them). Time grows faster than memory: each backward pass runs the attention over the
whole context, whose cost is quadratic even where its memory is not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, no install needed
from _memory import peak_mb  # noqa: E402  (the benchmarks' folder is on sys.path: the script's own)


def build(context: int, d_sae: int, k: int, seed: int = 0):
    import torch

    import workbench as wb
    from workbench.analysis.dictionaries import DictionaryConfig
    from workbench.analysis.dictionaries.transcoder import SkipTranscoder

    class TopKSkipTranscoder(SkipTranscoder):
        """A skip-transcoder whose k largest pre-activations fire (circuit-tracer's TopK(k) transcoders)."""

        def activate(self, pre):
            values, indices = pre.topk(self.cfg.k, dim=-1)
            return torch.zeros_like(pre).scatter_(-1, indices, values.relu())

    stories = json.loads((ROOT / "checkpoints" / "stories-2026" / "config.json").read_text())
    cfg = wb.ModelConfig(**{**stories, "n_ctx": context, "name": "stories-size", "seed": seed})
    model = wb.HookedDecoder(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    tcs = []
    for layer in range(cfg.n_layers):
        tc = TopKSkipTranscoder(DictionaryConfig(kind="skip_transcoder", d_in=cfg.d_model, d_sae=d_sae, d_out=cfg.d_model, k=k,
                                                 hook_name=f"blocks.{layer}.ln2.hook_normalized",
                                                 hook_name_out=f"blocks.{layer}.hook_mlp_out"))
        tc.init_weights(g)
        with torch.no_grad():
            tc.W_dec.mul_(0.1)
            tc.W_skip.copy_(0.05 * torch.randn(cfg.d_model, cfg.d_model, generator=g))
        tcs.append(tc.eval())
    tokens = torch.randint(0, cfg.d_vocab, (1, context), generator=g)
    return model, tcs, tokens


def child(args) -> None:
    """One measurement in this process: print a JSON line with seconds and peak RSS."""
    import torch

    from workbench.analysis.graphs import attribution_graph

    torch.set_num_threads(args.threads)
    model, tcs, tokens = build(args.context, args.d_sae, args.k)
    start = time.perf_counter()
    row = {"context": args.context}
    if not args.baseline:
        graph = attribution_graph(model, tcs, tokens, max_feature_nodes=args.features, batch_size=args.batch,
                                  edge_mass=0.999, max_edges_per_node=args.edges, max_n_logits=10)
        row.update(seconds=time.perf_counter() - start, active_features=graph.meta["n_active_features"],
                   feature_rows=int((graph.kind == 0).sum()), edges=graph.n_edges,
                   stored_patterns=graph.meta["stored_patterns"])
    row["peak_mb"] = peak_mb()
    print("RESULT " + json.dumps(row), flush=True)


def run_child(context: int, args, baseline: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", "--context", str(context), "--features", str(args.features),
           "--batch", str(args.batch), "--edges", str(args.edges), "--d-sae", str(args.d_sae), "--k", str(args.k),
           "--threads", str(args.threads)] + (["--baseline"] if baseline else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"the {context}-token run failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def fit_exponent(x, y) -> float:
    """p in y ~ x^p, least squares on logs."""
    return float(np.polyfit(np.log(np.asarray(x, float)), np.log(np.asarray(y, float)), 1)[0])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="256,512,1024,2048,4096", help="comma-separated context lengths")
    p.add_argument("--features", type=int, default=128, help="feature rows per graph (max_feature_nodes)")
    p.add_argument("--batch", type=int, default=16, help="targets per backward pass (copies of the prompt)")
    p.add_argument("--edges", type=int, default=2048, help="edges kept per row at most")
    p.add_argument("--d-sae", type=int, default=512)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=int, default=3600, help="seconds per context")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for context in contexts:
        base = run_child(context, args, baseline=True)
        row = run_child(context, args)
        row["baseline_mb"] = base["peak_mb"]
        row["graph_mb"] = row["peak_mb"] - base["peak_mb"]
        rows.append(row)
        print(f"{context:6d} tokens  {row['seconds']:8.1f} s  peak {row['peak_mb']:8.0f} MB  "
              f"(graph {row['graph_mb']:7.0f} MB over a {base['peak_mb']:.0f} MB baseline)  "
              f"{row['active_features']} active features, {row['feature_rows']} feature rows, {row['edges']} edges, "
              f"backward through {'stored patterns' if row['stored_patterns'] else 'frozen queries/keys'}", flush=True)
    if len(rows) > 1:
        ctx = [r["context"] for r in rows]
        print(f"fitted exponent, graph memory vs context: {fit_exponent(ctx, [max(r['graph_mb'], 1.0) for r in rows]):.2f}"
              f"  (peak RSS: {fit_exponent(ctx, [r['peak_mb'] for r in rows]):.2f};"
              f" time: {fit_exponent(ctx, [r['seconds'] for r in rows]):.2f})")
    return rows


if __name__ == "__main__":
    main()
