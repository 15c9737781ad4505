"""Parameter counts: the seeds' closed form N = V d + L (12 d^2 + 2 d) + d against the exact
count (the model's own parameter list, built on the meta device) for every preset,
GPT-3 175B included. The gap is explained by what the closed form leaves out:
positional tables, biases, d_mlp != 4 d, gated FFNs, GQA, untied heads, LayerNorm biases.

The counts are exact functions of the configs: no seed changes them, so ``--seeds`` (taken,
like every experiment's flags) runs the table once; its intervals would have zero width.
"""

from __future__ import annotations

import _common
import pandas as pd
import plotly.graph_objects as go

NAME = "param_table"


def main(argv=None) -> pd.DataFrame:
    args = _common.parser(NAME, __doc__).parse_args(argv)
    _common.setup(args)
    import workbench as wb

    presets = wb.ModelConfig.presets()
    if args.quick:
        presets = [p for p in presets if p in ("gpt2-small", "gpt3-175b", "llama-style-tiny")]

    def one(name: str):
        cfg = wb.ModelConfig.from_preset(name)
        exact = wb.count_params(cfg)
        seed = wb.seed_param_formula(cfg)
        yield {"preset": name, "d_model": cfg.d_model, "n_layers": cfg.n_layers, "d_vocab": cfg.d_vocab,
               "exact": exact["total"], "seed_formula": seed, "difference": exact["total"] - seed,
               "relative": (exact["total"] - seed) / exact["total"], "positional": exact["positional"],
               "untied_head": exact["unembedding"], "d_mlp_over_d": cfg.d_mlp / cfg.d_model,
               "n_kv_heads": cfg.n_kv_heads, "ffn": cfg.ffn}

    results = _common.run_grid(presets, one, desc="presets")
    if results is None:
        return None
    fig = go.Figure(go.Bar(x=results.preset, y=100 * results.relative,
                           hovertemplate="%{x}<br>exact - formula: %{y:.2f}% of exact<extra></extra>"))
    fig.update_layout(title="Seed closed form vs exact parameter count", yaxis_title="(exact - formula) / exact, %",
                      template="plotly_white")
    summary = results[["preset", "exact", "seed_formula", "difference", "relative"]]
    _common.write_run(args.out, {"experiment": NAME, **vars(args)}, results, {"relative_difference": fig}, summary)
    return results


if __name__ == "__main__":
    main()
