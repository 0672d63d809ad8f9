"""Where images may come from, and how big they may be: the media policy.

Images in a request are URLs the server fetches on the user's behalf, so an open fetcher is a way into
the server's own network (the cloud metadata address, an admin port on localhost) and into its disk.
The defaults are Dynamo 1.x's: only ``https://`` and ``data:`` URLs, no internal address, no local
file.  ``DYN_MM_ALLOW_INTERNAL=1`` opens ``http://`` and internal addresses (for an image store on the
same private network); ``DYN_MM_LOCAL_PATH`` (or ``--allowed-local-media-path``, vLLM's flag) opens
``file://`` URLs under one directory.  The sizes (bytes, pixels, seconds, images per prompt) bound what
one request can make the server do.

One policy serves the whole process: the HTTP input installs the one it built from its flags at
start-up (:func:`use_policy`); anything else gets the environment's (:func:`current_policy`).
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dynamo.errors import RequestError, UserError

ALLOW_INTERNAL_ENV = "DYN_MM_ALLOW_INTERNAL"  # Dynamo 1.x's
LOCAL_PATH_ENV = "DYN_MM_LOCAL_PATH"  # Dynamo 1.x's
MAX_BYTES_ENV = "DYN_MM_MAX_IMAGE_BYTES"  # ours
MAX_PIXELS_ENV = "DYN_MM_MAX_IMAGE_PIXELS"  # ours
TIMEOUT_ENV = "DYN_MM_FETCH_TIMEOUT_SECS"  # ours
LOCAL_PATH_FLAG = "--allowed-local-media-path"  # vLLM's
LIMIT_FLAG = "--limit-mm-per-prompt"  # vLLM's

DEFAULT_MAX_BYTES = 20 * 1024 * 1024  # an encoded image: a 4096x4096 PNG photo is about 15-25 MiB
DEFAULT_MAX_PIXELS = 4096 * 4096  # decoded RGB: 48 MiB; far above what any vision encoder takes in
DEFAULT_TIMEOUT_S = 30.0  # the whole fetch, redirects included (Dynamo's media fetcher waits 30 s)
DEFAULT_MAX_IMAGES = 16  # per prompt
MAX_REDIRECTS = 3  # as Dynamo's fetcher


class MediaError(RequestError):
    """An image the request cannot use: a refused URL, a failed fetch, a corrupt or unsupported image,
    too many images, or a model that takes none.  A 400 ``invalid_request_error`` in the API's shape."""

    def __init__(self, message: str, *, param: str | None = "messages") -> None:
        super().__init__(message, status=400, param=param)


@dataclass(frozen=True)
class MediaPolicy:
    """What image URLs a request may use and the bounds on each image."""

    allow_http: bool = False  # plain http:// URLs
    allow_private: bool = False  # loopback, private, link-local and other non-global addresses
    local_path: Path | None = None  # file:// URLs under this directory (resolved), else none
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_images: int = DEFAULT_MAX_IMAGES
    max_redirects: int = MAX_REDIRECTS

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, local_path: str | None = None,
                 limit_mm_per_prompt: str | None = None) -> "MediaPolicy":
        """The environment's policy, with the flags (when given) taking precedence; a bad value is a
        :class:`UserError` naming it (at start-up, not on the first image)."""
        env = os.environ if env is None else env
        internal = _env_bool(env, ALLOW_INTERNAL_ENV)
        path_text = local_path if local_path is not None else (env.get(LOCAL_PATH_ENV) or "").strip() or None
        where = LOCAL_PATH_FLAG if local_path is not None else LOCAL_PATH_ENV
        limit = parse_limit_mm_per_prompt(limit_mm_per_prompt) if limit_mm_per_prompt is not None else None
        return cls(
            allow_http=internal,
            allow_private=internal,
            local_path=_local_dir(path_text, where) if path_text else None,
            max_bytes=_env_number(env, MAX_BYTES_ENV, DEFAULT_MAX_BYTES, int),
            max_pixels=_env_number(env, MAX_PIXELS_ENV, DEFAULT_MAX_PIXELS, int),
            timeout_s=_env_number(env, TIMEOUT_ENV, DEFAULT_TIMEOUT_S, float),
            max_images=limit if limit is not None else DEFAULT_MAX_IMAGES,
        )

    def check_count(self, n: int) -> None:
        """``n`` images in one prompt are allowed (``--limit-mm-per-prompt``)."""
        if n > self.max_images:
            raise MediaError(f"At most {self.max_images} image(s) may be sent in one request ({LIMIT_FLAG}); "
                             f"this one has {n}")


