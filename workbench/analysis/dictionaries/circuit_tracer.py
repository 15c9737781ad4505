"""Transcoders and CLTs in circuit-tracer's on-disk format (0.5.x), both ways.

    save_circuit_tracer([tc0, tc1, tc2], "ct/tcs", model=model)     # a transcoder set, one per MLP
    save_circuit_tracer(clt, "ct/clt", model=model)                 # a cross-layer transcoder
    load_circuit_tracer("ct/tcs", model=model)                      # -> list of transcoders, or a CLT

The folder is what circuit-tracer's cache holds (``utils/caching.py``) and its loaders read:
``config.yaml`` (``model_kind`` ``transcoder_set`` or ``cross_layer_transcoder``,
``feature_input_hook`` ``mlp.hook_in``, ``feature_output_hook`` ``mlp.hook_out``, ``scan``) and

- a transcoder set: ``layer_{l}.safetensors`` per layer (``load_relu_transcoder``): ``W_enc``
  ``[d_sae, d_model]`` (applied as ``F.linear``, so ours transposed), ``W_dec`` ``[d_sae, d_model]``,
  ``b_enc``, ``b_dec``, ``W_skip`` ``[d_model, d_model]`` (``x @ W_skip.T``, as ours) and, for JumpReLU,
  ``activation_function.threshold``;
- a CLT (``load_clt``): ``W_enc_{l}.safetensors`` with ``W_enc_{l}`` ``[d_sae, d_model]``, ``b_enc_{l}``,
  ``b_dec_{l}`` (and ``threshold_{l}``), and ``W_dec_{l}.safetensors`` with ``W_dec_{l}``
  ``[d_sae, n_layers - l, d_model]``, the layout ours keeps.

Where the two differ, and what is done about it:
- circuit-tracer's features read ``mlp.hook_in``, the MLP's input after the norm's weight; ours
  read ``ln2.hook_normalized``, before it. With ``model=`` the norm weights are folded into the
  encoders (and skips) on the way out and taken out again on the way in; without it the files
  assume a norm with no weight (circuit-tracer's ``RMSPre``, or a model whose norms are folded).
- Its files hold ReLU and JumpReLU activations only. A TopK transcoder is written with its ``k``
  in ``config.yaml`` (``activation: topk``), which circuit-tracer's loader ignores: build its
  ``SingleLayerTranscoder(..., TopK(k), ...)`` from the file, as its own tests build TopK ones.
- Its CLT files have no skip connection and no TopK: such CLTs are refused with a ValueError.
- Its JumpReLU is ``pre * (pre > threshold)``; ours is ``relu(pre) * (pre > relu(threshold))``:
  equal for the non-negative thresholds written here; negative ones are refused on the way in.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from workbench.analysis.dictionaries.base import DictionaryConfig
from workbench.analysis.dictionaries.clt import HOOK_IN, HOOK_OUT, CrossLayerTranscoder, clt_config
from workbench.analysis.dictionaries.saelens import DictionaryError
from workbench.analysis.dictionaries.transcoder import SkipTranscoder, Transcoder
from workbench.overwrite import write_atomic

CONFIG_FILE = "config.yaml"
INPUT_HOOK, OUTPUT_HOOK = "mlp.hook_in", "mlp.hook_out"  # circuit-tracer's names, relative to blocks.{l}


def _norm_weights(model, n_layers: int, d_in: int) -> Tensor:
    """``[n_layers, d_in]``: each layer's ln2 weight (ones without a model)."""
    if model is None:
        return torch.ones(n_layers, d_in)
    if model.cfg.n_layers != n_layers:
        raise ValueError(f"the transcoders cover {n_layers} layers but the model has {model.cfg.n_layers}")
    w = torch.stack([model.blocks[layer].ln2.w.detach().float().cpu() for layer in range(n_layers)])
    if (w == 0).any():
        raise ValueError("a norm weight is exactly 0: the features cannot be moved across it; save with model=None")
    return w


