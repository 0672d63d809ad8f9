"""Discovery shared with Dynamo 1.x processes: writing our endpoints' ``v1/`` records, and following our
records and 1.x's as one list.

Writing: an endpoint of ours served on the TCP request plane also gets a ``v1/instances`` record under
the process's lease (:func:`publish_endpoint`), so a 1.x frontend finds it (the event plane writes its own
``v1/event_channels`` records: :mod:`.event_channels`). It goes through the runtime's
:class:`~.kv_store.KeyValueStore` with ``lease=True``: on etcd a plain key under our lease, on the file
store 1.x's file (:mod:`.file_v1`), and either way it is re-published if the store loses it and goes
when the lease goes.

Reading: :class:`MergedWatch` follows two prefixes as one watch: our records (primary) and 1.x's
(secondary, translated into our key space and shape). A worker of ours writes both, so one instance id
would otherwise appear twice: the view is ours, plus a translated 1.x record only where we have no record
under the same key and never had one: a 1.x record that was once the twin of ours stays hidden when ours
goes (our record goes with the worker's lease, or first at its shutdown; the twin on the file store lives
on until it is 10 s stale, and the worker is gone meanwhile). Two watches deliver in no common order (on etcd they are two streams), and a worker
of ours writes its own record first, so a live 1.x-only record waits ``hold`` seconds before it shows:
if our record arrives meanwhile, the 1.x one is never seen. Records present when the watch starts are
compared at once (both listings are taken before the first event).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable

from dynamo.aio import cancel_and_wait

from .discovery import Discovery, DiscoveryWatch, KeyValue, ListedWatch
from .names import EndpointId, is_v1_tcp_address
from .v1_records import (
    endpoint_key,
    endpoint_record,
    instances_prefix,
    translate_instance,
)

log = logging.getLogger(__name__)

TCP_SCHEME = "tcp://"  # our TCP request plane's addresses (tcp_request_plane.py)
HOLD = 0.5  # seconds a live 1.x-only record waits for ours (a worker of ours writes its own first)

# (key, value) of the secondary prefix -> (key, value) in the primary's space; ValueError: skip it
Translate = Callable[[str, bytes], tuple[str, bytes]]

_nats_warned: set[str] = set()


@dataclass(slots=True)
class _Secondary:
    key: str  # translated
    value: bytes
    lease: int
    ready_at: float  # loop time from which it shows (0: at once)
    shadowed: bool = False  # a record of ours had its key: the twin of one of our workers, never shown


class MergedWatch(ListedWatch):
    """A :class:`~.discovery.DiscoveryWatch` over ``primary`` and ``secondary`` (not started), the latter
    translated by ``translate``; for a key both have, ``primary``'s record wins."""

    def __init__(self, prefix: str, primary: DiscoveryWatch, secondary: DiscoveryWatch, translate: Translate,
                 *, hold: float = HOLD) -> None:
        super().__init__(prefix)
        self._primary_watch = primary
        self._secondary_watch = secondary
        self._translate = translate
        self._hold = hold
        self._primary: dict[str, KeyValue] = {}
        self._secondary: dict[str, _Secondary] = {}  # secondary key -> its translation
        self._bad: set[str] = set()  # secondary keys already warned about
        self._tasks: list[asyncio.Task[None]] = []
        self._timers: list[asyncio.TimerHandle] = []

    async def start(self) -> "MergedWatch":
        if self._started:
            return self
        self._started = True
        await self._primary_watch.start()
        await self._secondary_watch.start()
        for kv in self._primary_watch.initial:
            self._primary[kv.key] = kv
        for kv in self._secondary_watch.initial:
            self._put_secondary(kv.key, kv.value, kv.lease, at_once=True)
        self._emit_listing(sorted(self._view().values(), key=lambda kv: kv.key))
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._pump(self._primary_watch, True), name=f"merged-watch:{self.prefix}"),
                       loop.create_task(self._pump(self._secondary_watch, False), name=f"merged-watch-v1:{self.prefix}")]
        return self

    async def close(self) -> None:
        if self._closed:
            return
        for timer in self._timers:
            timer.cancel()
        for task in self._tasks:
            await cancel_and_wait(task)
        await self._primary_watch.close()
        await self._secondary_watch.close()
        self._end()

    def _put_secondary(self, key: str, value: bytes, lease: int, *, at_once: bool) -> None:
        try:
            tkey, tvalue = self._translate(key, value)
        except (ValueError, KeyError, TypeError) as exc:
            self._secondary.pop(key, None)
            if key not in self._bad:
                self._bad.add(key)
                log.warning("ignoring Dynamo 1.x record %s: %s", key, exc)
            return
        old = self._secondary.get(key)
        ready_at = 0.0
        if not at_once and tkey not in self._primary and (old is None or old.ready_at):
            loop = asyncio.get_running_loop()
            ready_at = loop.time() + self._hold
            self._timers = [t for t in self._timers if t.when() > loop.time()]  # those still to fire
            self._timers.append(loop.call_later(self._hold, self._refresh, 0))
        shadowed = old is not None and old.shadowed and old.key == tkey
        self._secondary[key] = _Secondary(tkey, tvalue, lease, ready_at, shadowed)

    def _view(self) -> dict[str, KeyValue]:
        view = dict(self._primary)
        now = asyncio.get_running_loop().time()
        for sec in self._secondary.values():
            if sec.key in self._primary:
                sec.shadowed = True
            elif not sec.shadowed and sec.ready_at <= now:
                view[sec.key] = KeyValue(sec.key, sec.value, lease=sec.lease)
        return view

    def _refresh(self, revision: int) -> None:
        if not self._closed:
            self._emit_difference(self._view(), revision)

    async def _pump(self, watch: DiscoveryWatch, primary: bool) -> None:
        try:
            async for ev in watch:
                if ev.initial:
                    continue
                if primary:
                    if ev.kind == "put":
                        self._primary[ev.key] = KeyValue(ev.key, ev.value, mod_revision=ev.revision, lease=ev.lease)
                    else:
                        self._primary.pop(ev.key, None)
                elif ev.kind == "put":
                    self._put_secondary(ev.key, ev.value, ev.lease, at_once=False)
                else:
                    self._secondary.pop(ev.key, None)
                    self._bad.discard(ev.key)
                self._refresh(ev.revision)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the caller's iterator raises it, as a plain watch would
            self._queue.put_nowait(exc)


