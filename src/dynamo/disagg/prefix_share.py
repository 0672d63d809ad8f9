"""Aggregated workers lending each other cached prompt prefixes: the KV of a prefix another worker holds is
fetched from it instead of computed again.

Why: a KV-aware router sends a prompt to the worker that holds its prefix, unless that worker is busy;
then the prompt goes to an idle worker, which computes the prefix a second time (SmolLM2-135M on one
core of this machine: about 4 ms per prompt token, 1.2 s for a 300-token system prompt and question).
A router that sees only request text (sglang-router, vllm-router) can only choose between those two: wait
behind the busy holder, or recompute.  An engine that exports a sequence's KV state (llama.cpp) offers a
third: the idle worker asks the holder for the state of its cache that shares the longest prefix with the
prompt, loads it (milliseconds: 23 KB per token here), and computes only the rest.

Who decides: the router (kv/router.py) counts a prefix another worker holds as cached on a worker that
can fetch it, at a weight below a resident one, and names the holder's share address in the request's
``prefix_source``; the chosen worker fetches before it admits the request, within
``DYN_KV_PREFIX_FETCH_TIMEOUT`` seconds (default 2), and computes the prompt itself on any failure (the
holder evicted it meanwhile, went away, timed out): a fetch never fails a request.  A lending engine
keeps each finished request's state in host memory and answers from there at once; what only its cache
holds it exports between two of its engine steps, so such a fetch waits up to one step there (a long
prefill's, about a second here: the router prices that wait, and credits a fetch only from a holder with a
prefill ahead, since one that is only decoding delays a prompt sent to it less than a fetch costs).

Wire format, on transfer.py's framing (big-endian)::

    request   b"DKVQ" | u32 n | n x u32 token ids (the prompt)
    response  u32 tokens the state covers | u32 of them the same as the request's | transfer.py's response
              (status 1: nothing shared)

The state covers the holder's whole cache of that sequence; the fetching engine keeps the shared tokens
and drops the rest.  Both ends prove a key first, as for every other plane: the fleet secret's, or on one
machine the key kept in the file store (:func:`choose_sharing` says when a worker lends at all).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import struct
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from dynamo.errors import UserError
from dynamo.llm.engine import Context, HasRuntimeConfig, close_engine
from dynamo.llm.model_entry import KV_PREFIX_SHARE
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest
from dynamo.runtime.fleet_auth import FleetAuth

from .transfer import (
    DEFAULT_MAX_BYTES,
    NOT_HELD,
    StateServer,
    TransferError,
    dial,
    read_state,
    write_state,
)

log = logging.getLogger(__name__)

QUERY_MAGIC = b"DKVQ"
DEFAULT_FETCH_TIMEOUT_S = 2.0
MAX_QUERY_TOKENS = 1 << 20  # a query longer than this is not a prompt: the connection is dropped
_QUERY_HEAD = struct.Struct(">4sI")
_COVER = struct.Struct(">II")


@dataclass(frozen=True)
class PrefixState:
    """A sequence's KV state from another worker: it covers ``n_state`` tokens, of which the first
    ``n_shared`` are the requesting prompt's."""

    n_state: int
    n_shared: int
    data: bytearray  # (writable: the engine loads it in place)


Export = Callable[[list[int]], Awaitable[tuple[int, int, Any] | None]]  # (.., .., a bytes-like state)


SHARING_ENV = "DYN_KV_PREFIX_SHARING"
_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")
TURN_ON = (f"set DYN_FLEET_SECRET (the same on every process of the fleet) to turn it on; {SHARING_ENV}=1 turns "
           "it on without authentication")


@dataclass(frozen=True)
class SharingChoice:
    """Whether a worker that can lend its cached prefixes does, how its share server authenticates
    (``"fleet"``: the fleet secret; ``"machine"``: the key of this user's private store; ``"none"``), and
    the start-up line that says so (``warn``: a warning)."""

    on: bool
    auth: str
    line: str
    warn: bool = False


