"""A small asyncio etcd v3 client over etcd's JSON gRPC-gateway (``/v3/...``), built on aiohttp.

Why not a gRPC client library: see docs/runtime.md ("etcd client"). In short, ``aetcd`` works but pulls
grpcio + protobuf (~22 MB) whose generated etcd descriptors clash with other etcd libraries in the same
process, and etcd is not on the request hot path: only registration, leases and watches go through it.

Only what the runtime needs is here: range/put/txn(create-if-absent)/delete, lease grant/keep-alive/
revoke, and prefix watches with get-then-watch (no gap) and transparent re-watch after a broken stream
or compaction.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

import aiohttp
import orjson

from dynamo.aio import cancel_and_wait
from .config import EtcdSettings
from .errors import DynamoRuntimeError, RuntimeConnectionError

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 5.0
CONNECT_TIMEOUT = 3.0


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _to_bytes(value: bytes | str | dict | list) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return orjson.dumps(value)


def prefix_range_end(prefix: bytes) -> bytes:
    """etcd's range end for "every key starting with prefix": prefix with its last byte + 1."""
    buf = bytearray(prefix)
    while buf:
        if buf[-1] < 0xFF:
            buf[-1] += 1
            return bytes(buf)
        buf.pop()
    return b"\0"  # every key


