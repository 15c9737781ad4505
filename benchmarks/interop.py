"""Interop benchmarks: the forward of an imported model, and the import itself.

    python benchmarks/interop.py [forward] [--repeats 7] [--batch 8] [--pos 256]
    python benchmarks/interop.py import [--size 300m|1b] [--repeats 3] [--device cpu]

``forward`` -- speed of an imported GPT-2-shaped model: ours against plain Hugging Face and TransformerBridge.

One HF GPT-2 (d_model 256, 4 layers, 8 heads, d_mlp 1024, vocab 4096, ctx 256, random weights)
is imported with ``wb.from_hf`` and wrapped by TransformerLens' ``TransformerBridge``; the
contenders run interleaved in one process so machine noise hits them alike, and every time is
printed as a ratio to the plain HF forward (sdpa attention, HF's default):

    ours forward               target <= 1.15x HF
    ours run_with_cache        (every hook cached)
    bridge forward / run_with_cache   (the bridge forces eager attention, so HF eager is listed too)

``import`` -- a random Llama-shaped model (``--size 300m``: d_model 1024 x 24 layers, GQA 16/8 heads,
d_mlp 2816, vocab 32000, 345M parameters; ``1b``: TinyLlama's shape, 1.1B) is written as sharded
bf16 safetensors in a temp dir, then imported in bf16 by ``wb.from_hf`` and by transformers'
``AutoModelForCausalLM.from_pretrained``, each in a fresh process, in turns:

    peak RSS rise / model bytes     target <= 1.3 (ours); transformers' printed beside it
    wall time ours / transformers   target <= 1.2
    import + first forward          the forward reads every weight, so lazy mapping is no advantage

``--dtype bfloat16`` (default) is the file's dtype: on the CPU both libraries map the file and
read nothing at import; ``--dtype float32`` makes both convert every tensor.

Each process first imports a tiny model of the same family (the libraries' code loaded on first
use is not weights), then reads its RSS, imports, and reads its peak RSS (``VmHWM``: a child's
``getrusage`` ru_maxrss starts at its parent's peak, since Linux keeps it across exec). The
files are read once before the runs, so both read from the page cache.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
import workbench as wb  # noqa: E402
from _timing import interleaved  # noqa: E402


def build(directory: Path):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=8, n_inner=1024, vocab_size=4096,
                                     n_positions=256, bos_token_id=None, eos_token_id=None)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    _word_tokenizer().save_pretrained(directory)  # the bridge wants a tokenizer; a local one
    load = lambda **kw: transformers.AutoModelForCausalLM.from_pretrained(directory, **kw).eval()  # noqa: E731
    return load(), load(attn_implementation="eager"), load(), wb.from_hf(directory)


def _word_tokenizer(vocab: int = 4096):
    """A local word-level tokenizer ("w0 w1 ..."): the bridge and nnsight want one beside the weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def main(argv=None) -> pd.DataFrame:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["import"]:
        return main_import(argv[1:])
    if argv[:1] == ["forward"]:
        argv = argv[1:]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pos", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    from transformer_lens.model_bridge import TransformerBridge

    with tempfile.TemporaryDirectory() as tmp:
        hf_sdpa, hf_eager, hf_for_bridge, ours = build(Path(tmp))
        bridge = TransformerBridge.boot_transformers(
            tmp, hf_model=hf_for_bridge, tokenizer=AutoTokenizer.from_pretrained(tmp), device="cpu"
        )
    tokens = torch.randint(0, 4096, (args.batch, args.pos))
    contenders = {
        "hf forward (sdpa)": lambda: hf_sdpa(tokens).logits,
        "hf forward (eager)": lambda: hf_eager(tokens).logits,
        "ours forward": lambda: ours(tokens),
        "ours run_with_cache": lambda: ours.run_with_cache(tokens),
        "bridge forward": lambda: bridge(tokens),
        "bridge run_with_cache": lambda: bridge.run_with_cache(tokens),
    }
    with torch.no_grad():
        reference = hf_sdpa(tokens).logits
        diffs = {"ours forward": (ours(tokens) - reference).abs().max().item(),
                 "bridge forward": (bridge(tokens) - reference).abs().max().item()}
        # the first round was a warm-up, dropped from the medians
        times = interleaved(contenders, max(1, args.repeats - 1), warmup=args.repeats > 1)
    base = times["hf forward (sdpa)"]
    rows = []
    for name, median in times.items():
        rows.append({"contender": name, "median_s": median, "ratio_to_hf": median / base,
                     "tokens_per_s": args.batch * args.pos / median, "max_abs_logit_diff": diffs.get(name)})
    table = pd.DataFrame(rows)
    with pd.option_context("display.float_format", "{:.4g}".format, "display.width", 120):
        print(f"GPT-2 shape d256 x4 layers, batch {args.batch} x {args.pos} tokens, {args.repeats} repeats, "
              f"{args.threads} threads")
        print(table.to_string(index=False))
    ratio = table.set_index("contender").loc["ours forward", "ratio_to_hf"]
    print(f"ours forward / hf forward = {ratio:.2f}x (target <= 1.15x): {'ok' if ratio <= 1.15 else 'MISSED'}")
    return table


# ---- import: peak memory and wall time against transformers ------------------------------------------
SIZES = {  # Llama-shaped; "1b" is TinyLlama-1.1B's shape
    "300m": dict(d_model=1024, n_layers=24, n_heads=16, n_kv_heads=8, d_mlp=2816, d_vocab=32000),
    "1b": dict(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_mlp=5632, d_vocab=32000),
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=128, d_vocab=256),
    "small": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_mlp=1408, d_vocab=8192),  # 33M
    "8b": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_mlp=14336, d_vocab=128256),  # Llama-3.1-8B's shape
}
LLAMA = dict(n_ctx=2048, norm="rmsnorm", positional="rope", ffn="swiglu", bias=False, tie_embeddings=False)

