"""Hub ids: ``"gpt2"`` or ``"meta-llama/Llama-3.1-8B"`` -> a local model directory.

Resolution goes through ``huggingface_hub.snapshot_download``: online it downloads (or reuses)
the files a workbench import reads; with ``HF_HUB_OFFLINE=1`` it returns the snapshot already
in the cache (``$HF_HOME/hub/models--org--name/snapshots/<rev>/``, ``refs/main`` naming
``<rev>``) without touching the network. Only safetensors weights are fetched: a repository
that has nothing but ``pytorch_model.bin`` is refused rather than unpickled.

Every way this fails (no such repository, gated without a token, not cached while offline,
no network) raises one ``HFImportError`` that names the id and what to do.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Union

# What an import reads: config, weights (single or sharded), tokenizer files. Never *.bin / *.pt.
HUB_PATTERNS = [
    "config.json", "generation_config.json", "model.safetensors", "model-*.safetensors",
    "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.*",
]
# user/name or name: letters, digits, - _ . ; at most one slash (huggingface_hub's own rule).
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


class HFImportError(ValueError):
    """A Hugging Face model that cannot be read: not found, gated, broken or missing files, an
    unsupported device or dtype. The message names the id, file or argument at fault."""


def looks_like_hub_id(source: Union[str, Path]) -> bool:
    """True for strings shaped like ``name`` or ``org/name`` that are not existing local paths."""
    if isinstance(source, Path):
        return False
    text = str(source)
    return bool(_HUB_ID.match(text)) and ".." not in text and not text.endswith((".json", ".safetensors")) \
        and not Path(text).expanduser().exists()


def resolve_hf_source(source: Union[str, Path], *, revision: Optional[str] = None,
                      token: Union[str, bool, None] = None) -> Path:
    """A local directory holding the model ``source`` names: ``source`` itself when it exists
    locally, else the snapshot of hub id ``source`` at ``revision`` (default: main)."""
    path = Path(source).expanduser()
    if path.exists():
        if revision is not None:
            raise HFImportError(f"revision={revision!r} only applies to hub ids; {source} is a local path")
        return path
    if not looks_like_hub_id(source):
        raise HFImportError(f"{source} is neither an existing directory nor a hub id like 'org/name'")
    return Path(_snapshot(str(source), revision, token))


def _snapshot(repo_id: str, revision: Optional[str], token: Union[str, bool, None]) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    try:
        return snapshot_download(repo_id, revision=revision, token=token, allow_patterns=HUB_PATTERNS)
    except GatedRepoError:
        raise HFImportError(
            f"{repo_id} is a gated repository and this request had no token with access: accept its terms at "
            f"https://huggingface.co/{repo_id}, then log in (`hf auth login`), set HF_TOKEN, or pass token="
        ) from None
    except RevisionNotFoundError:
        raise HFImportError(f"{repo_id} has no revision {revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise HFImportError(
            f"no model repository {repo_id!r} on the Hub (or it is private and this request had no token for it); "
            "check the id, or pass a local directory"
        ) from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise HFImportError(
                f"{repo_id}{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 "
                "forbids downloading it: unset HF_HUB_OFFLINE while online once, or pass a local directory"
            ) from None
        raise HFImportError(
            f"{repo_id}{at} could not be downloaded (the Hub is unreachable) and is not in the cache "
            f"({constants.HF_HUB_CACHE}); connect to the network, or pass a local directory"
        ) from None
    except HfHubHTTPError as e:
        raise HFImportError(f"the Hub refused {repo_id}{at}: {e}") from None
    except OSError as e:  # a disk-level failure while writing the cache
        raise HFImportError(f"could not fetch {repo_id}{at} into {constants.HF_HUB_CACHE}: {e}") from None


__all__ = ["HFImportError", "HUB_PATTERNS", "looks_like_hub_id", "resolve_hf_source"]
