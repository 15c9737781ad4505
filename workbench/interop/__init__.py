"""Hugging Face interop: open GPT-2 / Llama / Mistral / Qwen2 / Mixtral / GPT-NeoX / Qwen3 / OLMo 2 /
Phi-3 checkpoints (local directories or hub ids) as ``HookedDecoder`` models (``from_hf``) and write ours back out (``to_hf``);
GGUF files (``open_gguf``) and the shipped pretrained model (``open_pretrained("smollm2-135m")``) through the same weight table."""

from workbench.interop.families import UnsupportedHFConfig, config_from_hf, hf_config_for, hf_family_for
from workbench.interop.gguf import GGUFImportError, open_gguf, open_pretrained
from workbench.interop.hf import from_hf, looks_like_hf_dir, to_hf
from workbench.interop.hf_tokenizer import HFTokenizer
from workbench.interop.hub import HFImportError

__all__ = [
    "from_hf",
    "to_hf",
    "looks_like_hf_dir",
    "UnsupportedHFConfig",
    "HFImportError",
    "HFTokenizer",
    "open_gguf",
    "open_pretrained",
    "GGUFImportError",
    "config_from_hf",
    "hf_config_for",
    "hf_family_for",
]
