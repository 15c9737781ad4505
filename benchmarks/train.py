"""Training speed of workbench's loop against a plain PyTorch nanoGPT-style loop, as ratios.

At the benchmark size of benchmarks/forward.py (preset "nanogpt-bench": d_model 256,
4 layers, 8 heads, d_mlp 1024, vocab 4096, ctx 256, batch 8) it measures
  - the plain loop: nanoGPT's model, AdamW, clipping, cross-entropy, written here;
  - ``workbench.training.train`` itself (data generation, hooks, logging included),
    its tokens/s read from the metrics it logs every step;
and the machine's fp32 matmul peak in the same run, so MFU = training FLOPs (3x the forward's,
causal attention over n/2 keys on average) / time / peak.  Targets: workbench MFU >= 50% and
step time within 1.15x of the plain loop's.  Rounds alternate plain / workbench / plain /
workbench ... so machine noise hits both; medians are reported.

The snapshot row: the wall time of a whole ``train`` run of ``--snapshot-steps`` steps with 24
log-spaced fp32 weight snapshots (``snapshots="log:24"``) against the same run without them,
both writing their checkpoint to a temporary folder, alternated ``--rounds`` times; target
<= 1.05x. 24 snapshots in 100 steps is far denser than a real run's (24 in thousands), so the
ratio is an upper bound on what snapshots cost. On a shared machine two whole runs differ by
more than the snapshots cost, so the cost of one snapshot write is also timed on its own
(median of 24) and reported as a fraction of the run without snapshots.

    python benchmarks/train.py [--steps 6] [--rounds 2] [--threads 2] [--snapshot-steps 100] [--only-snapshots]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
sys.path.insert(0, str(Path(__file__).resolve().parent))
import workbench as wb  # noqa: E402
from forward import PlainGPT, matmul_peak_gflops  # noqa: E402
from workbench.training import TrainConfig, train  # noqa: E402


def plain_loop_step_times(cfg: wb.ModelConfig, batch: int, steps: int) -> list[float]:
    """nanoGPT's training step: forward, cross-entropy, backward, clip, AdamW; seconds per step."""
    torch.manual_seed(0)
    model = PlainGPT(cfg).train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), foreach=True)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps + 1):  # the first step warms up allocators and the optimizer state
        t0 = time.perf_counter()
        tokens = torch.randint(0, cfg.d_vocab, (batch, cfg.n_ctx), generator=gen)
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.d_vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return times[1:]


def workbench_step_times(cfg: wb.ModelConfig, batch: int, steps: int) -> list[float]:
    """``train`` on random tokens with recurring segments; seconds per step from its own log."""
    config = TrainConfig(task="induction", task_options={"vocab": cfg.d_vocab, "seq_len": cfg.n_ctx}, steps=steps + 1,
                         batch_size=batch, warmup_steps=1, eval_every=0, log_every=1, autocast="none")
    result = train(config, cfg, out_dir=None, progress=False)
    history = result.history.iloc[1:]  # the first step warms up, as in the plain loop
    return [batch * cfg.n_ctx / tps for tps in history["tokens_per_s"]]


