"""SynthSAEBench (SAE Lens' ``sae_lens.synthetic``): the workbench's trainers against SAE Lens' at equal L0.

SAE Lens' generator builds a ground-truth dictionary of ``--features`` unit directions in
``--hidden`` dimensions and samples activations from it (``--recipe synth16k``: SynthSAEBench-16k's
settings, Zipfian firing probabilities, trees of mutually exclusive children, low-rank
correlations, magnitudes 5 down to 4, bias 0.5, orthogonalised features; ``--recipe small``: the
earlier CPU recipe). On each seed's generator this trains the workbench's ReLU, TopK, BatchTopK,
JumpReLU and Matryoshka BatchTopK dictionaries (``train_sae``) and, when SAE Lens imports, SAE
Lens' own trainers of the same kinds (``sae_lens.synthetic.train_toy_sae``) with the same width,
k, samples, batch size, learning rate, warm-up and seed. Every dictionary is scored by SAE Lens'
``eval_sae_on_synthetic_data`` on the same held-out samples (MCC, F1 / precision / recall,
uniqueness, explained variance, L0, dead latents, shrinkage); ``synth_bench.evaluate`` is scored
beside it as a check (``max |ours - SAE Lens|`` in config.json).

Equal L0: the TopK-style kinds run at k (k = the mean number of firing features among the
``--latents`` most frequent, rounded; matched when L0 is within 10% of k). ReLU and JumpReLU run at
``--sweep`` multiples of each trainer's base coefficient, and their metrics are interpolated at
L0 = k (linear in log L0 between the two runs that bracket it; never extrapolated). Tables:
summary.csv (equal-L0 means and 95% intervals), equal_l0.csv (per seed), sweep.csv (every run),
verdicts.csv (workbench minus SAE Lens on F1 and MCC, paired by seed).

SynthSAEBench-16k itself (``--recipe synth16k --features 16384 --hidden 768 --latents 4096
--gen-seed 42``) is far past a 2-core CPU (docs/reference/synth-sae-bench.md says how far).
Without SAE Lens (as in CI, and always under ``--quick``) the data come from
``synth_bench.SimpleSynthModel`` and only the workbench's trainers and evals run.

    PYTHONPATH=/work/saelens torchrun --standalone --nproc_per_node 3 experiments/synth_sae_bench.py \
        --recipe synth16k --features 512 --hidden 24 --latents 128 --samples 256000 --batch-size 256 \
        --lr 3e-3 --sweep 3,10,30 --seeds 3 --threads 1
"""

from __future__ import annotations

import time
import warnings

import _common

NAME = "synth_sae_bench"
RECIPES = ["small", "synth16k"]
CHUNK = 16384  # rows drawn from the generator at a time
SWEPT = ("relu", "jumprelu")  # kinds whose L0 is set by a coefficient, not by k
KINDS = ["relu", "topk", "batchtopk", "jumprelu", "matryoshka_batchtopk"]
METRICS = ["classification/f1_score", "mcc", "classification/precision", "classification/recall", "uniqueness",
           "explained_variance", "sae_l0", "dead_latents", "shrinkage"]


