"""Looking at a dictionary's features: where they fire, how often, and what they write.

    an.feature_table(model, sae, tokens)                    one row per feature: density, max, top logits, top context
    an.max_activating_contexts(model, sae, tokens, 17)      the contexts where feature 17 fires hardest
    an.feature_histogram(model, sae, tokens, 17)            its activation histogram (firing positions only)
    an.feature_logit_effects(model, sae, 17)                the tokens its decoder direction promotes / suppresses
    an.feature_dla(model, sae, tokens, answer, wrong)       each feature's direct share of logit[answer] - logit[wrong]
    an.features_on_token(model, sae, tokens, " to")         the features that fire where that token stands
    an.feature_direction(model, sae, 17)                    its decoder row as a Direction (steer with it)
    with an.feature_edit(model, sae, 17, value=0.0): ...     the feature ablated (or set), nothing else changed

``tokens`` is a ``[batch, pos]`` id tensor, a Task (``n_sequences`` of its validation batches), or
an ActivationStore (the token ids it kept). Activations come from running the model to the
dictionary's hook and encoding there, so they equal ``cache[f"{hook}.hook_sae_acts_post"]`` of a
spliced run. Position 0 (the BOS-like first token) is left out, as in the store.

A decoder direction's effect on the logits goes through the final norm's linear part (centring
for LayerNorm, the weight ``ln_final.w``) and ``W_U``; for a feature at ``mlp.hook_post`` it first
goes through ``W_out``, at ``attn.hook_z`` through ``W_O``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from workbench.analysis.common import check_choice, str_tokens
from workbench.analysis.store import check_hook, hook_layer, stop_layer

Dataset = Union[Tensor, object]


def dataset_tokens(model, dataset: Dataset, n_sequences: int = 256) -> Int[Tensor, "batch pos"]:
    """Token ids ``[n, pos]`` from a tensor, a Task (validation batches) or an ActivationStore."""
    from workbench.analysis.store import ActivationStore
    from workbench.data.base import Task

    if isinstance(dataset, Tensor):
        tokens = dataset if dataset.ndim == 2 else dataset[None]
    elif isinstance(dataset, Task):
        seq_len = dataset.default_seq_len if dataset.fixed_seq_len else min(model.cfg.n_ctx, dataset.default_seq_len)
        tokens = dataset.batch(n_sequences, seq_len, step=0, split="val")
    elif isinstance(dataset, ActivationStore):
        parts, have = [], 0
        for i in range(dataset.n_shards):
            ids = dataset.load_shard(i, [], with_tokens=True)["token_ids"].long()
            parts.append(ids)
            have += len(ids)
            if have >= n_sequences:
                break
        tokens = torch.cat(parts)[:n_sequences]
    else:
        raise ValueError(f"dataset must be token ids, a Task or an ActivationStore, got {type(dataset).__name__}")
    return model._check_tokens(tokens.long())


@torch.no_grad()
def feature_activations(model, sae, tokens: Int[Tensor, "batch pos"], batch_size: int = 64) -> Float[Tensor, "batch pos d_sae"]:
    """Every feature's activation at every position: the hook's activation, encoded."""
    hook = check_hook(model, sae.cfg.hook_name)
    out = []
    for start in range(0, len(tokens), batch_size):
        rows = tokens[start : start + batch_size].to(model.device)
        seen = {}

        def grab(act: Tensor, hook) -> None:
            seen["act"] = act  # noqa: B023 (called within this iteration)

        model.run_with_hooks(rows, return_type=None, stop_at_layer=stop_layer(model, [hook]), fwd_hooks=[(hook, grab)])
        act = seen["act"]
        act = act.flatten(2) if act.ndim > 3 else act
        if act.shape[-1] != sae.cfg.d_in:
            raise ValueError(f"the dictionary's d_in={sae.cfg.d_in} does not match {hook} ({act.shape[-1]} features)")
        out.append(sae.encode(act.to(sae.device)).float().cpu())
    return torch.cat(out)


def _kept(acts: Tensor, exclude_first: bool) -> Tensor:
    if exclude_first:
        acts = acts.clone()
        acts[:, 0] = 0
    return acts


def _check_feature(sae, feature: int) -> int:
    if not isinstance(feature, (int, np.integer)) or not 0 <= feature < sae.cfg.d_sae:
        raise ValueError(f"feature={feature!r} out of range: valid features are 0..{sae.cfg.d_sae - 1}")
    return int(feature)


def _context(labels: list[str], pos: int, window: int) -> tuple[str, str, str]:
    left = "".join(_spaced(labels[max(0, pos - window) : pos]))
    right = "".join(_spaced(labels[pos + 1 : pos + 1 + max(1, window // 4)]))
    return left, labels[pos], right


def _spaced(labels: Sequence[str]) -> list[str]:
    return [label if label.startswith(" ") else f" {label}" for label in labels]


@torch.no_grad()
def max_activating_contexts(model, sae, dataset: Dataset, feature: int, k: int = 10, window: int = 12,
                            n_sequences: int = 256, exclude_first: bool = True) -> pd.DataFrame:
    """The ``k`` positions where ``feature`` is largest, with the tokens before (and a few after) each.

    Columns: rank, sequence, position, activation, token, left, right, context (the token in
    ``[[ ]]``), and per-position ``context_tokens`` / ``context_acts`` lists for highlighting.
    """
    feature = _check_feature(sae, feature)
    tokens = dataset_tokens(model, dataset, n_sequences)
    acts = _kept(feature_activations(model, sae, tokens)[..., feature], exclude_first)
    values, flat = acts.flatten().topk(min(k, acts.numel()))
    rows = []
    for rank, (value, index) in enumerate(zip(values.tolist(), flat.tolist())):
        if value <= 0:
            break
        seq, pos = divmod(index, tokens.shape[1])
        labels = str_tokens(model, tokens[seq])
        left, token, right = _context(labels, pos, window)
        lo, hi = max(0, pos - window), min(len(labels), pos + 1 + max(1, window // 4))
        rows.append({"feature": feature, "rank": rank, "sequence": seq, "position": pos, "activation": value,
                     "token": token, "left": left, "right": right, "context": f"{left} [[{token.strip()}]]{right}",
                     "context_tokens": labels[lo:hi], "context_acts": acts[seq, lo:hi].tolist(),
                     "context_max": pos - lo})
    return pd.DataFrame(rows, columns=["feature", "rank", "sequence", "position", "activation", "token", "left",
                                       "right", "context", "context_tokens", "context_acts", "context_max"])


@torch.no_grad()
def feature_histogram(model, sae, dataset: Dataset, feature: int, bins: int = 30, n_sequences: int = 256,
                      exclude_first: bool = True) -> pd.DataFrame:
    """Histogram of ``feature``'s non-zero activations: bin_left, bin_right, count, and its density."""
    feature = _check_feature(sae, feature)
    tokens = dataset_tokens(model, dataset, n_sequences)
    acts = feature_activations(model, sae, tokens)[..., feature]
    acts = acts[:, 1:] if exclude_first else acts
    firing = acts[acts > 0].numpy()
    counts, edges = np.histogram(firing, bins=bins) if len(firing) else (np.zeros(bins, dtype=int), np.linspace(0, 1, bins + 1))
    return pd.DataFrame({"feature": feature, "bin_left": edges[:-1], "bin_right": edges[1:], "count": counts,
                         "density": len(firing) / max(1, acts.numel())})


