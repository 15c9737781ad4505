"""ActivationStore: a model's activations at some hooks, as sharded safetensors with a manifest.

    store = ActivationStore.collect(model, get_task("stories"), hooks=["blocks.1.hook_resid_post"],
                                    tokens=2_000_000, out="acts/s26-l1")     # resumable
    for batch in store.batches(4096, seed=0): ...                             # [4096, d] shuffled
    store.contexts(shard=0, rows=[5, 9])                                      # the tokens around rows

A store folder holds ``manifest.json`` and ``shard_00000.safetensors``, ``shard_00001...``.
Each shard holds one tensor per hook (``[rows, d]``: the kept positions of its sequences, the
trailing dimensions of the hook flattened), ``token_ids`` ``[sequences, seq_len]`` (so
contexts can be shown) and ``rows`` (the flat index ``sequence * seq_len + pos`` of every kept
position). The manifest records the model (name and a fingerprint of its weights), the hooks
with their shapes, the dtype, the source of the tokens, the position rule, the token count and
every shard with its row count and checksum.

Which positions are kept is a rule, written in the manifest: position 0 (the BOS-like first
token every task starts with, whose residual norm dwarfs the rest) is dropped unless
``exclude_first=False``, as is any token in ``exclude_token_ids``; padding will be dropped by the
``attention_mask`` argument of ``keep_mask`` (every sequence is packed to full length today).

Collection is resumable: a shard is written to a temporary file and renamed, then the manifest
is rewritten (also by rename). Shard ``k`` always holds source batches ``k * batches_per_shard``
onwards (tasks make batch ``j`` a pure function of the seed and ``j``; token streams are cut in
order), so a run killed at any point continues at the first shard the manifest lacks and never
repeats a token. Memory is one shard, never the corpus.

Reading streams shards through a shuffle buffer of ``buffer_shards`` shards: the order of the
row stream is a pure function of ``(seed, batch index)``, so a resumed trainer can start at any
batch without replaying the ones before it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from jaxtyping import Bool, Int
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm

from workbench.checkpoint import model_fingerprint  # noqa: F401  (re-exported: its historical home)
from workbench.habits import tokenizer_prepends_bos
from workbench.overwrite import write_atomic
from workbench.utils import jsonable

MANIFEST = "manifest.json"
FORMAT = "workbench-activations"
FORMAT_VERSION = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SHARD = "shard_{:05d}.safetensors"


class StoreError(ValueError):
    """A store folder is missing, corrupt, inconsistent, or belongs to another model or source."""


# ---- hooks ---------------------------------------------------------------------------------
def check_hook(model, name: str) -> str:
    """``name`` if the model has that hook, else a ValueError listing the closest names."""
    if not isinstance(name, str):
        raise ValueError(f"a hook name must be a string, got {type(name).__name__}")
    if name in model.hook_dict:
        return name
    close = difflib.get_close_matches(name, list(model.hook_dict), n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"the model has no hook {name!r}{hint} ({len(model.hook_dict)} hooks in model.hook_dict)")


def hook_layer(name: str) -> Optional[int]:
    """The block index of ``blocks.{l}.*`` hooks, None for hooks outside the blocks."""
    match = re.match(r"blocks\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def stop_layer(model, hooks: Sequence[str]) -> Optional[int]:
    """The ``stop_at_layer`` that still runs every hook in ``hooks`` (None: the whole model)."""
    layers = [hook_layer(h) for h in hooks]
    if any(layer is None for layer in layers):
        return None
    last = max(layers) + 1
    return None if last >= model.cfg.n_layers else last


@torch.no_grad()
def hook_shapes(model, hooks: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The trailing shape (after batch and position) of each hook, from a two-token probe run.

    Remembered on the model, keyed by the hooks, its config, its parameters' shapes and the hook
    modules themselves (a module swapped in, as a splice does, probes again): splicing in and out
    per call then costs no forward."""
    hooks = [check_hook(model, h) for h in hooks]
    key = (tuple(hooks), repr(model.cfg), tuple(p.shape for p in model.parameters()),  # torch.Size: hashable
           tuple(id(model.hook_dict[h]) for h in hooks))
    known = model.__dict__.setdefault("_hook_shapes_seen", {})
    if key in known:
        return dict(known[key])
    seen: dict[str, tuple[int, ...]] = {}

    def record(act: Tensor, hook) -> None:
        seen[hook.name] = tuple(act.shape[2:])

    tokens = torch.zeros((1, 2), dtype=torch.long, device=model.device)
    # eagerly even on a compiled model: compiled, the probe was a graph of its own (seconds under
    # inductor), one of the model's recompile_limit, and a batch of 1 made its later graphs dynamic
    with torch.compiler.set_stance("force_eager"):
        model.run_with_hooks(tokens, return_type=None, stop_at_layer=stop_layer(model, hooks),
                             fwd_hooks=[(h, record) for h in hooks])
    known[key] = {h: seen[h] for h in hooks}
    return dict(known[key])


