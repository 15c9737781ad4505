"""Ours against the other ways to look inside a model: transformers, TransformerLens' bridge, nnsight.

    python benchmarks/contenders.py [--size small|tiny|300m|1b] [--dtype float32|bfloat16]
        [--batch 2] [--pos 64] [--repeats 3] [--threads 1] [--all-layers] [--nnsight-path DIR]
        [--device cpu|cuda] [--dir DIR]

One random Llama-shaped model (``--size``: the shapes of ``benchmarks/interop.py``; ``small`` is
d_model 512 x 8 layers, GQA 8/4 heads, d_mlp 1408, vocab 8192, 33M parameters) is written once
with ``wb.to_hf`` (bf16 safetensors and a word-level tokenizer) to a temp dir; every contender
loads it from there in ``--dtype``, and three tasks run on the same random tokens:

    forward        transformers (sdpa) | ours (``wb.from_hf``) | bridge | nnsight (a trace, nothing saved)
    cache          every activation: ours ``run_with_cache`` (every hook) | bridge ``run_with_cache`` |
                   nnsight saving every module's output (each module's output, in the order they run) |
                   transformers ``output_hidden_states=True`` (the residual stream only); on a CPU also
                   the bytes each result holds (storages counted once) and how far one call raised the
                   process's resident memory (peak RSS, reset before each call), and the minor page faults of one call
                   as timed (pages freshly mapped: where the time of holding many bytes can go)
    patch heads    per-head activation patching of layer ``--layer``'s attention z (o_proj's input) from
                   the clean run into the corrupted run, each head alone, metric = logit[1] - logit[2]
                   at the last position (mean over the batch); ``--all-layers``: every head of every layer

Ours patches through ``workbench.analysis`` (one layer: ``resume.run_from_site``, which runs only
what follows the edited z; all layers: ``activation_patching(sites="head")``, the same engine), and,
as a second row, with ``run_with_hooks`` on ``hook_z`` (a full forward per head, as the others do).
The cache task has a second row of ours too: every hook but the attention scores, pattern and per-head
result, the three whose caching costs work a plain forward skips (explicit attention instead of sdpa,
and ``z W_O`` per head), so the set is closer to what nnsight's module outputs hold.
The bridge patches ``hook_z`` with ``run_with_hooks`` (clean cache once); nnsight sets the slice of
o_proj's input in one trace per head. The patching numbers of every contender are compared (the
largest difference is printed and must be small: the benchmark fails otherwise).

The contenders run in turns (``_timing.interleaved``) so machine noise hits them alike; medians are
printed with each one's ratio to ours. nnsight is not a dependency: it is imported from
``--nnsight-path`` (a ``pip install --target DIR --no-deps nnsight`` beside our pins) or PYTHONPATH,
and left out with a line saying so when absent; a bridge that fails to boot is left out the same way.
``--threads`` defaults to 1: on a shared 2-core machine two threads under load are slower, not faster.
``--device cuda`` puts every contender and the tokens on the GPU (each timed call is synchronised);
``--dir`` reads (or writes once) the saved model there instead of a temp dir, so a caller that already
wrote that size with ``wb.to_hf`` (``scripts/gpu_check.py``) does not write it again.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
sys.path.insert(0, str(Path(__file__).resolve().parent))
import workbench as wb  # noqa: E402
from _memory import peak_growth, status_bytes  # noqa: E402
from _timing import interleaved  # noqa: E402
from interop import SIZES, _word_tokenizer, _write_llama  # noqa: E402
from workbench.analysis import activation_patching  # noqa: E402
from workbench.analysis.common import logit_diff_metric  # noqa: E402
from workbench.analysis.resume import needed_hooks, run_from_site  # noqa: E402

ANSWER, WRONG = 1, 2
# The hooks whose caching costs work the forward does not do: the attention scores and pattern (cached,
# attention runs explicitly instead of fused sdpa) and each head's output (z W_O per head, [b, p, h, d_model]).
EXTRA_WORK = ("hook_attn_scores", "hook_pattern", "hook_result")


def tensors_of(value: Any) -> list:
    """The tensors a returned structure holds (tuples, lists, dicts, model outputs, caches)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "cache_dict"):
        value = value.cache_dict
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    return []


