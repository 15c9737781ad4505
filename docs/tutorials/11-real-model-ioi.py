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
# # 11. Indirect object identification in a real model
#
# "Then, Mary and John went to the store. John gave a drink to" -> " Mary". Wang et al. (2022) found
# the circuit GPT-2 small uses for this; here are the first steps of the same study on SmolLM2-135M
# (30 layers x 9 heads), on a handful of prompts so that it runs in seconds. The full study, with
# seeds, intervals, EAP-IG and ACDC, is `python experiments/real_ioi.py --seeds 3`; its tables are in
# docs/reference/real-model-ioi.md.

# %%
import torch

import workbench as wb
from workbench.analysis.circuits import ComputationGraph, EdgeRunner
from workbench.analysis.circuits.ioi import (
    ioi_prompts, logit_diff_direct_effects, mean_ablation_runner, single_token_names,
)

torch.set_num_threads(2)
model = wb.open_pretrained("smollm2-135m")     # converted once into the workbench's model cache
print(len(single_token_names(model.tokenizer)), "names are one token here, e.g.",
      single_token_names(model.tokenizer)[:6])

# %% [markdown]
# ## The prompts and the behaviour
#
# `ioi_prompts` draws a template, an order (ABBA: IO first; BABA: S first) and three distinct names per
# row. The corrupted twin replaces the second S by the third name C (the ABC corruption): nothing in it
# tells IO from S. The metric is logit(IO) - logit(S) at the last token.

# %%
prompts = ioi_prompts(model, 6, seed=0)
clean, corrupted = prompts.tokens()
for i in range(2):
    print(prompts.order[i], repr(prompts.texts[i]), "->", model.to_string([prompts.io[i]]))
    print("   corrupted:", repr(model.to_string(corrupted[i])))
with torch.no_grad():
    last = model(clean)[:, -1]
rows = torch.arange(len(prompts))
diff = last[rows, torch.tensor(prompts.io)] - last[rows, torch.tensor(prompts.s)]
print("logit(IO) - logit(S) per prompt:", [round(x, 2) for x in diff.tolist()])
print("IO beats S on", int((diff > 0).sum()), "of", len(prompts))

# %% [markdown]
# ## Which heads write the answer: path patching into the logits
#
# An `EdgeRunner` holds the clean and the corrupted runs. `logit_diff_direct_effects` path-patches every
# node into the logits at once: the logits read that node's corrupted output, everything else clean,
# and the final norm is recomputed. A name mover's effect is negative (its clean output pushed IO up);
# a negative name mover's is positive.

# %%
runner = EdgeRunner(model, (clean, corrupted))
graph = runner.graph
effects = logit_diff_direct_effects(runner, prompts.io, prompts.s)
heads = [(i, n) for i, n in enumerate(graph.senders) if n[0] == "head"]
ranked = sorted(heads, key=lambda item: float(effects[item[0]]))
print("clean logit difference", round(runner.endpoints(prompts.metric())[0], 2))
print("largest drops (name-mover candidates):",
      [(f"L{n[1]}H{n[2]}", round(float(effects[i]), 2)) for i, n in ranked[:3]])
print("largest rises (negative name movers):",
      [(f"L{n[1]}H{n[2]}", round(float(effects[i]), 2)) for i, n in ranked[::-1][:2]])

# %% [markdown]
# A name mover should attend from the last token (END) to IO. The attention pattern says whether it does.

# %%
top = [(n[1], n[2]) for _, n in ranked[:3]]
_, cache = model.run_with_cache(clean, names_filter=lambda name: name.endswith("hook_pattern"))
end, io_pos, s2_pos = prompts.pos("END"), prompts.pos("IO"), prompts.pos("S2")
for layer, head in top:
    pattern = cache[f"blocks.{layer}.attn.hook_pattern"][rows, head]
    print(f"L{layer}H{head}: attention END->IO {float(pattern[rows, end, io_pos].mean()):.2f}, "
          f"END->S2 {float(pattern[rows, end, s2_pos].mean()):.2f}")

# %% [markdown]
# ## Faithfulness under mean ablation
#
# Keep only some heads (with every MLP and the embedding, as MIB's node circuits do) and replace every
# other head's output by its mean over the ABC prompts of the same template (`mean_ablation_runner`).
# Faithfulness is (m(circuit) - m(all mean-ablated)) / (m(model) - m(all mean-ablated)). Three heads out
# of 270 with every MLP is a small circuit: expect it to keep part of the behaviour, not all of it.

# %%
from workbench.analysis.circuits.mib import node_keep

mean = mean_ablation_runner(runner, prompts.template)
metric = prompts.metric()
scores = {f"L{l}H{h}": float(f"L{l}H{h}" in {f"L{a}H{b}" for a, b in top})
          for l in range(graph.n_layers) for h in range(graph.n_heads)}
keep = node_keep(graph, scores, len(top), absolute=False)
full, empty = runner.endpoints(metric)[0], mean.metric_of(metric, torch.zeros_like(graph.adjacency))
kept = mean.metric_of(metric, keep)
print(f"model {full:.2f}, everything mean-ablated {empty:.2f}, the 3 heads + MLPs {kept:.2f}: "
      f"faithfulness {(kept - empty) / (full - empty):.2f}")
print(ComputationGraph(model).n_edges, "edges in the whole graph; EAP-IG and ACDC rank them in the full study")
