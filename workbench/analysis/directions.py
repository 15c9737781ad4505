"""Directions in activation space: one object for "a vector at a hook", steering with it, reading along it.

A ``Direction`` is a vector at a hook point (``[width]``, or ``[pos, width]`` for one vector per
absolute position) with its provenance: contrastive means (``steering_vector``), a probe
(``Probe.direction``), an SAE feature's decoder row, the difference of two prompts
(``Direction.from_prompts``) or a weight row (``Direction.from_weight``). It is saved as
safetensors (the vector) + JSON (hook, provenance), never pickled.

Steering edits the activation ``x`` at the hook, at chosen absolute positions:

    add      x + s * v
    ablate   x - s * (x . u) u            (u = v / |v|; s = 1 removes the component)
    clamp    x - (x . u) u + s * v        (the component along u becomes s * |v|)

"Absolute" is what makes KV-cache generation equal the recompute: in a decode step the hook
sees ``[batch, 1, width]``, and reads where that token sits from ``model.pos_offset`` (the
cache's length, set by ``forward``); in a padded batch it reads each row's positions within
its own prompt (``model.row_positions``), so a left-padded row is steered where its prompt
alone would be. A list of scales steers a scale-major batch (rows
``i * B .. (i + 1) * B - 1`` get ``scales[i]``), so a scale sweep is one batched run
(``steered_generate``, ``steering_sweep``).

Prompts of different lengths are read one length-group at a time (no padding); a ``mask``
([batch, pos], True for real tokens) trims padded token rows the same way, so padded batches
slot in without changing the results.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import numbers
import zipfile
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from workbench.analysis.common import check_choice

KINDS = ("contrastive", "probe", "sae_feature", "prompt_diff", "weight_row", "custom")
MODES = ("add", "ablate", "clamp")
FORMAT_VERSION = 1
MAX_MEMBER_BYTES = 256 << 20  # a direction zip's members when no model says how wide a direction can be
Prompts = Union[str, Sequence[str], Tensor, Sequence[Sequence[int]], Any]


# ---- which model a direction belongs to -------------------------------------------------
def direction_bytes_limit(cfg) -> int:
    """The most a saved direction of a model with config ``cfg`` can take in one file: a
    per-position vector [n_ctx, widest hook] of float64, plus room for the header and a JSON
    provenance that lists prompt tokens (ints, a few per position)."""
    widest = max(cfg.d_model, getattr(cfg, "d_mlp", 0) or 0, cfg.n_heads * cfg.d_head)
    return 8 * cfg.n_ctx * widest + 64 * cfg.n_ctx + (1 << 20)



def model_fingerprint(model) -> str:
    """A short hash of the model's config (its non-default fields) and the signs of its first 256
    embedding weights.

    Signs, not values, so the same model in bf16 or on another device matches; another
    checkpoint of the same architecture (or another seed) almost surely does not.
    """
    signs = (model.W_E.detach().flatten()[:256] > 0).to("cpu", torch.uint8).numpy().tobytes()
    config = json.dumps(model.cfg.identity_dict(), sort_keys=True, default=str).encode()
    return hashlib.sha256(config + signs).hexdigest()[:16]


def model_stamp(model) -> dict:
    return {"name": getattr(model.cfg, "name", None), "fingerprint": model_fingerprint(model)}


def hook_width(model, hook: str) -> tuple[int, ...]:
    """The trailing (per-position) shape of the activation at ``hook``; ValueError for an unknown hook."""
    if hook not in model.hook_dict:
        some = [h for h in model.hook_dict if "resid" in h][:3]
        raise ValueError(f"hook={hook!r} is not a hook of this model (e.g. {some}; see model.hook_dict)")
    cfg = model.cfg
    if re.search(r"(hook_resid_\w+|hook_attn_out|hook_mlp_out|^hook_embed|^hook_pos_embed)$", hook):
        return (cfg.d_model,)
    if re.search(r"mlp\.hook_(pre|post)$", hook) and cfg.ffn != "moe":
        return (cfg.d_mlp,)
    seen: dict = {}
    with torch.no_grad():  # anything else: one token through the model says it
        model.run_with_hooks(torch.zeros(1, 1, dtype=torch.long, device=model.device), return_type=None,
                             fwd_hooks=[(hook, lambda act, hook: seen.setdefault("shape", act.shape))])
    if "shape" not in seen:
        raise ValueError(f"hook={hook!r} did not fire in a forward pass; pick a hook on the main path")
    return tuple(seen["shape"][2:])


# ---- the object -----------------------------------------------------------------------
@dataclass
class Direction:
    """A vector at a hook: ``[width]``, or ``[pos, width]`` (row p is for absolute position p).

    ``provenance`` is JSON: ``kind`` (one of KINDS) and how it was made; ``model`` (name and
    fingerprint) when made from a model, so applying it to another model is an error.
    """

    vector: Tensor  # [width] or [pos, width]; checked in __post_init__ with messages that say what to do
    hook: str
    provenance: dict = field(default_factory=lambda: {"kind": "custom"})

    def __post_init__(self) -> None:
        if not isinstance(self.vector, Tensor):
            self.vector = torch.as_tensor(self.vector)
        if not self.vector.dtype.is_floating_point:
            self.vector = self.vector.float()
        if self.vector.ndim not in (1, 2) or self.vector.numel() == 0:
            raise ValueError("a direction's vector must be [width] or [pos, width], "
                             f"got shape {tuple(self.vector.shape)}")
        if not bool(torch.isfinite(self.vector).all()):
            raise ValueError(f"the direction at {self.hook} has NaN or infinite entries; it cannot steer or project")
        if not bool((self.vector != 0).any()):
            raise ValueError(f"the direction at {self.hook} is the zero vector: it has no direction "
                             "(were the positive and negative sets the same?)")
        if not isinstance(self.hook, str):
            raise ValueError(f"hook must be a hook name such as 'blocks.1.hook_resid_post', got {self.hook!r}")
        self.provenance = dict(self.provenance)
        self.provenance.setdefault("kind", "custom")
        check_choice("provenance['kind']", self.provenance["kind"], KINDS)
        self.vector = self.vector.detach().to("cpu", torch.float32).contiguous()

    @property
    def width(self) -> int:
        return self.vector.shape[-1]

    @property
    def per_position(self) -> bool:
        return self.vector.ndim == 2

    @property
    def unit(self) -> Tensor:
        """``vector`` scaled to unit length (per row; an all-zero row stays zero)."""
        norm = self.vector.norm(dim=-1, keepdim=True)
        return torch.where(norm > 0, self.vector / norm.clamp_min(1e-30), torch.zeros_like(self.vector))

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.vector.shape))
        return f"Direction({self.provenance['kind']}, hook={self.hook!r}, [{shape}], |v|={self.vector.norm():.4g})"

    def check(self, model, check_model: bool = True) -> "Direction":
        """Raise ValueError unless this direction fits ``model``: the hook exists, its width
        matches, and (``check_model``) it was made on this model."""
        width = hook_width(model, self.hook)
        if width != (self.width,):
            raise ValueError(f"the direction is {self.width} wide but {self.hook} is {list(width)} on this model "
                             "(a direction from another model or another hook?)")
        made_on = self.provenance.get("model") or {}
        if check_model and made_on.get("fingerprint") and made_on["fingerprint"] != model_fingerprint(model):
            raise ValueError(
                f"this direction was made on model {made_on.get('name')!r} (fingerprint {made_on['fingerprint']}), "
                f"not on this one ({model.cfg.name!r}, {model_fingerprint(model)}); pass check_model=False "
                "to apply it anyway")
        return self

    def hooks(self, scale: Any = 1.0, mode: str = "add", positions: Any = "all", model=None) -> list:
        """``fwd_hooks`` that steer along this direction (see the module docstring for the modes).

        ``positions``: ``"all"``, an int or a list of absolute positions (these need ``model=``,
        whose ``pos_offset`` says where a KV-cache decode step is). A list of scales steers a
        scale-major batch. With ``model`` the direction is checked against it first.
        """
        if model is not None:
            self.check(model)
        elif positions != "all" or self.per_position:
            raise ValueError("steering chosen positions (or with a per-position direction) needs model=: "
                             "positions are absolute, and the model says where a KV-cache decode step sits")
        return [(self.hook, _steering_hook(self, _scales(scale), mode, _positions(positions, self), model))]

    # ---- constructors from a model -------------------------------------------------
    @classmethod
    def from_prompts(cls, model, plus: Union[str, Tensor], minus: Union[str, Tensor], hook: str) -> "Direction":
        """ActAdd (Turner et al. 2023): activation of ``plus`` minus that of ``minus`` at every
        position; the two prompts must be the same number of tokens. A per-position direction."""
        seqs = prompt_sequences(model, plus) + prompt_sequences(model, minus)
        if len(seqs) != 2:
            raise ValueError("from_prompts takes one plus prompt and one minus prompt")
        a, b = seqs
        if len(a) != len(b):
            raise ValueError(f"plus is {len(a)} tokens and minus is {len(b)}; a prompt difference needs equal lengths")
        acts = _read_positions(model, [a, b], [hook])[hook]
        diff = acts[0] - acts[1]
        return cls(diff, hook, {"kind": "prompt_diff", "plus": a.tolist(), "minus": b.tolist(),
                                "model": model_stamp(model)})

    @classmethod
    def from_weight(cls, model, param: str, index: int, hook: str) -> "Direction":
        """A row (or column) of a weight, e.g. ``("blocks.0.mlp.W_out", 7)`` or ``("W_U", token)``:
        the slice along the axis whose length is the hook's width."""
        weight = _get_param(model, param)
        (width,) = hook_width(model, hook)
        if weight.ndim != 2 or width not in weight.shape:
            raise ValueError(f"{param} has shape {tuple(weight.shape)}; neither axis matches {hook}'s width {width}")
        axis = 1 if weight.shape[1] == width else 0
        if not 0 <= index < weight.shape[1 - axis]:
            raise ValueError(f"index={index} out of range: {param} has {weight.shape[1 - axis]} rows along that axis")
        vector = weight[index] if axis == 1 else weight[:, index]
        return cls(vector, hook, {"kind": "weight_row", "param": param, "index": int(index),
                                  "model": model_stamp(model)})

    # ---- files --------------------------------------------------------------------
    def save(self, path: Union[str, Path], *, overwrite: bool = False) -> Path:
        """Write ``<path>.safetensors`` (the vector) and ``<path>.json`` (hook, provenance); returns the stem.

        Files of those names are replaced only when they are a direction the workbench saved (its
        ``.json``); any other raises ValueError, nothing written, unless ``overwrite=True``."""
        from safetensors.torch import save_file

        from workbench.overwrite import refuse_foreign, write_atomic

        stem = _stem(path)
        files = [stem.with_name(stem.name + s) for s in (".safetensors", ".json")]
        refuse_foreign(files, lambda _: _is_our_direction(files[1]), overwrite=overwrite,
                       what=f"saving the direction {stem}")
        stem.parent.mkdir(parents=True, exist_ok=True)
        text = self._meta_text()
        for suffix, write in ((".safetensors", lambda p: save_file({"vector": self.vector}, str(p))),
                              (".json", lambda p: p.write_text(text, encoding="utf-8"))):
            write_atomic(stem.with_name(stem.name + suffix), write)  # by rename: never half a file
        return stem

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Direction":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        stem = _stem(path)
        files = [stem.with_name(stem.name + s) for s in (".json", ".safetensors")]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"no saved direction at {stem}: missing {missing}")
        try:
            text, tensors = files[0].read_text(encoding="utf-8"), load_file(str(files[1]))
        except (SafetensorError, OSError, UnicodeDecodeError) as e:
            raise ValueError(f"the direction at {stem} cannot be read ({type(e).__name__}: {e})") from None
        return cls._from_parts(text, tensors, *map(str, files))

    # ---- one file, for a download or an upload ---------------------------------------------
    def to_bytes(self, name: str = "direction") -> bytes:
        """The direction as one zip file holding ``<name>.json`` and ``<name>.safetensors``,
        the two files ``save`` writes (``from_bytes`` reads it back)."""
        from safetensors.torch import save

        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"name must be a plain file name (no folders, not hidden), got {name!r}")
        buffer = io.BytesIO()
        # Stored, not deflated: float32 vectors barely compress.
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr(f"{name}.json", self._meta_text())
            archive.writestr(f"{name}.safetensors", save({"vector": self.vector}))
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, model: Any = None) -> "Direction":
        """The direction in a zip file made by ``to_bytes`` (one ``.json`` and one ``.safetensors``);
        ValueError saying what is wrong with any other bytes.

        ``model`` (a model or its ModelConfig) caps the members at what a direction of its widths
        can need (``direction_bytes_limit``), counted while inflating; without it, at
        ``MAX_MEMBER_BYTES``. An upload is read with the model it is for.
        """
        from safetensors.torch import load

        from workbench.archive import read_zip

        if not zipfile.is_zipfile(io.BytesIO(data)):
            raise ValueError("not a direction file: not a zip (Direction.to_bytes writes a zip of the "
                             ".json and .safetensors that Direction.save writes)")
        limit = MAX_MEMBER_BYTES if model is None else direction_bytes_limit(getattr(model, "cfg", model))
        members = read_zip(data, name="the direction zip", max_total=2 * limit, max_member=limit, max_entries=16)
        by_suffix = {Path(n).suffix: n for n in members}
        if len(members) != 2 or set(by_suffix) != {".json", ".safetensors"}:
            raise ValueError(f"a direction zip holds exactly one .json and one .safetensors, this one holds {list(members)}")
        try:
            text = members[by_suffix[".json"]].decode()
            tensors = load(members[by_suffix[".safetensors"]])
        except Exception as e:  # undecodable text, a bad safetensors header
            raise ValueError(f"the direction zip cannot be read: {e}") from None
        return cls._from_parts(text, tensors, by_suffix[".json"], by_suffix[".safetensors"])

    def _meta_text(self) -> str:
        meta = {"format_version": FORMAT_VERSION, "hook": self.hook, "shape": list(self.vector.shape),
                "provenance": self.provenance}
        return json.dumps(meta, indent=2, default=_json_default) + "\n"

    @classmethod
    def _from_parts(cls, text: str, tensors: dict, json_name: str, tensors_name: str) -> "Direction":
        """The direction in ``text`` (the JSON) and ``tensors`` (the safetensors), named in errors."""
        try:
            meta = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{json_name} is not valid JSON: {e}") from None
        missing = [k for k in ("hook", "shape", "provenance") if not isinstance(meta, dict) or k not in meta]
        if missing:
            raise ValueError(f"{json_name} is not a direction's JSON: missing {missing}")
        version = meta.get("format_version", 0)
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(f"{json_name} has format_version {version!r}; this library reads {FORMAT_VERSION}")
        if not isinstance(meta["hook"], str) or not isinstance(meta["provenance"], dict) \
                or not isinstance(meta["shape"], list):
            raise ValueError(f"{json_name} is not a direction's JSON: hook must be a string, shape a list and "
                             "provenance an object")
        if set(tensors) != {"vector"} or list(tensors["vector"].shape) != meta["shape"]:
            raise ValueError(f"{tensors_name} does not hold the vector its JSON describes (shape {meta['shape']})")
        return cls(tensors["vector"], meta["hook"], meta["provenance"])


