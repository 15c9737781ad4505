"""QK attribution: why a head attended where it did, as pairs of graph nodes.

    frame = qk_attribution(graph, layer, head, query_pos, key_pos)   # one row per (query node, key node)
    frame.attrs["score"], frame.attrs["bilinear"], frame.attrs["residual"]

An attribution graph freezes attention; this opens one entry of a frozen pattern. In the graph's
replacement model the residual stream entering block ``layer`` at a position is exactly a sum of
node writes: the embedding (token, plus a learned positional embedding where the model has one),
every active feature's decoder write (a cross-layer feature's writes into every MLP output before
``layer``), every error node, every earlier head's output at that position (its result, the value
path through the frozen pattern, ``z W_O``) and constants (output and decoder biases) gathered in
one ``bias`` node. A skip-transcoder's skip path is a linear map of its MLP input (a frozen ``ln2``
scale) and is credited to the nodes that make that input. The frozen ``ln1`` scale makes the
norm linear (centring and scale; its bias joins ``bias``); then ``W_Q``/``W_K`` (their biases join
``bias``), a frozen QK-norm scale, RoPE at the two fixed positions and the model's score scale
are linear too, so the score ``q . k`` is bilinear in (query-side node, key-side node) and the
contributions of all pairs sum to it exactly. ALiBi's additive bias goes to the (bias, bias) pair.
A score soft-cap ``c tanh(s / c)`` is linearised at this prompt (each pair scaled by the tanh's
derivative there); what that misses is ``residual`` = score - bilinear, reported beside the table.

``pattern_change`` (the ``exact`` largest rows): the exact change of pattern[query, key] when that
row's key-side node's contribution is removed from the key (a re-run of the layer with that key
edited after ``W_K``, the norm scales held as the graph holds them, everything else live).
"""

from __future__ import annotations

import math
from numbers import Integral  # int and numpy's integers (a DataFrame column's values)
from typing import Optional

import torch
from torch import Tensor

from workbench.utils import is_int, weights_signature

KINDS = ("token", "feature", "error", "head", "bias")
COLUMNS = ["query_node", "key_node", "query_kind", "key_kind", "query_layer", "key_layer", "contribution",
           "pattern_change", "query_unit", "key_unit", "query_index", "key_index", "query_node_pos", "key_node_pos"]


class _Parts:
    """A residual-stream vector at position ``pos`` as a sum of node writes, ``stack().sum(0)``; row 0 is ``bias``.

    Each node has a ``unit`` (its name without the position: ``L0 H2``, ``tok '4'``, ``F1:123``,
    ``err L1``, ``bias``), an ``index`` (the head's or the feature's, else -1) and a label, the unit at
    ``pos`` (``L0 H2 @5``; ``bias`` alone, a sum of constants)."""

    def __init__(self, d_model: int, pos: int, device, dtype):
        self.pos = pos
        self.units, self.kinds, self.layers, self.indices = ["bias"], ["bias"], [-1], [-1]
        self.rows = [torch.zeros(d_model, device=device, dtype=dtype)]
        self.index: dict = {}  # node key -> row

    def add(self, key, unit: str, kind: str, layer: int, index: int, vector: Tensor) -> None:
        if key in self.index:
            self.rows[self.index[key]] = self.rows[self.index[key]] + vector
            return
        self.index[key] = len(self.rows)
        self.units.append(unit), self.kinds.append(kind), self.layers.append(layer), self.indices.append(index)
        self.rows.append(vector)

    @property
    def labels(self) -> list[str]:
        return [u if k == "bias" else f"{u} @{self.pos}" for u, k in zip(self.units, self.kinds)]

    def stack(self) -> Tensor:
        return torch.stack(self.rows)


def _norm_parts(norm, vectors: Tensor, scale: Optional[Tensor], weighted: bool = True) -> Tensor:
    """A pre-norm's action on the parts of its input, its scale held: linear; row 0 (bias) gets its bias."""
    from workbench.components.norm import LayerNorm, LayerNormPre, NoNorm

    if isinstance(norm, NoNorm) or norm is None:
        return vectors
    x = vectors.double()
    if isinstance(norm, (LayerNorm, LayerNormPre)):
        x = x - x.mean(-1, keepdim=True)
    x = x / scale.double()
    if not weighted:
        return x
    x = x * norm.w.detach().double()
    b = getattr(norm, "b", None)
    if b is not None:
        x[0] = x[0] + b.detach().double()
    return x


