"""Dictionaries on disk in SAELens' format, so they move both ways between SAELens and the workbench.

    saes/NAME/cfg.json                  SAELens 6.x config (architecture, d_in, d_sae, metadata.hook_name, ...)
    saes/NAME/sae_weights.safetensors   W_enc [d_in, d_sae], b_enc, W_dec [d_sae, d_out], b_dec (+ threshold, W_skip)
    saes/NAME/sae_meta.json             ours: the kind, metrics, training settings (SAELens ignores it)

SAELens (6.x) cannot be installed beside TransformerLens 4 (it pins transformer-lens < 4), so
the schema is matched by hand: ``SAEConfig.to_dict`` writes ``d_in d_sae dtype device
apply_b_dec_to_input normalize_activations reshape_activations metadata architecture`` plus
``k`` (and ``rescale_acts_by_decoder_norm``) for ``topk`` and ``d_out`` for transcoders, and its
loader reads ``metadata.sae_lens_version`` to decide between the 6.x layout and the older flat one
(``hook_point``/``hook_name`` at the top level, ``activation_fn_kwargs.k``). We write 6.x and read
both. BatchTopK is written as SAELens writes it, a ``jumprelu`` with its threshold.

TopK transcoders have no SAELens form: SAELens 6.x (checked to 6.54) registers ``transcoder``,
``skip_transcoder`` and their JumpReLU twins, all without a ``k``, so a TopK (skip-)transcoder
written as ``transcoder`` loads there as ReLU and gives other outputs (a TopK is no JumpReLU either:
its threshold differs per token). Its cfg.json names ``topk_transcoder`` / ``topk_skip_transcoder``
with ``k`` at the top level, as SAELens' ``topk`` keeps it: SAELens refuses an architecture it has
not registered (a KeyError naming it) instead of misreading the file, and a class registered under
that name (``sae_lens.register_sae_class``) loads it. Saving one warns; loading one of the
``transcoder`` files written before warns too (it loads here as TopK, from ``sae_meta.json``).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from workbench.analysis.dictionaries.base import Dictionary, DictionaryConfig
from workbench.analysis.dictionaries.clt import CrossLayerTranscoder
from workbench.analysis.dictionaries.registry import DICTIONARIES, FROM_SAELENS, TOPK_TRANSCODER_ARCHITECTURES
from workbench.overwrite import is_json_with, refuse_foreign, write_atomic
from workbench.utils import check_path

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
META_FILE = "sae_meta.json"
DICTIONARY_FORMAT = "workbench-dictionary"  # sae_meta.json's mark: a dictionary the workbench saved
# The schema version SAELens' loader keys on: from 6.0 the hook and model live under "metadata".
SAELENS_SCHEMA_VERSION = "6.0.0"
IDENTITY_KEY = "workbench.dictionary"  # the safetensors metadata entry: hook, shape, widths, fingerprint
_DTYPES = {"float32": torch.float32, "torch.float32": torch.float32, "bfloat16": torch.bfloat16,
           "torch.bfloat16": torch.bfloat16, "float16": torch.float16, "torch.float16": torch.float16}


class DictionaryError(ValueError):
    """A dictionary folder is missing, corrupt, or in a form the workbench cannot reproduce exactly."""


def saelens_config(sae: Dictionary, context_size: Optional[int] = None) -> dict[str, Any]:
    """The ``cfg.json`` SAELens 6.x writes for this dictionary."""
    c = sae.cfg
    metadata = {
        "sae_lens_version": SAELENS_SCHEMA_VERSION,
        "sae_lens_training_version": SAELENS_SCHEMA_VERSION,
        "model_name": c.model_name or None,
        "hook_name": c.hook_name or None,
        "hook_head_index": None,
        # whether the training text began with a BOS: the model's tokenizer's own choice, recorded by the
        # activation source; False when unknown, the workbench's default (ModelConfig.default_prepend_bos)
        "prepend_bos": bool(c.extra.get("prepend_bos", False)),
        "context_size": context_size,
    }
    if sae.is_transcoder:
        metadata["hook_name_out"] = c.hook_name_out or None
    cfg = {
        "d_in": c.d_in,
        "d_sae": c.d_sae,
        "dtype": c.dtype,
        "device": "cpu",
        "apply_b_dec_to_input": bool(c.apply_b_dec_to_input),
        "normalize_activations": "none",
        "reshape_activations": "hook_z" if c.hook_name.endswith("hook_z") else "none",
        "metadata": metadata,
        "architecture": sae.architecture,
    }
    if sae.architecture == "topk":
        cfg.update(k=int(c.k), rescale_acts_by_decoder_norm=False)
    if sae.is_transcoder:
        cfg["d_out"] = c.d_out
        if c.k:  # no SAELens class: a name it refuses, not "transcoder", which it would read as ReLU
            cfg.update(architecture=TOPK_TRANSCODER_ARCHITECTURES[sae.architecture], k=int(c.k))
    return cfg


NO_SAELENS_TOPK_TRANSCODER = (
    "SAE Lens 6.x has no TopK transcoder class: it reads a cfg.json that says 'transcoder' or 'skip_transcoder' "
    "as a ReLU transcoder and gives other outputs. The workbench writes architecture 'topk_transcoder' / "
    "'topk_skip_transcoder' with k in cfg.json, which SAE Lens refuses unless a class is registered under that "
    "name (sae_lens.register_sae_class); docs/reference/dictionaries.md shows one")


def save_dictionary(sae: Union[Dictionary, CrossLayerTranscoder], path: Union[str, Path], extra_meta: Optional[dict] = None,
                    context_size: Optional[int] = None, *, overwrite: bool = False) -> Path:
    """Write ``cfg.json``, ``sae_weights.safetensors`` and ``sae_meta.json`` into ``path`` (``write_atomic``: a file
    already there is replaced by rename).

    A cross-layer transcoder has no SAELens form: it is written as ``clt.json`` + ``clt.safetensors``.
    Files of those names are replaced only when they are a dictionary the workbench wrote (its
    ``sae_meta.json``); any other (a SAELens download, a user's file) raises DictionaryError, nothing
    written, unless ``overwrite=True``. A CLT the workbench saved in the folder goes, since the folder
    would load as that CLT.
    """
    if getattr(sae, "cross_layer", False):
        from workbench.analysis.dictionaries.clt import save_clt

        return save_clt(sae, path, extra_meta=extra_meta, overwrite=overwrite)
    from workbench.analysis.dictionaries.clt import CONFIG_FILE as CLT_CONFIG, WEIGHTS_FILE as CLT_WEIGHTS
    from workbench.analysis.dictionaries.clt import is_our_clt

    path = _folder(path)
    clt_files = [path / CLT_CONFIG, path / CLT_WEIGHTS]
    refuse_foreign([path / n for n in (WEIGHTS_FILE, CFG_FILE, META_FILE)], lambda _: is_our_dictionary(path),
                   overwrite=overwrite, what=f"saving a dictionary into {path}", error=DictionaryError)
    refuse_foreign(clt_files, lambda _: is_our_clt(path), overwrite=overwrite,
                   what=f"saving a dictionary into {path} (it holds a cross-layer transcoder)", error=DictionaryError)
    if sae.is_transcoder and sae.cfg.k:
        warnings.warn(f"saving a TopK transcoder: {NO_SAELENS_TOPK_TRANSCODER}", stacklevel=2)
    path.mkdir(parents=True, exist_ok=True)
    dtype = _DTYPES[sae.cfg.dtype]
    tensors = {name: p.detach().to("cpu", dtype).contiguous() for name, p in sae.named_parameters()}
    if "threshold" in dict(sae.named_buffers()):
        tensors["threshold"] = sae.threshold.detach().to("cpu", dtype).contiguous()
    meta = {"format": DICTIONARY_FORMAT, "version": 1, "config": sae.cfg.to_dict(), "metrics": sae.metrics,
            **(extra_meta or {})}
    # What the weights were trained on, inside the weights file itself: cfg.json (SAELens') is plain
    # text a hand can edit to another hook of the same width, and load_dictionary compares the two.
    identity = {"format": "pt", IDENTITY_KEY: json.dumps(_identity(sae.cfg), sort_keys=True)}
    write_atomic(path / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata=identity))
    write_atomic(path / CFG_FILE, json.dumps(saelens_config(sae, context_size), indent=1))
    write_atomic(path / META_FILE, json.dumps(meta, indent=1, default=_json_default))
    for stale in clt_files:  # the folder now holds this dictionary, not the CLT saved there before
        stale.unlink(missing_ok=True)
    _record_in_checkpoint(path)
    return path


def is_our_dictionary(path: Union[str, Path]) -> bool:
    """Whether folder ``path`` holds a dictionary the workbench saved (its ``sae_meta.json`` says so)."""
    return is_json_with(Path(path) / META_FILE, format=DICTIONARY_FORMAT)


def _folder(path: Union[str, Path]) -> Path:
    """``path`` as a Path to a folder that is or can be made, or DictionaryError."""
    try:
        path = check_path(path, "dictionary folder")
    except ValueError as e:
        raise DictionaryError(str(e)) from None
    if os.path.lexists(path) and not path.is_dir():
        raise DictionaryError(f"{path} exists and is not a folder: a dictionary is saved as a folder; choose "
                              "another path")
    return path


def _identity(cfg: DictionaryConfig) -> dict[str, Any]:
    return {"hook_name": cfg.hook_name, "hook_name_out": cfg.hook_name_out, "hook_shape": list(cfg.hook_shape),
            "d_in": cfg.d_in, "d_out": cfg.d_out, "d_sae": cfg.d_sae, "model_fingerprint": cfg.model_fingerprint}


def _record_in_checkpoint(path: Path) -> None:
    """A dictionary saved inside a checkpoint (``<checkpoint>/saes/NAME``) joins the files its
    meta.json lists, as a tuned lens does: re-saving the checkpoint with new weights drops it,
    instead of carrying a dictionary of the old weights into the new model's folder."""
    from workbench.checkpoint import locked, owned_files, record_files

    for parent in list(path.resolve().parents)[:3]:
        if (parent / "meta.json").is_file() and owned_files(parent) is not None:
            with locked(parent):
                record_files(parent, [path.resolve().relative_to(parent).as_posix() + "/"])
            return


def _check_identity(path: Path, cfg: DictionaryConfig, meta: dict) -> None:
    """DictionaryError when cfg.json names another hook or hook shape than the weights (or our
    sae_meta.json) recorded at save time: the Features page would compute on the wrong activations."""
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            recorded = json.loads((f.metadata() or {}).get(IDENTITY_KEY) or "null")
    except (SafetensorError, OSError, ValueError):
        recorded = None  # a corrupt file: load_file says so below
    if not isinstance(recorded, dict):  # an older save or SAELens' own file: our sae_meta.json, if any
        recorded = meta.get("config") if isinstance(meta.get("config"), dict) else {}
    mine = _identity(cfg)
    for key in ("hook_name", "hook_name_out", "hook_shape"):  # the widths: _load_state checks them against the weights
        theirs = recorded.get(key)
        if key == "hook_shape" and theirs in (None, []):
            continue
        if theirs is not None and theirs != "" and theirs != mine[key]:
            raise DictionaryError(
                f"{path}: {CFG_FILE} says {key}={mine[key]!r}, but these weights were saved for {key}={theirs!r}: "
                f"{CFG_FILE} was edited or belongs to another dictionary; restore the {CFG_FILE} saved with them")


def load_dictionary(path: Union[str, Path], device: Union[str, torch.device] = "cpu"
                    ) -> Union[Dictionary, CrossLayerTranscoder]:
    """A dictionary from a folder in SAELens' format (ours, or one SAELens wrote), or a CLT folder."""
    from workbench.analysis.dictionaries.clt import is_clt_folder, load_clt

    path = Path(path)
    if is_clt_folder(path):
        return load_clt(path, device)
    if not (path / CFG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise DictionaryError(f"{path} is not a dictionary folder: it needs {CFG_FILE} and {WEIGHTS_FILE}")
    try:
        raw = json.loads((path / CFG_FILE).read_text())
        meta = json.loads((path / META_FILE).read_text()) if (path / META_FILE).is_file() else {}
    except (OSError, json.JSONDecodeError) as e:
        raise DictionaryError(f"{path}: {CFG_FILE} or {META_FILE} is not valid JSON ({e})") from None
    cfg = config_from_saelens(raw, meta)
    _check_identity(path, cfg, meta if isinstance(meta, dict) else {})
    try:
        state = load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise DictionaryError(f"{path / WEIGHTS_FILE} is corrupt ({e})") from None
    # Before the module is built: it allocates [d_in, d_sae] from cfg.json, so a width the weights do not
    # have (d_in = 2**63 from a damaged file) raised a TypeError inside torch, or asked for the RAM.
    enc = state.get("W_enc")
    if enc is None:
        raise DictionaryError(f"{path / WEIGHTS_FILE} lacks ['W_enc'] (every dictionary kind has one)")
    if tuple(enc.shape) != (cfg.d_in, cfg.d_sae):
        raise DictionaryError(f"{path / WEIGHTS_FILE}: W_enc has shape {tuple(enc.shape)}, but cfg.json "
                              f"(d_in={cfg.d_in}, d_sae={cfg.d_sae}) needs {(cfg.d_in, cfg.d_sae)}")
    sae = DICTIONARIES[cfg.kind](cfg)
    _load_state(sae, state, raw, path)
    sae.metrics = dict(meta.get("metrics", {}))
    sae.meta = meta
    return sae.to(device)


def config_from_saelens(raw: dict, meta: Optional[dict] = None) -> DictionaryConfig:
    """Our DictionaryConfig from a SAELens ``cfg.json`` (6.x or the older flat layout)."""
    if not isinstance(raw, dict):
        raise DictionaryError("cfg.json must hold a JSON object")
    metadata = raw.get("metadata") or raw.get("meta") or {}
    if not isinstance(metadata, dict):
        raise DictionaryError("cfg.json's metadata must be a JSON object")
    flat = {**raw, **{k: v for k, v in metadata.items() if v is not None}}
    architecture = raw.get("architecture", "standard")
    if architecture not in FROM_SAELENS:
        raise DictionaryError(f"SAELens architecture {architecture!r} is not supported here; "
                              f"supported: {sorted(FROM_SAELENS)}")
    kind = FROM_SAELENS[architecture]
    ours = (meta or {}).get("config", {})
    if architecture in TOPK_TRANSCODER_ARCHITECTURES.values() and not isinstance(raw.get("k"), int):
        raise DictionaryError(f"cfg.json says architecture {architecture!r} but has no integer 'k' (got "
                              f"{raw.get('k')!r}): a TopK transcoder needs its k")
    if architecture == "jumprelu" and ours.get("kind") in ("batchtopk", "matryoshka_batchtopk"):
        kind = ours["kind"]
    norm = raw.get("normalize_activations") or "none"
    if norm not in ("none", False):
        raise DictionaryError(f"normalize_activations={norm!r} needs a dataset norm the file does not hold; "
                              "fold it into the weights first (SAELens: fold_activation_norm_scaling_factor)")
    activation = flat.get("activation_fn", flat.get("activation_fn_str", "relu"))
    if architecture in ("standard", "transcoder", "skip_transcoder") and activation not in ("relu", None):
        raise DictionaryError(f"activation_fn={activation!r} is not supported (ReLU only for {architecture})")
    k = raw.get("k", (flat.get("activation_fn_kwargs") or {}).get("k", ours.get("k", 0)))
    for key in ("d_in", "d_sae"):
        if not isinstance(raw.get(key), int) or raw[key] < 1:
            raise DictionaryError(f"cfg.json needs a positive integer {key!r}, got {raw.get(key)!r}")
    if architecture in TOPK_TRANSCODER_ARCHITECTURES and k:
        source = "cfg.json" if "k" in raw else "sae_meta.json"
        warnings.warn(f"loaded a TopK transcoder from a cfg.json that says {architecture!r} (k={k} from {source}; "
                      f"save_dictionary rewrites it as {TOPK_TRANSCODER_ARCHITECTURES[architecture]!r}): "
                      f"{NO_SAELENS_TOPK_TRANSCODER}", stacklevel=3)
    hook = flat.get("hook_name") or flat.get("hook_point") or ""
    return DictionaryConfig(
        kind=kind, d_in=raw["d_in"], d_sae=raw["d_sae"], d_out=int(raw.get("d_out") or 0), k=k or 0,
        hook_name=hook, hook_name_out=flat.get("hook_name_out") or ours.get("hook_name_out", ""),
        hook_shape=tuple(ours.get("hook_shape") or ()), model_name=flat.get("model_name") or "",
        model_fingerprint=ours.get("model_fingerprint", ""),
        apply_b_dec_to_input=bool(raw.get("apply_b_dec_to_input", kind not in ("transcoder", "skip_transcoder"))),
        dtype=str(raw.get("dtype", "float32")).replace("torch.", ""), extra=dict(ours.get("extra", {})),
    )


def _load_state(sae: Dictionary, state: dict, raw: dict, path: Path) -> None:
    state = {k: v.float() for k, v in state.items()}
    if "log_threshold" in state:  # SAELens' older JumpReLU checkpoints
        state["threshold"] = state.pop("log_threshold").exp()
    ones = state.pop("scaling_factor", None)
    if ones is not None and not torch.allclose(ones, torch.ones_like(ones)):
        raise DictionaryError(f"{path} has a finetuning scaling_factor; fold it into W_dec first")
    expected = {name: tuple(t.shape) for name, t in list(sae.named_parameters()) + list(sae.named_buffers())}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise DictionaryError(f"{path / WEIGHTS_FILE} lacks {missing} (a {sae.architecture} needs {sorted(expected)})")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise DictionaryError(f"{path / WEIGHTS_FILE}: {name} has shape {tuple(state[name].shape)}, "
                                  f"but cfg.json (d_in={sae.cfg.d_in}, d_sae={sae.cfg.d_sae}) needs {shape}")
    with torch.no_grad():
        if raw.get("rescale_acts_by_decoder_norm"):  # SAELens' topk: fold the decoder norms in (its own rule)
            norms = state["W_dec"].norm(dim=-1).clamp_min(1e-8)
            state["b_enc"] = state["b_enc"] * norms
            state["W_enc"] = state["W_enc"] * norms
            state["W_dec"] = state["W_dec"] / norms[:, None]
        for name in expected:
            dict(list(sae.named_parameters()) + list(sae.named_buffers()))[name].copy_(state[name])


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    return str(value)
