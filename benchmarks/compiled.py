"""Interventions at compiled speed: eager vs ``model.compile()``, each with no hook, one head
ablation, a steering vector, an SAE splice and caching every residual-stream hook, on the same
model and batch (interleaved medians; one run measures everything). Also printed: the seconds and
the graphs each first compiled call traced, whether attaching the same kind of hook at another
layer (or head) traces again, and whether going back to an earlier configuration is cached.

Targets (issue 23): compiled with an intervention >= 0.9x the throughput of compiled without it;
compiled with hooks faster than eager without; idle hooks free (compiled hooked model, nothing
attached, equals the compiled model: it is the same graph here).

    python benchmarks/compiled.py [--backend inductor|aot_eager|eager] [--layers 4] [--batch 4] [--pos 128]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
from _timing import add_model_args, interleaved, random_model  # noqa: E402
from workbench.analysis import Direction  # noqa: E402
from workbench.analysis.dictionaries import DictionaryConfig, make_dictionary  # noqa: E402
from workbench.analysis.splice import spliced  # noqa: E402
from workbench.compiled import compile_counters  # noqa: E402


def zero_head(layer: int, head: int):
    def hook(z, hook):
        z = z.clone()
        z[:, :, head] = 0
        return z
    return (f"blocks.{layer}.attn.hook_z", hook)


def interventions(model, args):
    """name -> a function running one forward of ``model`` under that intervention."""
    layer = args.layers // 2
    hook = f"blocks.{layer}.hook_resid_post"
    direction = Direction(torch.randn(args.d_model, generator=torch.Generator().manual_seed(1)), hook)
    sae = make_dictionary(DictionaryConfig(kind="topk", d_in=args.d_model, d_sae=4 * args.d_model, k=32,
                                           hook_name=hook))
    sae.init_weights(torch.Generator().manual_seed(2))
    residual = [n for n in model.hook_dict if n.split(".")[-1] in ("hook_resid_pre", "hook_resid_mid",
                                                                   "hook_resid_post")]
    tokens = torch.randint(0, args.vocab, (args.batch, args.pos), generator=torch.Generator().manual_seed(0))

    def none():
        return model(tokens)

    def ablation():
        with model.hooks(fwd_hooks=[zero_head(layer, 1)]):
            return model(tokens)

    def steering():
        with model.steer(direction, 4.0):
            return model(tokens)

    def sae_splice():
        with spliced(model, sae):
            return model(tokens)

    def cache():
        return model.run_with_cache(tokens, names_filter=lambda n: n in residual)[0]

    return {"no hook": none, "one ablation": ablation, "steering vector": steering, "SAE splice": sae_splice,
            f"cache {len(residual)} resid hooks": cache}, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, d_model=256, vocab=4096, batch=4, pos=128)
    parser.add_argument("--backend", default="inductor")
    parser.set_defaults(layers=4, threads=1)
    args = parser.parse_args()
    eager = random_model(args)
    compiled = random_model(args).compile(backend=args.backend)
    eager_fns, tokens = interventions(eager, args)
    compiled_fns, _ = interventions(compiled, args)
    print(f"model: d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}; batch {args.batch} x "
          f"{args.pos}; {args.threads} thread(s); backend {args.backend}; torch {torch.__version__}")
    print("\nfirst compiled call of each intervention (traces and compiles it):")
    with torch.no_grad():
        for name, fn in compiled_fns.items():
            before = compile_counters()["graphs"]
            start = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - start
            err = (out - eager_fns[name]()).abs().max().item()
            print(f"  {name:<22} {seconds:7.1f} s  graphs traced {compile_counters()['graphs'] - before}  "
                  f"max |compiled - eager| {err:.1e}")
        for what, hook in (("ablation at another layer", zero_head(args.layers // 2 + 1, 1)),
                           ("ablation at another head", zero_head(args.layers // 2, 2)),
                           ("a third head (cached?)", zero_head(args.layers // 2, 3)),
                           ("the first ablation again", zero_head(args.layers // 2, 1))):
            before = compile_counters()["graphs"]
            start = time.perf_counter()
            with compiled.hooks(fwd_hooks=[hook]):
                compiled(tokens)
            print(f"  {what:<26} {time.perf_counter() - start:6.1f} s  graphs traced "
                  f"{compile_counters()['graphs'] - before}")
        fns = {**{("eager", n): f for n, f in eager_fns.items()}, **{("compiled", n): f for n, f in compiled_fns.items()}}
        times = interleaved(fns, args.repeats)
    base = times[("eager", "no hook")]
    compiled_base = times[("compiled", "no hook")]
    print(f"\nforward time relative to eager with no hook ({base * 1e3:.1f} ms), interleaved medians of {args.repeats}:")
    print(f"  {'intervention':<24}{'eager':>8}{'compiled':>10}{'compiled vs compiled, no hook':>32}")
    for name in eager_fns:
        e, c = times[("eager", name)], times[("compiled", name)]
        print(f"  {name:<24}{e / base:8.2f}{c / base:10.2f}{compiled_base / c:>26.2f}x throughput")
    print(f"\ngraphs traced in all: {compile_counters()['graphs']}; graph breaks: {compile_counters()['graph_breaks']}")


if __name__ == "__main__":
    main()
