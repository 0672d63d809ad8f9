"""A small asyncio etcd v3 client over etcd's JSON gRPC-gateway (``/v3/...``), built on aiohttp: the
etcd implementation of :class:`~dynamo.runtime.discovery.Discovery`.

Why not a gRPC client library: see docs/runtime.md ("etcd client"). In short, ``aetcd`` works but pulls
grpcio + protobuf (~22 MB) whose generated etcd descriptors clash with other etcd libraries in the same
process, and etcd is not on the request hot path: only registration, leases and watches go through it.

Only what the runtime needs is here: range/put/txn(create-if-absent)/delete and lease grant/keep-alive/
revoke. Prefix watches, which survive etcd outages by re-listing, are :mod:`.etcd_watch`; this client
opens their streams and owns them (closing the client ends them).

Connectivity is tracked per client: the first failure after a success logs one warning, the first
success after a failure logs one info line, whatever made the call (a watch, a keep-alive, a put).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any

import aiohttp
import orjson

from .config import EtcdSettings
from .discovery import KeyValue, WatchEvent, encode_value
from .errors import RuntimeConnectionError
from .etcd_watch import PrefixWatch
from .etcd_wire import (
    CONNECT_TIMEOUT,
    REQUEST_TIMEOUT,
    AuthExpired,
    EtcdError,
    auth_hint,
    b64,
    describe,
    is_auth_error,
    kv_from_gateway,
    prefix_range_end,
)
from .tls import client_context

log = logging.getLogger(__name__)

__all__ = ["EtcdClient", "EtcdError", "KeyValue", "PrefixWatch", "WatchEvent", "prefix_range_end"]


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
    def token(self) -> str | None:
        """The auth token in use (None without auth)."""
        return self._token

    @property
    def auth_enabled(self) -> bool:
        return bool(self.settings.username)

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
        s = self.settings
        return client_context(ca=s.ca_file, cert=s.cert_file, key=s.key_file,
                              names=("ETCD_AUTH_CA", "ETCD_AUTH_CLIENT_CERT", "ETCD_AUTH_CLIENT_KEY"))

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
                await self._post("/v3/kv/range", {"key": b64(b"\0")}, timeout=CONNECT_TIMEOUT, retry=False)
                self._connected = True
                return
            except RuntimeConnectionError as exc:
                errors.append(str(exc))
            except EtcdError as exc:
                await self.close()
                raise RuntimeConnectionError(f"cannot use etcd at {url}: {auth_hint(str(exc))}") from None
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

    async def reauthenticate(self, stale: str | None) -> None:
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
            reason = f"cannot reach etcd at {base}: {describe(exc)}"
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
                    and is_auth_error(status, raw.decode(errors="replace"))):
                await self.reauthenticate(token)  # token expired or etcd restarted: once more, fresh token
                return await self._post_once(url, body, timeout)
            raise EtcdError(f"etcd error {status}: {message}")
        return result

    # ------------------------------------------------------------------ key-value

    async def put(self, key: str, value: bytes | str | dict | list, lease: int = 0) -> int:
        """Write ``key``; returns the new revision."""
        body: dict[str, Any] = {"key": b64(key.encode()), "value": b64(encode_value(value))}
        if lease:
            body["lease"] = str(lease)
        result = await self._post("/v3/kv/put", body)
        return int(result.get("header", {}).get("revision", 0))

    async def create(self, key: str, value: bytes | str | dict | list, lease: int = 0) -> bool:
        """Create-if-absent (a transaction on version == 0). True if this call created the key."""
        put: dict[str, Any] = {"key": b64(key.encode()), "value": b64(encode_value(value))}
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
        result = await self._post("/v3/kv/range", {"key": b64(key.encode())})
        kvs = result.get("kvs") or []
        return kv_from_gateway(kvs[0]) if kvs else None

    async def get_prefix_with_revision(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the store revision the listing reflects."""
        raw = prefix.encode()
        body = {"key": b64(raw), "range_end": b64(prefix_range_end(raw))}
        result = await self._post("/v3/kv/range", body)
        kvs = [kv_from_gateway(kv) for kv in result.get("kvs") or []]
        return kvs, int(result.get("header", {}).get("revision", 0))

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        return (await self.get_prefix_with_revision(prefix))[0]

    async def delete(self, key: str) -> int:
        """Delete one key; returns how many were deleted (0 or 1)."""
        result = await self._post("/v3/kv/deleterange", {"key": b64(key.encode())})
        return int(result.get("deleted", 0))

    async def delete_prefix(self, prefix: str) -> int:
        raw = prefix.encode()
        body = {"key": b64(raw), "range_end": b64(prefix_range_end(raw))}
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
        raw = b64(key.encode())
        body = {
            "compare": [
                {"key": raw, "target": "VALUE", "result": "EQUAL", "value": b64(value)},
                {"key": raw, "target": "LEASE", "result": "EQUAL", "lease": str(lease)},
            ],
            "success": [],
            "failure": [{"request_put": {"key": raw, "value": b64(value), "lease": str(lease)}}],
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
        watch = PrefixWatch(self, prefix, resync_grace=self.settings.resync_grace, on_close=self._watches.discard)
        self._watches.add(watch)
        return watch

    async def open_watch_stream(self, prefix: str, start_revision: int) -> aiohttp.ClientResponse:
        if self._session is None:
            raise EtcdError("etcd client is not connected")
        raw = prefix.encode()
        create = {"key": b64(raw), "range_end": b64(prefix_range_end(raw)), "start_revision": str(start_revision)}
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
            reason = f"cannot reach etcd at {url[:-9]}: {describe(exc)}"
            self._note_down(reason)
            raise RuntimeConnectionError(reason) from None
        self._note_up()
        if resp.status != 200:
            text = await resp.text()
            resp.release()
            if self.settings.username and is_auth_error(resp.status, text):
                await self.reauthenticate(token)
                raise AuthExpired(f"etcd watch refused the token ({resp.status}); re-authenticated")
            raise EtcdError(f"etcd watch error {resp.status}: {text}")
        return resp
