"""``from_hf`` and ``to_hf``: Hugging Face checkpoints in, workbench models out, and back.

    model = wb.from_hf("gpt2")                                   # a hub id, through huggingface_hub's cache
    model = wb.from_hf("meta-llama/Llama-3.1-8B", dtype=torch.bfloat16, device="cuda")
    model = wb.from_hf("path/to/hf-dir", fold_ln=True)           # or an already-built transformers model
    wb.to_hf(model, "exported/")                                 # AutoModelForCausalLM.from_pretrained loads it

A directory (or a hub id, resolved to its cached snapshot by ``hub.py``) is read without
building the transformers model: the config is checked first (``families.config_from_hf``, so
an unsupported model fails before its weights are read), then the safetensors shards are
streamed tensor by tensor into our layout, dtype and device (``streaming.py``). A built
transformers model goes through the same weight table from its ``state_dict``. Export writes
sharded safetensors the same way, one tensor at a time, plus config.json and the tokenizer.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch

from workbench.checkpoint import atomic_write_dir
from workbench.interop.families import FAMILIES, UnsupportedHFConfig, config_from_hf, hf_config_for, hf_family_for
from workbench.interop.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from workbench.interop.hub import HFImportError, resolve_hf_source
from workbench.interop.streaming import (
    DEFAULT_MAX_SHARD_SIZE,
    check_placement,
    fill_model,
    float32_weights,
    load_hf_weights,
    model_shapes,
    parse_size,
    unfilled_model,
    write_sharded,
)
from workbench.interop.weights import DictSource, import_tensors, layout_of, plan_export, plan_import
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
    dtype: Union[torch.dtype, str] = torch.float32,
    device: Union[str, torch.device, None] = None,
    fold_ln: bool = False,
    center_writing_weights: bool = False,
    center_unembed: bool = False,
    fold_value_biases: bool = False,
    revision: Optional[str] = None,
    token: Union[str, bool, None] = None,
) -> HookedDecoder:
    """A ``HookedDecoder`` with the weights of a Hugging Face causal LM, in eval mode.

    ``source`` is a local model directory, a hub id (``"gpt2"``, ``"org/name"``; downloaded
    through huggingface_hub's cache, or read from it alone when ``HF_HUB_OFFLINE=1``; ``revision``
    and ``token`` go to the Hub), or a built ``transformers`` model. The weights arrive on
    ``device`` in ``dtype`` without a transformers model or a second copy of them in memory.
    The directory's tokenizer (or ``tokenizer``, a transformers tokenizer) is attached as
    ``model.tokenizer``. ``n_ctx`` caps the context (default: the model's, extended by its RoPE
    scaling factor). The four processing switches (all off: the weights as imported) run
    ``model.process_weights`` in float32 before the cast to ``dtype`` (so the float32 model is
    held while they run). Raises ``UnsupportedHFConfig`` naming the first config field the
    workbench cannot reproduce, ``HFImportError`` naming the id, file or argument otherwise.
    """
    import transformers

    device, dtype = check_placement(device, dtype, HFImportError)
    processing = fold_ln or center_writing_weights or center_unembed or fold_value_biases
    load_dtype = torch.float32 if processing else dtype
    if isinstance(source, (str, Path)):
        directory = resolve_hf_source(source, revision=revision, token=token)
        family, cfg = _config_of(directory, n_ctx)
        if Path(directory) != Path(source).expanduser():  # a hub id: name the model by it, not by the snapshot path
            cfg = cfg.replace(name=str(source))
        model = load_hf_weights(directory, family, cfg, device, load_dtype)
        if tokenizer is None:
            tokenizer = load_hf_tokenizer(directory)
    elif isinstance(source, transformers.PreTrainedModel):
        if source.get_output_embeddings() is None:
            raise ValueError(
                f"{type(source).__name__} has no language-model head; pass the *ForCausalLM / LMHeadModel class"
            )
        family, cfg = config_from_hf(source.config, n_ctx)
        model = _from_state_dict(source.state_dict(), family, cfg, device, load_dtype)
    else:
        raise TypeError(f"from_hf needs a directory path, a hub id or a transformers model, got {type(source).__name__}")
    if tokenizer is not None and not isinstance(tokenizer, HFTokenizer):
        tokenizer = HFTokenizer.from_transformers(tokenizer)
    model.tokenizer = tokenizer
    if processing:
        model.process_weights(fold_ln, center_writing_weights, center_unembed, fold_value_biases)
        model.to(dtype=dtype)
    return model  # in eval mode (fill_model; processing keeps the mode)


def _config_of(directory: Path, n_ctx: Optional[int]) -> tuple[str, Any]:
    """(family, ModelConfig) of an HF directory; the model_type is checked before transformers parses it."""
    import transformers

    if not looks_like_hf_dir(directory):
        raise HFImportError(f"{directory} is not a Hugging Face model directory (no config.json with a model_type)")
    model_type = json.loads(Path(directory, "config.json").read_text())["model_type"]
    if model_type not in FAMILIES:
        raise UnsupportedHFConfig(
            f"unsupported Hugging Face config field model_type={model_type!r} in {directory / 'config.json'}: "
            f"supported families are {list(FAMILIES)}"
        )
    hf_config = transformers.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    return config_from_hf(hf_config, n_ctx)


def _from_state_dict(hf_state: dict, family: str, cfg: Any, device: torch.device, dtype: torch.dtype) -> HookedDecoder:
    model = unfilled_model(cfg)
    ours, persistent = model_shapes(model)
    source = DictSource(hf_state)
    plan = plan_import(family, cfg, source, ours, persistent, layout=layout_of(hf_state))
    tensors = import_tensors(plan, source, persistent, device, dtype, float32_weights(model))  # copies: nothing shared with the HF model
    return fill_model(model, tensors, plan.zero_biases, device, dtype)


def to_hf(
    model: HookedDecoder,
    directory: Union[str, Path],
    *,
    tokenizer: Any = None,
    dtype: Union[torch.dtype, str, None] = None,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``model`` as a Hugging Face model directory (safetensors + config.json), atomically.

    The weights are written one tensor at a time in ``dtype`` (default: the model's), in
    shards of at most ``max_shard_size`` (bytes, or "5GB" / "500MiB") with
    ``model.safetensors.index.json`` when there are several; no transformers model is built.
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
    if dtype is not None:
        dtype = check_placement("cpu", dtype)[1]
    hf_config.dtype = str(dtype or model.embed.W_E.dtype).removeprefix("torch.")
    with torch.device("meta"):  # only the names and shapes the family has: nothing is allocated
        built = transformers.AutoModelForCausalLM.from_config(hf_config)
        # persistent buffers are weights too (DeepSeek-V3's e_score_correction_bias)
        hf_module = {**built.state_dict(keep_vars=True), **dict(built.named_parameters(remove_duplicate=False))}
    ours = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    entries = plan_export(family, cfg, ours, hf_module, layout="file")
    parse_size(max_shard_size)  # a bad size fails before anything is written

    def write(tmp: Path) -> None:
        hf_config.save_pretrained(str(tmp))
        with torch.no_grad():
            write_sharded(tmp, entries, dtype, max_shard_size)
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


__all__ = ["from_hf", "to_hf", "looks_like_hf_dir", "UnsupportedHFConfig", "HFImportError", "HFTokenizer"]
