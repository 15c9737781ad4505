"""MLA decode against GQA at the same d_model: KV-cache bytes per token and decode tokens/s, as ratios.

Both models have the same width, depth, heads, SwiGLU MLP and RoPE; GQA shares each key/value
head among ``n_heads / n_kv_heads`` query heads, MLA (DeepSeek-V2/V3 multi-head latent attention,
its default kv_lora_rank = 4 d_head, qk_rope_head_dim = d_head / 2) caches one normed latent and one
shared RoPE key per token and layer and decodes on the latent (W_UK absorbed into the query, W_UV
into the output). Greedy decode with the KV cache, timed interleaved so machine noise hits both.
The MLA greedy tokens are checked against its recompute (no cache) before anything is timed.

    python benchmarks/mla.py [--d-model 1024] [--n-heads 16] [--n-kv-heads 4] [--layers 4] [--batch 8]
                             [--prompt 256] [--new-tokens 64] [--repeats 5] [--device cpu|cuda] [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
import workbench as wb  # noqa: E402
from _timing import interleaved  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    common = dict(d_model=args.d_model, n_layers=args.layers, n_heads=args.n_heads, d_vocab=4096,
                  n_ctx=args.prompt + args.new_tokens, positional="rope", norm="rmsnorm", ffn="swiglu", bias=False, seed=0)
    configs = {"gqa": wb.ModelConfig(n_kv_heads=args.n_kv_heads, **common), "mla": wb.ModelConfig(attention="mla", **common)}
    models = {k: wb.HookedDecoder(c).to(args.device, dtype).eval() for k, c in configs.items()}
    prompt = torch.randint(0, 4096, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0)).to(args.device)
    mla = models["mla"]
    check = prompt[:1, :32]
    same = bool(mla.generate(check, max_new_tokens=16).equal(mla.generate(check, max_new_tokens=16, use_kv_cache=False)))
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    seconds = interleaved({k: (lambda m=m: m.generate(prompt, max_new_tokens=args.new_tokens)) for k, m in models.items()},
                          args.repeats, sync=sync)
    tokens = args.batch * args.new_tokens
    out = {}
    for k, cfg in configs.items():
        out[k] = dict(kv_bytes_per_token=wb.kv_cache_bytes_per_token(cfg, torch.finfo(dtype).bits // 8),
                      tokens_per_s=tokens / seconds[k], params=wb.count_params(cfg)["total"])
    mla_cfg = configs["mla"]
    print(f"device {args.device}, {args.dtype}; d_model {args.d_model}, {args.layers} layers, {args.n_heads} heads; "
          f"GQA n_kv_heads={args.n_kv_heads}; MLA kv_lora_rank={mla_cfg.kv_lora_rank}, "
          f"qk_rope_head_dim={mla_cfg.qk_rope_head_dim}; batch {args.batch}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, median of {args.repeats}")
    print(f"MLA cached greedy tokens equal its recompute: {same}")
    for k in ("gqa", "mla"):
        print(f"  {k.upper():3s}  KV bytes/token {out[k]['kv_bytes_per_token']:>7d}   decode {out[k]['tokens_per_s']:9.1f} tok/s"
              f"   params {out[k]['params'] / 1e6:.1f}M")
    out["ratios"] = dict(kv_bytes=out["mla"]["kv_bytes_per_token"] / out["gqa"]["kv_bytes_per_token"],
                         tokens_per_s=out["mla"]["tokens_per_s"] / out["gqa"]["tokens_per_s"])
    print(f"MLA / GQA: KV bytes per token {out['ratios']['kv_bytes']:.3f}x, decode tokens/s "
          f"{out['ratios']['tokens_per_s']:.2f}x")
    return out


if __name__ == "__main__":
    main()
