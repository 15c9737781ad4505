"""What an attention head copies, and what wrote the keys it attends to: two readings of induction heads.

    copying_scores(model)                            # per head: the OV circuit's eigenvalue copying score
    k_composition(model, tokens, half, [(18, 6)])    # an induction head's score split over its key's writers

``copying_scores``: the token-to-logit circuit of a head, ``W_E diag(ln1.w) W_V^h W_O^h diag(ln_final.w)
W_U``, is a copier when its eigenvalues are mostly positive: sum(eigenvalues) / sum(|eigenvalues|) is +1
for a pure copier (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits"). Its nonzero
eigenvalues are those of the d_head x d_head matrix ``W_O^h diag(ln_final.w) W_U W_E diag(ln1.w) W_V^h``,
so the vocabulary-sized matrix is never built.

``k_composition``: on repeated tokens ``[r, r]`` an induction head at a second-copy token attends to
the token after the first occurrence. The key there is linear in what wrote the residual stream entering
the head's layer (the embedding, every earlier head's output ``z W_O``, every earlier MLP's output, the
biases) once the layer's norm scale is held at its clean value, so each part's ``q . RoPE(W_K norm(part))
/ sqrt(d_head)`` is its contribution and the parts sum to the score (``residual``: the score minus that
sum, rounding only). It is QK attribution (``an.qk_attribution``) on the key side with the query held
whole; a previous-token head feeding the induction head's keys is K-composition.
"""

from __future__ import annotations

import pandas as pd
import torch

__all__ = ["copying_scores", "k_composition", "key_parts", "held_norm"]


@torch.no_grad()
def copying_scores(model) -> pd.DataFrame:
    """Per head (columns layer, head): ``copying``, the OV circuit's eigenvalue copying score (+1: a pure
    copier; the module docstring), and ``copying_frac``, the fraction of its eigenvalues with a positive
    real part. From the weights alone."""
    W_E, W_U = model.W_E.double(), model.W_U.double()
    final = model.ln_final.w.double() if hasattr(model.ln_final, "w") else torch.ones(W_E.shape[1], dtype=torch.double)
    G = (final[:, None] * W_U) @ W_E  # [d_model, d_model]: residual -> logits -> back through the embedding
    rows = []
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        w1 = block.ln1.w.double() if hasattr(block.ln1, "w") else torch.ones(W_E.shape[1], dtype=torch.double)
        for head in range(model.cfg.n_heads):
            M = attn.W_O[head].double() @ G @ (w1[:, None] * attn.W_V[head].double())  # [d_head, d_head]
            eig = torch.linalg.eigvals(M)
            rows.append({"layer": layer, "head": head, "copying": float(eig.sum().real / eig.abs().sum()),
                         "copying_frac": float((eig.real > 0).double().mean())})
    return pd.DataFrame(rows)


