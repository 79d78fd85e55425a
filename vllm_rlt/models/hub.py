"""The model a user names, as a local directory: none (the packaged tiny-ouro-stdlib), a
directory as given, or a Hugging Face hub id (`ByteDance/Ouro-1.4B`), resolved as vLLM does
through `huggingface_hub`: its local cache first, else a download with progress, at `revision`
into `download_dir` (default: the hub's cache), with `HF_TOKEN` for private models. With
`HF_HUB_OFFLINE` set only the cache is read. Every failure is one CheckpointError line."""

from __future__ import annotations

import os
import re
from pathlib import Path

from vllm_rlt.models.loader import CheckpointError
from vllm_rlt.models.tiny import default_model_dir

# what the engine reads of a checkpoint (config, weights, tokenizer, chat and generation config)
FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
# `name` or `org/name`; anything else (an absolute path, ./x, a/b/c) is a directory
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def resolve_model_dir(
    model: str | os.PathLike | None, revision: str | None = None, download_dir: str | None = None
) -> Path:
    """The local directory of `model` (see the module docstring)."""
    if model is None:
        return default_model_dir()
    name = os.fspath(model)
    if Path(name).exists() or not HUB_ID.fullmatch(name):
        return Path(name)  # (read_config says when it is no model directory)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f" (revision {revision})" if revision else ""
    try:
        path = snapshot_download(
            name, revision=revision, cache_dir=download_dir, allow_patterns=FILES
        )
    except LocalEntryNotFoundError:
        cache = download_dir or "the Hugging Face cache"
        raise CheckpointError(
            f"model {name}{where} is neither a local directory nor in {cache}, and it cannot be "
            "downloaded now (HF_HUB_OFFLINE is set, or the hub cannot be reached)"
        ) from None
    except RevisionNotFoundError:
        raise CheckpointError(f"model {name} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise CheckpointError(
            f"model {name} is neither a local directory nor a model on the Hugging Face hub "
            "(a private or gated one needs HF_TOKEN)"
        ) from None
    except OSError as err:
        raise CheckpointError(f"model {name}{where}: the download failed: {err}") from None
    return Path(path)