@dataclass(slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int = 0
    mod_revision: int = 0
    version: int = 0
    lease: int = 0

    def json(self) -> Any:
        return orjson.loads(self.value)

    @classmethod
    def from_gateway(cls, kv: dict) -> "KeyValue":
        return cls(
            key=_unb64(kv.get("key")).decode(),
            value=_unb64(kv.get("value")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
            version=int(kv.get("version", 0)),
            lease=int(kv.get("lease", 0)),
        )


@dataclass(slots=True)
class WatchEvent:
    """One change under a watched prefix. ``initial`` marks events synthesised from the first listing."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    revision: int
    lease: int = 0
    initial: bool = False

    PUT = "put"
    DELETE = "delete"

    def json(self) -> Any:
        return orjson.loads(self.value)


class EtcdError(DynamoRuntimeError):
    """etcd answered with an error (not a connectivity problem)."""


def _describe(exc: BaseException) -> str:
    """A short lowercase reason for a connection failure, e.g. 'connection refused'."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    os_err = getattr(exc, "os_error", None) or (exc if isinstance(exc, OSError) else None)
    if isinstance(os_err, OSError):
        if os_err.errno:
            return os.strerror(os_err.errno).lower()
        if os_err.strerror:
            return os_err.strerror.lower()
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0]


class EtcdClient:
    """Async etcd v3 client. Create, ``await connect()``, use, ``await close()``."""

    def __init__(self, settings: EtcdSettings | None = None) -> None:
        self.settings = settings or EtcdSettings()
        self._endpoints = list(self.settings.endpoints)
        self._session: aiohttp.ClientSession | None = None
        self._token: str | None = None
        self._watches: set[PrefixWatch] = set()

    @property
    def endpoint(self) -> str:
        """The etcd URL currently in use."""
        return self._endpoints[0]

    # ------------------------------------------------------------------ connection

    async def connect(self) -> None:
        """Open the HTTP session and check that some endpoint answers; raise RuntimeConnectionError otherwise."""
        ssl_ctx: ssl.SSLContext | None = None
        if self.settings.ca_file or self.settings.cert_file:
            ssl_ctx = ssl.create_default_context(cafile=self.settings.ca_file)
            if self.settings.cert_file:
                ssl_ctx.load_cert_chain(self.settings.cert_file, self.settings.key_file)
        # no connection cap: every watch holds one streaming connection for its lifetime
        connector = aiohttp.TCPConnector(limit=0, ssl=ssl_ctx if ssl_ctx else False)
        self._session = aiohttp.ClientSession(connector=connector)
        errors: list[str] = []
        for _ in range(len(self._endpoints)):
            url = self.endpoint
            try:
                await self._authenticate()
                await self._post("/v3/kv/range", {"key": _b64(b"\0")}, timeout=CONNECT_TIMEOUT, retry=False)
                return
            except RuntimeConnectionError as exc:
                errors.append(str(exc))
            except EtcdError as exc:
                await self.close()
                raise RuntimeConnectionError(f"cannot use etcd at {url}: {exc}") from None
            self._rotate()
        await self.close()
        raise RuntimeConnectionError("; ".join(errors))

    async def close(self) -> None:
        """Close the session and end every watch made from this client (their iterators stop)."""
        for watch in list(self._watches):
            await watch.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _rotate(self) -> None:
        self._endpoints.append(self._endpoints.pop(0))

    async def _authenticate(self) -> None:
        if not self.settings.username:
            return
        self._token = None
        body = {"name": self.settings.username, "password": self.settings.password or ""}
        result = await self._post("/v3/auth/authenticate", body, retry=False)
        self._token = result.get("token")

    async def _post(self, path: str, body: dict, *, timeout: float = REQUEST_TIMEOUT, retry: bool = True) -> dict:
        """POST a JSON body to the current endpoint; fail over to the next endpoint once on connect errors."""
        attempts = len(self._endpoints) if retry else 1
        for attempt in range(attempts):
            url = self.endpoint
            try:
                return await self._post_once(url + path, body, timeout)
            except RuntimeConnectionError:
                if attempt + 1 >= attempts:
                    raise
                self._rotate()
        raise AssertionError("unreachable")

    async def _post_once(self, url: str, body: dict, timeout: float) -> dict:
        if self._session is None:
            raise EtcdError("etcd client is not connected")
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = self._token
        try:
            async with self._session.post(
                url, data=orjson.dumps(body), headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as exc:
            base = url.split("/v3/")[0]
            raise RuntimeConnectionError(f"cannot reach etcd at {base}: {_describe(exc)}") from None
        result = orjson.loads(raw) if raw else {}
        if status != 200:
            message = result.get("message") or result.get("error") or raw.decode(errors="replace")
            if status == 401 and self.settings.username and "/auth/" not in url:
                await self._authenticate()  # token expired: once more with a fresh one
                return await self._post_once(url, body, timeout)
            raise EtcdError(f"etcd error {status}: {message}")
        return result

    # ------------------------------------------------------------------ key-value

    async def put(self, key: str, value: bytes | str | dict | list, lease: int = 0) -> int:
        """Write ``key``; returns the new revision."""
        body: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(_to_bytes(value))}
        if lease:
            body["lease"] = str(lease)
        result = await self._post("/v3/kv/put", body)
        return int(result.get("header", {}).get("revision", 0))

    async def create(self, key: str, value: bytes | str | dict | list, lease: int = 0) -> bool:
        """Create-if-absent (a transaction on version == 0). True if this call created the key."""
        put: dict[str, Any] = {"key": _b64(key.encode()), "value": _b64(_to_bytes(value))}
        if lease:
            put["lease"] = str(lease)
        body = {
            "compare": [{"key": put["key"], "target": "VERSION", "result": "EQUAL", "version": "0"}],
            "success": [{"request_put": put}],
            "failure": [],
        }
        result = await self._post("/v3/kv/txn", body)
        return bool(result.get("succeeded", False))

    async def get(self, key: str) -> KeyValue | None:
        result = await self._post("/v3/kv/range", {"key": _b64(key.encode())})
        kvs = result.get("kvs") or []
        return KeyValue.from_gateway(kvs[0]) if kvs else None

    async def get_prefix_with_revision(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the store revision the listing reflects."""
        raw = prefix.encode()
        body = {"key": _b64(raw), "range_end": _b64(prefix_range_end(raw))}
        result = await self._post("/v3/kv/range", body)
        kvs = [KeyValue.from_gateway(kv) for kv in result.get("kvs") or []]
        return kvs, int(result.get("header", {}).get("revision", 0))

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        return (await self.get_prefix_with_revision(prefix))[0]

    async def delete(self, key: str) -> int:
        """Delete one key; returns how many were deleted (0 or 1)."""
        result = await self._post("/v3/kv/deleterange", {"key": _b64(key.encode())})
        return int(result.get("deleted", 0))

    async def delete_prefix(self, prefix: str) -> int:
        raw = prefix.encode()
        body = {"key": _b64(raw), "range_end": _b64(prefix_range_end(raw))}
        return int((await self._post("/v3/kv/deleterange", body)).get("deleted", 0))

    # ------------------------------------------------------------------ leases

    async def grant_lease(self, ttl: int) -> int:
        result = await self._post("/v3/lease/grant", {"TTL": str(ttl), "ID": "0"})
        if result.get("error"):
            raise EtcdError(f"lease grant failed: {result['error']}")
        return int(result["ID"])

    async def keep_alive_once(self, lease_id: int) -> int:
        """Refresh a lease; returns its TTL, or 0 if etcd no longer knows it (expired or revoked)."""
        result = await self._post("/v3/lease/keepalive", {"ID": str(lease_id)})
        return int((result.get("result") or {}).get("TTL", 0))

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease (deleting its keys). An unknown lease is not an error."""
        try:
            await self._post("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    # ------------------------------------------------------------------ watches

    def watch_prefix(self, prefix: str) -> "PrefixWatch":
        """Get-then-watch ``prefix``: yields the existing keys as ``initial`` put events, then changes.

        ``async for ev in client.watch_prefix("models"): ...``; or ``w = await client.watch_prefix(p)``
        to have the listing in ``w.initial`` before iterating. Close with ``await w.close()``.
        """
        watch = PrefixWatch(self, prefix)
        self._watches.add(watch)
        return watch

    async def _open_watch_stream(self, prefix: str, start_revision: int) -> aiohttp.ClientResponse:
        if self._session is None:
            raise EtcdError("etcd client is not connected")
        raw = prefix.encode()
        create = {"key": _b64(raw), "range_end": _b64(prefix_range_end(raw)), "start_revision": str(start_revision)}
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = self._token
        url = self.endpoint + "/v3/watch"
        try:
            resp = await self._session.post(
                url, data=orjson.dumps({"create_request": create}), headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_read=None),
            )
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as exc:
            self._rotate()
            raise RuntimeConnectionError(f"cannot reach etcd at {url[:-9]}: {_describe(exc)}") from None
        if resp.status != 200:
            text = await resp.text()
            resp.release()
            raise EtcdError(f"etcd watch error {resp.status}: {text}")
        return resp


class _Compacted(Exception):
    pass


class PrefixWatch:
    """A running get-then-watch on a prefix. See :meth:`EtcdClient.watch_prefix`."""

    RETRY_DELAY = 0.5

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self._client = client
        self.prefix = prefix
        self.initial: list[KeyValue] = []
        self._queue: asyncio.Queue[WatchEvent | BaseException | None] = asyncio.Queue()
        self._known: dict[str, int] = {}  # key -> mod_revision, to re-sync after compaction
        self._revision = 0
        self._task: asyncio.Task | None = None
        self._started = False
        self._closed = False

    async def start(self) -> "PrefixWatch":
        """Do the initial listing and start watching from the revision right after it."""
        if self._started:
            return self
        self._started = True
        kvs, revision = await self._client.get_prefix_with_revision(self.prefix)
        self.initial = kvs
        self._revision = revision
        for kv in kvs:
            self._known[kv.key] = kv.mod_revision
            self._queue.put_nowait(WatchEvent("put", kv.key, kv.value, kv.mod_revision, kv.lease, initial=True))
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"etcd-watch:{self.prefix}")
        return self

    def __await__(self):
        return self.start().__await__()

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self

    async def __anext__(self) -> WatchEvent:
        if not self._started:
            await self.start()
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self) -> None:
        self._closed = True
        self._client._watches.discard(self)
        await cancel_and_wait(self._task)
        self._task = None
        self._queue.put_nowait(None)

    async def __aenter__(self) -> "PrefixWatch":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _run(self) -> None:
        """Keep a watch stream open from ``_revision + 1``; re-open after errors, re-list after compaction."""
        while not self._closed:
            try:
                await self._stream_once()
            except asyncio.CancelledError:
                raise
            except _Compacted:
                await self._resync()
                continue
            except Exception as exc:  # connection dropped, etcd restarting...
                log.debug("etcd watch on %s broke (%s); re-watching", self.prefix, exc)
            await asyncio.sleep(self.RETRY_DELAY)

    async def _stream_once(self) -> None:
        resp = await self._client._open_watch_stream(self.prefix, self._revision + 1)
        try:
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while True:
                    nl = buf.find(b"\n")
                    if nl < 0:
                        break
                    line, buf = buf[:nl], buf[nl + 1:]
                    if line.strip():
                        self._handle_message(orjson.loads(line))
        finally:
            resp.release()

    def _handle_message(self, msg: dict) -> None:
        if "error" in msg:
            raise EtcdError(f"etcd watch error: {msg['error']}")
        result = msg.get("result") or {}
        if int(result.get("compact_revision", 0) or 0) > 0:
            raise _Compacted()
        if result.get("canceled"):
            raise EtcdError(f"etcd watch canceled: {result.get('cancel_reason', '')}")
        for ev in result.get("events") or ():
            kv = ev.get("kv") or {}
            key = _unb64(kv.get("key")).decode()
            rev = int(kv.get("mod_revision", 0))
            if ev.get("type") == "DELETE":
                self._known.pop(key, None)
                self._queue.put_nowait(WatchEvent("delete", key, b"", rev))
            else:
                self._known[key] = rev
                self._queue.put_nowait(WatchEvent("put", key, _unb64(kv.get("value")), rev, int(kv.get("lease", 0))))
            self._revision = max(self._revision, rev)

    async def _resync(self) -> None:
        """After compaction we may have missed changes: list again and emit the difference."""
        kvs, revision = await self._client.get_prefix_with_revision(self.prefix)
        current = {kv.key: kv for kv in kvs}
        for key in list(self._known):
            if key not in current:
                del self._known[key]
                self._queue.put_nowait(WatchEvent("delete", key, b"", revision))
        for key, kv in current.items():
            if self._known.get(key) != kv.mod_revision:
                self._known[key] = kv.mod_revision
                self._queue.put_nowait(WatchEvent("put", key, kv.value, kv.mod_revision, kv.lease))
        self._revision = revision
