"""Prefix watches on etcd that never end by themselves: get-then-watch (no gap between the listing and
the first change), and after any break (etcd restarting or unreachable, compaction, an expired token) a
fresh listing whose difference from what was emitted is emitted, then a new watch from its revision.

A wiped etcd, or one restored from an older snapshot (the revision went backwards, where watching from
our old revision would wait for changes that never come), is caught up that way like compaction is.
The watch only needs a :class:`WatchSource` (the etcd client): listing with a revision, opening a watch
stream, and re-authenticating.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Protocol

import aiohttp
import orjson

from dynamo.aio import cancel_and_wait

from .backoff import backoff_delays
from .discovery import KeyValue, ListedWatch
from .errors import RuntimeConnectionError
from .etcd_wire import AuthExpired, EtcdError, is_auth_error, unb64

log = logging.getLogger(__name__)


class WatchSource(Protocol):
    """What a watch needs from the etcd client that made it."""

    @property
    def token(self) -> str | None:
        """The auth token in use (None without auth)."""

    @property
    def auth_enabled(self) -> bool: ...

    async def get_prefix_with_revision(self, prefix: str) -> tuple[list[KeyValue], int]: ...

    async def open_watch_stream(self, prefix: str, start_revision: int) -> Any:
        """An ``aiohttp.ClientResponse`` streaming the gateway's watch messages, one JSON per line."""

    async def reauthenticate(self, stale: str | None) -> None: ...


class WatchCompacted(Exception):
    """etcd compacted away the revision the watch asked for: re-list."""


class PrefixWatch(ListedWatch):
    """A running get-then-watch on a prefix (a :class:`~dynamo.runtime.discovery.DiscoveryWatch`).

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

    def __init__(self, client: WatchSource, prefix: str, *, resync_grace: float = 0.0,
                 on_close: Callable[["PrefixWatch"], None] | None = None) -> None:
        super().__init__(prefix)
        self._client = client
        self._on_close = on_close
        self.resync_grace = resync_grace
        self._pending_deletes: dict[str, asyncio.TimerHandle] = {}
        self._revision = 0
        self._task: asyncio.Task | None = None
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
        self._revision = revision
        self._emit_listing(kvs)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"etcd-watch:{self.prefix}")
        return self

    async def close(self) -> None:
        self._closed = True
        if self._on_close is not None:
            self._on_close(self)
        await cancel_and_wait(self._task)
        self._task = None
        for handle in self._pending_deletes.values():
            handle.cancel()
        self._pending_deletes.clear()
        self._end()

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
            except WatchCompacted:
                need_resync = True
                continue  # etcd is up: re-list at once
            except AuthExpired as exc:
                need_resync = True
                if not self._auth_retried:  # our token went stale (expired, etcd restarted): once more, fresh
                    self._auth_retried = True
                    log.debug("%s", exc)
                    try:
                        await self._client.reauthenticate(self._stream_token)
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
        self._stream_token = self._client.token
        resp = await self._client.open_watch_stream(self.prefix, self._revision + 1)
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
        return self._client.auth_enabled and (
            is_auth_error(0, text) or "permission denied" in lowered)

    def _handle_message(self, msg: dict) -> None:
        if "error" in msg:
            text = orjson.dumps(msg["error"]).decode()
            if self._auth_refused(text):
                raise AuthExpired(f"etcd watch on {self.prefix}: token refused ({text})")
            raise EtcdError(f"etcd watch error: {text}")
        result = msg.get("result") or {}
        if int(result.get("compact_revision", 0) or 0) > 0:
            raise WatchCompacted()
        if result.get("canceled"):
            reason = str(result.get("cancel_reason", ""))
            if self._auth_refused(reason):
                raise AuthExpired(f"etcd watch on {self.prefix}: token refused ({reason})")
            raise EtcdError(f"etcd watch canceled: {reason}")
        if result.get("created"):  # etcd accepted the watch: whatever was failing works again
            self._auth_retried = False
            if self._failing:
                self._failing = False
                log.info("etcd watch on %s works again", self.prefix)
        for ev in result.get("events") or ():
            kv = ev.get("kv") or {}
            key = unb64(kv.get("key")).decode()
            rev = int(kv.get("mod_revision", 0))
            self._cancel_pending_delete(key)
            if ev.get("type") == "DELETE":
                self._emit_delete(key, rev)
            else:
                self._emit_put(key, unb64(kv.get("value")), rev, int(kv.get("lease", 0)))
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
        for key in current:  # back within the grace: no delete
            self._cancel_pending_delete(key)
        self._emit_difference(current, revision, self._delete_after_grace)
        self._revision = revision

    def _delete_after_grace(self, key: str, revision: int) -> None:
        if key in self._pending_deletes:
            return
        if self.resync_grace > 0:
            loop = asyncio.get_running_loop()
            self._pending_deletes[key] = loop.call_later(self.resync_grace, self._expire, key, revision)
        else:
            self._emit_delete(key, revision)

    def _expire(self, key: str, revision: int) -> None:
        self._pending_deletes.pop(key, None)
        if not self._closed and key in self._known:
            self._emit_delete(key, revision)
