"""A read analysis over a dataset: the logit lens aggregated over every real token of N prompts
of different lengths (stories-task validation text cut to lengths spread from 25% to 100% of
the context), streamed in batches.

Prints the seconds and the process's peak resident memory, and checks the aggregate against
the per-token table of the same prompts (the same means). Run it once per batch size to see
that memory follows the batch, not the dataset:

    python benchmarks/dataset_lens.py [--prompts 256] [--batch-size 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, no install needed
import workbench as wb  # noqa: E402
import workbench.analysis as an  # noqa: E402
from workbench.analysis.reference import task_from_meta  # noqa: E402
from workbench.checkpoint import read_meta  # noqa: E402
from _memory import peak_mb  # noqa: E402  (the benchmarks' folder is on sys.path: the script's own)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "stories-2026"))
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = wb.load_checkpoint(args.checkpoint)
    model.eval()
    n_ctx = model.cfg.n_ctx
    rows = task_from_meta(read_meta(args.checkpoint)).batch(args.prompts, n_ctx, split="val").tolist()
    lengths = np.linspace(n_ctx // 4, n_ctx, len(rows)).round().astype(int).tolist()
    ds = wb.TokenBatch.from_ids([r[:n] for r, n in zip(rows, lengths)], model.tokenizer.pad_id, "left")
    before = peak_mb()  # VmHWM: this process's own peak (ru_maxrss would carry a parent's across exec)
    start = time.perf_counter()
    table = an.logit_lens(model, ds, batch_size=args.batch_size, aggregate=True)
    seconds = time.perf_counter() - start
    peak = peak_mb()
    print(f"{len(ds)} prompts of {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} real), batch {args.batch_size}: "
          f"{seconds:.2f} s, peak RSS {peak:.0f} MiB (+{peak - before:.0f} MiB during the lens)")
    print(table[["layer_label", "n_tokens", "kl_to_final", "top1_accuracy"]].to_string(index=False))
    few = wb.TokenBatch(ds.tokens[::8], ds.attention_mask[::8], "left")  # the check: 1 prompt in 8
    per_token = an.logit_lens(model, few, k=1, batch_size=args.batch_size)
    check = an.logit_lens(model, few, k=1, batch_size=args.batch_size, aggregate=True)
    np.testing.assert_allclose(check.kl_to_final, per_token.groupby("layer").kl_to_final.mean(), rtol=1e-5)


if __name__ == "__main__":
    main()
