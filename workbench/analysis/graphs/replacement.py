"""The replacement model: the HookedDecoder with transcoders in place of its MLPs, frozen on one prompt.

    rs = replacement_set(transcoders)           # a per-layer list, or a cross-layer transcoder
    cap = capture(model, rs, tokens)            # one clean run: what the frozen model holds fixed
    with frozen(model, rs, cap, acts, errors, embed) as run:   # hooks, nothing copied into the model
        logits = run(tokens)                    # the replacement model's logits; run.x[l]: MLP inputs

Each MLP's output becomes ``decode(l, acts) + error_l`` (``error_l``: what the transcoders miss
at that layer on this prompt, a node of its own), and everything else nonlinear is held at its
value on the prompt: every norm's ``hook_scale`` (ln1, ln2, ln_final, QK-norms, MLA's latent
norms) and the attention's queries and keys (``attn.hook_q`` / ``attn.hook_k``), which fix the
pattern together with whatever the layer computes from them alone (QK-norm, RoPE, ALiBi, windows,
soft-capping, sinks). Values, output projections, the transcoders' decoders and the skip paths
stay live and linear, so the model is linear from feature activations, errors and token
embeddings to every MLP input and to the logits. Freezing queries and keys instead of the
pattern keeps attention on the fused kernel, whose memory grows with the context, not its square.

A per-layer set of (skip-)transcoders is the cross-layer case whose decoder from layer s to
layer t is zero unless s == t: ``TranscoderSet`` gives it the cross-layer API, and one code
path serves both. Only the pre-norm and parallel layouts are supported: in the others the MLP's
output passes through a norm (post, sandwich, reordered) before the residual stream.

An attention-only model (``attn_only``, pre-norm) has no MLP to replace: its replacement model is
the model itself with attention and norms frozen (``AttentionOnly``, an empty set: no features,
no error nodes), so its graph has token and logit nodes only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

SUPPORTED_LAYOUTS = ("pre", "parallel", "attn_only_pre")


class TranscoderSet(nn.Module):
    """Per-layer (skip-)transcoders, one per MLP, seen through the cross-layer transcoder's API."""

    cross_layer = False

    def __init__(self, transcoders: Sequence[nn.Module]):
        super().__init__()
        self.transcoders = nn.ModuleList(transcoders)
        if not len(self.transcoders):
            raise ValueError("a transcoder set needs one transcoder per MLP layer; got none")
        for i, tc in enumerate(self.transcoders):
            if not getattr(tc, "is_transcoder", False):
                raise ValueError(f"item {i} ({type(tc).__name__}) is not a transcoder: it reads and writes one hook")
            want_in, want_out = f"blocks.{i}.ln2.hook_normalized", f"blocks.{i}.hook_mlp_out"
            if (tc.cfg.hook_name, tc.cfg.hook_name_out) != (want_in, want_out):
                raise ValueError(f"transcoder {i} reads {tc.cfg.hook_name!r} and writes {tc.cfg.hook_name_out!r}; "
                                 f"layer {i}'s must read {want_in!r} and write {want_out!r} (give one per layer, in order)")
        self.n_layers = len(self.transcoders)
        self.d_in, self.d_out = self.transcoders[0].cfg.d_in, self.transcoders[0].cfg.d_out
        self.d_sae = max(tc.cfg.d_sae for tc in self.transcoders)
        self.skip = any(hasattr(tc, "W_skip") for tc in self.transcoders)

    def hook_in(self, layer: int) -> str:
        return self.transcoders[layer].cfg.hook_name

    def hook_out(self, layer: int) -> str:
        return self.transcoders[layer].cfg.hook_name_out

    def encoder(self, layer: int) -> tuple[Tensor, Tensor]:
        tc = self.transcoders[layer]
        return tc.W_enc, tc.b_enc

    def encode(self, layer: int, x: Tensor) -> Tensor:
        return self.transcoders[layer].encode(x)

    def decoder(self, source: int, target: int) -> Tensor:
        W = self.transcoders[source].W_dec
        return W if source == target else W.new_zeros(W.shape)

    def skip_out(self, target: int, x: Tensor) -> Optional[Tensor]:
        tc = self.transcoders[target]
        return x.to(tc.W_skip.dtype) @ tc.W_skip.T if hasattr(tc, "W_skip") else None

    def decode(self, target: int, acts_by_source: Sequence[Optional[Tensor]], x_target: Optional[Tensor] = None) -> Tensor:
        tc = self.transcoders[target]
        return tc.decode(acts_by_source[target], x_target)


