"""Cross-layer transcoders (Ameisen et al. 2025): features read one layer's MLP input and write every later MLP output.

    acts_s   = activation_s(x_s W_enc[s] + b_enc[s])                   x_s: blocks.{s}.ln2.hook_normalized
    y_hat_t  = sum_{s <= t} acts_s W_dec[s][:, t - s] + b_dec[t]       y_t: blocks.{t}.hook_mlp_out
               (+ x_t W_skip[t]^T for a skip-CLT)

Each source layer ``s`` has ``d_sae`` features; a feature of layer ``s`` has one decoder per target
layer ``t >= s`` (``decoder(s, t)``, ``[d_sae, d_out]``), stored per source as
``W_dec[s]`` ``[d_sae, n_layers - s, d_out]`` (circuit-tracer's layout), so a feature that the model
computes once and uses in several MLPs is one feature, not one per layer. The activation is
JumpReLU (``jumprelu.py``'s straight-through estimators, trained with an L0 penalty) or a per-layer
TopK (``k`` features per token and source layer).

While training, a feature's whole decoder (all its targets together) keeps unit norm, as a
per-layer dictionary's row does, so its activation is its size along one unit direction and
the L0 and dead-feature bookkeeping mean the same thing. The trainer sees the CLT through the
same methods as a per-layer dictionary, on rows that concatenate the layers: ``x`` is
``[rows, n_layers * d_in]``, ``y`` ``[rows, n_layers * d_out]`` and the activations
``[rows, n_layers * d_sae]`` (source layer ``s`` owns columns ``s * d_sae : (s + 1) * d_sae``).

On disk (``save_clt`` / ``load_clt``, which ``save_dictionary`` / ``load_dictionary`` call):
``clt.json`` (the DictionaryConfig, metrics, training settings) and ``clt.safetensors``
(``W_enc`` [n_layers, d_in, d_sae], ``b_enc``, ``threshold``, ``W_dec_{s}``, ``b_dec``, ``W_skip``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Optional, Sequence, Union

import torch
from jaxtyping import Float
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from workbench.analysis.dictionaries.topk import topk_relu
from workbench.analysis.dictionaries.base import DictionaryConfig
from workbench.analysis.dictionaries.jumprelu import BANDWIDTH, INIT_THRESHOLD, _JumpReLU, _Step

CONFIG_FILE = "clt.json"
WEIGHTS_FILE = "clt.safetensors"
CLT_FORMAT = "workbench-clt"  # clt.json's mark: a CLT the workbench saved
HOOK_IN = "blocks.{l}.ln2.hook_normalized"  # the MLP's input, as the per-layer transcoders read it
HOOK_OUT = "blocks.{l}.hook_mlp_out"
ACTIVATIONS = ("jumprelu", "topk")


def clt_config(n_layers: int, d_in: int, d_sae: int, d_out: int = 0, activation: str = "jumprelu", k: int = 0,
               skip: bool = False, model_name: str = "", model_fingerprint: str = "",
               hook_in: str = HOOK_IN, hook_out: str = HOOK_OUT) -> DictionaryConfig:
    """The DictionaryConfig of a CLT (kind ``clt``; the layer count and activation live in ``extra``)."""
    return DictionaryConfig(kind="clt", d_in=d_in, d_sae=d_sae, d_out=d_out, k=k, hook_name=hook_in,
                            hook_name_out=hook_out, model_name=model_name, model_fingerprint=model_fingerprint,
                            apply_b_dec_to_input=False,
                            extra={"n_layers": n_layers, "activation": activation, "skip": bool(skip)})


class CrossLayerTranscoder(nn.Module):
    """A CLT over ``n_layers`` MLPs: ``CrossLayerTranscoder(n_layers=3, d_in=128, d_sae=512)`` or from a config."""

    kind: ClassVar[str] = "clt"
    architecture: ClassVar[str] = "clt"
    is_transcoder: ClassVar[bool] = True
    cross_layer: ClassVar[bool] = True

    def __init__(self, cfg: Optional[DictionaryConfig] = None, **kwargs: Any):
        super().__init__()
        if cfg is None:
            cfg = clt_config(**kwargs)
        elif kwargs:
            raise ValueError("give either a DictionaryConfig or keyword arguments, not both")
        extra = dict(cfg.extra)
        n_layers, activation = extra.get("n_layers"), extra.get("activation", "jumprelu")
        if not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"a CLT needs extra['n_layers'], a positive integer; got {n_layers!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"a CLT's activation must be one of {ACTIVATIONS}, got {activation!r}")
        if activation == "topk" and (not float(cfg.k).is_integer() or not 1 <= cfg.k <= cfg.d_sae):
            raise ValueError(f"a TopK CLT needs an integer k in [1, d_sae={cfg.d_sae}] (per source layer), got {cfg.k}")
        self.cfg = cfg.replace(kind="clt", apply_b_dec_to_input=False, k=int(cfg.k) if activation == "topk" else 0)
        self.n_layers, self.d_in, self.d_out, self.d_sae = n_layers, cfg.d_in, cfg.d_out, cfg.d_sae
        self.activation, self.skip = activation, bool(extra.get("skip", False))
        self.bandwidth = float(extra.get("bandwidth", BANDWIDTH))
        L = n_layers
        self.W_enc = nn.Parameter(torch.empty(L, cfg.d_in, cfg.d_sae))
        self.b_enc = nn.Parameter(torch.zeros(L, cfg.d_sae))
        self.W_dec = nn.ParameterList([nn.Parameter(torch.empty(cfg.d_sae, L - s, cfg.d_out)) for s in range(L)])
        self.b_dec = nn.Parameter(torch.zeros(L, cfg.d_out))
        if activation == "jumprelu":
            self.threshold = nn.Parameter(torch.full((L, cfg.d_sae), INIT_THRESHOLD))
        if self.skip:
            self.W_skip = nn.Parameter(torch.zeros(L, cfg.d_out, cfg.d_in))
        self.metrics: dict[str, Any] = {}
        self.init_weights()

    # ---- hooks and shape ------------------------------------------------------------------------
    def hook_in(self, layer: int) -> str:
        return self.cfg.hook_name.format(l=self._layer(layer))

    def hook_out(self, layer: int) -> str:
        return self.cfg.hook_name_out.format(l=self._layer(layer))

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    @property
    def n_features(self) -> int:
        """Features over all source layers (what the trainer counts as firing or dead)."""
        return self.n_layers * self.d_sae

    def _layer(self, layer: int) -> int:
        if not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise ValueError(f"layer must be an integer in [0, {self.n_layers}), got {layer!r}")
        return layer

    @torch.no_grad()
    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        """Unit-norm random decoders (all targets of a feature together) and unit-norm encoder columns."""
        for s in range(self.n_layers):
            self.W_dec[s].copy_(torch.randn(self.W_dec[s].shape, generator=generator))
            V = torch.randn(self.d_in, self.d_sae, generator=generator)
            self.W_enc[s].copy_(V / V.norm(dim=0, keepdim=True))
        self.normalize_decoder()
        self.b_enc.zero_()
        self.b_dec.zero_()

    # ---- the map, one layer at a time ------------------------------------------------------------
    def pre_acts_layer(self, layer: int, x: Float[Tensor, "*rows d_in"]) -> Float[Tensor, "*rows d_sae"]:
        layer = self._layer(layer)
        return x.to(self.W_enc.dtype) @ self.W_enc[layer] + self.b_enc[layer]

    def activate_layer(self, layer: int, pre: Tensor) -> Tensor:
        if self.activation == "topk":
            return topk_relu(pre, self.cfg.k)
        return pre.relu() * (pre > self.threshold[layer].relu())

    def encode(self, layer: int, x: Float[Tensor, "*rows d_in"]) -> Float[Tensor, "*rows d_sae"]:
        """Source layer ``layer``'s feature activations from that layer's MLP input."""
        return self.activate_layer(layer, self.pre_acts_layer(layer, x))

    def layer_encoder(self, layer: int) -> "CLTLayerEncoder":
        """Source layer ``layer``'s features as a one-hook dictionary (``cfg.hook_name``, ``encode(x)``),
        what the feature analyses (``max_activating_contexts``, ``feature_table``) read."""
        return CLTLayerEncoder(self, self._layer(layer))

    def decoder(self, source: int, target: int) -> Float[Tensor, "d_sae d_out"]:
        """How source layer ``source``'s features write into target layer ``target``'s MLP output."""
        source, target = self._layer(source), self._layer(target)
        if source > target:
            raise ValueError(f"features of layer {source} write only into layers {source}..{self.n_layers - 1}, "
                             f"not into layer {target}")
        return self.W_dec[source][:, target - source]

    def decode(self, target: int, acts_by_source: Sequence[Optional[Tensor]], x_target: Optional[Tensor] = None
               ) -> Float[Tensor, "*rows d_out"]:
        """Target layer ``target``'s MLP output from the activations of source layers ``0..target``.

        ``acts_by_source[s]`` is layer ``s``'s activations (entries past ``target`` are ignored, and may be None);
        a skip-CLT also needs ``x_target``, that layer's MLP input.
        """
        target = self._layer(target)
        if len(acts_by_source) <= target:
            raise ValueError(f"decoding layer {target} needs the activations of layers 0..{target}; "
                             f"got {len(acts_by_source)}")
        out = self.b_dec[target]
        for s in range(target + 1):
            out = out + acts_by_source[s].to(self.b_dec.dtype) @ self.decoder(s, target)
        if self.skip:
            if x_target is None:
                raise ValueError("a skip-CLT's output depends on the target layer's input: pass x_target")
            out = out + x_target.to(self.W_skip.dtype) @ self.W_skip[target].T
        return out

    def forward(self, xs: Sequence[Tensor]) -> list[Tensor]:
        """Every layer's MLP output from every layer's MLP input (lists indexed by layer)."""
        if len(xs) != self.n_layers:
            raise ValueError(f"a CLT over {self.n_layers} layers needs {self.n_layers} inputs, got {len(xs)}")
        acts = [self.encode(s, x) for s, x in enumerate(xs)]
        return [self.decode(t, acts, xs[t]) for t in range(self.n_layers)]

    # ---- the trainer's view: rows that concatenate the layers ------------------------------------
    def _split(self, flat: Tensor, width: int) -> list[Tensor]:
        return list(flat.split(width, dim=-1))

    def pre_acts(self, x: Float[Tensor, "*rows layer_d_in"]) -> Float[Tensor, "*rows layer_d_sae"]:
        return torch.cat([self.pre_acts_layer(s, xs) for s, xs in enumerate(self._split(x, self.d_in))], dim=-1)

    def activate(self, pre: Tensor) -> Tensor:
        return torch.cat([self.activate_layer(s, p) for s, p in enumerate(self._split(pre, self.d_sae))], dim=-1)

    def train_activate(self, pre: Tensor) -> Tensor:
        if self.activation == "topk":
            return self.activate(pre)
        return _JumpReLU.apply(pre, self.threshold.relu().flatten(), self.bandwidth)

    def train_encode(self, pre: Tensor) -> Tensor:
        return self.train_activate(pre)

    def train_decode(self, acts: Tensor, x: Tensor) -> Tensor:
        return self.decode_all(acts, x)

    def decode_all(self, acts: Tensor, x: Optional[Tensor] = None) -> Tensor:
        """Concatenated outputs ``[rows, n_layers * d_out]`` from concatenated activations (one matmul per source)."""
        parts = self._split(acts, self.d_sae)
        rows = acts.shape[:-1]
        out = self.b_dec.expand(*rows, self.n_layers, self.d_out).clone()
        for s, a in enumerate(parts):
            written = a.to(self.b_dec.dtype) @ self.W_dec[s].flatten(1)
            out[..., s:, :] += written.view(*rows, self.n_layers - s, self.d_out)
        if self.skip:
            if x is None:
                raise ValueError("a skip-CLT's output depends on its inputs: pass x")
            xs = x.to(self.W_skip.dtype).view(*rows, self.n_layers, self.d_in)
            out = out + torch.einsum("...li,loi->...lo", xs, self.W_skip)
        return out.flatten(-2)

    def sparsity_loss(self, acts: Tensor, pre: Tensor, coefficient: float) -> dict[str, Tensor]:
        if self.activation == "topk":
            return {}
        l0 = _Step.apply(pre, self.threshold.relu().flatten(), self.bandwidth).sum(-1).mean()
        return {"l0": coefficient * l0}

    @torch.no_grad()
    def after_batch(self, acts: Tensor) -> None:
        """Nothing to track between batches (TopK and JumpReLU have no running statistics)."""

    @torch.no_grad()
    def remove_parallel_grads(self) -> None:
        for W in self.W_dec:
            if W.grad is not None:
                W.grad -= (W.grad * W).sum((1, 2), keepdim=True) * W

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        for W in self.W_dec:
            W /= W.norm(dim=(1, 2), keepdim=True).clamp_min(1e-8)

    @torch.no_grad()
    def init_b_dec(self, y_mean: Tensor) -> None:
        """``b_dec`` at the (scaled) targets' mean, given as ``[n_layers * d_out]``."""
        self.b_dec.copy_(y_mean.view(self.n_layers, self.d_out).to(self.b_dec.device))

    @torch.no_grad()
    def fold_scaling(self, scale_in: Sequence[float], scale_out: Sequence[float]) -> None:
        """Turn a CLT trained on ``x_l * scale_in[l] -> y_l * scale_out[l]`` into one on raw activations.

        The activations stay as trained (thresholds unchanged); each target's decoders, bias and
        skip absorb that target's output scale, so decoders are no longer unit norm afterwards.
        """
        s_in = torch.as_tensor(list(scale_in), dtype=self.W_enc.dtype, device=self.device)
        s_out = torch.as_tensor(list(scale_out), dtype=self.W_enc.dtype, device=self.device)
        self.W_enc.mul_(s_in[:, None, None])
        for s, W in enumerate(self.W_dec):
            W.div_(s_out[s:][None, :, None])
        self.b_dec.div_(s_out[:, None])
        if self.skip:
            self.W_skip.mul_((s_in / s_out)[:, None, None])

    # ---- splicing and metrics -------------------------------------------------------------------
    def splice(self, model, error_term: bool = False, hook: Optional[str] = None):
        """Replace every MLP output of ``model`` by this CLT (``splice.add_clt``; what ``model.add_sae`` calls)."""
        from workbench.analysis.splice import add_sae

        return add_sae(model, self, error_term=error_term, hook=hook)

    def unsplice(self, model, which: Union[str, nn.Module, None] = None) -> None:
        from workbench.analysis.splice import remove_sae

        remove_sae(model, which)

    def __repr__(self) -> str:
        k = f", k={self.cfg.k}" if self.activation == "topk" else ""
        skip = ", skip" if self.skip else ""
        return (f"CrossLayerTranscoder(n_layers={self.n_layers}, d_in={self.d_in}, d_sae={self.d_sae}, "
                f"d_out={self.d_out}, {self.activation}{k}{skip})")


