"""``python -m workbench import-hf`` and ``export-hf``: the interop subcommands.

    python -m workbench import-hf path/to/hf-model --out checkpoints/NAME   # HF dir -> our checkpoint
    python -m workbench export-hf checkpoints/NAME --out path/to/hf-model   # our checkpoint -> HF dir

``register(subparsers)`` is called by ``workbench/__main__.py``; each command returns an exit
code, and bad input raises ``ValueError`` (printed as one line by the main program).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    imp = subparsers.add_parser(
        "import-hf", help="convert a local Hugging Face model directory into a workbench checkpoint",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    imp.add_argument("source", type=Path, metavar="DIR", help="a Hugging Face model directory (config.json + weights)")
    imp.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write (e.g. checkpoints/NAME)")
    imp.add_argument("--n-ctx", type=int, default=None, help="cap the context length (needed below a sliding window)")
    imp.set_defaults(func=cmd_import_hf)

    exp = subparsers.add_parser(
        "export-hf", help="write a workbench checkpoint as a Hugging Face model directory",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    exp.add_argument("checkpoint", type=Path, help="a workbench checkpoint directory")
    exp.add_argument("--out", type=Path, required=True, help="the Hugging Face directory to write")
    exp.set_defaults(func=cmd_export_hf)


def cmd_import_hf(args: argparse.Namespace) -> int:
    from workbench.checkpoint import save_checkpoint
    from workbench.interop.hf import from_hf

    model = from_hf(args.source, n_ctx=args.n_ctx)
    family = json.loads(Path(args.source, "config.json").read_text())["model_type"]
    save_checkpoint(model, args.out, meta={"imported_from": str(args.source), "hf_family": family})
    tokenizer = "with its tokenizer" if model.tokenizer is not None else "without a tokenizer"
    print(f"imported {args.source} ({sum(p.numel() for p in model.parameters()):,} parameters) {tokenizer} -> {args.out}")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from workbench.checkpoint import load_checkpoint
    from workbench.interop.families import hf_family_for
    from workbench.interop.hf import to_hf

    model, _ = load_checkpoint(args.checkpoint)
    to_hf(model, args.out)
    print(f"exported {args.checkpoint} as {hf_family_for(model.cfg)} -> {args.out}")
    return 0
