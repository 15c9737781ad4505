"""Edge interventions: a receiver reads one sender's corrupted output while everything else stays clean.

Two engines, one meaning (tests check they agree, and agree with a hand-written
``run_with_hooks`` patch):

* ``edge_patching`` patches one edge at a time, exactly, through the resume machinery
  (``workbench.analysis.resume``, ``Block.resume``). Only the receiver changes, so only it is
  recomputed: a head receiver recomputes its edited projection (q, k or v) and its ``z``,
  adds the change of ``z W_O`` to the cached attention output and resumes its block from
  ``attn_out``; an MLP receiver recomputes that MLP and resumes
  from ``mlp_out``; the logits receiver is the final norm and unembedding of the edited
  stream. Everything below the receiver comes from the clean run's cache.
* ``EdgeRunner.run`` runs a forward pass node by node in which every receiver's input is
  its own sum, ``sum_s keep[s, r] * out_s + (1 - keep[s, r]) * corrupted_s``: any set of edges
  at once (circuits, ACDC, path patching), starting at the first stage that changes and
  computing only the nodes some kept edge reads (``run_stacked`` is the older, differentiable
  path, which computes every node and restacks the senders' changes at each stage). With
  every edge kept it is the clean run; with none, the corrupted run. Its receiver inputs can
  carry gradients, which is what edge attribution patching needs.

A prompt set ``ds`` is ``(clean_tokens, corrupted_tokens)`` of one shape, or anything with
``clean`` (or ``tokens``) and ``corrupted`` attributes. A metric maps logits to one number
(a 0-d tensor) for the whole batch.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch
from einops import einsum
from jaxtyping import Float
from torch import Tensor

from workbench.analysis.circuits.graph import ComputationGraph, EdgeSpec
from workbench.analysis.common import Progress, ProgressLike, as_tokens
from workbench.analysis.resume import needed_hooks, run_from_site
from workbench.utils import weights_signature, weights_stamp

MetricLike = Union[str, Callable[[Tensor], Tensor], None]


# ---- inputs: the prompt pair and the metric ---------------------------------------------------
def prompt_pair(model, ds) -> tuple[Tensor, Tensor]:
    """(clean, corrupted) token ids [batch, pos] on the model's device, checked to have one shape."""
    if isinstance(ds, (tuple, list)) and len(ds) == 2:
        clean, corrupted = ds
    elif hasattr(ds, "corrupted") and (hasattr(ds, "clean") or hasattr(ds, "tokens")):
        clean, corrupted = getattr(ds, "clean", None), ds.corrupted
        clean = ds.tokens if clean is None else clean
    else:
        raise ValueError(f"ds must be (clean_tokens, corrupted_tokens) or have .clean/.tokens and .corrupted; "
                         f"got {type(ds).__name__}")
    clean, corrupted = as_tokens(model, clean), as_tokens(model, corrupted)
    if clean.shape != corrupted.shape:
        raise ValueError(f"clean {tuple(clean.shape)} and corrupted {tuple(corrupted.shape)} tokens must have one "
                         "shape (prompt sets of one length; pad or trim them first)")
    return clean, corrupted


def metric_value(metric: Callable[[Tensor], Tensor], logits: Tensor) -> Tensor:
    """``metric(logits)`` as a 0-d tensor, or ValueError naming what it returned instead."""
    value = metric(logits)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = torch.tensor(float(value))
    if not isinstance(value, Tensor):
        raise ValueError(f"metric must return a tensor (one number for the batch), got {type(value).__name__}")
    if value.numel() != 1:
        raise ValueError(f"metric must return one number for the batch (a 0-d tensor), got shape "
                         f"{tuple(value.shape)}: average it over the batch (e.g. end with .mean())")
    return value.reshape(())


def kl_metric(clean_logits: Float[Tensor, "batch pos d_vocab"]) -> Callable[[Tensor], Tensor]:
    """Mean over batch and positions of KL(clean || patched) of the next-token distributions."""
    clean_logp = clean_logits.detach().float().log_softmax(-1)

    def metric(logits: Tensor) -> Tensor:
        logp = logits.float().log_softmax(-1)
        return (clean_logp.exp() * (clean_logp - logp)).sum(-1).mean()

    return metric