def n_tensors(value: Any) -> int:
    return len(tensors_of(value))


def held_bytes(value: Any) -> int:
    """Bytes of the storages the returned tensors keep alive, each storage counted once (views share)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors_of(value)}
    return sum(storages.values())


def _rss(field: str) -> int:
    """``field`` ("VmRSS:", "VmHWM:") of this process in bytes, 0 where it cannot be read."""
    return status_bytes(field.rstrip(":")) or 0


peak_rss_growth = peak_growth  # the name real_model.py and the tests know


def minor_faults(fn: Callable, outputs: dict, name: str) -> int:
    """Minor page faults during one call of ``fn`` (pages the process touched for the first time since the
    allocator mapped them), its result then kept in ``outputs[name]`` in place of the last one, as the timed
    rounds do; -1 where resource usage cannot be read."""
    try:
        import resource
    except ImportError:
        return -1
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = fn()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    outputs[name] = out
    return faults


# ---- the contenders -------------------------------------------------------------------------------------
def load_nnsight(path: Path, dtype: torch.dtype, where: Optional[str], device: str = "cpu") -> tuple[Any, str]:
    """nnsight's LanguageModel on the saved directory, or None and why not."""
    if where:
        sys.path.insert(0, where)
    try:
        import nnsight
    except ImportError as err:
        return None, f"not installed (pip install nnsight): {err}"
    # TransformersModel is 0.8's name for what LanguageModel was (which it now warns about)
    kind = getattr(nnsight, "TransformersModel", None)
    kw = {"task": "text-generation"} if kind is not None else {}
    lm = (kind or nnsight.LanguageModel)(str(path), dtype=dtype, attn_implementation="sdpa", dispatch=True,
                                         device_map=device, **kw)
    return lm, f"nnsight {nnsight.__version__} ({type(lm).__name__})"


def load_bridge(path: Path, dtype: torch.dtype, device: str = "cpu") -> tuple[Any, str]:
    try:
        from transformers import AutoTokenizer
        from transformer_lens.model_bridge import TransformerBridge

        bridge = TransformerBridge.boot_transformers(str(path), device=device, dtype=dtype,
                                                     tokenizer=AutoTokenizer.from_pretrained(path))
    except Exception as err:  # a benchmark reports a contender that cannot run and goes on
        return None, f"failed to boot: {type(err).__name__}: {err}"
    from importlib.metadata import version

    return bridge, f"TransformerLens {version('transformer-lens')}"


def module_order(hf_model, tokens) -> list[str]:
    """Every submodule's name in the order its output appears (nnsight wants them read in that order)."""
    order: list[str] = []
    handles = [m.register_forward_hook(lambda mod, inp, out, name=name: order.append(name))
               for name, m in hf_model.named_modules() if name]
    try:
        with torch.no_grad():
            hf_model(tokens)
    finally:
        for h in handles:
            h.remove()
    return list(dict.fromkeys(order))  # a module called twice is read at its first output


# ---- patching -------------------------------------------------------------------------------------------
def ours_resume(model, clean, corrupted, metric, layers) -> dict:
    """{(layer, head): metric}: one layer through ``run_from_site``; every layer through activation_patching."""
    if len(layers) == model.cfg.n_layers:
        frame = activation_patching(model, clean, corrupted, metric, sites="head")
        return {(int(r.layer), int(r.head)): float(r.metric) for r in frame.itertuples()}
    names = needed_hooks(model)
    _, clean_cache = model.run_with_cache(clean, names_filter=lambda n: n in names)
    _, cache = model.run_with_cache(corrupted, names_filter=lambda n: n in names)
    out = {}
    for layer in layers:
        z_clean, z = clean_cache[f"blocks.{layer}.attn.hook_z"], cache[f"blocks.{layer}.attn.hook_z"]
        for head in range(model.cfg.n_heads):
            edit = z.clone()
            edit[:, :, head] = z_clean[:, :, head]
            out[layer, head] = float(metric(run_from_site(model, layer, "z", edit, cache.cache_dict)))
    return out