def _is_our_direction(json_file: Path) -> bool:
    """Whether ``json_file`` is the ``.json`` half of a direction the workbench saved (``_meta_text``'s fields)."""
    from workbench.overwrite import read_json_dict

    meta = read_json_dict(json_file)
    return meta is not None and {"format_version", "hook", "shape", "provenance"} <= set(meta)


def _stem(path: Union[str, Path]) -> Path:
    path = Path(path)
    return path.with_suffix("") if path.suffix in (".json", ".safetensors") else path


def _json_default(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, Tensor):
        return value.tolist()
    raise TypeError(f"provenance holds {type(value).__name__}, which JSON cannot store")


def _get_param(model, name: str) -> Tensor:
    obj = model
    for part in name.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"param={name!r} names no weight of this model (e.g. 'blocks.0.mlp.W_out', 'W_U')")
    if not isinstance(obj, Tensor):
        raise ValueError(f"param={name!r} is not a weight tensor")
    return obj.detach()


# ---- steering -----------------------------------------------------------------------
def _scales(scale: Any) -> Tensor:
    message = f"scale must be a finite number or a non-empty list of them, got {scale!r}"
    items = scale.flatten().tolist() if isinstance(scale, (Tensor, np.ndarray)) else (
        list(scale) if isinstance(scale, (list, tuple)) else [scale])
    # Not torch.as_tensor first: a string ("4") or None is a TypeError deep in torch, a bool a silent 1.0.
    if not items or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in items):
        raise ValueError(message)
    values = torch.as_tensor(items, dtype=torch.float32).flatten()
    if not bool(torch.isfinite(values).all()):
        raise ValueError(message)
    return values


