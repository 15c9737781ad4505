"""SynthSAEBench (SAE Lens' ``sae_lens.synthetic``): every dictionary kind scored against known features.

SAE Lens' generator builds a ground-truth dictionary of ``--features`` unit directions in
``--hidden`` dimensions (Zipfian firing probabilities from 0.3 down to 0.01, a hierarchy of
features whose children fire only with their parent, low-rank correlations, firing magnitudes
``relu(1 + 0.1 N(0,1))``, a bias of norm 1) and samples activations from it. On each seed's
generator this trains the workbench's ReLU, TopK, BatchTopK, JumpReLU and Matryoshka BatchTopK
dictionaries (``train_sae``), and, when SAE Lens imports, SAE Lens' own trainers of the same five
kinds (``sae_lens.synthetic.train_toy_sae``) with the same width, k, samples, batch size, peak
learning rate and seed. Every dictionary is scored by SAE Lens' ``eval_sae_on_synthetic_data`` on
the same held-out samples (MCC, F1 / precision / recall, uniqueness, explained variance, L0, dead
latents, shrinkage); ``workbench.analysis.synth_bench.evaluate`` is scored beside it as a check
that it reproduces SAE Lens' numbers (``max |ours - SAE Lens|`` in config.json).

The benchmark paper's SynthSAEBench-16k model (16,384 features) is published on the Hugging Face
Hub, which this machine cannot reach, and its training budget is far past a 2-core CPU: the
default here is the same generator at 256 features in 48 dimensions with 256 latents, 50k
training samples per dictionary
(``--features/--hidden/--latents``), so its numbers are not the paper's 16k numbers.

Without SAE Lens (as in CI) the data come from ``synth_bench.SimpleSynthModel`` (the same Zipfian
probabilities and magnitudes, no hierarchy or correlations), only the workbench's trainers run,
and only the workbench's evals score them.

    PYTHONPATH=/work/saelens python experiments/synth_sae_bench.py --seeds 3 --threads 2
"""

from __future__ import annotations

import time
import warnings

import _common

NAME = "synth_sae_bench"
KINDS = ["relu", "topk", "batchtopk", "jumprelu", "matryoshka_batchtopk"]
METRICS = ["classification/f1_score", "mcc", "classification/precision", "classification/recall", "uniqueness",
           "explained_variance", "sae_l0", "dead_latents", "shrinkage"]


def add_flags(p) -> None:
    p.add_argument("--features", type=int, default=256, help="ground-truth features (the paper's model: 16384)")
    p.add_argument("--hidden", type=int, default=48, help="hidden size of the activations")
    p.add_argument("--latents", type=int, default=256, help="dictionary width (the paper: as many as features)")
    p.add_argument("--k", type=float, default=0, help="TopK-style k (0: the generator's true L0, rounded)")
    p.add_argument("--samples", type=int, default=50_000, help="training samples per dictionary")
    p.add_argument("--batch-size", type=int, default=512, help="samples per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate, both trainers")
    p.add_argument("--eval-samples", type=int, default=20_000, help="held-out samples scored per dictionary")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated dictionary kinds")
    p.add_argument("--no-saelens", action="store_true", help="do not use SAE Lens even when it imports")


def parse_kinds(text: str) -> list[str]:
    from workbench.analysis.dictionaries import DICTIONARIES

    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in DICTIONARIES or k not in KINDS]
    if unknown or not kinds:
        raise SystemExit(f"--kinds: unknown dictionary kind(s) {unknown or [text]}; registered kinds are "
                         f"{list(DICTIONARIES)} (this benchmark trains the SAEs among them: {KINDS})")
    return kinds


