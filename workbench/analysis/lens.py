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

from workbench.analysis.common import as_tokens, str_tokens
from workbench.checkpoint import CheckpointError
from workbench.utils import check_float, check_int, check_seed, check_token_ids, eval_mode

TUNED_LENS_WEIGHTS = "tuned_lens.safetensors"
TUNED_LENS_META = "tuned_lens.json"
LENS_FORMAT = "workbench.tuned_lens"


# ---- the residual stream at every layer ------------------------------------------------------
def residual_stack(model, tokens: Tensor) -> tuple[Float[Tensor, "layer batch pos d_model"], Tensor]:
    """The stream entering every block plus the final stream ([n_layers + 1, ...]), and the logits.

    Uses TransformerLens' ``ActivationCache.accumulated_resid`` on our cache.
    """
    n = model.cfg.n_layers
    wanted = {f"blocks.{l}.hook_resid_pre" for l in range(n)} | {f"blocks.{n - 1}.hook_resid_post"}
    logits, cache = model.run_with_cache(tokens, names_filter=lambda name: name in wanted)
    return cache.accumulated_resid(layer=None, incl_mid=False), logits


def _project(model, resid: Float[Tensor, "layer batch pos d_model"]) -> Float[Tensor, "layer batch pos d_vocab"]:
    """Final norm (its statistics recomputed per layer, as the lens needs) and unembedding."""
    return torch.stack([model.unembed(model.ln_final(r)) for r in resid])


def _lens_table(
    model,
    tokens: Tensor,
    lens_logits: Float[Tensor, "layer batch pos d_vocab"],
    final_logits: Float[Tensor, "batch pos d_vocab"],
    k: int,
    targets: Optional[Tensor],
    lens_name: str,
) -> pd.DataFrame:
    n_layer, batch, pos, _ = lens_logits.shape
    k = check_int("k", k, 1, model.cfg.d_vocab)
    if targets is not None:
        if not isinstance(targets, Tensor) or targets.shape != tokens.shape:
            raise ValueError(f"targets must be a tensor of token ids shaped like tokens {tuple(tokens.shape)}, "
                             f"got {tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__}")
        targets = check_token_ids("targets", targets, model.cfg.d_vocab, allow=(-1,)).to(tokens.device)
    logp = lens_logits.float().log_softmax(-1)
    final_logp = final_logits.float().log_softmax(-1)
    kl = (final_logp.exp() * (final_logp - logp)).sum(-1)  # KL(final || lens)
    entropy = -(logp.exp() * logp).sum(-1)
    top_p, top_i = logp.exp().topk(k, dim=-1)
    if targets is None:  # the next token; the last position has none
        targets = torch.full_like(tokens, -1)
        targets[:, :-1] = tokens[:, 1:]
    has_target = targets >= 0
    safe = targets.clamp(min=0)[None].expand(n_layer, -1, -1)
    target_logit = lens_logits.gather(-1, safe[..., None]).squeeze(-1)
    target_rank = (lens_logits > target_logit[..., None]).sum(-1) + 1  # 1 = the top token
    target_prob = logp.gather(-1, safe[..., None]).squeeze(-1).exp()

    grid = np.meshgrid(np.arange(n_layer), np.arange(batch), np.arange(pos), indexing="ij")
    layer, b, p = (g.ravel() for g in grid)
    labels = np.array(str_tokens(model, torch.arange(model.cfg.d_vocab)) + [""], dtype=object)
    n = model.cfg.n_layers
    frame = {
        "lens": lens_name,
        "batch": b,
        "layer": layer,
        "layer_label": np.where(layer == n, "final", np.char.add("resid_pre ", layer.astype(str))),
        "pos": p,
        "token": labels[tokens.cpu().numpy()[b, p]],
        "target_id": targets.cpu().numpy()[b, p],
    }
    frame["target"] = labels[frame["target_id"]]  # -1 picks the trailing ""
    mask = has_target[None].expand(n_layer, -1, -1).cpu().numpy().ravel()
    frame["target_prob"] = np.where(mask, target_prob.cpu().numpy().ravel(), np.nan)
    frame["target_rank"] = np.where(mask, target_rank.cpu().numpy().ravel(), -1)
    frame["kl_to_final"] = kl.cpu().numpy().ravel()
    frame["entropy"] = entropy.cpu().numpy().ravel()
    ids, probs = top_i.cpu().numpy().reshape(-1, k), top_p.cpu().numpy().reshape(-1, k)
    for j in range(k):
        frame[f"top{j + 1}"] = labels[ids[:, j]]
        frame[f"top{j + 1}_id"] = ids[:, j]
        frame[f"top{j + 1}_prob"] = probs[:, j]
    return pd.DataFrame(frame)