def _positions(positions: Any, direction: Direction) -> Optional[Tensor]:
    """None for every position, else a sorted tensor of absolute positions."""
    if isinstance(positions, str):
        check_choice("positions", positions, ("all",))
        return None
    if isinstance(positions, numbers.Integral):
        positions = [positions]
    values = torch.as_tensor(list(positions), dtype=torch.long).flatten()
    if values.numel() == 0 or int(values.min()) < 0:
        raise ValueError("positions must be 'all' or absolute positions >= 0 (counted from the first token), "
                         f"got {positions!r}")
    if direction.per_position and int(values.max()) >= direction.vector.shape[0]:
        raise ValueError(f"positions reach {int(values.max())} but the per-position direction has only "
                         f"{direction.vector.shape[0]} rows")
    return values.unique()


def _steering_hook(direction: Direction, scales: Tensor, mode: str, positions: Optional[Tensor], model) -> Callable:
    check_choice("mode", mode, MODES)
    vector, unit, n_rows = direction.vector, direction.unit, direction.vector.shape[0]
    placed: dict = {}

    def on(act: Tensor) -> tuple:
        key = (act.device, act.dtype)
        if key not in placed:  # moved once per device and dtype, not in every decode step
            placed[key] = tuple(t.to(act.device, act.dtype) for t in (vector, unit, scales)) + (
                None if positions is None else positions.to(act.device),)
        return placed[key]

    def hook(act: Tensor, hook) -> Tensor:
        if act.ndim != 3 or act.shape[-1] != direction.width:
            raise ValueError(f"the direction is {direction.width} wide but {direction.hook} carries "
                             f"{list(act.shape[2:])} per position (a direction from another model or hook?)")
        v, u, s, pos_set = on(act)
        rows, n = act.shape[:2]
        if rows % len(s):
            raise ValueError(f"{len(s)} scales need a scale-major batch (the input repeated once per scale), "
                             f"but the batch has {rows} rows")
        s = s.repeat_interleave(rows // len(s))[:, None, None]
        keep = None  # every position: no mask to build in each decode step
        if pos_set is not None or direction.per_position:
            offset = model.pos_offset if model is not None else 0
            own = getattr(model, "row_positions", None)
            if own is not None and tuple(own.shape) == (rows, n):  # a padded batch: each row's own positions
                where = own.to(act.device)
            else:
                where = torch.arange(offset, offset + n, device=act.device)
            keep = torch.ones_like(where, dtype=torch.bool) if pos_set is None else torch.isin(where, pos_set)
            if direction.per_position:
                keep &= where < n_rows
                v, u = v[where.clamp(min=0, max=n_rows - 1)], u[where.clamp(min=0, max=n_rows - 1)]
        if mode == "add":
            steered = act + s * v
        elif mode == "ablate":
            steered = act - s * (act * u).sum(-1, keepdim=True) * u
        else:
            steered = act - (act * u).sum(-1, keepdim=True) * u + s * v
        if keep is None:
            return steered
        return torch.where((keep[None] if keep.ndim == 1 else keep)[..., None], steered, act)

    return hook


def steering_hooks(model, direction: Direction, scale: Any = 1.0, mode: str = "add", positions: Any = "all") -> list:
    """``direction.hooks(...)`` checked against ``model`` (what ``model.steer`` installs)."""
    if not isinstance(direction, Direction):
        raise ValueError(f"direction must be a workbench.analysis.Direction, got {type(direction).__name__}")
    return direction.hooks(scale, mode, positions, model=model)


@torch.no_grad()
def steered_generate(
    model,
    tokens: Union[str, Int[Tensor, "batch pos"]],
    direction: Direction,
    scales: Sequence[float],
    max_new_tokens: int = 32,
    mode: str = "add",
    positions: Any = "all",
    batched: bool = True,
    **generate_kwargs: Any,
) -> Int[Tensor, "scale batch total"]:
    """Greedy (or sampled) continuations under each scale: ``[n_scales, batch, pos + new]``.

    ``batched`` runs every scale in one ``generate`` over the input repeated once per scale;
    ``batched=False`` runs one ``generate`` per scale (the reference it must equal).
    """
    tokens = _as_batch(model, tokens)
    scales = _scales(scales)
    if not batched:
        outs = []
        for s in scales.tolist():
            with model.steer(direction, s, mode, positions):
                outs.append(model.generate(tokens, max_new_tokens=max_new_tokens, **generate_kwargs))
        width = max(o.shape[1] for o in outs)  # rows that all stop early end sooner
        return torch.stack([_pad_to(o, width, o[:, -1:]) for o in outs])
    with model.steer(direction, scales, mode, positions):
        out = model.generate(tokens.repeat(len(scales), 1), max_new_tokens=max_new_tokens, **generate_kwargs)
    return out.view(len(scales), tokens.shape[0], -1)


def _pad_to(t: Tensor, width: int, fill: Tensor) -> Tensor:
    return t if t.shape[1] == width else torch.cat([t, fill.expand(-1, width - t.shape[1])], dim=1)


@torch.no_grad()
def steering_sweep(
    model,
    tokens: Union[str, Int[Tensor, "batch pos"]],
    direction: Direction,
    scales: Sequence[float],
    metric: Optional[Callable[[Tensor], Tensor]] = None,
    mode: str = "add",
    positions: Any = "all",
    batched: bool = True,
) -> pd.DataFrame:
    """``metric(logits)`` under each scale, one row per (scale, prompt) when the metric returns
    one value per prompt ([batch]), else one row per scale. Default metric: each prompt's mean
    next-token loss. ``batched`` runs all scales as one forward."""
    tokens = _as_batch(model, tokens)
    scales = _scales(scales)
    metric = metric or (lambda logits: model.loss_fn(logits, tokens, per_token=True).mean(-1))
    if batched:
        with model.steer(direction, scales, mode, positions):
            logits = model(tokens.repeat(len(scales), 1))
        values = [metric(part) for part in logits.split(len(tokens))]
    else:
        values = []
        for s in scales.tolist():
            with model.steer(direction, s, mode, positions):
                values.append(metric(model(tokens)))
    rows = []
    for s, value in zip(scales.tolist(), values):
        value = value.detach().float().cpu().flatten()
        per_prompt = value.numel() == len(tokens) and value.numel() > 1
        rows += [{"scale": s, "prompt": i if per_prompt else None, "metric": float(v)} for i, v in enumerate(value)]
    frame = pd.DataFrame(rows)
    return frame.dropna(axis=1, how="all") if frame["prompt"].isna().all() else frame


# ---- reading activations ----------------------------------------------------------------
def _as_batch(model, tokens) -> Tensor:
    seqs = prompt_sequences(model, tokens)
    if len({len(s) for s in seqs}) != 1:
        raise ValueError("these prompts have different lengths; pass equal-length prompts (or one at a time)")
    return torch.stack(seqs).to(model.device)


def prompt_sequences(model, prompts: Prompts, mask: Optional[Tensor] = None) -> list[Tensor]:
    """Each prompt as a 1-D token tensor: from a string, a list of strings (any lengths), token
    ids ``[batch, pos]`` (with ``mask`` True at real tokens: padding is dropped), a list of id
    lists, or a batch object with ``tokens`` and ``attention_mask``."""
    if hasattr(prompts, "tokens") and hasattr(prompts, "attention_mask") and not isinstance(prompts, Tensor):
        prompts, mask = prompts.tokens, prompts.attention_mask if mask is None else mask
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, Tensor):
        tokens = model._check_tokens(prompts).cpu()
        if mask is None:
            return list(tokens)
        mask = torch.as_tensor(mask, dtype=torch.bool).cpu()
        if mask.shape != tokens.shape:
            raise ValueError(f"mask must be [batch, pos] like the tokens {tuple(tokens.shape)}, "
                             f"got {tuple(mask.shape)}")
        if not bool(mask.any(-1).all()):
            raise ValueError("mask has a row with no real token")
        return [row[m] for row, m in zip(tokens, mask)]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if mask is not None:
        raise ValueError("mask= goes with token ids [batch, pos], not with text")
    if all(isinstance(p, str) for p in prompts):
        return [model._check_tokens(model.to_tokens(p)).cpu()[0] for p in prompts]
    return [model._check_tokens(torch.as_tensor(list(p), dtype=torch.long)).cpu()[0] for p in prompts]


