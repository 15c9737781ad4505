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
# # 3. Import a Hugging Face model, offline
#
# `wb.from_hf` reads a Hugging Face model directory (or a hub id, through huggingface_hub's
# cache). This tutorial needs no network: it writes the directory itself, exporting the shipped
# stories model with `wb.to_hf`, loads it with transformers as any HF checkpoint, and imports it back.

# %%
from pathlib import Path

import plotly.io as pio

import workbench as wb
CHECKPOINTS = Path(wb.__file__).resolve().parents[1] / "checkpoints"  # the repository's shipped models
pio.renderers.default = "notebook_connected"       # in a notebook (and on the docs site) figures load plotly.js once
import tempfile

import torch
from transformers import AutoModelForCausalLM

model, tok = wb.load_checkpoint(CHECKPOINTS / "stories-2026")
hf_dir = Path(tempfile.mkdtemp()) / "stories-2026-hf"
wb.to_hf(model, hf_dir)                             # our config picks the family: RMSNorm + SwiGLU + RoPE -> Llama
print(sorted(p.name for p in hf_dir.iterdir()))
print((hf_dir / "config.json").read_text()[:300])

# %% [markdown]
# ## transformers reads it, and computes what we compute

# %%
hf = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
tokens = model.to_tokens("When Mary and John went to the store , John gave a drink to")
with torch.no_grad():
    theirs = hf(tokens).logits
    ours = model(tokens)
print(type(hf).__name__, "max |logit difference|:", float((theirs - ours).abs().max()))

# %% [markdown]
# ## Back into the workbench, with TransformerLens' processing
# `from_hf` streams the safetensors one tensor at a time into our weights; `fold_ln=True` folds the
# norms' weights as TransformerLens does on load, which changes no prediction.

# %%
back = wb.from_hf(hf_dir, fold_ln=True)
with torch.no_grad():
    again = back(tokens)
print("config:", back.cfg.normalization_type, "| max |difference| after folding:", float((again - ours).abs().max()))
_, cache = back.run_with_cache(tokens)
print([name for name in cache.keys() if name.startswith("blocks.0.")][:8])