# ---- one head from separate q, k and v inputs ------------------------------------------------
def project(block, x: Float[Tensor, "batch pos head_index d_model"], kind: str,
            heads: Sequence[int]) -> Float[Tensor, "batch pos head_index d_head"]:
    """The ``kind`` (q, k or v) projection of ``heads`` of ``block``, each head reading its own
    pre-norm stream (normed on its own, as the block's ``ln1`` does), QK-normed as the attention
    does (before the rotation). A projection-wide QK-norm (OLMo 2) normalises every head's
    projection of the stream together: here, of the stream the head reads."""
    attn, heads = block.attn, list(heads)
    weight, bias = {"q": (attn.W_Q, attn.b_Q), "k": (attn._W_K, attn._b_K), "v": (attn._W_V, attn._b_V)}[kind]
    group = 1 if kind == "q" else attn.group  # k and v: each head reads its KV head's weights
    normed = block.ln1(x.flatten(1, 2)).view_as(x)
    if kind != "v" and attn.cfg.qk_norm == "projection":
        own, own_bias = (attn.W_Q, attn.b_Q) if kind == "q" else (attn._W_K, attn._b_K)  # the projection's own heads
        every = einsum(normed, own, "b p s d, g d e -> b p s g e") + own_bias
        every = (attn.q_norm if kind == "q" else attn.k_norm)(every.flatten(-2)).unflatten(-1, every.shape[-2:])
        index = torch.tensor(heads) // group
        return every[:, :, torch.arange(len(heads)), index]
    if heads == list(range(attn.cfg.n_heads)):  # every head: the weights as they are, not gathered per head
        grouped = normed.unflatten(2, (weight.shape[0], group))
        projected = (einsum(grouped, weight, "b p k g d, k d e -> b p k g e") + bias[:, None]).flatten(2, 3)
    else:
        index = torch.tensor(heads, device=weight.device) // group
        projected = einsum(normed, weight[index], "b p h d, h d e -> b p h e") + bias[index]
    if kind == "v" or attn.cfg.qk_norm == "none":
        return projected
    return (attn.q_norm if kind == "q" else attn.k_norm)(projected)  # per-head QK-norm


def attend(block, q: Float[Tensor, "batch pos head_index d_head"], k: Float[Tensor, "batch pos head_index d_head"],
           v: Float[Tensor, "batch pos head_index d_head"], heads: Sequence[int]
           ) -> Float[Tensor, "batch pos head_index d_head"]:
    """``z`` of ``heads`` from their (unrotated) queries, keys and values, as the block's attention
    computes it: its rotation, score scale (Gemma's query_pre_attn_scalar), soft-cap, score bias
    (ALiBi), causal mask narrowed to its sliding window, and a float32 softmax."""
    attn, heads = block.attn, list(heads)
    if attn.position.rotates:
        q, k = attn.position.rotate(q, 0), attn.position.rotate(k, 0)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [batch, head, pos, d_head]
    n = q.shape[2]
    bias = attn.position.score_bias(n, n, 0)
    scores = attn.scores(q, k, None if bias is None else bias[heads])
    visible = attn._windowed(None, None, n, n, 0, q.device) if attn.window is not None else None
    if visible is None:
        visible = attn._causal_mask(n, n, 0, q.device)
    pattern = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1, dtype=torch.float32)
    return (pattern.to(v.dtype) @ v).transpose(1, 2)


def head_z(
    block,
    x_q: Float[Tensor, "batch pos head_index d_model"],
    x_k: Float[Tensor, "batch pos head_index d_model"],
    x_v: Float[Tensor, "batch pos head_index d_model"],
    heads: Sequence[int],
) -> Float[Tensor, "batch pos head_index d_head"]:
    """``z`` of ``heads`` of ``block``, each reading its own (pre-norm) query, key and value streams.

    The block's own norm, weights, rotation and score bias, and the same causal SDPA the
    attention runs, so with one stream for all three it is the block's ``hook_z`` (tests check).
    """
    return attend(block, project(block, x_q, "q", heads), project(block, x_k, "k", heads),
                  project(block, x_v, "v", heads), heads)


# ---- node outputs and the node-by-node forward -----------------------------------------------
def _cache_names(model) -> set[str]:
    last = model.cfg.n_layers - 1
    return needed_hooks(model) | {"hook_embed", "hook_pos_embed", f"blocks.{last}.hook_resid_post"}


def _outputs(model, graph: ComputationGraph, cache) -> Tensor:
    """Every sender's output [senders, batch, pos, d_model] from a run's cache (head outputs without b_O),
    written into one tensor layer by layer (stacking a list would hold every output twice)."""
    embed = cache["hook_embed"] + (cache["hook_pos_embed"] if "hook_pos_embed" in cache.cache_dict else 0)
    out = embed.new_empty(len(graph.senders), *embed.shape)
    out[0], i = embed, 1
    for layer in range(graph.n_layers):
        W_O = model.blocks[layer].attn.W_O
        heads = einsum(cache[f"blocks.{layer}.attn.hook_z"], W_O, "b p h e, h e d -> h b p d")
        out[i:i + len(heads)], i = heads, i + len(heads)
        if graph.has_mlp:
            out[i], i = cache[f"blocks.{layer}.hook_mlp_out"], i + 1
    return out