def hooked(model, clean, corrupted, metric, layers, n_heads: int) -> dict:
    """{(layer, head): metric} with a hook on ``hook_z`` and a full forward per head (ours or the bridge).
    The bridge's hook_z is o_proj's input, [batch, pos, heads * d_head]: it is viewed per head."""
    names = {f"blocks.{layer}.attn.hook_z" for layer in layers}
    _, clean_cache = model.run_with_cache(clean, names_filter=lambda n: n in names)
    out = {}

    def patch(z, name: str, head: int):  # name: ours; the bridge's hook.name is its own (o.hook_in)
        source = clean_cache[name]
        z.view(*z.shape[:2], n_heads, -1)[:, :, head] = source.view(*z.shape[:2], n_heads, -1)[:, :, head]
        return z

    for layer in layers:
        name = f"blocks.{layer}.attn.hook_z"
        for head in range(n_heads):
            logits = model.run_with_hooks(corrupted, fwd_hooks=[(name, lambda z, hook, n=name, h=head: patch(z, n, h))])
            out[layer, head] = float(metric(logits))
    return out


def nnsight_patched(lm, clean, corrupted, metric, layers, n_heads: int) -> dict:
    """{(layer, head): metric}: one trace for the clean o_proj inputs, then a trace per head setting its slice."""
    sources: dict = {}  # filled inside the trace, made outside it (a name bound inside does not come out)
    with lm.trace(clean):
        for layer in layers:
            sources[layer] = lm.model.layers[layer].self_attn.o_proj.input.save()
    out = {}
    for layer in layers:
        d_head = sources[layer].shape[-1] // n_heads
        for head in range(n_heads):
            cols = slice(head * d_head, (head + 1) * d_head)
            with lm.trace(corrupted):
                lm.model.layers[layer].self_attn.o_proj.input[:, :, cols] = sources[layer][:, :, cols]
                logits = lm.lm_head.output.save()
            out[layer, head] = float(metric(logits))
    return out


