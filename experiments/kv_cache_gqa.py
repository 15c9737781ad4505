"""KV-cache size and decode speed as n_kv_heads goes from n_heads (MHA) through GQA to 1 (MQA), and MLA.

For each n_kv_heads dividing n_heads: KV-cache bytes per token (bf16, from the config alone),
the cache for the whole context and batch, parameter count, and greedy decode tokens/s with
the KV cache (random weights: speed does not depend on them). The MLA row (multi-head latent
attention at the same d_model and heads, its default kv_lora_rank = 4 d_head and qk_rope_head_dim
= d_head / 2) caches one latent and one shared RoPE key per token and layer, and decodes on the latent. Bytes and parameters follow
from the config; the speed is a measurement, so ``--seeds N`` repeats it N times (seed ``s``:
its weights and prompt) and the summary gives its mean and 95% interval.
"""

from __future__ import annotations

import time

import _common
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

NAME = "kv_cache_gqa"


def main(argv=None) -> pd.DataFrame:
    p = _common.parser(NAME, __doc__)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.n_heads, args.n_layers, args.batch, args.prompt, args.new_tokens = 32, 4, 1, 2, 4, 4
    _common.setup(args)
    import workbench as wb

    kv_choices = [k for k in range(args.n_heads, 0, -1) if args.n_heads % k == 0] + ["mla"]

    def one(item):
        n_kv, seed = item
        mla = n_kv == "mla"
        cfg = wb.ModelConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                             n_kv_heads=None if mla else n_kv, attention="mla" if mla else "mha",
                             d_vocab=512, n_ctx=args.prompt + args.new_tokens, positional="rope", norm="rmsnorm",
                             ffn="swiglu", bias=False, seed=seed)
        n_kv = cfg.n_kv_heads
        model = wb.HookedDecoder(cfg).eval()
        prompt = torch.randint(0, cfg.d_vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(seed))
        model.generate(prompt, max_new_tokens=2)  # warm-up
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=args.new_tokens, use_kv_cache=True)
        seconds = time.perf_counter() - start
        per_token = wb.kv_cache_bytes_per_token(cfg)
        yield {"n_heads": cfg.n_heads, "n_kv_heads": n_kv, "seed": seed, "kind": "MLA" if mla else "MHA" if n_kv == cfg.n_heads else "MQA" if n_kv == 1 else "GQA",
               "kv_bytes_per_token": per_token, "kv_cache_mib": per_token * cfg.n_ctx * args.batch / 2**20,
               "params": wb.count_params(cfg)["total"], "decode_tokens_per_s": args.batch * args.new_tokens / seconds}

    results = _common.run_grid([(n_kv, seed) for seed in _common.seeds(args) for n_kv in kv_choices], one,
                               desc="n_kv_heads x seeds")
    if results is None:
        return None
    results["label"] = [f"{kind} {n}" if kind != "MLA" else "MLA" for kind, n in zip(results.kind, results.n_kv_heads)]
    results["is_mla"] = results.kind == "MLA"
    results = results.sort_values(["is_mla", "n_kv_heads", "seed"], ascending=[True, False, True],
                                  kind="stable").drop(columns="is_mla").reset_index(drop=True)
    results["cache_vs_mha"] = results.kv_bytes_per_token / results.kv_bytes_per_token[results.kind == "MHA"].iloc[0]
    numbers, readable = _common.with_intervals(results, ["label", "n_kv_heads", "kind", "kv_bytes_per_token", "kv_cache_mib",
                                                         "params", "cache_vs_mha"], ["decode_tokens_per_s"], digits=4)
    mean = numbers.decode_tokens_per_s_mean
    fig = make_subplots(rows=1, cols=2, subplot_titles=("KV cache bytes per token", "decode tokens/s (mean, 95% interval)"))
    fig.add_trace(go.Bar(x=numbers.label, y=numbers.kv_bytes_per_token, name="bytes/token"), 1, 1)
    fig.add_trace(go.Bar(x=numbers.label, y=mean, name="tokens/s", error_y=dict(
        type="data", symmetric=False, array=(numbers.decode_tokens_per_s_high - mean).fillna(0),
        arrayminus=(mean - numbers.decode_tokens_per_s_low).fillna(0))), 1, 2)
    fig.update_xaxes(title="attention (n_kv_heads)")
    fig.update_layout(title="KV sharing: memory and decode speed", template="plotly_white", showlegend=False)
    _common.write_run(args.out, {"experiment": NAME, **vars(args)}, results, {"kv_cache_gqa": fig}, readable,
                      title=f"KV sharing; decode tokens/s: mean [95% interval] over {len(_common.seeds(args))} seed(s)",
                      tables={"summary": numbers})
    return results


if __name__ == "__main__":
    main()
