"""TEMPORARY stand-in for h-qk's ``qk_attribution`` / attention-only graphs (deleted once they land).

Attention-only models only: the score of (layer, head, q, k) split into (query component x key
component) pairs, components being the embedding at the position, each earlier head's output and
the bias remainder. Same columns as the real table.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd
import torch


def attribution_graph(model, transcoders, prompt, **_):
    tokens = prompt.reshape(1, -1) if isinstance(prompt, torch.Tensor) else model.to_tokens(prompt).reshape(1, -1)
    return SimpleNamespace(model=model, tokens=tokens[0], str_tokens=[str(t) for t in tokens[0].tolist()],
                           n_layers=model.cfg.n_layers)


def _components(cache, model, layer: int, pos: int):
    """[(name, kind, layer, vector)] summing to resid_pre[layer] at pos."""
    embed = cache["hook_embed"][0, pos] + (cache["hook_pos_embed"][0, pos] if "hook_pos_embed" in cache else 0)
    out = [(f"T{pos}", "token", -1, embed)]
    for l in range(layer):
        z = cache[f"blocks.{l}.attn.hook_z"][0, pos]  # [head, d_head]
        for h in range(model.cfg.n_heads):
            out.append((f"A{l}.{h}", "head", l, z[h] @ model.blocks[l].attn.W_O[h]))
        if f"blocks.{l}.hook_mlp_out" in cache:
            out.append((f"E{l}.{pos}", "error", l, cache[f"blocks.{l}.hook_mlp_out"][0, pos]))
    return out


def _side(model, cache, layer, head, pos, which):
    attn = model.blocks[layer].attn
    ln = model.blocks[layer].ln1
    scale = cache[f"blocks.{layer}.ln1.hook_scale"][0, pos] if f"blocks.{layer}.ln1.hook_scale" in cache else None
    W = attn.W_Q[head] if which == "q" else attn.W_K[head // attn.group]
    total = cache[f"blocks.{layer}.attn.hook_{which}"][0, :, head if which == "q" else head // attn.group]
    rows = []
    for name, kind, l, c in _components(cache, model, layer, pos):
        if scale is not None:
            if hasattr(ln, "b"):
                c = c - c.mean()
            c = c / scale * ln.w
        vec = torch.zeros_like(total)
        vec[pos] = c @ W
        rows.append((name, kind, l, vec))
    rest = total.clone()
    rest[:pos] = 0
    rest[pos + 1:] = 0
    rest[pos] -= sum(v[pos] for *_, v in rows)
    rows.append((f"B{layer}", "bias", layer, rest))
    if attn.position.rotates:
        rows = [(n, k, l, attn.position.rotate(v[None, :, None], 0)[0, :, 0]) for n, k, l, v in rows]
    return [(n, k, l, v[pos]) for n, k, l, v in rows]


@torch.no_grad()
def qk_attribution(graph, layer, head, query_pos, key_pos, *, top=20, exact=5):
    model = graph.model if hasattr(graph, "model") else graph._context[0]
    tokens = graph.tokens[None].to(model.device)
    _, cache = model.run_with_cache(tokens)
    attn = model.blocks[layer].attn
    qs = _side(model, cache, layer, head, query_pos, "q")
    ks = _side(model, cache, layer, head, key_pos, "k")
    score = float(cache[f"blocks.{layer}.attn.hook_attn_scores"][0, head, query_pos, key_pos])
    rows = [dict(query_node=qn, key_node=kn, query_kind=qk, key_kind=kk, query_layer=ql, key_layer=kl,
                 contribution=float(qv @ kv) / attn.attn_scale)
            for qn, qk, ql, qv in qs for kn, kk, kl, kv in ks]
    table = pd.DataFrame(rows)
    bilinear = float(table["contribution"].sum())
    table = table.reindex(table["contribution"].abs().sort_values(ascending=False).index).head(top)
    table = table.reset_index(drop=True)
    before = float(cache[f"blocks.{layer}.attn.hook_pattern"][0, head, query_pos, key_pos])
    changes = []
    for i, row in table.iterrows():
        if i >= exact:
            changes.append(math.nan)
            continue
        kvec = next(v for n, _, _, v in _side(model, cache, layer, head, key_pos, "k") if n == row["key_node"])
        if attn.position.rotates:  # undo: patch after the rotation
            site = f"blocks.{layer}.attn.hook_rot_k"
        else:
            site = f"blocks.{layer}.attn.hook_k"

        def patch(value, hook, kvec=kvec):
            value = value.clone()
            value[0, key_pos, head // attn.group] -= kvec
            return value

        seen = {}
        model.run_with_hooks(tokens, fwd_hooks=[(site, patch), (f"blocks.{layer}.attn.hook_pattern",
                                                                lambda v, hook: seen.setdefault("p", v))])  # noqa: B023
        changes.append(float(seen["p"][0, head, query_pos, key_pos]) - before)
    table["pattern_change"] = changes
    table.attrs.update(score=score, bilinear=bilinear, residual=score - bilinear, layer=layer, head=head,
                       query_pos=query_pos, key_pos=key_pos)
    return table