class EdgeRunner:
    """The clean and corrupted runs of one prompt pair, and forward passes with edges corrupted.

    ``keep`` masks are [senders, receivers] (``ComputationGraph.full_mask``, ``mask_of``): 1
    where the receiver reads the sender's value in this run, 0 where it reads the sender's
    corrupted value. Built once per prompt pair; every method reuses its caches.

    Those caches are of the weights the runner was built with, so each run first compares a cheap
    stamp of the model's tensors (``workbench.utils.weights_stamp``: a ``load_state_dict``, a cast, a
    move, a replaced or in-place-edited parameter) and ``acdc``, ``edge_effects`` and
    ``logit_diff_direct_effects`` also the values' signature (``weights_signature``, one pass over the
    weights: an in-place ``.data`` edit too), and refuse with a ``ValueError`` when they differ.
    ``check_weights(full=True)`` makes the full check on demand.
    """

    def __init__(self, model, ds, graph: Optional[ComputationGraph] = None):
        self.model = model
        self.graph = ComputationGraph(model) if graph is None else graph
        self.clean, self.corrupted = prompt_pair(model, ds)
        names = _cache_names(model)
        with torch.no_grad():
            self.clean_logits, self.clean_cache = model.run_with_cache(self.clean, names_filter=lambda n: n in names)
            self.corrupted_logits, cache = model.run_with_cache(self.corrupted, names_filter=lambda n: n in names)
            self.clean_out = _outputs(model, self.graph, self.clean_cache)
            self.corrupted_out = _outputs(model, self.graph, cache)
            del cache
        # what check_weights compares: taken after the runs (a buffer filled lazily is not an edit)
        self._stamp, self._signature = weights_stamp(model), weights_signature(model)
        self.delta = self.corrupted_out - self.clean_out  # what each edge's patch adds to its receiver's input
        g = self.graph
        # The stages in forward order, each with the receivers it reads for and the senders it writes.
        self.stages = sorted(set(g.receiver_stage.tolist()))
        self._receivers_at = {t: np.nonzero(g.receiver_stage == t)[0] for t in self.stages}
        self._senders_at = {t: np.nonzero(g.sender_stage == t)[0] for t in self.stages}
        self._n_before = {t: int((g.sender_stage < t).sum()) for t in self.stages}
        self._layer_at = {t: (t - 1) // 2 for t in self.stages}
        sender_of = {node: i for i, node in enumerate(g.senders)}
        self._sender_of_receiver = np.array([sender_of.get(g.node_of_receiver(r), -1) for r in range(len(g.receivers))])
        self._prefix: Optional[Tensor] = None  # [senders + 1, batch, pos, d_model], built on first use
        self._adjacency = g.adjacency.to(self.clean_out.device, self.clean_out.dtype)

    @property
    def _clean_prefix(self) -> Tensor:
        """The clean stream before each sender, [senders + 1, batch, pos, d_model]: one more copy of
        every sender's output, built when a run first resumes mid-model (EAP never does)."""
        if self._prefix is None:
            self._prefix = torch.cat([torch.zeros_like(self.clean_out[:1]), self.clean_out.cumsum(0)])
        return self._prefix

    def check_weights(self, full: bool = False) -> None:
        """A ValueError when the model's weights changed since this runner was built: the cheap stamp
        (microseconds), and with ``full`` the values too (one pass; sees in-place ``.data`` edits)."""
        if weights_stamp(self.model) != self._stamp or (full and weights_signature(self.model) != self._signature):
            raise ValueError("the model's weights changed since this EdgeRunner was built (an edit, a load, a cast or "
                             "a move): its clean and corrupted runs are of the old weights. Build it again from the "
                             "model as it is now, or put the old weights back")

    # ---- metrics of the two ends -----------------------------------------------------------
    def resolve_metric(self, metric: MetricLike) -> Callable[[Tensor], Tensor]:
        """The metric function: a callable as it is, ``"kl"`` or None as ``kl_metric`` of the clean run."""
        if metric is None or (isinstance(metric, str) and metric == "kl"):
            return kl_metric(self.clean_logits)
        if isinstance(metric, str) or not callable(metric):
            raise ValueError(f"metric must be a function of the logits or 'kl', got {metric!r}")
        return metric

    def endpoints(self, metric: Callable[[Tensor], Tensor]) -> tuple[float, float]:
        """(metric of the clean run, metric of the corrupted run)."""
        self.check_weights()
        with torch.no_grad():
            return float(metric_value(metric, self.clean_logits)), float(metric_value(metric, self.corrupted_logits))

    # ---- the node-by-node forward --------------------------------------------------------------
    def _bias_before(self, stage: int) -> Tensor:
        """The attention output biases written before ``stage`` (constant, so no edge carries them)."""
        total = torch.zeros_like(self.clean_out[0, 0, 0])
        for layer in range(self.graph.n_layers):
            if 2 * layer + 1 < stage:
                total = total + self.model.blocks[layer].attn.b_O
        return total

    def first_stage(self, keep: Tensor) -> int:
        """The first stage whose receivers read a corrupted edge (after the last when none does)."""
        drop = (1 - keep.to(self._adjacency)) * self._adjacency
        changed = drop.any(0).nonzero().flatten().cpu().numpy()
        return int(self.graph.receiver_stage[changed].min()) if len(changed) else self.stages[-1] + 1

    def _span(self, keep: Optional[Tensor], from_stage: Optional[int], embed: Optional[Tensor],
              collect: Optional[list]) -> tuple[Tensor, Optional[int], int]:
        """What ``run`` and ``run_stacked`` start from: the mask on the graph's device, the first stage to
        run (None: no stage changes, the clean logits are the answer) and how many senders come before it."""
        self.check_weights()
        g = self.graph
        keep = self._adjacency if keep is None else keep.to(self._adjacency)
        if from_stage is None:
            from_stage = 0 if (embed is not None or collect is not None) else self.first_stage(keep)
        if from_stage > self.stages[-1]:
            return keep, None, 0
        from_stage = max(from_stage, self.stages[0])  # the embedding has no inputs: every run starts after it
        n_before = self._n_before[from_stage] if from_stage in self._n_before else int((g.sender_stage < from_stage).sum())
        return keep, from_stage, n_before

    def run(
        self,
        keep: Optional[Tensor] = None,
        from_stage: Optional[int] = None,
        embed: Optional[Tensor] = None,
        collect: Optional[list] = None,
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """Logits with every edge where ``keep`` is 0 reading the corrupted sender (None: all kept).

        Stages before ``from_stage`` (default: the first one that changes) are taken from the
        clean run. ``embed`` replaces the embedding node's output (integrated gradients
        interpolate it); ``collect``, a list, receives each stage's receiver inputs
        [receivers, batch, pos, d_model] in receiver order.

        Without autograd (``torch.no_grad()``, as ``metric_of`` runs it) each sender's change
        (corrupted minus this run's output) is written once, into one buffer, each stage mixes only
        the rows it needs from there (``_mixed``), and a node none of whose edges is kept is not
        computed (its readers all read its corrupted value). With autograd on, the run is
        ``run_stacked``, which rebuilds each stage's rows afresh (differentiable; on SmolLM2's 30
        layers 1.5-8.6x slower for a faithfulness run, benchmarks/edge_runner.py).
        """
        if torch.is_grad_enabled():
            return self.run_stacked(keep, from_stage, embed, collect)
        g, model = self.graph, self.model
        keep, from_stage, n_before = self._span(keep, from_stage, embed, collect)
        if from_stage is None:
            return self.clean_logits
        # Which rows each stage reads is decided on the host, from one copy of the mask.
        host_adjacency = g.adjacency.to(torch.float32)
        host_keep = keep.to("cpu", torch.float32) * host_adjacency
        # A sender none of whose edges is kept is read by every receiver as its corrupted value, whatever it
        # computes: it is not computed, and its change is 0 (``collect`` wants every input: all are computed).
        read = np.ones(len(g.senders), dtype=bool) if collect is not None else (host_keep != 0).any(1).numpy()
        live = np.ones(len(g.senders), dtype=bool)  # senders whose change may not be 0
        # Senders before from_stage are clean: their change is ``delta``'s, read in place (never copied).
        # Those this run writes go into ``fresh`` once each, as they are computed.
        fresh = self.delta.new_empty(len(g.senders) - n_before, *self.delta.shape[1:])
        if embed is not None:
            if from_stage != self.stages[0]:
                raise ValueError("a replaced embedding needs the run to start at the first stage")
            fresh = torch.cat([(self.corrupted_out[0] - embed)[None], fresh])
            n_before = 0
        resid = (embed if embed is not None else self._clean_prefix[n_before]) + self._bias_before(from_stage)
        total = None  # the sum of every change so far (resid + total: the corrupted stream), built on first use
        n_done = n_before + (1 if embed is not None else 0)  # senders whose change is known
        for stage in [t for t in self.stages if t >= from_stage]:
            receivers, n_up, last = self._receivers_at[stage], self._n_before[stage], stage == self.stages[-1]
            readers = self._sender_of_receiver[receivers]
            cols = np.nonzero((readers < 0) | read[np.maximum(readers, 0)])[0]  # receivers whose node is read
            if len(cols):
                adjacency = host_adjacency[:n_up, receivers[cols]]
                drop = (1 - host_keep[:n_up, receivers[cols]]) * adjacency
                # Each input is resid + sum_s drop[s, r] change_s. Where most edges are dropped (a small
                # circuit), equally (resid + the sum of every change so far: the corrupted stream) less
                # the kept edges' changes: a receiver reads every sender before its stage, so the sums agree.
                kept = (1 - drop) * adjacency
                alive = torch.from_numpy(live[:n_up])
                base, weights, rows = resid, drop, (drop.any(1) & alive).nonzero().flatten()
                kept_rows = (kept.any(1) & alive).nonzero().flatten()
                if len(kept_rows) < len(rows):
                    if total is None:
                        total = self._mixed(torch.ones(n_done, 1), torch.arange(n_done), n_before, fresh)[0]
                    base, weights, rows = resid + total, -kept, kept_rows
                inputs = base.unsqueeze(0).expand(len(cols), *base.shape)
                mixed = self._mixed(weights, rows, n_before, fresh)
                if mixed is not None:
                    inputs = inputs + mixed
                if collect is not None:
                    collect.append(inputs)
                if last:
                    return model.unembed(model.ln_final(inputs[0]))
            # The senders of this stage, in sender order: computed where read, else their corrupted value.
            senders = self._senders_at[stage]
            heads = [g.senders[s][2] for s in senders if g.senders[s][0] == "head" and read[s]]
            mlp = any(g.senders[s][0] == "mlp" and read[s] for s in senders)
            computed, written = iter(self._write_read(stage, inputs if len(cols) else None, heads, mlp)), []
            for s in senders:
                change = fresh[s - n_before]
                if read[s]:
                    written.append(next(computed))
                    torch.sub(self.corrupted_out[s], written[-1], out=change)
                    if total is not None:
                        total += change
                else:
                    written.append(self.corrupted_out[s])
                    change.zero_()
                    live[s] = False
            n_done += len(senders)
            if stage == 2 * self._layer_at[stage] + 1:  # the heads' b_O, then their outputs summed: the block's order
                resid = resid + model.blocks[self._layer_at[stage]].attn.b_O
            resid = resid + sum(written)
        raise AssertionError("the logits stage is always last")

    def _mixed(self, weights: Tensor, rows: Tensor, n_before: int, fresh: Tensor) -> Optional[Tensor]:
        """sum_s weights[s, r] change_s for each column r of ``weights`` [senders so far, receivers] (on the
        host), as [receivers, batch, pos, d_model], reading only ``rows`` (ascending; every other row's
        weight or change is 0; None when there are none). Senders below ``n_before`` change by
        ``delta``; the rest by ``fresh``'s rows. Few rows are gathered; many are multiplied where they
        lie (a copy of nearly every row would cost more than the rows it saves)."""
        if not len(rows):
            return None
        n_up, shape, device = weights.shape[0], self.delta.shape[1:], self.delta.device
        weights = weights.to(device, self.delta.dtype)
        if 2 * len(rows) < n_up:
            below, above = rows[rows < n_before], rows[rows >= n_before] - n_before
            parts = [source.index_select(0, index.to(device)) for source, index in ((self.delta, below), (fresh, above))
                     if len(index)]
            changes = parts[0] if len(parts) == 1 else torch.cat(parts)
            return (weights[rows.to(device)].T @ changes.flatten(1)).view(-1, *shape)
        first = min(n_before, n_up)
        out = weights[:first].T @ self.delta[:first].flatten(1)
        if n_up > first:
            out += weights[first:].T @ fresh[:n_up - first].flatten(1)
        return out.view(-1, *shape)

    def _write_read(self, stage: int, inputs: Optional[Tensor], heads: list[int], mlp: bool) -> list[Tensor]:
        """What ``heads`` (and the MLP, when ``mlp``) of ``stage`` write, in sender order, from their
        receivers' inputs [3 x len(heads) (+ 1), batch, pos, d_model] (q, k, v of each head, the MLP last)."""
        written = []
        if heads:
            written += self._write_group(stage, inputs[:3 * len(heads)], heads)
        if mlp:
            written += self._write_group(stage, inputs[-1:], None)
        return written

    def run_stacked(
        self,
        keep: Optional[Tensor] = None,
        from_stage: Optional[int] = None,
        embed: Optional[Tensor] = None,
        collect: Optional[list] = None,
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """``run``, differentiable: at each stage, the changes of every sender with a dropped edge into
        it are stacked afresh from a list of outputs (autograd follows; the fast path's buffer,
        written in place, would not). It is also the reference the fast path is tested against."""
        model = self.model
        keep, from_stage, n_before = self._span(keep, from_stage, embed, collect)
        if from_stage is None:
            return self.clean_logits
        outs = list(self.clean_out[:n_before])
        if embed is not None:
            if from_stage != self.stages[0]:
                raise ValueError("a replaced embedding needs the run to start at the first stage")
            outs = [embed]
        resid = (embed if embed is not None else self._clean_prefix[n_before]) + self._bias_before(from_stage)
        for stage in [t for t in self.stages if t >= from_stage]:
            receivers, n_up = self._receivers_at[stage], self._n_before[stage]
            drop = (1 - keep[:n_up, receivers]) * self._adjacency[:n_up, receivers]
            inputs = resid.unsqueeze(0).expand(len(receivers), *resid.shape)
            rows = drop.any(1).nonzero().flatten()
            if len(rows):
                diff = torch.stack([self.corrupted_out[s] - outs[s] for s in rows.tolist()])
                inputs = inputs + einsum(drop[rows], diff, "s r, s b p d -> r b p d")
            if collect is not None:
                collect.append(inputs)
            if stage == self.stages[-1]:
                return model.unembed(model.ln_final(inputs[0]))
            written, bias = self._write(stage, inputs)
            outs += written
            if bias is not None:
                resid = resid + bias
            resid = resid + sum(written)
        raise AssertionError("the logits stage is always last")

    def _write(self, stage: int, inputs: Tensor) -> tuple[list[Tensor], Optional[Tensor]]:
        """What the senders of ``stage`` (not the logits) write from their receivers' inputs
        [receivers, batch, pos, d_model], in sender order, and the constant bias the stage adds to
        the stream (the heads' b_O; None for an MLP stage)."""
        g, layer = self.graph, self._layer_at[stage]
        written, bias = [], None
        if stage == 2 * layer + 1:  # this layer's heads (and its MLP when parallel)
            written += self._write_group(stage, inputs[:3 * g.n_heads], list(range(g.n_heads)))
            bias = self.model.blocks[layer].attn.b_O
        if g.receivers[self._receivers_at[stage][-1]][0] == "mlp":  # this layer's MLP reads at this stage
            written += self._write_group(stage, inputs[-1:], None)
        return written, bias

    def metric_of(self, metric: Callable[[Tensor], Tensor], keep: Optional[Tensor] = None,
                  from_stage: Optional[int] = None) -> float:
        with torch.no_grad():
            return float(metric_value(metric, self.run(keep, from_stage)))

    def receiver_scores(self, metric: Callable[[Tensor], Tensor],
                        embed: Optional[Tensor] = None) -> Float[Tensor, "sender receiver"]:
        """EAP's sums, [senders, receivers] in float32: (corrupted - clean output of each sender) .
        d metric / d (each receiver's input), summed over batch, positions and d_model, on the clean
        run or with ``embed`` as the embedding. Zero where the sender writes after the receiver reads.

        The numbers of ``delta @ receiver_grads().T`` (tests check, to float rounding) at about the
        memory of one forward and backward: a forward without autograd keeps only the stream
        entering each stage; the backward then recomputes one stage at a time with autograd, a few
        heads at a time (each head reads its own receivers, so their gradients are independent),
        and reduces each group's receiver-input gradient to its scores at once. No more than one
        group's gradient and attention pattern ever exists, never [receivers, batch, pos, d_model].
        """
        g, model = self.graph, self.model
        scores = torch.zeros(len(g.senders), len(g.receivers), dtype=torch.float32, device=self.delta.device)
        self.check_weights()
        start = (self.clean_out[0] if embed is None else embed).detach()
        entering = []  # the stream entering each stage but the last
        with torch.no_grad():
            resid = start + self._bias_before(self.stages[0])
            for stage in self.stages[:-1]:
                entering.append(resid)
                written = [out for rows, heads in self._groups(stage)
                           for out in self._write_group(stage, self._spread(resid, len(rows)), heads)]
                if stage == 2 * self._layer_at[stage] + 1:
                    resid = resid + model.blocks[self._layer_at[stage]].attn.b_O
                resid = resid + sum(written)
        last = self.stages[-1]
        with torch.enable_grad():
            inputs = self._spread(resid, 1).requires_grad_(True)
            value = metric_value(metric, model.unembed(model.ln_final(inputs[0])))
            grad, = torch.autograd.grad(value, inputs)
        self._score(scores, last, [0], grad)
        upstream = grad.sum(0)  # d metric / d (the stream entering the logits)
        del grad, inputs, value
        for stage, resid in zip(reversed(self.stages[:-1]), reversed(entering)):
            through = 0  # d metric / d resid through this stage's receivers
            for rows, heads in self._groups(stage):
                with torch.enable_grad():
                    inputs = self._spread(resid, len(rows)).requires_grad_(True)
                    grad, = torch.autograd.grad(sum(self._write_group(stage, inputs, heads)), inputs, upstream)
                self._score(scores, stage, rows, grad)
                through = through + grad.sum(0)
                del grad, inputs
            upstream = upstream + through  # the stream reaches the next stage directly, too
        return scores

    def _groups(self, stage: int) -> list[tuple[list[int], Optional[list[int]]]]:
        """``stage``'s receivers in groups computed apart: (their rows among the stage's receivers, the
        heads whose q, k and v they are, or None for an MLP). Heads go a few at a time, so that one
        group's [batch, heads, pos, pos] attention pattern is about the size of the stream."""
        g, layer = self.graph, self._layer_at[stage]
        n = len(self._receivers_at[stage])
        groups: list[tuple[list[int], Optional[list[int]]]] = []
        if stage == 2 * layer + 1:
            h, n_pos = g.n_heads, self.clean_out.shape[2]
            size = max(1, min(h, 4 * self.model.cfg.d_model // n_pos))
            for first in range(0, h, size):
                heads = list(range(first, min(h, first + size)))
                groups.append(([i * h + head for i in range(3) for head in heads], heads))
        if g.receivers[self._receivers_at[stage][-1]][0] == "mlp":
            groups.append(([n - 1], None))
        return groups

    def _write_group(self, stage: int, inputs: Tensor, heads: Optional[list[int]]) -> list[Tensor]:
        """What one group of ``_groups`` writes from its receivers' inputs [rows, batch, pos, d_model]:
        each head's ``z W_O`` (without b_O), or the MLP's output."""
        block = self.model.blocks[self._layer_at[stage]]
        if heads is None:
            return [block.mlp(block.ln2(inputs[0]))]
        n = len(heads)
        xq, xk, xv = (inputs[i * n:(i + 1) * n].permute(1, 2, 0, 3) for i in range(3))
        z = head_z(block, xq, xk, xv, heads)
        W_O = block.attn.W_O if heads == list(range(block.attn.cfg.n_heads)) else block.attn.W_O[heads]
        return list(einsum(z, W_O, "b p h e, h e d -> h b p d"))

    @staticmethod
    def _spread(resid: Tensor, n: int) -> Tensor:
        """``resid`` as ``n`` receivers read it on the clean run, [n, batch, pos, d_model]: expanded, not
        copied, and a leaf of its own."""
        return resid.detach().unsqueeze(0).expand(n, *resid.shape)

    def _score(self, scores: Tensor, stage: int, rows: list[int], grad: Tensor) -> None:
        """Add the scores of ``rows`` of ``stage``'s receivers: delta . grad for every sender before the stage."""
        n_up = self._n_before[stage]
        receivers = torch.as_tensor(self._receivers_at[stage][rows], device=scores.device)
        part = self.delta[:n_up].flatten(1) @ grad.flatten(1).T  # [senders before, rows]
        scores[:n_up, receivers] += part.float()

    def receiver_grads(self, metric: Callable[[Tensor], Tensor],
                       embed: Optional[Tensor] = None) -> Float[Tensor, "receiver batch pos d_model"]:
        """d metric / d (each receiver's input), on the clean run or with ``embed`` as the embedding.

        All of them at once, [receivers, batch, pos, d_model]: memory that grows with the receivers
        times the context. EAP reads ``receiver_scores`` instead; this stays as its reference."""
        collected: list[Tensor] = []
        with torch.enable_grad():
            start = (self.clean_out[0] if embed is None else embed).detach().clone().requires_grad_(True)
            value = metric_value(metric, self.run(None, 0, embed=start, collect=collected))
            grads = torch.autograd.grad(value, collected, allow_unused=True)
        return torch.cat([torch.zeros_like(x) if g is None else g for x, g in zip(collected, grads)])


# ---- exact single-edge patching through resume ------------------------------------------------
def _tile(t: Tensor, n: int) -> Tensor:
    return t.repeat(n, *([1] * (t.ndim - 1))) if n > 1 else t


@torch.no_grad()
def edge_effects(runner: EdgeRunner, metric: Callable[[Tensor], Tensor], edges: Sequence[int],
                 stack: int = 1, progress: ProgressLike = False) -> np.ndarray:
    """Metric with each edge (by index) patched alone, the others clean: one value per edge.

    Edges are grouped by receiver and ``stack`` patches run as one batch. A head receiver
    recomputes only the projection its edge feeds (the other two are the clean ones, computed
    once per receiver) and its own ``z``, and adds the change of ``z W_O`` to the cached
    attention output; every recomputation is taken as a change from its own recomputed clean
    value, so an edge whose sender is the same in both runs leaves the clean activations
    untouched, bit for bit.
    """
    runner.check_weights(full=True)  # once: the runs below reuse the runner's clean cache
    g, model, cache = runner.graph, runner.model, runner.clean_cache
    by_receiver: dict[int, list[int]] = defaultdict(list)
    for e in edges:
        by_receiver[int(g.edge_receiver[e])].append(int(e))
    values = {}
    last = g.n_layers - 1
    bar = Progress(progress, len(edges), "edge patching")
    for r, members in by_receiver.items():
        node = g.receivers[r]
        if node[0] == "head":  # the head's clean q, k, v and z, computed once for every edge into it
            _, layer, head, kind = node
            block = model.blocks[layer]
            x = cache[f"blocks.{layer}.hook_resid_pre"]

            def projected(stream: Tensor, k: str) -> Tensor:  # [batch, pos, 1, d_head]
                return project(block, stream[:, :, None], k, [head])  # noqa: B023 (called within this iteration)

            clean_qkv = {k: projected(x, k) for k in ("q", "k", "v")}
            clean_z = attend(block, clean_qkv["q"], clean_qkv["k"], clean_qkv["v"], [head])[:, :, 0]
            W_O = block.attn.W_O[head]
        elif node[0] == "mlp":
            layer = node[1]
            block = model.blocks[layer]
            x = cache[f"blocks.{layer}.hook_resid_pre" if g.parallel else f"blocks.{layer}.hook_resid_mid"]
            clean_mlp = block.mlp(block.ln2(x))
        for start in range(0, len(members), stack):
            chunk = members[start:start + stack]
            n = len(chunk)
            delta = torch.cat([runner.delta[g.edge_sender[e]] for e in chunk])  # [n * batch, pos, d_model]
            if node[0] == "head":
                qkv = {k: _tile(v, n) for k, v in clean_qkv.items()}
                qkv[kind] = projected(_tile(x, n) + delta, kind)
                change = attend(block, qkv["q"], qkv["k"], qkv["v"], [head])[:, :, 0] - _tile(clean_z, n)
                attn_out = _tile(cache[f"blocks.{layer}.hook_attn_out"], n) + change @ W_O
                logits = run_from_site(model, layer, "attn_out", attn_out, cache.cache_dict)
            elif node[0] == "mlp":
                change = block.mlp(block.ln2(_tile(x, n) + delta)) - _tile(clean_mlp, n)
                logits = run_from_site(model, layer, "mlp_out", _tile(cache[f"blocks.{layer}.hook_mlp_out"], n) + change,
                                       cache.cache_dict)
            else:
                logits = model.unembed(model.ln_final(_tile(cache[f"blocks.{last}.hook_resid_post"], n) + delta))
            for e, part in zip(chunk, logits.chunk(n)):
                values[e] = float(metric_value(metric, part))
            bar.update(n)
    bar.close()
    return np.array([values[int(e)] for e in edges])


def default_stack(model, stack: Optional[int]) -> int:
    """Patches per batch: 1 on a CPU (one forward already fills the cores), 16 on a GPU."""
    if stack is None:
        return 16 if model.device.type == "cuda" else 1
    if isinstance(stack, bool) or not isinstance(stack, int) or stack < 1:
        raise ValueError(f"stack must be a positive integer (patches per batch), got {stack!r}")
    return stack


def edge_patching(
    model,
    ds,
    metric: MetricLike,
    edges: Optional[Sequence[EdgeSpec]] = None,
    stack: Optional[int] = None,
    progress: ProgressLike = False,
    graph: Optional[ComputationGraph] = None,
):
    """Exact edge patching: the metric with each edge corrupted alone, the rest clean; one row per edge.

    ``edges``: labels (``"L0H3 -> L1H4.k"``), (sender, receiver) tuples or indices; None for all.
    Columns are ``ComputationGraph.edges``' plus metric, clean, corrupted and score (metric - clean).
    """
    runner = EdgeRunner(model, ds, graph)
    metric = runner.resolve_metric(metric)
    g = runner.graph
    idx = list(range(g.n_edges)) if edges is None else g.edge_indices(edges)
    clean, corrupted = runner.endpoints(metric)
    values = edge_effects(runner, metric, idx, default_stack(model, stack), progress)
    frame = g.edges.iloc[idx].reset_index(drop=True)
    frame["metric"], frame["clean"], frame["corrupted"] = values, clean, corrupted
    frame["score"] = values - clean
    return frame
