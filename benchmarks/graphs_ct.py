"""Attribution graphs side by side with circuit-tracer 0.5: the same model, the same transcoders, edge by edge.

    python benchmarks/graphs_ct.py                         # contexts 64 and 256
    python benchmarks/graphs_ct.py --contexts 64 --ct-python /work/ctvenv/bin/python
    python benchmarks/graphs_ct.py --contexts 64 --config gpt2 --conventions circuit-tracer

circuit-tracer cannot share the workbench's environment (it pins transformers <= 4.57.3 and
huggingface-hub < 1 and builds on TransformerLens 3), so it runs in a venv of its own and the two
sides exchange files only. Create that venv once (torch first, so pip keeps the CPU build):

    python3 -m venv /work/ctvenv && /work/ctvenv/bin/pip install torch==2.13.0 \\
        && /work/ctvenv/bin/pip install circuit-tracer==0.5.0

What runs (``--out``, default ``runs/graphs_ct``):
1. A random Llama-shaped HookedDecoder (4 layers, d_model 128, 4 heads of 32, SwiGLU 512, RMSNorm
   pre-norm with unit weights, RoPE on all 32 head dimensions, untied unembedding, no biases) and
   one TopK-16 skip-transcoder of 512 features per MLP, seeded; the prompt is random tokens after a
   special token (circuit-tracer prepends one to any prompt that lacks it). Exported as files: the weights
   under HookedTransformer's names (``W_Q`` [heads, d_model, d_head] etc., as ours), its config
   (``RMSPre`` with our eps, ``rotary`` half-split as ours), the transcoders in circuit-tracer's
   own format (``save_circuit_tracer``) and the prompt's tokens.
2. The weight mapping is proven first: circuit-tracer's model's logits on the prompt against ours
   (max |difference| < 1e-4, else the script stops).
3. For each context, in subprocesses of their own (so each peak resident memory is that graph's
   process alone): circuit-tracer's ``attribute`` (``_ct_side.py``) and ours
   (``an.attribution_graph``). circuit-tracer zeroes position 0's features and error vectors (it
   treats the first token as a constant); our graph keeps them as nodes, so they are left out of
   the comparison. Then:
   max |adjacency difference| over all (target, source) pairs, the feature sets, the pruned node
   sets (0.8 / 0.98, each library's own pruning), both libraries' ``compute_graph_scores`` /
   ``graph.scores()`` and the ratios of time and peak memory.

``--config gpt2``: the GPT-2 shape instead (LayerNorm pre-norm with unit weights and zero biases,
circuit-tracer's side ``LNPre``; learned position embeddings; a GELU MLP of 512; the same sizes,
transcoders and prompt). ``--conventions circuit-tracer`` builds our graph with
``token_embedding="token", held_positions=1``, circuit-tracer's own (token nodes carry W_E alone,
position 0 has no feature or error nodes); the default, ``workbench``, keeps our defaults. On the
Llama shape (RoPE) the two differ only at position 0, which the comparison leaves out.

Without ``an.attribution_graph`` (or with ``--ct-only``) only circuit-tracer's side runs and its
adjacency and timings are written, for a later comparison (``--compare-only`` redoes step 3's
arithmetic on what is already in ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, no install needed

N_LAYERS, D_MODEL, N_HEADS, D_HEAD, D_MLP, D_VOCAB = 4, 128, 4, 32, 512, 160
# d_vocab differs from d_model on purpose: circuit-tracer 0.5 tells the unembedding's orientation by
# matching a side against d_vocab (attribution/targets.py), and takes rows for columns when the two are equal.
D_SAE, K, EPS = 512, 16, 1e-5
# circuit-tracer's venv, the one place its path is named (real_model.py imports it from here)
CT_VENV = "/work/ctvenv"
DEFAULT_CT_PYTHON = f"{CT_VENV}/bin/python"
BOS = 1  # the bos_token of _ct_side.py's WordLevel tokenizer (t1)


CONVENTIONS = {"workbench": {}, "circuit-tracer": dict(token_embedding="token", held_positions=1)}


def build(n_ctx: int, seed: int = 0, config: str = "llama"):
    """The model, its transcoders and a prompt of ``n_ctx`` tokens, all from ``seed``."""
    import torch

    import workbench as wb
    from workbench.analysis.dictionaries import DictionaryConfig, make_dictionary

    shape = (dict(norm="rmsnorm", positional="rope", rotary_dim=D_HEAD, ffn="swiglu", name="llama-shaped-random")
             if config == "llama" else dict(norm="layernorm", positional="learned", ffn="gelu",
                                              name="gpt2-shaped-random"))
    cfg = wb.ModelConfig(d_model=D_MODEL, n_layers=N_LAYERS, n_heads=N_HEADS, d_head=D_HEAD, d_mlp=D_MLP,
                         d_vocab=D_VOCAB, n_ctx=n_ctx, norm_eps=EPS, tie_embeddings=False, bias=False, qkv_bias=False,
                         seed=seed, **shape)
    model = wb.HookedDecoder(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".w", ".b")):  # norm weights stay 1, biases 0: circuit-tracer's side is RMSPre / LNPre
                continue
            p.copy_(torch.rand(p.shape, generator=g) * 0.2 - 0.1)
    tcs = []
    for layer in range(N_LAYERS):
        tc = make_dictionary(DictionaryConfig(kind="skip_transcoder", d_in=D_MODEL, d_sae=D_SAE, d_out=D_MODEL, k=K,
                                              hook_name=f"blocks.{layer}.ln2.hook_normalized",
                                              hook_name_out=f"blocks.{layer}.hook_mlp_out"))
        with torch.no_grad():
            for p in tc.parameters():
                p.copy_(torch.rand(p.shape, generator=g) * 0.2 - 0.1)
        tcs.append(tc.eval())
    tokens = torch.randint(4, D_VOCAB, (n_ctx,), generator=g)
    tokens[0] = BOS  # a special token first, or circuit-tracer prepends one and the prompts differ
    return model, tcs, tokens


def tl_state_dict(model) -> dict:
    """Our weights under HookedTransformer 3's names (the layouts already agree). A GQA model keeps TL's grouped
    ``_W_K`` / ``_W_V`` names; for MHA they are ``W_K`` / ``W_V``. A bias-free model gets TL's biases as zeros."""
    import torch

    c = model.cfg
    kv = c.n_kv_heads or c.n_heads
    k = "_" if kv != c.n_heads else ""
    rename = {"unembed.W_U_param": "unembed.W_U"}
    if not k:
        rename.update({"._W_K": ".W_K", "._W_V": ".W_V", "._b_K": ".b_K", "._b_V": ".b_V"})
    out = {}
    for name, value in model.state_dict().items():
        if name.endswith((".ln1.w", ".ln2.w", "ln_final.w", ".ln1.b", ".ln2.b", "ln_final.b")) or ".b_gate" in name:
            continue  # RMSPre / LNPre have no weight (or bias); the bias-free gated MLP's b_gate is zero and TL has none
        if name == "embed.W_E_T":
            continue  # a tied model's unembedding: written as unembed.W_U below
        for a, b in rename.items():
            name = name.replace(a, b)
        out[name] = value.detach().float().contiguous()
    out["unembed.W_U"] = model.W_U.detach().float().contiguous()
    out["unembed.b_U"] = torch.zeros(c.d_vocab)
    for layer in range(c.n_layers):  # a bias-free model: HookedTransformer still has its biases, all zero
        zeros = {"attn.b_Q": (c.n_heads, c.d_head), f"attn.{k}b_K": (kv, c.d_head), f"attn.{k}b_V": (kv, c.d_head),
                 "attn.b_O": (c.d_model,), "mlp.b_in": (c.d_mlp,), "mlp.b_out": (c.d_model,)}
        for name, shape in zeros.items():
            out.setdefault(f"blocks.{layer}.{name}", torch.zeros(shape))
    return out