def stop_layer(model, hooks: Sequence[str]) -> Optional[int]:
    """The block after the last one ``hooks`` read, so a read-only forward can stop there."""
    layers = [re.match(r"blocks\.(\d+)\.", h) for h in hooks]
    if not all(layers):
        return None
    last = max(int(m.group(1)) for m in layers) + 1
    return last if last < model.cfg.n_layers else None


def _length_groups(seqs: Sequence[Tensor], batch_size: int):
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    for _, group in itertools.groupby(order, key=lambda i: len(seqs[i])):
        group = list(group)
        for start in range(0, len(group), batch_size):
            yield group[start:start + batch_size]


@torch.no_grad()
def _read_positions(model, seqs: Sequence[Tensor], hooks: Sequence[str],
                    batch_size: int = 32) -> dict[str, list[Tensor]]:
    """Every position's activation at each hook, per sequence: {hook: [[len_i, width] ...]} on the CPU."""
    out = {h: [None] * len(seqs) for h in hooks}
    names, stop = set(hooks), stop_layer(model, hooks)
    for chunk in _length_groups(seqs, batch_size):
        batch = torch.stack([seqs[i] for i in chunk]).to(model.device)
        cache: dict = {}
        fwd = [(h, lambda act, hook: cache.__setitem__(hook.name, act.detach().float().cpu())) for h in names]  # noqa: B023 (called within this iteration)
        model.run_with_hooks(batch, fwd_hooks=fwd, stop_at_layer=stop, return_type=None)
        for h in hooks:
            if cache[h].ndim != 3:
                raise ValueError(f"hook {h} is not [batch, pos, width]; read a residual, attention-out or MLP hook")
            for row, i in enumerate(chunk):
                out[h][i] = cache[h][row]
    return out


