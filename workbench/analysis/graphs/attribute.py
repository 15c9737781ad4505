"""Computing an attribution graph: backward passes through the frozen replacement model.

    graph = attribution_graph(model, transcoders, "When Mary and John went to the store, John gave a drink to")

Every edge is a direct effect in the frozen replacement model (``replacement.py``), where
everything is linear: the edge from a source node to a target node is the gradient of the
target's pre-activation with respect to the source times the source's value (gradient x
activation), which equals the change in the target when the source is set to zero with every
other node held. One forward of ``batch_size`` copies of the prompt is kept; each backward
injects one target per copy (a feature's encoder row at its layer's MLP input, or a logit
direction at the unembedding) and reads, at every source, the gradient at the MLP outputs
(features and errors) and at the embedding.

Which features get a row: the logits' rows first, then, while the budget
``max_feature_nodes`` lasts, the not yet expanded features of largest influence on the logits
through the rows so far (as circuit-tracer does). Memory: rows are kept sparse, each row only
its largest edges up to ``edge_mass`` of its absolute mass (and at most
``max_edges_per_node``), so what is held grows with rows x kept edges plus the per-copy
activations, linearly in the context; nothing of size (active features)^2 is ever made.

Speed (what made it faster than circuit-tracer on the same prompts): the real MLPs are skipped
in the kept forward; at short context the backward runs through the stored attention patterns
(one product per head) instead of the fused kernel's backward; a feature's edges are read by
one batched product per position against a grid of the active features' decoder rows; the
kept edges go into one buffer paged in as written (``_EdgeStore``), or to disk (``spill_dir``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from workbench.analysis.common import check_device
from workbench.analysis.graphs.checks import check_capture_finite, check_finite, fingerprint, warn_trained_elsewhere
from workbench.analysis.graphs.graph import Graph, NODE_KINDS, _influence, compute_influence_sparse
from workbench.analysis.graphs.replacement import (AttentionOnly, Capture, FrozenRun, capture, check_conventions,
                                                   check_layout, check_model, final_read, pattern_layers,
                                                   replacement_set, targets_of)
from workbench.analysis.graphs.spill import Spill, open_spill
from workbench.padding import TokenBatch
from workbench.utils import is_int

FEATURE, ERROR, TOKEN, LOGIT = (NODE_KINDS.index(k) for k in ("feature", "error", "token", "logit"))
PATTERN_BUDGET = 64 << 20  # bytes of stored attention patterns (all layers) below which they are used
GRID_BUDGET = 32 << 20  # bytes of decoder-row grids (all layers) below which the rows are read through them


def attribution_graph(
    model,
    transcoders,
    prompt: Union[str, Sequence[str], Tensor, TokenBatch],
    target=None,
    *,
    max_n_logits: int = 10,
    desired_logit_prob: float = 0.95,
    max_feature_nodes: Optional[int] = None,
    batch_size: Optional[int] = None,
    edge_mass: float = 1.0,
    max_edges_per_node: Optional[int] = None,
    update_interval: int = 4,
    chunk: int = 8192,
    stored_patterns: Optional[bool] = None,
    spill_dir: Optional[Union[str, Path]] = None,
    edge_chunk: int = 1 << 20,
    verbose: bool = False,
    qk: bool = False,
    qk_entries: int = 2,
    qk_top: int = 5,
    token_embedding: str = "token+position",
    held_positions: int = 0,
) -> Union[Graph, list[Graph]]:
    """The attribution graph of ``prompt`` (a list of prompts or a padded batch: one graph each).

    ``target``: None (the top logits at the last position up to ``desired_logit_prob`` of the
    probability, at most ``max_n_logits``), a token (id or string), a pair ``(a, b)`` (the
    logit difference a - b), a [d_vocab] weighting of the logits or a [d_model] direction at the
    unembedding's input, or a list of these. Token logits are demeaned over the vocabulary, as
    circuit-tracer does. ``max_feature_nodes``: how many features get rows (None: all active
    ones); ``edge_mass`` < 1 / ``max_edges_per_node`` keep each row sparse. ``batch_size``: targets
    per backward pass (None: up to 64, fewer as the context grows, so the kept forward of that many
    copies stays near 2^16 token copies). ``stored_patterns``: the backward passes run through the
    attention patterns stored from the clean run (faster; heads x pos^2 floats per layer) rather than
    through the fused attention with frozen queries and keys (memory linear in the context); None:
    stored when they take at most 64 MB. Both give the same graph.

    ``spill_dir``: a folder for the edges, written as they are computed in safetensors files of
    ``edge_chunk`` edges (``graph-edges-<run>-00000.safetensors``, ...; a batch of prompts: one
    ``prompt-{i}`` subfolder each), so at most one chunk of edges is ever in memory; the graph
    reads them back chunk by chunk for influence, pruning and subgraphs (see ``Graph.edge_files``).
    The folder must hold no edge files already (they are the caller's to delete), and one graph at a
    time writes into it (``spill.open_spill``: another one is refused at once); a path that is a file,
    too long, or not writable is refused before anything is computed.

    ``transcoders``: a list of per-layer (skip-)transcoders or a cross-layer transcoder; None for an
    attention-only model (its replacement model is the model itself: token and logit nodes only).
    ``qk``: attach ``graph.qk`` (``qk.qk_table``): for every head its ``qk_entries`` attention
    entries of largest weight in the graph, each with its ``qk_top`` QK pairs.

    Two conventions, recorded in ``graph.meta`` (the defaults keep every input a node; circuit-tracer
    0.5.0's graphs are ``token_embedding="token", held_positions=1``):
    ``token_embedding``: on a model whose position embedding is added to the residual stream (learned,
    sinusoidal), a token node carries ``"token+position"`` (the default: the whole stream entering block
    0) or ``"token"`` (W_E of its token alone; the position embedding is then a constant, no node's).
    With RoPE, ALiBi or no positions the two are the same. ``held_positions``: the first this many
    positions get no feature nodes and no error nodes (0, the default; 1 holds position 0, often BOS,
    whose features are then held at zero and whose MLP output is a constant).
    """
    if not 0 < edge_mass <= 1:
        raise ValueError(f"edge_mass must lie in (0, 1], got {edge_mass}")
    # update_interval 0 picked no rows and looped for ever; max_feature_nodes -1 shrank the edge buffer below
    # the logit rows; max_edges_per_node 0 kept no edge at all
    optional = ("batch_size", "max_edges_per_node")
    for name, value in (("batch_size", batch_size), ("max_n_logits", max_n_logits), ("chunk", chunk),
                        ("edge_chunk", edge_chunk), ("update_interval", update_interval),
                        ("max_edges_per_node", max_edges_per_node)):
        if (value is not None or name not in optional) and (not is_int(value) or value < 1):
            raise ValueError(f"{name} must be a positive integer{' or None' if name in optional else ''}, "
                             f"got {value!r}")
    if max_feature_nodes is not None and (not is_int(max_feature_nodes) or max_feature_nodes < 0):
        raise ValueError(f"max_feature_nodes must be a non-negative integer or None, got {max_feature_nodes!r}")
    check_conventions(token_embedding, held_positions)
    check_layout(model)
    rs = replacement_set(transcoders, model)
    check_device(model, "the transcoders' weights", rs)  # before check_model's probe runs them on the model's data
    check_model(model, rs)
    _check_precision(model, rs)
    if isinstance(target, list) and not target:
        raise ValueError("target is an empty list: give at least one target (a token, a pair (a, b), a tensor), "
                         "or None for the top logits")
    check_finite(model, rs)  # once, before anything is computed: a NaN weight gave NaN edges or a runaway graph
    weights = fingerprint(model, rs)  # what the graph records, so bind() can refuse other weights
    warn_trained_elsewhere(model, rs, weights["model"])
    tokens, mask, single = _tokens(model, prompt)
    if stored_patterns is None:
        n_heads = sum(model.blocks[l].attn.cfg.n_heads for l in pattern_layers(model))
        stored_patterns = n_heads * tokens.shape[1] ** 2 * 4 <= PATTERN_BUDGET
    was = model.training
    # the spill folder is checked (and locked) before any computation: open_spill refuses what it cannot own
    with open_spill(spill_dir, None if single else tokens.shape[0]) as spills:
        model.eval()
        try:
            caps = capture(model, rs, tokens, mask, patterns=bool(stored_patterns), token_embedding=token_embedding,
                           held_positions=held_positions)
            for cap in caps:
                check_capture_finite(cap)
            graphs = [_attribute(model, rs, cap, target, max_n_logits, desired_logit_prob, max_feature_nodes,
                                 batch_size, edge_mass, max_edges_per_node, update_interval, chunk, verbose,
                                 _EdgeStore(edge_chunk, spill, _capacity(rs, cap, target, max_n_logits,
                                                                         max_feature_nodes)))
                      for cap, spill in zip(caps, spills)]
            for graph in graphs:
                graph.meta["fingerprint"] = dict(weights)
            if qk:
                from workbench.analysis.graphs.qk import qk_table

                for graph in graphs:
                    graph.qk = qk_table(graph, entries=qk_entries, top=qk_top)
        finally:
            model.train(was)
    return graphs[0] if single else graphs


def _check_precision(model, rs) -> None:
    """A ValueError for a half-precision model, or transcoders in another dtype than the model's: the
    backward passes would mix dtypes (a RuntimeError deep inside), and sums over bf16 values are about 1%
    off (on a tiny bf16 attention-only model, with the crash patched, the QK pairs missed the score and the
    head loadings the edge by that)."""
    dtype = model.embed.W_E.dtype
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"attribution graphs need a float32 (or float64) model; this one is {dtype}: build the "
                         "graph from model.float() (and float32 transcoders)")
    other = sorted({str(p.dtype) for p in rs.parameters() if p.dtype != dtype})
    if other:
        raise ValueError(f"the transcoders' weights are {', '.join(other)}, the model's {dtype}: give them in the "
                         f"model's dtype (transcoder.to({dtype}))")


def _tokens(model, prompt) -> tuple[Tensor, Optional[Tensor], bool]:
    if isinstance(prompt, str):
        return model.to_tokens(prompt).reshape(1, -1), None, True
    if isinstance(prompt, TokenBatch):
        return prompt.tokens.to(model.device), prompt.attention_mask.to(model.device), False
    if isinstance(prompt, Tensor):
        if prompt.ndim == 1 or (prompt.ndim == 2 and prompt.shape[0] == 1):
            return prompt.reshape(1, -1).to(model.device), None, True
        if prompt.ndim == 2:
            return prompt.to(model.device), None, False
        raise ValueError(f"token prompts are [pos] or [batch, pos]; got shape {list(prompt.shape)}")
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
        batch = model.to_tokens(list(prompt), padding_side="right")
        return batch.tokens, batch.attention_mask, False
    raise ValueError("prompt must be a string, a list of strings, a token tensor or a TokenBatch")


# ---- targets ----------------------------------------------------------------------------------------
def logit_targets(model, cap: Capture, target, max_n_logits: int, desired_logit_prob: float
                  ) -> tuple[list[str], list[int], Tensor, Tensor]:
    """``(labels, vocab ids (-1: not a token), weights, d_model vectors at the unembedding input)``."""
    W_U = model.W_U.detach()
    V = W_U.shape[1]
    probs = cap.logits[-1].float().softmax(-1)

    def token(t) -> int:
        if isinstance(t, str):
            return model.to_single_token(t)
        t = int(t)
        if not 0 <= t < V:
            raise ValueError(f"target token id {t} is outside the vocabulary [0, {V})")
        return t

    def demeaned(t: int) -> Tensor:
        return W_U[:, t] - W_U.mean(1)

    if target is None:
        order = probs.argsort(descending=True)
        cum = probs[order].cumsum(0)
        n = min(max_n_logits, int((cum < desired_logit_prob).sum()) + 1)
        ids = order[:n].tolist()
        return ([_label(model, i) for i in ids], ids, probs[ids].clone(), torch.stack([demeaned(i) for i in ids]))
    items = target if isinstance(target, list) else [target]
    labels, ids, weights, vecs = [], [], [], []
    for item in items:
        if isinstance(item, (int, str)) and not isinstance(item, bool):
            t = token(item)
            labels.append(_label(model, t)), ids.append(t), weights.append(float(probs[t])), vecs.append(demeaned(t))
        elif isinstance(item, tuple) and len(item) == 2:
            a, b = token(item[0]), token(item[1])
            labels.append(f"{_label(model, a)} - {_label(model, b)}"), ids.append(-1), weights.append(1.0)
            vecs.append(W_U[:, a] - W_U[:, b])
        elif isinstance(item, Tensor) and item.ndim == 1 and item.shape[0] in (V, model.cfg.d_model):
            vec = W_U @ item.to(W_U) if item.shape[0] == V else item.to(W_U)
            labels.append("direction"), ids.append(-1), weights.append(1.0), vecs.append(vec)
        else:
            raise ValueError("a target is a token (id or string), a pair (a, b) for logit(a) - logit(b), a [d_vocab] "
                             f"or [d_model] tensor, or a list of these; got {item!r}")
    return labels, ids, torch.tensor(weights), torch.stack(vecs)


def _label(model, t: int) -> str:
    try:
        return model.to_string([t])
    except Exception:  # no tokenizer: the id is the label
        return str(t)


# ---- one prompt -------------------------------------------------------------------------------------
class _Sources:
    """The active features, errors and tokens of one prompt, in circuit-tracer's node order."""

    def __init__(self, rs, cap: Capture):
        feats = []
        for layer, acts in enumerate(cap.acts):
            pos, f = acts.nonzero(as_tuple=True)  # row-major: sorted by position, then feature id
            feats.append(torch.stack([torch.full_like(pos, layer), pos, f], 1))
        # [n, 3] (layer, pos, feature); an attention-only model has none
        self.features = torch.cat(feats) if feats else torch.zeros(0, 3, dtype=torch.long, device=cap.tokens.device)
        values = [cap.acts[l][ft[:, 1], ft[:, 2]] for l, ft in enumerate(feats)]
        self.values = torch.cat(values).detach() if values else cap.embed.new_zeros(0)
        self.n_feat, self.n_pos, self.n_layers = len(self.features), len(cap.tokens), rs.n_layers
        self.error_start = self.n_feat
        self.token_start = self.n_feat + self.n_layers * self.n_pos
        self.n = self.token_start + self.n_pos
        by_layer = self.features[:, 0]
        self.layer_slices = [(by_layer == l).nonzero().squeeze(-1) for l in range(self.n_layers)]
        # each layer's features as slots of a [pos, k_max] grid (k_max: the most active at one position),
        # so a row's feature edges are one batched product per position instead of one per feature
        self.k_max, self.slots = [], []
        for ft in feats:
            counts = torch.bincount(ft[:, 1], minlength=self.n_pos)
            k = int(counts.max()) if len(ft) else 0
            first = counts.cumsum(0) - counts
            self.k_max.append(k)
            self.slots.append(ft[:, 1] * k + torch.arange(len(ft), device=ft.device) - first[ft[:, 1]])


class _Engine:
    """One forward of ``batch`` copies kept for many backward passes, one target per copy."""

    def __init__(self, model, rs, cap: Capture, src: _Sources, batch: int, chunk: int):
        self.model, self.rs, self.cap, self.src, self.batch, self.chunk = model, rs, cap, src, batch, chunk
        self.embed = cap.embed[None].expand(batch, -1, -1).clone().requires_grad_(True)
        self.writes: dict[int, Tensor] = {}
        with torch.no_grad():
            skip_clean = [rs.skip_out(l, cap.x_in[l]) for l in range(rs.n_layers)]

        def write(layer: int, x: Tensor) -> Tensor:
            base = cap.mlp_out[layer] - (skip_clean[layer] if skip_clean[layer] is not None else 0)
            leaf = base[None].expand(batch, -1, -1).clone().requires_grad_(True)
            self.writes[layer] = leaf
            skip = rs.skip_out(layer, x)
            return leaf if skip is None else leaf + skip

        self.run = FrozenRun(model, rs, cap, write, self.embed)
        extra, handles = self._pattern_hooks(model, cap, batch)
        try:
            with torch.enable_grad():
                self.logits = self.run(batch, extra)
        finally:
            for h in handles:
                h.remove()
        self.final_w = final_read(model)[1]
        self.decoders, self.grids = {}, {}
        P = src.n_pos
        # the grids hold pos x k_max x d_out floats per (source, target) layer pair: within GRID_BUDGET
        size = sum(P * src.k_max[s] * rs.d_out * 4 for s in range(rs.n_layers) for _ in targets_of(rs, s))
        with torch.no_grad():
            for s in range(rs.n_layers):
                idx, k = src.layer_slices[s], src.k_max[s]
                # the grid pays off unless one crowded position makes most of it padding, or features are dense
                grid = len(idx) and P * k <= 2 * len(idx) + P and 4 * k <= rs.d_sae and size <= GRID_BUDGET
                for t in targets_of(rs, s):
                    W = rs.decoder(s, t).detach()
                    if not grid:
                        self.decoders[(s, t)] = W
                        continue
                    # [pos, d_out, k_max]: each active feature's decoder row times its activation, in its slot
                    g = W.new_zeros(P * k, W.shape[1])
                    g[src.slots[s]] = W[src.features[idx, 2]] * src.values[idx, None].to(W.dtype)
                    self.grids[(s, t)] = g.view(P, k, -1).transpose(1, 2).contiguous()
        # one row buffer, written in full by every read (no per-batch allocation of [batch, n_sources])
        self.out = torch.empty(batch, src.n, dtype=self.embed.dtype, device=self.embed.device)

    @staticmethod
    def _pattern_hooks(model, cap: Capture, batch: int) -> tuple[list, list]:
        """With the patterns captured, each such layer's attention output is recomputed as
        ``pattern @ values`` from its input (at ``hook_z``): the backward then runs one product per
        head, not the fused kernel's backward (which also forms the frozen queries' and keys'
        gradients) nor the fused projection's (whose query and key parts get zero gradients)."""
        import torch.nn.functional as F

        inputs: dict[int, Tensor] = {}
        hooks, handles = [], []
        for layer, pattern in cap.patterns.items():
            attn = model.blocks[layer].attn

            def keep_input(module, args, layer=layer):
                inputs[layer] = args[0]

            def z_from_pattern(z: Tensor, hook, layer=layer, attn=attn, pattern=pattern) -> Tensor:
                e = attn.cfg.d_head
                v = F.linear(inputs.pop(layer), attn._W_V.transpose(1, 2).flatten(0, 1), attn._b_V.flatten())
                v = v.unflatten(-1, (-1, e))
                if attn.group > 1:  # grouped keys/values: each serves `group` query heads
                    v = v.repeat_interleave(attn.group, dim=2)  # [b, pos, head, e]
                b, P, h, _ = v.shape
                out = torch.bmm(pattern.to(v.dtype), v.permute(2, 1, 0, 3).reshape(h, P, b * e))  # [head, pos, b * e]
                return out.view(h, P, b, e).permute(2, 1, 0, 3).to(z.dtype)

            handles.append(attn.register_forward_pre_hook(keep_input))
            hooks.append((f"blocks.{layer}.attn.hook_z", z_from_pattern))
        return hooks, handles

    def rows(self, layers: Tensor, positions: Tensor, vectors: Tensor, retain: bool = True) -> Tensor:
        """[n, n_sources] direct effects on n <= batch targets: (layer or n_layers = logit, pos, vector).

        The result is a view of a buffer the next call overwrites."""
        n = len(layers)
        grads: dict[int, Tensor] = {}
        for layer in layers.unique().tolist():
            at = (layers == layer).nonzero().squeeze(-1)
            where = self.run.final if layer == self.rs.n_layers else self.run.x[layer]
            g = torch.zeros_like(where)
            g[at, positions[at]] = vectors[at].reshape(-1, *g.shape[2:]).to(g.dtype)
            grads[layer] = g
        tensors = [self.run.final if layer == self.rs.n_layers else self.run.x[layer] for layer in grads]
        leaves = [self.embed, *self.writes.values()]
        # autograd.grad, not backward: only the sources' gradients are computed (no weight gradients),
        # and nothing accumulates into the model's or the transcoders' .grad
        got = torch.autograd.grad(tensors, leaves, list(grads.values()), retain_graph=retain, allow_unused=True)
        return self._read(n, got[0], dict(zip(self.writes, got[1:])))

    @torch.no_grad()
    def _read(self, n: int, g_embed: Optional[Tensor], g_writes: dict[int, Optional[Tensor]]) -> Tensor:
        src, cap, P = self.src, self.cap, self.src.n_pos
        out = self.out[:n]
        zero = torch.zeros_like(self.embed[:n])
        gw = {t: (g[:n] if g is not None else zero) for t, g in g_writes.items()}
        gp = {}  # [pos, n, d_out]: the gradient at each MLP output, position-major for the batched products
        for s in range(src.n_layers):
            idx = src.layer_slices[s]
            if not len(idx):
                continue
            if (s, targets_of(self.rs, s)[0]) in self.grids:
                # a feature's edge: its activation times (gradient at the MLP outputs it writes) . (its decoder rows)
                proj = 0
                for t in targets_of(self.rs, s):
                    if t not in gp:
                        gp[t] = gw[t].transpose(0, 1).contiguous()
                    proj = proj + torch.bmm(gp[t], self.grids[(s, t)])  # [pos, n, k_max]
                out[:, idx] = proj.transpose(0, 1).reshape(n, -1)[:, src.slots[s]]
                continue
            # dense or unevenly spread features: project on every decoder row, a chunk of positions at a time
            pos, f = src.features[idx, 1], src.features[idx, 2]
            step = max(1, self.chunk * 64 // max(1, n * self.rs.d_sae))
            for lo in range(0, P, step):
                a, b = torch.searchsorted(pos, torch.tensor([lo, lo + step], device=pos.device))
                if a == b:
                    continue
                proj = 0
                for t in targets_of(self.rs, s):
                    proj = proj + gw[t][:, lo:lo + step] @ self.decoders[(s, t)].T  # [n, chunk, d_sae]
                out[:, idx[a:b]] = proj[:, pos[a:b] - lo, f[a:b]] * src.values[idx[a:b]]
        for t in range(src.n_layers):
            lo = src.error_start + t * P
            out[:, lo:lo + P] = torch.einsum("npd,pd->np", gw[t], cap.errors[t])
            out[:, lo:lo + min(cap.held, P)] = 0  # a held position's error is a constant, not a node
        ge = g_embed[:n] if g_embed is not None else zero
        out[:, src.token_start:] = torch.einsum("npd,pd->np", ge, cap.token_part)
        return out


def _sparsify(rows: Tensor, edge_mass: float, cap: Optional[int]) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's largest entries up to ``edge_mass`` of its absolute sum (at most ``cap``):
    ``(row in the block, column, value)`` of the kept entries, row by row."""
    if edge_mass >= 1 and cap is None:
        r, c = rows.nonzero(as_tuple=True)
        return r, c, rows[r, c]
    out_r, out_c = [], []
    for i, row in enumerate(rows):
        nz = row.nonzero().squeeze(-1)
        if edge_mass >= 1 and (cap is None or len(nz) <= cap):
            out_c.append(nz)
        else:
            mag = row[nz].abs()
            k = len(nz) if cap is None else min(cap, len(nz))
            top, order = mag.topk(k)
            total = mag.sum().clamp_min(1e-30)
            keep = int(torch.searchsorted(top.cumsum(0) / total, torch.tensor(edge_mass, dtype=top.dtype))) + 1
            out_c.append(nz[order[:min(keep, k)]])
        out_r.append(torch.full_like(out_c[-1], i))
    r, c = torch.cat(out_r), torch.cat(out_c)
    return r, c, rows[r, c]


class _EdgeStore:
    """The kept edges ``(target, source, weight)`` as int32, int32, fp32, filled in place.

    In memory: one buffer of ``capacity`` edges (every row's every source, an upper bound), which
    costs nothing until written (the pages of a large allocation are mapped as they are first
    touched), so the graph's edges end as views of it: no final concatenation doubling the peak,
    and none of the many small, differently sized row tensors that fragment the heap (glibc then
    kept several times their size resident). Where that bound is too large to reserve, chunks of
    ``chunk_edges``. With a ``spill`` each full chunk is written to its ``raw-edges-<run>-{i:05d}.safetensors``
    and dropped, so at most one chunk of edges is in memory."""

    def __init__(self, chunk_edges: int = 1 << 20, spill: Optional[Spill] = None, capacity: Optional[int] = None):
        self.chunk_edges, self.spill, self.capacity = chunk_edges, spill, capacity
        self.single = spill is None and capacity is not None and 12 * capacity <= _reserve_limit()
        self.chunks: list = []  # (t, s, w) tensors, or a Path to a spilled chunk
        self.n = 0
        self._new(capacity if self.single else chunk_edges)

    def _new(self, size: int) -> None:
        self.size = size
        self.buf = (torch.empty(size, dtype=torch.int32), torch.empty(size, dtype=torch.int32), torch.empty(size))
        self.fill = 0

    def add(self, t: Tensor, s: Tensor, w: Tensor) -> None:
        if self.capacity is not None and self.n + len(w) > self.capacity:  # spilled or paged too: never unbounded
            raise RuntimeError(f"the graph's edges would pass their ceiling of {self.capacity} (rows x sources: every "
                               "row's every source); this is a bug in the edge accumulation, please report it")
        at = 0
        while at < len(w):
            take = min(len(w) - at, self.size - self.fill)
            for buf, x in zip(self.buf, (t, s, w)):
                buf[self.fill:self.fill + take] = x[at:at + take]
            self.fill, at, self.n = self.fill + take, at + take, self.n + take
            if self.fill == self.size and at < len(w):
                if self.single:
                    raise RuntimeError("more edges than the store's capacity")
                self._finish()

    def _finish(self) -> None:
        part = tuple(b[:self.fill] for b in self.buf)
        if self.spill is not None:
            from safetensors.torch import save_file

            path = self.spill.path("raw", len(self.chunks))
            save_file(dict(zip(("target", "source", "weight"), (p.contiguous() for p in part))), str(path))
            self.chunks.append(path)
        else:
            self.chunks.append(part)
        self._new(self.chunk_edges)

    def __iter__(self):
        """Each chunk's ``(target, source, weight)`` (the last one partly filled), read back if spilled."""
        for chunk in self.chunks:
            yield _load_chunk(chunk) if isinstance(chunk, Path) else chunk
        if self.fill:
            yield tuple(b[:self.fill] for b in self.buf)

    def drain(self):
        """The chunks as ``__iter__`` gives them, each dropped from the store once given."""
        while self.chunks:
            chunk = self.chunks.pop(0)
            if isinstance(chunk, Path):
                loaded = _load_chunk(chunk)
                chunk.unlink()  # a file this store wrote
                chunk = loaded
            yield chunk
        if self.fill:
            last, self.fill = tuple(b[:self.fill] for b in self.buf), 0
            self.buf = None
            yield last

    def all(self) -> tuple[Tensor, Tensor, Tensor]:
        parts = list(self)
        if not parts:
            return torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), torch.zeros(0)
        return tuple(torch.cat([p[i] for p in parts]) if len(parts) > 1 else parts[0][i] for i in range(3))

    def renumbered(self, old_to_new: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The single buffer's edges with node ids mapped by ``old_to_new`` (-1: dropped), compacted
        in place (writes never pass the block being read), as views of the buffer."""
        t, s, w = self.buf
        if bool((old_to_new == torch.arange(len(old_to_new))).all()):
            return t[:self.fill], s[:self.fill], w[:self.fill]
        out = 0
        for lo in range(0, self.fill, self.chunk_edges):
            hi = min(lo + self.chunk_edges, self.fill)
            nt, ns = old_to_new[t[lo:hi].long()], old_to_new[s[lo:hi].long()]
            keep = (nt >= 0) & (ns >= 0)
            k = int(keep.sum())
            kept_w = w[lo:hi][keep]
            t[out:out + k], s[out:out + k], w[out:out + k] = nt[keep], ns[keep], kept_w
            out += k
        return t[:out], s[:out], w[:out]


def _capacity(rs, cap: Capture, target, max_n_logits: int, max_feature_nodes: Optional[int]) -> int:
    """At most how many edges a graph can have: rows (logits and features) x sources."""
    n_feat = sum(int((a != 0).sum()) for a in cap.acts)
    n_pos = len(cap.tokens)
    n_logits = max_n_logits if target is None else len(target) if isinstance(target, list) else 1
    rows = n_logits + (n_feat if max_feature_nodes is None else min(int(max_feature_nodes), n_feat))
    return rows * (n_feat + (rs.n_layers + 1) * n_pos)


def _reserve_limit() -> int:
    """Bytes of address space one graph's edge buffer may reserve: 8 GB, at most a quarter of the
    physical memory (the kernel refuses one allocation far beyond it, touched or not)."""
    import os

    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 4 << 30
    return min(8 << 30, physical // 4)


def _load_chunk(path: Path) -> tuple[Tensor, Tensor, Tensor]:
    from safetensors.torch import load_file

    d = load_file(str(path))
    return d["target"], d["source"], d["weight"]


def _attribute(model, rs, cap: Capture, target, max_n_logits, desired_logit_prob, max_feature_nodes, batch_size,
               edge_mass, max_edges_per_node, update_interval, chunk, verbose, store: "_EdgeStore") -> Graph:
    t0 = time.time()
    src = _Sources(rs, cap)
    labels, ids, weights, vecs = logit_targets(model, cap, target, max_n_logits, desired_logit_prob)
    n_logits = len(labels)
    logit_start = src.n
    n_total = src.n + n_logits
    budget = src.n_feat if max_feature_nodes is None else min(int(max_feature_nodes), src.n_feat)
    if batch_size is None:  # as many copies as keep the kept forward near 2^16 token copies, at most 64
        batch_size = max(1, min(64, (1 << 16) // max(1, src.n_pos)))
    # no more copies of the prompt than there are targets to put in one backward pass
    engine = _Engine(model, rs, cap, src, min(batch_size, max(n_logits, budget, 1)), chunk)
    batch_size = engine.batch
    final_vecs = vecs * engine.final_w  # the logit direction at the final norm's normalised input
    final_values = (cap.final.float() * engine.final_w) @ vecs.T  # without the norm's bias: a constant
    if getattr(model.ln_final, "b", None) is not None:
        final_values = final_values + (model.ln_final.b.detach() @ vecs.T)

    def add(node_ids: Tensor, rows: Tensor) -> None:
        r, c, w = _sparsify(rows, edge_mass, max_edges_per_node)
        store.add(node_ids[r.to(node_ids.device)], c, w)

    last = len(cap.tokens) - 1
    for lo in range(0, n_logits, batch_size):
        hi = min(lo + batch_size, n_logits)
        layers = torch.full((hi - lo,), rs.n_layers)
        add(torch.arange(logit_start + lo, logit_start + hi),
            engine.rows(layers, torch.full((hi - lo,), last), final_vecs[lo:hi]))
    visited = torch.zeros(src.n_feat, dtype=torch.bool)
    logit_weights = torch.zeros(n_total)
    logit_weights[logit_start:] = weights
    encoders = [rs.encoder(l)[0].detach() for l in range(rs.n_layers)]
    n_visited = 0
    while n_visited < budget:
        if budget == src.n_feat:
            pending = torch.arange(src.n_feat)
        else:
            if store.spill is None:
                influence = compute_influence_sparse(_long(store.all()), n_total, logit_weights)
            else:  # chunk by chunk from the files: all the spilled edges at once would undo the spill
                influence = _influence(lambda: map(_long, store), n_total, logit_weights)
            rank = influence[:src.n_feat].argsort(descending=True)
            pending = rank[~visited[rank]][:min(update_interval * batch_size, budget - n_visited)]
        for lo in range(0, len(pending), batch_size):
            idx = pending[lo:lo + batch_size]
            layers, positions, f = src.features[idx].unbind(1)
            enc = torch.empty(len(idx), rs.d_in, dtype=encoders[0].dtype, device=encoders[0].device)
            for layer in layers.unique().tolist():
                at = (layers == layer).nonzero().squeeze(-1)
                enc[at] = encoders[layer][:, f[at]].T
            n_visited += len(idx)
            add(idx, engine.rows(layers, positions, enc, retain=n_visited < budget))
            visited[idx] = True
        if verbose:
            print(f"  {n_visited}/{budget} feature rows, {time.time() - t0:.1f}s", flush=True)
    del engine
    return _package(model, rs, cap, src, visited, labels, ids, weights, vecs, final_values[-1], store,
                    dict(max_feature_nodes=max_feature_nodes, edge_mass=edge_mass, batch_size=batch_size,
                         stored_patterns=bool(cap.patterns),
                         token_embedding="token+position" if cap.token_vectors is None else "token",
                         held_positions=cap.held,
                         max_edges_per_node=max_edges_per_node, seconds=time.time() - t0))


def _long(edges: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    return edges[0].long(), edges[1].long(), edges[2].float()


def _package(model, rs, cap, src: _Sources, visited, labels, ids, weights, vecs, values, store: _EdgeStore,
             settings) -> Graph:
    """Keep the expanded features, every error and token node and the logits; renumber the edges."""
    selected = visited.nonzero().squeeze(-1)
    n_sel = len(selected)
    old_to_new = torch.full((src.n + len(labels),), -1, dtype=torch.long)
    old_to_new[selected] = torch.arange(n_sel)
    rest = torch.arange(src.n_feat, src.n + len(labels))
    old_to_new[rest] = torch.arange(n_sel, n_sel + len(rest))
    # renumbered chunk by chunk, so the peak holds the final edges and one chunk's temporaries
    files = []
    if store.single:
        targets, sources, w = store.renumbered(old_to_new)
    else:
        parts = [(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), torch.zeros(0))]
        for t, s, w in store.drain():
            t, s = old_to_new[t.long()], old_to_new[s.long()]
            keep = (t >= 0) & (s >= 0)
            t, s, w = t[keep].int(), s[keep].int(), w[keep].float().contiguous()
            if store.spill is None:
                parts.append((t, s, w))
                continue
            from safetensors.torch import save_file

            files.append(store.spill.path("graph", len(files)))
            save_file({"target": t, "source": s, "weight": w}, str(files[-1]))
        targets, sources, w = (torch.cat([p[i] for p in parts]) for i in range(3))
        del parts
        if files:
            targets = sources = w = None
    L, P = src.n_layers, src.n_pos  # L: MLP layers (0 in an attention-only model)
    err_layer = torch.arange(L).repeat_interleave(P)
    err_pos = torch.arange(P).repeat(L)
    # the graph's node fields live on the CPU, whatever the model's device (the edges already do)
    feats = src.features[selected.to(src.features.device)].cpu()
    kind = torch.cat([torch.full((n_sel,), FEATURE), torch.full((L * P,), ERROR), torch.full((P,), TOKEN),
                      torch.full((len(labels),), LOGIT)])
    layer = torch.cat([feats[:, 0], err_layer, torch.full((P,), -1), torch.full((len(labels),), model.cfg.n_layers)])
    pos = torch.cat([feats[:, 1], err_pos, torch.arange(P), torch.full((len(labels),), P - 1)])
    feature = torch.cat([feats[:, 2], torch.full((L * P,), -1), cap.tokens.cpu(), torch.tensor(ids, dtype=torch.long)])
    err_norm = torch.stack([e.norm(dim=-1) for e in cap.errors]).cpu() if cap.errors else torch.zeros(0, P)
    err_norm[:, :cap.held] = 0  # held positions' errors are constants, not nodes
    err_norm = err_norm.flatten()
    activation = torch.cat([src.values[selected.to(src.values.device)].float().cpu(), err_norm.float(), torch.zeros(P),
                            values.detach().float().reshape(-1).cpu()])
    logit_weight = torch.zeros(len(kind))
    logit_weight[-len(labels):] = weights.float().cpu()
    graph = Graph(kind=kind, layer=layer, pos=pos, feature=feature, activation=activation.cpu(),
                  logit_weight=logit_weight, logit_labels=list(labels),
                  edge_target=targets, edge_source=sources, edge_weight=None if w is None else w.float().cpu(),
                  edge_files=tuple(files),
                  tokens=cap.tokens.cpu(), str_tokens=_str_tokens(model, cap.tokens), n_layers=model.cfg.n_layers,
                  logit_vectors=vecs.detach().cpu().float(),
                  meta=dict(model=getattr(model.cfg, "name", ""), d_vocab=model.cfg.d_vocab, n_active_features=src.n_feat,
                            replacement=("none (attention only)" if isinstance(rs, AttentionOnly) else
                                         "clt" if rs.cross_layer else "transcoders"), **settings))
    graph._attach(model, rs, cap)
    return graph


def _str_tokens(model, tokens: Tensor) -> list[str]:
    try:
        return list(model.to_str_tokens(tokens.reshape(1, -1))) if model.tokenizer is not None else [str(int(t)) for t in tokens]
    except Exception:  # no tokenizer
        return [str(int(t)) for t in tokens]
