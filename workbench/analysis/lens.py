"""Lenses: read the residual stream at every layer as a next-token distribution.

The logit lens (nostalgebraist 2020) applies the final norm and the unembedding to the
residual stream entering each block. The tuned lens (Belrose et al. 2023) first passes
each layer's stream through a learned affine translator, trained to match the model's
final distribution, which removes most of the logit lens' bias at early layers.

Layer ``l`` (0..n_layers-1) is the stream entering block ``l`` (``l = 0`` is the
embedding); layer ``n_layers`` is the final stream, where both lenses are the model.
Both lenses return the same tidy table: one row per (batch, layer, position).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from workbench.analysis.batching import (
    DataLike, as_token_batch, iter_batches, n_rows, next_real_index, real_cells, select_rows, with_meta,
)
from workbench.analysis.common import check_device, vocab_labels
from workbench.checkpoint import CheckpointError
from workbench.padding import TokenBatch
from workbench.utils import check_float, check_int, check_seed, check_token_ids, eval_mode

TUNED_LENS_WEIGHTS = "tuned_lens.safetensors"
TUNED_LENS_META = "tuned_lens.json"
LENS_FORMAT = "workbench.tuned_lens"


# ---- the residual stream at every layer ------------------------------------------------------
def _stack(model, batch: TokenBatch) -> tuple[Float[Tensor, "layer batch pos d_model"], Float[Tensor, "batch pos d_vocab"]]:
    """The stream entering every block plus the final stream, and the logits, of one padded
    batch; zero at pads (defined values that no sum and no mean can pick up)."""
    n = model.cfg.n_layers
    wanted = {f"blocks.{l}.hook_resid_pre" for l in range(n)} | {f"blocks.{n - 1}.hook_resid_post"}
    logits, cache = model.run_with_cache(batch, names_filter=lambda name: name in wanted)
    resid = cache.accumulated_resid(layer=None, incl_mid=False)
    real = batch.attention_mask.bool()
    if not bool(real.all()):
        resid = torch.where(real[None, :, :, None], resid, torch.zeros_like(resid))
        logits = torch.where(real[:, :, None], logits, torch.zeros_like(logits))
    return resid, logits


@torch.no_grad()
def residual_stack(
    model,
    data: DataLike,
    batch_size: Optional[int] = None,
    progress: bool = False,
    padding_side: str = "left",
    attention_mask: Optional[Tensor] = None,
) -> tuple[Float[Tensor, "layer batch pos d_model"], Tensor]:
    """The stream entering every block plus the final stream ([n_layers + 1, ...]), and the logits.

    ``data``: token ids, texts of any lengths, a ``TokenBatch`` or a ``PromptSet``; prompts of
    different lengths come back padded on ``padding_side`` (their own side for a TokenBatch),
    zero at pads, each row what its prompt gives alone. The result holds the whole data, so
    ``batch_size`` bounds only the forward's memory; a dataset-scale reduction streams
    ``iter_batches`` instead (as ``logit_lens(..., aggregate=True)`` does). Uses
    TransformerLens' ``ActivationCache.accumulated_resid`` on our cache.
    """
    whole = as_token_batch(model, data, padding_side, attention_mask)
    size = len(whole) if batch_size is None else batch_size
    parts = [_stack(model, batch) for batch in iter_batches(model, whole, size, progress=progress, desc="residual stack")]
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=0)


def _project(model, resid: Float[Tensor, "layer batch pos d_model"]) -> Float[Tensor, "layer batch pos d_vocab"]:
    """Final norm (its statistics recomputed per layer and position, as the lens needs) and unembedding,
    every layer in one product: one unembedding per layer read the whole [d_model, d_vocab] matrix once
    per layer (SmolLM2's 31 streams of a 14-token prompt: 3.8 s on one thread, against 0.44 s at once)."""
    streams = resid.flatten(0, 1)  # [layer * batch, pos, d_model]: the layers as rows of one batch
    return model.unembed(model.ln_final(streams)).unflatten(0, resid.shape[:2])


def _check_targets(model, data: DataLike, targets: Optional[Tensor]) -> Optional[Tensor]:
    """``targets`` checked against the token grid of ``data`` (token data only: texts have no fixed grid)."""
    if targets is None:
        return None
    grid = data.tokens if isinstance(data, TokenBatch) else data if isinstance(data, Tensor) else None
    if grid is None:
        raise ValueError("targets go with token ids (a tensor or a TokenBatch) shaped like them; "
                         f"the data is {type(data).__name__}")
    grid = grid[None] if grid.ndim == 1 else grid
    if not isinstance(targets, Tensor) or targets.shape != grid.shape:
        raise ValueError(f"targets must be a tensor of token ids shaped like tokens {tuple(grid.shape)}, "
                         f"got {tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__}")
    return check_token_ids("targets", targets, model.cfg.d_vocab, allow=(-1,)).to(model.device)


def _lens_stats(lens_logits: Tensor, final_logits: Tensor, targets: Tensor, k: int) -> dict:
    """Everything a lens table reports, [layer, batch, pos] (top-k: [..., k]); a target of -1 is none."""
    n_layer = lens_logits.shape[0]
    logp = lens_logits.float().log_softmax(-1)
    final_logp = final_logits.float().log_softmax(-1)
    safe = targets.clamp(min=0)[None].expand(n_layer, -1, -1)[..., None]
    target_logit = lens_logits.gather(-1, safe).squeeze(-1)
    probs = logp.exp()
    top_p, top_i = probs.topk(k, dim=-1)
    final_p = final_logp.exp()
    # The sums over the vocabulary as products (einsum): no [layer, batch, pos, vocab] temporary for each,
    # and counting the tokens above the target in int32: SmolLM2's 31 streams x 14 positions x 49,152
    # tokens: 0.27-0.36 s for the whole table on one thread, against 0.42-0.55 s with elementwise products and sums.
    return {
        "kl": torch.einsum("bpv,lbpv->lbp", final_p, final_logp - logp),  # KL(final || lens)
        "entropy": -torch.einsum("lbpv,lbpv->lbp", probs, logp),
        "top_p": top_p, "top_i": top_i, "targets": targets,
        "has_target": (targets >= 0)[None].expand(n_layer, -1, -1),
        # 1 = the top token
        "target_rank": (lens_logits > target_logit[..., None]).sum(-1, dtype=torch.int32).long() + 1,
        "target_prob": logp.gather(-1, safe).squeeze(-1).exp(),
    }


LENS_CHUNK_BYTES = 256 << 20  # the [layer, batch, positions, vocab] logits of one chunk of positions


def _chunked_stats(model, resid: Tensor, final_logits: Tensor, batch, targets: Optional[Tensor], k: int) -> dict:
    """:func:`_lens_stats` a chunk of positions at a time: each position's row is its own, so only one
    chunk's [layer, batch, pos, vocab] logits (and their log-softmax) exist at once. Whole, SmolLM2's
    31 streams x 2,501 positions x 49,152 tokens are 15 GB of float32 per copy."""
    n_layer, n_batch, n_pos = resid.shape[:3]
    if targets is None:  # each token's next real token (none after the last real one: -1), over the whole row
        after = next_real_index(batch.attention_mask)
        targets = torch.where(after >= 0, batch.tokens.gather(1, after.clamp(min=0)), torch.full_like(batch.tokens, -1))
    step = max(1, LENS_CHUNK_BYTES // (n_layer * n_batch * model.cfg.d_vocab * 4))
    parts = [_lens_stats(_project(model, resid[:, :, lo:lo + step]), final_logits[:, lo:lo + step],
                         targets[:, lo:lo + step], k)
             for lo in range(0, n_pos, step)]
    if len(parts) == 1:
        return parts[0]
    return {key: torch.cat([p[key] for p in parts], dim=1 if key == "targets" else 2) for key in parts[0]}


def _layer_labels(model, layer: np.ndarray) -> np.ndarray:
    return np.where(layer == model.cfg.n_layers, "final", np.char.add("resid_pre ", layer.astype(str)))


def _lens_rows(model, labels: np.ndarray, batch, stats: dict, k: int, lens_name: str) -> pd.DataFrame:
    """The per-token table of one batch: its real tokens only, positions counted within each prompt."""
    b, c, p = real_cells(batch.attention_mask)
    n_layer = stats["kl"].shape[0]
    bt, ct = torch.as_tensor(b, device=batch.tokens.device), torch.as_tensor(c, device=batch.tokens.device)
    take = lambda name: stats[name][:, bt, ct].cpu().numpy()  # noqa: E731  [layer, n_real]
    layer = np.repeat(np.arange(n_layer), len(b))
    prompt = np.tile(batch.rows.cpu().numpy()[b], n_layer)
    target_id = np.tile(stats["targets"][bt, ct].cpu().numpy(), n_layer)
    has = take("has_target").ravel()
    frame = {
        "lens": lens_name, "batch": prompt, "layer": layer, "layer_label": _layer_labels(model, layer),
        "pos": np.tile(p, n_layer), "token": labels[np.tile(batch.tokens[bt, ct].cpu().numpy(), n_layer)],
        "target_id": target_id, "target": labels[target_id],  # -1 picks the trailing ""
        "target_prob": np.where(has, take("target_prob").ravel(), np.nan),
        "target_rank": np.where(has, take("target_rank").ravel(), -1),
        "kl_to_final": take("kl").ravel(), "entropy": take("entropy").ravel(),
    }
    ids, probs = take("top_i").reshape(-1, k), take("top_p").reshape(-1, k)
    for j in range(k):
        frame[f"top{j + 1}"] = labels[ids[:, j]]
        frame[f"top{j + 1}_id"] = ids[:, j]
        frame[f"top{j + 1}_prob"] = probs[:, j]
    frame["prompt"] = prompt
    return pd.DataFrame(frame)


AGGREGATES = ("kl_to_final", "entropy", "target_prob", "target_rank", "top1_accuracy")


def _lens_sums(stats: dict, mask: Tensor) -> dict:
    """Per-layer sums over a batch's real tokens (float64: the sum of a dataset does not depend on its batching)."""
    real = mask.bool()[None].expand_as(stats["kl"])
    has = stats["has_target"] & real
    hit = stats["top_i"][..., 0] == stats["targets"][None]
    total = lambda x, where: torch.where(where, x.double(), torch.zeros_like(x, dtype=torch.float64)).sum(dim=(1, 2))  # noqa: E731
    return {"n_tokens": real.sum(dim=(1, 2)).double(), "n_targets": has.sum(dim=(1, 2)).double(),
            "kl_to_final": total(stats["kl"], real), "entropy": total(stats["entropy"], real),
            "target_prob": total(stats["target_prob"], has), "target_rank": total(stats["target_rank"], has),
            "top1_accuracy": total(hit.double(), has)}


def _lens_run(model, data: DataLike, lenses: dict, k: int, targets: Optional[Tensor], batch_size: int,
              progress: bool, aggregate: bool, padding_side: str, attention_mask: Optional[Tensor]) -> pd.DataFrame:
    """One pass over ``data`` for every lens in ``lenses`` ({name: TunedLens or None for the logit
    lens}): the per-token table, or with ``aggregate`` the per-layer means over every real token."""
    k = check_int("k", k, 1, model.cfg.d_vocab)
    targets = _check_targets(model, data, targets)
    labels = None if aggregate else vocab_labels(model)
    tables: list[pd.DataFrame] = []
    sums: dict = {name: None for name in lenses}
    for batch in iter_batches(model, data, batch_size, padding_side, progress, f"{'/'.join(lenses)} lens",
                              attention_mask):
        resid, final_logits = _stack(model, batch)
        for name, lens in lenses.items():
            moved = resid if lens is None else lens.translate(resid)
            stats = _chunked_stats(model, moved, final_logits, batch,
                                   None if targets is None else targets[batch.rows], k)
            if aggregate:
                part = _lens_sums(stats, batch.attention_mask)
                sums[name] = part if sums[name] is None else {key: sums[name][key] + v for key, v in part.items()}
            else:
                tables.append(_lens_rows(model, labels, batch, stats, k, name))
    if not aggregate:
        frame = pd.concat(tables, ignore_index=True).sort_values(["lens", "layer", "batch", "pos"], kind="stable")
        return with_meta(frame.reset_index(drop=True), data)
    frames = []
    for name, total in sums.items():
        layer = np.arange(model.cfg.n_layers + 1)
        frame = pd.DataFrame({"lens": name, "layer": layer, "layer_label": _layer_labels(model, layer),
                              "n_tokens": total["n_tokens"].cpu().numpy().astype(int)})
        for key in AGGREGATES:
            count = total["n_tokens"] if key in ("kl_to_final", "entropy") else total["n_targets"]
            frame[key] = (total[key] / count.clamp(min=1)).cpu().numpy()
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


@torch.no_grad()
def logit_lens(
    model,
    data: DataLike,
    k: int = 5,
    targets: Optional[Int[Tensor, "batch pos"]] = None,
    batch_size: int = 32,
    progress: bool = False,
    aggregate: bool = False,
    padding_side: str = "left",
    attention_mask: Optional[Tensor] = None,
) -> pd.DataFrame:
    """The logit lens at every layer and every real token of every prompt.

    ``data``: a text, texts of any lengths, token ids [batch, pos] (with ``attention_mask``
    if padded), a ``TokenBatch`` or a ``PromptSet``; run in batches of ``batch_size`` (a
    tqdm bar with ``progress``), each row as its prompt alone.

    Columns: lens, batch, layer, layer_label, pos (within the prompt: 0 = its first token),
    token, target_id, target, target_prob, target_rank (1 = top), kl_to_final (KL(final ||
    lens), nats), entropy, for the top ``k`` tokens ``top{i}``, ``top{i}_id``,
    ``top{i}_prob``, then prompt (= batch: the row of ``data``) and a PromptSet's meta
    columns. ``targets`` defaults to the next token (none at a prompt's last token:
    target_rank -1, target_prob NaN); a target of -1 means none.

    ``aggregate=True``: one row per layer instead, means over every real token of the data,
    reduced batch by batch (memory bounded by the batch): lens, layer, layer_label,
    n_tokens, kl_to_final, entropy, target_prob, target_rank and top1_accuracy (the last
    three over tokens with a target).
    """
    return _lens_run(model, data, {"logit": None}, k, targets, batch_size, progress, aggregate, padding_side,
                     attention_mask)


# ---- the tuned lens ------------------------------------------------------------------------
class TunedLens(nn.Module):
    """One affine translator per layer (``h -> h W^T + b``), identity-initialised.

    Layer ``n_layers`` (the final stream) has no translator: the lens there is the model.
    """

    def __init__(self, n_layers: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(d_model).repeat(n_layers, 1, 1))
        self.bias = nn.Parameter(torch.zeros(n_layers, d_model))
        self.info: dict = {}

    @property
    def n_layers(self) -> int:
        return self.weight.shape[0]

    def translate(self, resid: Float[Tensor, "layer batch pos d_model"]) -> Float[Tensor, "layer batch pos d_model"]:
        """Translate a stack of n_layers + 1 streams; the last (final) one passes through.

        The translators stay float32 whatever the model's dtype (a bf16 lens could not learn its
        small updates to the identity): bf16/fp16 streams are translated in float32 and cast back."""
        moved = torch.einsum("lbpd,led->lbpe", resid[:-1].to(self.weight.dtype), self.weight)
        moved = (moved + self.bias[:, None, None]).to(resid.dtype)
        return torch.cat([moved, resid[-1:]], dim=0)

    def check_fits(self, model) -> None:
        if (self.n_layers, self.weight.shape[-1]) != (model.cfg.n_layers, model.cfg.d_model):
            raise ValueError(
                f"tuned lens is for n_layers={self.n_layers}, d_model={self.weight.shape[-1]}; the model has "
                f"n_layers={model.cfg.n_layers}, d_model={model.cfg.d_model}: train a lens for this model"
            )

    def save(self, checkpoint_dir: Union[str, Path]) -> Path:
        """Write ``tuned_lens.safetensors`` and ``tuned_lens.json`` into the checkpoint directory.

        An existing lens is replaced only when its ``tuned_lens.json`` marks it as one the
        workbench wrote; files of those names that are not raise CheckpointError. In a checkpoint
        the two files join meta.json's list of written files, so re-saving the checkpoint (new
        weights) removes the lens that was trained for the old ones.
        """
        from workbench.checkpoint import locked, record_files
        from workbench.overwrite import write_atomic

        directory = Path(checkpoint_dir)
        if not directory.is_dir():
            raise ValueError(f"checkpoint directory {directory} does not exist")
        weights = {"weight": self.weight.detach().cpu().contiguous(), "bias": self.bias.detach().cpu().contiguous()}
        meta = {"format": LENS_FORMAT, "version": 1, "n_layers": self.n_layers,
                "d_model": int(self.weight.shape[-1]), **self.info}
        names = (TUNED_LENS_WEIGHTS, TUNED_LENS_META)
        with locked(directory):  # the checkpoint's own lock: a concurrent re-save cannot swap the folder away
            present = [n for n in names if os.path.lexists(directory / n)]
            if present and not _is_our_lens(directory / TUNED_LENS_META):
                raise CheckpointError(
                    f"{directory} already holds {', '.join(present)}, which is not a tuned lens the workbench "
                    "wrote; move it away first (nothing was written)"
                )
            # each file replaced atomically (always by rename), so a reader never sees half a lens file
            text = json.dumps(meta, indent=2) + "\n"
            write_atomic(directory / TUNED_LENS_WEIGHTS, lambda tmp: save_file(weights, str(tmp)))
            write_atomic(directory / TUNED_LENS_META, lambda tmp: tmp.write_text(text, encoding="utf-8"))
            record_files(directory, list(names))
        return directory / TUNED_LENS_WEIGHTS

    @classmethod
    def load(cls, checkpoint_dir: Union[str, Path], model=None) -> "TunedLens":
        """The lens saved in ``checkpoint_dir`` (checked against ``model`` when given).

        CheckpointError, as for the checkpoint itself, when there is none or it is incomplete or corrupt.
        """
        directory = Path(checkpoint_dir)
        path = directory / TUNED_LENS_WEIGHTS
        if not path.exists():
            raise CheckpointError(f"no tuned lens at {path}: train one with train_tuned_lens(...).save(dir)")
        try:
            meta = json.loads((directory / TUNED_LENS_META).read_text())
            weights = load_file(str(path))
            lens = cls(meta["n_layers"], meta["d_model"])
            lens.load_state_dict(weights)
        except (SafetensorError, OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            raise CheckpointError(f"the tuned lens in {directory} is incomplete or corrupt ({type(e).__name__}: {e}); "
                                  "train and save it again") from None
        lens.info = {k: v for k, v in meta.items() if k not in ("format", "version", "n_layers", "d_model")}
        if model is not None:
            lens.check_fits(model)
            lens.to(model.device)
        return lens


def _is_our_lens(meta_path: Path) -> bool:
    try:
        return json.loads(meta_path.read_text()).get("format") == LENS_FORMAT
    except (OSError, ValueError, AttributeError):  # absent, not JSON, not a JSON object
        return False


def _kl_per_layer(model, lens: TunedLens, resid: Float[Tensor, "layer tokens d_model"]) -> Tensor:
    """KL(final || tuned lens) per layer [layer], averaged over the given (real) tokens."""
    with torch.no_grad():
        final_logp = _project(model, resid[-1:, None])[0, 0].float().log_softmax(-1)
    logp = _project(model, lens.translate(resid[:, None])[:-1])[:, 0].float().log_softmax(-1)
    return (final_logp.exp() * (final_logp - logp)).sum(-1).mean(dim=1)


def _real_streams(model, batch) -> Float[Tensor, "layer tokens d_model"]:
    """Every real token's streams, row after row (pads dropped): [n_layers + 1, n_real, d_model]."""
    resid, _ = _stack(model, batch)
    return resid[:, batch.attention_mask.bool()]


def train_tuned_lens(
    model,
    data: DataLike,
    steps: int = 300,
    batch_size: int = 16,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
    max_cached_bytes: int = 2**30,
    padding_side: str = "left",
) -> TunedLens:
    """Fit a translator per layer to minimise KL(final || lens) on ``data`` (the model's own text:
    token ids, texts of any lengths, a ``TokenBatch`` or a ``PromptSet``).

    All layers train together (their losses are independent, so this is L separate fits);
    the model is frozen. Each step draws ``batch_size`` prompts and averages the KL over their
    real tokens (pads never enter it). The model's residual streams are computed once, batch by
    batch, and kept when every real token's streams fit in ``max_cached_bytes``; a larger
    dataset is run again for the prompts each step draws, so memory stays bounded by the step's
    batch. Both ways give the same lens. The loss history is kept in ``lens.info["history"]``.
    """
    steps, batch_size = check_int("steps", steps, 0), check_int("batch_size", batch_size, 1)
    lr, seed = check_float("lr", lr, 0, None, lo_open=True), check_seed("seed", seed)
    max_cached_bytes = check_int("max_cached_bytes", max_cached_bytes, 0)
    n = n_rows(data)
    lens = TunedLens(model.cfg.n_layers, model.cfg.d_model).to(model.device)
    opt = torch.optim.Adam(lens.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / max(steps, 1))
    gen = torch.Generator().manual_seed(seed)
    history: list[float] = []
    n_tokens, longest = 0, 0
    # Frozen for the training: without this each backward also computed the gradient of every weight
    # the KL reads (the final norm and the unembedding, d_model x d_vocab) only to throw it away.
    frozen = [p for p in model.parameters() if p.requires_grad]
    # enable_grad: the lens learns by backward even when the caller has gradients off (a notebook's
    # earlier torch.set_grad_enabled(False), or a no_grad block), which raised "element 0 of tensors does
    # not require grad" from inside the first step
    with eval_mode(model), torch.enable_grad():
        try:
            for p in frozen:
                p.requires_grad_(False)
            # The model is frozen, so its residual streams are computed once, not once per step,
            # when they fit: packed real tokens, with where each prompt's tokens start.
            per_token = (model.cfg.n_layers + 1) * model.cfg.d_model * 4
            streams: Optional[list] = []
            with torch.no_grad():
                for batch in iter_batches(model, data, 64, padding_side, progress, "tuned lens: streams"):
                    lengths = batch.lengths
                    n_tokens, longest = n_tokens + int(lengths.sum()), max(longest, int(lengths.max()))
                    if streams is not None and n_tokens * per_token <= max_cached_bytes:
                        streams.extend(_real_streams(model, batch).split(lengths.tolist(), dim=1))
                    else:
                        streams = None  # too large to keep: each step runs its prompts again
            for _ in tqdm(range(steps), disable=not progress, desc="tuned lens"):
                rows = torch.randint(0, n, (min(batch_size, n),), generator=gen)
                if streams is not None:
                    resid = torch.cat([streams[int(r)] for r in rows], dim=1)
                else:
                    with torch.no_grad():
                        (batch,) = iter_batches(model, select_rows(data, rows.tolist()), len(rows), padding_side)
                        resid = _real_streams(model, batch)
                kl = _kl_per_layer(model, lens, resid)  # [layer]
                opt.zero_grad(set_to_none=True)
                kl.sum().backward()
                opt.step()
                sched.step()
                history.append(float(kl.detach().mean()))
        finally:
            for p in frozen:
                p.requires_grad_(True)
    lens.info = {"train": {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed,
                           "n_sequences": n, "seq_len": longest, "n_tokens": n_tokens},
                 "history": history}
    return lens


@torch.no_grad()
def tuned_lens(
    model,
    data: DataLike,
    lens: TunedLens,
    k: int = 5,
    targets: Optional[Int[Tensor, "batch pos"]] = None,
    batch_size: int = 32,
    progress: bool = False,
    aggregate: bool = False,
    padding_side: str = "left",
    attention_mask: Optional[Tensor] = None,
) -> pd.DataFrame:
    """The tuned lens at every layer and every real token; the same data, arguments and columns
    as ``logit_lens`` (``aggregate=True``: per-layer means over the whole data)."""
    lens.check_fits(model)
    check_device(model, "the tuned lens's weights", lens)
    return _lens_run(model, data, {"tuned": lens}, k, targets, batch_size, progress, aggregate, padding_side,
                     attention_mask)


@torch.no_grad()
def compare_lenses(
    model,
    data: DataLike,
    lens: TunedLens,
    batch_size: int = 32,
    progress: bool = False,
    padding_side: str = "left",
    attention_mask: Optional[Tensor] = None,
) -> pd.DataFrame:
    """Mean KL to the final distribution per layer for both lenses, over every real token of
    ``data`` (one pass, reduced batch by batch): columns layer, lens, kl."""
    lens.check_fits(model)
    check_device(model, "the tuned lens's weights", lens)
    both = _lens_run(model, data, {"logit": None, "tuned": lens}, 1, None, batch_size, progress, True,
                     padding_side, attention_mask)
    both = both.sort_values(["layer", "lens"], kind="stable").reset_index(drop=True)
    return both[["layer", "lens", "kl_to_final"]].rename(columns={"kl_to_final": "kl"})