def _pick(acts: Tensor, position: Union[int, str]) -> Tensor:
    if position == "mean":
        return acts.mean(0)
    if not isinstance(position, numbers.Integral):
        raise ValueError(f"position must be an int or 'mean', got {position!r}")
    if not -len(acts) <= position < len(acts):
        raise ValueError(f"position={position} is outside a {len(acts)}-token prompt")
    return acts[position]


def read_activations(model, prompts: Prompts, hooks: Sequence[str], position: Union[int, str] = -1,
                     mask: Optional[Tensor] = None, batch_size: int = 32) -> dict[str, Tensor]:
    """One activation per prompt at each hook: ``{hook: [n_prompts, width]}``, read at ``position``
    of each prompt (-1: its last real token; ``"mean"``: the mean over its tokens)."""
    acts = _read_positions(model, prompt_sequences(model, prompts, mask), hooks, batch_size)
    return {h: torch.stack([_pick(a, position) for a in rows]) for h, rows in acts.items()}


def steering_vector(
    model,
    positive: Prompts,
    negative: Prompts,
    hook: str,
    position: Union[int, str] = -1,
    mask: Optional[tuple] = None,
    batch_size: int = 32,
) -> Direction:
    """Contrastive activation addition (Rimsky et al. 2023): the mean activation at ``hook`` over
    the ``positive`` prompts minus the mean over the ``negative`` ones, each read at ``position``
    (-1: the last real token of each prompt; ``"mean"``: the mean over its tokens).

    Prompts may have different lengths. ``mask`` is a pair (positive mask, negative mask) for
    padded token batches.
    """
    hook_width(model, hook)
    pos_mask, neg_mask = mask if mask is not None else (None, None)
    pos = read_activations(model, positive, [hook], position, pos_mask, batch_size)[hook]
    neg = read_activations(model, negative, [hook], position, neg_mask, batch_size)[hook]
    diff = pos.mean(0) - neg.mean(0)
    if not bool((diff != 0).any()):
        raise ValueError("the positive and negative prompts give the same mean activation: the steering vector is zero")
    return Direction(diff, hook, {"kind": "contrastive", "n_positive": len(pos), "n_negative": len(neg),
                                  "position": position, "model": model_stamp(model)})


