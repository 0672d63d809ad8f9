"""Which frontends to read, and which of their models are the namespace's: both from discovery.

**Frontends.**  Every HTTP frontend registers ``frontends/<id>`` with its URL under its lease
(:mod:`dynamo.frontend.registration`).  :class:`FrontendDirectory` watches that prefix: a frontend that
starts is read from the next interval; one that stops cleanly deletes its key; one killed with SIGKILL
stays listed until its lease expires (``DYN_LEASE_TTL``, 10 s), and meanwhile the scraper leaves it out
as unreachable; one that comes back registers again under a new lease and its first scrape is a new
baseline.  ``--frontend-url`` replaces discovery: only those URLs are read (a registered frontend named
under another address, ``localhost`` for ``10.0.0.5``, would otherwise count twice).

**Models.**  Our frontends serve every namespace's models, so a frontend's metrics may carry other
fleets' load.  :func:`namespace_models` lists the model names registered in the planner's namespace
(``v1/mdc/<namespace>/...``), and only their series count (``--model`` narrows it to one).
:class:`NamespaceModels` keeps every name once seen (requests still come for a model whose workers are
all gone), and, while discovery does not answer (etcd down or restarting), goes on with those: the
frontends and their ``/metrics`` do not need etcd, so the planner keeps observing and deciding through an
outage instead of failing every interval.  Only a planner that never listed the models cannot tell its
load from other fleets': its intervals are skipped (:class:`~.observe.ObservationUnavailable`) until discovery answers,
rather than read as "no load" (which would drain the fleet).
"""

from __future__ import annotations

import asyncio
import logging

from dynamo.aio import cancel_and_wait
from dynamo.frontend.registration import FRONTENDS_PREFIX, FrontendEntry
from dynamo.llm.v1_card import entry_from_record
from dynamo.planner.observe import ObservationUnavailable
from dynamo.runtime.discovery import DiscoveryWatch
from dynamo.runtime.errors import DynamoRuntimeError
from dynamo.runtime.kv_store import KeyValueStore
from dynamo.runtime.v1_records import models_prefix

log = logging.getLogger(__name__)


class FrontendDirectory:
    """The ``--frontend-url`` frontends if any were named, else those registered in discovery (kept current
    by a watch)."""

    def __init__(self, store: KeyValueStore | None, static_urls: list[str]) -> None:
        self.store = store
        self.static = [u.rstrip("/") for u in static_urls]
        self.registered: dict[str, str] = {}  # key -> URL
        self._watch: DiscoveryWatch | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.store is None or self.static:
            return
        self._watch = await self.store.watch_prefix(FRONTENDS_PREFIX).start()
        for kv in self._watch.initial:
            self._put(kv.key, kv.value, initial=True)
        self._task = asyncio.create_task(self._run(), name="planner-frontends")

    async def _run(self) -> None:
        assert self._watch is not None
        async for ev in self._watch:
            if ev.kind == "put":
                self._put(ev.key, ev.value, initial=ev.initial)
            else:
                url = self.registered.pop(ev.key, None)
                if url is not None:
                    log.info("frontend %s left discovery", url)

    def _put(self, key: str, value: bytes, initial: bool = False) -> None:
        if key in self.registered and initial:
            return  # the listing, seen again as the watch's first events
        try:
            entry = FrontendEntry.from_json(value)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("ignoring a malformed frontend entry %s: %s", key, e)
            return
        url = entry.url.rstrip("/")
        if self.registered.get(key) != url:
            log.info("frontend %s found in discovery", url)
        self.registered[key] = url

    def urls(self) -> list[str]:
        return sorted({*self.static, *self.registered.values()})

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._watch is not None:
            await self._watch.close()
            self._watch = None


async def namespace_models(store: KeyValueStore, namespace: str) -> set[str]:
    """The names (lowercased, as the frontend labels its series) of the models registered in ``namespace``."""
    names: set[str] = set()
    for kv in await store.get_prefix(models_prefix(namespace)):
        try:
            names.add(entry_from_record(kv.value).name.lower())
        except Exception:  # noqa: BLE001 - a malformed entry is the frontend's to report
            continue
    return names


class NamespaceModels:
    """The model names whose series count: ``--model``, else every name ever registered in the namespace
    (see the module docstring for why an unreachable store is not an error here)."""

    def __init__(self, store: KeyValueStore, namespace: str, only: str | None = None) -> None:
        self.store = store
        self.namespace = namespace
        self.only = only.lower() if only else None
        self.seen: set[str] = set()
        self.unreachable_since: float | None = None

    async def __call__(self) -> set[str]:
        if self.only:
            return {self.only}
        loop = asyncio.get_running_loop()
        try:
            names = await namespace_models(self.store, self.namespace)
        except DynamoRuntimeError as e:
            if self.unreachable_since is None:
                self.unreachable_since = loop.time()
                log.warning("cannot list the models of namespace %s (%s); %s until discovery answers",
                            self.namespace, e, f"counting the {len(self.seen)} already seen" if self.seen
                            else "no interval is decided")
            if not self.seen:
                raise ObservationUnavailable(f"the models of namespace {self.namespace} are not known yet: {e}") from None
            return self.seen
        if self.unreachable_since is not None:
            log.info("the models of namespace %s listed again after %.1f s", self.namespace,
                     loop.time() - self.unreachable_since)
            self.unreachable_since = None
        self.seen.update(names)
        return self.seen
