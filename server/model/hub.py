"""``--model org/name[@revision]``: a Hugging Face Hub id resolved to a checkpoint directory in the hub's cache.

Online, the files the server reads (``download.select``: config, tokenizer, weights; no ``.bin`` copies beside
safetensors) are fetched into the cache, or found there up to date; offline (``HF_HUB_OFFLINE=1``, no network, or
a download cut short) the cached snapshot of that revision is used; neither gives a ``ModelLoadError`` saying what
to do. A path that exists is a directory, whatever it looks like.
"""

from __future__ import annotations

import re
from pathlib import Path

from mambaserve.server.model.config import ModelLoadError
from mambaserve.server.model.download import ALLOW, select

HUB_ID = re.compile(r"([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w./-]+))?")


def hub_id(model: str) -> tuple[str, str] | None:
    """``(repo, revision)`` when ``model`` names a hub repository rather than an existing path."""
    m = HUB_ID.fullmatch(model)
    if m is None or Path(model).exists():
        return None
    return m.group(1), m.group(2) or "main"


def resolve(model: str) -> Path:
    """The local directory of ``model``: itself, or its hub snapshot (fetched when online)."""
    ref = hub_id(model)
    if ref is None:
        return Path(model)
    repo, revision = ref
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    unreachable = ""
    try:
        if not constants.HF_HUB_OFFLINE:
            try:
                files = select(HfApi().list_repo_files(repo, revision=revision))
                return Path(snapshot_download(repo, revision=revision, allow_patterns=files))
            except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError):
                raise
            except Exception as e:  # no network, or it went mid-download (its HTTP client's own errors, such as
                # ConnectError, are not OSErrors): the cached snapshot, else an error naming this one
                unreachable = f" ({type(e).__name__}: {next(iter(str(e).splitlines()), '')})"
        return Path(snapshot_download(repo, revision=revision, allow_patterns=list(ALLOW), local_files_only=True))
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as e:
        raise ModelLoadError(f"--model {model}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"--model {model}: not a directory, and {repo}@{revision} is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) while the hub cannot be reached"
            f"{' (HF_HUB_OFFLINE is set)' if constants.HF_HUB_OFFLINE else unreachable}: download it once online, "
            "or pass a checkpoint directory") from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelLoadError(f"--model {model}: fetching {repo}@{revision} failed: {e}") from None
