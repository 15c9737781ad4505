"""TransformerLens habits on a ``HookedDecoder``: the names a TL user types first.

``HookedDecoder`` already answers TL's hook names, ``run_with_cache``, ``to_tokens``,
``to_str_tokens``, ``to_single_token``, ``W_Q``... This module adds the few calls a TL user
reaches for next, each either working as in TL or refusing with a message naming ours:

- ``model.to_single_str_token(id)``: the string of one token id.
- ``model.to_tokens(text, prepend_bos=...)``: True puts the tokenizer's BOS first (once),
  False takes off the BOS its post-processor adds; a tokenizer with no BOS refuses True.
- ``model.set_use_attn_result(flag)``: in TL, ``hook_result`` (each head's write to the
  residual stream) exists only after ``set_use_attn_result(True)``. Here it is computed whenever
  something listens, so True changes nothing; False leaves it out of a default
  ``run_with_cache`` (it is [batch, pos, head, d_model]: the largest entry of a full cache).
- ``HookedDecoder.from_pretrained(name)``: a shipped checkpoint by name, a checkpoint folder, a
  shipped pretrained model (``"smollm2-135m"``) or GGUF file, or a Hugging Face model folder / hub
  id (through ``workbench.from_hf``).

TL's other configuration switches (``set_use_split_qkv_input``, ``set_use_hook_mlp_in``, ...)
have no counterpart to set: the hook points they add (``hook_q_input``, ``hook_mlp_in``) are
listed in ``model.hook_dict`` or they are not, and an unknown name raises naming the known ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch

ATTN_RESULT = "attn.hook_result"


def to_single_str_token(model: Any, token: Union[int, torch.Tensor]) -> str:
    """TL's ``to_single_str_token``: the readable string of one token id."""
    if isinstance(token, torch.Tensor):
        if token.numel() != 1:
            raise ValueError(f"to_single_str_token takes one token id, got a tensor of shape {tuple(token.shape)}")
        token = int(token.item())
    if isinstance(token, bool) or not isinstance(token, int):
        raise ValueError(f"to_single_str_token takes an int token id, got {type(token).__name__}")
    tok = model._need_tokenizer()
    size = tok.vocab_size
    if not 0 <= token < size:
        raise ValueError(f"token id {token} is outside the vocabulary (0..{size - 1})")
    return tok.token_str(token)


def bos_id(tokenizer: Any) -> Optional[int]:
    """The tokenizer's BOS id, or None when it has none (the workbench's own tokenizers have none)."""
    lookup = getattr(tokenizer, "token_id", None)
    return lookup("bos_token") if callable(lookup) else None


def tokenizer_prepends_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer.encode`` puts a BOS first: the model's own default, what its text was encoded
    with. A BOS that is only declared (SmolLM2's GGUF names ``<|im_start|>`` but does not add it) is not."""
    if tokenizer is None:
        return False
    bos = bos_id(tokenizer)
    return bos is not None and tokenizer.encode("a")[:1] == [bos]


def apply_prepend_bos(tokenizer: Any, ids: list[int], prepend_bos: Any) -> list[int]:
    """``ids`` as ``to_tokens(..., prepend_bos=)`` returns them: None keeps the tokenizer's own
    choice, True makes the BOS the first id (never twice), False takes a leading BOS off."""
    if prepend_bos is None:
        return ids
    if not isinstance(prepend_bos, bool):
        raise ValueError(f"prepend_bos must be True, False or None, got {prepend_bos!r}")
    bos = bos_id(tokenizer)
    if bos is None:
        if prepend_bos:
            raise ValueError(
                "this model's tokenizer has no BOS token, so prepend_bos=True cannot add one: the workbench's "
                "own tokenizers never prepend one (model.cfg.default_prepend_bos is False)"
            )
        return ids
    starts = bool(ids) and ids[0] == bos
    if prepend_bos and not starts:
        return [bos, *ids]
    if not prepend_bos and starts:
        return ids[1:]
    return ids


def set_use_attn_result(model: Any, use_attn_result: Any) -> None:
    """TL's switch for ``blocks.{l}.attn.hook_result``; see the module docstring."""
    if not isinstance(use_attn_result, bool):
        raise ValueError(f"set_use_attn_result takes True or False, got {use_attn_result!r}")
    model.use_attn_result = use_attn_result


def default_names_filter(model: Any) -> Any:
    """The ``names_filter`` a ``run_with_cache`` without one uses: every hook point, or every
    one but the per-head results after ``set_use_attn_result(False)``."""
    if getattr(model, "use_attn_result", True):
        return None
    return lambda name: not name.endswith(ATTN_RESULT)


def from_pretrained(cls: Any, name: Union[str, Path], *, device: Any = None,
                    dtype: Union[torch.dtype, str] = torch.float32, **kwargs: Any) -> Any:
    """TL's ``from_pretrained``, for what the workbench opens.

    ``name`` is a shipped checkpoint (``"stories-2020"``, one of the folders in the repository's
    ``checkpoints/``), a folder written by ``save_checkpoint``, a shipped pretrained model
    (``"smollm2-135m"``) or a ``.gguf`` file (``workbench.open_gguf``; ``cache=`` goes to it), or
    anything ``workbench.from_hf`` opens (a Hugging Face model folder or hub id). ``kwargs`` go to the loader (``fold_ln=True``,
    ...). TL's ``from_pretrained`` folds the norms and centres the weights by default; here
    nothing is processed unless asked, as in ``from_hf``.
    """
    from workbench.checkpoint import load_checkpoint
    from workbench.interop import from_hf

    # the repository's checkpoints/ (workbench.planted.CHECKPOINTS; planted sits a layer above this module)
    CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"

    if not isinstance(name, (str, Path)) or not str(name):
        raise ValueError(f"from_pretrained takes a checkpoint name, a folder or a hub id, got {name!r}")
    shipped = CHECKPOINTS / str(name)
    candidates = [Path(name)] + ([shipped] if "/" not in str(name) else [])
    for path in candidates:
        if (path / "meta.json").is_file() and (path / "config.json").is_file() and (path / "model.safetensors").is_file():
            model, _ = load_checkpoint(path, device=device, dtype=dtype, **kwargs)
            if not isinstance(model, cls):
                raise ValueError(f"{path} holds a {type(model).__name__}, not a {cls.__name__}")
            return model
    from workbench.interop.gguf import PRETRAINED, open_gguf, resolve_gguf

    if str(name) in PRETRAINED or str(name).lower().endswith(".gguf"):  # a shipped pretrained model or a GGUF file
        model = open_gguf(resolve_gguf(name), device=device, dtype=dtype, **kwargs)
        if not isinstance(model, cls):
            raise ValueError(f"{name} opens as a {type(model).__name__}, not a {cls.__name__}")
        return model
    try:
        return from_hf(name, device=device, dtype=dtype, **kwargs)
    except Exception as error:  # say what was tried, then what the HF loader said
        shipped_names = sorted(p.name for p in CHECKPOINTS.iterdir() if (p / "meta.json").is_file()) if CHECKPOINTS.is_dir() else []
        raise ValueError(
            f"could not open {str(name)!r}: it is not a shipped checkpoint ({shipped_names}), not a folder written by "
            f"save_checkpoint, and workbench.from_hf said: {error}"
        ) from error