def watch_instances(discovery: Discovery, endpoint: EndpointId, *, hold: float = HOLD) -> MergedWatch:
    """The instances of ``endpoint``: our ``instances/...:{id:x}`` records, and 1.x workers' ``v1/instances``
    records as Instance JSON whose subject is their 1.x TCP address (not started)."""
    prefix = endpoint.etcd_prefix + ":"
    return MergedWatch(prefix, discovery.watch_prefix(prefix), discovery.watch_prefix(instances_prefix(endpoint)),
                       translate_instance, hold=hold)


async def publish_endpoint(store: Any, endpoint: EndpointId, lease_id: int, address: str) -> str | None:
    """Write the ``v1/instances`` record of an endpoint of ours served at ``address`` (under the primary
    lease, through the runtime's KeyValueStore ``store``); its key, or None when 1.x cannot reach it:
    an endpoint on NATS (1.x speaks TCP to workers; said once per process and endpoint)."""
    if not (address.startswith(TCP_SCHEME) or is_v1_tcp_address(address)):
        if str(endpoint) not in _nats_warned:
            _nats_warned.add(str(endpoint))
            log.info("%s is served over NATS: Dynamo 1.x frontends cannot reach it (they send to workers over "
                     "TCP; DYN_REQUEST_PLANE=tcp makes it reachable), so no v1/instances record is written",
                     endpoint)
        return None
    hostport = address.removeprefix(TCP_SCHEME).split("/", 1)[0]  # tcp://host:port/<service>.<ep>
    key = endpoint_key(endpoint.namespace, endpoint.component, endpoint.name, lease_id)
    await store.put(key, endpoint_record(endpoint.namespace, endpoint.component, endpoint.name, lease_id, hostport),
                    lease=True)
    return key