class QKContext:
    """One clean run of a graph's prompt and the linear maps QK attribution reads, built once per graph."""

    def __init__(self, graph):
        from workbench.analysis.graphs.replacement import check_layout
        from workbench.components.attention import Attention
        from workbench.components.block import layout_of

        self.graph = graph
        self.model, self.rs, self.cap = graph._bound()
        # the weights' in-memory signature (Graph._bound's, which it just matched): check_weights compares it
        # again before every reuse, since .data edits, which bump no version counter, leave every cached
        # tensor here (the clean run, the node writes, the rotations) of the old weights
        self.signature = graph._context[3]
        # what check_context compares with the graph a context is later given with: its prompt and, as the
        # graph it was made for recorded (bind checked the weights against it), the weights' fingerprint
        self.tokens = graph.tokens.reshape(-1).cpu().clone()
        recorded = graph.meta.get("fingerprint") if isinstance(graph.meta, dict) else None
        self.fingerprint = dict(recorded) if isinstance(recorded, dict) else None
        model = self.model
        check_layout(model)
        if not all(isinstance(b.attn, Attention) for b in model.blocks):
            raise ValueError("QK attribution needs MHA/GQA/MQA attention (W_Q, W_K); MLA's latent queries and keys "
                             "are not supported")
        self.parallel = layout_of(model.cfg) == "parallel"
        self.n_pos = len(self.cap.tokens)
        wanted = ("hook_resid_pre", "attn.hook_z", "attn.hook_v", "ln1.hook_scale", "ln2.hook_scale",
                  "q_norm.hook_scale", "k_norm.hook_scale", "attn.hook_attn_scores", "attn.hook_pattern")
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                _, cache = model.run_with_cache(self.cap.tokens[None],
                                                names_filter=lambda n: any(n.endswith(w) for w in wanted))
        finally:
            model.train(was)
        self.cache = {k: v[0] for k, v in cache.items()}
        self.str_tokens = graph.str_tokens
        self._rot: dict = {}
        self._parts: dict = {}

    def check_weights(self) -> None:
        """A ValueError unless the model's and the transcoders' weights are still those this context was
        made with: an edit (``.data`` too), a ``load_state_dict``, a cast or a device move since. One pass
        over the weights (``Graph._bound``'s signature), made once per ``qk_attribution``,
        ``attention_entries`` or ``qk_table`` call that is given this context."""
        if weights_signature(self.model, self.rs) != self.signature:
            raise ValueError("the model's or the transcoders' weights changed since this QK context was made (an "
                             "edit, a load, a cast or a move): its clean run is of the old weights. Build the graph "
                             "and QKContext(graph) again from the new weights, or put the old ones back")

    # ---- the residual stream as node writes -------------------------------------------------------
    def parts(self, layer: int, pos: int) -> _Parts:
        """The residual stream entering block ``layer`` at ``pos``, as node writes."""
        key = (layer, pos)
        if key in self._parts:
            return self._parts[key]
        model, rs, cap = self.model, self.rs, self.cap
        embed = cap.embed[pos].detach().double()
        token = cap.token_part[pos].detach().double()
        parts = _Parts(embed.shape[-1], pos, embed.device, torch.float64)
        parts.rows[0] = parts.rows[0] + (embed - token)  # token_embedding="token": the position embedding, a constant
        parts.add(("tok", pos), f"tok {self.str_tokens[pos]!r}", "token", -1, -1, token)
        for l in range(layer):
            attn = model.blocks[l].attn
            mlp_reads = parts.stack() if self.parallel else None  # a parallel block's MLP reads resid_pre
            result = torch.einsum("he,hed->hd", self.cache[f"blocks.{l}.attn.hook_z"][pos].double(), attn.W_O.double())
            for h in range(model.cfg.n_heads):
                parts.add(("head", l, h), f"L{l} H{h}", "head", l, h, result[h])
            if attn.b_O is not None:
                parts.rows[0] = parts.rows[0] + attn.b_O.detach().double()
            if rs.n_layers:
                self._add_mlp(parts, l, pos, parts.stack() if mlp_reads is None else mlp_reads)
        self._parts[key] = parts
        return parts

    def _add_mlp(self, parts: _Parts, layer: int, pos: int, reads: Tensor) -> None:
        """Layer ``layer``'s replacement MLP output at ``pos``: features, error, bias and skip path."""
        rs, cap = self.rs, self.cap
        with torch.no_grad():
            if rs.skip:  # x W_skip^T of the MLP input: linear in the parts of the residual it reads
                hook = rs.hook_in(layer)
                if not hook.endswith("ln2.hook_normalized"):
                    raise ValueError(f"a skip path reading {hook!r} is not supported here (ln2.hook_normalized is)")
                scale = self.cache[f"blocks.{layer}.ln2.hook_scale"][pos]
                x = _norm_parts(self.model.blocks[layer].ln2, reads, scale, weighted=False)
                skip = rs.skip_out(layer, x.to(reads.dtype)).double()
                for i in range(len(skip)):
                    parts.rows[i] = parts.rows[i] + skip[i]
            zeros = [a[:1] * 0 for a in cap.acts]
            parts.rows[0] = parts.rows[0] + rs.decode(layer, zeros, cap.x_in[layer][:1] * 0)[0].double()
            sources = range(layer + 1) if rs.cross_layer else (layer,)
            for s in sources:
                active = cap.acts[s][pos].nonzero().squeeze(-1)
                if not len(active):
                    continue
                writes = cap.acts[s][pos, active, None].double() * rs.decoder(s, layer)[active].double()
                for f, w in zip(active.tolist(), writes):
                    parts.add(("feature", s, f), f"F{s}:{f}", "feature", s, f, w)
            if pos < cap.held:  # a held position's error is a constant (held_positions), not a node
                parts.rows[0] = parts.rows[0] + cap.errors[layer][pos].double()
            else:
                parts.add(("error", layer), f"err L{layer}", "error", layer, -1, cap.errors[layer][pos].double())

    # ---- into query / key space ---------------------------------------------------------------------
    def rotation(self, layer: int) -> Optional[Tensor]:
        """[pos, d_head, d_head] R with rotate(v) at pos = v @ R[pos] (None: the layer does not rotate)."""
        attn = self.model.blocks[layer].attn
        if not attn.position.rotates:
            return None
        if layer not in self._rot:
            e = self.model.cfg.d_head
            basis = torch.eye(e, device=self.cap.embed.device)[:, None, None, :].expand(e, self.n_pos, 1, e)
            with torch.no_grad():
                self._rot[layer] = attn.position.rotate(basis.contiguous(), 0).double()[:, :, 0].transpose(0, 1)
        return self._rot[layer]

    def project(self, layer: int, head: int, pos: int, side: str) -> tuple[_Parts, Tensor, Tensor]:
        """(parts, [n, d_head] their query or key after norm, projection, QK-norm and RoPE,
        [n, d_head] their key or query right after the projection, before QK-norm and RoPE)."""
        model = self.model
        block, attn = model.blocks[layer], model.blocks[layer].attn
        parts = self.parts(layer, pos)
        with torch.no_grad():
            scale = self.cache.get(f"blocks.{layer}.ln1.hook_scale")
            x = _norm_parts(getattr(block, "ln1", None), parts.stack(), None if scale is None else scale[pos])
            if side == "q":
                W, b, norm, idx = attn.W_Q[head], attn.b_Q, getattr(attn, "q_norm", None), head
            else:
                idx = head // attn.group
                W, b, norm = attn._W_K[idx], attn._b_K, getattr(attn, "k_norm", None)
            proj = x @ W.detach().double()
            if b is not None:
                proj[0] = proj[0] + b[idx].detach().double()
            out = proj
            if norm is not None:  # QK-norm with its scale held: linear
                s = self.cache[f"blocks.{layer}.attn.{side}_norm.hook_scale"][pos]
                e = model.cfg.d_head
                if model.cfg.qk_norm == "head":
                    s, w = s[idx], norm.w.detach().double()
                else:
                    w = norm.w.detach().double()[idx * e:(idx + 1) * e]
                out = out / s.double() * w
            R = self.rotation(layer)
            if R is not None:
                out = out @ R[pos]
        return parts, out, proj


