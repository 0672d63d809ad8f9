"""Download a model from the Hugging Face hub into the standard HF cache (spec 1.6).

Uses ``huggingface_hub`` (progress bars, ``HF_TOKEN``, ``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, cache hits)
and skips files a server does not need.  Every failure becomes one line naming the repo and the cause.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dynamo.errors import ModelError

log = logging.getLogger(__name__)

IGNORE_PATTERNS = [".gitattributes", "LICENSE", "LICENSE.txt", "README.md", "USE_POLICY.md",
                   "*.png", "*.jpg", "*.jpeg", "*.PNG", "*.JPG", "*.JPEG", "original/*"]
WEIGHT_PATTERNS = ["*.bin", "*.safetensors", "*.h5", "*.msgpack", "*.ckpt.index", "*.pt", "*.pth", "*.gguf"]


def download(repo_id: str, *, weights: bool = True, revision: str | None = None) -> Path:
    """The local snapshot folder of ``repo_id``, downloading what is missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    ignore = IGNORE_PATTERNS + ([] if weights else WEIGHT_PATTERNS)
    log.info("fetching %s from Hugging Face (cached files are reused)", repo_id)
    try:
        path = snapshot_download(repo_id, revision=revision, ignore_patterns=ignore)
    except GatedRepoError:
        raise ModelError(
            f"Hugging Face model '{repo_id}' is gated: accept its licence on the hub and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"Hugging Face model '{repo_id}' does not exist (or is private: set HF_TOKEN). "
            "Is this a valid Hugging Face ID, or a local path with a typo?"
        ) from None
    except RevisionNotFoundError:
        raise ModelError(f"Hugging Face model '{repo_id}': revision {revision!r} not found") from None
    except LocalEntryNotFoundError:
        raise ModelError(
            f"cannot fetch '{repo_id}': the Hugging Face hub cannot be reached and the model is not in "
            "the local cache (HF_HUB_OFFLINE or no network)"
        ) from None
    except HfHubHTTPError as e:
        raise ModelError(f"cannot fetch '{repo_id}' from Hugging Face: {_first_line(e)}") from None
    except OSError as e:
        raise ModelError(f"cannot fetch '{repo_id}' from Hugging Face: {_first_line(e)}") from None
    local = Path(path)
    if not any(local.iterdir()):
        raise ModelError(f"Hugging Face model '{repo_id}' contains no downloadable files")
    return local


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
