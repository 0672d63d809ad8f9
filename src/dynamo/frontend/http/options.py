"""How the HTTP service is exposed: API keys, TLS, CORS origins and the request body limit.

Kept apart from ``service.py`` so the request hot path stays as it is: the service asks this object for
its middlewares, its SSL context and its body limit once, at start-up.  Everything is checked here, before
the server listens, so a bad certificate or an empty key is a one-line error instead of a server that
half works.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo.errors import UserError
from dynamo.llm.media import MediaPolicy

DEFAULT_BODY_LIMIT_BYTES = 32 * 1024 * 1024  # ours since the start; Dynamo's DYN_HTTP_BODY_LIMIT_MB overrides
BODY_LIMIT_ENV = "DYN_HTTP_BODY_LIMIT_MB"
API_KEY_ENV = "DYN_API_KEY"
ANTHROPIC_API_ENV = "DYN_ENABLE_ANTHROPIC_API"  # Dynamo's name, as for its --enable-anthropic-api


@dataclass
class HttpOptions:
    """What ``--api-key``, ``--tls-*``, ``--allowed-origins``, ``--enable-anthropic-api``,
    ``DYN_HTTP_BODY_LIMIT_MB`` and the media settings (``DYN_MM_*``, ``--allowed-local-media-path``,
    ``--limit-mm-per-prompt``) asked for."""

    api_keys: list[str] = field(default_factory=list)
    allowed_origins: list[str] = field(default_factory=list)
    tls_cert_path: Path | None = None
    tls_key_path: Path | None = None
    body_limit: int = DEFAULT_BODY_LIMIT_BYTES
    anthropic_api: bool = False  # serve /v1/messages (Anthropic's Messages API)
    media: MediaPolicy = field(default_factory=MediaPolicy)  # where images may come from (llm/media)

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert_path is not None else "http"

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server-side TLS context, or None for plain HTTP; unusable files are a UserError."""
        if self.tls_cert_path is None or self.tls_key_path is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(str(self.tls_cert_path), str(self.tls_key_path))
        except (ssl.SSLError, OSError) as e:
            raise UserError(
                f"cannot use --tls-cert-path {self.tls_cert_path} with --tls-key-path {self.tls_key_path}: "
                f"{getattr(e, 'strerror', None) or e}"
            ) from None
        return ctx

    def middlewares(self) -> list[Any]:
        """Outermost first: CORS (preflights need no key), then the API key check."""
        out: list[Any] = []
        if self.allowed_origins:
            from dynamo.frontend.http.cors import cors_middleware

            out.append(cors_middleware(self.allowed_origins))
        if self.api_keys:
            from dynamo.frontend.http.auth import api_key_middleware

            out.append(api_key_middleware(self.api_keys))
        return out

    def install(self, app: Any) -> None:
        """Hooks that are not middlewares: CORS headers on every response, streamed ones included."""
        if self.allowed_origins:
            from dynamo.frontend.http.cors import add_cors_headers

            app.on_response_prepare.append(add_cors_headers(self.allowed_origins))


def build_http_options(
    *,
    api_keys: list[str] | None = None,
    allowed_origins: list[str] | None = None,
    tls_cert_path: str | None = None,
    tls_key_path: str | None = None,
    anthropic_api: bool | None = None,
    allowed_local_media_path: str | None = None,
    limit_mm_per_prompt: str | None = None,
    environ: dict[str, str] | None = None,
) -> HttpOptions:
    """Flags plus environment into checked options.  ``--api-key`` given replaces ``DYN_API_KEY``;
    ``--[no-]enable-anthropic-api`` given (not None) replaces ``DYN_ENABLE_ANTHROPIC_API``;
    ``--allowed-local-media-path`` replaces ``DYN_MM_LOCAL_PATH``."""
    env = os.environ if environ is None else environ
    if anthropic_api is None:
        anthropic_api = env_flag(env, ANTHROPIC_API_ENV)
    keys = list(api_keys or [])
    if not keys and env.get(API_KEY_ENV):
        keys = [k.strip() for k in env[API_KEY_ENV].split(",")]
        if any(not k for k in keys):
            raise UserError(f"{API_KEY_ENV} has an empty key (keys are separated by commas)")
    for key in keys:
        if not key or key != key.strip():
            raise UserError("--api-key: a key must not be empty or start or end with spaces")
    if (tls_cert_path is None) != (tls_key_path is None):
        raise UserError("--tls-cert-path and --tls-key-path go together: give both or neither")
    cert = key_path = None
    if tls_cert_path is not None and tls_key_path is not None:
        cert, key_path = Path(tls_cert_path).expanduser(), Path(tls_key_path).expanduser()
        for flag, path in (("--tls-cert-path", cert), ("--tls-key-path", key_path)):
            if not path.is_file():
                raise UserError(f"{flag}: no such file: {path}")
    origins = parse_origins(allowed_origins or [])
    media = MediaPolicy.from_env(env, local_path=allowed_local_media_path, limit_mm_per_prompt=limit_mm_per_prompt)
    opts = HttpOptions(api_keys=keys, allowed_origins=origins, tls_cert_path=cert, tls_key_path=key_path,
                       body_limit=body_limit_from_env(env), anthropic_api=anthropic_api, media=media)
    opts.ssl_context()  # fail now, not on the first connection
    return opts


def env_flag(env: Any, name: str) -> bool:
    """A boolean environment variable: 1/true/yes/on or 0/false/no/off (any case), unset or empty false."""
    raw = (env.get(name) or "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise UserError(f"{name}={env.get(name)!r}: expected true or false (1/0, yes/no, on/off)")


def parse_origins(values: list[str]) -> list[str]:
    """``--allowed-origins`` values: comma-separated, repeatable, or vLLM's JSON list (``'["*"]'``)."""
    import json

    out: list[str] = []
    for value in values:
        text = value.strip()
        if text.startswith("["):
            try:
                items = json.loads(text)
            except json.JSONDecodeError as e:
                raise UserError(f"--allowed-origins {value!r}: not a JSON list: {e}") from None
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise UserError(f"--allowed-origins {value!r}: expected a JSON list of strings")
        else:
            items = text.split(",")
        for item in items:
            origin = item.strip().rstrip("/")
            if not origin:
                continue
            if origin != "*" and "://" not in origin:
                raise UserError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port]) or *")
            if origin not in out:
                out.append(origin)
    return out


def body_limit_from_env(env: Any = None) -> int:
    """``DYN_HTTP_BODY_LIMIT_MB`` (whole MiB, as in Dynamo) in bytes; our default when unset."""
    env = os.environ if env is None else env
    raw = env.get(BODY_LIMIT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_BODY_LIMIT_BYTES
    try:
        mb = float(raw)
    except ValueError:
        mb = -1
    if not mb > 0:
        raise UserError(f"{BODY_LIMIT_ENV}={raw!r}: expected a positive number of megabytes")
    return int(mb * 1024 * 1024)