def _context(graph, context: Optional[QKContext]) -> QKContext:
    """``context`` once checked to be of ``graph``'s prompt and weights, and its weights unchanged since it
    was made (a ValueError if not), or a new one."""
    if context is None:
        return QKContext(graph)
    from workbench.analysis.graphs.checks import check_context

    check_context(context, graph)
    context.check_weights()
    return context


def _check(model, n_pos: int, layer, head, query_pos, key_pos) -> tuple[int, int, int, int]:
    """The four as ints (numpy ones too: they come from DataFrame rows such as ``attention_entries``')."""
    cfg = model.cfg
    for name, value, hi in (("layer", layer, cfg.n_layers), ("head", head, cfg.n_heads),
                            ("query_pos", query_pos, n_pos), ("key_pos", key_pos, n_pos)):
        if not is_int(value) or not 0 <= value < hi:
            raise ValueError(f"{name} must be an integer in [0, {hi}), got {value!r}")
    layer, head, query_pos, key_pos = int(layer), int(head), int(query_pos), int(key_pos)
    if key_pos > query_pos:
        raise ValueError(f"key_pos {key_pos} comes after query_pos {query_pos}: attention is causal, a query "
                         "reads only keys at or before its own position")
    return layer, head, query_pos, key_pos


def qk_attribution(graph, layer: Integral, head: Integral, query_pos: Integral, key_pos: Integral, *,
                   top: Optional[Integral] = 20, exact: Integral = 5, context: Optional[QKContext] = None):
    """Attention score of ``head`` at ``layer``, query ``query_pos``, key ``key_pos``, split into
    pairs (query-side node, key-side node) of ``graph``'s prompt (see the module docstring).

    A DataFrame sorted by |contribution|, at most ``top`` rows (None: all), columns ``COLUMNS``;
    ``pattern_change`` for the first ``exact`` rows, NaN after. ``attrs``: ``score`` (the model's
    score, after its scale and soft-cap, before the mask), ``bilinear`` (the sum of all pairs),
    ``residual`` (score - bilinear), ``layer``, ``head``, ``query_pos``, ``key_pos``.
    A ``context`` is re-checked against the weights on every call (``QKContext.check_weights``).
    """
    return _attribution(_context(graph, context), layer, head, query_pos, key_pos, top, exact)