# Runs in a fresh process: argv = contender, warm-up dir, model dir, device.
_CHILD = """
import json, sys, time, torch
who, warm, path, device, dtype = sys.argv[1:6]
dtype = getattr(torch, dtype)
torch.set_num_threads(2)
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096
def hwm(): return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) * 1024
def sync():
    if device != 'cpu':
        torch.cuda.synchronize()
if who == 'ours':
    import workbench as wb
    load = lambda p: wb.from_hf(p, dtype=dtype, device=device)
    forward = lambda m, t: m(t)
else:
    import transformers
    where = {} if device == 'cpu' else {'device_map': device}
    load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(p, dtype=dtype, **where)
    forward = lambda m, t: m(t).logits
load(warm)
before = rss()
start = time.perf_counter()
model = load(path)
sync()
seconds = time.perf_counter() - start
peak_import = hwm()
tokens = torch.randint(0, 256, (1, 16), device=device)  # within every size's vocabulary (tiny: 256)
start = time.perf_counter()
with torch.no_grad():
    forward(model, tokens)
sync()
params = {id(p): p for p in model.parameters()}.values()
print(json.dumps({'seconds': seconds, 'forward_seconds': time.perf_counter() - start, 'before': before,
                  'peak_import': peak_import, 'peak_forward': hwm(),
                  'model_bytes': sum(p.numel() * p.element_size() for p in params),
                  'gpu_peak': torch.cuda.max_memory_allocated() if device != 'cpu' else 0}))
"""


def _write_llama(directory: Path, size: str, shard: str) -> int:
    """A random Llama-shaped model of ``size`` as bf16 safetensors shards; returns the parameter count."""
    cfg = wb.ModelConfig(**SIZES[size], **LLAMA, seed=0)
    model = wb.HookedDecoder(cfg).to(torch.bfloat16)
    wb.to_hf(model, directory, max_shard_size=shard)
    return sum(p.numel() for p in model.parameters())


def _run_child(who: str, warm: Path, path: Path, device: str, dtype: str) -> dict:
    import json
    import subprocess

    # the repo first, then whatever the caller's path holds (packages installed beside the interpreter's)
    search = [str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(search)}
    run = subprocess.run([sys.executable, "-c", _CHILD, who, str(warm), str(path), device, dtype],
                         capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"{who} import failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main_import(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["300m", "1b"], default="300m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shard", default="400MB", help="max shard size of the saved model (default 400MB)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the import's target device")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                        help="the import's target dtype (the file is bf16; float32 makes both libraries convert)")
    parser.add_argument("--dir", type=Path, default=None, help="keep the saved model here (default: a temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.dir or Path(tmp)
        path, warm = root / f"llama-{args.size}", root / "llama-tiny"
        if not (path / "config.json").exists():
            started = time.perf_counter()
            n = _write_llama(path, args.size, args.shard)
            print(f"wrote {n / 1e6:.0f}M parameters as {len(list(path.glob('*.safetensors')))} bf16 shards "
                  f"in {time.perf_counter() - started:.0f} s")
        if not (warm / "config.json").exists():
            _write_llama(warm, "tiny", args.shard)
        for f in path.glob("*.safetensors"):  # into the page cache, for both contenders alike
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
        rows = []
        for repeat in range(args.repeats):
            for who in ("ours", "transformers"):
                r = _run_child(who, warm, path, args.device, args.dtype)
                rows.append({"contender": who, "repeat": repeat, "seconds": r["seconds"],
                             "first_forward_s": r["forward_seconds"],
                             "peak_rise_ratio": (r["peak_import"] - r["before"]) / r["model_bytes"],
                             "after_forward_ratio": (r["peak_forward"] - r["before"]) / r["model_bytes"],
                             "model_gib": r["model_bytes"] / 2**30, "gpu_peak_gib": r["gpu_peak"] / 2**30})
    table = pd.DataFrame(rows)
    summary = table.groupby("contender").median(numeric_only=True).drop(columns="repeat")
    with pd.option_context("display.float_format", "{:.3g}".format, "display.width", 120):
        print(f"import of a {args.size} Llama-shaped bf16 checkpoint to {args.device} in {args.dtype}, "
              f"median of {args.repeats} fresh processes each, interleaved")
        print(summary.to_string())
    ours, theirs = summary.loc["ours"], summary.loc["transformers"]
    time_ratio = ours.seconds / theirs.seconds
    print(f"peak RSS rise / model bytes: ours {ours.peak_rise_ratio:.2f} (target <= 1.3: "
          f"{'ok' if ours.peak_rise_ratio <= 1.3 else 'MISSED'}), transformers {theirs.peak_rise_ratio:.2f}")
    print(f"wall time ours / transformers = {time_ratio:.2f}x (target <= 1.2x: {'ok' if time_ratio <= 1.2 else 'MISSED'}); "
          f"ours {ours.seconds:.2f} s, transformers {theirs.seconds:.2f} s")
    both = (ours.seconds + ours.first_forward_s) / (theirs.seconds + theirs.first_forward_s)
    print(f"import + first forward (1 x 16 tokens, which reads every weight) ours / transformers = {both:.2f}x; "
          f"peak RSS rise after it / model bytes: ours {ours.after_forward_ratio:.2f}, "
          f"transformers {theirs.after_forward_ratio:.2f}")
    return table


if __name__ == "__main__":
    main()
