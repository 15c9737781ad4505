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
# # 2. Ablate and patch over a prompt set
#
# One prompt is an anecdote. A `PromptSet` holds many prompts (of any lengths) with their answers,
# wrong answers and corrupted twins; every intervention scores each prompt as if it ran alone and
# reports the mean, with a spread.

# %%
from pathlib import Path

import plotly.io as pio

import workbench as wb
from workbench import analysis as an, viz

CHECKPOINTS = Path(wb.__file__).resolve().parents[1] / "checkpoints"  # the repository's shipped models
pio.renderers.default = "notebook_connected"       # in a notebook (and on the docs site) figures load plotly.js once
from workbench.data import get_task

model, tok = wb.load_checkpoint(CHECKPOINTS / "stories-2026")
ds = wb.PromptSet.from_task(get_task("stories"), n=48, seed=0)   # held-out IOI prompts, corrupted = ABC
print(len(ds), "prompts; first:", ds.clean[0], "->", ds.answers[0], "(not", ds.wrong[0] + "); corrupted:", ds.corrupted[0])
print("mean logit difference (answer - wrong):", round(float(an.logit_diff(model, ds).logit_diff.mean()), 2))

# %% [markdown]
# ## Every head, zero- and mean-ablated
# `delta` is the change in the logit difference (mean over the 48 prompts; `delta_std` their
# standard deviation).

# %%
sweep = an.ablation_sweep(model, ds, unit="head", methods=("zero", "mean"), batch_size=48)
print(sweep.nsmallest(4, "delta")[["label", "clean", "delta", "delta_std", "n_prompts"]].to_string(index=False))
viz.layer_head_figure(sweep[sweep.method == "zero"], value="delta", title="zero ablation: change in logit difference")

# %% [markdown]
# ## Activation patching
# Patch each clean activation into the corrupted run (the ABC prompt, which names a third person) and
# see how much of the logit difference comes back, per layer and position.

# %%
patched = an.activation_patching(model, ds, sites=("resid_pre",), batch_size=48)
print(patched.columns.tolist())
viz.patching_figure(patched, site="resid_pre")

# %% [markdown]
# ## Attribution patching against the exact patch
# The gradient estimate of every head's patch, beside the exact one, and their correlation.

# %%
attr = an.attribution_patching(model, ds, exact=True, batch_size=48)
print("correlation with exact patching:", round(attr.attrs["correlation"], 3))
