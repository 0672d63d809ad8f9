"""Runtime settings read from the environment (spec 1.4), in one place.

Read once when a DistributedRuntime is built, so tests can set env vars per runtime.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .errors import RuntimeConfigError

DEFAULT_ETCD_ENDPOINT = "http://localhost:2379"
DEFAULT_NATS_SERVER = "nats://localhost:4222"
DEFAULT_LEASE_TTL = 10
# After etcd comes back, a watch re-lists; keys missing from that listing are reported deleted only after
# this many seconds (live workers re-publish within ~2 s of etcd's return; see PrefixWatch).
DEFAULT_RESYNC_GRACE = 5.0
DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT = 30.0
# A response stream whose worker sent nothing (not even a heartbeat) for this long is treated like a
# dead worker (DYN_STREAM_LIVENESS_S); also the bound on a request's ack and on the worker calling home.
DEFAULT_STREAM_LIVENESS = 5.0


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


@dataclass(slots=True)
class EtcdSettings:
    endpoints: list[str] = field(default_factory=lambda: [DEFAULT_ETCD_ENDPOINT])
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    resync_grace: float = DEFAULT_RESYNC_GRACE

    @classmethod
    def from_env(cls) -> "EtcdSettings":
        raw = _env("ETCD_ENDPOINTS") or DEFAULT_ETCD_ENDPOINT
        endpoints = [_normalise_etcd_url(e) for e in raw.split(",") if e.strip()]
        return cls(
            endpoints=endpoints or [DEFAULT_ETCD_ENDPOINT],
            username=_env("ETCD_AUTH_USERNAME"),
            password=_env("ETCD_AUTH_PASSWORD"),
            ca_file=_env("ETCD_AUTH_CA"),
            cert_file=_env("ETCD_AUTH_CLIENT_CERT"),
            key_file=_env("ETCD_AUTH_CLIENT_KEY"),
            resync_grace=_float_env("DYN_ETCD_RESYNC_GRACE", DEFAULT_RESYNC_GRACE, minimum=0.0),
        )


def _float_env(name: str, default: float, *, minimum: float) -> float:
    """A number from the environment; a bad value is a clear error, not a silent default."""
    raw = _env(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise RuntimeConfigError(f"{name}={raw!r} is not a number") from None
    if value < minimum:
        raise RuntimeConfigError(f"{name}={raw!r} must be at least {minimum:g}")
    return value


def _normalise_etcd_url(text: str) -> str:
    """``host:port`` -> ``http://host:port``; trailing slashes dropped."""
    text = text.strip().rstrip("/")
    if "://" not in text:
        text = "http://" + text
    return text


@dataclass(slots=True)
class NatsSettings:
    server: str = DEFAULT_NATS_SERVER
    username: str | None = None
    password: str | None = None
    token: str | None = None
    nkey_seed: str | None = None
    credentials_file: str | None = None

    @classmethod
    def from_env(cls) -> "NatsSettings":
        return cls(
            server=_env("NATS_SERVER") or DEFAULT_NATS_SERVER,
            username=_env("NATS_AUTH_USERNAME"),
            password=_env("NATS_AUTH_PASSWORD"),
            token=_env("NATS_AUTH_TOKEN"),
            nkey_seed=_env("NATS_AUTH_NKEY"),
            credentials_file=_env("NATS_AUTH_CREDENTIALS_FILE"),
        )


@dataclass(slots=True)
class RuntimeSettings:
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    nats: NatsSettings = field(default_factory=NatsSettings)
    lease_ttl: int = DEFAULT_LEASE_TTL
    graceful_shutdown_timeout: float = DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT
    # Address this process advertises for TCP call-home response streams (None = auto-detect).
    tcp_host: str | None = None
    # "tcp" (default, see docs/runtime.md for the measurement) or "nats".
    response_transport: str = "tcp"
    # Seconds of silence after which a stream's worker counts as frozen (docs/reliability.md).
    stream_liveness: float = DEFAULT_STREAM_LIVENESS

    @classmethod
    def from_env(cls) -> "RuntimeSettings":
        timeout = _env("DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT")
        return cls(
            etcd=EtcdSettings.from_env(),
            nats=NatsSettings.from_env(),
            lease_ttl=int(_float_env("DYN_LEASE_TTL", DEFAULT_LEASE_TTL, minimum=1)),
            graceful_shutdown_timeout=float(timeout) if timeout else DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT,
            tcp_host=_env("DYN_TCP_RPC_HOST"),
            response_transport=(_env("DYN_RESPONSE_TRANSPORT") or "tcp").lower(),
            stream_liveness=_float_env("DYN_STREAM_LIVENESS_S", DEFAULT_STREAM_LIVENESS, minimum=0.05),
        )

