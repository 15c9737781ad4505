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
# # 6. Circuits, scored against planted truth
#
# A circuit method's output is a claim; on a model whose circuit is known it can be scored. The
# planted models in `checkpoints/planted-*` have their circuits by construction (hand-written weights)
# or by strict interchange-intervention training. Here: the IIT induction model, whose previous-token
# head is L0H2 and induction head L1H1.

# %%
import plotly.io as pio

from workbench import analysis as an, viz

pio.renderers.default = "notebook_connected"       # in a notebook (and on the docs site) figures load plotly.js once
from workbench.planted import load_planted

p = load_planted("iit-induction")
clean, corrupted = ds = p.prompts(32, seed=0)
metric = p.metric(clean)
print("truth:", sorted(p.truth))
print("established by:", p.established_by[:120])

# %% [markdown]
# ## Edge scores from three methods, and their AUROC against the truth

# %%
rows = []
for method in ("exact", "eap", "eap-ig"):
    scores = an.edge_attribution(model=p.model, data=ds, metric=metric, method=method) if False else         an.edge_attribution(p.model, ds, metric, method=method)
    rows.append({"method": method, "edges": len(scores), "edge AUROC": round(an.edge_auroc(scores, p.truth, p.unscored), 3)})
print(rows)

# %% [markdown]
# ## ACDC finds the circuit itself
# With exact interventions at a threshold of 0.01 of the clean-corrupted gap. Its faithfulness is
# the metric kept when only the circuit's edges carry the clean run.

# %%
circuit = an.discover_circuit(p.model, ds, metric, method="acdc", threshold=0.01)
print("found:", sorted(circuit.edges), "| the truth exactly:", set(circuit.edges) == set(p.truth))
print("faithfulness:", round(float(an.faithfulness(p.model, circuit, ds, metric)), 3))
viz.circuit_figure(circuit.to_frame(), title="ACDC on planted-iit-induction")
