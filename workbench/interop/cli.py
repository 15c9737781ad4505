"""``python -m workbench import-hf`` and ``export-hf``: the interop subcommands.

    python -m workbench import-hf gpt2 --out checkpoints/gpt2                    # a hub id (cache, or download)
    python -m workbench import-hf Qwen/Qwen2.5-0.5B --out checkpoints/qwen --dtype bfloat16
    python -m workbench import-hf path/to/hf-model --out checkpoints/NAME        # a local HF directory
    python -m workbench export-hf checkpoints/NAME --out path/to/hf-model --max-shard-size 2GB
    python -m workbench open-gguf smollm2-135m --prompt "When Mary and John went to the store, John gave a drink to"
    python -m workbench open-gguf path/to/model.gguf --prompt "..." --top 10 --out checkpoints/NAME

``register(subparsers)`` is called by ``workbench/__main__.py``; each command returns an exit
code, and bad input raises ``ValueError`` (printed as one line by the main program). The
output folder is checked before the import starts and written atomically, so a failed import
leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers: argparse._SubParsersAction) -> None:
    imp = subparsers.add_parser(
        "import-hf", help="convert a Hugging Face model (hub id or local directory) into a workbench checkpoint",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    imp.add_argument("source", metavar="ID_OR_DIR",
                     help="a hub id (gpt2, org/name; HF_HUB_OFFLINE=1 reads the cache only) or a local HF model directory")
    imp.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write (e.g. checkpoints/NAME)")
    imp.add_argument("--dtype", choices=DTYPES, default="float32", help="the dtype the checkpoint stores (default float32)")
    imp.add_argument("--revision", default=None, help="a hub revision: branch, tag or commit (hub ids only)")
    imp.add_argument("--n-ctx", type=int, default=None, help="cap the context length (needed below a sliding window)")
    imp.set_defaults(func=cmd_import_hf)

    exp = subparsers.add_parser(
        "export-hf", help="write a workbench checkpoint as a Hugging Face model directory",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    exp.add_argument("checkpoint", type=Path, help="a workbench checkpoint directory")
    exp.add_argument("--out", type=Path, required=True, help="the Hugging Face directory to write")
    exp.add_argument("--dtype", choices=DTYPES, default=None, help="the dtype of the exported weights (default: as stored)")
    exp.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 500MiB (default 5GB)")
    exp.set_defaults(func=cmd_export_hf)

    gg = subparsers.add_parser(
        "open-gguf", help="open a GGUF file or a shipped pretrained model (smollm2-135m) and show its top next tokens",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gg.add_argument("source", metavar="NAME_OR_FILE", help="a pretrained name (smollm2-135m) or a path to a .gguf file")
    gg.add_argument("--prompt", default=None, help="text whose next-token prediction to print")
    gg.add_argument("--top", type=int, default=5, help="how many next tokens to print (default 5)")
    gg.add_argument("--dtype", choices=DTYPES, default="float32", help="the dtype to run in (default float32)")
    gg.add_argument("--cache", type=Path, default=None,
                    help="the model cache folder (default $WORKBENCH_CACHE/models or ~/.cache/workbench/models)")
    gg.add_argument("--out", type=Path, default=None, help="also save the model as a workbench checkpoint here")
    gg.set_defaults(func=cmd_open_gguf)


def cmd_import_hf(args: argparse.Namespace) -> int:
    from workbench.checkpoint import check_replaceable, save_checkpoint
    from workbench.interop.hf import from_hf
    from workbench.interop.hub import resolve_hf_source

    check_replaceable(args.out)  # a folder we may not replace fails now, not after a long import
    model = from_hf(args.source, n_ctx=args.n_ctx, dtype=args.dtype, revision=args.revision)
    directory = resolve_hf_source(args.source, revision=args.revision)  # the snapshot just read (a cache hit)
    family = json.loads(Path(directory, "config.json").read_text())["model_type"]
    meta = {"imported_from": str(args.source), "hf_family": family, "dtype": args.dtype}
    if str(directory) != str(args.source):
        meta.update(hf_snapshot=str(directory), hf_revision=args.revision or "main")
    save_checkpoint(model, args.out, meta=meta)
    tokenizer = "with its tokenizer" if model.tokenizer is not None else "without a tokenizer"
    print(f"imported {args.source} ({sum(p.numel() for p in model.parameters()):,} parameters, {args.dtype}) "
          f"{tokenizer} -> {args.out}")
    return 0


def cmd_open_gguf(args: argparse.Namespace) -> int:
    import time

    import torch

    from workbench.checkpoint import check_replaceable, save_checkpoint
    from workbench.interop.gguf import cache_dir_for, open_gguf, resolve_gguf

    if args.top < 1:
        raise ValueError(f"--top must be at least 1, got {args.top}")
    if args.out is not None:
        check_replaceable(args.out)
    path = resolve_gguf(args.source)
    cached = (cache_dir_for(path, args.cache) / "meta.json").is_file()
    started = time.perf_counter()
    model = open_gguf(path, dtype=args.dtype, cache=args.cache)
    n_params = sum(p.numel() for p in model.parameters())
    how = "from the cache" if cached else "converted into the cache"
    print(f"opened {path.name} ({model.cfg.n_layers} layers, d_model {model.cfg.d_model}, {n_params:,} parameters, "
          f"{args.dtype}) {how} in {time.perf_counter() - started:.1f} s")
    if args.prompt is not None:
        tokens = model.to_tokens(args.prompt)
        with torch.no_grad():
            probs = model(tokens)[0, -1].float().softmax(-1)
        top = probs.topk(min(args.top, probs.numel()))
        print(f"prompt: {args.prompt!r} ({tokens.shape[-1]} tokens)")
        for rank, (p, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            print(f"  {rank:>2}. {model.tokenizer.token_str(i)!r:<20} p={p:.4f}")
    if args.out is not None:
        save_checkpoint(model, args.out, meta={"imported_from": str(path), "dtype": args.dtype})
        print(f"saved -> {args.out}")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from workbench.checkpoint import load_checkpoint
    from workbench.interop.families import hf_family_for
    from workbench.interop.hf import to_hf
    from workbench.interop.streaming import parse_size

    parse_size(args.max_shard_size)  # before the checkpoint is read
    model, _ = load_checkpoint(args.checkpoint, dtype=args.dtype or _stored_dtype(args.checkpoint))
    to_hf(model, args.out, max_shard_size=args.max_shard_size)
    print(f"exported {args.checkpoint} as {hf_family_for(model.cfg)} ({str(model.embed.W_E.dtype)[6:]}) -> {args.out}")
    return 0


def _stored_dtype(checkpoint: Path) -> str:
    """The dtype the checkpoint's weights are stored in (its embedding's), so export keeps it."""
    from safetensors import SafetensorError, safe_open

    from workbench.checkpoint import WEIGHTS_FILE

    try:
        with safe_open(str(checkpoint / WEIGHTS_FILE), framework="pt") as f:
            code = f.get_slice("embed.W_E").get_dtype()
    except (SafetensorError, OSError, KeyError):
        return "float32"  # load_checkpoint reports what is wrong with the file
    return {"BF16": "bfloat16", "F16": "float16"}.get(code, "float32")