def parse_limit_mm_per_prompt(text: str) -> int:
    """``--limit-mm-per-prompt`` as vLLM writes it, ``'{"image": N}'``, or ``image=N``: the image limit.
    Other modalities are refused (no engine here takes audio or video)."""
    raw = text.strip()
    items: dict[str, Any]
    if raw.startswith("{"):
        try:
            items = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UserError(f"{LIMIT_FLAG} {text!r}: not a JSON object: {e}") from None
        if not isinstance(items, dict):
            raise UserError(f"{LIMIT_FLAG} {text!r}: expected a JSON object such as '{{\"image\": 4}}'")
    else:
        items = {}
        for pair in raw.split(","):
            key, eq, value = pair.partition("=")
            if not eq:
                raise UserError(f"{LIMIT_FLAG} {text!r}: expected '{{\"image\": N}}' or image=N")
            items[key.strip()] = value.strip()
    extra = sorted(set(items) - {"image"})
    if extra:
        raise UserError(f"{LIMIT_FLAG}: only 'image' is supported here (got {extra[0]!r})")
    if "image" not in items:
        raise UserError(f"{LIMIT_FLAG} {text!r}: give the image limit, '{{\"image\": N}}'")
    value = items["image"]
    if isinstance(value, bool) or not str(value).strip().isdigit():
        raise UserError(f"{LIMIT_FLAG}: the image limit must be a whole number of at least 0 (got {value!r})")
    return int(str(value).strip())


def _env_bool(env: Mapping[str, str], name: str) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise UserError(f"{name}={env.get(name)!r}: expected 1 or 0")


def _env_number(env: Mapping[str, str], name: str, default: Any, kind: type) -> Any:
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise UserError(f"{name}={raw!r}: expected a positive number")
    return value


def _local_dir(text: str, where: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_absolute():
        raise UserError(f"{where} {text!r}: must be an absolute directory path")
    if not path.is_dir():
        raise UserError(f"{where} {text!r}: no such directory")
    return path.resolve()


# -- addresses ---------------------------------------------------------------------------------------


def is_internal_address(address: str) -> bool:
    """Whether ``address`` (an IP literal) is not a public Internet address: loopback, private (RFC 1918,
    ULA), link-local (the cloud metadata service at 169.254.169.254), shared (CGNAT), multicast, reserved
    or unspecified.  An IPv4 address inside IPv6 (``::ffff:127.0.0.1``, 6to4) is judged as that IPv4
    address, so wrapping it changes nothing."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return True  # not an address we understand: not one we connect to
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is not None:
            ip = inner
    return bool(not ip.is_global or ip.is_multicast or ip.is_private or ip.is_loopback or ip.is_link_local
                or ip.is_reserved or ip.is_unspecified)


# -- the process's policy ----------------------------------------------------------------------------

_current: MediaPolicy | None = None


def use_policy(policy: MediaPolicy) -> None:
    """Install the process's policy (the HTTP input does, from its flags, before it serves)."""
    global _current
    _current = policy


def current_policy() -> MediaPolicy:
    """The installed policy, else the environment's."""
    global _current
    if _current is None:
        _current = MediaPolicy.from_env()
    return _current
