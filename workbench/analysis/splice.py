"""Splicing a dictionary into a model: its features become hooks, so every analysis works on them.

    model.add_sae(sae, error_term=True)          # or: with spliced(model, sae, error_term=True): ...
    logits, cache = model.run_with_cache(tokens)
    cache["blocks.1.hook_resid_post.hook_sae_acts_post"]    # [batch, pos, d_sae] feature activations
    model.remove_sae()                           # every dictionary out, the original hooks back

The model's HookPoint at the dictionary's hook (``blocks.1.hook_resid_post``) is swapped for an
``SAEHookPoint``: still a HookPoint under the same name (so caches and hooks there keep working
and see the spliced value), holding child hooks that ``HookedRootModule.setup()`` registers as
``{hook}.hook_sae_input``, ``.hook_sae_acts_pre``, ``.hook_sae_acts_post``, ``.hook_sae_recons`` and
``.hook_sae_error``. Ablating or steering a feature is a hook on ``hook_sae_acts_post``.

With ``error_term=True`` the value passed on is ``recons + (x - recons_clean)``, where
``recons_clean`` is the reconstruction with no hook edits: unedited, the model computes what it
did before (to float rounding), and its gradient with respect to ``x`` is the identity, while the
gradient with respect to a feature is its decoder direction (the error is a separate node, as in
sparse feature circuits). Without it the model runs on the reconstruction alone.

A transcoder reads one hook (the MLP's input) and replaces another (the MLP's output): the input
hook is swapped for an ``InputTap`` that hands its value to the output's ``SAEHookPoint``.

A cross-layer transcoder (``dictionaries/clt.py``) replaces every MLP at once: each layer's MLP
input is tapped, and layer ``t``'s ``hook_mlp_out`` becomes a ``CLTHookPoint`` that encodes layer
``t``'s features (its ``hook_sae_acts_post``, edited or not) and decodes the features of layers
``0..t`` written so far in this forward. Its error term is the MLP's output minus the unedited
reconstruction, so with ``error_term=True`` and no edits the model computes what it did before.

The dictionary is held by reference, not as a submodule: the model's parameters, state_dict and
checkpoints never include it.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Optional, Union

import numpy as np
import torch
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from workbench.analysis.store import check_hook, hook_shapes

SAE_HOOKS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error")


class InputTap(HookPoint):
    """A HookPoint that also keeps its latest value for the transcoder that reads it."""

    def __init__(self):
        super().__init__()
        self.value: Optional[Tensor] = None

    def has_hooks(self, *args, **kwargs) -> bool:
        return True  # norms and attention take their hooked path only when a hook listens

    def forward(self, x: Tensor) -> Tensor:
        self.value = x
        return x


class SAEHookPoint(HookPoint):
    """A model HookPoint whose value is a dictionary's reconstruction (plus the error term, if asked)."""

    def __init__(self, sae: nn.Module, error_term: bool, tap: Optional[InputTap] = None):
        super().__init__()
        self._sae = [sae]  # a list: not a submodule, so its weights stay out of the model's
        self.error_term = bool(error_term)
        self._tap = [tap] if tap is not None else []
        for name in SAE_HOOKS:
            setattr(self, name, HookPoint())

    @property
    def sae(self) -> nn.Module:
        return self._sae[0]

    def has_hooks(self, *args, **kwargs) -> bool:
        return True

    def forward(self, x: Tensor) -> Tensor:
        sae = self.sae
        if self._tap:
            raw, self._tap[0].value = self._tap[0].value, None
            if raw is None:
                raise RuntimeError(f"the transcoder at {self.name} found no input at {sae.cfg.hook_name}: "
                                   "that hook did not run before this one")
        else:
            raw = x
        unread = not (torch.is_grad_enabled() or self._hooked())
        if unread and self.error_term:
            # recons + (x - recons) is x, and nothing reads or edits the dictionary's values: nothing to compute
            return x
        raw = raw.flatten(2) if raw.ndim > 3 else raw
        target = x.flatten(2) if x.ndim > 3 else x
        sae_in = self.hook_sae_input(raw)
        pre = self.hook_sae_acts_pre(sae.pre_acts(sae_in))
        # Nothing reads or edits the features and no gradient flows: a TopK dictionary decodes its k
        # kept features (a sum of k decoder rows) instead of a dense [rows, d_sae] @ W_dec.
        sparse = sae.sparse_activate(pre) if unread else None
        if sparse is not None:
            return sae.decode_sparse(*sparse, sae_in).to(x.dtype).view(x.shape)
        acts = self.hook_sae_acts_post(sae.activate(pre))
        recons = self.hook_sae_recons(sae.decode(acts, sae_in))
        if self.error_term:
            edited = torch.is_grad_enabled() or any(
                getattr(self, name).has_hooks() for name in SAE_HOOKS if name != "hook_sae_error")
            clean = sae(raw) if edited else recons
            recons = recons + self.hook_sae_error(target.to(recons.dtype) - clean)
        return recons.to(x.dtype).view(x.shape)

    def _hooked(self) -> bool:
        """Whether a hook sits on any of this splice's own hook points."""
        return any(getattr(self, name).has_hooks() for name in SAE_HOOKS)


