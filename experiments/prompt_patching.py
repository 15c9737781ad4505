"""Activation patching and attribution patching over a prompt file: which residual streams and
heads carry the clean answer, averaged over the prompt set, with 95% intervals over the pairs.

``--prompts FILE`` (CSV or JSONL) gives ``prompt`` (clean), ``corrupted``, ``answer`` and
``wrong`` per row, plus any columns (``pos_IO``, ``pos_S2``, ... name positions per row, as
``PromptSet.from_task`` writes them). Clean and corrupted prompts may tokenize to different
lengths: positions are aligned per row (``--positions -2,-1`` from each prompt's end, or names
such as ``S2,END``; a name counts in the clean prompt, ``corrupted_pos_<NAME>`` overrides it for
the corrupted one), and a row that lacks a position is refused by name. Each pair is scored as
if it ran alone: the logit difference answer - wrong at the last token.

results.csv: one row per patch and pair (``effect`` = patched metric - corrupted metric; for
heads also ``attribution``, attribution patching's estimate of the same effect), with the
file's columns; summary.csv: each patch's mean and interval over the pairs.

    python experiments/prompt_patching.py --checkpoint checkpoints/stories-2026 --prompts ioi.csv --positions S2,END
"""

from __future__ import annotations

import _common
import pandas as pd

NAME = "prompt_patching"
# --quick without a file: IOI-like pairs whose corrupted prompts are sometimes longer or shorter.
QUICK = [
    ("When Mary and John went to the store , John gave a drink to", "When Mary and John went to the store , "
     "the tall Anna gave a drink to", "Mary", "John", 12),
    ("Then Anne and Bob talked ; Bob handed a book to", "Then Anne and Bob talked ; Tom handed a book to",
     "Anne", "Bob", 6),
    ("After Tom and Kate met , Kate gave a cup to", "After Tom and Kate met , Sam gave a cup to", "Tom", "Kate", 6),
    ("When Sam and Lily left , Lily sent a note to", "When Sam and Lily left , Bob sent it to", "Sam", "Lily", 6),
]


def main(argv=None) -> pd.DataFrame:
    p = _common.parser(NAME, __doc__)
    p.add_argument("--checkpoint", type=_common.Path, default=None,
                   help="default: checkpoints/stories-2026 (--quick: a random tiny model reading the file's words)")
    p.add_argument("--prompts", type=_common.Path, default=None, help="the prompt pairs (.csv or .jsonl)")
    p.add_argument("--positions", default=None,
                   help="comma-separated positions: ints from the start (0) or end (-1), or names (S2, IO, END); "
                        "default: every position when all prompts are equally long, else S2,END (--quick: -2,END)")
    p.add_argument("--batch", type=int, default=32, help="pairs per batch")
    args = p.parse_args(argv)
    _common.setup(args)
    import workbench as wb
    from workbench import viz
    from workbench.analysis import activation_patching, attribution_patching

    if args.prompts is not None:
        prompts = _common.read_prompts(args.prompts)
    elif args.quick:
        prompts = wb.PromptSet.from_records([{"prompt": c, "corrupted": k, "answer": a, "wrong": w, "pos_S2": s}
                                             for c, k, a, w, s in QUICK])
    else:
        raise SystemExit("--prompts FILE is needed (a .csv or .jsonl of prompt, corrupted, answer, wrong)")
    if prompts.corrupted is None or prompts.answers is None or prompts.wrong is None:
        raise SystemExit(f"--prompts {args.prompts}: patching needs the columns corrupted, answer and wrong")
    model, source = _common.model_for_prompts(args, prompts, _common.REPO / "checkpoints" / "stories-2026")
    model.eval()
    positions = _positions(args, prompts, model)
    patched = activation_patching(model, prompts, sites=("resid_pre", "head"), positions=positions,
                                  batch_size=args.batch, progress=True, per_prompt=True)
    patched["effect"] = patched["metric"] - patched["corrupted"]
    estimate = attribution_patching(model, prompts, positions=positions, batch_size=args.batch, progress=True,
                                    per_prompt=True)[["layer", "head", "prompt", "attribution"]]
    results = patched.merge(estimate.assign(site="head"), on=["site", "layer", "head", "prompt"], how="left")
    numbers, readable = _common.with_intervals(results, ["site", "layer", "pos", "head"],
                                               ["effect", "attribution"])
    heads = numbers[numbers.site == "head"]
    # the figure's table: mean effects, positions as labels (ints and names side by side)
    mean = numbers.rename(columns={"effect_mean": "metric"}).assign(pos=lambda f: f["pos"].astype(str))
    mean["corrupted"], mean["clean"] = patched["corrupted"].mean(), patched["clean"].mean()
    figures = {"resid_pre": viz.patching_figure(mean, "resid_pre"),
               "heads": viz.layer_head_figure(heads, "effect_mean", units="Δ logit difference",
                                              title=f"Patching each head ({source}; mean over {len(prompts)} pairs)")}
    order = numbers["effect_mean"].abs().sort_values(ascending=False).index[:10]
    _common.write_run(args.out, {"experiment": NAME, **vars(args), "source": source, "n_prompts": len(prompts),
                                 "positions": positions}, results, figures, readable.loc[order].reset_index(drop=True),
                      title=f"largest patching effects ({source}): mean [95% interval] over {len(prompts)} pairs",
                      tables={"summary": numbers})
    return results


def _positions(args, prompts, model):
    """--positions as a list (ints stay ints), or the default."""
    if args.positions:
        return [int(p) if p.lstrip("-").isdigit() else p for p in args.positions.split(",") if p]
    if args.quick:
        return [-2, "END"]
    tok = model.tokenizer
    lengths = {len(tok.encode(t)) for t in [*prompts.clean, *prompts.corrupted]}
    if len(lengths) == 1:
        return None
    return ["S2", "END"] if "pos_S2" in prompts.meta.columns else [-2, -1]


if __name__ == "__main__":
    main()