def save_circuit_tracer(dictionaries: Union[CrossLayerTranscoder, Sequence[Transcoder]], path: Union[str, Path],
                        model=None, scan: str = "", dtype: torch.dtype = torch.float32, *,
                        overwrite: bool = False) -> Path:
    """Write a transcoder set (one per layer, in layer order) or a CLT as circuit-tracer's files.

    Beside them a ``workbench.json`` manifest lists the files written: a later export replaces those,
    and a file of one of those names that no export of ours wrote (circuit-tracer's own download, a
    user's ``config.yaml``) raises DictionaryError, nothing written, unless ``overwrite=True``."""
    from workbench.analysis.dictionaries.saelens import _folder
    from workbench.checkpoint import MANIFEST_FILE, owned_files
    from workbench.overwrite import refuse_foreign

    path = _folder(path)
    if isinstance(dictionaries, CrossLayerTranscoder):
        names = [f"{w}_{layer}.safetensors" for layer in range(dictionaries.n_layers) for w in ("W_enc", "W_dec")]
    else:
        dictionaries = list(dictionaries)
        names = [f"layer_{layer}.safetensors" for layer in range(len(dictionaries))]
    names.append(CONFIG_FILE)
    owned = (owned_files(path) if path.is_dir() else None) or frozenset()
    refuse_foreign([path / n for n in [*names, MANIFEST_FILE]], lambda p: p.name in owned, overwrite=overwrite,
                   what=f"exporting circuit-tracer files into {path}", error=DictionaryError)
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(dictionaries, CrossLayerTranscoder):
        config = _save_clt(dictionaries, path, model, dtype)
    else:
        config = _save_set(dictionaries, path, model, dtype)
    config.update(feature_input_hook=INPUT_HOOK, feature_output_hook=OUTPUT_HOOK, scan=scan or path.name)
    # JSON is YAML: circuit-tracer's yaml.safe_load reads it, and nothing here needs a YAML writer.
    write_atomic(path / CONFIG_FILE, json.dumps(config, indent=1))
    files = sorted({*names, *(n for n in owned if n != MANIFEST_FILE and (path / n).is_file())})
    write_atomic(path / MANIFEST_FILE, json.dumps({"format": "workbench.circuit_tracer", "files": files}, indent=1))
    return path


def _save_set(transcoders: list, path: Path, model, dtype: torch.dtype) -> dict:
    if not transcoders or not all(getattr(t, "is_transcoder", False) and not getattr(t, "cross_layer", False)
                                  for t in transcoders):
        raise ValueError("save_circuit_tracer needs a CrossLayerTranscoder or a list of per-layer transcoders, "
                         "one per MLP in layer order")
    for layer, tc in enumerate(transcoders):
        want = (HOOK_IN.format(l=layer), HOOK_OUT.format(l=layer))
        if (tc.cfg.hook_name, tc.cfg.hook_name_out) != want:
            raise ValueError(f"transcoder {layer} reads {tc.cfg.hook_name!r} and writes {tc.cfg.hook_name_out!r}; "
                             f"circuit-tracer's layer {layer} needs {want[0]!r} -> {want[1]!r}")
    w = _norm_weights(model, len(transcoders), transcoders[0].cfg.d_in)
    names = []
    for layer, tc in enumerate(transcoders):
        tensors = {"W_enc": tc.W_enc.detach().float().cpu().T / w[layer], "W_dec": tc.W_dec.detach().float().cpu(),
                   "b_enc": tc.b_enc.detach().float().cpu(), "b_dec": tc.b_dec.detach().float().cpu()}
        if hasattr(tc, "W_skip"):
            tensors["W_skip"] = tc.W_skip.detach().float().cpu() / w[layer]
        name = f"layer_{layer}.safetensors"
        write_atomic(path / name, lambda tmp, t=tensors: save_file({k: v.to(dtype).contiguous() for k, v in t.items()},
                                                                   str(tmp)))
        names.append(name)
    config = {"model_kind": "transcoder_set", "transcoders": [str((path / n).resolve()) for n in names]}
    ks = {int(tc.cfg.k) for tc in transcoders}
    if ks != {0}:
        if len(ks) != 1 or 0 in ks:
            raise ValueError(f"the transcoders mix activations (k = {sorted(ks)}); one set has one activation")
        config.update(activation="topk", k=ks.pop())
    return config


def _save_clt(clt: CrossLayerTranscoder, path: Path, model, dtype: torch.dtype) -> dict:
    if clt.skip:
        raise ValueError("circuit-tracer's CLT files hold no skip connection (its to_safetensors and load_clt "
                         "drop W_skip): this skip-CLT cannot be written in its format")
    if clt.activation != "jumprelu":
        raise ValueError("circuit-tracer's CLTs are ReLU or JumpReLU: a TopK CLT cannot be written in its format")
    if clt.d_in != clt.d_out:
        raise ValueError("circuit-tracer's CLTs read and write d_model: d_in must equal d_out")
    w = _norm_weights(model, clt.n_layers, clt.d_in)
    for layer in range(clt.n_layers):
        enc = {f"W_enc_{layer}": clt.W_enc[layer].detach().float().cpu().T / w[layer],
               f"b_enc_{layer}": clt.b_enc[layer].detach().float().cpu(),
               f"b_dec_{layer}": clt.b_dec[layer].detach().float().cpu(),
               f"threshold_{layer}": clt.threshold[layer].detach().float().cpu().relu()}
        dec = {f"W_dec_{layer}": clt.W_dec[layer].detach().float().cpu()}
        for name, tensors in ((f"W_enc_{layer}.safetensors", enc), (f"W_dec_{layer}.safetensors", dec)):
            write_atomic(path / name, lambda tmp, t=tensors: save_file({k: v.to(dtype).contiguous()
                                                                        for k, v in t.items()}, str(tmp)))
    return {"model_kind": "cross_layer_transcoder"}


