"""KV events from SGLang and TensorRT-LLM workers to the KV router (the engines' side of vllm_kv.py).

Both engines keep a prefix cache and can announce what it holds; a worker serving ``in=dyn://`` turns
that on and translates the announcements into our events (recomputing our block hashes from the token
ids they carry, as for vLLM):

* **SGLang** publishes vLLM's ZMQ/msgpack format (``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared`` as tagged arrays) when its ``kv_events_config`` (a JSON string) says
  ``{"publisher": "zmq", "endpoint": ...}``.  Its publisher *connects* to an endpoint without ``*``, so
  we bind a SUB socket on loopback and give SGLang that address.  Its blocks are its pages: ``page_size``
  must be the router's block size, so it is set to the card's when not given (SGLang's default is 1).
  With ``dp_size`` > 1 each rank publishes on its own port (the endpoint's port plus the rank), which we do
  not follow: such a worker says it publishes nothing and is routed with the approximate indexer.
* **TensorRT-LLM** queues events in the process when ``kv_cache_config.event_buffer_max_size`` > 0 and
  block reuse is on; ``LLM.get_kv_cache_events(timeout)`` hands them over as dicts, which a poller reads
  in a thread and maps with :func:`vllm_kv.trtllm_events_to_common`.

Neither engine runs here (both need CUDA): the translation is unit-tested with events written from
their documented shapes, and the wiring with stand-ins for the engines (docs/routing.md says which).
Neither reports scheduler load to us: ``load_metrics`` is empty and the router balances on its own
bookkeeping, as for every engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Mapping

from dynamo.kv.zmq_events import KvEventSink, KvEventTranslator, ZmqKvEventSubscriber, trtllm_events_to_common
from dynamo.run_config import RunConfig

log = logging.getLogger(__name__)

TRTLLM_EVENT_BUFFER = 1024  # event_buffer_max_size when the worker turns events on itself
TRTLLM_POLL_TIMEOUT_S = 0.5  # the longest a poll waits for events (and a close waits for the poll)


def serves_router(cfg: RunConfig) -> bool:
    """A worker behind a frontend (``in=dyn://``): the only place KV events have a reader."""
    return cfg.input.startswith("dyn://")


def sglang_kv_events_wanted(cfg: RunConfig, args: Mapping[str, Any], extra: Mapping[str, Any] | None) -> str | None:
    """None if an ``out=sglang`` worker should publish KV events, else why not (logged by the caller)."""
    if not serves_router(cfg):
        return "not a dyn:// worker"
    if int(args.get("node_rank", 0) or 0) > 0:
        return "a follower node (the leader publishes)"
    if args.get("disable_radix_cache"):
        return "its prefix cache is off (disable_radix_cache)"
    if "kv_events_config" in (extra or {}):
        return "--extra-engine-args sets kv_events_config (SGLang publishes where it says)"
    if int(args.get("dp_size", 1) or 1) > 1:
        return "dp_size > 1 (each rank publishes on its own port; not followed yet)"
    return None


def trtllm_kv_events_wanted(cfg: RunConfig, args: Mapping[str, Any]) -> str | None:
    """None if an ``out=trtllm`` worker should publish KV events, else why not."""
    if not serves_router(cfg):
        return "not a dyn:// worker"
    kv = args.get("kv_cache_config") or {}
    if not isinstance(kv, Mapping):
        return "kv_cache_config is not a mapping"
    if kv.get("enable_block_reuse") is False:
        return "block reuse is off (kv_cache_config.enable_block_reuse)"
    if "event_buffer_max_size" in kv and not kv["event_buffer_max_size"]:
        return "kv_cache_config.event_buffer_max_size is 0"
    return None


class EngineKvEvents:
    """What an engine module needs to publish KV events: the sink (translation, numbering, the
    dump for the recovery query) and the ``attach`` / ``publishes_kv_events`` / ``kv_state_dump`` surface."""

    def __init__(self, engine: str, block_size: int):
        self.sink = KvEventSink(KvEventTranslator(block_size, engine=engine))
        self.engine = engine
        self.running = False

    def set_block_size(self, block_size: int) -> None:
        self.sink.translator.block_size = int(block_size)

    def attach(self, worker_id: int, publish: Any) -> None:
        self.sink.worker_id = worker_id
        self.sink.publish = publish

    def dump(self) -> dict[str, Any]:
        return self.sink.state.dump()


class PublishesEngineKvEvents:
    """The router-facing surface (what inputs/endpoint.py calls) of an engine whose KV events come from
    an :class:`EngineKvEvents` in ``self._kv`` (None when the worker does not publish them).  Load
    metrics are not read from these engines: the router balances on its own bookkeeping."""

    _kv: Any = None

    def attach(self, worker_id: int, *, publish_kv_event: Any = None, publish_metrics: Any = None) -> None:
        if self._kv is not None:
            self._kv.attach(worker_id, publish_kv_event)

    @property
    def publishes_kv_events(self) -> bool:
        return self._kv is not None and self._kv.running

    def kv_state_dump(self) -> dict[str, Any]:
        if self._kv is None:
            return {"worker_id": 0, "last_event_id": None, "blocks": []}
        return self._kv.dump()

    def all_load_metrics(self) -> list[dict[str, Any]]:
        return []


class SglangKvEvents(EngineKvEvents):
    """SGLang's ZMQ publisher -> our events.  :meth:`configure` before the engine starts (it connects
    to our socket), :meth:`start` once it runs."""

    def __init__(self, block_size: int):
        super().__init__("SGLang", block_size)
        self.subscriber = ZmqKvEventSubscriber(self.sink)

    def configure(self, args: dict[str, Any], block_size: int) -> None:
        """Bind our socket and point SGLang's publisher at it (``kv_events_config``); pages of
        ``block_size`` tokens unless ``page_size`` is given."""
        endpoint = self.subscriber.bind()
        args["kv_events_config"] = json.dumps({"publisher": "zmq", "endpoint": endpoint, "topic": ""})
        if not args.get("page_size"):
            args["page_size"] = int(block_size)
            log.info("sglang: page_size %d (the router's block size) so that its KV events match the router's "
                     "blocks", block_size)
        self.set_block_size(int(args["page_size"]))

    def start(self) -> None:
        self.subscriber.start()
        self.running = True
        log.info("sglang: KV events from %s, block size %d, to the KV router", self.subscriber.endpoint,
                 self.sink.translator.block_size)

    async def close(self) -> None:
        self.running = False
        await self.subscriber.close()


class TrtllmKvEvents(EngineKvEvents):
    """TensorRT-LLM's ``get_kv_cache_events`` -> our events, polled in a thread."""

    def __init__(self, block_size: int):
        super().__init__("TensorRT-LLM", block_size)
        self._task: asyncio.Task[None] | None = None
        self.polls = 0

    @staticmethod
    def configure(args: dict[str, Any]) -> None:
        """Turn TensorRT-LLM's event queue on (``event_buffer_max_size``) unless it is set."""
        kv = dict(args.get("kv_cache_config") or {})
        kv.setdefault("event_buffer_max_size", TRTLLM_EVENT_BUFFER)
        kv.setdefault("enable_block_reuse", True)
        args["kv_cache_config"] = kv

    def start(self, llm: Any) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll(llm), name="trtllm-kv-events")
        self.running = True
        log.info("trtllm: KV events (get_kv_cache_events), block size %d, to the KV router",
                 self.sink.translator.block_size)

    async def _poll(self, llm: Any) -> None:
        while True:
            try:
                events = await asyncio.to_thread(llm.get_kv_cache_events, TRTLLM_POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the engine is shutting down, or a bad batch: say so, keep polling
                log.warning("trtllm: reading KV events failed: %s", e)
                await asyncio.sleep(TRTLLM_POLL_TIMEOUT_S)
                continue
            self.polls += 1
            if events:
                self.handle(events)

    def handle(self, events: list[Mapping[str, Any]]) -> int:
        """One batch of TensorRT-LLM's event dicts; returns the number of our events emitted."""
        return self.sink.handle_events(trtllm_events_to_common(events))

    async def close(self) -> None:
        self.running = False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