# ---- positions ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PositionRule:
    """Which positions of a packed sequence become rows: not the first, not these token ids."""

    exclude_first: bool = True
    exclude_token_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {"exclude_first": self.exclude_first, "exclude_token_ids": list(self.exclude_token_ids)}


def keep_mask(tokens: Int[Tensor, "batch pos"], rule: PositionRule,
              attention_mask: Optional[Tensor] = None) -> Bool[Tensor, "batch pos"]:
    """True where a position's activation is kept. ``attention_mask`` (1 = real token) drops pads."""
    keep = torch.ones_like(tokens, dtype=torch.bool)
    if rule.exclude_first:
        keep[:, 0] = False
    if rule.exclude_token_ids:
        keep &= ~torch.isin(tokens, torch.tensor(rule.exclude_token_ids, device=tokens.device))
    if attention_mask is not None:
        keep &= attention_mask.bool()
    return keep


# ---- token sources ---------------------------------------------------------------------------
class TokenSource:
    """Batch ``j`` of ``batch_size`` packed sequences, a pure function of ``j``; ``identity`` for the manifest."""

    def __init__(self, source: Any, model, batch_size: int, seq_len: Optional[int], split: str = "train"):
        from workbench.data.base import Task

        self.batch_size, self.split = int(batch_size), split
        if isinstance(source, Task):
            self.task = source
            self.seq_len = int(seq_len or (source.default_seq_len if source.fixed_seq_len else model.cfg.n_ctx))
            self.stream = None
            self.identity = {"kind": "task", "task": source.name, "options": jsonable(source.options()), "split": split}
            if source.vocab_size > model.cfg.d_vocab:
                raise ValueError(f"the {source.name} task's vocabulary ({source.vocab_size}) exceeds the model's d_vocab={model.cfg.d_vocab}")
        else:
            if isinstance(source, (str, Path)):
                text = Path(source).read_text(encoding="utf-8") if _is_file(source) else str(source)
                ids = torch.tensor(model._need_tokenizer().encode(text), dtype=torch.long)
            elif isinstance(source, Tensor) and not source.dtype.is_floating_point:
                ids = source.detach().cpu().long()
            else:
                raise ValueError("source must be a Task, a tensor of token ids, a text string or a path to a text file; "
                                 f"got {type(source).__name__}")
            self.task = None
            self.seq_len = int(seq_len or (ids.shape[1] if ids.ndim == 2 else model.cfg.n_ctx))
            flat = ids.flatten()
            n_seq = len(flat) // self.seq_len
            if n_seq == 0:
                raise ValueError(f"the token source has {len(flat)} tokens, fewer than one sequence of seq_len={self.seq_len}")
            self.stream = flat[: n_seq * self.seq_len].view(n_seq, self.seq_len)
            if int(self.stream.max()) >= model.cfg.d_vocab or int(self.stream.min()) < 0:
                raise ValueError(f"token ids must lie in [0, {model.cfg.d_vocab})")
            digest = hashlib.sha256(self.stream.numpy().tobytes()).hexdigest()[:16]
            self.identity = {"kind": "tokens", "sequences": n_seq, "sha256": digest}
        if self.seq_len < 1 or self.seq_len > model.cfg.n_ctx:
            raise ValueError(f"seq_len={self.seq_len} must lie in [1, n_ctx={model.cfg.n_ctx}]")
        self.identity.update(seq_len=self.seq_len, batch_size=self.batch_size)

    @property
    def n_batches(self) -> Optional[int]:
        """How many batches there are (None: endless, a task)."""
        return None if self.stream is None else math.ceil(len(self.stream) / self.batch_size)

    def batch(self, j: int) -> Int[Tensor, "batch pos"]:
        if self.task is not None:
            return self.task.batch(self.batch_size, self.seq_len, step=j, split=self.split)
        return self.stream[j * self.batch_size : (j + 1) * self.batch_size]


# ---- one forward -----------------------------------------------------------------------------
@torch.no_grad()
def forward_rows(model, tokens: Int[Tensor, "batch pos"], hooks: Sequence[str], rule: PositionRule,
                 dtype: torch.dtype = torch.float32, attention_mask: Optional[Tensor] = None,
                 ) -> tuple[dict[str, Tensor], Tensor]:
    """The kept rows ``{hook: [rows, d]}`` of one batch and their flat indices ``seq * pos_len + pos``.

    The forward stops after the last block a hook needs, and hooks only copy what they keep.
    """
    tokens = tokens.to(model.device)
    keep = keep_mask(tokens, rule, attention_mask)
    flat_keep = keep.flatten()
    out: dict[str, Tensor] = {}

    def take(act: Tensor, hook) -> None:
        rows = act.reshape(act.shape[0] * act.shape[1], -1)[flat_keep]
        out[hook.name] = rows.to(dtype=dtype, device="cpu")

    model.run_with_hooks(tokens, return_type=None, stop_at_layer=stop_layer(model, hooks),
                         fwd_hooks=[(h, take) for h in hooks])
    return out, flat_keep.nonzero().flatten().cpu()


