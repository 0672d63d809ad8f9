"""A small asyncio etcd v3 client over etcd's JSON gRPC-gateway (``/v3/...``), built on aiohttp.

Why not a gRPC client library: see docs/runtime.md ("etcd client"). In short, ``aetcd`` works but pulls
grpcio + protobuf (~22 MB) whose generated etcd descriptors clash with other etcd libraries in the same
process, and etcd is not on the request hot path: only registration, leases and watches go through it.

Only what the runtime needs is here: range/put/txn(create-if-absent)/delete, lease grant/keep-alive/
revoke, and prefix watches with get-then-watch (no gap) that survive etcd outages: a broken stream is
re-opened with backoff after a fresh listing (so compaction, a wiped etcd or one restored from an older
snapshot, where the revision goes backwards, are all caught up by emitting the difference).

Connectivity is tracked per client: the first failure after a success logs one warning, the first
success after a failure logs one info line, whatever made the call (a watch, a keep-alive, a put).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import random
import ssl
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Literal

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


class _AuthExpired(EtcdError):
    """etcd refused our token (expired, or etcd restarted and forgot it): authenticate again."""


def _is_auth_error(status: int, text: str) -> bool:
    lowered = text.lower()
    return status == 401 or "invalid auth token" in lowered or '"grpc_code":16' in lowered.replace(" ", "")


def backoff_delays(first: float = 0.25, cap: float = 2.0) -> "Iterator[float]":
    """Retry delays: ``first`` doubling up to ``cap``, each with +-20 % jitter (so a fleet that lost etcd
    at the same moment does not hammer it in step when it returns)."""
    delay = first
    while True:
        yield delay * random.uniform(0.8, 1.2)
        delay = min(delay * 2, cap)


def _describe(exc: BaseException) -> str:
    """A short lowercase reason for a connection failure, e.g. 'connection refused'."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    cert_error = getattr(exc, "certificate_error", None)
    if isinstance(cert_error, ssl.SSLCertVerificationError):
        detail = cert_error.verify_message or str(cert_error)
        return f"certificate verify failed: {detail} (ETCD_AUTH_CA names the CA to trust)"
    if isinstance(exc, aiohttp.ClientSSLError):
        return f"TLS failed: {str(exc).splitlines()[0]}"
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
        self._down_since: float | None = None  # monotonic time of the first failure of an outage
        self._connected = False  # before connect() succeeds a failure is connect()'s to report
        self._auth_lock = asyncio.Lock()

    @property
    def endpoint(self) -> str:
        """The etcd URL currently in use."""
        return self._endpoints[0]

    @property
    def reachable(self) -> bool:
        """False from the first failed call of an outage until the next call that succeeds."""
        return self._down_since is None

    def _note_down(self, reason: str) -> None:
        if self._down_since is None and self._connected:
            self._down_since = time.monotonic()
            log.warning("etcd unreachable (%s); serving goes on with what is known, retrying", reason)

    def _note_up(self) -> None:
        if self._down_since is not None:
            down_for = time.monotonic() - self._down_since
            self._down_since = None
            log.info("etcd at %s reachable again after %.1fs", self.endpoint, down_for)

    # ------------------------------------------------------------------ connection

    def _ssl_context(self) -> ssl.SSLContext:
        """Verify the server's certificate, against ETCD_AUTH_CA if given, else the system trust store."""
        ctx = ssl.create_default_context(cafile=self.settings.ca_file)
        if self.settings.cert_file:
            ctx.load_cert_chain(self.settings.cert_file, self.settings.key_file)
        return ctx

    async def connect(self) -> None:
        """Open the HTTP session and check that some endpoint answers; raise RuntimeConnectionError otherwise."""
        # no connection cap: every watch holds one streaming connection for its lifetime
        connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl_context())
        self._session = aiohttp.ClientSession(connector=connector)
        errors: list[str] = []
        for _ in range(len(self._endpoints)):
            url = self.endpoint
            try:
                await self._authenticate()
                await self._post("/v3/kv/range", {"key": _b64(b"\0")}, timeout=CONNECT_TIMEOUT, retry=False)
                self._connected = True
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

    async def _reauthenticate(self, stale: str | None) -> None:
        """A fresh token, unless another task already replaced ``stale`` meanwhile."""
        async with self._auth_lock:
            if self._token == stale or self._token is None:
                await self._authenticate()

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
        token = self._token
        if token:
            headers["Authorization"] = token
        try:
            async with self._session.post(
                url, data=orjson.dumps(body), headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as exc:
            base = url.split("/v3/")[0]
            reason = f"cannot reach etcd at {base}: {_describe(exc)}"
            self._note_down(reason)
            raise RuntimeConnectionError(reason) from None
        self._note_up()
        try:
            result = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            result = {"message": raw.decode(errors="replace")[:200]}
        if status != 200:
            message = result.get("message") or result.get("error") or raw.decode(errors="replace")
            if (self.settings.username and "/auth/" not in url
                    and _is_auth_error(status, raw.decode(errors="replace"))):
                await self._reauthenticate(token)  # token expired or etcd restarted: once more, fresh token
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

    async def grant_lease(self, ttl: int, lease_id: int = 0) -> int:
        """Grant a lease; ``lease_id`` asks for that id (0: etcd picks). Returns the id.

        Asking for a known id is how an instance keeps its identity after etcd lost its lease: the id is
        in its keys and NATS subjects. EtcdError if that id is in use.
        """
        result = await self._post("/v3/lease/grant", {"TTL": str(ttl), "ID": str(lease_id)})
        if result.get("error"):
            raise EtcdError(f"lease grant failed: {result['error']}")
        return int(result["ID"])

    async def keep_alive(self, lease_id: int) -> tuple[int, int]:
        """Refresh a lease: (TTL, store revision). TTL 0 means etcd does not know the lease (expired,
        revoked, or etcd was wiped)."""
        result = (await self._post("/v3/lease/keepalive", {"ID": str(lease_id)})).get("result") or {}
        return int(result.get("TTL", 0)), int((result.get("header") or {}).get("revision", 0))

    async def keep_alive_once(self, lease_id: int) -> int:
        """Refresh a lease; returns its TTL, or 0 if etcd no longer knows it (expired or revoked)."""
        return (await self.keep_alive(lease_id))[0]

    async def put_if_changed(self, key: str, value: bytes, lease: int) -> bool:
        """Write ``key`` unless it already holds ``value`` under ``lease`` (so no watcher sees an event
        for nothing). True if it wrote."""
        raw = _b64(key.encode())
        body = {
            "compare": [
                {"key": raw, "target": "VALUE", "result": "EQUAL", "value": _b64(value)},
                {"key": raw, "target": "LEASE", "result": "EQUAL", "lease": str(lease)},
            ],
            "success": [],
            "failure": [{"request_put": {"key": raw, "value": _b64(value), "lease": str(lease)}}],
        }
        result = await self._post("/v3/kv/txn", body)
        return not result.get("succeeded", False)

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
        watch = PrefixWatch(self, prefix, resync_grace=self.settings.resync_grace)
        self._watches.add(watch)
        return watch

    async def _open_watch_stream(self, prefix: str, start_revision: int) -> aiohttp.ClientResponse:
        if self._session is None:
            raise EtcdError("etcd client is not connected")
        raw = prefix.encode()
        create = {"key": _b64(raw), "range_end": _b64(prefix_range_end(raw)), "start_revision": str(start_revision)}
        headers = {"Content-Type": "application/json"}
        token = self._token
        if token:
            headers["Authorization"] = token
        url = self.endpoint + "/v3/watch"
        try:
            resp = await self._session.post(
                url, data=orjson.dumps({"create_request": create}), headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT, sock_read=None),
            )
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as exc:
            self._rotate()
            reason = f"cannot reach etcd at {url[:-9]}: {_describe(exc)}"
            self._note_down(reason)
            raise RuntimeConnectionError(reason) from None
        self._note_up()
        if resp.status != 200:
            text = await resp.text()
            resp.release()
            if self.settings.username and _is_auth_error(resp.status, text):
                await self._reauthenticate(token)
                raise _AuthExpired(f"etcd watch refused the token ({resp.status}); re-authenticated")
            raise EtcdError(f"etcd watch error {resp.status}: {text}")
        return resp


