"""Download a model from the Hugging Face hub into the standard HF cache.

Uses ``huggingface_hub.snapshot_download``, so everything its users expect works: the cache under
``HF_HOME`` / ``HF_HUB_CACHE`` (a second run reuses it), ``HF_TOKEN`` for gated and private repos,
``HF_HUB_OFFLINE=1`` (cache only), ``HF_ENDPOINT`` (a mirror), and a progress bar on a terminal.
Files a server does not need (README, licence, images, ``original/`` checkpoints) are skipped, and of the
weights only one format is fetched, in vLLM's order of preference: safetensors, else ``.bin``, else
``.pt``/``.pth`` (a repo often carries the same weights two or three times; Mistral's also as
``consolidated.safetensors``).
Every failure becomes one line that names the repo and the cause.
"""

from __future__ import annotations

import logging
from pathlib import Path

from dynamo.errors import ModelError

log = logging.getLogger(__name__)

IGNORE_PATTERNS = [".gitattributes", "LICENSE", "LICENSE.txt", "README.md", "USE_POLICY.md",
                   "*.png", "*.jpg", "*.jpeg", "*.PNG", "*.JPG", "*.JPEG", "original/*"]
WEIGHT_PATTERNS = ["*.bin", "*.safetensors", "*.h5", "*.msgpack", "*.ckpt.index", "*.pt", "*.pth", "*.gguf"]
# one weight format is enough: the first of these with a match in the repo
_WEIGHT_PREFERENCE = [["*.safetensors"], ["*.bin"], ["*.pt", "*.pth"]]


def weight_ignore_patterns(files: list[str]) -> list[str]:
    """Patterns that skip every weight format but the preferred one present in ``files``."""
    from fnmatch import fnmatch

    names = [f.rsplit("/", 1)[-1] for f in files]
    for group in _WEIGHT_PREFERENCE:
        if any(fnmatch(n, pat) for n in names for pat in group):
            skip = [p for p in WEIGHT_PATTERNS if p not in group]
            if group == ["*.safetensors"] and any(n.startswith("model") and n.endswith(".safetensors")
                                                  for n in names):
                skip.append("consolidated*.safetensors")  # Mistral's second copy of the same weights
            return skip
    return []


def download(repo_id: str, *, weights: bool = True, revision: str | None = None) -> Path:
    """The local snapshot folder of ``repo_id``, downloading what is missing."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    ignore = IGNORE_PATTERNS + ([] if weights else WEIGHT_PATTERNS)
    endpoint = constants.ENDPOINT
    offline = constants.HF_HUB_OFFLINE
    if offline:
        log.info("looking for %s in the local Hugging Face cache (HF_HUB_OFFLINE is set)", repo_id)
    else:
        log.info("fetching %s from %s (cached files are reused)", repo_id, endpoint)
    not_found = (f"Hugging Face model '{repo_id}' does not exist on {endpoint} (or it is private: set HF_TOKEN). "
                 "Is this a valid Hugging Face ID, or a local path with a typo?")
    try:
        if weights and not offline:
            ignore += _weight_filter(repo_id, revision)
        path = snapshot_download(repo_id, revision=revision, ignore_patterns=ignore)
    except GatedRepoError:
        raise ModelError(
            f"Hugging Face model '{repo_id}' is gated: accept its licence on the hub and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(not_found) from None
    except RevisionNotFoundError:
        raise ModelError(f"Hugging Face model '{repo_id}': revision {revision or 'main'!r} not found") from None
    except RemoteEntryNotFoundError as e:
        raise ModelError(f"cannot fetch '{repo_id}': a file it lists is missing on the hub ({_first_line(e)})") from None
    except HFValidationError:
        raise ModelError(f"'{repo_id}' is not a valid Hugging Face repo id (expected org/name) "
                         "and no such file or directory exists") from None
    except LocalEntryNotFoundError as e:
        cause = _root_cause(e)
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if status == 404:  # a hub or mirror that answers a plain 404 for a missing repo
            raise ModelError(not_found) from None
        if offline:
            raise ModelError(
                f"'{repo_id}' is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                "HF_HUB_OFFLINE is set: run once with network access, or unset HF_HUB_OFFLINE"
            ) from None
        if "incomplete" in str(e):
            raise ModelError(f"cannot fetch '{repo_id}': the hub at {endpoint} cannot be reached and the cached "
                             "copy is incomplete") from None
        why = _first_line(cause) if cause is not e else "no response"
        raise ModelError(
            f"cannot fetch '{repo_id}': the Hugging Face hub at {endpoint} cannot be reached ({why}) and the "
            "model is not in the local cache"
        ) from None
    except HfHubHTTPError as e:
        raise ModelError(f"cannot fetch '{repo_id}' from {endpoint}: {_first_line(e)}") from None
    except OSError as e:
        raise ModelError(f"cannot fetch '{repo_id}' from {endpoint}: {_first_line(e)}") from None
    except Exception as e:  # httpx errors that are not OSError (proxy, protocol)
        raise ModelError(f"cannot fetch '{repo_id}' from {endpoint}: {type(e).__name__}: {_first_line(e)}") from None
    local = Path(path)
    if not local.is_dir() or not any(local.iterdir()):
        raise ModelError(f"Hugging Face model '{repo_id}' contains no downloadable files")
    log.info("using %s", local)
    return local


def _weight_filter(repo_id: str, revision: str | None) -> list[str]:
    """Best effort: when the listing fails, ``snapshot_download`` reports the cause in its own words."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo_id, revision=revision)
    except Exception:  # noqa: BLE001
        return []
    return weight_ignore_patterns([s.rfilename for s in info.siblings or []])


def _root_cause(e: BaseException) -> BaseException:
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__
