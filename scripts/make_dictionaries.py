"""Rebuild the shipped sparse dictionary of stories-2026 (deterministic given the seeds below).

    python scripts/make_dictionaries.py                    # into checkpoints/stories-2026/saes/
    python scripts/make_dictionaries.py --checkpoints DIR  # another checkpoints folder

One thread, so the reductions and hence the weights are the same on every rebuild on the same
machine and torch build; a few minutes on 2 CPU cores. The activations are collected into a
temporary store and deleted afterwards; the dictionary (SAELens format, under 1 MB) goes inside
the checkpoint directory, because a rebuilt checkpoint (scripts/make_checkpoints.py) replaces
that directory and its dictionaries would no longer describe it: make_checkpoints.py runs this
script again after rebuilding stories-2026.

Then the features docs/reference/dictionaries.md names are checked: each claim is measured again and printed, and
the script fails if one no longer holds (a rebuild on another machine may number features
differently; then look again, with the printed table, and update docs/reference/dictionaries.md).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench import analysis as an  # noqa: E402
from workbench.data import get_task  # noqa: E402

CHECKPOINT = "stories-2026"
NAME = "resid-post-1"  # checkpoints/stories-2026/saes/resid-post-1/
HOOK = "blocks.1.hook_resid_post"  # the middle of three blocks
COLLECT = dict(tokens=7 * 33 * 32 * 63, batch_size=32, seq_len=64, tokens_per_shard=33 * 32 * 63)  # 7 whole shards
TRAIN = dict(kind="batchtopk", d_sae=512, k=16, steps=1500, batch_size=2048, seed=0, threads=1, log_every=50,
             save_train_state=False, eval_sequences=256)
# Found by looking (the features firing at each IOI role, then their contexts, logits and ablations);
# docs/reference/dictionaries.md shows them. check_features() measures every claim again.
TO_BEFORE_IO, GIVER, REPEATED_NAME = 206, 149, 281


def build(root: Path) -> dict:
    torch.set_num_threads(1)
    model, _ = wb.load_checkpoint(root / CHECKPOINT)
    task = get_task("stories", seed=0)
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="acts-"))
    try:
        store = an.ActivationStore.collect(model, task, [HOOK], COLLECT["tokens"], tmp / "store",
                                           batch_size=COLLECT["batch_size"], seq_len=COLLECT["seq_len"],
                                           tokens_per_shard=COLLECT["tokens_per_shard"])
        out = root / CHECKPOINT / "saes" / NAME
        if out.exists():
            shutil.rmtree(out)
        sae = an.train_sae(store, out=out, model=model, **TRAIN)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    minutes = (time.perf_counter() - started) / 60
    size_mb = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in sae.metrics.items()}
    print(f"{out}: {size_mb:.2f} MB, {minutes:.1f} min: {shown}", flush=True)
    return {"model": model, "sae": sae, "task": task, "size_mb": size_mb}


@torch.no_grad()
def check_features(model, sae, task) -> bool:
    """Re-measure what docs/reference/dictionaries.md says about the named features; print it; True when all of it holds."""
    from workbench.data.stories import GIVES, NAMES

    ioi = task.ioi_prompts(256, split="heldout")
    rows = torch.arange(len(ioi.tokens))
    acts = an.feature_activations(model, sae, ioi.tokens)
    end, s2 = ioi.positions["end"], ioi.positions["S2"]

    def fires(f, pos):
        return float((acts[rows, pos, f] > 0).float().mean())

    def elsewhere(f, pos):
        other = acts[..., f].clone()
        other[rows, pos] = 0
        return float((other[:, 1:] > 0).float().mean())

    def promoted(f, k=5):
        effects = an.feature_logit_effects(model, sae, f, k=k)
        return effects[effects.direction == "top"]["token"].str.strip().tolist()

    def logit_diff(feature=None):
        hooks = []
        if feature is not None:
            def zero(value, hook):
                value = value.clone()
                value[..., feature] = 0
                return value
            hooks = [(f"{HOOK}.hook_sae_acts_post", zero)]
        with an.spliced(model, sae, error_term=True):
            logits = model.run_with_hooks(ioi.tokens, fwd_hooks=hooks)[:, -1]
        diff = logits[rows, ioi.correct] - logits[rows, ioi.wrong]
        return float(diff.mean()), float((diff > 0).float().mean())

    clean, ablated = logit_diff(), logit_diff(TO_BEFORE_IO)
    contexts = an.max_activating_contexts(model, sae, task, REPEATED_NAME, k=8)
    claims = {
        f"feature {TO_BEFORE_IO} fires on the final 'to' of IOI prompts ({fires(TO_BEFORE_IO, end):.0%})":
            fires(TO_BEFORE_IO, end) >= 0.95,
        f"feature {TO_BEFORE_IO} promotes names {promoted(TO_BEFORE_IO)}": set(promoted(TO_BEFORE_IO)) <= set(NAMES),
        f"zeroing feature {TO_BEFORE_IO} (error term kept) takes the IOI logit difference from {clean[0]:.2f} "
        f"(accuracy {clean[1]:.2f}) to {ablated[0]:.2f} (accuracy {ablated[1]:.2f})": ablated[0] < 0.3 * clean[0],
        f"feature {GIVER} fires on the giver's name (S2) of IOI prompts ({fires(GIVER, s2):.0%})": fires(GIVER, s2) >= 0.95,
        f"feature {GIVER} promotes giving verbs {promoted(GIVER)}": len(set(promoted(GIVER)) & set(GIVES)) >= 4,
        f"feature {REPEATED_NAME} fires on S2 ({fires(REPEATED_NAME, s2):.0%}) and almost nowhere else in IOI "
        f"prompts ({elsewhere(REPEATED_NAME, s2):.1%})": fires(REPEATED_NAME, s2) >= 0.95 and elsewhere(REPEATED_NAME, s2) < 0.01,
        f"feature {REPEATED_NAME}'s top stories contexts are the asked name of 'X plays with the' questions":
            bool(contexts["right"].str.startswith(" plays").mean() >= 0.75),
    }
    for claim, ok in claims.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {claim}")
    print(contexts[["activation", "context"]].head(3).to_string(index=False))
    return all(claims.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=Path, default=Path(__file__).resolve().parents[1] / "checkpoints",
                        help="the folder holding stories-2026")
    parser.add_argument("--check-only", action="store_true", help="check the named features of the shipped dictionary; train nothing")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.check_only:
        model, _ = wb.load_checkpoint(args.checkpoints / CHECKPOINT)
        sae = an.load_dictionary(args.checkpoints / CHECKPOINT / "saes" / NAME)
        return 0 if check_features(model, sae, get_task("stories", seed=0)) else 1
    built = build(args.checkpoints)
    ok = check_features(built["model"], built["sae"], built["task"])
    return 0 if built["size_mb"] < 1.0 and ok else 1


if __name__ == "__main__":
    sys.exit(main())