class _CLTForward:
    """What one forward of a spliced CLT has computed so far: each layer's activations (as edited
    by hooks) and, once something was edited, the unedited ones the error term needs."""

    def __init__(self):
        self.acts: list[Tensor] = []
        self.clean: list[Tensor] = []
        self.edited = False


class CLTHookPoint(SAEHookPoint):
    """Layer ``layer``'s MLP output, replaced by a cross-layer transcoder's reconstruction."""

    def __init__(self, clt: nn.Module, layer: int, error_term: bool, tap: InputTap, state: _CLTForward):
        super().__init__(clt, error_term, tap)
        self.layer, self._state = layer, [state]

    def forward(self, x: Tensor) -> Tensor:
        clt, layer, state = self.sae, self.layer, self._state[0]
        raw, self._tap[0].value = self._tap[0].value, None
        if raw is None:
            raise RuntimeError(f"the CLT at {self.name} found no input at {clt.hook_in(layer)}: that hook did not run")
        if layer == 0:
            state.__init__()
        if len(state.acts) != layer:
            raise RuntimeError(f"the CLT reached layer {layer} after layers {len(state.acts)} of this forward; "
                               "a spliced CLT needs every block to run in order (no resuming from a middle layer)")
        sae_in = self.hook_sae_input(raw)
        acts = self.hook_sae_acts_post(clt.activate_layer(layer, self.hook_sae_acts_pre(clt.pre_acts_layer(layer, sae_in))))
        state.acts.append(acts)
        recons = self.hook_sae_recons(clt.decode(layer, state.acts, sae_in))
        if self.error_term:
            state.edited = state.edited or torch.is_grad_enabled() or any(
                getattr(self, name).has_hooks() for name in SAE_HOOKS if name != "hook_sae_error")
            if state.edited:
                state.clean.append(clt.encode(layer, raw))
                clean = clt.decode(layer, state.clean, raw)
            else:
                state.clean.append(acts)
                clean = recons
            recons = recons + self.hook_sae_error(x.to(recons.dtype) - clean)
        return recons.to(x.dtype)