class CLTView:
    """A cross-layer transcoder (``dictionaries/clt.py``) with the two helpers the graph code reads."""

    cross_layer = True

    def __init__(self, clt: nn.Module):
        self.clt = clt
        self.n_layers, self.d_in, self.d_out, self.d_sae = clt.n_layers, clt.d_in, clt.d_out, clt.d_sae
        self.skip = bool(getattr(clt, "skip", False))

    def parameters(self) -> Iterator[nn.Parameter]:
        """The CLT's weights (as a ``TranscoderSet``, an ``nn.Module``, gives its transcoders')."""
        return self.clt.parameters()

    def hook_in(self, layer: int) -> str:
        return self.clt.hook_in(layer)

    def hook_out(self, layer: int) -> str:
        return self.clt.hook_out(layer)

    def encoder(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.clt.W_enc[layer], self.clt.b_enc[layer]

    def encode(self, layer: int, x: Tensor) -> Tensor:
        return self.clt.encode(layer, x)

    def decoder(self, source: int, target: int) -> Tensor:
        return self.clt.decoder(source, target)

    def skip_out(self, target: int, x: Tensor) -> Optional[Tensor]:
        return x.to(self.clt.W_skip.dtype) @ self.clt.W_skip[target].T if self.skip else None

    def decode(self, target: int, acts_by_source: Sequence[Optional[Tensor]], x_target: Optional[Tensor] = None) -> Tensor:
        return self.clt.decode(target, acts_by_source, x_target)

    def to(self, *args, **kwargs) -> "CLTView":
        self.clt.to(*args, **kwargs)
        return self


class AttentionOnly:
    """The replacement of an attention-only model: nothing (no MLPs, so no features and no errors)."""

    cross_layer, skip, n_layers, d_sae = False, False, 0, 0

    def to(self, *args, **kwargs) -> "AttentionOnly":
        return self

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(())


def replacement_set(transcoders, model=None) -> "TranscoderSet | CLTView | AttentionOnly":
    """What replaces the MLPs: a ``TranscoderSet``/``CLTView`` as given, a list of per-layer
    transcoders, or a cross-layer transcoder; None (or, for an attention-only ``model``, an empty
    list) for an attention-only model, which has nothing to replace."""
    if isinstance(transcoders, (TranscoderSet, CLTView, AttentionOnly)):
        return transcoders
    attn_only = model is not None and model.cfg.attn_only
    if transcoders is None or (attn_only and isinstance(transcoders, (list, tuple, nn.ModuleList)) and not len(transcoders)):
        return AttentionOnly()
    if getattr(transcoders, "cross_layer", False):
        return CLTView(transcoders)
    if isinstance(transcoders, nn.Module) and getattr(transcoders, "is_transcoder", False):
        raise ValueError("one transcoder replaces one MLP; give a list with one per layer (or a cross-layer transcoder)")
    if isinstance(transcoders, (list, tuple, nn.ModuleList)):
        return TranscoderSet(list(transcoders))
    raise ValueError(f"transcoders must be a list of per-layer transcoders or a cross-layer transcoder, "
                     f"got {type(transcoders).__name__}")


def targets_of(rs, source: int) -> range:
    """The layers whose MLP output source layer ``source``'s features write."""
    return range(source, rs.n_layers) if rs.cross_layer else range(source, source + 1)


def check_layout(model) -> None:
    """A ValueError naming the layout unless the model's MLP outputs enter the residual stream as they are."""
    from workbench.components.block import layout_of

    layout = layout_of(model.cfg)
    if layout not in SUPPORTED_LAYOUTS:
        raise ValueError(f"attribution graphs need a layout where the MLP's output enters the residual stream "
                         f"as it is; this model's layout is {layout!r} (supported: {list(SUPPORTED_LAYOUTS)}): "
                         "a norm after the MLP (post, sandwich, reordered) is not linear in the features")


def check_model(model, rs) -> None:
    """A ValueError naming the problem unless ``rs`` can replace ``model``'s MLPs."""
    check_layout(model)
    if model.cfg.attn_only != isinstance(rs, AttentionOnly):
        if model.cfg.attn_only:
            raise ValueError("this model has no MLPs (attn_only): there is nothing for transcoders to replace; "
                             "pass transcoders=None (its replacement model is the model itself)")
        raise ValueError("this model has MLPs: give transcoders (one per MLP layer) or a cross-layer transcoder")
    if isinstance(rs, AttentionOnly):
        return
    if rs.n_layers != model.cfg.n_layers:
        raise ValueError(f"the transcoders cover {rs.n_layers} layers, the model has {model.cfg.n_layers}: "
                         "give one per MLP layer")
    for layer in range(rs.n_layers):
        for name in (rs.hook_in(layer), rs.hook_out(layer)):
            if name not in model.hook_dict:
                raise ValueError(f"the model has no hook {name!r}: are these the transcoders of another model?")


def frozen_hook_names(model) -> list[str]:
    """Every hook whose value the replacement model holds fixed: norm scales, queries, keys."""
    return [name for name in model.hook_dict
            if name.endswith(".hook_scale") or name.endswith("attn.hook_q") or name.endswith("attn.hook_k")
            or name == "ln_final.hook_scale"]


def final_read(model) -> tuple[str, Tensor]:
    """Where a logit direction is read and the factor the unembedding input applies there.

    ``(hook, w)``: the logits are ``(x * w + b) @ W_U + b_U`` with ``x`` the value at ``hook``
    (the final norm's normalised input; the last residual stream when the model has no final norm).
    """
    if "ln_final.hook_normalized" in model.hook_dict:
        return "ln_final.hook_normalized", model.ln_final.w.detach()
    return f"blocks.{model.cfg.n_layers - 1}.hook_resid_post", torch.ones(model.cfg.d_model, device=model.device)


@dataclass
class Capture:
    """One clean run on a prompt: everything the frozen replacement model holds or starts from."""

    tokens: Tensor  # [pos]
    frozen: dict[str, Tensor]  # hook -> [1, pos, ...] clean value (scales, queries, keys)
    x_in: list[Tensor]  # per layer [pos, d_in]: the transcoders' inputs
    mlp_out: list[Tensor]  # per layer [pos, d_out]: the MLPs' outputs
    embed: Tensor  # [pos, d_model]: the residual stream entering block 0
    final: Tensor  # [pos, d_model]: the value at final_read's hook
    logits: Tensor  # [pos, d_vocab]
    acts: list[Tensor] = field(default_factory=list)  # per layer [pos, d_sae]
    errors: list[Tensor] = field(default_factory=list)  # per layer [pos, d_out]
    patterns: dict[int, Tensor] = field(default_factory=dict)  # layer -> [head, pos, pos], when captured
    # [pos, d_model]: what each token node carries (None: all of ``embed``); with token_embedding="token", the
    # token embedding alone, and ``embed - token_vectors`` (the position embedding) is a constant, no node's
    token_vectors: Optional[Tensor] = None
    # positions [0, held) have no feature nodes and no error nodes (held_positions): their features are held
    # at zero and their errors (the whole MLP output less the decoder bias) are constants, no node's
    held: int = 0

    @property
    def token_part(self) -> Tensor:
        """[pos, d_model]: the token nodes' values (``embed`` itself unless token_embedding="token")."""
        return self.embed if self.token_vectors is None else self.token_vectors


def pattern_layers(model) -> list[int]:
    """The layers whose attention output is ``pattern @ values`` with the pattern at ``attn.hook_pattern``
    and the values at ``attn.hook_v`` (the standard attention; MLA is not one of them)."""
    from workbench.components.attention import Attention

    return [l for l, block in enumerate(model.blocks) if type(block.attn) is Attention]


TOKEN_EMBEDDINGS = ("token+position", "token")


def check_conventions(token_embedding: str, held_positions: int) -> None:
    """A ValueError unless ``token_embedding`` and ``held_positions`` are settings ``capture`` takes."""
    from workbench.utils import is_int

    if token_embedding not in TOKEN_EMBEDDINGS:
        raise ValueError(f"token_embedding must be one of {list(TOKEN_EMBEDDINGS)}, got {token_embedding!r}")
    if not is_int(held_positions) or held_positions < 0:
        raise ValueError(f"held_positions must be a non-negative integer (circuit-tracer's convention: 1), "
                         f"got {held_positions!r}")


@torch.no_grad()
def capture(model, rs, tokens: Tensor, attention_mask: Optional[Tensor] = None, patterns: bool = False, *,
            token_embedding: str = "token+position", held_positions: int = 0) -> list[Capture]:
    """Clean run(s): one ``Capture`` per row of ``tokens`` [batch, pos] (only its real positions);
    with ``patterns``, also the attention patterns of ``pattern_layers`` (memory: heads x pos^2 per layer).

    ``token_embedding``: what a token node carries on a model whose position embedding is added to
    the residual stream (learned, sinusoidal): ``"token+position"`` (the default: the whole residual
    stream entering block 0, so nothing of it is left unattributed) or ``"token"`` (the token
    embedding alone, the position embedding a constant: circuit-tracer's convention). Elsewhere the
    two are the same. ``held_positions``: the first this many positions get no feature and no error
    nodes (0, the default, keeps them all; circuit-tracer's convention is 1: position 0, often BOS,
    whose MLP output is a large constant)."""
    check_conventions(token_embedding, held_positions)
    names = frozen_hook_names(model)
    if patterns:
        names = names + [f"blocks.{l}.attn.hook_pattern" for l in pattern_layers(model)]
    reads = {rs.hook_in(l): ("x", l) for l in range(rs.n_layers)}
    reads.update({rs.hook_out(l): ("y", l) for l in range(rs.n_layers)})
    final_hook, _ = final_read(model)
    store: dict = {}

    def keep(act: Tensor, hook) -> None:
        store[hook.name] = act.detach()

    extra = ["hook_embed"] if token_embedding == "token" else []
    hooks = [(n, keep) for n in names + list(reads) + ["blocks.0.hook_resid_pre", final_hook] + extra]
    logits = model.run_with_hooks(tokens, attention_mask=attention_mask, fwd_hooks=hooks)
    mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(tokens, dtype=torch.bool)
    out = []
    for b in range(tokens.shape[0]):
        real = mask[b].nonzero().squeeze(-1)
        row = {name: value[b:b + 1, real] for name, value in store.items() if not name.endswith("hook_pattern")}
        cap = Capture(
            tokens=tokens[b, real],
            frozen={n: row[n] for n in names if n in row and not n.endswith("hook_pattern")},
            x_in=[row[rs.hook_in(l)][0].flatten(1) for l in range(rs.n_layers)],
            mlp_out=[row[rs.hook_out(l)][0].flatten(1) for l in range(rs.n_layers)],
            embed=row["blocks.0.hook_resid_pre"][0],
            final=row[final_hook][0],
            logits=logits[b, real],
        )
        if token_embedding == "token":
            cap.token_vectors = row["hook_embed"][0]
        cap.acts = [rs.encode(l, cap.x_in[l]) for l in range(rs.n_layers)]
        if held_positions:
            cap.held = int(held_positions)
            for acts in cap.acts:
                acts[:held_positions] = 0
        cap.errors = [cap.mlp_out[l] - rs.decode(l, cap.acts, cap.x_in[l]) for l in range(rs.n_layers)]
        for name in names:
            if name.endswith("hook_pattern"):
                cap.patterns[int(name.split(".")[1])] = store[name][b][:, real][:, :, real]
        out.append(cap)
    return out


class FrozenRun:
    """The frozen replacement model as a callable; ``x[l]`` / ``final`` hold the last run's values."""

    def __init__(self, model, rs, cap: Capture, write: Callable[[int, Tensor], Tensor], embed: Tensor):
        self.model, self.rs, self.cap, self.write, self.embed = model, rs, cap, write, embed
        self.x: dict[int, Tensor] = {}
        self.final: Optional[Tensor] = None

    def hooks(self, batch: int) -> list:
        def frozen_value(act: Tensor, hook) -> Tensor:
            return self.cap.frozen[hook.name].expand(act.shape).to(act.dtype)

        def embed(act: Tensor, hook) -> Tensor:
            return self.embed.expand(act.shape) if self.embed.ndim == act.ndim else self.embed[None].expand(act.shape)

        def read_x(act: Tensor, hook, layer: int) -> Tensor:
            self.x[layer] = act
            return act

        def write(act: Tensor, hook, layer: int) -> Tensor:
            x = self.x[layer]
            out = self.write(layer, x.flatten(2) if x.ndim > 3 else x).to(act.dtype)
            # held activations without a skip path decode to [pos, d]: the same for every copy of a batch
            return out.expand(act.shape) if out.ndim < act.ndim else out.view(act.shape)

        def read_final(act: Tensor, hook) -> Tensor:
            self.final = act
            return act

        rs = self.rs
        hooks = [(name, frozen_value) for name in self.cap.frozen]
        hooks.append(("blocks.0.hook_resid_pre", embed))
        for layer in range(rs.n_layers):
            hooks.append((rs.hook_in(layer), _bind(read_x, layer)))
            hooks.append((rs.hook_out(layer), _bind(write, layer)))
        hooks.append((final_read(self.model)[0], read_final))
        return hooks

    def __call__(self, batch: int = 1, extra_hooks: Sequence = ()) -> Tensor:
        tokens = self.cap.tokens[None].expand(batch, -1)
        with self.model.hooks(fwd_hooks=self.hooks(batch) + list(extra_hooks)), mlps_skipped(self.model):
            return self.model(tokens)


@contextlib.contextmanager
def mlps_skipped(model) -> Iterator[None]:
    """The real MLPs not computed: each returns a zero placeholder (a stride-0 view, no memory)
    that the ``hook_mlp_out`` write of the replacement model replaces. Only for runs whose every
    MLP output is written by a hook: everything inside the MLP (its hooks too) is skipped."""
    mlps = [block.mlp for block in model.blocks if hasattr(block, "mlp")]
    d_model = model.cfg.d_model

    def placeholder(x: Tensor, token_mask: Optional[Tensor] = None) -> Tensor:
        return x.new_zeros(()).expand(*x.shape[:-1], d_model)

    had = [mlp.__dict__.get("forward") for mlp in mlps]
    for mlp in mlps:
        mlp.forward = placeholder
    try:
        yield
    finally:
        for mlp, before in zip(mlps, had):
            if before is None:
                del mlp.forward
            else:
                mlp.forward = before


def _bind(fn, layer: int):
    def hook(act, hook):
        return fn(act, hook, layer)
    return hook


def frozen_forward(model, rs, cap: Capture, acts: Optional[list[Tensor]] = None,
                   errors: Optional[list[Tensor]] = None, embed: Optional[Tensor] = None,
                   freeze: bool = True) -> FrozenRun:
    """The replacement model with feature activations ``acts`` and ``errors`` held as given
    (default: the clean ones) and, with ``freeze``, queries/keys/scales frozen; ``run()`` runs it."""
    acts = cap.acts if acts is None else acts
    errors = cap.errors if errors is None else errors

    def write(layer: int, x: Tensor) -> Tensor:
        return rs.decode(layer, acts, x) + errors[layer]

    run = FrozenRun(model, rs, cap, write, cap.embed if embed is None else embed)
    if not freeze:
        run.cap = _unfrozen(cap)
    return run


def _unfrozen(cap: Capture) -> Capture:
    return Capture(cap.tokens, {}, cap.x_in, cap.mlp_out, cap.embed, cap.final, cap.logits, cap.acts, cap.errors,
                   token_vectors=cap.token_vectors, held=cap.held)


def live_forward(model, rs, cap: Capture, edit: Callable[[int, Tensor], Tensor], freeze: bool = False) -> FrozenRun:
    """The replacement model whose features are re-encoded from the live MLP inputs, edited by
    ``edit(layer, acts)``; errors held at their clean values; attention live unless ``freeze``."""
    acts: list[Optional[Tensor]] = [None] * rs.n_layers

    def write(layer: int, x: Tensor) -> Tensor:
        encoded = rs.encode(layer, x)
        if cap.held:  # held positions keep their features at zero: their errors hold the whole MLP output
            encoded = encoded.clone()
            encoded[..., :cap.held, :] = 0
        acts[layer] = edit(layer, encoded)
        return rs.decode(layer, acts, x) + cap.errors[layer]

    return FrozenRun(model, rs, cap if freeze else _unfrozen(cap), write, cap.embed)


@contextlib.contextmanager
def eval_no_dropout(model) -> Iterator[None]:
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)