def key_parts(model, cache, layer: int, keys: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """(labels, [batch, len(keys), n_parts, d_model]): what wrote the residual stream entering ``layer``
    at the ``keys`` positions: embedding, each earlier head's output, each earlier MLP's output, biases."""
    labels, parts = ["embed"], [cache["hook_embed"][:, keys]]
    if "hook_pos_embed" in cache.cache_dict:
        labels.append("pos_embed"), parts.append(cache["hook_pos_embed"][:, keys].expand_as(parts[0]))
    bias = torch.zeros_like(parts[0])
    for l in range(layer):
        attn = model.blocks[l].attn
        z = cache[f"blocks.{l}.attn.hook_z"][:, keys]  # [batch, k, head, d_head]
        out = torch.einsum("bkhe,hed->bkhd", z, attn.W_O)
        for h in range(model.cfg.n_heads):
            labels.append(f"L{l}H{h}"), parts.append(out[:, :, h])
        if getattr(attn, "b_O", None) is not None:
            bias = bias + attn.b_O
        if f"blocks.{l}.hook_mlp_out" in cache.cache_dict:  # an attention-only model has none
            labels.append(f"L{l} MLP"), parts.append(cache[f"blocks.{l}.hook_mlp_out"][:, keys])
    labels.append("bias"), parts.append(bias)
    return labels, torch.stack(parts, dim=2)


def held_norm(block, cache, layer: int, keys: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """``ln1`` applied to each part of its input [batch, k, n_parts, d_model] with its clean scale held
    (linear: a LayerNorm also centres each part; its bias goes to the last part, ``bias``)."""
    from workbench.components.norm import LayerNorm, LayerNormPre

    name = f"blocks.{layer}.ln1.hook_scale"
    if name not in cache.cache_dict:  # no norm
        return X
    norm = block.ln1
    if isinstance(norm, (LayerNorm, LayerNormPre)):
        X = X - X.mean(-1, keepdim=True)
    X = X / cache[name][:, keys][:, :, None]  # the scale, [batch, k, 1] -> per part
    if getattr(norm, "w", None) is not None:
        X = X * norm.w
    if getattr(norm, "b", None) is not None:
        X = X.clone()
        X[:, :, -1] = X[:, :, -1] + norm.b
    return X


@torch.no_grad()
def k_composition(model, tokens: torch.Tensor, half: int, heads: list[tuple[int, int]], cache=None,
                  prefix: int = 0) -> pd.DataFrame:
    """Per induction head and key-side part: the mean contribution to the head's attention score at the
    designed entries (query n + j, key j + 1, j = 0..n-2, all after ``prefix`` tokens such as a BOS), the
    mean score, and the largest |score - sum of parts|; see the module docstring.

    ``tokens`` [batch, prefix + 2 half]: ``prefix`` tokens, then a random half and its repeat
    (``an.repeated_random_tokens``); ``heads``: (layer, head) pairs; ``cache``: a ``run_with_cache`` of
    ``tokens`` to reuse. Columns layer, head, source (``embed``, ``pos_embed``, ``L0H2``, ``L0 MLP``,
    ``bias``), contribution, score, residual."""
    if tokens.ndim != 2 or tokens.shape[1] < prefix + 2 * half or half < 2:
        raise ValueError(f"k_composition needs tokens [batch, prefix + 2 * half] = [*, {prefix + 2 * half}] with "
                         f"half >= 2, got shape {tuple(tokens.shape)} and half={half}")
    for layer, head in heads:
        if not (0 <= layer < model.cfg.n_layers and 0 <= head < model.cfg.n_heads):
            raise ValueError(f"head ({layer}, {head}) is not in this model ({model.cfg.n_layers} layers x "
                             f"{model.cfg.n_heads} heads)")
    if cache is None:
        wanted = ("hook_embed", "hook_pos_embed", "hook_z", "hook_mlp_out", "hook_resid_pre", "ln1.hook_scale",
                  "hook_rot_q", "hook_q", "hook_attn_scores")
        _, cache = model.run_with_cache(tokens, names_filter=lambda name: name.endswith(wanted))
    keys = torch.arange(prefix + 1, prefix + half, device=tokens.device)
    queries = keys + half - 1
    batch = tokens.shape[0]
    rows = []
    for layer, head in heads:
        block, attn = model.blocks[layer], model.blocks[layer].attn
        labels, X = key_parts(model, cache, layer, keys)
        whole = cache[f"blocks.{layer}.hook_resid_pre"][:, keys]
        if not torch.allclose(X.sum(2), whole, atol=1e-3 * float(whole.abs().max())):
            raise RuntimeError(f"the parts of layer {layer}'s input do not sum to it: the model writes its residual "
                               "stream somewhere key_parts does not read")
        Xn = held_norm(block, cache, layer, keys, X)
        k = Xn @ attn._W_K[head // attn.group]  # [batch, k, n_parts, d_head]
        if attn._b_K is not None:
            k[:, :, -1] = k[:, :, -1] + attn._b_K[head // attn.group]
        if attn.position.rotates:
            k = attn.position.rotate(k.contiguous(), 0, positions=keys[None].expand(batch, -1))
            q = cache[f"blocks.{layer}.attn.hook_rot_q"][:, queries, head]
        else:
            q = cache[f"blocks.{layer}.attn.hook_q"][:, queries, head]
        contrib = (k * q[:, :, None]).sum(-1) / attn.attn_scale  # [batch, k, n_parts]
        score = cache[f"blocks.{layer}.attn.hook_attn_scores"][:, head, queries, keys]  # [batch, k]
        residual = float((score - contrib.sum(-1)).abs().max())
        mean = contrib.mean(dim=(0, 1))
        for label, value in zip(labels, mean.tolist()):
            rows.append({"layer": layer, "head": head, "source": label, "contribution": value,
                         "score": float(score.mean()), "residual": residual})
    return pd.DataFrame(rows)