def choose_sharing(setting: str | None, *, fleet_secret: bool, loopback: bool, private_store: bool) -> SharingChoice:
    """``DYN_KV_PREFIX_SHARING`` (``setting``): unset, on exactly where a stranger cannot read the KV of
    prompts cached here through the share server.

    That is with a fleet secret (the server proves it before reading a query), or on one machine where the
    worker listens on loopback only (no other machine reaches it) and the file store is this user's alone:
    the server then proves a key kept in that store, which other local users, who do reach loopback
    ports, cannot read. Otherwise off, in one line saying why and how to turn it on. ``0`` is off; ``1`` is
    on, and where neither protection holds it is on without authentication, in one warning line (as every
    other plane opened beyond loopback without the secret is: docs/security.md). Anything else is refused.
    Why on by default at all: in the peers benchmark fetching lowered the kv router's TTFT where a prompt's
    holder was busy (docs/routing.md), and a user who never reads about the setting should get that.
    """
    raw = (setting or "").strip().lower()
    if raw and raw not in _ON + _OFF:
        raise UserError(f"{SHARING_ENV}={setting!r}: use 1 (on) or 0 (off); unset, it is on where it is safe")
    if raw in _OFF:
        return SharingChoice(False, "none", f"KV prefix sharing off ({SHARING_ENV}={setting})")
    if fleet_secret:
        return SharingChoice(True, "fleet", "authenticated by the fleet secret")
    if loopback and private_store:
        return SharingChoice(True, "machine", "one machine: loopback only, authenticated by a key in this user's "
                                              "private file store")
    why = ("the worker listens beyond loopback" if not loopback else
           "no file store of this user's alone to keep a key in (etcd, or a DYN_FILE_KV directory another user "
           "owns or may read)")
    if raw in _ON:
        return SharingChoice(True, "none", f"WITHOUT authentication ({SHARING_ENV}={setting}, {why}, no fleet "
                                           "secret): anyone who reaches its port can read the KV of prompts cached "
                                           "here; set DYN_FLEET_SECRET (the same on every process) to close it",
                             warn=True)
    return SharingChoice(False, "none", f"KV prefix sharing off: {why} and there is no fleet secret, so anyone who "
                                        f"reaches its port could read the KV of prompts cached here; {TURN_ON}")


def fetch_timeout() -> float:
    """``DYN_KV_PREFIX_FETCH_TIMEOUT`` (seconds, default 2): the longest a worker waits for a prefix."""
    raw = os.environ.get("DYN_KV_PREFIX_FETCH_TIMEOUT", "").strip()
    try:
        return max(0.01, float(raw)) if raw else DEFAULT_FETCH_TIMEOUT_S
    except ValueError:
        log.warning("DYN_KV_PREFIX_FETCH_TIMEOUT=%r is not a number of seconds; keeping %g", raw,
                    DEFAULT_FETCH_TIMEOUT_S)
        return DEFAULT_FETCH_TIMEOUT_S


class PrefixShareServer(StateServer):
    """Answers prefix queries from ``export`` (the engine's), one query per connection."""

    what = "KV prefix sharing"

    def __init__(self, export: Export, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None,
                 auth: FleetAuth | None = None, chunk: int = 1 << 20) -> None:
        super().__init__(host, port, advertise, chunk, auth)
        self.export = export
        self.missed = 0

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        magic, n = _QUERY_HEAD.unpack(await asyncio.wait_for(reader.readexactly(_QUERY_HEAD.size), 10.0))
        if magic != QUERY_MAGIC or n > MAX_QUERY_TOKENS:
            return
        raw = await asyncio.wait_for(reader.readexactly(4 * n), 10.0)
        tokens = list(struct.unpack(f">{n}I", raw))
        try:
            found = await self.export(tokens)
        except Exception:  # noqa: BLE001 - the engine failed to export: the fetcher computes the prompt
            log.exception("KV prefix export failed")
            return
        if found is None:
            self.missed += 1
            writer.write(_COVER.pack(0, 0) + NOT_HELD)
            await writer.drain()
            return
        n_state, n_shared, data = found
        writer.write(_COVER.pack(n_state, n_shared))
        await write_state(writer, data, None, self.chunk)  # (crc32 per chunk; no sha256 to compute)
        self.served += 1