def export(model, tcs, tokens, exchange: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from workbench.analysis.dictionaries.circuit_tracer import save_circuit_tracer

    exchange.mkdir(parents=True, exist_ok=True)
    c = model.cfg
    norms = [n for b in model.blocks for n in (b.ln1, b.ln2)] + [model.ln_final]
    assert all(bool((n.w == 1).all()) and bool((getattr(n, "b", torch.zeros(1)) == 0).all()) for n in norms)
    spec = dict(n_layers=c.n_layers, d_model=c.d_model, n_ctx=c.n_ctx, d_head=c.d_head, n_heads=c.n_heads,
                d_mlp=c.d_mlp, d_vocab=c.d_vocab, eps=c.norm_eps, default_prepend_bos=False)
    if c.positional == "rope":
        spec.update(act_fn="silu", normalization_type="RMSPre", positional_embedding_type="rotary",
                    rotary_dim=c.rotary_dim, rotary_base=int(c.rope_base), rotary_adjacent_pairs=bool(c.rotary_interleaved),
                    gated_mlp=True, final_rms=True, original_architecture="LlamaForCausalLM")
    else:
        spec.update(act_fn="gelu", normalization_type="LNPre", positional_embedding_type="standard", gated_mlp=False,
                    original_architecture="GPT2LMHeadModel")
    (exchange / "model.json").write_text(json.dumps(spec, indent=1))
    save_file(tl_state_dict(model), str(exchange / "model.safetensors"))
    save_circuit_tracer(tcs, exchange / "transcoders", model=None, scan="graphs-ct-random", dtype=torch.float32)
    (exchange / "tokens.json").write_text(json.dumps(tokens.tolist()))


from _memory import peak_mb  # noqa: E402  (the benchmarks' folder is on sys.path: the script's own)


def child_ours(args) -> None:
    """Our graph of the first ``--context`` tokens, in circuit-tracer's node order, with time and memory."""
    import torch
    from safetensors.torch import save_file

    from workbench import analysis as an

    torch.set_num_threads(args.threads)
    model, tcs, tokens = build(args.max_context, args.seed, args.config)
    prompt = tokens[: args.context]
    before = peak_mb()
    start = time.perf_counter()
    graph = an.attribution_graph(model, tcs, prompt, batch_size=args.batch_size, **CONVENTIONS[args.conventions])
    seconds = time.perf_counter() - start
    after = peak_mb()
    pruned = graph.prune_masks(0.8, 0.98)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"kind": graph.kind.long(), "layer": graph.layer.long(), "pos": graph.pos.long(),
               "feature": graph.feature.long(), "activation": graph.activation.float(),
               "edge_target": graph.edge_target.long(), "edge_source": graph.edge_source.long(),
               "edge_weight": graph.edge_weight.float(), "node_mask": pruned.node_mask.contiguous()},
              str(out / "graph.safetensors"))
    (out / "timing.json").write_text(json.dumps({"context": args.context, "seconds": seconds,
                                                 "peak_rss_mb_before": before, "peak_rss_mb": after,
                                                 "n_nodes": graph.n_nodes, "n_edges": graph.n_edges,
                                                 "threads": args.threads, "batch_size": graph.meta["batch_size"],
                                                 "stored_patterns": graph.meta["stored_patterns"],
                                                 "conventions": args.conventions, "scores": graph.scores()}, indent=1))