# ---- on disk ------------------------------------------------------------------------------------
class CLTLayerEncoder(nn.Module):
    """One source layer of a CLT seen as an encoder-only dictionary at ``blocks.{layer}.ln2.hook_normalized``."""

    def __init__(self, clt: CrossLayerTranscoder, layer: int):
        super().__init__()
        self.clt, self.layer = clt, layer
        self.cfg = clt.cfg.replace(hook_name=clt.hook_in(layer), hook_name_out=clt.hook_out(layer))

    @property
    def device(self) -> torch.device:
        return self.clt.device

    def encode(self, x: Float[Tensor, "*rows d_in"]) -> Float[Tensor, "*rows d_sae"]:
        return self.clt.encode(self.layer, x)


def save_clt(clt: CrossLayerTranscoder, path: Union[str, Path], extra_meta: Optional[dict] = None, *,
             overwrite: bool = False) -> Path:
    """Write ``clt.json`` and ``clt.safetensors`` into the folder ``path`` (``write_atomic``). A folder
    inside a checkpoint (``<checkpoint>/saes/NAME``) is recorded in its meta.json, as a dictionary is.
    Files of those names are replaced only when they are a CLT the workbench saved (``clt.json``'s
    format); any other raises DictionaryError, nothing written, unless ``overwrite=True``."""
    from workbench.analysis.dictionaries.saelens import (DictionaryError, _DTYPES, _folder, _json_default,
                                                         _record_in_checkpoint)
    from workbench.overwrite import refuse_foreign, write_atomic

    path = _folder(path)
    refuse_foreign([path / WEIGHTS_FILE, path / CONFIG_FILE], lambda _: is_our_clt(path), overwrite=overwrite,
                   what=f"saving a cross-layer transcoder into {path}", error=DictionaryError)
    path.mkdir(parents=True, exist_ok=True)
    dtype = _DTYPES[clt.cfg.dtype]
    tensors = {_file_name(name): p.detach().to("cpu", dtype).contiguous() for name, p in clt.named_parameters()}
    meta = {"format": CLT_FORMAT, "version": 1, "config": clt.cfg.to_dict(), "metrics": clt.metrics,
            **(extra_meta or {})}
    write_atomic(path / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp)))
    write_atomic(path / CONFIG_FILE, json.dumps(meta, indent=1, default=_json_default))
    _record_in_checkpoint(path)  # inside a checkpoint: a save of new weights there drops it, as an SAE's
    return path


