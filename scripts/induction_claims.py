"""Remeasure the documented claims about the shipped induction model (checkpoints/induction-attn2l).

    python scripts/induction_claims.py            # print every measurement
    python scripts/induction_claims.py --check    # and fail if one no longer matches the docs

What it measures, on plain repeated random tokens ``[r, r]`` of 16-token halves, 32 sequences per
prompt set: six prompt sets drawn as ``an.head_scores`` draws them (``repeated_random_tokens``,
seeds 0-5), the set the induction task itself draws (``task.repeated_tokens(32, 16)``, its own
seed), and, for the scores only, ``task.evaluate``'s default layout (32-token halves):

* the loss on the repeated half, clean; with each single layer-1 head zeroed (its ``hook_z``); and
  with all of layer 1's heads zeroed: the docs give the range of "the worst single head" over the
  six sets, not one set's value;
* both induction scores of every layer-1 head on the same tokens: ``an.head_scores`` (attention to
  the token after *any* earlier copy of the current one) and ``workbench.data.induction``'s
  ``induction_scores`` (the designed offset of ``[r, r]`` only, what ``task.evaluate`` reports as
  ``induction_score_max``), and their largest difference.

One thread, a few seconds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import workbench as wb  # noqa: E402
from workbench import analysis as an  # noqa: E402
from workbench.data import get_task  # noqa: E402
from workbench.analysis.heads import repeated_random_tokens  # noqa: E402
from workbench.data.induction import induction_scores  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEEDS = range(6)
HALF, BATCH = 16, 32
# What docs/reference/checkpoints.md and induction-scores.md say (rounded as printed there).
DOCUMENTED = {
    "clean_min": 0.29, "clean_max": 0.34,              # the repeated-half loss, clean
    "worst_head_min": 1.19, "worst_head_max": 1.32,    # the worst single layer-1 head zeroed
    "all_layer1_min": 4.27, "all_layer1_max": 4.31,    # all of layer 1's heads zeroed
    "score_gap_max": 0.14,                              # |head_scores - designed offset|, any layer-1 head
}
TOLERANCE = 0.006  # each measured end of a range must round to the documented digits


@torch.no_grad()
def repeated_half_loss(model, tokens, half: int, heads=()) -> float:
    def zero(z, hook):
        z[:, :, list(heads)] = 0.0
        return z
    hooks = [("blocks.1.attn.hook_z", zero)] if heads else []
    losses = model.run_with_hooks(tokens, return_type="loss", loss_per_token=True, fwd_hooks=hooks)
    return float(losses[:, half:].mean())  # index i predicts token i + 1: from `half` on, the repeat is known


def measure(model, task, tokens, half: int, name: str) -> dict:
    n_heads = model.cfg.n_heads
    single = [repeated_half_loss(model, tokens, half, [h]) for h in range(n_heads)]
    copy = an.head_scores(model, tokens, kinds=("induction",)).query("layer == 1").set_index("head").score
    offset = induction_scores(model, tokens).query("layer == 1").set_index("head").score
    return {
        "prompts": name, "clean": repeated_half_loss(model, tokens, half),
        "worst_head": max(single), "worst_head_is": f"L1H{single.index(max(single))}",
        "all_layer1": repeated_half_loss(model, tokens, half, range(n_heads)),
        "score_gap": float((copy - offset).abs().max()),
        "copy_score_range": f"{copy.min():.2f}-{copy.max():.2f}", "offset_score_range": f"{offset.min():.2f}-{offset.max():.2f}",
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a documented number no longer holds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, _ = wb.load_checkpoint(REPO / "checkpoints" / "induction-attn2l")
    task = get_task("induction")
    rows = [measure(model, task, repeated_random_tokens(model, HALF, BATCH, seed), HALF, f"head_scores' seed {seed}, |r| = {HALF}")
            for seed in SEEDS]
    rows.append(measure(model, task, task.repeated_tokens(BATCH, HALF), HALF, f"the task's own, |r| = {HALF}"))
    half = model.cfg.n_ctx // 2  # what task.evaluate draws by default (batch 32, its own seed)
    rows.append(measure(model, task, task.repeated_tokens(32, half), half, f"task.evaluate's default, |r| = {half}"))
    import pandas as pd
    table = pd.DataFrame(rows)
    print(table.round(3).to_string(index=False))
    sets = table.iloc[: len(SEEDS)]
    found = {
        "clean_min": sets.clean.min(), "clean_max": sets.clean.max(),
        "worst_head_min": sets.worst_head.min(), "worst_head_max": sets.worst_head.max(),
        "all_layer1_min": sets.all_layer1.min(), "all_layer1_max": sets.all_layer1.max(),
        "score_gap_max": table.score_gap.max(),
    }
    print("over the six prompt sets:", {k: round(float(v), 3) for k, v in found.items()})
    if args.check:
        bad = []
        for key, value in found.items():
            doc = DOCUMENTED[key]
            if abs(value - doc) > TOLERANCE:
                bad.append(f"{key}: measured {value:.3f}, documented {doc}")
        if bad:
            print("documented claims that no longer hold:\n  " + "\n  ".join(bad))
            return 1
        print("every documented claim holds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