def decoder_directions(model, sae) -> Float[Tensor, "d_sae d_model"]:
    """Each feature's decoder row as a residual-stream direction (through W_out / W_O for MLP / head hooks)."""
    name = sae.cfg.hook_name_out if sae.is_transcoder else sae.cfg.hook_name
    W = sae.W_dec.detach()
    layer = hook_layer(name)
    residual = name.endswith(("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out",
                              "hook_mlp_out")) or name in ("hook_embed", "hook_pos_embed")
    if residual and W.shape[1] == model.cfg.d_model:
        return W.to(model.device)
    if layer is not None and name.endswith(("mlp.hook_post", "attn.hook_z")) and model.cfg.norm_placement in (
            "sandwich", "reordered"):
        raise ValueError(f"features at {name} reach the residual stream through the {model.cfg.norm_placement} "
                         "block's output norm (ln1_post / ln2_post), which is not linear: no fixed direction; "
                         "use a dictionary at hook_attn_out / hook_mlp_out or the residual stream")
    if layer is not None and name.endswith("mlp.hook_post"):
        return W.to(model.device) @ model.blocks[layer].mlp.W_out
    if layer is not None and name.endswith("attn.hook_z"):
        W_O = model.blocks[layer].attn.W_O  # [n_heads, d_head, d_model]
        return torch.einsum("fhd,hdm->fm", W.to(model.device).view(W.shape[0], *W_O.shape[:2]), W_O)
    raise ValueError(f"cannot map features at {name} to the residual stream (supported: residual-stream hooks, "
                     "hook_attn_out, hook_mlp_out, mlp.hook_post, attn.hook_z)")