# ---- the store -----------------------------------------------------------------------------------
class ShardedActivations:
    """What every activation source shares (a store on disk, live activations, tensors in memory):
    shuffled batches over its shards, and the one hook it holds when none is named."""

    hooks: list[str]
    buffer_shards = 4  # shards shuffled together by default

    def batches(self, batch_size: int, hooks: Union[str, Sequence[str], None] = None, seed: int = 0,
                buffer_shards: Optional[int] = None, start_batch: int = 0, device: Union[str, torch.device] = "cpu",
                ) -> Iterator[Union[Tensor, tuple[Tensor, ...]]]:
        """An endless stream of shuffled float32 batches ``[batch_size, d]`` (a tuple for several hooks).

        Epoch ``e`` visits the shards in a seeded order, ``buffer_shards`` at a time; each group's
        rows are shuffled together and cut into whole batches (a group's remainder is skipped).
        """
        hooks, single = _as_hooks(hooks, self)
        return stream_batches(self, hooks, batch_size, seed, buffer_shards or self.buffer_shards, start_batch, device,
                              single)

    def _single_hook(self) -> str:
        if len(self.hooks) != 1:
            raise ValueError(f"these activations hold several hooks {self.hooks}; say which")
        return self.hooks[0]


class ActivationStore(ShardedActivations):
    """A collected store on disk (``ActivationStore(path)`` opens one; ``collect`` writes one)."""

    def __init__(self, path: Union[str, Path], shards: Optional[Sequence[int]] = None):
        self.path = Path(path)
        self.manifest = _read_manifest(self.path)
        all_shards = self.manifest["shards"]
        self.shard_ids = list(range(len(all_shards))) if shards is None else [int(s) for s in shards]
        for s in self.shard_ids:
            if not 0 <= s < len(all_shards):
                raise ValueError(f"shard {s} out of range: the store has shards 0..{len(all_shards) - 1}")
        self._checked: set[int] = set()

    # ---- what is in it ------------------------------------------------------------------
    @property
    def hooks(self) -> list[str]:
        return list(self.manifest["hooks"])

    def d(self, hook: str) -> int:
        """The row width of ``hook`` (its trailing dimensions multiplied)."""
        return int(np.prod(self.hook_shape(hook)))

    def hook_shape(self, hook: str) -> tuple[int, ...]:
        if hook not in self.manifest["hooks"]:
            raise ValueError(f"the store has no hook {hook!r}; it holds {self.hooks}")
        return tuple(self.manifest["hooks"][hook]["shape"])

    @property
    def n_shards(self) -> int:
        return len(self.shard_ids)

    def shard_rows(self, i: int) -> int:
        return int(self.manifest["shards"][self.shard_ids[i]]["rows"])

    known_rows = shard_rows

    @property
    def n_rows(self) -> int:
        return sum(self.shard_rows(i) for i in range(self.n_shards))

    @property
    def model_info(self) -> dict:
        return dict(self.manifest["model"])

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.manifest["dtype"]]

    def subset(self, shards: Sequence[int]) -> "ActivationStore":
        """A view of some shards (indices into this view), e.g. all but the last for training."""
        return ActivationStore(self.path, [self.shard_ids[int(i)] for i in shards])

    def check_model(self, model) -> None:
        """Raise StoreError unless this store was collected from ``model`` (same fingerprint)."""
        info, fp = self.manifest["model"], model_fingerprint(model)
        if info["fingerprint"] != fp:
            raise StoreError(
                f"{self.path} was collected from model {info.get('name')!r} (fingerprint {info['fingerprint']}), "
                f"not from this model {model.cfg.name!r} (fingerprint {fp}); collect a store from this model"
            )

    def __repr__(self) -> str:
        return (f"ActivationStore({str(self.path)!r}, hooks={self.hooks}, rows={self.n_rows:,}, "
                f"shards={self.n_shards}, dtype={self.manifest['dtype']})")

    # ---- reading ----------------------------------------------------------------------------
    def load_shard(self, i: int, hooks: Optional[Sequence[str]] = None, with_tokens: bool = False) -> dict[str, Tensor]:
        """Shard ``i`` of this view: ``{hook: [rows, d]}`` (plus ``token_ids`` and ``rows`` when asked)."""
        hooks = list(hooks or self.hooks)
        for h in hooks:
            self.hook_shape(h)
        shard = self.shard_ids[i]
        entry = self.manifest["shards"][shard]
        file = self.path / entry["file"]
        names = hooks + (["token_ids", "rows"] if with_tokens else [])
        try:
            with safe_open(str(file), framework="pt") as f:
                if shard not in self._checked:
                    self._check_shard_header(f, entry, file)
                    self._checked.add(shard)
                out = {name: f.get_tensor(name) for name in names}
        except (SafetensorError, OSError, RuntimeError) as e:
            raise StoreError(f"shard {file} is missing or corrupt ({e}); recollect the store (delete the shard "
                             "and run collect again to resume)") from None
        return out

    def _check_shard_header(self, f, entry: dict, file: Path) -> None:
        keys = set(f.keys())
        missing = (set(self.hooks) | {"token_ids", "rows"}) - keys
        if missing:
            raise StoreError(f"shard {file} lacks tensors {sorted(missing)} the manifest lists; the store is inconsistent")
        for h in self.hooks:
            shape = f.get_slice(h).get_shape()
            if list(shape) != [entry["rows"], self.d(h)]:
                raise StoreError(f"shard {file} holds {h} of shape {list(shape)} but the manifest says "
                                 f"[{entry['rows']}, {self.d(h)}]; the shard and the manifest do not match")
            dtype = f.get_slice(h).get_dtype()
            if _SAFETENSORS_DTYPES.get(dtype) != self.manifest["dtype"]:
                raise StoreError(f"shard {file} holds {h} as {dtype} but the manifest says {self.manifest['dtype']}")
        if f.get_slice("rows").get_shape() != [entry["rows"]]:
            raise StoreError(f"shard {file} has {f.get_slice('rows').get_shape()} row indices but the manifest says {entry['rows']}")

    def verify(self) -> None:
        """Read every shard of this view and compare its checksum with the manifest's."""
        for i in range(self.n_shards):
            entry = self.manifest["shards"][self.shard_ids[i]]
            file = self.path / entry["file"]
            if not file.exists() or _sha256(file) != entry["sha256"]:
                raise StoreError(f"shard {file} does not match its checksum in the manifest (missing or corrupt); "
                                 "delete it and run collect again to resume")
            self.load_shard(i)

    def activations(self, hook: Optional[str] = None, max_rows: Optional[int] = None) -> Tensor:
        """The first ``max_rows`` rows of ``hook`` (all when None), in store order, as float32."""
        hook = hook or self._single_hook()
        parts, total = [], 0
        for i in range(self.n_shards):
            part = self.load_shard(i, [hook])[hook]
            parts.append(part)
            total += len(part)
            if max_rows is not None and total >= max_rows:
                break
        return torch.cat(parts)[:max_rows].float()

    def contexts(self, shard: int, rows: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """For rows of shard ``shard``: their sequences' token ids ``[n, seq_len]`` and (sequence, position)."""
        data = self.load_shard(shard, [], with_tokens=True)
        flat = data["rows"][torch.as_tensor(list(rows), dtype=torch.long)]
        seq_len = data["token_ids"].shape[1]
        seq, pos = flat // seq_len, flat % seq_len
        return data["token_ids"][seq], seq, pos

    # ---- writing ------------------------------------------------------------------------------
    @classmethod
    def collect(
        cls,
        model,
        source: Any,
        hooks: Union[str, Sequence[str]],
        tokens: int,
        out: Union[str, Path],
        *,
        batch_size: int = 32,
        seq_len: Optional[int] = None,
        tokens_per_shard: Optional[int] = None,
        dtype: str = "float32",
        exclude_first: bool = True,
        exclude_token_ids: Sequence[int] = (),
        split: str = "train",
        progress: bool = True,
        on_shard: Optional[Callable[[int], None]] = None,
    ) -> "ActivationStore":
        """Collect ``tokens`` rows of activations at ``hooks`` into ``out`` (or continue a killed run).

        ``source``: a Task (batches of its ``split``), token ids (``[n, seq_len]`` or a flat stream,
        packed in order), or text (a string or a file path, encoded by the model's tokenizer).
        ``tokens_per_shard`` defaults to about 64 MiB of activations per shard. ``on_shard(k)``
        runs after shard ``k`` is on disk (tests use it to simulate a kill).
        """
        if isinstance(hooks, str):
            hooks = [hooks]
        hooks = [check_hook(model, h) for h in hooks]
        if not hooks or len(set(hooks)) != len(hooks):
            raise ValueError(f"hooks must be a non-empty list of distinct hook names, got {hooks}")
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be a positive integer (rows to collect), got {tokens!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not valid; choose one of {list(DTYPES)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        out = Path(out)
        src = TokenSource(source, model, batch_size, seq_len, split)
        rule = PositionRule(bool(exclude_first), tuple(int(t) for t in exclude_token_ids))
        kept_per_seq = src.seq_len - int(rule.exclude_first)
        if kept_per_seq < 1:
            raise ValueError("seq_len=1 with exclude_first=True keeps no positions; use longer sequences")
        shapes = hook_shapes(model, hooks)
        width = sum(int(np.prod(s)) for s in shapes.values())
        if tokens_per_shard is None:
            tokens_per_shard = max(kept_per_seq, (64 << 20) // (width * DTYPES[dtype].itemsize))
        batches_per_shard = max(1, math.ceil(tokens_per_shard / (kept_per_seq * src.batch_size)))
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "model": {"name": model.cfg.name, "fingerprint": model_fingerprint(model), "d_model": model.cfg.d_model,
                      "d_vocab": model.cfg.d_vocab, "n_layers": model.cfg.n_layers,
                      "prepend_bos": tokenizer_prepends_bos(getattr(model, "tokenizer", None))},
            "hooks": {h: {"shape": list(shapes[h])} for h in hooks},
            "dtype": dtype,
            "source": src.identity,
            "rule": rule.to_dict(),
            "seq_len": src.seq_len,
            "batches_per_shard": batches_per_shard,
            "tokens_per_shard": batches_per_shard * src.batch_size * kept_per_seq,
            "target_tokens": tokens,
            "tokens": 0,
            "complete": False,
            "shards": [],
        }
        # One collection writes into a folder at a time (the folder's lock, as a spill folder of a graph
        # has): a second one is refused at once. Without it two collects into one folder could delete each
        # other's half-written shards (taken for the strays of a killed run) and number their shards alike.
        with _owned(out):
            if (out / MANIFEST).exists():
                manifest = _resume_manifest(out, manifest)
            elif out.exists() and any(out.iterdir()):
                raise StoreError(f"{out} is a non-empty folder without {MANIFEST}; choose a new or empty folder")
            out.mkdir(parents=True, exist_ok=True)
            if manifest["tokens"] >= tokens:
                return cls(out)  # already collected: read it, write nothing
            _remove_strays(out)
            _write_manifest(out, manifest)
            bar = tqdm(total=tokens, initial=min(manifest["tokens"], tokens), unit="tok", desc="collect", disable=not progress)
            try:
                while manifest["tokens"] < tokens:
                    k = len(manifest["shards"])
                    first = k * batches_per_shard
                    if src.n_batches is not None and first >= src.n_batches:
                        raise ValueError(f"the token source ran out after {manifest['tokens']:,} rows; "
                                         f"asked for {tokens:,}: pass more text or fewer tokens")
                    entry = _collect_shard(model, src, hooks, rule, DTYPES[dtype], out, k, first, batches_per_shard,
                                           tokens - manifest["tokens"])
                    manifest["shards"].append(entry)
                    manifest["tokens"] += entry["rows"]
                    manifest["complete"] = manifest["tokens"] >= tokens
                    _write_manifest(out, manifest)
                    bar.update(entry["rows"])
                    if on_shard is not None:
                        on_shard(k)
            finally:
                bar.close()
            return cls(out)


def _owned(out: Path):
    """The write lock of store folder ``out`` (``.<name>.lock`` beside it), held; StoreError at once when
    another collection holds it."""
    from workbench.checkpoint import hold_now

    return hold_now(out, lambda by: StoreError(f"{out} is in use: another collection{by} is writing there now; give "
                                               "each collection its own folder (nothing was written)"))


# What a shard or manifest write leaves when its process is killed: write_atomic's temporary file
# (``.<name>.tmp-<pid>-<hex>``) or, from a version before it, ``.<name>.tmp`` (one name for every writer).
_STRAY = re.compile(r"^\.(?:manifest\.json|shard_\d{5,}\.safetensors)\.tmp(?:-(\d+)-[0-9a-f]+)?$")


def _remove_strays(out: Path) -> None:
    """Remove the half-written shards and manifests of dead collections in ``out`` (call with its lock held).

    Only files of the names the store writes: a user's own ``.*.tmp`` stays. A temporary file whose
    process is alive and which is not an hour old is another writer's (one of an older version, which
    takes no lock) and stays too; a name without a pid (an older version's) is taken as a killed run's,
    as it always was."""
    from workbench.checkpoint import writer_gone

    for entry in out.iterdir():
        match = _STRAY.match(entry.name)
        if not match or entry.is_symlink() or not entry.is_file():
            continue
        try:
            gone = match[1] is None or writer_gone(int(match[1]), entry.stat().st_mtime)
        except FileNotFoundError:  # renamed into place as we looked
            continue
        if gone:
            entry.unlink(missing_ok=True)


def _collect_shard(model, src: TokenSource, hooks, rule, dtype, out: Path, k: int, first: int, n_batches: int,
                   needed: int) -> dict:
    """Run source batches ``first .. first + n_batches`` and write shard ``k`` (at most ``needed`` rows)."""
    acts: dict[str, list[Tensor]] = {h: [] for h in hooks}
    token_parts, row_parts, n_rows, n_seq = [], [], 0, 0
    last = first + n_batches if src.n_batches is None else min(first + n_batches, src.n_batches)
    for j in range(first, last):
        tokens = src.batch(j)
        got, rows = forward_rows(model, tokens, hooks, rule, dtype)
        if n_rows + len(rows) > needed:  # the last shard stops at exactly the asked-for count
            rows = rows[: needed - n_rows]
            got = {h: a[: len(rows)] for h, a in got.items()}
            n_used = int(rows[-1]) // tokens.shape[1] + 1 if len(rows) else 0
            tokens = tokens[:n_used]
        for h in hooks:
            acts[h].append(got[h])
        row_parts.append(rows + n_seq * tokens.shape[1])
        token_parts.append(tokens.cpu().to(torch.int32))
        n_rows += len(rows)
        n_seq += tokens.shape[0]
        if n_rows >= needed:
            break
    tensors = {h: torch.cat(acts[h]).contiguous() for h in hooks}
    tensors["token_ids"] = torch.cat(token_parts).contiguous()
    tensors["rows"] = torch.cat(row_parts).to(torch.int64).contiguous()
    name = _SHARD.format(k)
    # write_atomic gives the file an ordinary mode (safetensors writes 0600; a store is ordinary shared data)
    write_atomic(out / name, lambda tmp: save_file(tensors, str(tmp), metadata={"format": FORMAT, "shard": str(k)}))
    return {"file": name, "rows": n_rows, "sequences": n_seq, "first_batch": first,
            "bytes": (out / name).stat().st_size, "sha256": _sha256(out / name)}


# ---- streaming ---------------------------------------------------------------------------------
def _as_hooks(hooks, source) -> tuple[list[str], bool]:
    if hooks is None:
        return [source._single_hook()], True
    if isinstance(hooks, str):
        return [hooks], True
    return list(hooks), False


def stream_batches(source, hooks: list[str], batch_size: int, seed: int, buffer_shards: int, start_batch: int,
                   device, single: bool) -> Iterator:
    """Shuffled batches from ``source`` (anything with ``n_shards``, ``shard_rows(i)``, ``load_shard(i, hooks)``).

    A finite source cycles through epochs; an endless one (``n_shards`` None) goes on in shard
    order. The shuffle is seeded per (epoch, group), so batch ``b`` is the same however it is reached.
    """
    if batch_size < 1 or buffer_shards < 1:
        raise ValueError(f"batch_size and buffer_shards must be >= 1, got {batch_size} and {buffer_shards}")
    for h in hooks:
        source.d(h)
    skip = int(start_batch)
    for epoch, group in _groups(source, buffer_shards, seed):
        known = [source.known_rows(i) for i in group]
        if None not in known and skip >= sum(known) // batch_size:
            skip -= sum(known) // batch_size  # skipped without reading a byte
            continue
        parts = [source.load_shard(i, hooks) for i in group]
        data = [parts[0][h] if len(parts) == 1 else torch.cat([p[h] for p in parts]) for h in hooks]
        rows = len(data[0])
        n_batches = rows // batch_size
        if skip >= n_batches:
            skip -= n_batches
            continue
        gen = torch.Generator().manual_seed(_mix(seed, epoch, group[0]))
        order = torch.randperm(rows, generator=gen)
        for b in range(skip, n_batches):
            idx = order[b * batch_size : (b + 1) * batch_size]
            # index_select gathers rows about 2-5x faster than d[idx] on CPU
            out = tuple(d.index_select(0, idx).to(device=device, dtype=torch.float32, non_blocking=True) for d in data)
            yield out[0] if single else out
        skip = 0


def _mix(*values: int) -> int:
    """A fixed seed from integers (Python's hash() of a tuple changes between processes)."""
    out = 0
    for v in values:
        out = (out * 1_000_003 + int(v) + 7919) % (2**61 - 1)
    return out


def _groups(source, buffer_shards: int, seed: int) -> Iterator[tuple[int, list[int]]]:
    if source.n_shards is None:
        start = 0
        while True:
            yield 0, list(range(start, start + buffer_shards))
            start += buffer_shards
    if source.n_shards == 0:
        raise StoreError("the store has no shards to read")
    epoch = 0
    while True:
        gen = torch.Generator().manual_seed(_mix(seed, epoch, 17))
        order = torch.randperm(source.n_shards, generator=gen).tolist()
        for g in range(0, len(order), buffer_shards):
            yield epoch, order[g : g + buffer_shards]
        epoch += 1


# ---- live activations (no store) ------------------------------------------------------------------
class LiveActivations(ShardedActivations):
    """Activations generated on the fly from a model and a token source: a store without a disk.

    Shard ``i`` is source batch ``i``'s kept rows (computed on demand, its row count remembered), so
    ``stream_batches`` and the trainer treat it like an endless store.
    """

    buffer_shards = 8  # a live shard is one source batch: shuffle more of them together

    def __init__(self, model, source: Any, hooks: Union[str, Sequence[str]], *, batch_size: int = 32,
                 seq_len: Optional[int] = None, exclude_first: bool = True, exclude_token_ids: Sequence[int] = (),
                 split: str = "train"):
        hooks = [hooks] if isinstance(hooks, str) else list(hooks)
        self.model = model
        self.hooks = [check_hook(model, h) for h in hooks]
        self.src = TokenSource(source, model, batch_size, seq_len, split)
        self.rule = PositionRule(bool(exclude_first), tuple(int(t) for t in exclude_token_ids))
        self.shapes = hook_shapes(model, self.hooks)
        self.rows: dict[int, int] = {}  # row counts of the batches seen so far (a resumed trainer restores them)
        self.manifest = {"model": {"name": model.cfg.name, "fingerprint": model_fingerprint(model),
                                   "d_model": model.cfg.d_model,
                                   "prepend_bos": tokenizer_prepends_bos(getattr(model, "tokenizer", None))},
                         "source": self.src.identity,
                         "rule": self.rule.to_dict(), "hooks": {h: {"shape": list(s)} for h, s in self.shapes.items()}}

    n_shards = None

    @property
    def model_info(self) -> dict:
        return dict(self.manifest["model"])

    def d(self, hook: str) -> int:
        if hook not in self.shapes:
            raise ValueError(f"these live activations have no hook {hook!r}; they hold {self.hooks}")
        return int(np.prod(self.shapes[hook]))

    def hook_shape(self, hook: str) -> tuple[int, ...]:
        self.d(hook)
        return tuple(self.shapes[hook])

    def known_rows(self, i: int) -> Optional[int]:
        return self.rows.get(i)

    def load_shard(self, i: int, hooks: Optional[Sequence[str]] = None, with_tokens: bool = False) -> dict[str, Tensor]:
        n = self.src.n_batches
        if n is not None and i >= n:  # a text or tensor source is finite: no empty batch for the forward
            raise StoreError(
                f"the token source ran out: its {len(self.src.stream)} sequences of {self.src.seq_len} tokens are "
                f"{n} batch(es) of {self.src.batch_size}, and batch {i} was asked for. Live activations do not "
                "repeat a text: give a longer one or train fewer steps, or collect an ActivationStore from it "
                "(ActivationStore.collect), which training reads epoch after epoch")
        tokens = self.src.batch(i)
        got, rows = forward_rows(self.model, tokens, self.hooks, self.rule)
        self.rows[i] = len(rows)
        got.update(token_ids=tokens.cpu(), rows=rows)
        return {h: got[h] for h in list(hooks or self.hooks) + (["token_ids", "rows"] if with_tokens else [])}

    def check_model(self, model) -> None:
        if model_fingerprint(model) != self.manifest["model"]["fingerprint"]:
            raise StoreError("these live activations come from another model than the one passed")

    def heldout(self) -> "LiveActivations":
        """The same activations over the task's validation split (the same source when it is not a task)."""
        if self.src.task is None:
            return self
        rule = self.rule
        return LiveActivations(self.model, self.src.task, self.hooks, batch_size=self.src.batch_size,
                               seq_len=self.src.seq_len, exclude_first=rule.exclude_first,
                               exclude_token_ids=rule.exclude_token_ids, split="val")


class TensorActivations(ShardedActivations):
    """Activations already in memory (``{hook: [rows, d]}``), cut into shards: a store without files.

    Synthetic data, a benchmark's fixed batch, or activations from elsewhere train like a store.
    """

    def __init__(self, tensors: dict[str, Tensor], rows_per_shard: int = 65536, shards: Optional[Sequence[int]] = None):
        lengths = {len(t) for t in tensors.values()}
        if not tensors or len(lengths) != 1 or any(t.ndim != 2 for t in tensors.values()):
            raise ValueError("tensors must be a non-empty {hook: [rows, d]} dict with the same rows for every hook")
        if rows_per_shard < 1:
            raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
        self.tensors, self.rows_per_shard = tensors, int(rows_per_shard)
        total = lengths.pop()
        all_shards = list(range(math.ceil(total / self.rows_per_shard)))
        self.shard_ids = all_shards if shards is None else [all_shards[int(i)] for i in shards]
        self.total = total
        self.hooks = list(tensors)
        self.manifest = {"model": {"name": "", "fingerprint": ""}, "source": {"kind": "tensors", "rows": total},
                         "hooks": {h: {"shape": [t.shape[1]]} for h, t in tensors.items()}}

    @property
    def n_shards(self) -> int:
        return len(self.shard_ids)

    @property
    def model_info(self) -> dict:
        return dict(self.manifest["model"])

    def d(self, hook: str) -> int:
        return self.hook_shape(hook)[0]

    def hook_shape(self, hook: str) -> tuple[int, ...]:
        if hook not in self.tensors:
            raise ValueError(f"no hook {hook!r}; these activations hold {self.hooks}")
        return (int(self.tensors[hook].shape[1]),)

    def shard_rows(self, i: int) -> int:
        start = self.shard_ids[i] * self.rows_per_shard
        return min(self.rows_per_shard, self.total - start)

    known_rows = shard_rows

    def load_shard(self, i: int, hooks: Optional[Sequence[str]] = None, with_tokens: bool = False) -> dict[str, Tensor]:
        if with_tokens:
            raise ValueError("in-memory activations carry no token ids")
        start = self.shard_ids[i] * self.rows_per_shard
        return {h: self.tensors[h][start : start + self.rows_per_shard] for h in (hooks or self.hooks)}

    def subset(self, shards: Sequence[int]) -> "TensorActivations":
        return TensorActivations(self.tensors, self.rows_per_shard, [self.shard_ids[int(i)] for i in shards])

    def check_model(self, model) -> None:
        raise StoreError("in-memory activations record no model to check against")


# ---- manifest files -----------------------------------------------------------------------------
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _is_file(source: Union[str, Path]) -> bool:
    try:
        return Path(source).is_file()
    except (OSError, ValueError):  # a long text is not a path
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(out: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=1)
    # always by rename (a function, not text): a reader of the store never sees half of a new manifest
    write_atomic(out / MANIFEST, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _read_manifest(path: Path) -> dict:
    if not (path / MANIFEST).is_file():
        raise StoreError(f"{path} is not an activation store: it has no {MANIFEST} (collect one with ActivationStore.collect)")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StoreError(f"{path / MANIFEST} is corrupt ({e}); recollect the store") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(f"{path / MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise StoreError(f"{path} has store format version {manifest.get('version')}; this workbench reads version {FORMAT_VERSION}")
    for key in ("model", "hooks", "dtype", "shards", "tokens", "seq_len"):
        if key not in manifest:
            raise StoreError(f"{path / MANIFEST} lacks the {key!r} entry; recollect the store")
    try:
        _check_manifest_types(manifest)
    except (TypeError, KeyError, AttributeError, ValueError) as e:
        raise StoreError(f"{path / MANIFEST} is corrupt ({type(e).__name__}: {e}); recollect the store") from None
    if manifest["dtype"] not in DTYPES:
        raise StoreError(f"{path / MANIFEST} names dtype {manifest['dtype']!r}; valid dtypes are {list(DTYPES)}")
    total = sum(int(s["rows"]) for s in manifest["shards"])
    if total != manifest["tokens"]:
        raise StoreError(f"{path / MANIFEST} says {manifest['tokens']} tokens but its shards hold {total}; the manifest is inconsistent")
    for s in manifest["shards"]:
        if not (path / s["file"]).is_file():
            raise StoreError(f"shard {path / s['file']} listed in the manifest is missing; run collect again to rewrite it")
    return manifest


def _check_manifest_types(manifest: dict) -> None:
    """TypeError/ValueError unless the manifest's entries have the types the reader relies on."""
    if not isinstance(manifest["hooks"], dict) or not isinstance(manifest["shards"], list):
        raise TypeError("hooks must be an object and shards a list")
    for name, hook in manifest["hooks"].items():
        shape = hook["shape"]
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
            raise ValueError(f"hook {name!r} has shape {shape!r}, not a list of positive integers")
    for shard in manifest["shards"]:
        if not isinstance(shard["file"], str) or not isinstance(shard["sha256"], str) or "/" in shard["file"] \
                or not isinstance(shard["rows"], int) or isinstance(shard["rows"], bool) or shard["rows"] < 0:
            raise ValueError(f"shard entry {shard!r} needs a file name, a sha256 and a row count")
    if not isinstance(manifest["model"], dict) or not isinstance(manifest["tokens"], int) \
            or not isinstance(manifest["dtype"], str):
        raise TypeError("model must be an object, tokens an integer and dtype a string")


def _resume_manifest(out: Path, fresh: dict) -> dict:
    """The manifest of the interrupted (or shorter) collection in ``out``, checked against this call.

    Reading a finished store needs only the same model, hooks, dtype, rule and token source; adding
    shards to it also needs the same batch size and shard size, so the next shard starts where it should.
    """
    old = _read_manifest(out)
    more = old["tokens"] < fresh["target_tokens"]
    ignore = set() if more else {"batch_size"}
    for key, what in (("model", "model"), ("hooks", "hooks"), ("dtype", "dtype"), ("source", "token source"),
                      ("rule", "position rule"), ("batches_per_shard", "shard size")):
        if key == "model":
            same = old["model"].get("fingerprint") == fresh["model"]["fingerprint"]
        elif key == "source":
            same = ({k: v for k, v in old.get(key, {}).items() if k not in ignore}
                    == {k: v for k, v in fresh[key].items() if k not in ignore})
        elif key == "batches_per_shard":
            same = not more or old.get(key) == fresh[key]
        else:
            same = old.get(key) == fresh[key]
        if not same:
            raise StoreError(
                f"{out} holds a store from another {what} ({key}: {old.get(key)} vs now {fresh[key]}); "
                "collect into a new folder, or delete this one"
            )
    old["target_tokens"] = max(old.get("target_tokens", 0), fresh["target_tokens"])
    return old