def is_our_clt(path: Union[str, Path]) -> bool:
    """Whether folder ``path`` holds a CLT the workbench saved (``clt.json``'s format says so)."""
    from workbench.overwrite import is_json_with

    return is_json_with(Path(path) / CONFIG_FILE, format=CLT_FORMAT)


def load_clt(path: Union[str, Path], device: Union[str, torch.device] = "cpu") -> CrossLayerTranscoder:
    """A CLT from a folder ``save_clt`` wrote."""
    from workbench.analysis.dictionaries.saelens import DictionaryError

    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise DictionaryError(f"{path} is not a CLT folder: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        meta = json.loads((path / CONFIG_FILE).read_text())
        raw = dict(meta["config"])
        raw["hook_shape"] = tuple(raw.get("hook_shape") or ())
        cfg = DictionaryConfig(**raw)
        clt = CrossLayerTranscoder(cfg)
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise DictionaryError(f"{path / CONFIG_FILE} is not a valid CLT config ({e})") from None
    try:
        state = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise DictionaryError(f"{path / WEIGHTS_FILE} is corrupt ({e})") from None
    expected = {_file_name(n): p for n, p in clt.named_parameters()}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise DictionaryError(f"{path / WEIGHTS_FILE} lacks {missing}")
    with torch.no_grad():
        for name, p in expected.items():
            if tuple(state[name].shape) != tuple(p.shape):
                raise DictionaryError(f"{path / WEIGHTS_FILE}: {name} has shape {tuple(state[name].shape)}, "
                                      f"but {CONFIG_FILE} needs {tuple(p.shape)}")
            p.copy_(state[name].float())
    clt.metrics = dict(meta.get("metrics", {}))
    clt.meta = meta
    return clt.to(device)


def is_clt_folder(path: Union[str, Path]) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def _file_name(param_name: str) -> str:
    return param_name.replace("W_dec.", "W_dec_")  # ParameterList entries: W_dec.0 -> W_dec_0