def _through_final_norm(model, directions: Tensor) -> Tensor:
    if model.cfg.norm_placement == "post":
        raise ValueError("logit effects of a direction assume a pre-norm residual stream; this model is post-norm")
    if model.cfg.norm == "layernorm":
        directions = directions - directions.mean(-1, keepdim=True)
    if model.cfg.norm != "none":
        directions = directions * model.ln_final.w
    return directions


@torch.no_grad()
def logit_effects(model, sae) -> Float[Tensor, "d_sae d_vocab"]:
    """Each feature's decoder direction through the final norm's linear part and W_U."""
    return _through_final_norm(model, decoder_directions(model, sae)) @ model.W_U


@torch.no_grad()
def feature_logit_effects(model, sae, feature: int, k: int = 10) -> pd.DataFrame:
    """The ``k`` tokens ``feature`` promotes most (``top``) and suppresses most (``bottom``)."""
    feature = _check_feature(sae, feature)
    effects = logit_effects(model, sae)[feature].float().cpu()
    k = min(k, len(effects))
    rows = []
    for direction, (values, ids) in (("top", effects.topk(k)), ("bottom", (-effects).topk(k))):
        labels = str_tokens(model, ids)
        for rank, (value, token_id, label) in enumerate(zip(values.tolist(), ids.tolist(), labels)):
            rows.append({"feature": feature, "direction": direction, "rank": rank, "token_id": token_id,
                         "token": label, "effect": value if direction == "top" else -value})
    return pd.DataFrame(rows)


@torch.no_grad()
def feature_table(model, sae, dataset: Dataset, n_logits: int = 5, n_sequences: int = 256, window: int = 8,
                  exclude_first: bool = True, density: Optional[Tensor] = None) -> pd.DataFrame:
    """One row per feature: density, mean activation when firing, max, its top context, top / bottom logits.

    ``density`` (e.g. the training run's, in ``sae.feature_density``) replaces the one measured here.
    """
    tokens = dataset_tokens(model, dataset, n_sequences)
    acts = feature_activations(model, sae, tokens)
    acts = acts[:, 1:] if exclude_first else acts
    offset = 1 if exclude_first else 0
    flat = acts.reshape(-1, acts.shape[-1])
    firing = flat > 0
    counts = firing.sum(0)
    measured = counts.float() / max(1, flat.shape[0])
    max_act, where = flat.max(0)
    mean_act = flat.sum(0) / counts.clamp_min(1)
    effects = logit_effects(model, sae).float().cpu()
    top = effects.topk(min(n_logits, effects.shape[1]), dim=1).indices
    bottom = (-effects).topk(min(n_logits, effects.shape[1]), dim=1).indices
    rows = []
    for f in range(sae.cfg.d_sae):
        context = ""
        if counts[f] > 0:
            seq, pos = divmod(int(where[f]), acts.shape[1])
            labels = str_tokens(model, tokens[seq])
            left, token, right = _context(labels, pos + offset, window)
            context = f"{left} [[{token.strip()}]]{right}"
        rows.append({
            "feature": f,
            "density": float(density[f]) if density is not None else float(measured[f]),
            "measured_density": float(measured[f]),
            "mean_activation": float(mean_act[f]),
            "max_activation": float(max_act[f]),
            "top_context": context,
            "top_logits": str_tokens(model, top[f]),
            "bottom_logits": str_tokens(model, bottom[f]),
        })
    return pd.DataFrame(rows)


