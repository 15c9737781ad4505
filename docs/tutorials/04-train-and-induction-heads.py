# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 4. Train a model and watch its induction heads form
#
# Training is one call. A short run shows the loop and its outputs; the shipped `induction-attn2l`
# checkpoint kept 24 snapshots of its full 1,500-step run, so the phase change (Olsson et al., 2022)
# can be watched without waiting for it.

# %%
from pathlib import Path

import plotly.io as pio

import workbench as wb
from workbench import analysis as an, viz

CHECKPOINTS = Path(wb.__file__).resolve().parents[1] / "checkpoints"  # the repository's shipped models
pio.renderers.default = "notebook_connected"       # in a notebook (and on the docs site) figures load plotly.js once
import functools
import tempfile

from workbench.data import get_task
from workbench.training import TrainConfig, train

run = Path(tempfile.mkdtemp()) / "ind"
result = train(TrainConfig(task="induction", steps=30, eval_every=15, snapshots="every:10"),
               wb.ModelConfig.from_preset("attn-only-2l"), run)
print(result.metrics)
print(result.history.tail(3).to_string(index=False))
print(sorted(p.name for p in (run / "snapshots").iterdir()))

# %% [markdown]
# ## The shipped run's snapshots
# `over_training` maps any analysis over the snapshots (one model in memory at a time). Two induction
# scores appear below, and they are not the same measure: `an.head_scores` (kind "induction") counts
# attention to the token after *any* earlier copy of the current token; `task.evaluate`'s
# `induction_score_max` counts only the designed offset of `[r, r]` (key = query - |r| + 1).

# %%
series = wb.load_series(CHECKPOINTS / "induction-attn2l")
task = get_task("induction")
scores = functools.partial(an.head_scores, kinds=("previous_token", "induction"), seq_len=32, batch=8)
both = an.over_training(series, {"heads": scores, "task": functools.partial(task.evaluate, half_len=32)},
                        progress=False)
heads, evals = both["heads"], both["task"]
best = heads.groupby(["step", "kind"]).score.max().unstack()
print(best.join(evals.set_index("step")[["loss_repeated_half", "induction_score_max"]]).round(3).to_string())

# %%
viz.over_training_figure(heads, losses=evals[["step", "loss_repeated_half"]])
