"""Forward-pass speed of the hooked model against a plain nanoGPT-style model, as ratios.

One run measures everything, interleaving the contenders so that machine noise hits both:
  - hooked forward with no hooks attached        target <= 1.10x the plain model
  - run_with_cache of every hook                  target <= 2.00x
  - greedy decode of 128 tokens after 128, batch 1: KV cache vs recompute, target >= 5x faster
It also measures the machine's matmul peak, so the forward's model-FLOPs utilisation is visible.

    python benchmarks/forward.py [--repeats 7] [--batch 8]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
import workbench as wb  # noqa: E402
from _timing import interleaved  # noqa: E402


class PlainBlock(nn.Module):
    def __init__(self, d: int, h: int, d_mlp: int):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, d_mlp), nn.Linear(d_mlp, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class PlainGPT(nn.Module):
    """nanoGPT's model, trimmed: the reference a hooked model is compared with."""

    def __init__(self, cfg: wb.ModelConfig):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.d_vocab, cfg.d_model), nn.Embedding(cfg.n_ctx, cfg.d_model)
        self.blocks = nn.ModuleList([PlainBlock(cfg.d_model, cfg.n_heads, cfg.d_mlp) for _ in range(cfg.n_layers)])
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T

    @torch.no_grad()
    def generate_recompute(self, idx, n):
        for _ in range(n):
            idx = torch.cat([idx, self(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return idx


def matmul_peak_gflops(d: int = 256, rows: int = 2048, repeats: int = 20) -> float:
    a, b = torch.randn(rows, d), torch.randn(d, 4 * d)
    t = interleaved({"matmul": lambda: a @ b}, repeats, warmup=False)["matmul"]
    return 2 * rows * d * 4 * d / t / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = wb.ModelConfig.from_preset("nanogpt-bench")
    hooked = wb.HookedDecoder(cfg).eval()
    plain = PlainGPT(cfg).eval()
    tokens = torch.randint(0, cfg.d_vocab, (args.batch, cfg.n_ctx))
    n_hooks = len(hooked.hook_dict)

    with torch.no_grad():
        fwd = interleaved(
            {
                "plain": lambda: plain(tokens),
                "hooked": lambda: hooked(tokens),
                "cache": lambda: hooked.run_with_cache(tokens),
            },
            args.repeats,
        )
    peak = matmul_peak_gflops()
    flops = wb.forward_flops_per_token(cfg, context=cfg.n_ctx // 2) * tokens.numel()  # causal: mean context n/2

    prompt = tokens[:1, : cfg.n_ctx - args.decode_tokens]
    with torch.no_grad():
        dec = interleaved(
            {
                "kv_cache": lambda: hooked.generate(prompt, max_new_tokens=args.decode_tokens, use_kv_cache=True),
                "recompute": lambda: hooked.generate(prompt, max_new_tokens=args.decode_tokens, use_kv_cache=False),
                "plain_recompute": lambda: plain.generate_recompute(prompt, args.decode_tokens),
            },
            max(1, args.repeats // 3),
        )
        same = torch.equal(
            hooked.generate(prompt, max_new_tokens=min(16, args.decode_tokens), use_kv_cache=True),
            hooked.generate(prompt, max_new_tokens=min(16, args.decode_tokens), use_kv_cache=False),
        )

    rows = [
        ("hooked forward, no hooks / plain", fwd["hooked"] / fwd["plain"], "<= 1.10", fwd["hooked"] / fwd["plain"] <= 1.10),
        (f"run_with_cache ({n_hooks} hooks) / plain", fwd["cache"] / fwd["plain"], "<= 2.00", fwd["cache"] / fwd["plain"] <= 2.0),
        ("decode speed-up, KV cache vs recompute", dec["recompute"] / dec["kv_cache"], ">= 5.0", dec["recompute"] / dec["kv_cache"] >= 5.0),
    ]
    print(f"config: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, d_mlp {cfg.d_mlp}, "
          f"vocab {cfg.d_vocab}, ctx {cfg.n_ctx}, batch {args.batch}; torch threads {torch.get_num_threads()}")
    print(f"matmul peak: {peak:.0f} GFLOP/s (fp32, {2048}x{cfg.d_model} @ {cfg.d_model}x{4 * cfg.d_model})")
    for name in ("plain", "hooked", "cache"):
        print(f"  {name:>8}: {fwd[name] * 1e3:8.1f} ms/forward  {tokens.numel() / fwd[name]:8.0f} tok/s  "
              f"MFU {flops / fwd[name] / 1e9 / peak:5.1%}")
    print(f"  decode {args.decode_tokens} tokens after {prompt.shape[1]}, batch 1: kv-cache {dec['kv_cache']:.2f} s, "
          f"recompute {dec['recompute']:.2f} s (plain model recompute {dec['plain_recompute']:.2f} s); "
          f"outputs identical: {same}")
    print()
    print(f"{'measure':44} {'ratio':>7} {'target':>8}  met")
    for name, ratio, target, ok in rows:
        print(f"{name:44} {ratio:7.2f} {target:>8}  {'yes' if ok else 'NO'}")
    if not math.isfinite(peak):
        raise SystemExit("matmul peak could not be measured")


if __name__ == "__main__":
    main()
