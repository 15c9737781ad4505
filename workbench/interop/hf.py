"""``from_hf`` and ``to_hf``: Hugging Face checkpoints in, workbench models out, and back.

    model = wb.from_hf("path/to/hf-dir")        # or an already-built transformers model
    logits, cache = model.run_with_cache(model.to_tokens("Hello"))
    wb.to_hf(model, "exported/")                # AutoModelForCausalLM.from_pretrained loads it

Reading a directory goes through ``transformers.AutoModelForCausalLM.from_pretrained`` (local
files only), so every on-disk layout transformers understands (sharded safetensors, Mixtral's
per-expert tensors, ...) arrives in one in-memory layout that ``weights.py`` maps. The config is
checked first (``families.config_from_hf``) so an unsupported model fails before its weights
are read.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch

from workbench.checkpoint import atomic_write_dir
from workbench.interop.families import UnsupportedHFConfig, config_from_hf, hf_config_for, hf_family_for
from workbench.interop.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from workbench.interop.weights import state_from_hf, state_to_hf
from workbench.model import HookedDecoder

HF_EXPORT_FORMAT = "workbench.hf_export"  # workbench.json's marker: transformers ignores the extra file


def looks_like_hf_dir(path: Union[str, Path]) -> bool:
    """True when ``path`` holds a Hugging Face model (its config.json names a ``model_type``)."""
    config = Path(path, "config.json")
    if not config.is_file():
        return False
    try:
        return "model_type" in json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def from_hf(
    source: Any,
    *,
    n_ctx: Optional[int] = None,
    tokenizer: Any = None,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device, None] = None,
    fold_ln: bool = False,
    center_writing_weights: bool = False,
    center_unembed: bool = False,
    fold_value_biases: bool = False,
) -> HookedDecoder:
    """A ``HookedDecoder`` with the weights of a Hugging Face causal LM, in eval mode.

    ``source`` is a local model directory or a built ``transformers`` model. The directory's
    tokenizer (or ``tokenizer``, a transformers tokenizer) is attached as ``model.tokenizer``.
    ``n_ctx`` caps the context (default: the model's, extended by its RoPE scaling factor).
    The four processing switches (all off: the weights as imported) run
    ``model.process_weights`` in float32, before the cast to ``dtype``.
    Raises ``UnsupportedHFConfig`` naming the first field the workbench cannot reproduce.
    """
    import transformers

    if isinstance(source, (str, Path)):
        directory = Path(source)
        if not looks_like_hf_dir(directory):
            raise ValueError(f"{directory} is not a Hugging Face model directory (no config.json with a model_type)")
        hf_config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
        family, cfg = config_from_hf(hf_config, n_ctx)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), config=hf_config, dtype=torch.float32, local_files_only=True
        )
        if tokenizer is None:
            tokenizer = load_hf_tokenizer(directory)
    elif isinstance(source, transformers.PreTrainedModel):
        hf_model = source
        if hf_model.get_output_embeddings() is None:
            raise ValueError(
                f"{type(hf_model).__name__} has no language-model head; pass the *ForCausalLM / LMHeadModel class"
            )
        family, cfg = config_from_hf(hf_model.config, n_ctx)
    else:
        raise TypeError(f"from_hf needs a directory path or a transformers model, got {type(source).__name__}")
    model = HookedDecoder(cfg)
    hf_state = {k: v.detach().to("cpu", torch.float32) for k, v in hf_model.state_dict().items()}
    model.load_state_dict(state_from_hf(family, cfg, hf_state, model.state_dict()), strict=True)
    if tokenizer is not None and not isinstance(tokenizer, HFTokenizer):
        tokenizer = HFTokenizer.from_transformers(tokenizer)
    model.tokenizer = tokenizer
    if fold_ln or center_writing_weights or center_unembed or fold_value_biases:
        model.process_weights(fold_ln, center_writing_weights, center_unembed, fold_value_biases)
    model.to(device=device, dtype=dtype)
    return model.eval()


def to_hf(model: HookedDecoder, directory: Union[str, Path], *, tokenizer: Any = None) -> Path:
    """Write ``model`` as a Hugging Face model directory (safetensors + config.json), atomically.

    ``directory`` must be absent, empty, or an earlier export (its ``workbench.json`` lists the
    files the export wrote, which are all it replaces); a downloaded HF model or any other
    folder is refused with a CheckpointError, so nothing the workbench did not write is lost.
    The family is chosen from the config (``families.hf_family_for``); a config with no HF
    equivalent raises ``UnsupportedHFConfig`` naming the component. The tokenizer (argument or
    ``model.tokenizer``) is written when it has an HF form (imported HF, BPE); otherwise a
    warning says it was left out.
    """
    import transformers

    cfg = model.cfg
    family = hf_family_for(cfg)
    hf_config = hf_config_for(cfg, family)
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    hf_tokenizer = _hf_tokenizer(tokenizer)
    if hf_tokenizer is not None:
        for role in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(hf_config, role, getattr(hf_tokenizer, role, None))
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    ours = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    ours = {k: v.detach().to("cpu", torch.float32) for k, v in ours.items()}
    # Parameters only: buffers (rotary tables, masks) are the HF model's own business.
    params = {name for name, _ in hf_model.named_parameters(remove_duplicate=False)}
    expected = {k: v for k, v in hf_model.state_dict().items() if k in params}
    missing, unexpected = hf_model.load_state_dict(state_to_hf(family, cfg, ours, expected), strict=False)
    if unexpected or set(missing) & params:
        raise RuntimeError(f"export to {family} left parameters unmapped: {sorted(set(missing) & params) + unexpected}")

    def write(tmp: Path) -> None:
        hf_model.save_pretrained(str(tmp))
        if hf_tokenizer is not None:
            hf_tokenizer.save_pretrained(str(tmp))

    return atomic_write_dir(directory, write, marker=HF_EXPORT_FORMAT)


def _hf_tokenizer(tokenizer: Any) -> Any:
    if tokenizer is None:
        return None
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.to_transformers()
    if getattr(tokenizer, "kind", None) == "bpe":
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf)
    if hasattr(tokenizer, "save_pretrained"):  # already a transformers tokenizer
        return tokenizer
    warnings.warn(
        f"the {getattr(tokenizer, 'kind', type(tokenizer).__name__)!r} tokenizer has no Hugging Face form; "
        "the exported directory has weights and config only",
        stacklevel=3,
    )
    return None


__all__ = ["from_hf", "to_hf", "looks_like_hf_dir", "UnsupportedHFConfig", "HFTokenizer"]
