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
# # 12. An attribution graph of the real model
#
# An attribution graph needs a replacement for every MLP: here a skip-transcoder per layer of
# SmolLM2-135M (30 layers). The study in `docs/reference/real-model-transcoders.md` trains
# 1,024-feature transcoders on about 20,000 tokens of real text (`python experiments/real_transcoders.py`,
# about half an hour on 2 CPU cores) and saves them where the app's Graph page reads them. This
# tutorial runs the same pipeline at toy scale, so that it finishes in seconds: 64-feature
# transcoders trained on a few hundred tokens. Such transcoders explain little of each MLP, so
# most of this graph's weight sits in error nodes; the machinery, and how to read it, are the same.

# %%
import torch

import workbench as wb
from workbench import analysis as an
from workbench.data.stdlib import stdlib_text  # real text with no download: the standard library's docstrings

torch.manual_seed(0)
model = wb.open_pretrained("smollm2-135m")  # about 8 s from the converted cache
for p in model.parameters():
    p.requires_grad_(False)
n_layers = model.cfg.n_layers

# %% [markdown]
# ## Activations of real text, and one transcoder per MLP
#
# Four sequences of 32 tokens of Python's `argparse` docstrings (the study uses 24 modules).
# One forward records every MLP's input (`ln2.hook_normalized`) and output (`hook_mlp_out`);
# `TensorActivations` makes them a store in memory, which `train_sae` trains on like one on disk.

# %%
ids = model.to_tokens(stdlib_text(["argparse"]), prepend_bos=False)[0]
text = ids[: 4 * 32].view(4, 32)
hooks = [h for layer in range(n_layers) for h in (f"blocks.{layer}.ln2.hook_normalized", f"blocks.{layer}.hook_mlp_out")]
with torch.no_grad():
    _, cache = model.run_with_cache(text, names_filter=lambda name: name in hooks)
acts = an.TensorActivations({h: cache[h][:, 1:].reshape(-1, model.cfg.d_model) for h in hooks}, rows_per_shard=3 * 31)
transcoders = []
for layer in range(n_layers):
    tc = an.train_sae(acts, kind="skip_transcoder", d_sae=64, steps=20, batch_size=93, seed=0, eval_sequences=0,
                      hook=f"blocks.{layer}.ln2.hook_normalized", hook_out=f"blocks.{layer}.hook_mlp_out",
                      save_train_state=False, progress=False)
    transcoders.append(tc.eval().requires_grad_(False))
print({k: round(v, 3) for k, v in transcoders[15].metrics.items() if k in ("explained_variance", "l0")})

# %% [markdown]
# ## The graph of an IOI prompt
#
# The target is the logit of " Mary", the indirect object. `max_feature_nodes` bounds the feature
# rows (each row is part of a backward pass); `scores()` gives circuit-tracer's replacement and
# completeness scores: the share of the influence that reaches tokens rather than error nodes.

# %%
prompt = "When Mary and John went to the store, John gave a drink to"
tokens = model.to_tokens(prompt, prepend_bos=False)
mary = model.to_single_token(" Mary")
graph = an.attribution_graph(model, transcoders, tokens, target=mary, max_feature_nodes=32)
print(graph, graph.scores())
pruned = graph.prune(node_threshold=0.8, edge_threshold=0.98)
print(pruned)

# %% [markdown]
# ## From the indirect object to the answer
#
# `an.widest_path` follows the edges of largest normalised weight from the token node of " Mary"
# (position 1) to the logit. Every edge is a direct effect in the graph's frozen replacement
# model, so zeroing its source there moves its target by exactly minus the edge:
# `an.measured_edge` does that intervention (on the model the graph was built from: a pruned
# graph keeps it) and the two columns agree.

# %%
io = int((tokens[0] == mary).nonzero()[0])
source = [i for i in pruned.nodes_of("token").tolist() if int(pruned.pos[i]) == io][0]
logit = int(pruned.nodes_of("logit")[0])
path = an.widest_path(pruned, source, logit)
names = pruned.node_ids()
for s, t in zip(path, path[1:]):
    edge = pruned.edge(t, s)
    measured = an.measured_edge(pruned, s, t)
    print(f"{names[s]:>10} -> {names[t]:<10} edge {edge:+.4f}   intervention {measured:+.4f}")
    assert abs(edge - measured) < 1e-3 * max(1.0, abs(edge))

# %% [markdown]
# ## The full study, and the Graph page
#
# `python experiments/real_transcoders.py` writes 30 transcoders of 1,024 features into the real
# model's cache folder (`<cache>/saes/transcoders/layer{l}`), with per-layer explained variance,
# L0 and dead features on held-out text, the loss with all 30 spliced in, and this graph with its
# IO -> answer path; `docs/reference/real-model-transcoders.md` has the numbers and how to open
# the graph on the app's Graph page. Loading them is one line per layer:
#
# ```python
# from workbench.interop.gguf import cache_dir_for, pretrained_path
# folder = cache_dir_for(pretrained_path("smollm2-135m")) / "saes" / "transcoders"
# transcoders = [an.load_dictionary(folder / f"layer{l}") for l in range(30)]
# ```