def load_circuit_tracer(path: Union[str, Path], model=None) -> Union[CrossLayerTranscoder, list[Transcoder]]:
    """A transcoder set (a list, one per layer) or a CLT from circuit-tracer's files (``model=``: see above)."""
    path = Path(path)
    config = _read_config(path)
    kind = config.get("model_kind")
    try:
        if kind == "transcoder_set":
            return _load_set(path, config, model)
        if kind == "cross_layer_transcoder":
            return _load_clt(path, model)
    except (SafetensorError, OSError, RuntimeError, KeyError) as e:
        raise DictionaryError(f"{path}: circuit-tracer files missing or corrupt ({e})") from None
    raise DictionaryError(f"{path / CONFIG_FILE}: model_kind {kind!r} is neither transcoder_set nor cross_layer_transcoder")


def _read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise DictionaryError(f"{path} is not a circuit-tracer transcoder folder: it has no {CONFIG_FILE}")
    text = file.read_text()
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        try:
            import yaml
        except ImportError:  # pragma: no cover - PyYAML comes with the hub libraries
            raise DictionaryError(f"{file} is YAML: install PyYAML to read it") from None
        try:
            config = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise DictionaryError(f"{file} is not valid YAML ({e})") from None
    if not isinstance(config, dict):
        raise DictionaryError(f"{file} must hold a mapping")
    for key, want in (("feature_input_hook", INPUT_HOOK), ("feature_output_hook", OUTPUT_HOOK)):
        if config.get(key, want) != want:
            raise DictionaryError(f"{file}: {key} is {config[key]!r}; the workbench maps only {want!r} "
                                  "(the MLP's input and output) onto its hooks")
    return config


def _load_set(path: Path, config: dict, model) -> list[Transcoder]:
    files = [Path(p) for p in config.get("transcoders", [])] or sorted(
        path.glob("layer_*.safetensors"), key=lambda f: int(f.stem.split("_")[1]))
    files = [f if f.is_absolute() and f.is_file() else path / f.name for f in files]
    if not files:
        raise DictionaryError(f"{path} holds no layer_*.safetensors")
    k = int(config.get("k", 0)) if config.get("activation") == "topk" else 0
    states = [load_file(str(f)) for f in files]
    d_sae, d_in = states[0]["W_enc"].shape
    w = _norm_weights(model, len(states), d_in)
    out = []
    for layer, state in enumerate(states):
        if "activation_function.threshold" in state:
            raise DictionaryError(f"{files[layer]} is a JumpReLU transcoder; the workbench's per-layer transcoders "
                                  "are ReLU or TopK")
        skip = "W_skip" in state
        cfg = DictionaryConfig(kind="skip_transcoder" if skip else "transcoder", d_in=d_in, d_sae=d_sae,
                               d_out=int(state["b_dec"].shape[0]), k=k, hook_name=HOOK_IN.format(l=layer),
                               hook_name_out=HOOK_OUT.format(l=layer))
        tc = (SkipTranscoder if skip else Transcoder)(cfg)
        with torch.no_grad():
            tc.W_enc.copy_((state["W_enc"].float() * w[layer]).T)
            tc.W_dec.copy_(state["W_dec"].float())
            tc.b_enc.copy_(state["b_enc"].float())
            tc.b_dec.copy_(state["b_dec"].float())
            if skip:
                tc.W_skip.copy_(state["W_skip"].float() * w[layer])
        out.append(tc.eval())
    return out


def _load_clt(path: Path, model) -> CrossLayerTranscoder:
    n_layers = len(list(path.glob("W_enc_*.safetensors")))
    if n_layers == 0:
        raise DictionaryError(f"{path} holds no W_enc_*.safetensors")
    enc = [load_file(str(path / f"W_enc_{layer}.safetensors")) for layer in range(n_layers)]
    dec = [load_file(str(path / f"W_dec_{layer}.safetensors")) for layer in range(n_layers)]
    d_sae, d_in = enc[0]["W_enc_0"].shape
    w = _norm_weights(model, n_layers, d_in)
    clt = CrossLayerTranscoder(clt_config(n_layers, d_in, d_sae, d_in))
    with torch.no_grad():
        for layer in range(n_layers):
            e = enc[layer]
            clt.W_enc[layer].copy_((e[f"W_enc_{layer}"].float() * w[layer]).T)
            clt.b_enc[layer].copy_(e[f"b_enc_{layer}"].float())
            clt.b_dec[layer].copy_(e[f"b_dec_{layer}"].float())
            threshold = e.get(f"threshold_{layer}", torch.zeros(d_sae)).float()  # ReLU: a zero threshold
            if (threshold < 0).any():
                raise DictionaryError(f"{path}: layer {layer} has negative JumpReLU thresholds, which circuit-tracer "
                                      "lets pass negative activations; the workbench's JumpReLU cannot")
            clt.threshold[layer].copy_(threshold)
            clt.W_dec[layer].copy_(dec[layer][f"W_dec_{layer}"].float())
    return clt.eval()
