"""Prompts of different lengths: one padded batch against the same prompts one at a time, and
against an unpadded batch of equal-length prompts holding the same number of real tokens.

Prompt lengths spread evenly from 25% to 100% of the longest, so about 37% of a padded batch
is padding. Two model sizes: the shipped stories checkpoint's architecture with IOI-sized
prompts (6-24 tokens), and nanogpt-bench with 16-64 tokens. Printed as ratios, interleaved
so that machine noise hits every contender alike:
  - padded batch vs one at a time                     target >= 5x faster
  - cost per real token, padded vs unpadded batch     target <= 1.3x
  - (shown) the same prompts sorted by length into 4 batches, and the padded batch with a
    hook attached (pads then go through every step: nothing is packed)
It also checks that the padded batch's logits equal the prompts' alone.

    python benchmarks/batches.py [--repeats 5] [--batch 32] [--threads 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, no install needed
import workbench as wb  # noqa: E402
from _timing import interleaved  # noqa: E402


def measure(name: str, cfg: wb.ModelConfig, longest: int, batch: int, repeats: int) -> list[tuple]:
    model = wb.HookedDecoder(cfg).eval()
    lengths = torch.linspace(longest / 4, longest, batch).round().long().tolist()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.d_vocab, (n,), generator=gen).tolist() for n in lengths]
    padded = wb.TokenBatch.from_ids(prompts, padding_side="left")
    n_real = sum(lengths)
    unpadded = torch.randint(0, cfg.d_vocab, (batch, round(n_real / batch)), generator=gen)
    alone = [torch.tensor([p]) for p in prompts]
    by_length = sorted(prompts, key=len)
    per = -(-batch // 4)
    sorted_batches = [wb.TokenBatch.from_ids(by_length[i : i + per], padding_side="left") for i in range(0, batch, per)]
    listen = [("blocks.0.hook_resid_pre", lambda x, hook: None)]

    with torch.no_grad():
        t = interleaved(
            {
                "padded": lambda: model(padded),
                "one at a time": lambda: [model(a) for a in alone],
                "unpadded": lambda: model(unpadded),
                "sorted": lambda: [model(b) for b in sorted_batches],
                "padded, hooked": lambda: model.run_with_hooks(padded, fwd_hooks=listen),
            },
            repeats,
        )
        logits = model(padded)
        diff = max((logits[i][padded.attention_mask[i].bool()] - model(a)[0]).abs().max().item()
                   for i, a in enumerate(alone))

    print(f"{name}: d_model {cfg.d_model}, {cfg.n_layers} layers, vocab {cfg.d_vocab}; {batch} prompts of "
          f"{min(lengths)}-{max(lengths)} tokens, {n_real} real, {1 - n_real / padded.tokens.numel():.0%} of the "
          f"padded batch is padding; max |logit diff| padded vs alone {diff:.1e}")
    for key, value in t.items():
        print(f"  {key:>15}: {value * 1e3:8.1f} ms  {n_real / value:8.0f} real tok/s")
    speedup, per_token = t["one at a time"] / t["padded"], t["padded"] / t["unpadded"]
    return [
        (f"{name}: padded batch speed-up vs one at a time", speedup, ">= 5.0", speedup >= 5.0),
        (f"{name}: cost per real token, padded / unpadded", per_token, "<= 1.30", per_token <= 1.3),
        (f"{name}: ... 4 length-sorted batches / unpadded", t["sorted"] / t["unpadded"], "", None),
        (f"{name}: ... padded with a hook (unpacked) / unpadded", t["padded, hooked"] / t["unpadded"], "", None),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    stories = wb.ModelConfig.from_json(ROOT / "checkpoints" / "stories-2026" / "config.json")
    print(f"torch threads {torch.get_num_threads()}")
    rows = measure("stories-2026", stories, 24, args.batch, args.repeats)
    rows += measure("nanogpt-bench", wb.ModelConfig.from_preset("nanogpt-bench", n_ctx=64), 64, args.batch, args.repeats)
    print()
    print(f"{'measure':58} {'ratio':>7} {'target':>8}  met")
    for name, ratio, target, ok in rows:
        print(f"{name:58} {ratio:7.2f} {target:>8}  {'' if ok is None else 'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