# ---- the run --------------------------------------------------------------------------------------------
def main(argv=None, rows: Optional[list] = None) -> pd.DataFrame:
    """Run the benchmark and return its table; ``rows``, when given, receives each timing as it is taken
    (a caller keeps them even when the patching numbers disagree and this raises)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--pos", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layer", type=int, default=None, help="the layer patched (default: the middle one)")
    parser.add_argument("--all-layers", action="store_true", help="patch every head of every layer")
    parser.add_argument("--nnsight-path", default=None, help="a directory holding nnsight (pip install --target)")
    parser.add_argument("--tasks", default="forward,cache,patch", help="comma-separated subset of the tasks")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...: every contender and the tokens")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the saved model lives (written there once when absent; default: a temp dir)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = SIZES[args.size]
    n_layers, n_heads = shape["n_layers"], shape["n_heads"]
    layer = n_layers // 2 if args.layer is None else args.layer
    if not 0 <= layer < n_layers:
        parser.error(f"--layer must be in [0, {n_layers - 1}], got {layer}")
    layers = list(range(n_layers)) if args.all_layers else [layer]
    tasks = args.tasks.split(",")

    import transformers

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        path = (args.dir or Path(tmp)) / f"llama-{args.size}"
        started = time.perf_counter()
        if not (path / "config.json").exists():
            _write_llama(path, args.size, "2GB")
        if not (path / "tokenizer.json").exists():
            _word_tokenizer(shape["d_vocab"]).save_pretrained(path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        hf = hf.to(device).eval()
        ours = wb.from_hf(path, dtype=dtype, device=device).eval()
        bridge, bridge_note = load_bridge(path, dtype, str(device))
        lm, nnsight_note = load_nnsight(path, dtype, args.nnsight_path, str(device))
        n_params = sum(p.numel() for p in ours.parameters())
        print(f"wrote (or found) and loaded {n_params / 1e6:.0f}M parameters four times in "
              f"{time.perf_counter() - started:.0f} s, on {device}")
    print(f"bridge: {bridge_note}")
    print(f"nnsight: {nnsight_note}" if lm is not None else "nnsight: not installed (pip install nnsight)")

    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(3, shape["d_vocab"], (args.batch, args.pos), generator=gen).to(device)
    corrupted = torch.randint(3, shape["d_vocab"], (args.batch, args.pos), generator=gen).to(device)
    metric = logit_diff_metric(ANSWER, WRONG)
    rows = [] if rows is None else rows
    bad: dict = {}

    def timed(task: str, fns: dict[str, Callable], count: bool = False, note: str = "") -> dict:
        outputs: dict = {}
        with torch.no_grad():
            times = interleaved(fns, args.repeats, outputs=outputs, sync=sync)
        for name, median in times.items():
            rows.append({"task": task, "contender": name, "median_s": median,
                         "tensors": n_tensors(outputs[name]) if count else None})
        if note:
            print(note)
        return outputs

    if "forward" in tasks:
        fns = {"transformers (sdpa)": lambda: hf(clean).logits, "ours": lambda: ours(clean)}
        if bridge is not None:
            fns["bridge"] = lambda: bridge(clean)
        if lm is not None:
            def nnsight_forward():
                with lm.trace(clean):
                    pass
            fns["nnsight"] = nnsight_forward
        outputs = timed("forward", fns)
        reference = outputs["transformers (sdpa)"].float()
        if lm is not None:  # the timed trace saves nothing; one more that saves the logits, to compare
            with torch.no_grad(), lm.trace(clean):
                logits = lm.lm_head.output.save()
            outputs["nnsight"] = logits
        for name in ("ours", "bridge", "nnsight"):
            if name in outputs:
                print(f"forward: max |logits - transformers'| {name}: "
                      f"{(outputs[name].float() - reference).abs().max().item():.3g}")

    if "cache" in tasks:
        from transformer_lens import HookedRootModule

        fns = {"ours run_with_cache": lambda: ours.run_with_cache(clean),
               # the same cache through TransformerLens' hook bookkeeping (ours before it had its own path)
               "ours via TL's caching hooks": lambda: HookedRootModule.run_with_cache(ours, clean),
               "ours without pattern/result": lambda: ours.run_with_cache(clean, names_filter=lambda n: not n.endswith(
                   EXTRA_WORK)),
               "transformers hidden_states": lambda: hf(clean, output_hidden_states=True).hidden_states}
        if bridge is not None:
            fns["bridge run_with_cache"] = lambda: bridge.run_with_cache(clean)
        if lm is not None:
            order = module_order(lm._module, clean)

            def nnsight_cache():
                saved: list = []  # made outside the trace: a name bound inside it does not come out
                with lm.trace(clean):
                    for name in order:
                        saved.append(lm.get(name).output.save())
                return saved
            fns["nnsight every module"] = nnsight_cache
        outputs = timed("cache", fns, count=True, note="cache: ours and the bridge cache every hook point; nnsight every "
                        "submodule's output; transformers the residual stream only (n_layers + 1 tensors); "
                        f"'ours without pattern/result': every hook but {', '.join(EXTRA_WORK)}")
        if device.type == "cpu":  # what each cache holds, and how far one call raised the process's memory
            held = {name: held_bytes(out) for name, out in outputs.items()}
            with torch.no_grad():  # one more call each, the others' results alive as in the timed rounds
                faults = {name: minor_faults(fn, outputs, name) for name, fn in fns.items()}
            del outputs
            with torch.no_grad():
                peaks = {name: peak_rss_growth(fn) for name, fn in fns.items()}
            print("cache memory (MiB), held by the result / peak resident growth during one call; minor page "
                  "faults in one call as timed (fresh pages the allocator had to map):")
            for name in fns:
                peak = "n/a" if peaks[name] is None else f"{peaks[name] / 2**20:.1f}"
                print(f"  {name:<32}{held[name] / 2**20:9.1f} / {peak:>6}; {faults[name]} faults")
                rows_row = next(r for r in rows if r["task"] == "cache" and r["contender"] == name)
                rows_row.update(held_mib=held[name] / 2**20, peak_mib=None if peaks[name] is None else peaks[name] / 2**20,
                                faults=faults[name])

    if "patch" in tasks:
        where = "every layer" if args.all_layers else f"layer {layer}"
        fns = {"ours": lambda: ours_resume(ours, clean, corrupted, metric, layers),
               "ours run_with_hooks": lambda: hooked(ours, clean, corrupted, metric, layers, n_heads)}
        if bridge is not None:
            fns["bridge run_with_hooks"] = lambda: hooked(bridge, clean, corrupted, metric, layers, n_heads)
        if lm is not None:
            fns["nnsight"] = lambda: nnsight_patched(lm, clean, corrupted, metric, layers, n_heads)
        outputs = timed("patch heads", fns)
        reference = outputs["ours"]
        worst = {name: max(abs(out[k] - reference[k]) for k in reference) for name, out in outputs.items()}
        spread = max(reference.values()) - min(reference.values())
        print(f"patch heads ({where}, {len(reference)} patches): metric from {min(reference.values()):.4g} to "
              f"{max(reference.values()):.4g}; max |difference from ours|: "
              + ", ".join(f"{name} {d:.3g}" for name, d in worst.items() if name != "ours"))
        tolerance = 1e-3 if dtype == torch.float32 else 0.1
        bad = {name: d for name, d in worst.items() if d > tolerance * max(1.0, spread)}

    table = pd.DataFrame(rows)
    ours_of = {"forward": "ours", "cache": "ours run_with_cache", "patch heads": "ours"}
    table["ratio_to_ours"] = [r.median_s / table[(table.task == r.task) & (table.contender == ours_of[r.task])]
                              .median_s.iloc[0] for r in table.itertuples()]
    with pd.option_context("display.float_format", "{:.4g}".format, "display.width", 120):
        print(f"\nLlama-shaped {args.size} ({n_params / 1e6:.0f}M) in {args.dtype} on {device}, batch {args.batch} x "
              f"{args.pos} tokens, median of {args.repeats} interleaved rounds, {args.threads} thread(s)")
        print(table.to_string(index=False))
    for task, group in table.groupby("task", sort=False):
        mine = group[group.contender == ours_of[task]].median_s.iloc[0]
        # transformers' hidden states are n_layers + 1 tensors, not every activation: not a rival at caching
        rivals = group[~group.contender.str.startswith("ours") & (group.contender != "transformers hidden_states")]
        if rivals.empty:
            print(f"{task}: no other contender ran")
            continue
        fastest = rivals.loc[rivals.median_s.idxmin()]
        verdict = ("ours is fastest" if mine <= fastest.median_s else
                   f"ours is NOT fastest: {fastest.contender} is {mine / fastest.median_s:.2f}x faster")
        others = group[group.contender.str.startswith("ours") & (group.contender != ours_of[task])]
        also = "".join(f"; {r.contender}: {r.median_s / fastest.median_s:.2f}x {fastest.contender}'s time"
                       for r in others.itertuples())
        print(f"{task}: {verdict} ({fastest.contender} takes {fastest.median_s / mine:.2f}x ours' time{also})")
    if bad:  # after the table: the timings stand, the disagreement fails the run
        raise AssertionError(f"the contenders disagree on the patching numbers: {bad} (tolerance {tolerance})")
    return table


if __name__ == "__main__":
    main()
