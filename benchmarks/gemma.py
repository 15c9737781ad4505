"""What Gemma's options cost in the forward pass, as ratios against the same model without them.

Attention soft-capping has no SDPA form, so a soft-capped layer materialises the
[batch, head, query, key] scores (the explicit path); a sliding window only changes SDPA's mask,
and shrinks the KV cache (printed after the timings).
Contenders run interleaved (``_timing.interleaved``), medians:

    python benchmarks/gemma.py [--repeats 7] [--batch 8] [--seq 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
import workbench as wb  # noqa: E402
from _timing import interleaved  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    base = wb.ModelConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_vocab=4096, n_ctx=args.seq, norm="rmsnorm",
                          positional="rope", ffn="swiglu", bias=False, seed=0)
    variants = {
        "plain (SDPA)": base,
        "sliding window 64 (SDPA, masked)": base.replace(sliding_window=64),
        "attention soft-cap (explicit)": base.replace(attn_logit_softcap=50.0),
        "Gemma 2 style (all options)": base.replace(norm="gemma_rmsnorm", norm_placement="sandwich", ffn="geglu_tanh",
                                                    attn_logit_softcap=50.0, final_logit_softcap=30.0, sliding_window=64,
                                                    global_every=2, query_pre_attn_scalar=32.0, scale_embeddings=True),
    }
    tokens = torch.randint(0, base.d_vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    models = {name: wb.HookedDecoder(cfg).eval() for name, cfg in variants.items()}

    def forward(model):
        return lambda: model(tokens)

    with torch.no_grad():
        times = interleaved({name: forward(m) for name, m in models.items()}, args.repeats)
    plain = times["plain (SDPA)"]
    print(f"forward, batch {args.batch} x {args.seq} tokens, d_model 256, 4 layers, {torch.get_num_threads()} threads")
    for name, t in times.items():
        print(f"  {name:36s} {t * 1e3:8.1f} ms  {t / plain:5.2f}x")
    # a sliding layer's KV cache holds the window, not the context (the cache allocates exactly this)
    print(f"KV cache for batch {args.batch} x {args.seq} positions (bf16)")
    full = wb.kv_cache_bytes(base, args.seq, args.batch)
    for name, cfg in variants.items():
        size = wb.kv_cache_bytes(cfg, args.seq, args.batch)
        print(f"  {name:36s} {size / 2**20:8.2f} MiB {size / full:5.2f}x")


if __name__ == "__main__":
    main()