def snapshot_run_seconds(cfg: wb.ModelConfig, batch: int, steps: int, snapshots) -> float:
    """Wall time of one whole ``train`` run into a temporary folder, with or without snapshots."""
    config = TrainConfig(task="induction", task_options={"vocab": cfg.d_vocab, "seq_len": cfg.n_ctx}, steps=steps,
                         batch_size=batch, warmup_steps=1, eval_every=0, eval_batches=1, log_every=10,
                         autocast="none", save_train_state=False, snapshots=snapshots)
    folder = Path(tempfile.mkdtemp(prefix="bench-snapshots-"))
    try:
        started = time.perf_counter()
        train(config, cfg, out_dir=folder / "run", progress=False)
        return time.perf_counter() - started
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def snapshot_write_seconds(cfg: wb.ModelConfig, writes: int = 24) -> float:
    """Median seconds of one fp32 snapshot write of a model of ``cfg`` (weights, index, ownership)."""
    from workbench.snapshots import SnapshotWriter

    model = wb.HookedDecoder(cfg)
    folder = Path(tempfile.mkdtemp(prefix="bench-snapshot-write-"))
    try:
        writer = SnapshotWriter(folder / "run", range(writes), fp16=False)
        times = []
        for step in range(writes):
            started = time.perf_counter()
            writer.write(model, step, {"train_loss": 1.0, "lr": 1e-3, "grad_norm": 1.0})
            times.append(time.perf_counter() - started)
        return statistics.median(times)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each loop")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--snapshot-steps", type=int, default=100,
                        help="steps of each run in the snapshot comparison (>= 24; 0 skips it)")
    parser.add_argument("--only-snapshots", action="store_true", help="skip the plain-loop comparison")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = wb.ModelConfig.from_preset("nanogpt-bench", seed=0)
    if args.only_snapshots:
        print(f"config: nanogpt-bench, batch {args.batch}; torch threads {torch.get_num_threads()}")
        rows: list = []
        snapshot_rows(cfg, args, rows)
        _print_rows(rows)
        return
    plain, hooked, peaks = [], [], []
    for _ in range(args.rounds):  # the peak is re-measured next to each loop: a shared machine's speed drifts
        peaks.append(matmul_peak_gflops(d=cfg.d_model))
        plain += plain_loop_step_times(cfg, args.batch, args.steps)
        peaks.append(matmul_peak_gflops(d=cfg.d_model))
        hooked += workbench_step_times(cfg, args.batch, args.steps)
    peak = max(peaks)
    tokens = args.batch * cfg.n_ctx
    flops = 3 * wb.forward_flops_per_token(cfg, context=cfg.n_ctx // 2) * tokens
    t_plain, t_hooked = statistics.median(plain), statistics.median(hooked)
    mfu_plain, mfu_hooked = flops / t_plain / 1e9 / peak, flops / t_hooked / 1e9 / peak
    print(f"config: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, d_mlp {cfg.d_mlp}, vocab "
          f"{cfg.d_vocab}, ctx {cfg.n_ctx}, batch {args.batch}; torch threads {torch.get_num_threads()}; "
          f"{len(plain)} timed steps each")
    print(f"matmul peak: {peak:.0f} GFLOP/s (fp32, best of {len(peaks)}: {', '.join(f'{p:.0f}' for p in peaks)}); "
          f"training FLOPs per step: {flops / 1e9:.2f} G")
    for name, t, mfu in (("plain loop", t_plain, mfu_plain), ("workbench train", t_hooked, mfu_hooked)):
        print(f"  {name:>15}: {t * 1e3:8.1f} ms/step  {tokens / t:8.0f} tok/s  MFU {mfu:5.1%}")
    rows = [
        ("workbench MFU", mfu_hooked, ">= 0.50", mfu_hooked >= 0.50),
        ("step time, workbench / plain loop", t_hooked / t_plain, "<= 1.15", t_hooked / t_plain <= 1.15),
    ]
    snapshot_rows(cfg, args, rows)
    _print_rows(rows)


def snapshot_rows(cfg: wb.ModelConfig, args: argparse.Namespace, rows: list) -> None:
    """The snapshot rows: whole runs with and without 24 snapshots, and one write timed alone."""
    if not args.snapshot_steps:
        return
    without, with_snapshots = [], []
    for _ in range(args.rounds):
        without.append(snapshot_run_seconds(cfg, args.batch, args.snapshot_steps, None))
        with_snapshots.append(snapshot_run_seconds(cfg, args.batch, args.snapshot_steps, "log:24"))
    run = statistics.median(without)
    ratio = statistics.median(with_snapshots) / run
    write = snapshot_write_seconds(cfg)
    print(f"  {args.snapshot_steps}-step run: {run:.1f} s without snapshots, {statistics.median(with_snapshots):.1f} s "
          f"with 24 log-spaced ones (runs: {', '.join(f'{t:.0f}' for t in without)} / "
          f"{', '.join(f'{t:.0f}' for t in with_snapshots)} s); one snapshot write {write * 1e3:.0f} ms")
    rows.append(("run time, 24 snapshots / none", ratio, "<= 1.05", ratio <= 1.05))
    rows.append(("24 writes alone / run without", 1 + 24 * write / run, "<= 1.05", 24 * write / run <= 0.05))


def _print_rows(rows: list) -> None:
    print()
    print(f"{'measure':36} {'value':>7} {'target':>8}  met")
    for name, value, target, ok in rows:
        print(f"{name:36} {value:7.2f} {target:>8}  {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