def run(cmd: list[str], timeout: int, env: dict | None = None) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


# ---- the comparison ------------------------------------------------------------------------------------
def ct_node_keys(ct: dict, n_layers: int, n_pos: int) -> list[tuple]:
    """circuit-tracer's node order: selected features, errors (layer-major), tokens, logits."""
    feats = ct["active_features"][ct["selected_features"]].tolist()
    keys = [("F", l, p, f) for l, p, f in feats]
    keys += [("E", l, p) for l in range(n_layers) for p in range(n_pos)]
    keys += [("T", p) for p in range(n_pos)]
    keys += [("L", j) for j in range(len(ct["logit_ids"]))]
    return keys


def ours_in_ct_order(ours: dict, keys: list[tuple]):
    """Our edges as a dense matrix over circuit-tracer's nodes, without position 0's features and errors.

    circuit-tracer zeroes position 0's feature activations *and* its error vectors
    (``replacement_model_transformerlens.py``: the first token is treated as a constant), so its
    graph has no feature there and its position-0 error nodes have no edges; ours keeps both as
    nodes. They are left out of the comparison (their columns stay zero on both sides).
    """
    import torch

    index = {k: i for i, k in enumerate(keys)}
    kind, layer, pos, feat = (ours[n].tolist() for n in ("kind", "layer", "pos", "feature"))
    mapped, logit_j, unmatched = [], 0, []
    for k, l, p, f in zip(kind, layer, pos, feat):
        if k in (0, 1) and p == 0:
            mapped.append(-1)
            continue
        if k == 0:
            key = ("F", l, p, f)
        elif k == 1:
            key = ("E", l, p)
        elif k == 2:
            key = ("T", p)
        else:
            key, logit_j = ("L", logit_j), logit_j + 1
        if key not in index:
            unmatched.append(key)
        mapped.append(index.get(key, -1))
    mapped = torch.tensor(mapped)
    t, s, w = ours["edge_target"], ours["edge_source"], ours["edge_weight"]
    keep = (mapped[t] >= 0) & (mapped[s] >= 0)
    A = torch.zeros(len(keys), len(keys), dtype=torch.float64)
    A.index_put_((mapped[t[keep]], mapped[s[keep]]), w[keep].double(), accumulate=True)
    kept = {keys[int(mapped[i])] for i in ours["node_mask"].nonzero().flatten().tolist() if int(mapped[i]) >= 0}
    return A, unmatched, kept


