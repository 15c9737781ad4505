"""Steering speed, as ratios (interleaved medians; one run measures everything):
  - steered greedy decode of 128 tokens after 128: KV cache vs steered recompute, target >= 5x faster,
    outputs equal (the steering hook knows each decode step's absolute position)
  - a sweep of 8 scales: one batched steered generation vs 8 separate ones, target >= 3x faster,
    outputs equal; the forward-only sweep (one batched forward vs 8) is printed beside it

    python benchmarks/steering.py [--repeats 2] [--batch 1] [--decode-tokens 128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
import workbench as wb  # noqa: E402
from _timing import interleaved  # noqa: E402
from workbench import analysis as an  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="prompts per generation")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--sweep-tokens", type=int, default=32, help="new tokens per generation in the scale sweep")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = wb.ModelConfig.from_preset("nanogpt-bench")
    model = wb.HookedDecoder(cfg).eval()
    hook = f"blocks.{cfg.n_layers // 2}.hook_resid_post"
    tokens = torch.randint(0, cfg.d_vocab, (args.batch, cfg.n_ctx))
    prompt = tokens[:, : cfg.n_ctx - args.decode_tokens]
    direction = an.steering_vector(model, tokens[:, :16], torch.randint(0, cfg.d_vocab, (args.batch, 16)), hook)
    scales = [-8.0, -4.0, -2.0, 0.0, 2.0, 4.0, 8.0, 16.0]

    def steered(use_kv_cache: bool):
        with model.steer(direction, 4.0, positions="all"):
            return model.generate(prompt, max_new_tokens=args.decode_tokens, use_kv_cache=use_kv_cache)

    def unsteered():
        return model.generate(prompt, max_new_tokens=args.decode_tokens, use_kv_cache=True)

    def sweep(batched: bool):
        return an.steered_generate(model, prompt, direction, scales, max_new_tokens=args.sweep_tokens, batched=batched)

    def forward_sweep(batched: bool):
        return an.steering_sweep(model, tokens, direction, scales, batched=batched)

    outs: dict = {}
    with torch.no_grad():
        dec = interleaved({"kv_cache": lambda: steered(True), "recompute": lambda: steered(False),
                           "unsteered": unsteered}, args.repeats, outputs=outs)
        gen_sweep = interleaved({"batched": lambda: sweep(True), "separate": lambda: sweep(False)},
                                args.repeats, outputs=outs)
        sweep_outs: dict = {}
        fwd_sweep = interleaved({"batched": lambda: forward_sweep(True), "separate": lambda: forward_sweep(False)},
                                args.repeats, outputs=sweep_outs)
    decode_equal = torch.equal(outs["kv_cache"], outs["recompute"])
    sweep_equal = torch.equal(outs["batched"], outs["separate"])
    fwd_close = bool((sweep_outs["batched"].metric - sweep_outs["separate"].metric).abs().max() < 1e-4)

    rows = [
        ("steered decode, KV cache vs recompute", dec["recompute"] / dec["kv_cache"], ">= 5.0", 5.0, decode_equal),
        ("8-scale generation sweep, batched vs 8 runs", gen_sweep["separate"] / gen_sweep["batched"], ">= 3.0", 3.0,
         sweep_equal),
        ("8-scale forward sweep, batched vs 8 runs", fwd_sweep["separate"] / fwd_sweep["batched"], "(info)", None,
         fwd_close),
        ("steered / unsteered KV-cache decode time", dec["kv_cache"] / dec["unsteered"], "(info)", None, None),
    ]
    print(f"config: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, vocab {cfg.d_vocab}, "
          f"ctx {cfg.n_ctx}, batch {args.batch}; steering {hook} at every position; "
          f"torch threads {torch.get_num_threads()}")
    print(f"  decode {args.decode_tokens} tokens after {prompt.shape[1]}: kv-cache {dec['kv_cache']:.2f} s, "
          f"recompute {dec['recompute']:.2f} s, unsteered with the cache {dec['unsteered']:.2f} s")
    print(f"  sweep of {len(scales)} scales, {args.sweep_tokens} new tokens: batched {gen_sweep['batched']:.2f} s, "
          f"separate {gen_sweep['separate']:.2f} s; forward-only ({tokens.shape[1]} tokens): "
          f"batched {fwd_sweep['batched']:.2f} s, separate {fwd_sweep['separate']:.2f} s")
    print()
    print(f"{'measure':46} {'ratio':>7} {'target':>8}  met  outputs equal")
    for name, ratio, target, bound, equal in rows:
        met = "-" if bound is None else ("yes" if ratio >= bound else "NO")
        print(f"{name:46} {ratio:7.2f} {target:>8}  {met:>3}  {'' if equal is None else equal}")


if __name__ == "__main__":
    main()
