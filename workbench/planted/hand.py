"""A hand-built induction model: every weight written, none trained, so its circuit is known exactly.

Two attention-only layers of three heads, no norms, learned (one-hot) positions. The
residual stream is cut into named 16-dimensional subspaces, and each head reads and writes
only its own:

    TOK   the token (embedding)          POS   the position (positional embedding)
    PREV  the previous token (L0H0)      JUNK  the previous token again (L0H1)
    CUR   the current token (L0H2)       SINK  written by L1H1, read by nobody
    OUT   what the unembedding reads

    L0H0  previous-token head: attends i -> i-1 by position, copies TOK into PREV     (circuit)
    L0H1  the same pattern, copies TOK into JUNK                                    (distractor)
    L0H2  attends to itself, copies TOK into CUR                                    (distractor)
    L1H0  induction head: query TOK, key PREV (K-composition with L0H0), value TOK -> OUT (circuit)
    L1H1  induction pattern too (key JUNK, K-composition with L0H1), value CUR -> SINK  (distractor)
    L1H2  attends to position 0 (always BOS), writes a constant into OUT            (distractor)

Prompts are ``[BOS, r, r]`` with ``r`` distinct tokens; corrupted prompts ``[BOS, s, s]``. The
circuit is the five edges through which the corruption reaches the answer:
``embed -> L0H0.v``, ``L0H0 -> L1H0.k``, ``embed -> L1H0.q``, ``embed -> L1H0.v``, ``L1H0 -> logits``.
Every other edge is zero-effect by construction: its sender writes a subspace its receiver
does not read (e.g. ``embed -> L0H0.q`` carries only token changes into a head whose query
reads only positions), or its sender does not differ between the two prompts (L1H2).
The distractors are there to fool the shortcuts: L0H1 and L1H1 are a second, complete
induction mechanism (high previous-token and induction scores, large activation changes)
whose output nobody reads, and L1H2 has a large direct logit attribution and no effect.

The induction head's match is left soft (a score of 12 against 0) so gradients through its
softmax are small but not zero; the positional heads are hard (40).
"""

from __future__ import annotations

import torch

from workbench.config import ModelConfig
from workbench.model import HookedDecoder

VOCAB, N_CTX, HALF, WIDTH = 16, 16, 7, 16
BOS = VOCAB - 1
SUBSPACES = ("TOK", "POS", "PREV", "JUNK", "CUR", "SINK", "OUT")
HARD, SOFT, UNEMBED_SCALE = 40.0, 12.0, 12.0
TRUTH = ["embed -> L0H0.v", "L0H0 -> L1H0.k", "embed -> L1H0.q", "embed -> L1H0.v", "L1H0 -> logits"]


def _dims(name: str) -> slice:
    start = SUBSPACES.index(name) * WIDTH
    return slice(start, start + WIDTH)


def config() -> ModelConfig:
    return ModelConfig(d_model=WIDTH * len(SUBSPACES), n_layers=2, n_heads=3, d_head=WIDTH, d_vocab=VOCAB, n_ctx=N_CTX,
                       attn_only=True, norm="none", positional="learned", bias=False, tie_embeddings=False,
                       name="planted-hand-induction", seed=0)


@torch.no_grad()
def build_hand_induction() -> HookedDecoder:
    """The model described in the module docstring (deterministic: no randomness anywhere)."""
    cfg = config()
    model = HookedDecoder(cfg)
    for p in model.parameters():
        p.zero_()
    eye = torch.eye(WIDTH)
    # SDPA scales scores by 1/sqrt(d_head): a query and key entry of sqrt(score * sqrt(d_head)) each give `score`.
    hard, soft = (HARD * WIDTH**0.5) ** 0.5, (SOFT * WIDTH**0.5) ** 0.5
    model.embed.W_E[:, _dims("TOK")] = eye
    model.pos_embed.W_pos[:, _dims("POS")] = eye
    shift = torch.diag(torch.ones(WIDTH - 1), 1)  # position j -> slot j + 1: key j matches query j + 1

    def head(layer: int, h: int, q: tuple, k: tuple, v: str, out: str, out_scale: float = 1.0) -> None:
        attn = model.blocks[layer].attn
        attn.W_Q[h, _dims(q[0])] = q[1]
        attn._W_K[h, _dims(k[0])] = k[1]
        attn._W_V[h, _dims(v)] = eye
        attn.W_O[h, :, _dims(out)] = eye * out_scale

    first_slot = torch.zeros(WIDTH, WIDTH)
    first_slot[:, 0] = 1.0  # every position's query -> slot 0
    head(0, 0, ("POS", eye * hard), ("POS", shift * hard), "TOK", "PREV")
    head(0, 1, ("POS", eye * hard), ("POS", shift * hard), "TOK", "JUNK")
    head(0, 2, ("POS", eye * hard), ("POS", eye * hard), "TOK", "CUR")
    head(1, 0, ("TOK", eye * soft), ("PREV", eye * soft), "TOK", "OUT")
    head(1, 1, ("TOK", eye * soft), ("JUNK", eye * soft), "CUR", "SINK")
    key_first = torch.zeros(WIDTH, WIDTH)
    key_first[0, 0] = 1.0  # only position 0's key has slot 0
    head(1, 2, ("POS", first_slot * hard), ("POS", key_first * hard), "TOK", "OUT", out_scale=0.5)
    model.unembed.W_U_param[_dims("OUT")] = eye * UNEMBED_SCALE
    return model.eval()