def _parent(model, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def _refresh_hook_dict(model) -> None:
    """What ``HookedRootModule.setup()`` does (each module's ``name``, ``mod_dict``, ``hook_dict``, in
    module order), writing ``name`` only where it changed: a splice goes in and out in well under a
    millisecond instead of re-setting every module's name through ``nn.Module.__setattr__``."""
    mod_dict, hook_dict = {}, {}
    for name, module in model.named_modules():
        if not name:
            continue
        if module.__dict__.get("name") != name:
            module.name = name
        mod_dict[name] = module
        if isinstance(module, HookPoint):
            hook_dict[name] = module
    model.mod_dict, model.hook_dict = mod_dict, hook_dict


def _splices(model) -> dict:
    if not hasattr(model, "_sae_splices"):
        model._sae_splices = {}
    return model._sae_splices


class DictionaryMismatchWarning(UserWarning):
    """A dictionary was trained on other weights than the model it is used with (its recorded
    fingerprint differs): its features may mean something else here."""


def dictionary_hooks(sae, hook: Optional[str] = None) -> tuple[str, str]:
    """(the hook a dictionary reads, the hook it replaces): ``hook`` or its recorded one, and a
    transcoder's recorded output hook; ValueError when it records none."""
    cfg = sae.cfg
    hook_in = hook or cfg.hook_name
    if not hook_in:
        raise ValueError("this dictionary records no hook; pass hook='blocks.L.hook_...'")
    hook_out = (cfg.hook_name_out or "") if getattr(sae, "is_transcoder", False) else hook_in
    if not hook_out:
        raise ValueError("this transcoder records no output hook (cfg.hook_name_out); it cannot be spliced")
    return hook_in, hook_out


def check_fits(model, sae, hook: Optional[str] = None) -> Optional[str]:
    """What splicing, the Features page and every feature analysis check before using ``sae`` on
    ``model``: ValueError (naming both) unless its hooks exist with the widths and the per-position
    shape it was trained on; a warning (a string) when it was trained on another model (name) or
    on other weights (the fingerprint it recorded); else None.

    A fingerprint mismatch only warns: casting or processing a model after the dictionary was
    trained (fold_ln, bf16) changes the fingerprint too, and the dictionary still reads it.
    """
    from workbench.analysis.graphs.checks import trained_elsewhere

    cfg = sae.cfg
    hook_in, hook_out = dictionary_hooks(sae, hook)
    for name in {hook_in, hook_out}:
        check_hook(model, name)
    shapes = hook_shapes(model, sorted({hook_in, hook_out}))
    for name, width, what in ((hook_in, cfg.d_in, "d_in"), (hook_out, cfg.d_out, "d_out")):
        have = int(np.prod(shapes[name]))
        if have != width:
            raise ValueError(f"the dictionary's {what}={width} does not match {name}: it is {width} wide at {name}, "
                             f"but this model's {name} has {have} features (shape {list(shapes[name])}); it was "
                             "trained on another hook or model")
    recorded, actual = tuple(cfg.hook_shape), tuple(shapes[hook_in])
    if recorded not in (actual, (cfg.d_in,)):  # (d_in,): no shape recorded (SAELens' files)
        raise ValueError(f"the dictionary was trained on activations of shape {list(recorded)} at {cfg.hook_name}, "
                         f"but {hook_in} on this model has shape {list(actual)}: it belongs to another hook or model")
    return trained_elsewhere(cfg, model)  # one check with the attribution graph's and add_clt's


def add_sae(model, sae, error_term: bool = False, hook: Optional[str] = None
            ) -> Union[SAEHookPoint, list["CLTHookPoint"]]:
    """Put ``sae`` at its hook (``hook`` overrides ``sae.cfg.hook_name``); returns the new HookPoint.

    A transcoder replaces ``sae.cfg.hook_name_out`` and reads ``sae.cfg.hook_name``; a cross-layer
    transcoder replaces every layer's MLP output (``add_clt``). The checks of ``check_fits`` run
    first: a wrong hook, width or shape is a ValueError, other weights than the dictionary's a
    ``DictionaryMismatchWarning``.
    """
    if getattr(sae, "cross_layer", False):
        if hook is not None:
            raise ValueError("a cross-layer transcoder splices in at every layer's MLP; hook= does not apply")
        return add_clt(model, sae, error_term=error_term)
    hook_in, hook_out = dictionary_hooks(sae, hook)
    splices = _splices(model)
    for name in {hook_in, hook_out}:
        if name in splices or any(name == s["hook_in"] for s in splices.values()):
            raise ValueError(f"a dictionary is already spliced in at {name}; remove_sae({name!r}) first")
        if isinstance(model.hook_dict.get(name), (SAEHookPoint, InputTap)):
            raise ValueError(f"{name} is already spliced")
    warning = check_fits(model, sae, hook)
    if warning:
        warnings.warn(warning, DictionaryMismatchWarning, stacklevel=3)
    sae.to(model.device).eval()
    tap = None
    if hook_out != hook_in:
        parent, attr = _parent(model, hook_in)
        tap = InputTap()
        original_in = getattr(parent, attr)
        setattr(parent, attr, tap)
    parent, attr = _parent(model, hook_out)
    original = getattr(parent, attr)
    point = SAEHookPoint(sae, error_term, tap)
    setattr(parent, attr, point)
    splices[hook_out] = {"point": point, "original": original, "hook_in": hook_in,
                         "tap_original": original_in if tap is not None else None}
    _refresh_hook_dict(model)
    return point


def add_clt(model, clt, error_term: bool = False) -> list[CLTHookPoint]:
    """Replace every MLP output of ``model`` by ``clt``'s reconstruction; returns the new HookPoints."""
    if clt.n_layers != model.cfg.n_layers:
        raise ValueError(f"the CLT covers {clt.n_layers} layers but the model has {model.cfg.n_layers}")
    hooks = [(clt.hook_in(layer), clt.hook_out(layer)) for layer in range(clt.n_layers)]
    splices = _splices(model)
    for pair in hooks:
        for name in pair:
            if name in splices or any(name == s["hook_in"] for s in splices.values()) \
                    or isinstance(model.hook_dict.get(name), (SAEHookPoint, InputTap)):
                raise ValueError(f"a dictionary is already spliced in at {name}; remove_sae({name!r}) first")
            check_hook(model, name)
    shapes = hook_shapes(model, [h for pair in hooks for h in pair])
    for hook_in, hook_out in hooks:
        for name, width, what in ((hook_in, clt.d_in, "d_in"), (hook_out, clt.d_out, "d_out")):
            if int(np.prod(shapes[name])) != width:
                raise ValueError(f"the CLT's {what}={width} does not match {name} (shape {list(shapes[name])})")
    from workbench.analysis.graphs.checks import trained_elsewhere

    warning = trained_elsewhere(clt.cfg, model)  # add_sae's check: a CLT of another model warned nothing
    if warning:
        warnings.warn(warning, DictionaryMismatchWarning, stacklevel=3)
    clt.to(model.device).eval()
    state, points = _CLTForward(), []
    for layer, (hook_in, hook_out) in enumerate(hooks):
        parent, attr = _parent(model, hook_in)
        tap, original_in = InputTap(), getattr(parent, attr)
        setattr(parent, attr, tap)
        parent, attr = _parent(model, hook_out)
        point, original = CLTHookPoint(clt, layer, error_term, tap, state), getattr(parent, attr)
        setattr(parent, attr, point)
        splices[hook_out] = {"point": point, "original": original, "hook_in": hook_in, "tap_original": original_in}
        points.append(point)
    _refresh_hook_dict(model)
    return points


def remove_sae(model, which: Union[str, nn.Module, None] = None) -> None:
    """Take out the dictionary at hook ``which`` (or that dictionary object; None: all of them)."""
    splices = _splices(model)
    if which is None:
        names = list(splices)
    elif isinstance(which, str):
        names = [n for n, s in splices.items() if which in (n, s["hook_in"])]
    else:
        names = [n for n, s in splices.items() if s["point"].sae is which]
    if which is not None and not names:
        raise ValueError(f"no dictionary is spliced in at {which!r}; spliced: {list(splices) or 'none'}")
    # a cross-layer transcoder comes out of every layer together
    whole = {id(splices[n]["point"].sae) for n in names if isinstance(splices[n]["point"], CLTHookPoint)}
    names += [n for n, s in splices.items() if n not in names and id(s["point"].sae) in whole]
    for name in names:
        entry = splices.pop(name)
        parent, attr = _parent(model, name)
        setattr(parent, attr, entry["original"])
        if entry["tap_original"] is not None:
            parent, attr = _parent(model, entry["hook_in"])
            setattr(parent, attr, entry["tap_original"])
    _refresh_hook_dict(model)


def spliced_saes(model) -> dict[str, nn.Module]:
    """``{hook: dictionary}`` for every dictionary spliced into ``model`` (a CLT under each MLP output)."""
    return {name: entry["point"].sae for name, entry in _splices(model).items()}


@contextlib.contextmanager
def spliced(model, *saes, error_term: bool = False) -> Iterator:
    """Splice ``saes`` in for the ``with`` block; they come out again however the block ends."""
    added = []
    try:
        for sae in saes:
            add_sae(model, sae, error_term=error_term)
            added.append(sae)
        yield model
    finally:
        for sae in added:
            remove_sae(model, sae)
