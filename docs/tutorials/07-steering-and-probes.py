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
# # 7. Steering and probes
#
# A `Direction` is a vector at a hook with its provenance. Here it is "the subject came first": the
# mean residual after layer 1 at the last token of BABA prompts minus that of ABBA prompts. Added to
# ABBA prompts, it should push the model's answer from the indirect object towards the subject.

# %%
from pathlib import Path

import plotly.io as pio

import workbench as wb
from workbench import analysis as an

CHECKPOINTS = Path(wb.__file__).resolve().parents[1] / "checkpoints"  # the repository's shipped models
pio.renderers.default = "notebook_connected"       # in a notebook (and on the docs site) figures load plotly.js once
import torch

from workbench.data import get_task

model, tok = wb.load_checkpoint(CHECKPOINTS / "stories-2026")
task = get_task("stories")
build = task.ioi_prompts(128, split="train", seed=1000)
first = torch.tensor([t == "BABA" for t in build.templates])
d = an.steering_vector(model, build.tokens[first], build.tokens[~first], "blocks.1.hook_resid_post")
print(d)

# %% [markdown]
# ## The logit difference as the scale grows (held-out ABBA prompts)

# %%
held = task.ioi_prompts(64, split="heldout", seed=2000)
abba = torch.tensor([t == "ABBA" for t in held.templates])
tokens, right, wrong = held.tokens[abba], held.correct[abba], held.wrong[abba]
rows = torch.arange(len(right))
for scale in (0.0, 4.0, 8.0, 16.0):
    with torch.no_grad(), model.steer(d, scale=scale, positions="all"):
        last = model(tokens)[:, -1]
    diff = last[rows, right] - last[rows, wrong]
    print(f"scale {scale:4.0f}: logit difference {float(diff.mean()):6.2f}, flipped {float((diff < 0).float().mean()):.0%}"
          f" of {len(rows)} prompts")

# %%
prompt = model.to_string(tokens[0])
out = an.steering_comparison(model, prompt, d, scale=8.0, max_new_tokens=8)
table = out["tokens"]                      # one row per token of each run; "generated" marks the continuation
for run in ("clean", "steered"):
    generated = table[(table.run == run) & table.generated]
    print(f"{run:8s}", prompt.split(",")[-1].strip(), "->", " ".join(generated.token))

# %% [markdown]
# ## A probe for the same fact
# A logistic probe per layer for "the subject came first" (BABA vs ABBA), read at the last token;
# accuracy and AUC come with 95% bootstrap intervals over test prompts, and a shuffled-label control.
# On these 128 prompts (32 held out) no layer's probe is clearly above the majority baseline: the
# intervals are wide, and a direction that steers is not the same as a fact a linear probe reads.

# %%
import pandas as pd
frame = pd.DataFrame({"prompt": [model.to_string(t) for t in build.tokens], "subject_first": first.int().tolist()})
probe = an.train_probe(model, frame, label="subject_first", text_column="prompt", n_boot=50)
print(probe.results.round(3).to_string(index=False))