@torch.no_grad()
def project(
    model,
    tokens: Prompts,
    direction: Direction,
    mask: Optional[Tensor] = None,
    check_model: bool = True,
    batch_size: int = 32,
) -> pd.DataFrame:
    """The activation at ``direction.hook`` along the direction's unit vector, per position:
    one row per (prompt, pos) with the token and its ``projection`` (x . u)."""
    from workbench.analysis.common import str_tokens

    direction.check(model, check_model)
    seqs = prompt_sequences(model, tokens, mask)
    acts = _read_positions(model, seqs, [direction.hook], batch_size)[direction.hook]
    unit, rows = direction.unit, []
    for i, (seq, act) in enumerate(zip(seqs, acts)):
        if direction.per_position:
            n = min(len(seq), unit.shape[0])  # positions past the direction's rows have no vector
            values = (act[:n] * unit[:n]).sum(-1)
        else:
            values = act @ unit
        labels = str_tokens(model, seq)
        rows += [{"prompt": i, "pos": p, "token": labels[p], "projection": float(v)} for p, v in enumerate(values)]
    return pd.DataFrame(rows)


# ---- clean and edited, side by side --------------------------------------------------------
@torch.no_grad()
def edit_comparison(
    model,
    tokens: Union[str, Int[Tensor, "batch pos"]],
    edit: Callable[[], Any],
    max_new_tokens: int = 24,
    read: Optional[Direction] = None,
    label: str = "edited",
) -> dict[str, pd.DataFrame]:
    """One prompt run clean and inside ``edit()`` (a function returning a context manager,
    e.g. ``lambda: model.steer(d, 4.0)``): what a page shows side by side.

    ``"tokens"``: one row per (run, pos) of the prompt and its greedy continuation (run is
    ``"clean"`` or ``label``): pos, token_id, token, generated (False on the prompt), and, with
    ``read``, ``projection``: the activation along ``read`` as the *unedited* model reads that
    text, so both runs are measured by one yardstick. ``"clean"`` and ``label``: the prompt's
    ``token_losses`` without and with the edit.
    """
    from workbench.analysis.common import str_tokens
    from workbench.analysis.tokens import token_losses

    tokens = _as_batch(model, tokens)
    if len(tokens) != 1:
        raise ValueError(f"edit_comparison takes one prompt, got {len(tokens)}")
    if label == "clean":
        raise ValueError("label='clean' names the unedited run; pass another label")
    runs, losses = {}, {}
    runs["clean"] = model.generate(tokens, max_new_tokens=max_new_tokens, temperature=0.0, seed=0)[0]
    losses["clean"] = token_losses(model, tokens)
    with edit():
        runs[label] = model.generate(tokens, max_new_tokens=max_new_tokens, temperature=0.0, seed=0)[0]
        losses[label] = token_losses(model, tokens)
    frames = []
    for run, seq in runs.items():
        frames.append(pd.DataFrame({"run": run, "pos": range(len(seq)), "token_id": seq.tolist(),
                                    "token": str_tokens(model, seq), "generated": [p >= tokens.shape[1]
                                                                                  for p in range(len(seq))]}))
    frame = pd.concat(frames, ignore_index=True)
    if read is not None:
        along = project(model, list(runs.values()), read)
        frame["projection"] = along["projection"].to_numpy()  # the same (run, pos) order
    return {"tokens": frame, **losses}


def steering_comparison(
    model,
    tokens: Union[str, Int[Tensor, "batch pos"]],
    direction: Direction,
    scale: float = 4.0,
    mode: str = "add",
    positions: Any = "all",
    max_new_tokens: int = 24,
) -> dict[str, pd.DataFrame]:
    """``edit_comparison`` for steering: clean and steered (``model.steer(direction, scale, mode,
    positions)``) greedy continuations, losses, and the projection of both texts along ``direction``."""
    direction.check(model)
    check_choice("mode", mode, MODES)
    _scales(scale)
    return edit_comparison(model, tokens, lambda: model.steer(direction, scale, mode, positions), max_new_tokens,
                           read=direction, label="steered")