def compare(out: Path, context: int) -> dict:
    from safetensors.torch import load_file

    ct = load_file(str(out / f"ct-{context}" / "graph.safetensors"))
    ours = load_file(str(out / f"ours-{context}" / "graph.safetensors"))
    keys = ct_node_keys(ct, N_LAYERS, context)
    A_ct = ct["adjacency"].double()
    A_ours, unmatched, ours_kept = ours_in_ct_order(ours, keys)
    ct_kept = {keys[i] for i in ct["node_mask"].nonzero().flatten().tolist()}
    ours_feats = {(l, p, f) for k, l, p, f in zip(*(ours[n].tolist() for n in ("kind", "layer", "pos", "feature")))
                  if k == 0 and p > 0}
    ct_feats = {tuple(x) for x in ct["active_features"].tolist()}
    pruned_ct = {k for k in ct_kept if k[0] in "FE"}
    pruned_ours = {k for k in ours_kept if k[0] in "FE"}
    diff = (A_ours - A_ct).abs()
    t_ct = json.loads((out / f"ct-{context}" / "timing.json").read_text())
    t_ours = json.loads((out / f"ours-{context}" / "timing.json").read_text())
    return {
        "context": context, "nodes": len(keys), "unmatched_nodes": len(unmatched),
        "max_abs_adjacency_difference": float(diff.max()), "max_abs_adjacency": float(A_ct.abs().max()),
        "feature_sets_equal": ours_feats == ct_feats,
        "pruned_nodes_ct": len(pruned_ct), "pruned_nodes_ours": len(pruned_ours),
        "pruned_node_jaccard": len(pruned_ct & pruned_ours) / max(1, len(pruned_ct | pruned_ours)),
        "batch_size_ct": t_ct.get("batch_size"), "batch_size_ours": t_ours.get("batch_size"),
        "seconds_ct": t_ct["seconds"], "seconds_ours": t_ours["seconds"],
        "time_ratio_ours_over_ct": t_ours["seconds"] / t_ct["seconds"],
        "peak_mb_ct": t_ct["peak_rss_mb"], "peak_mb_ours": t_ours["peak_rss_mb"],
        "memory_ratio_ours_over_ct": t_ours["peak_rss_mb"] / t_ct["peak_rss_mb"],
        "graph_mb_ct": t_ct["peak_rss_mb"] - t_ct["peak_rss_mb_before"],
        "graph_mb_ours": t_ours["peak_rss_mb"] - t_ours["peak_rss_mb_before"],
        "conventions_ours": t_ours.get("conventions", "workbench"),
        "scores_ct": t_ct.get("scores"), "scores_ours": t_ours.get("scores"),
    }