class _Compacted(Exception):
    pass


class PrefixWatch:
    """A running get-then-watch on a prefix. See :meth:`EtcdClient.watch_prefix`.

    It never ends by itself: when the stream breaks (etcd restarting, unreachable, compacted, token
    expired) it retries with backoff, and each time it gets through it first lists the prefix again and
    emits the difference from what it had emitted, then watches from that listing's revision. So a wiped
    etcd, or one restored from an older snapshot (the revision went backwards, where watching from our
    old revision would wait for changes that never come), is caught up like compaction is. Deletions
    found that way are held back ``resync_grace`` seconds, cancelled if the key comes back meanwhile:
    after a wipe, live workers re-publish their keys within a few seconds, and a consumer must not drop
    a model they still serve. Deletions seen live are emitted at once.
    """

    RETRY_FIRST = 0.25
    RETRY_CAP = 2.0

    def __init__(self, client: EtcdClient, prefix: str, *, resync_grace: float = 0.0) -> None:
        self._client = client
        self.prefix = prefix
        self.resync_grace = resync_grace
        self.initial: list[KeyValue] = []
        self._queue: asyncio.Queue[WatchEvent | BaseException | None] = asyncio.Queue()
        # key -> (value, lease) as last emitted, to emit only the difference after a re-list
        self._known: dict[str, tuple[bytes, int]] = {}
        self._pending_deletes: dict[str, asyncio.TimerHandle] = {}
        self._revision = 0
        self._task: asyncio.Task | None = None
        self._started = False
        self._closed = False
        self.resyncs = 0  # how many re-lists ran (tests and diagnostics)
        self._failing = False  # a warning was logged for the current run of failures
        self._auth_retried = False
        self._stream_token: str | None = None

    async def start(self) -> "PrefixWatch":
        """Do the initial listing and start watching from the revision right after it."""
        if self._started:
            return self
        self._started = True
        kvs, revision = await self._client.get_prefix_with_revision(self.prefix)
        self.initial = kvs
        self._revision = revision
        for kv in kvs:
            self._known[kv.key] = (kv.value, kv.lease)
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
        for handle in self._pending_deletes.values():
            handle.cancel()
        self._pending_deletes.clear()
        self._queue.put_nowait(None)

    async def __aenter__(self) -> "PrefixWatch":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _run(self) -> None:
        """Keep a watch stream open from ``_revision + 1``; after any break, re-list then re-watch."""
        delays = backoff_delays(self.RETRY_FIRST, self.RETRY_CAP)
        need_resync = False
        while not self._closed:
            try:
                if need_resync:
                    await self._resync()
                    need_resync = False
                    delays = backoff_delays(self.RETRY_FIRST, self.RETRY_CAP)
                await self._stream_once()
                need_resync = True  # etcd ended the stream (it is stopping): catch up when it is back
            except asyncio.CancelledError:
                raise
            except _Compacted:
                need_resync = True
                continue  # etcd is up: re-list at once
            except _AuthExpired as exc:
                need_resync = True
                if not self._auth_retried:  # our token went stale (expired, etcd restarted): once more, fresh
                    self._auth_retried = True
                    log.debug("%s", exc)
                    try:
                        await self._client._reauthenticate(self._stream_token)
                    except Exception as auth_exc:  # noqa: BLE001 - etcd gone again: the loop retries
                        log.debug("etcd re-authentication failed: %s", auth_exc)
                    continue
                self._note_failure(f"refused with a fresh token too: {exc}")
            except (RuntimeConnectionError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError,
                    asyncio.TimeoutError, OSError) as exc:
                # etcd went away (the client logs the outage once) or cut the stream while stopping
                need_resync = True
                log.debug("etcd watch on %s: %s; retrying", self.prefix, exc)
            except Exception as exc:  # noqa: BLE001 - an error answer, a broken stream, a bug: never die
                need_resync = True
                self._note_failure(str(exc), exc_info=not isinstance(exc, (EtcdError, aiohttp.ClientError, ValueError)))
            await asyncio.sleep(next(delays))

    def _note_failure(self, reason: str, *, exc_info: bool = False) -> None:
        """One warning for a run of failures (other than etcd being unreachable, which the client logs)."""
        if self._failing:
            log.debug("etcd watch on %s still failing: %s", self.prefix, reason)
            return
        self._failing = True
        log.warning("etcd watch on %s failed (%s); re-listing and re-watching with backoff", self.prefix, reason,
                    exc_info=exc_info)

    async def _stream_once(self) -> None:
        self._stream_token = self._client._token
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

    def _auth_refused(self, text: str) -> bool:
        # a stale token on a watch shows as "invalid auth token" or, for the gateway, "permission denied"
        lowered = text.lower()
        return bool(self._client.settings.username) and (
            _is_auth_error(0, text) or "permission denied" in lowered)

    def _handle_message(self, msg: dict) -> None:
        if "error" in msg:
            text = orjson.dumps(msg["error"]).decode()
            if self._auth_refused(text):
                raise _AuthExpired(f"etcd watch on {self.prefix}: token refused ({text})")
            raise EtcdError(f"etcd watch error: {text}")
        result = msg.get("result") or {}
        if int(result.get("compact_revision", 0) or 0) > 0:
            raise _Compacted()
        if result.get("canceled"):
            reason = str(result.get("cancel_reason", ""))
            if self._auth_refused(reason):
                raise _AuthExpired(f"etcd watch on {self.prefix}: token refused ({reason})")
            raise EtcdError(f"etcd watch canceled: {reason}")
        if result.get("created"):  # etcd accepted the watch: whatever was failing works again
            self._auth_retried = False
            if self._failing:
                self._failing = False
                log.info("etcd watch on %s works again", self.prefix)
        for ev in result.get("events") or ():
            kv = ev.get("kv") or {}
            key = _unb64(kv.get("key")).decode()
            rev = int(kv.get("mod_revision", 0))
            self._cancel_pending_delete(key)
            if ev.get("type") == "DELETE":
                self._known.pop(key, None)
                self._queue.put_nowait(WatchEvent("delete", key, b"", rev))
            else:
                value, lease = _unb64(kv.get("value")), int(kv.get("lease", 0))
                self._known[key] = (value, lease)
                self._queue.put_nowait(WatchEvent("put", key, value, rev, lease))
            self._revision = max(self._revision, rev)

    def _cancel_pending_delete(self, key: str) -> None:
        handle = self._pending_deletes.pop(key, None)
        if handle is not None:
            handle.cancel()

    async def _resync(self) -> None:
        """List again and emit the difference from what was emitted (missed changes, wipe, restore)."""
        kvs, revision = await self._client.get_prefix_with_revision(self.prefix)
        self.resyncs += 1
        if revision < self._revision:
            log.warning("etcd revision went backwards (%d -> %d; etcd was wiped or restored from a snapshot): "
                        "re-listed %s", self._revision, revision, self.prefix)
        current = {kv.key: kv for kv in kvs}
        gone = [key for key in self._known if key not in current and key not in self._pending_deletes]
        for key in gone:
            if self.resync_grace > 0:
                loop = asyncio.get_running_loop()
                self._pending_deletes[key] = loop.call_later(self.resync_grace, self._expire, key, revision)
            else:
                self._emit_delete(key, revision)
        for key, kv in current.items():
            self._cancel_pending_delete(key)
            if self._known.get(key) != (kv.value, kv.lease):
                self._known[key] = (kv.value, kv.lease)
                self._queue.put_nowait(WatchEvent("put", key, kv.value, kv.mod_revision, kv.lease))
        self._revision = revision

    def _expire(self, key: str, revision: int) -> None:
        self._pending_deletes.pop(key, None)
        if not self._closed and key in self._known:
            self._emit_delete(key, revision)

    def _emit_delete(self, key: str, revision: int) -> None:
        self._known.pop(key, None)
        self._queue.put_nowait(WatchEvent("delete", key, b"", revision))
