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
# # 5. Sparse dictionaries and their features
#
# The stories model ships with a BatchTopK dictionary (512 features, k = 16) on
# `blocks.1.hook_resid_post`, in SAELens' on-disk format. Spliced in with its error term, the
# model's logits do not change, and every feature is a hook.

# %%
from pathlib import Path

import plotly.io as pio

import workbench as wb
from workbench import analysis as an, viz

CHECKPOINTS = Path(wb.__file__).resolve().parents[1] / "checkpoints"  # the repository's shipped models
pio.renderers.default = "notebook_connected"       # in a notebook (and on the docs site) figures load plotly.js once
import torch

from workbench.data import get_task

model, tok = wb.load_checkpoint(CHECKPOINTS / "stories-2026")
sae = an.load_dictionary(CHECKPOINTS / "stories-2026/saes/resid-post-1")
task = get_task("stories")
tokens = task.batch(16, 64, split="val")
ioi = task.ioi_prompts(64)
clean = model(tokens)
with an.spliced(model, sae, error_term=True):
    logits, cache = model.run_with_cache(tokens)
acts = cache["blocks.1.hook_resid_post.hook_sae_acts_post"]
print("features:", acts.shape[-1], "| mean L0:", round(float((acts > 0).sum(-1).float().mean()), 1),
      "| max |logit change| with the error term:", float((logits - clean).abs().max()))

# %% [markdown]
# ## Which features fire where "to" stands
# Feature 206 fires on the final "to" of IOI prompts, where the indirect object is due.

# %%
on_to = an.features_on_token(model, sae, ioi.tokens, "to")
print(on_to.head(5).to_string(index=False))
contexts = an.max_activating_contexts(model, sae, tokens, 206)
viz.feature_contexts_figure(contexts)

# %% [markdown]
# ## What feature 206 does
# Its decoder direction's effect on the logits, and the IOI logit difference with the feature zeroed
# (error term kept, so nothing else changes).

# %%
print(an.feature_logit_effects(model, sae, 206).head(6).to_string(index=False))
@torch.no_grad()
def ioi_logit_diff():
    logits = model(ioi.tokens)[:, -1]
    rows = torch.arange(len(ioi.correct))
    return float((logits[rows, ioi.correct] - logits[rows, ioi.wrong]).mean())
before = ioi_logit_diff()                          # spliced with its error term, this is unchanged
with an.feature_edit(model, sae, 206, value=0.0):  # splices the dictionary for the duration
    after = ioi_logit_diff()
print(f"IOI logit difference on these 64 prompts: {before:.2f} -> {after:.2f} with feature 206 zeroed")