async def fetch_prefix(address: str, tokens: list[int], *, timeout: float = 2.0, max_bytes: int = DEFAULT_MAX_BYTES,
                       auth: FleetAuth | None = None) -> PrefixState:
    """The state of ``address``'s cache sharing the longest prefix with ``tokens``; TransferError when it
    holds none, or the fetch fails or takes longer than ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await dial(address, auth, "KV prefix")
            try:
                writer.write(_QUERY_HEAD.pack(QUERY_MAGIC, len(tokens)) + struct.pack(f">{len(tokens)}I", *tokens))
                await writer.drain()
                try:
                    n_state, n_shared = _COVER.unpack(await reader.readexactly(_COVER.size))
                except asyncio.IncompleteReadError:
                    raise TransferError(f"KV prefix from {address}: the stream ended early") from None
                data = await read_state(reader, max_bytes)
            finally:
                writer.close()
    except TimeoutError:
        raise TransferError(f"KV prefix from {address} timed out after {timeout:g} s") from None
    except (OSError, ValueError, struct.error) as e:
        raise TransferError(f"KV prefix from {address} failed: {e}") from None
    if not 0 < n_shared <= min(n_state, len(tokens)):
        raise TransferError(f"KV prefix from {address}: it claims {n_shared} shared tokens of {n_state}")
    return PrefixState(n_state, n_shared, data)


class PrefixSharingEngine:
    """A core engine that lends its cached prefixes (a :class:`PrefixShareServer`) and borrows others'
    when the router names a ``prefix_source``.  Everything else is the wrapped engine's."""

    kind = "core"

    def __init__(self, engine: Any, *, host: str = "127.0.0.1", advertise: str | None = None,
                 auth: FleetAuth | None = None, timeout: float | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, why: str = "", warn: bool = False) -> None:
        self.engine = engine
        self.why, self.warn = why, warn  # for the start-up line: how the share server is protected
        self.auth = auth
        self.timeout = fetch_timeout() if timeout is None else timeout
        self.max_bytes = max_bytes
        self.server = PrefixShareServer(engine.export_prefix, host=host, advertise=advertise, auth=auth)
        self.fetched = 0  # prefixes loaded from another worker
        self.failed = 0  # fetches that failed (the prompt was computed here)

    def __getattr__(self, name: str) -> Any:  # attach, load_metrics, capacity, ...
        return getattr(self.engine, name)

    @property
    def runtime_config(self) -> dict[str, Any]:
        own = self.engine.runtime_config if isinstance(self.engine, HasRuntimeConfig) else {}
        return {**(own or {}), KV_PREFIX_SHARE: self.server.address}

    async def start(self) -> None:
        self.engine.keep_states_to_lend()
        await self.server.start()
        log.log(logging.WARNING if self.warn else logging.INFO, "lending cached KV prefixes at %s%s",
                self.server.address, f" ({self.why})" if self.why else "")

    async def close(self) -> None:
        await self.server.close()
        await close_engine(self.engine)

    def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        # no source named (most requests): the engine's own stream, without a layer per token.  A prompt
        # with images is expanded by the engine, so its token ids are not the cache's: not fetched
        if not request.prefix_source or request.multi_modal_data:
            return self.engine.generate(request, context)
        return self._borrowing(request, context)

    async def _borrowing(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        # the request goes in line at once and the engine admits it when the state is there (or the fetch
        # failed): fetched first and queued after, a request that came meanwhile took the engine's next
        # step and this one waited for that whole prefill
        arrived: concurrent.futures.Future[PrefixState | None] = concurrent.futures.Future()
        fetching = asyncio.create_task(self._fetch(request, context))
        fetching.add_done_callback(lambda t: arrived.set_result(
            None if t.cancelled() or t.exception() is not None else t.result()))
        gen = self.engine.generate(request, context, prefix_state=arrived)
        try:
            async for out in gen:
                yield out
        finally:
            fetching.cancel()
            await gen.aclose()

    async def _fetch(self, request: PreprocessedRequest, context: Context) -> PrefixState | None:
        src = request.prefix_source or {}
        try:
            address, n = str(src["address"]), int(src["tokens"])
        except (KeyError, TypeError, ValueError):
            log.warning("request %s: malformed prefix_source %r; computing the prompt", context.id, src)
            return None
        if address == self.server.address:
            return None
        # the whole prompt: the holder lends what it shares of it, often a few tokens past the complete
        # blocks the router counted (its cache ends where the last turn's answer did), each one a token
        # less to compute here.  ``n`` (those blocks) is what the router promised, not a limit
        tokens = list(request.token_ids)
        t0 = time.perf_counter()
        try:
            state = await fetch_prefix(address, tokens, timeout=self.timeout, max_bytes=self.max_bytes, auth=self.auth)
        except TransferError as e:
            self.failed += 1
            log.info("request %s: no KV prefix from %s (%s); computing the prompt", context.id, address, e)
            return None
        self.fetched += 1
        log.debug("request %s: KV prefix of %d tokens (the router counted %d; state of %d, %d bytes) from %s in "
                  "%.1f ms", context.id, state.n_shared, n, state.n_state, len(state.data), address,
                  1e3 * (time.perf_counter() - t0))
        return state