@torch.no_grad()
def feature_dla(model, sae, tokens: Union[str, Int[Tensor, "batch pos"]], answer, wrong=None, pos: int = -1) -> pd.DataFrame:
    """Each firing feature's direct share of ``logit[answer] - logit[wrong]`` (or ``logit[answer]``) at ``pos``.

    ``activation * direction . (W_U[:, answer] - W_U[:, wrong])`` with the final norm's scale of this run
    frozen, as in ``direct_logit_attribution``: the part the feature writes straight to the logits
    (not through later layers). One row per (batch, feature) where the feature fires, sorted by |dla|.
    """
    from workbench.analysis.attribution import _token_ids
    from workbench.analysis.common import as_tokens

    tokens = as_tokens(model, tokens)
    answer_ids = _token_ids(model, "answer", answer, tokens.shape[0])
    target = model.W_U[:, answer_ids].T  # [batch, d_model]
    if wrong is not None:
        target = target - model.W_U[:, _token_ids(model, "wrong", wrong, tokens.shape[0])].T
    hook = sae.cfg.hook_name
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in (hook, "ln_final.hook_scale"))
    act = cache[hook][:, pos]
    act = act.flatten(1) if act.ndim > 2 else act
    acts = sae.encode(act.to(sae.device)).float()  # [batch, d_sae]
    directions = _through_final_norm(model, decoder_directions(model, sae)).float()  # [d_sae, d_model]
    per_unit = target.float() @ directions.T  # [batch, d_sae]
    if model.cfg.norm != "none":
        per_unit = per_unit / cache["ln_final.hook_scale"][:, pos].float()
    dla = (acts * per_unit).cpu()
    batch_idx, feats = (acts > 0).nonzero(as_tuple=True)
    frame = pd.DataFrame({"batch": batch_idx.cpu().numpy(), "feature": feats.cpu().numpy(),
                          "activation": acts[batch_idx, feats].cpu().numpy(),
                          "dla": dla[batch_idx.cpu(), feats.cpu()].numpy()})
    return frame.reindex(frame["dla"].abs().sort_values(ascending=False).index).reset_index(drop=True)


@torch.no_grad()
def prompt_feature_activations(model, sae, tokens: Union[str, Int[Tensor, "batch pos"]], feature: int) -> pd.DataFrame:
    """``feature``'s activation at every position of ``tokens``: one row per (batch, pos) with the token."""
    from workbench.analysis.common import as_tokens

    feature = _check_feature(sae, feature)
    tokens = as_tokens(model, tokens)
    acts = feature_activations(model, sae, tokens)[..., feature]
    rows = []
    for b in range(len(tokens)):
        labels = str_tokens(model, tokens[b])
        rows += [{"batch": b, "pos": p, "token": labels[p], "activation": float(acts[b, p])}
                 for p in range(tokens.shape[1])]
    return pd.DataFrame(rows)


@torch.no_grad()
def features_on_token(model, sae, dataset: Dataset, token: str, n_sequences: int = 256,
                      exclude_first: bool = True) -> pd.DataFrame:
    """The features that fire where ``token`` stands (its string as ``str_tokens`` shows it, spaces
    ignored): one row per feature that fires there at least once, most often first.

    Columns: feature, fires (positions of the token where it fires), occurrences (positions
    of the token), fraction (fires / occurrences), mean_activation (over those firings).
    ValueError when the token never occurs in the dataset.
    """
    tokens = dataset_tokens(model, dataset, n_sequences)
    want = token.strip()
    if not want:
        raise ValueError("token is empty: type a token such as 'to'")
    labels = np.array([[t.strip() for t in str_tokens(model, row)] for row in tokens])
    where = torch.as_tensor(labels == want)
    if exclude_first:
        where[:, 0] = False
    occurrences = int(where.sum())
    if occurrences == 0:
        raise ValueError(_absent_token(getattr(model, "tokenizer", None), want, len(tokens)))
    acts = feature_activations(model, sae, tokens)[where]  # [occurrences, d_sae]
    fires = (acts > 0).sum(0)
    mean = acts.sum(0) / fires.clamp_min(1)
    frame = pd.DataFrame({"feature": np.arange(sae.cfg.d_sae), "fires": fires.numpy(), "occurrences": occurrences,
                          "fraction": (fires.float() / occurrences).numpy(), "mean_activation": mean.numpy()})
    frame = frame[frame["fires"] > 0]
    return frame.sort_values(["fraction", "mean_activation"], ascending=False).reset_index(drop=True)


