"""Sparse-dictionary speed as ratios within one run: collection, training, and store reading.

  1. Activation collection (``ActivationStore.collect``: forward, keep rows, write sharded
     safetensors with checksums and a manifest) against a plain no-hook forward over the same
     tokens. Target <= 1.2x. Collection stops after the hook's block, so a mid-layer hook can cost
     less than the full forward; the last block's output is timed too (no early stop).
  2. Dictionary training (``train_sae``, TopK: shuffle buffer, input scaling, decoder-norm
     projection, dead-feature counts, AuxK when features die) against a minimal plain-PyTorch
     TopK SAE loop on the same in-memory activations. Target >= 0.95x its tokens/s.
  3. Store reading (``store.batches``: shuffled float32 batches) against the disk's sequential
     read rate of the same shard files, both from a cold page cache (posix_fadvise DONTNEED).

    python benchmarks/dictionaries.py [--checkpoint checkpoints/stories-2026] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
sys.path.insert(0, str(Path(__file__).resolve().parent))
import workbench as wb  # noqa: E402
from _timing import interleaved  # noqa: E402
from workbench import analysis as an  # noqa: E402
from workbench.data import get_task  # noqa: E402


def collection(model, task, hook: str, n_batches: int, batch: int, seq_len: int, repeats: int) -> dict:
    batches = [task.batch(batch, seq_len, step=j) for j in range(n_batches)]
    tokens = n_batches * batch * (seq_len - 1)
    root = Path(tempfile.mkdtemp(prefix="bench-acts-"))

    def plain() -> None:
        with torch.no_grad():
            for b in batches:
                model(b, return_type=None)

    def collect(h: str):
        def run() -> None:
            out = root / f"s-{time.perf_counter_ns()}"
            an.ActivationStore.collect(model, torch.cat(batches), h, tokens, out, batch_size=batch, seq_len=seq_len,
                                       tokens_per_shard=tokens // 4, progress=False)
            shutil.rmtree(out)
        return run

    last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    times = interleaved({"plain": plain, "collect": collect(hook), "collect_last": collect(last)}, repeats)
    shutil.rmtree(root, ignore_errors=True)
    return {"tokens": tokens, **times}


def plain_topk_loop(x: torch.Tensor, d_sae: int, k: int, batch: int, steps: int, lr: float,
                    device: str = "cpu") -> float:
    """The minimal TopK SAE: encode, keep k, decode, MSE, Adam. Returns rows/s over ``steps`` (after one warm-up).
    ``x`` stays where it is (CPU memory, as a store's shards are); each batch is gathered there and moved to
    ``device``, the path ``train_sae`` takes."""
    torch.manual_seed(0)
    d = x.shape[1]
    W_dec = torch.randn(d_sae, d, device=device)
    W_dec /= W_dec.norm(dim=1, keepdim=True)
    params = [torch.nn.Parameter(W_dec.T.clone()), torch.nn.Parameter(torch.zeros(d_sae, device=device)),
              torch.nn.Parameter(W_dec), torch.nn.Parameter(x[:4096].mean(0).to(device))]
    W_enc, b_enc, W_dec, b_dec = params
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(0)
    start = None
    for step in range(steps + 1):
        if step == 1:
            start = time.perf_counter()
        rows = x[torch.randint(0, len(x), (batch,), generator=gen)].to(device, non_blocking=True)
        pre = (rows - b_dec) @ W_enc + b_enc
        values, indices = pre.topk(k, dim=-1, sorted=False)
        acts = torch.zeros_like(pre).scatter_(-1, indices, values.relu())
        loss = ((acts @ W_dec + b_dec) - rows).pow(2).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
    return steps * batch / (time.perf_counter() - start)


def ours_topk(x: torch.Tensor, d_sae: int, k: int, batch: int, steps: int, lr: float, device: str = "cpu") -> float:
    """``train_sae`` on the same rows (on ``device``); rows/s from its own log (setup and final evaluation excluded)."""
    source = an.TensorActivations({"x": x}, rows_per_shard=len(x) // 4)
    window = max(1, steps // 3)  # logged every `window` steps, as a run would (a row costs a few reductions)
    sae = an.train_sae(source, kind="topk", d_sae=d_sae, k=k, steps=window * 4, batch_size=batch, lr=lr,
                       warmup_steps=0, log_every=window, eval_rows=batch, progress=False, buffer_shards=2, device=device)
    rates = sae.history["tokens_per_s"].tolist()[1:]  # the first window includes the warm-up step
    return len(rates) / sum(1 / r for r in rates)  # rows over total time, not a mean of rates


def drop_cache(files) -> None:
    os.sync()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def reading(model, task, hook: str, rows: int, batch: int, repeats: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-read-"))
    store = an.ActivationStore.collect(model, task, hook, rows, root / "s", batch_size=32, seq_len=64,
                                       tokens_per_shard=rows // 8, progress=False)
    files = sorted((root / "s").glob("shard_*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    n_batches = store.n_rows // batch - 8  # one epoch, less each group's remainder

    def sequential() -> None:
        drop_cache(files)
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.read(1 << 24):
                    pass

    def stream() -> None:
        drop_cache(files)
        it = store.batches(batch, seed=0, buffer_shards=2)
        for _ in range(n_batches):
            next(it)

    times = interleaved({"sequential": sequential, "store": stream}, repeats)
    shutil.rmtree(root, ignore_errors=True)
    return {"bytes": size, "rows": n_batches * batch, **times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path(__file__).resolve().parents[1] / "checkpoints" / "stories-2026")
    parser.add_argument("--hook", default="blocks.1.hook_resid_post")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--d-sae", type=int, default=2048)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = wb.load_checkpoint(args.checkpoint)
    model.eval()
    task = get_task("stories", seed=0)

    c = collection(model, task, args.hook, n_batches=16, batch=32, seq_len=64, repeats=args.repeats)
    print(f"collection of {c['tokens']:,} tokens at {args.hook}:")
    print(f"  plain forward      {c['tokens'] / c['plain']:>12,.0f} tokens/s")
    print(f"  collect            {c['tokens'] / c['collect']:>12,.0f} tokens/s   {c['collect'] / c['plain']:.2f}x the forward's time (target <= 1.2)")
    print(f"  collect last block {c['tokens'] / c['collect_last']:>12,.0f} tokens/s   {c['collect_last'] / c['plain']:.2f}x (no early stop)")

    x = an.ActivationStore.collect(model, task, args.hook, 65536, Path(tempfile.mkdtemp()) / "x", batch_size=32,
                                   seq_len=64, progress=False).activations()
    batch, lr = 2048, 1e-3
    plain, ours = [], []
    for _ in range(args.repeats):  # alternate, so load from other processes hits both
        plain.append(plain_topk_loop(x, args.d_sae, args.k, batch, args.steps, lr))
        ours.append(ours_topk(x, args.d_sae, args.k, batch, args.steps, lr))
    p, o = statistics.median(plain), statistics.median(ours)
    print(f"TopK training, d_in {x.shape[1]}, d_sae {args.d_sae}, k {args.k}, batch {batch}:")
    print(f"  plain PyTorch loop {p:>12,.0f} tokens/s")
    print(f"  train_sae          {o:>12,.0f} tokens/s   {o / p:.2f}x the plain loop's throughput (target >= 0.95)")

    r = reading(model, task, args.hook, rows=8 * 33 * 32 * 63, batch=4096, repeats=args.repeats)
    print(f"store reading, {r['bytes'] / 2**20:.0f} MiB, cold page cache:")
    print(f"  sequential read    {r['bytes'] / r['sequential'] / 2**20:>12,.0f} MiB/s")
    print(f"  store.batches      {r['bytes'] / r['store'] / 2**20:>12,.0f} MiB/s   {r['rows'] / r['store']:,.0f} rows/s   "
          f"{r['sequential'] / r['store']:.2f}x the sequential rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