@torch.no_grad()
def logit_lens(
    model,
    tokens: Union[str, Int[Tensor, "batch pos"]],
    k: int = 5,
    targets: Optional[Int[Tensor, "batch pos"]] = None,
) -> pd.DataFrame:
    """The logit lens at every layer and position.

    Columns: lens, batch, layer, layer_label, pos, token, target_id, target, target_prob,
    target_rank (1 = top), kl_to_final (KL(final || lens), nats), entropy, and for the top
    ``k`` tokens ``top{i}``, ``top{i}_id``, ``top{i}_prob``. ``targets`` defaults to the next
    token (none at the last position: target_rank -1, target_prob NaN); a target of -1 means none.
    """
    tokens = as_tokens(model, tokens)
    resid, final_logits = residual_stack(model, tokens)
    return _lens_table(model, tokens, _project(model, resid), final_logits, k, targets, "logit")


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
        """Translate a stack of n_layers + 1 streams; the last (final) one passes through."""
        moved = torch.einsum("lbpd,led->lbpe", resid[:-1], self.weight) + self.bias[:, None, None]
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
            tmps = [directory / f".{n}.tmp-{os.getpid()}" for n in names]
            try:  # each file replaced atomically, so a reader never sees half a lens file
                save_file(weights, str(tmps[0]))
                os.replace(tmps[0], directory / TUNED_LENS_WEIGHTS)
                tmps[1].write_text(json.dumps(meta, indent=2) + "\n")
                os.replace(tmps[1], directory / TUNED_LENS_META)
            finally:
                for tmp in tmps:
                    tmp.unlink(missing_ok=True)
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


def train_tuned_lens(
    model,
    data: Int[Tensor, "n pos"],
    steps: int = 300,
    batch_size: int = 16,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> TunedLens:
    """Fit a translator per layer to minimise KL(final || lens) on ``data`` (the model's own text).

    All layers train together (their losses are independent, so this is L separate fits);
    the model is frozen. The loss history is kept in ``lens.info["history"]``.
    """
    data = as_tokens(model, data)
    steps, batch_size = check_int("steps", steps, 0), check_int("batch_size", batch_size, 1)
    lr, seed = check_float("lr", lr, 0, None, lo_open=True), check_seed("seed", seed)
    lens = TunedLens(model.cfg.n_layers, model.cfg.d_model).to(model.device)
    opt = torch.optim.Adam(lens.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / max(steps, 1))
    gen = torch.Generator().manual_seed(seed)
    history: list[float] = []
    with eval_mode(model):
        try:
            # The model is frozen, so its residual streams are computed once, not once per step.
            with torch.no_grad():
                streams = torch.cat([residual_stack(model, chunk)[0] for chunk in data.split(64)], dim=1)
            for _ in tqdm(range(steps), disable=not progress, desc="tuned lens"):
                rows = torch.randint(0, data.shape[0], (min(batch_size, data.shape[0]),), generator=gen)
                resid = streams[:, rows.to(streams.device)]
                with torch.no_grad():
                    final_logp = _project(model, resid[-1:])[0].float().log_softmax(-1)
                logp = _project(model, lens.translate(resid)[:-1]).float().log_softmax(-1)
                kl = (final_logp.exp() * (final_logp - logp)).sum(-1).mean(dim=(1, 2))  # [layer]
                opt.zero_grad(set_to_none=True)
                kl.sum().backward()
                opt.step()
                sched.step()
                history.append(float(kl.detach().mean()))
        finally:
            for p in model.parameters():  # backward left grads on the frozen model
                p.grad = None
    lens.info = {"train": {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed,
                           "n_sequences": int(data.shape[0]), "seq_len": int(data.shape[1])},
                 "history": history}
    return lens


@torch.no_grad()
def tuned_lens(
    model,
    tokens: Union[str, Int[Tensor, "batch pos"]],
    lens: TunedLens,
    k: int = 5,
    targets: Optional[Int[Tensor, "batch pos"]] = None,
) -> pd.DataFrame:
    """The tuned lens at every layer and position; the same columns as ``logit_lens``."""
    lens.check_fits(model)
    tokens = as_tokens(model, tokens)
    resid, final_logits = residual_stack(model, tokens)
    return _lens_table(model, tokens, _project(model, lens.translate(resid)), final_logits, k, targets, "tuned")


def compare_lenses(model, tokens: Union[str, Int[Tensor, "batch pos"]], lens: TunedLens) -> pd.DataFrame:
    """Mean KL to the final distribution per layer for both lenses: columns layer, lens, kl."""
    both = pd.concat([logit_lens(model, tokens, k=1), tuned_lens(model, tokens, lens, k=1)])
    return both.groupby(["layer", "lens"], as_index=False)["kl_to_final"].mean().rename(columns={"kl_to_final": "kl"})