def _absent_token(tokenizer, want: str, n_sequences: int) -> str:
    """Why ``want`` was found nowhere: outside the tokenizer's vocabulary (its ``unknown_pieces``: a word
    tokenizer's unseen word), more than one token under it, or one token these sequences lack."""
    from workbench.tokenizer import unknown_pieces

    if tokenizer is not None:
        unknown = unknown_pieces(tokenizer, want)
        size = getattr(tokenizer, "vocab_size", "?")
        if unknown:
            return (f"the token {want!r} is not in this tokenizer's vocabulary ({size} tokens; "
                    f"{', '.join(map(repr, unknown))} would encode as its unknown token)")
        encode = getattr(tokenizer, "encode", None)
        if encode is not None:
            lengths = {len(encode(text)) for text in (want, " " + want)}
            if 1 not in lengths:  # neither alone nor after a space is it one token
                return (f"{want!r} is not one token of this tokenizer ({size} tokens): it encodes as "
                        f"{min(lengths)} or more; type one token as the Inspect page labels it")
    return f"the token {want!r} does not occur in these {n_sequences} sequences"


def feature_direction(model, sae, feature: int):
    """``feature``'s decoder row as a ``Direction`` at the hook the dictionary writes to (its output
    hook for a transcoder), with the dictionary's hook and the feature as provenance: steering
    with it at scale ``s`` adds ``s`` units of the feature's output."""
    from workbench.analysis.directions import Direction, model_stamp

    feature = _check_feature(sae, feature)
    hook = sae.cfg.hook_name_out if sae.is_transcoder else sae.cfg.hook_name
    if len(sae.cfg.hook_shape) != 1 and not sae.is_transcoder:
        raise ValueError(f"features at {hook} (shape {list(sae.cfg.hook_shape)}) are not one vector per position; "
                         "steering needs a residual, attention-out, MLP-out or MLP-neuron hook")
    direction = Direction(sae.W_dec[feature].detach(), hook, {
        "kind": "sae_feature", "feature": feature, "dictionary_hook": sae.cfg.hook_name,
        "d_sae": sae.cfg.d_sae, "model": model_stamp(model)})
    return direction.check(model, check_model=False)


EDIT_MODES = ("set", "scale")


@contextlib.contextmanager
def feature_edit(model, sae, feature: int, value: float = 0.0, mode: str = "set") -> Iterator:
    """Inside the block, ``sae`` is spliced in at its hook with the error term and ``feature``'s
    activation is set to ``value`` (``mode="set"``; 0 ablates it) or multiplied by it
    (``"scale"``), everywhere. The error term keeps everything else as it was, so the hook's
    value changes by exactly ``(new - old) * W_dec[feature]``."""
    from workbench.analysis.splice import spliced

    feature = _check_feature(sae, feature)
    check_choice("mode", mode, EDIT_MODES)
    if not np.isfinite(value):
        raise ValueError(f"value must be a finite number, got {value!r}")
    hook_out = sae.cfg.hook_name_out if sae.is_transcoder else sae.cfg.hook_name

    def edit(acts: Tensor, hook) -> Tensor:
        acts = acts.clone()
        acts[..., feature] = value if mode == "set" else acts[..., feature] * value
        return acts

    with spliced(model, sae, error_term=True):
        with model.hooks(fwd_hooks=[(f"{hook_out}.hook_sae_acts_post", edit)]):
            yield model


def feature_ablation_comparison(model, sae, tokens: Union[str, Int[Tensor, "batch pos"]], feature: int,
                                value: float = 0.0, max_new_tokens: int = 24) -> dict[str, pd.DataFrame]:
    """``edit_comparison`` of one prompt clean and with ``feature`` set to ``value`` (0: ablated)
    by ``feature_edit``: both greedy continuations and the prompt's per-token losses; the edited
    run is labelled ``"ablated"``."""
    from workbench.analysis.directions import edit_comparison

    feature = _check_feature(sae, feature)
    return edit_comparison(model, tokens, lambda: feature_edit(model, sae, feature, value), max_new_tokens,
                           label="ablated")


def check_dictionary(model, sae) -> Optional[str]:
    """ValueError unless ``sae``'s hooks exist on ``model`` with the widths and shape it reads and
    writes; a warning (a string) when it was trained on another model or other weights; else None
    (``workbench.analysis.splice.check_fits``, what splicing checks too)."""
    from workbench.analysis.splice import check_fits

    return check_fits(model, sae)