def _attribution(ctx: QKContext, layer, head, query_pos, key_pos, top, exact):
    """``qk_attribution`` with a context already checked (a loop over entries checks it once, before)."""
    import pandas as pd

    model = ctx.model
    layer, head, query_pos, key_pos = _check(model, ctx.n_pos, layer, head, query_pos, key_pos)
    if top is not None and (not is_int(top) or top < 1):
        raise ValueError(f"top must be a positive integer or None, got {top!r}")
    if not is_int(exact) or exact < 0:
        raise ValueError(f"exact must be a non-negative integer, got {exact!r}")
    top, exact = None if top is None else int(top), int(exact)
    score = float(ctx.cache[f"blocks.{layer}.attn.hook_attn_scores"][head, query_pos, key_pos])
    if not math.isfinite(score):
        raise ValueError(f"query {query_pos} does not see key {key_pos} in layer {layer} (outside its sliding window)")
    attn = model.blocks[layer].attn
    qp, Q, _ = ctx.project(layer, head, query_pos, "q")
    kp, K, K_pre = ctx.project(layer, head, key_pos, "k")
    C = Q @ K.T / attn.attn_scale  # [n_query_parts, n_key_parts]
    if attn.softcap is not None:  # linearised at this prompt: d/ds c tanh(s / c) = 1 - tanh(s / c)^2
        C = C * (1 - math.tanh(float(C.sum()) / attn.softcap) ** 2)
    bias = attn.position.score_bias(ctx.n_pos, ctx.n_pos, 0)
    if bias is not None:  # ALiBi: an additive score term, a constant
        C[0, 0] = C[0, 0] + float(bias[head, query_pos, key_pos])
    bilinear = float(C.sum(dtype=torch.float64))
    flat = C.flatten()
    order = flat.abs().argsort(descending=True)
    if top is not None:
        order = order[:top]
    qi, ki = (order // C.shape[1]).tolist(), (order % C.shape[1]).tolist()
    q_labels, k_labels = qp.labels, kp.labels
    frame = pd.DataFrame({
        "query_node": [q_labels[i] for i in qi], "key_node": [k_labels[j] for j in ki],
        "query_kind": [qp.kinds[i] for i in qi], "key_kind": [kp.kinds[j] for j in ki],
        "query_layer": [qp.layers[i] for i in qi], "key_layer": [kp.layers[j] for j in ki],
        "contribution": flat[order].tolist(), "pattern_change": float("nan"),
        "query_unit": [qp.units[i] for i in qi], "key_unit": [kp.units[j] for j in ki],
        "query_index": [qp.indices[i] for i in qi], "key_index": [kp.indices[j] for j in ki],
        "query_node_pos": query_pos, "key_node_pos": key_pos,
    })
    n_exact = min(exact, len(frame))
    if n_exact:
        frame.loc[:n_exact - 1, "pattern_change"] = _pattern_change(ctx, layer, head, query_pos, key_pos,
                                                                    K_pre[ki[:n_exact]])
    frame.attrs.update(score=score, bilinear=bilinear, residual=score - bilinear, layer=layer, head=head,
                       query_pos=query_pos, key_pos=key_pos)
    return frame


def _pattern_change(ctx: QKContext, layer: int, head: int, query_pos: int, key_pos: int, removed: Tensor) -> list:
    """pattern[query, key] with each row of ``removed`` [n, d_head] taken off the key (after W_K), minus the clean one.

    One batched re-run: copy i edits its key at ``key_pos`` in ``attn.hook_k``; QK-norm scales are
    held at their clean values (the graph holds every norm scale), the rest of the layer runs live.
    """
    model = ctx.model
    n = len(removed)
    kv = head // model.blocks[layer].attn.group
    prefix = f"blocks.{layer}.attn"
    got = {}

    def edit_key(k: Tensor, hook) -> Tensor:
        k = k.clone()
        k[:, key_pos, kv] = k[:, key_pos, kv] - removed.to(k.dtype)
        return k

    def held(value: Tensor):
        def hook(act: Tensor, hook) -> Tensor:
            return value[None].expand(act.shape).to(act.dtype)
        return hook

    def read(pattern: Tensor, hook) -> None:
        got["pattern"] = pattern[:, head, query_pos, key_pos].double()

    hooks = [(f"{prefix}.hook_k", edit_key), (f"{prefix}.hook_pattern", read)]
    hooks += [(f"{prefix}.{s}_norm.hook_scale", held(ctx.cache[f"{prefix}.{s}_norm.hook_scale"]))
              for s in ("q", "k") if f"{prefix}.{s}_norm.hook_scale" in ctx.cache]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            model.run_with_hooks(ctx.cap.tokens[None].expand(n, -1), fwd_hooks=hooks)
    finally:
        model.train(was)
    clean = float(ctx.cache[f"{prefix}.hook_pattern"][head, query_pos, key_pos])
    return (got["pattern"] - clean).tolist()


# ---- the attention entries a graph keeps, and their QK pairs ------------------------------------------
def attention_entries(graph, context: Optional[QKContext] = None):
    """Every attention entry (layer, head, query, key) of the graph's prompt with its weight in the graph:
    ``pattern[query, key] (v_key W_O) . g``, where ``g`` is the gradient of the graph's weighted
    logit targets (``sum_j logit_weight_j * target_j``) with respect to that head's output at the
    query in the frozen replacement model. With attention frozen a head's output is a sum over keys,
    and this is the part of the targets that flows through one key: the entries sum, over keys,
    to the head's gradient x output (the whole effect of that output, through later heads' value paths
    too, since attention is frozen). A DataFrame sorted by |weight|."""
    return _entries(graph, _context(graph, context))


def _entries(graph, ctx: QKContext):
    """``attention_entries`` with a context already checked."""
    import pandas as pd

    from workbench.analysis.graphs.replacement import final_read, frozen_forward

    model, rs, cap = ctx.model, ctx.rs, ctx.cap
    cfg = model.cfg
    logit_nodes = graph.nodes_of("logit")
    weights = graph.logit_weight[logit_nodes].to(cap.embed)
    vectors = graph.logit_vectors.to(cap.embed)
    results: dict[int, Tensor] = {}

    def leaf(act: Tensor, hook) -> Tensor:
        # a zero added, not the output detached: the gradient then also runs through later heads' values
        results[int(hook.name.split(".")[1])] = zero = torch.zeros_like(act, requires_grad=True)
        return act + zero

    hooks = [(f"blocks.{l}.attn.hook_result", leaf) for l in range(cfg.n_layers)]
    run = frozen_forward(model, rs, cap)
    was = model.training
    model.eval()
    try:
        with torch.enable_grad(), model.hooks(fwd_hooks=hooks):
            run()
            final = run.final[0, -1] * final_read(model)[1]
            objective = ((vectors @ final) * weights).sum()
            grads = torch.autograd.grad(objective, [results[l] for l in range(cfg.n_layers)], allow_unused=True)
    finally:
        model.train(was)
    rows = []
    P = ctx.n_pos
    causal = torch.ones(P, P, dtype=torch.bool, device=cap.embed.device).tril()
    for l, g in enumerate(grads):
        if g is None:
            continue
        attn = model.blocks[l].attn
        with torch.no_grad():
            v = ctx.cache[f"blocks.{l}.attn.hook_v"].repeat_interleave(attn.group, dim=1).double()  # [key, head, e]
            ov = torch.einsum("khe,hed->khd", v, attn.W_O.double())
            pattern = ctx.cache[f"blocks.{l}.attn.hook_pattern"].double()  # [head, query, key]
            weight = pattern * torch.einsum("khd,qhd->hqk", ov, g[0].double())
        h, q, k = (causal[None].expand_as(weight) & (weight != 0)).nonzero(as_tuple=True)
        rows.append(pd.DataFrame({"layer": l, "head": h.tolist(), "query_pos": q.tolist(), "key_pos": k.tolist(),
                                  "pattern": pattern[h, q, k].tolist(), "weight": weight[h, q, k].tolist()}))
    frame = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(
        columns=["layer", "head", "query_pos", "key_pos", "pattern", "weight"])
    frame = frame.astype({"layer": int, "head": int, "query_pos": int, "key_pos": int, "pattern": float,
                          "weight": float})
    return frame.reindex(frame["weight"].abs().sort_values(ascending=False).index).reset_index(drop=True)


def qk_table(graph, entries: int = 2, top: int = 5, exact: int = 0, context: Optional[QKContext] = None):
    """For each head, its ``entries`` attention entries of largest |weight| in the graph
    (``attention_entries``), each with its ``top`` QK pairs (``qk_attribution``): one DataFrame,
    a row per (entry, pair), with the entry's ``layer head query_pos key_pos pattern weight``,
    ``score`` and ``residual`` beside the pair's columns and its ``rank`` within the entry."""
    import pandas as pd

    if not is_int(entries) or entries < 1:  # head(-1) would keep all but the last entry of each head
        raise ValueError(f"entries must be a positive integer, got {entries!r}")
    ctx = _context(graph, context)  # checked once here, not once per entry: nothing edits the weights in between
    kept = _entries(graph, ctx).groupby(["layer", "head"], sort=False).head(entries)
    frames = []
    for e in kept.itertuples(index=False):
        pairs = _attribution(ctx, int(e.layer), int(e.head), int(e.query_pos), int(e.key_pos), top, exact)
        lead = pd.DataFrame({"layer": e.layer, "head": e.head, "query_pos": e.query_pos, "key_pos": e.key_pos,
                             "pattern": e.pattern, "weight": e.weight, "score": pairs.attrs["score"],
                             "residual": pairs.attrs["residual"], "rank": range(len(pairs))})
        frames.append(pd.concat([lead, pairs.reset_index(drop=True)], axis=1))
    columns = ["layer", "head", "query_pos", "key_pos", "pattern", "weight", "score", "residual", "rank", *COLUMNS]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
