"""Host overhead per module and per hook point, on a CPU, against transformers in one run.

On a GPU the eager gap to transformers (forward 1.28x at 1B bf16, decode 1.37-1.39x at batch 32 in the
first GPU run) is Python time on the host while the chip waits between kernels. On a model small enough
that every tensor op is a few microseconds (2 layers, d_model 64, batch 1, 8 tokens) a CPU shows that same
host time, without a GPU:

    .venv/bin/python benchmarks/host_overhead.py [--rounds 30] [--inner 20] [--threads 1] [--json OUT]

Both models are the same weights: a seeded Llama-shaped HookedDecoder, written with ``wb.to_hf`` and read
back by transformers' ``LlamaForCausalLM`` (logits checked equal first). Timed in interleaved rounds
(ours, transformers, ours with a no-op hook on every hook point, ...), each sample the mean of ``--inner``
calls; reported: medians per call, the ratio ours / transformers as the median of per-round ratios with a
95% bootstrap interval, the count of module calls and of HookPoint calls per forward (counted by a global
forward pre-hook, in a separate untimed pass), and from those the time per module call and the cost of
one attached hook.

Decode is one greedy step on a KV cache: (t(generate 1 + n new) - t(generate 1 new)) / n, so each
contender's fixed generate overhead cancels.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(threads: int, layers: int = 2):
    import transformers

    import workbench as wb
    from interop import LLAMA, SIZES

    torch.set_num_threads(threads)
    cfg = wb.ModelConfig(**{**SIZES["tiny"], "n_layers": layers}, **{**LLAMA, "n_ctx": 256}, seed=0)
    ours = wb.HookedDecoder(cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        wb.to_hf(ours, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    hf.config.use_cache = True
    return ours, hf


def count_calls(model, fn) -> dict:
    """Module calls and HookPoint calls during one ``fn()`` (a global pre-hook, so nothing is timed with it)."""
    from transformer_lens.hook_points import HookPoint

    counts = {"modules": 0, "hook_points": 0}

    def pre(module, args):
        counts["modules"] += 1
        counts["hook_points"] += isinstance(module, HookPoint)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    try:
        fn()
    finally:
        handle.remove()
    return counts


def count_ops(fn) -> dict:
    """ATen ops during one ``fn()`` (on a GPU each is about one kernel launch, the host's work per op) and
    the host syncs among them: ``_local_scalar_dense`` is ``.item()``/``.tolist()``/``bool(tensor)``, which on a
    GPU waits for every queued kernel, so the host cannot run ahead of the chip."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"aten_ops": 0, "kernel_ops": 0, "host_syncs": 0}
    metadata_only = {"_unsafe_view", "lift_fresh", "detach", "_local_scalar_dense"}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["aten_ops"] += 1
            # views (slice, view, transpose, ...) change metadata only: no kernel runs on a GPU for them
            counts["kernel_ops"] += not (func.is_view or func.overloadpacket.__name__ in metadata_only)
            if func is torch.ops.aten._local_scalar_dense.default or "nonzero" in str(func):
                counts["host_syncs"] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return counts


def timed(fns: dict, rounds: int, inner: int) -> dict[str, list[float]]:
    """Per-call seconds of each callable: ``rounds`` interleaved rounds, each sample the mean of ``inner`` calls."""
    for fn in fns.values():
        fn()
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    return samples


def hook_point_dispatch_us(n: int = 20000) -> tuple[float, float]:
    """Microseconds per call of a HookPoint with nothing attached, and of a plain identity function (medians of 5)."""
    from transformer_lens.hook_points import HookPoint

    hp, x = HookPoint(), torch.zeros(4)
    ident = lambda t: t
    out = []
    for fn in (hp, ident):
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                fn(x)
            runs.append(1e6 * (time.perf_counter() - start) / n)
        out.append(statistics.median(runs))
    return out[0], out[1]


def ratio_interval(a: list[float], b: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Median of the per-round ratios a/b and a 95% bootstrap interval of that median."""
    ratios = [x / y for x, y in zip(a, b)]
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return statistics.median(ratios), boots[50], boots[1949]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--new", type=int, default=8, help="decode steps timed per generate")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    ours, hf = build(args.threads, args.layers)
    tokens = torch.randint(3, ours.cfg.d_vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    if diff > 1e-4:
        raise SystemExit(f"the two models differ ({diff:.2e}): the timing would compare different work")

    def noop(x, hook):
        return None

    names = [n for n, _ in ours.hook_dict.items()]
    hooked_fwd = lambda: ours.run_with_hooks(tokens, fwd_hooks=[(lambda n: True, noop)])

    def hf_gen(n):
        return hf.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)

    def ours_gen(n):
        return ours.generate(tokens, max_new_tokens=n, use_kv_cache=True)

    with torch.no_grad():
        calls = {"ours": count_calls(ours, lambda: ours(tokens)), "transformers": count_calls(hf, lambda: hf(tokens))}
        step_calls = {
            "ours": {k: (v - count_calls(ours, lambda: ours_gen(1))[k]) / args.new
                     for k, v in count_calls(ours, lambda: ours_gen(1 + args.new)).items()},
            "transformers": {k: (v - count_calls(hf, lambda: hf_gen(1))[k]) / args.new
                             for k, v in count_calls(hf, lambda: hf_gen(1 + args.new)).items()}}
        ops = {"forward": {"ours": count_ops(lambda: ours(tokens)), "transformers": count_ops(lambda: hf(tokens))},
               "decode_step": {}}
        for who, g in (("ours", ours_gen), ("transformers", hf_gen)):
            one, more = count_ops(lambda g=g: g(1)), count_ops(lambda g=g: g(1 + args.new))
            ops["decode_step"][who] = {k: (more[k] - one[k]) / args.new for k in one}
        # per layer: the same counts on a model one layer deeper, less these
        deeper, deeper_hf = build(args.threads, args.layers + 1)
        ops["forward_per_layer"] = {
            who: {k: count_ops(lambda m=m: m(tokens))[k] - ops["forward"][who][k] for k in ops["forward"][who]}
            for who, m in (("ours", deeper), ("transformers", deeper_hf))}
        fwd = timed({"ours": lambda: ours(tokens), "transformers": lambda: hf(tokens), "ours_hooked": hooked_fwd,
                     "ours_run_with_hooks_empty": lambda: ours.run_with_hooks(tokens, fwd_hooks=[])},
                    args.rounds, args.inner)
        gen_inner = max(1, args.inner // 4)
        gen = timed({"ours_1": lambda: ours_gen(1), "ours_n": lambda: ours_gen(1 + args.new),
                     "transformers_1": lambda: hf_gen(1), "transformers_n": lambda: hf_gen(1 + args.new)},
                    args.rounds, gen_inner)
    hp_us, ident_us = hook_point_dispatch_us()
    step = {who: [(n - one) / args.new for n, one in zip(gen[f"{who}_n"], gen[f"{who}_1"])]
            for who in ("ours", "transformers")}
    med = {k: statistics.median(v) for k, v in {**fwd, **{f"step_{k}": v for k, v in step.items()}}.items()}
    f_ratio = ratio_interval(fwd["ours"], fwd["transformers"])
    s_ratio = ratio_interval(step["ours"], step["transformers"])
    n_hp = calls["ours"]["hook_points"]
    per_hook_us = 1e6 * (med["ours_hooked"] - med["ours"]) / max(n_hp, 1)
    result = {
        "shape": {k: getattr(ours.cfg, k) for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_mlp", "d_vocab")},
        "batch": 1, "tokens": args.tokens, "threads": args.threads, "rounds": args.rounds, "inner": args.inner,
        "logits_max_abs_diff": diff, "hook_points_in_model": len(names),
        "calls_per_forward": calls, "aten_ops": ops, "calls_per_decode_step": step_calls,
        "median_us": {k: 1e6 * v for k, v in med.items()},
        "forward_ratio_ours_over_transformers": f_ratio, "decode_step_ratio_ours_over_transformers": s_ratio,
        "us_per_module_call_forward": {who: 1e6 * med[who] / calls[who]["modules"] for who in ("ours", "transformers")},
        "us_per_attached_noop_hook": per_hook_us,
        # one HookPoint call with nothing attached, against a plain function returning its input: what skipping
        # the dispatch when no hook is attached could save, at most, per hook point
        "us_per_bare_hook_point_call": hp_us, "us_per_identity_function_call": ident_us,
        "hook_point_dispatch_share_of_forward": n_hp * (hp_us - ident_us) / (1e6 * med["ours"]),
    }
    print(f"shape {result['shape']}, batch 1 x {args.tokens} tokens, {args.threads} thread(s); logits equal to {diff:.1e}")
    print(f"forward: ours {1e6 * med['ours']:.0f} us, transformers {1e6 * med['transformers']:.0f} us; "
          f"ratio {f_ratio[0]:.2f}x (95% {f_ratio[1]:.2f}-{f_ratio[2]:.2f})")
    print(f"decode step: ours {1e6 * med['step_ours']:.0f} us, transformers {1e6 * med['step_transformers']:.0f} us; "
          f"ratio {s_ratio[0]:.2f}x (95% {s_ratio[1]:.2f}-{s_ratio[2]:.2f})")
    for who in ("ours", "transformers"):
        print(f"{who}: {calls[who]['modules']} module calls per forward ({calls[who]['hook_points']} HookPoints), "
              f"{result['us_per_module_call_forward'][who]:.1f} us per module call; per decode step "
              f"{step_calls[who]['modules']:.0f} module calls ({step_calls[who]['hook_points']:.0f} HookPoints)")
    for where, by in ops.items():
        print(f"{where}: " + "; ".join(f"{who} {c['aten_ops']:.0f} aten ops ({c['kernel_ops']:.0f} that launch a "
                                        f"kernel on a GPU), {c['host_syncs']:.1f} host syncs"
                                        for who, c in by.items()))
    print(f"a no-op hook on each of {n_hp} hook points: {1e6 * med['ours_hooked']:.0f} us per forward, "
          f"{per_hook_us:.1f} us per attached hook; run_with_hooks with none: {1e6 * med['ours_run_with_hooks_empty']:.0f} us")
    print(f"one HookPoint call with no hook: {hp_us:.2f} us (a plain identity function: {ident_us:.2f} us); "
          f"x {n_hp} per forward = {100 * result['hook_point_dispatch_share_of_forward']:.1f}% of ours' forward")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
