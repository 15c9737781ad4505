"""Prompt input: the default prompt of a checkpoint, the prompt box, and its encoding (an unusable
prompt becomes a message in the page)."""

from __future__ import annotations

from typing import Optional

import streamlit as st
import torch

from workbench.tokenizer import IdTokenizer, unknown_pieces
from ui.common.loading import Checkpoint


# An indirect-object sentence of the stories grammar: the shipped stories models should answer "Mary".
DEFAULT_PROMPT = ("Once upon a time, Mary and John lived in a small town. "
                  "When Mary and John went to the store, John gave a drink to")


# Every attention pattern of one prompt, [layers x heads x pos x pos] float32, may fill at most this: Inspect
# caches them all in its one forward, and the server's memory is shared by every page and session. A
# 2,501-token prompt of SmolLM2-135M (30 layers x 9 heads) asked for 6.8 GB of patterns beside 15 GB of logit
# lens, and the kernel killed the server; 1 GiB lets SmolLM2 read 997 tokens, the shipped models their context.
PATTERN_BUDGET_BYTES = 1 << 30


def _pattern_bytes(cfg, n_tokens: int) -> int:
    """Every attention pattern of one prompt of ``n_tokens``: layers x heads x n_tokens^2 float32s."""
    return 4 * cfg.n_layers * cfg.n_heads * n_tokens**2


def max_prompt_tokens(cfg) -> int:
    """The longest prompt the app analyses on a model of config ``cfg``: its context, or fewer when every
    attention pattern of a longer prompt would pass ``PATTERN_BUDGET_BYTES``."""
    return max(2, min(cfg.n_ctx, int((PATTERN_BUDGET_BYTES / max(1, _pattern_bytes(cfg, 1))) ** 0.5)))


# ---- prompts -------------------------------------------------------------------------------------
def default_prompt(ckpt: Optional[Checkpoint]) -> str:
    """A prompt the checkpoint can read: meta.json's ``default_prompt``, the IOI sentence for a real
    language model (a converted GGUF file), else a stories sentence."""
    if ckpt is None:
        return DEFAULT_PROMPT
    if isinstance(ckpt.meta.get("default_prompt"), str):
        return ckpt.meta["default_prompt"]
    from ui.common import pretrained

    if pretrained.is_text_model(ckpt.path, ckpt.meta):  # a real language model: a real sentence
        return pretrained.PROMPT
    if isinstance(ckpt.tokenizer, IdTokenizer):
        return ckpt.tokenizer.decode(_id_prompt(ckpt))
    return DEFAULT_PROMPT


def _id_prompt(ckpt: Checkpoint) -> list[int]:
    """A prompt of token ids that fits the model's context: the first clean prompt of the task it
    was trained on (``a b = `` for modular addition, a repeated segment for induction), else a
    random segment seen twice (what induction heads copy), at most half the context long."""
    from workbench.analysis.circuits.tasks import prompt_spec
    from workbench.planted import spec_prompts

    try:
        spec = prompt_spec(ckpt.meta, ckpt.cfg, ckpt.path)
        ids = spec_prompts(spec, batch=1, seed=0)[0][0].tolist() if spec else None
    except (ValueError, KeyError, TypeError):
        ids = None
    if ids and len(ids) <= ckpt.cfg.n_ctx and max(ids) < ckpt.cfg.d_vocab:
        return ids
    half = max(1, min(12, ckpt.cfg.n_ctx // 2))
    segment = torch.randint(0, ckpt.cfg.d_vocab, (half,), generator=torch.Generator().manual_seed(0)).tolist()
    return segment * 2


def prompt_box(ckpt: Optional[Checkpoint], key: str = "prompt", label: str = "Prompt", where=st,
               default: Optional[str] = None) -> str:
    """A text area whose default (``default``, else the checkpoint's) follows the checkpoint until the user edits it."""
    default = default if default is not None else default_prompt(ckpt)
    last_default = st.session_state.get(f"{key}__default")
    if key not in st.session_state or st.session_state[key] == last_default:
        st.session_state[key] = default
    st.session_state[f"{key}__default"] = default
    return where.text_area(label, key=key, height=80)


def encode_prompt(ckpt: Checkpoint, text: str, min_tokens: int = 2) -> list[int]:
    """Token ids of ``text`` for this checkpoint, or ValueError with a message for the page."""
    if not text or not text.strip():
        raise ValueError("The prompt is empty: type some text.")
    bad = unknown_pieces(ckpt.tokenizer, text)
    if bad:
        shown = ", ".join(repr(b) for b in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise ValueError(
            f"This checkpoint's tokenizer cannot encode {shown}. "
            + ("Type token ids between 0 and {}, separated by spaces.".format(ckpt.cfg.d_vocab - 1)
               if isinstance(ckpt.tokenizer, IdTokenizer)
               else f"Use only what its vocabulary ({ckpt.tokenizer.vocab_size} tokens) contains.")
        )
    ids = ckpt.tokenizer.encode(text)
    if len(ids) > ckpt.cfg.n_ctx:
        raise ValueError(
            f"The prompt is {len(ids)} tokens; this model's context is {ckpt.cfg.n_ctx} tokens. Shorten the prompt."
        )
    limit = max_prompt_tokens(ckpt.cfg)
    if len(ids) > limit:
        gib = _pattern_bytes(ckpt.cfg, len(ids)) / (1 << 30)
        raise ValueError(
            f"The prompt is {len(ids):,} tokens; the app analyses at most {limit:,} on this model: its "
            f"{ckpt.cfg.n_layers} x {ckpt.cfg.n_heads} attention patterns alone would take {gib:.1f} GiB at "
            f"{len(ids):,} tokens, in a server every page shares. Shorten the prompt, or analyse it from Python "
            "(workbench.analysis), where you choose what is cached."
        )
    if len(ids) < min_tokens:
        raise ValueError(f"The prompt is {len(ids)} token(s); at least {min_tokens} are needed to score a prediction.")
    return ids


def prompt_ids(ckpt: Checkpoint, text: str, where=st) -> Optional[tuple[int, ...]]:
    """:func:`encode_prompt`, with the message shown in the page instead of raised."""
    try:
        return tuple(encode_prompt(ckpt, text))
    except ValueError as e:
        where.warning(str(e))
        return None
