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
# # 1. Look inside a model
#
# The shipped `stories-2026` checkpoint (3 layers, RMSNorm, SwiGLU, RoPE, 2 KV heads) was trained on a
# grammar of short stories with indirect-object sentences. We run one prompt, read its cache, and
# ask the questions every analysis answers as a table: what each layer predicts (logit lens), where
# heads attend, which components write the answer (direct logit attribution).

# %%
from pathlib import Path

import plotly.io as pio

import workbench as wb
from workbench import analysis as an, viz

CHECKPOINTS = Path(wb.__file__).resolve().parents[1] / "checkpoints"  # the repository's shipped models
pio.renderers.default = "notebook_connected"       # in a notebook (and on the docs site) figures load plotly.js once

model, tok = wb.load_checkpoint(CHECKPOINTS / "stories-2026")
prompt = "When Mary and John went to the store , John gave a drink to"
logits, cache = model.run_with_cache(prompt)
print(model.to_str_tokens(prompt))
print("answer:", model.to_str_tokens(logits[0, -1].argmax()), "| cache holds", len(cache), "activations")

# %% [markdown]
# ## The logit lens
# Each layer's residual stream read through the final norm and unembedding: by the last layer the
# model predicts "Mary" at the final position.

# %%
lens = an.logit_lens(model, prompt)
print(lens[lens.pos == lens.pos.max()][["layer_label", "top1", "top1_prob", "kl_to_final"]].to_string(index=False))
viz.logit_lens_figure(lens)

# %% [markdown]
# ## Attention
# One row per (layer, head, query, key). Layer 2's heads 2 and 3 look from the final "to" back at the
# names.

# %%
patterns = an.attention_patterns(model, prompt)
last = patterns[(patterns.layer == 2) & (patterns.query_pos == patterns.query_pos.max())]
print(last[last["head"].isin([2, 3])].nlargest(6, "attention")[["head", "key_pos", "key_token", "attention"]].to_string(index=False))
viz.attention_figure(patterns, layer=2, head=3)

# %% [markdown]
# ## Direct logit attribution
# How much each head writes into the logit difference "Mary" minus "John" at the last position; the
# parts sum to the total.

# %%
dla = an.direct_logit_attribution(model, prompt, " Mary", " John")
heads = dla[dla.granularity == "head"]
print(heads.nlargest(4, "attribution")[["component", "attribution", "total"]].to_string(index=False))
print("sum of parts:", round(heads.attribution.sum(), 4), "total:", round(heads.total.iloc[0], 4))
viz.dla_figure(dla, granularity="head")

# %% [markdown]
# ## Head scores
# Previous-token, induction, duplicate-token and first-token scores of every head, measured on
# repeated random tokens (the layout is in `attrs`).

# %%
scores = an.head_scores(model, seq_len=16, batch=16, seed=0)
print(scores.attrs["layout"])
viz.head_scores_figure(scores)
