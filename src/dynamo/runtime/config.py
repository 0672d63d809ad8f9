"""Runtime settings read from the environment (the variables the original reads), in one place.

Read once when a DistributedRuntime is built, so tests can set env vars per runtime.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import orjson

from . import tcp_tls
from .errors import RuntimeConfigError
from .fleet_auth import load_secret
from .tcp import DEFAULT_SILENCE_1X

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
    # True when the endpoints were given (in code, or ETCD_ENDPOINTS): then etcd is the discovery backend
    # unless another is asked for; False only from_env without ETCD_ENDPOINTS (the default rule probes)
    explicit: bool = True

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
            explicit=_env("ETCD_ENDPOINTS") is not None,
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
    # TLS (Dynamo 1.x's names): the CA that signs the server's certificate, a client certificate and key for a
    # server that verifies clients, and (development only) no verification at all. Any of them needs a
    # tls:// server URL, which alone means TLS against the system's trust store.
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_insecure: bool = False
    # True when the server was given (in code, or NATS_SERVER): then the request and event planes are
    # NATS's unless others are asked for; False only from_env without NATS_SERVER (the default rule probes)
    explicit: bool = True

    @classmethod
    def from_env(cls) -> "NatsSettings":
        return cls(
            explicit=_env("NATS_SERVER") is not None,
            server=_env("NATS_SERVER") or DEFAULT_NATS_SERVER,
            username=_env("NATS_AUTH_USERNAME"),
            password=_env("NATS_AUTH_PASSWORD"),
            token=_env("NATS_AUTH_TOKEN"),
            nkey_seed=_env("NATS_AUTH_NKEY"),
            credentials_file=_env("NATS_AUTH_CREDENTIALS_FILE"),
            tls_ca=_env("NATS_TLS_CA_CERT_PATH"),
            tls_cert=_env("NATS_TLS_CLIENT_CERT_PATH"),
            tls_key=_env("NATS_TLS_CLIENT_KEY_PATH"),
            tls_insecure=_bool_env("NATS_TLS_INSECURE", False),
        )


DEFAULT_SYSTEM_PORT = 8081  # Dynamo's default for the worker status server once it is enabled
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool_env(name: str, default: bool) -> bool:
    """A switch from the environment; anything but a yes/no word is a clear error, not a silent default."""
    raw = _env(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise RuntimeConfigError(f"{name}={raw!r}: use true or false")


@dataclass(slots=True)
class SystemSettings:
    """The worker's own status server (``/health``, ``/live``, ``/metrics``; docs/metrics.md).

    On with ``DYN_SYSTEM_ENABLED=true`` (Dynamo 0.x) or with ``DYN_SYSTEM_PORT`` set to a port >= 0
    (Dynamo 1.x, where -1 means off); ``DYN_SYSTEM_ENABLED=false`` turns it off whatever the port.
    """

    enabled: bool = False
    # DYN_SYSTEM_HOST; None: loopback when the planes are (one machine), else every interface
    host: str | None = None
    port: int = DEFAULT_SYSTEM_PORT  # 0: an ephemeral port, logged
    health_path: str = "/health"
    live_path: str = "/live"
    # endpoints that must serve before /health says ready (None: every endpoint this process serves)
    required_endpoints: list[str] | None = None

    @classmethod
    def from_env(cls) -> "SystemSettings":
        raw_enabled = _env("DYN_SYSTEM_ENABLED")
        raw_port = _env("DYN_SYSTEM_PORT")
        port = DEFAULT_SYSTEM_PORT
        if raw_port is not None:
            try:
                port = int(raw_port)
            except ValueError:
                raise RuntimeConfigError(f"DYN_SYSTEM_PORT={raw_port!r} is not a port number") from None
            if port > 65535 or port < -1:
                raise RuntimeConfigError(f"DYN_SYSTEM_PORT={raw_port!r} must be -1 (off), 0 (any free port) or a port")
        if raw_enabled is None:
            enabled = raw_port is not None and port >= 0
        elif raw_enabled.lower() in _TRUE:
            enabled = port >= 0
            if port < 0:
                raise RuntimeConfigError("DYN_SYSTEM_ENABLED=true with DYN_SYSTEM_PORT=-1: choose a port (0: any free one)")
        elif raw_enabled.lower() in _FALSE:
            enabled = False
        else:
            raise RuntimeConfigError(f"DYN_SYSTEM_ENABLED={raw_enabled!r}: use true or false")
        required = None
        raw_required = _env("DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS")
        if raw_required is not None:
            try:
                required = orjson.loads(raw_required)
            except orjson.JSONDecodeError:
                required = None
            if not isinstance(required, list) or not all(isinstance(x, str) for x in required):
                raise RuntimeConfigError(
                    f"DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS={raw_required!r}: expected a JSON list of endpoint names, "
                    'e.g. ["generate"]')
        return cls(
            enabled=enabled,
            host=_env("DYN_SYSTEM_HOST"),
            port=max(port, 0),
            health_path=_path_env("DYN_SYSTEM_HEALTH_PATH", "/health"),
            live_path=_path_env("DYN_SYSTEM_LIVE_PATH", "/live"),
            required_endpoints=required,
        )


def _path_env(name: str, default: str) -> str:
    value = _env(name) or default
    if not value.startswith("/"):
        raise RuntimeConfigError(f"{name}={value!r} must start with /")
    return value


@dataclass(slots=True)
class RuntimeSettings:
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    nats: NatsSettings = field(default_factory=NatsSettings)
    lease_ttl: int = DEFAULT_LEASE_TTL
    graceful_shutdown_timeout: float = DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT
    # DYN_TCP_RPC_HOST: where the request plane, the response streams and the ZMQ publisher listen and the
    # address they advertise (None: loopback on one machine, else reachable; runtime/tcp.py listen_hosts).
    tcp_host: str | None = None
    # "tcp" (default, see docs/runtime.md for the measurement) or "nats".
    response_transport: str = "tcp"
    # Seconds of silence after which a stream's worker counts as frozen (docs/reliability.md).
    stream_liveness: float = DEFAULT_STREAM_LIVENESS
    # Seconds a Dynamo 1.x worker's stream may be silent after its first token (it sends no heartbeats;
    # DYN_STREAM_SILENCE_1X_S, 0: unbounded).
    stream_silence_1x: float = DEFAULT_SILENCE_1X
    # One call-home connection per worker for all streams (runtime/mux.py), offered by clients and
    # accepted by workers; DYN_TCP_MUX=0 keeps a connection per stream (the original's protocol).
    tcp_mux: bool = True
    system: SystemSettings = field(default_factory=SystemSettings)
    # Discovery: "etcd", "file", or None to choose at start-up (runtime/discovery_choice.py).
    discovery_backend: str | None = None
    # The file store's directory (None: DYN_FILE_KV, else $TMPDIR/dynamo_store_kv).
    file_kv: str | None = None
    # How requests reach a worker: "nats", "tcp" (the worker listens, its address in discovery), or None:
    # chosen at connect time (runtime/distributed.py says the rule and logs the choice).
    request_plane: str | None = None
    # Port of a worker's request-plane listener with "tcp" (0: any free port; the address is in discovery).
    tcp_rpc_port: int = 0
    # How KV events and load metrics travel: "nats", "zmq" (each publisher binds, subscribers find it in
    # discovery), or None: chosen at connect time, as the request plane.
    event_plane: str | None = None
    # DYN_FLEET_SECRET / DYN_FLEET_SECRET_FILE: every TCP connection of the planes proves it, ZMQ events are
    # CURVE-encrypted with keys derived from it (runtime/fleet_auth.py); None: no authentication, as before.
    fleet_secret: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls) -> "RuntimeSettings":
        # DYN_TCP_TLS_* read afresh for this runtime; a setting that cannot work stops it here, in one line
        tcp_tls.reset()
        tcp_tls.settings()
        timeout = _env("DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT")
        return cls(
            discovery_backend=discovery_backend_name(_env("DYN_DISCOVERY_BACKEND"), "DYN_DISCOVERY_BACKEND"),
            file_kv=_env("DYN_FILE_KV"),
            etcd=EtcdSettings.from_env(),
            nats=NatsSettings.from_env(),
            lease_ttl=int(_float_env("DYN_LEASE_TTL", DEFAULT_LEASE_TTL, minimum=1)),
            graceful_shutdown_timeout=float(timeout) if timeout else DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT,
            tcp_host=_env("DYN_TCP_RPC_HOST"),
            response_transport=(_env("DYN_RESPONSE_TRANSPORT") or "tcp").lower(),
            stream_liveness=_float_env("DYN_STREAM_LIVENESS_S", DEFAULT_STREAM_LIVENESS, minimum=0.05),
            stream_silence_1x=_float_env("DYN_STREAM_SILENCE_1X_S", DEFAULT_SILENCE_1X, minimum=0.0),
            tcp_mux=_bool_env("DYN_TCP_MUX", True),
            system=SystemSettings.from_env(),
            request_plane=_choice_env("DYN_REQUEST_PLANE", REQUEST_PLANES),
            tcp_rpc_port=_port_env("DYN_TCP_RPC_PORT"),
            event_plane=_choice_env("DYN_EVENT_PLANE", EVENT_PLANES),
            fleet_secret=load_secret(),
        )


REQUEST_PLANES = ("nats", "tcp")
EVENT_PLANES = ("nats", "zmq")


def check_choice(what: str, value: str | None, choices: tuple[str, ...]) -> str | None:
    """``value`` lowercased if it is one of ``choices`` (None: not given), else a clear error."""
    if value is None:
        return None
    low = value.strip().lower()
    if low not in choices:
        raise RuntimeConfigError(f"{what}={value!r}: use {' or '.join(choices)}")
    return low


def _choice_env(name: str, choices: tuple[str, ...]) -> str | None:
    return check_choice(name, _env(name), choices)


def _port_env(name: str) -> int:
    raw = _env(name)
    if raw is None:
        return 0
    try:
        port = int(raw)
    except ValueError:
        raise RuntimeConfigError(f"{name}={raw!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise RuntimeConfigError(f"{name}={raw!r} must be a port (0: any free one)")
    return port


DISCOVERY_BACKENDS = ("etcd", "file")
# the names Dynamo 1.x accepts for the same backends
_DISCOVERY_ALIASES = {"etcd": "etcd", "kv_store": "etcd", "file": "file"}


def discovery_backend_name(raw: str | None, source: str = "--discovery-backend") -> str | None:
    """``etcd`` / ``kv_store`` -> ``etcd``, ``file`` -> ``file``, None or ``auto`` -> None (choose at
    start-up); anything else is a clear error naming where it came from."""
    if raw is None or raw.strip().lower() in ("", "auto"):
        return None
    name = _DISCOVERY_ALIASES.get(raw.strip().lower())
    if name is None:
        raise RuntimeConfigError(f"{source}={raw!r}: use etcd (or kv_store) or file")
    return name