def check_logits(model, tokens, out: Path) -> float:
    import torch
    from safetensors.torch import load_file

    theirs = load_file(str(out / "ct-logits" / "logits.safetensors"))["logits"]
    with torch.no_grad():
        ours = model(tokens[None])[0]
    return float((ours - theirs).abs().max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="64,256", help="prompt lengths, comma-separated")
    p.add_argument("--ct-python", default=DEFAULT_CT_PYTHON, help="the Python of circuit-tracer's venv")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "graphs_ct")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", choices=["llama", "gpt2"], default="llama",
                   help="llama: RMSNorm, RoPE, SwiGLU; gpt2: LayerNorm, learned positions, GELU")
    p.add_argument("--conventions", choices=list(CONVENTIONS), default="workbench",
                   help="our graph's token_embedding / held_positions: our defaults or circuit-tracer's")
    p.add_argument("--threads", type=int, default=1, help="torch threads on each side")
    p.add_argument("--ct-batch-size", type=int, default=64, help="circuit-tracer's attribute batch_size")
    p.add_argument("--batch-size", type=int, default=None, help="our attribution_graph batch_size (default: its own)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per subprocess")
    p.add_argument("--ct-only", action="store_true", help="run circuit-tracer's side only")
    p.add_argument("--compare-only", action="store_true", help="only compare what --out already holds")
    p.add_argument("--child", choices=["ours"], help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    p.add_argument("--max-context", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_ours(args)
    contexts = [int(c) for c in args.contexts.split(",")]
    out = args.out
    if not args.compare_only:
        if not Path(args.ct_python).exists():
            raise SystemExit(f"circuit-tracer's venv is missing ({args.ct_python}); create it with:\n  python3 -m venv "
                             f"{CT_VENV} && {CT_VENV}/bin/pip install torch==2.13.0 && "
                             f"{CT_VENV}/bin/pip install circuit-tracer==0.5.0")
        model, tcs, tokens = build(max(contexts), args.seed, args.config)
        export(model, tcs, tokens, out / "exchange")
        ct_cmd = [args.ct_python, str(ROOT / "benchmarks" / "_ct_side.py"), "--exchange", str(out / "exchange")]
        env = {"CT_THREADS": str(args.threads)}
        run(ct_cmd + ["--out", str(out / "ct-logits")], args.timeout, env)
        logit_diff = check_logits(model, tokens, out)
        print(f"weight mapping: max |logits(circuit-tracer) - logits(ours)| = {logit_diff:.2e} on {len(tokens)} tokens")
        if not logit_diff < 1e-4:
            raise SystemExit("the two models disagree: the weight mapping is wrong, no graph would compare")
        (out / "logits_check.json").write_text(json.dumps({"max_abs_logit_difference": logit_diff,
                                                           "tokens": len(tokens)}))
    try:
        from workbench import analysis as an

        have_ours = hasattr(an, "attribution_graph") and not args.ct_only
    except ImportError:
        have_ours = False
    results = []
    for context in contexts:
        if not args.compare_only:
            run(ct_cmd + ["--context", str(context), "--batch-size", str(args.ct_batch_size),
                          "--out", str(out / f"ct-{context}")], args.timeout, env)
            t = json.loads((out / f"ct-{context}" / "timing.json").read_text())
            print(f"circuit-tracer, {context} tokens: {t['seconds']:.1f} s, peak RSS {t['peak_rss_mb']:.0f} MB, "
                  f"{t['n_nodes']} nodes", flush=True)
            if have_ours:
                run([sys.executable, __file__, "--child", "ours", "--context", str(context), "--max-context",
                     str(max(contexts)), "--seed", str(args.seed), "--threads", str(args.threads),
                     "--config", args.config, "--conventions", args.conventions,
                     *(["--batch-size", str(args.batch_size)] if args.batch_size else []),
                     "--out", str(out / f"ours-{context}")], args.timeout)
        if (out / f"ours-{context}" / "graph.safetensors").exists():
            results.append(compare(out, context))
            print(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in results[-1].items()}), flush=True)
    if results:
        (out / "comparison.json").write_text(json.dumps(results, indent=1))
    elif not have_ours:
        why = "--ct-only" if args.ct_only else "an.attribution_graph is not available"
        print(f"{why}: circuit-tracer's side only, in {out}")


if __name__ == "__main__":
    main()