def generator(args, seed: int, sae_lens):
    """(model, true features, sample(n) -> (hidden, feature acts)) of one seed."""
    import torch

    from workbench.analysis.synth_bench import SimpleSynthModel

    if sae_lens is None:
        model = SimpleSynthModel(args.features, args.hidden, seed=seed)
        return model, model.feature_vectors, model.sample_with_features
    from sae_lens.synthetic import (HierarchyConfig, LowRankCorrelationConfig, SyntheticModel, SyntheticModelConfig,
                                    ZipfianFiringProbabilityConfig)

    roots = max(1, args.features // 16)
    cfg = SyntheticModelConfig(
        num_features=args.features, hidden_dim=args.hidden,
        firing_probability=ZipfianFiringProbabilityConfig(exponent=1.0, max_prob=0.3, min_prob=0.01),
        hierarchy=HierarchyConfig(total_root_nodes=roots, branching_factor=(2, 4), max_depth=2,
                                  mutually_exclusive_portion=0.5),
        correlation=LowRankCorrelationConfig(rank=16, correlation_scale=0.1, seed=seed),
        std_firing_magnitudes=0.1, mean_firing_magnitudes=1.0, bias=1.0, seed=seed)
    torch.manual_seed(seed)
    model = SyntheticModel(cfg)
    return model, model.feature_dict.feature_vectors.detach(), model.sample_with_features


def train_ours(kind, data, args, k, seed):
    from workbench.analysis.dictionaries import train_sae
    from workbench.analysis.store import TensorActivations

    steps = max(1, args.samples // args.batch_size)
    widths = ",".join(str(args.latents >> i) for i in (3, 2, 1, 0))
    return train_sae(TensorActivations({"x": data}, rows_per_shard=min(len(data), 65536)), kind=kind,
                     d_sae=args.latents, k=k, steps=steps, batch_size=args.batch_size, lr=args.lr,
                     warmup_steps=min(100, steps // 10), eval_rows=min(4096, len(data) // 10), seed=seed,
                     matryoshka_widths=widths if kind == "matryoshka_batchtopk" else "", progress=False,
                     threads=args.threads, device="cpu", save_train_state=False)


def train_saelens(kind, model, args, k, seed):
    import torch
    from sae_lens import (BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig, JumpReLUTrainingSAE,
                          JumpReLUTrainingSAEConfig, MatryoshkaBatchTopKTrainingSAE,
                          MatryoshkaBatchTopKTrainingSAEConfig, StandardTrainingSAE, StandardTrainingSAEConfig,
                          TopKTrainingSAE, TopKTrainingSAEConfig)
    from sae_lens.synthetic import train_toy_sae

    common = dict(d_in=args.hidden, d_sae=args.latents)
    widths = [args.latents >> i for i in (3, 2, 1, 0)]
    make = {"relu": lambda: StandardTrainingSAE(StandardTrainingSAEConfig(**common)),
            "topk": lambda: TopKTrainingSAE(TopKTrainingSAEConfig(k=int(k), **common)),
            "batchtopk": lambda: BatchTopKTrainingSAE(BatchTopKTrainingSAEConfig(k=k, **common)),
            "jumprelu": lambda: JumpReLUTrainingSAE(JumpReLUTrainingSAEConfig(**common)),
            "matryoshka_batchtopk": lambda: MatryoshkaBatchTopKTrainingSAE(
                MatryoshkaBatchTopKTrainingSAEConfig(k=k, matryoshka_widths=widths, **common))}
    torch.manual_seed(seed)
    sae = make[kind]()
    steps = max(1, args.samples // args.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_toy_sae(sae, model.feature_dict, model.activation_generator, training_samples=steps * args.batch_size,
                      batch_size=args.batch_size, lr=args.lr, lr_warm_up_steps=min(100, steps // 10),
                      lr_decay_steps=steps // 5)
    return sae


def run_seed(args, seed, sae_lens, kinds):
    import torch

    from workbench.analysis import synth_bench

    torch.manual_seed(seed)
    model, features, sample = generator(args, seed, sae_lens)
    steps = max(1, args.samples // args.batch_size)
    with torch.no_grad():
        data, _ = sample(steps * args.batch_size)
        held_x, held_acts = sample(args.eval_samples)
    true_l0 = float((held_acts > 0).sum(1).float().mean())
    k = args.k or max(1, round(true_l0))
    rows = []
    trainers = [("workbench", train_ours)] + ([("sae_lens", train_saelens)] if sae_lens is not None else [])
    for trainer, train in trainers:
        for kind in kinds:
            t0 = time.time()
            sae = train(kind, data if trainer == "workbench" else model, args, k, seed)
            seconds = time.time() - t0
            sae.eval()
            ours = synth_bench.evaluate(sae, features, held_x, held_acts)
            row = {"trainer": trainer, "kind": kind, "seed": seed, "k": k, "train_seconds": round(seconds, 1)}
            if sae_lens is not None:
                from sae_lens.synthetic import eval_sae_on_synthetic_data

                gen = _Replay(held_acts)
                theirs = synth_bench.saelens_result_dict(eval_sae_on_synthetic_data(
                    sae, model.feature_dict, gen, num_samples=len(held_acts), batch_size=8192))
                row.update(theirs, evals="sae_lens")
                row["evals_max_abs_diff"] = max(abs(ours[key] - theirs[key]) for key in ours if key != "dead_latents")
                row["dead_latents_diff"] = abs(ours["dead_latents"] - theirs["dead_latents"])
            else:
                row.update(ours, evals="workbench")
            rows.append(row)
            print(f"seed {seed} {trainer:9s} {kind:21s} F1 {row['classification/f1_score']:.3f} "
                  f"MCC {row['mcc']:.3f} L0 {row['sae_l0']:.1f} ({seconds:.0f}s)", flush=True)
    return rows


class _Replay:
    """An activation generator that hands SAE Lens' evals the held-out feature activations, in order."""

    def __init__(self, acts):
        self.acts, self.at = acts, 0

    def sample(self, n):
        out = self.acts[self.at:self.at + n]
        self.at += n
        return out


def main(argv=None):
    from workbench.analysis import synth_bench

    p = _common.parser(NAME, __doc__)
    add_flags(p)
    args = p.parse_args(argv)
    kinds = parse_kinds(args.kinds)
    if args.quick:
        args.features, args.hidden, args.latents, args.samples, args.eval_samples = 64, 16, 64, 4096, 1024
        args.batch_size = 256
        args.no_saelens = True  # seconds, and the same in CI whatever is installed
    steps = max(1, args.samples // args.batch_size)
    synth_bench.check_fits(args.features, args.hidden, args.latents, steps * args.batch_size + args.eval_samples,
                           args.batch_size)
    sae_lens, why = (None, "--no-saelens") if args.no_saelens else synth_bench.import_sae_lens()
    if sae_lens is None:
        print(f"SAE Lens not used ({why}): the stand-in generator, workbench trainers and evals only")
    _common.setup(args)
    gathered = _common.run_grid(_common.seeds(args), lambda seed: run_seed(args, seed, sae_lens, kinds), desc="seeds")
    if gathered is None:
        return None
    numbers, readable = _common.with_intervals(gathered, ["trainer", "kind"], METRICS)
    figures = {"f1": _common.interval_bars(numbers.assign(cell=numbers.trainer + " " + numbers.kind), "cell",
                                           "classification/f1_score", "feature F1 by trainer and kind")}
    config = {"experiment": NAME, **vars(args), "sae_lens": getattr(sae_lens, "__version__", None),
              "sae_lens_unused_because": why or None,
              "generator": "sae_lens.synthetic.SyntheticModel" if sae_lens else "synth_bench.SimpleSynthModel"}
    if "evals_max_abs_diff" in gathered:
        config["evals_max_abs_diff"] = float(gathered["evals_max_abs_diff"].max())
    _common.write_run(args.out, config, gathered, figures, readable, tables={"summary": numbers},
                      title=f"SynthSAEBench, {args.seeds} seed(s): mean [95% interval]")
    return gathered


if __name__ == "__main__":
    main()
