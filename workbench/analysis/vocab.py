"""The vocabulary as the model sees it: every token's embedding, its nearest neighbours, and
what the direct path (embed -> final norm -> unembed, no block in between) predicts after it.

For a small vocabulary (the task models here have 64-1000 tokens) this is the first map of a
model: the direct path is the "bigram" part of the logits that every later block adds to, and
tokens whose embeddings sit together are the ones the model treats alike. Positional
embeddings are left out: the direct path of a token is the same at every position only
without them, and that is what these tables describe.

    an.vocabulary_table(model)               # one row per token: norms and the direct path's top-k
    an.token_neighbours(model, "Mary", k=8)  # cosine neighbours in the embedding (or unembedding)
    an.direct_path(model, "Mary", k=10)      # the next tokens the direct path promotes and demotes
"""

from __future__ import annotations

from typing import Union

import pandas as pd
import torch
from torch import Tensor

from workbench.analysis.common import check_choice, str_tokens
from workbench.utils import check_int

SPACES = ("embed", "unembed")


def _direct_logits(model) -> Tensor:
    """[d_vocab, d_vocab] fp32: the logits the direct path gives after each token (row), computed
    in the model's own dtype through its final norm and unembedding."""
    with torch.no_grad():
        # [vocab, 1, d_model]: every token, one position, as the stream holds it (Gemma's scale included)
        resid = model.embed(torch.arange(model.cfg.d_vocab, device=model.embed.W_E.device)[:, None])
        return model.unembed(model.ln_final(resid))[:, 0].float()


def _token_id(model, token: Union[int, str]) -> int:
    if isinstance(token, str):
        if getattr(model, "tokenizer", None) is None:
            raise ValueError("this model has no tokenizer: pass the token's id")
        ids = model.tokenizer.encode(token)
        if len(ids) != 1:
            raise ValueError(f"token {token!r} is {len(ids)} tokens in this vocabulary, not one; pass its id")
        return int(ids[0])
    return check_int("token", token, 0, model.cfg.d_vocab - 1)


def vocabulary_table(model, k: int = 3) -> pd.DataFrame:
    """One row per token: id, token, embed_norm, unembed_norm, and the direct path's top ``k``
    next tokens (``direct_top``, a readable string) with the top one's logit (``direct_logit``)."""
    k = check_int("k", k, 1, model.cfg.d_vocab)
    logits = _direct_logits(model)
    top = logits.topk(k, dim=-1)
    labels = str_tokens(model, torch.arange(model.cfg.d_vocab))
    return pd.DataFrame({
        "id": range(model.cfg.d_vocab),
        "token": labels,
        "embed_norm": model.embed.W_E.detach().float().norm(dim=-1).cpu().numpy(),
        "unembed_norm": model.unembed.W_U.detach().float().norm(dim=0).cpu().numpy(),
        "direct_top": [" ".join(repr(labels[j]) for j in row) for row in top.indices.tolist()],
        "direct_logit": top.values[:, 0].cpu().numpy(),
    })


def token_neighbours(model, token: Union[int, str], k: int = 8, space: str = "embed") -> pd.DataFrame:
    """The ``k`` tokens whose embedding (``space="embed"``, rows of W_E) or unembedding
    (``"unembed"``, columns of W_U) is closest to ``token``'s by cosine similarity, itself excluded."""
    check_choice("space", space, SPACES)
    i = _token_id(model, token)
    k = check_int("k", k, 1, model.cfg.d_vocab - 1)
    vectors = model.embed.W_E.detach() if space == "embed" else model.unembed.W_U.detach().T
    vectors = torch.nn.functional.normalize(vectors.float(), dim=-1)
    sims = vectors @ vectors[i]
    sims[i] = float("-inf")
    top = sims.topk(k)
    return pd.DataFrame({"rank": range(1, k + 1), "id": top.indices.tolist(),
                         "token": str_tokens(model, top.indices), "cosine": top.values.cpu().numpy()})


def direct_path(model, token: Union[int, str], k: int = 10) -> pd.DataFrame:
    """The next tokens the direct path after ``token`` promotes most (``side="top"``) and least
    (``"bottom"``): rank, id, token, logit, and logit minus the mean over the vocabulary."""
    i = _token_id(model, token)
    k = check_int("k", k, 1, model.cfg.d_vocab)
    row = _direct_logits(model)[i]
    centred = row - row.mean()
    frames = []
    for side, largest in (("top", True), ("bottom", False)):
        top = row.topk(k, largest=largest)
        frames.append(pd.DataFrame({"side": side, "rank": range(1, k + 1), "id": top.indices.tolist(),
                                    "token": str_tokens(model, top.indices), "logit": top.values.cpu().numpy(),
                                    "centred_logit": centred[top.indices].cpu().numpy()}))
    return pd.concat(frames, ignore_index=True)