def add_flags(p) -> None:
    p.add_argument("--features", type=int, default=512, help="ground-truth features (the paper's model: 16384)")
    p.add_argument("--hidden", type=int, default=24, help="hidden size of the activations")
    p.add_argument("--latents", type=int, default=128, help="dictionary width (the paper: 4096 for 16384 features)")
    p.add_argument("--k", type=float, default=0, help="TopK-style k (0: the L0 of the --latents most frequent features, rounded)")
    p.add_argument("--samples", type=int, default=256_000, help="training samples per dictionary")
    p.add_argument("--batch-size", type=int, default=256, help="samples per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate, both trainers")
    p.add_argument("--eval-samples", type=int, default=20_000, help="held-out samples scored per dictionary")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated dictionary kinds")
    p.add_argument("--no-saelens", action="store_true", help="do not use SAE Lens even when it imports")
    p.add_argument("--recipe", choices=RECIPES, default="synth16k",
                   help="generator settings: 'small' (Zipf 0.3..0.01, magnitudes 1 +- 0.1, bias 1, hierarchy depth 2) "
                        "or 'synth16k' (SynthSAEBench-16k's settings at --features/--hidden; the paper's model is "
                        "--recipe synth16k --features 16384 --hidden 768 --latents 4096 --gen-seed 42)")
    p.add_argument("--sweep", default="3,10,30",
                   help="relu / jumprelu: multiples of each trainer's base coefficient trained per seed; metrics "
                        "are interpolated at L0 = k between the two runs whose L0s bracket it")
    p.add_argument("--l1-ours", type=float, default=1.0, help="base L1 coefficient, workbench relu")
    p.add_argument("--l0-ours", type=float, default=0.3, help="base L0 coefficient, workbench jumprelu")
    p.add_argument("--l1-saelens", type=float, default=1.0, help="base L1 coefficient, SAE Lens relu")
    p.add_argument("--l0-saelens", type=float, default=1.0, help="base L0 coefficient, SAE Lens jumprelu")
    p.add_argument("--gen-seed", type=int, default=-1, help="generator seed (-1: each training seed its own generator)")
    p.add_argument("--ortho-steps", type=int, default=100, help="synth16k: orthogonalisation steps of the features")


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

    gen_seed = seed if getattr(args, "gen_seed", -1) < 0 else args.gen_seed
    if getattr(args, "recipe", "small") == "synth16k":
        cfg = synth16k_config(args.features, args.hidden, gen_seed, getattr(args, "ortho_steps", 100))
    else:
        roots = max(1, args.features // 16)
        cfg = SyntheticModelConfig(
            num_features=args.features, hidden_dim=args.hidden,
            firing_probability=ZipfianFiringProbabilityConfig(exponent=1.0, max_prob=0.3, min_prob=0.01),
            hierarchy=HierarchyConfig(total_root_nodes=roots, branching_factor=(2, 4), max_depth=2,
                                      mutually_exclusive_portion=0.5),
            correlation=LowRankCorrelationConfig(rank=16, correlation_scale=0.1, seed=gen_seed),
            std_firing_magnitudes=0.1, mean_firing_magnitudes=1.0, bias=1.0, seed=gen_seed)
    torch.manual_seed(seed)
    model = SyntheticModel(cfg)
    return model, model.feature_dict.feature_vectors.detach(), model.sample_with_features


def synth16k_config(features: int, hidden: int, seed: int = 42, ortho_steps: int = 100):
    """SynthSAEBench-16k's generator settings (SAE Lens' docs/synth_sae_bench.md and
    decoderesearch/synth-sae-bench-experiments, experiments/create_synth_bench_16k_model.py: 16,384
    features in 768 dimensions, seed 42), with the number of root trees scaled with ``features``
    (128 roots of depth 3 and branching 4 at 16,384: 10,880 features in trees)."""
    from sae_lens.synthetic import (HierarchyConfig, LowRankCorrelationConfig, SyntheticModelConfig,
                                    ZipfianFiringProbabilityConfig)
    from sae_lens.synthetic.firing_magnitudes import FoldedNormalMagnitudeConfig, LinearMagnitudeConfig
    from sae_lens.synthetic.synthetic_model import OrthogonalizationConfig

    return SyntheticModelConfig(
        num_features=features, hidden_dim=hidden,
        firing_probability=ZipfianFiringProbabilityConfig(max_prob=0.4, min_prob=5e-4, exponent=0.5),
        hierarchy=HierarchyConfig(total_root_nodes=max(1, features // 128), branching_factor=4,
                                  mutually_exclusive_portion=1.0, mutually_exclusive_min_depth=0,
                                  compensate_probabilities=True, scale_children_by_parent=True, max_depth=3),
        mean_firing_magnitudes=LinearMagnitudeConfig(start=5.0, end=4.0),
        std_firing_magnitudes=FoldedNormalMagnitudeConfig(mean=0.5, std=0.5),
        correlation=LowRankCorrelationConfig(correlation_scale=0.1, rank=25),
        orthogonalization=OrthogonalizationConfig(num_steps=ortho_steps, lr=3e-4) if ortho_steps else None,
        bias=0.5, seed=seed)


def train_ours(kind, data, args, k, seed, coefficient=0.0):
    from workbench.analysis.dictionaries import train_sae
    from workbench.analysis.store import TensorActivations

    steps = max(1, args.samples // args.batch_size)
    widths = ",".join(str(w) for w in matryoshka_widths(args.latents))
    return train_sae(TensorActivations({"x": data}, rows_per_shard=min(len(data), 65536)), kind=kind,
                     d_sae=args.latents, k=k, steps=steps, batch_size=args.batch_size, lr=args.lr,
                     warmup_steps=warmup(args), eval_rows=min(4096, len(data) // 10), seed=seed,
                     sparsity_coefficient=coefficient, matryoshka_widths=widths if kind == "matryoshka_batchtopk" else "",
                     progress=False, threads=args.threads, device="cpu", save_train_state=False)


def matryoshka_widths(latents: int) -> list[int]:
    return [latents >> i for i in (3, 2, 1, 0)]


def warmup(args) -> int:
    return min(100, max(1, args.samples // args.batch_size) // 10)


def train_saelens(kind, model, args, k, seed, coefficient=0.0):
    import torch
    from sae_lens import (BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig, JumpReLUTrainingSAE,
                          JumpReLUTrainingSAEConfig, MatryoshkaBatchTopKTrainingSAE,
                          MatryoshkaBatchTopKTrainingSAEConfig, StandardTrainingSAE, StandardTrainingSAEConfig,
                          TopKTrainingSAE, TopKTrainingSAEConfig)
    from sae_lens.synthetic import train_toy_sae

    common = dict(d_in=args.hidden, d_sae=args.latents)
    make = {"relu": lambda: StandardTrainingSAE(StandardTrainingSAEConfig(l1_coefficient=coefficient, **common)),
            "topk": lambda: TopKTrainingSAE(TopKTrainingSAEConfig(k=int(k), **common)),
            "batchtopk": lambda: BatchTopKTrainingSAE(BatchTopKTrainingSAEConfig(k=k, **common)),
            "jumprelu": lambda: JumpReLUTrainingSAE(JumpReLUTrainingSAEConfig(l0_coefficient=coefficient, **common)),
            "matryoshka_batchtopk": lambda: MatryoshkaBatchTopKTrainingSAE(
                MatryoshkaBatchTopKTrainingSAEConfig(k=k, matryoshka_widths=matryoshka_widths(args.latents)[:-1],
                                                     **common))}
    torch.manual_seed(seed)
    sae = make[kind]()
    steps = max(1, args.samples // args.batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_toy_sae(sae, model.feature_dict, model.activation_generator, training_samples=steps * args.batch_size,
                      batch_size=args.batch_size, lr=args.lr, lr_warm_up_steps=warmup(args),
                      lr_decay_steps=steps // 5)
    return sae


def coefficients(args, trainer: str, kind: str) -> list[float]:
    """The sparsity coefficients one (trainer, kind) is trained at: [0.0] (no coefficient) for the
    TopK-style kinds, the sweep of ``--sweep`` multiples of the kind's base coefficient otherwise."""
    if kind not in SWEPT:
        return [0.0]
    base = getattr(args, f"{'l1' if kind == 'relu' else 'l0'}_{'ours' if trainer == 'workbench' else 'saelens'}")
    return [base * m for m in parse_sweep(args.sweep)]


def parse_sweep(text: str) -> list[float]:
    try:
        values = [float(m) for m in str(text).split(",") if m.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v < float("inf") for v in values):
        raise SystemExit(f"--sweep: expected comma-separated positive multiples of the base coefficient, got {text!r}")
    return values


def target_k(held_acts, latents: int) -> int:
    """k: the mean number of firing features among the ``latents`` most frequent ones, rounded (the
    paper's k = 25 for 4,096 latents on SynthSAEBench-16k)."""
    fires = held_acts > 0
    top = fires.float().mean(0).argsort(descending=True)[:latents]
    return max(1, round(float(fires[:, top].sum(1).float().mean())))


def run_seed(args, seed, sae_lens, kinds):
    import torch

    from workbench.analysis import synth_bench

    torch.manual_seed(seed)
    model, features, sample = generator(args, seed, sae_lens)
    steps = max(1, args.samples // args.batch_size)
    with torch.no_grad():  # in chunks: one 256k-row draw from SAE Lens' generator peaks past 4 GB
        data = torch.cat([sample(min(CHUNK, steps * args.batch_size - at))[0]
                          for at in range(0, steps * args.batch_size, CHUNK)])
        held_x, held_acts = sample(args.eval_samples)
    k = args.k or target_k(held_acts, args.latents)
    rows = []
    trainers = [("workbench", train_ours)] + ([("sae_lens", train_saelens)] if sae_lens is not None else [])
    for trainer, train in trainers:
        for kind in kinds:
            for coefficient in coefficients(args, trainer, kind):
                t0 = time.time()
                sae = train(kind, data if trainer == "workbench" else model, args, k, seed, coefficient)
                seconds = time.time() - t0
                sae.eval()
                ours = synth_bench.evaluate(sae, features, held_x, held_acts)
                row = {"trainer": trainer, "kind": kind, "seed": seed, "k": k, "coefficient": coefficient,
                       "train_seconds": round(seconds, 1)}
                if sae_lens is not None:
                    from sae_lens.synthetic import eval_sae_on_synthetic_data

                    gen = _Replay(held_acts)
                    theirs = synth_bench.saelens_result_dict(eval_sae_on_synthetic_data(
                        sae, model.feature_dict, gen, num_samples=len(held_acts), batch_size=8192))
                    row.update(theirs, evals="sae_lens")
                    row["evals_max_abs_diff"] = max(abs(ours[key] - theirs[key]) for key in ours
                                                    if key != "dead_latents")
                    row["dead_latents_diff"] = abs(ours["dead_latents"] - theirs["dead_latents"])
                else:
                    row.update(ours, evals="workbench")
                rows.append(row)
                print(f"seed {seed} {trainer:9s} {kind:21s} c={coefficient:<8.3g} F1 {row['classification/f1_score']:.3f} "
                      f"MCC {row['mcc']:.3f} L0 {row['sae_l0']:.2f} (k {k}, {seconds:.0f}s)", flush=True)
    return rows


def equal_l0(gathered, metrics):
    """One row per (trainer, kind, seed) at L0 = k: the TopK-style run itself, or the swept runs'
    metrics interpolated at k (``synth_bench.at_l0``); NaN where the sweep does not bracket k."""
    import pandas as pd

    from workbench.analysis.synth_bench import at_l0

    rows = []
    for (trainer, kind, seed), part in gathered.groupby(["trainer", "kind", "seed"], sort=False):
        k = float(part["k"].iloc[0])
        if kind in SWEPT:
            got, how = at_l0(part.to_dict("records"), k, metrics), "interpolated"
            nearest = part.iloc[(part["sae_l0"] - k).abs().argmin()]
            if got is None and abs(nearest["sae_l0"] - k) <= 0.1 * k:  # one run already within 10% of k
                got, how = {m: float(nearest[m]) for m in metrics}, f"coefficient {nearest['coefficient']:.3g}"
            row = {"trainer": trainer, "kind": kind, "seed": seed, "k": k, "matched": how if got else
                   f"not bracketed (L0 {part['sae_l0'].min():.3g}..{part['sae_l0'].max():.3g})"}
            row.update(got or {m: float("nan") for m in metrics})
            if how == "interpolated" and got:
                row["sae_l0"] = k
        else:
            one = part.iloc[0]
            near = abs(one["sae_l0"] - k) <= 0.1 * k
            row = {"trainer": trainer, "kind": kind, "seed": seed, "k": k,
                   "matched": "k" if near else f"L0 {one['sae_l0']:.3g} off k by more than 10%"}
            row.update({m: (float(one[m]) if near else float("nan")) for m in metrics})
        rows.append(row)
    return pd.DataFrame(rows)


def verdicts(matched, kinds):
    """workbench minus SAE Lens on F1 and MCC at equal L0, paired by seed, per kind."""
    import pandas as pd

    from workbench.stats import difference, format_difference

    rows = []
    for kind in kinds:
        row = {"kind": kind}
        for metric, name in (("classification/f1_score", "F1"), ("mcc", "MCC")):
            a = matched[(matched.trainer == "workbench") & (matched.kind == kind)].set_index("seed")[metric]
            b = matched[(matched.trainer == "sae_lens") & (matched.kind == kind)].set_index("seed")[metric]
            both = a.index.intersection(b.index)
            ok = [s for s in both if a[s] == a[s] and b[s] == b[s]]
            iv = difference(a[ok].to_numpy(float), b[ok].to_numpy(float), paired=True) if ok else None
            row[f"{name} workbench - SAE Lens"] = format_difference(iv) if iv else "no matched seeds"
            row[f"{name} verdict"] = ("not compared" if iv is None else "no difference detected"
                                      if iv.n < 2 or iv.low != iv.low or iv.covers(0.0) else
                                      "workbench better" if iv.mean > 0 else "SAE Lens better")
            row[f"{name} n"] = len(ok)
        rows.append(row)
    return pd.DataFrame(rows)


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
    parse_sweep(args.sweep)  # refused now, not after the first seed's training
    if args.quick:
        args.features, args.hidden, args.latents, args.samples, args.eval_samples = 64, 16, 64, 4096, 1024
        args.batch_size, args.recipe = 256, "small"
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
    matched = equal_l0(gathered, METRICS)
    numbers, readable = _common.with_intervals(matched, ["trainer", "kind"], METRICS)
    swept, swept_readable = _common.with_intervals(gathered, ["trainer", "kind", "coefficient"], METRICS)
    tables = {"summary": numbers, "equal_l0": matched, "sweep": swept}
    if sae_lens is not None:
        tables["verdicts"] = verdicts(matched, kinds)
    figures = {"f1": _common.interval_bars(numbers.assign(cell=numbers.trainer + " " + numbers.kind), "cell",
                                           "classification/f1_score", "feature F1 at equal L0 by trainer and kind")}
    config = {"experiment": NAME, **vars(args), "sae_lens": getattr(sae_lens, "__version__", None),
              "sae_lens_unused_because": why or None,
              "generator": "sae_lens.synthetic.SyntheticModel" if sae_lens else "synth_bench.SimpleSynthModel"}
    if "evals_max_abs_diff" in gathered:
        config["evals_max_abs_diff"] = float(gathered["evals_max_abs_diff"].max())
    print("\nevery run (sweeps included): mean [95% interval]")
    print(swept_readable.to_string(index=False))
    if "verdicts" in tables:
        print("\nworkbench - SAE Lens at equal L0 (paired by seed):")
        print(tables["verdicts"].to_string(index=False))
    _common.write_run(args.out, config, gathered, figures, readable, tables=tables,
                      title=f"SynthSAEBench at equal L0 (k), {args.seeds} seed(s): mean [95% interval]")
    return gathered


if __name__ == "__main__":
    main()
