"""KV events and load metrics from an engine's own publisher, turned into what our KV router reads.

vLLM (and SGLang, whose publisher follows vLLM's format) announce each prefix-cache block they store or
evict on a ZMQ PUB socket: frames ``(topic, seq: 8-byte big-endian, payload)``, the payload a msgpack
``EventBatch`` ``[ts, [event, ...], data_parallel_rank]``.  An event is a tagged map
``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h, "token_ids": [...],
"block_size": n, ...}`` (vLLM >= 0.11) or, in older vLLM and SGLang, a tagged array
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``;
likewise ``BlockRemoved`` (``block_hashes``, ``medium``) and ``AllBlocksCleared``.

The engine's block hashes are its own (vLLM's default is a SHA-256 of the parent's hash and the tokens,
seeded per process), so the router could never match them against a prompt it hashes itself.
:class:`KvEventTranslator` therefore **recomputes our hashes from the token ids in each stored event**
(hashing.py: local hash per block, chained sequence hash from the parent's) and keeps a map from the
engine's hash to ours, which resolves parents of later stores and the hashes in removals.  It names
each block by our sequence hash in the events it emits, as the mocker does.

A store under a LoRA adapter (vLLM's ``lora_name``, which vLLM also lists first in each block's
``extra_keys``) is hashed with the adapter's seed (hashing.py: Dynamo's ``lora_name`` salt), as the
router hashes that adapter's prompts: the router matches those blocks for that adapter's requests only.

What is skipped, and why (each logged once):

* a store whose ``block_size`` is not the router's: its blocks would be hashed over other boundaries;
* a store under a parent it never saw stored (events were lost, or it started late): its chained hash is
  unknown; its descendants are skipped with it, so the router never holds a block without its prefix;
* blocks with ``extra_keys`` besides a LoRA adapter's name (multimodal inputs, cache salts), or of an
  adapter named by its number only (``lora_id`` without ``lora_name``, older vLLM): the engine only
  shares them with requests that match those too, which the router's hash cannot tell;
* events for another medium than the GPU (``CPU``/``STORAGE`` offload tiers) or another KV cache group
  than the first (hybrid models): the router models one cache per worker.

A removal of a hash it does not know (one of the skipped blocks) is ignored quietly.  The engine may hold
two copies of one block (two requests computed it at once); each copy is stored and evicted on its own,
so the map counts them and the router hears ``removed`` only when the last copy goes.

:class:`ZmqKvEventSubscriber` is the wiring: it binds a SUB socket on loopback (the engine connects to
it), decodes, translates, wraps (``worker_id``, ``event_id``) and hands each event to the publisher
callback.  :class:`SchedulerStatsMetrics` turns vLLM's per-step ``SchedulerStats`` into the
ForwardPassMetrics the mocker publishes.  Nothing here imports vLLM; pyzmq is imported when a
subscriber starts (it comes with vLLM and SGLang).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

import msgspec

from dynamo.kv.events import CLEARED_DATA, removed_data, stored_data
from dynamo.kv.hashing import compute_block_hashes, compute_seq_hashes
from dynamo.kv.publisher import Publisher, emit
from dynamo.kv.worker_state import WorkerKvState

log = logging.getLogger(__name__)

GPU_MEDIUMS = (None, "GPU")

# positional fields of the tagged-array form (older vLLM, SGLang), after the tag
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


class BatchError(ValueError):
    """A payload that is not an event batch."""


def decode_event_batch(payload: bytes) -> tuple[list[dict[str, Any]], int | None]:
    """A msgpack ``EventBatch`` -> (events as dicts with a ``type`` key, data-parallel rank)."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise BatchError(f"not msgpack: {e}") from None
    if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], (list, tuple)):
        raise BatchError(f"not an event batch: {type(batch).__name__}")
    dp_rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else None
    return [normalize_event(e) for e in batch[1]], dp_rank


def normalize_event(event: Any) -> dict[str, Any]:
    """One event in either form (tagged map or tagged array) -> a dict with ``type``."""
    if isinstance(event, dict):
        if not isinstance(event.get("type"), str):
            raise BatchError(f"an event without a type: {event!r}")
        return event
    if isinstance(event, (list, tuple)) and event and isinstance(event[0], str):
        kind = event[0]
        names = _ARRAY_FIELDS.get(kind, ())
        out: dict[str, Any] = {"type": kind}
        out.update(zip(names, event[1:], strict=False))
        return out
    raise BatchError(f"not an event: {event!r}")


class KvEventTranslator:
    """An engine's BlockStored / BlockRemoved / AllBlocksCleared -> our event data (protocols.py)."""

    def __init__(self, block_size: int, engine: str = "vLLM"):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.block_size = block_size
        self.engine = engine
        # the engine's block hash -> [our sequence hash, our local hash, copies the engine holds]
        self._blocks: dict[Hashable, list[int]] = {}
        self.skipped = 0  # stored blocks not announced (see the module docstring)
        self._warned: set[str] = set()

    def __len__(self) -> int:
        return len(self._blocks)

    def our_hash(self, engine_hash: Hashable) -> int | None:
        entry = self._blocks.get(_key(engine_hash))
        return entry[0] if entry else None

    def translate(self, events: Iterable[Mapping[str, Any]]) -> list[Any]:
        """Our event data for a batch, in order (a store or removal that yields nothing is left out)."""
        out = []
        for event in events:
            data = self.translate_one(event)
            if data is not None:
                out.append(data)
        return out

    def translate_one(self, event: Mapping[str, Any]) -> Any:
        kind = event.get("type")
        if kind == "BlockStored":
            return self._stored(event)
        if kind == "BlockRemoved":
            if event.get("medium") not in GPU_MEDIUMS or event.get("group_idx") not in (None, 0):
                return None
            return self._removed(event.get("block_hashes") or ())
        if kind == "AllBlocksCleared":
            self._blocks.clear()
            return CLEARED_DATA
        self._warn_once(f"kind:{kind}", "%s KV event of unknown type %r ignored", self.engine, kind)
        return None

    def _stored(self, event: Mapping[str, Any]) -> Any:
        hashes = list(event.get("block_hashes") or ())
        tokens = event.get("token_ids") or []
        if not hashes:
            return None
        if event.get("medium") not in GPU_MEDIUMS or event.get("group_idx") not in (None, 0):
            return None
        bs = event.get("block_size")
        if bs != self.block_size:
            self.skipped += len(hashes)
            self._warn_once("block_size", "%s stores KV blocks of %s tokens but the router hashes blocks of %d: "
                            "its events are ignored (set --kv-cache-block-size to the engine's block size)",
                            self.engine, bs, self.block_size)
            return None
        if len(tokens) != bs * len(hashes):
            self.skipped += len(hashes)
            self._warn_once("partial", "%s KV event with %d tokens for %d blocks of %d ignored (partial blocks "
                            "are not routed on)", self.engine, len(tokens), len(hashes), bs)
            return None
        lora_name = event.get("lora_name") or None
        if (lora_name is None and event.get("lora_id") is not None) or _other_extra_keys(event, lora_name):
            # the engine shares these only with requests of the same media / salt (or of an adapter it
            # names by number only); the router's hash cannot tell them apart, so it is better not to
            # know them (children follow)
            self.skipped += len(hashes)
            return None
        parent_hash = event.get("parent_block_hash")
        parent_seq: int | None = None
        if parent_hash is not None:
            parent_seq = self.our_hash(parent_hash)
            if parent_seq is None:
                self.skipped += len(hashes)
                self._warn_once("parent", "%s stored KV blocks under a parent block it never reported (events "
                                "lost?); skipped until their prefix is stored again", self.engine)
                return None
        local = compute_block_hashes(tokens, bs, lora_name)  # an adapter's blocks: its salted hashes
        seq = compute_seq_hashes(local, parent_seq)
        blocks = self._blocks
        for h, lo, s in zip(hashes, local, seq, strict=False):
            k = _key(h)
            entry = blocks.get(k)
            if entry is not None and entry[0] == s:
                entry[2] += 1  # a second copy of a block the engine already holds
            else:
                blocks[k] = [s, lo, 1]
        return stored_data(parent_seq, zip(seq, local, strict=False))

    def _removed(self, hashes: Iterable[Any]) -> Any:
        gone = []
        blocks = self._blocks
        for h in hashes:
            k = _key(h)
            entry = blocks.get(k)
            if entry is None:
                continue  # never announced (skipped above)
            entry[2] -= 1
            if entry[2] <= 0:
                del blocks[k]
                gone.append(entry[0])
        return removed_data(gone) if gone else None

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)


def _other_extra_keys(event: Mapping[str, Any], lora_name: str | None) -> bool:
    """Whether a store's blocks carry hash keys besides its LoRA adapter's name (vLLM lists, per block, the
    adapter's name first, then media identifiers, the cache salt, prompt-embedding digests)."""
    for keys in event.get("extra_keys") or ():
        if not keys:
            continue
        if not isinstance(keys, (list, tuple)):
            return True  # a producer's flag (the TRT-LLM translation below): keys we cannot read
        rest = list(keys)
        if lora_name is not None and rest and rest[0] == lora_name:
            rest = rest[1:]
        if rest:
            return True
    return False


def _key(h: Any) -> Hashable:
    # msgpack gives bytes for vLLM's SHA-256 hashes and ints for the rest; lists would not be hashable
    return bytes(h) if isinstance(h, (bytearray, memoryview, list)) else h


class KvEventSink:
    """Wraps translated event data for one worker (``worker_id``, increasing ``event_id``) and emits it,
    keeping the blocks they describe for the recovery query (``state``, worker_state.py)."""

    def __init__(self, translator: KvEventTranslator, worker_id: int = 0, publish: Publisher | None = None):
        self.translator = translator
        self.state = WorkerKvState(worker_id, publish)
        self.batches = 0
        self.emitted = 0

    @property
    def worker_id(self) -> int:
        return self.state.worker_id

    @worker_id.setter
    def worker_id(self, value: int) -> None:
        self.state.worker_id = value

    @property
    def publish(self) -> Publisher | None:
        return self.state.publish

    @publish.setter
    def publish(self, value: Publisher | None) -> None:
        self.state.publish = value

    def handle_payload(self, payload: bytes) -> int:
        """Decode, translate and emit one batch; returns the number of events emitted."""
        try:
            events, _dp_rank = decode_event_batch(payload)
        except BatchError as e:
            log.warning("%s KV event batch skipped: %s", self.translator.engine, e)
            return 0
        return self.handle_events(events)

    def handle_events(self, events: Iterable[Mapping[str, Any]]) -> int:
        self.batches += 1
        n = 0
        for data in self.translator.translate(events):
            self.state.send(data)
            n += 1
        self.emitted += n
        return n


class ZmqKvEventSubscriber:
    """Binds a ZMQ SUB socket on loopback for the engine's publisher to connect to, and feeds a sink.

    Binding here (the engine connects) lets the kernel pick a free port: no race with other workers on
    the machine.  A gap in the batch sequence numbers (the engine dropped events at its high-water mark)
    is logged: the router may then miss blocks until they are stored again.
    """

    def __init__(self, sink: KvEventSink, host: str = "127.0.0.1", topic: str = ""):
        self.sink = sink
        self.host = host
        self.topic = topic
        self.endpoint: str | None = None
        self._ctx: Any = None
        self._sock: Any = None
        self._task: asyncio.Task[None] | None = None
        self._last_seq: int | None = None

    def bind(self) -> str:
        """Bind the socket (no event loop needed); returns the endpoint the engine must connect to."""
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._sock.setsockopt(zmq.RCVHWM, 0)
        port = self._sock.bind_to_random_port(f"tcp://{self.host}")
        self.endpoint = f"tcp://{self.host}:{port}"
        return self.endpoint

    @property
    def started(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        if self._sock is None:
            self.bind()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events-sub")

    async def _run(self) -> None:
        sock = self._sock
        while True:
            try:
                frames = await sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the context was closed under us
                log.debug("KV event subscriber stopped: %s", e)
                return
            if len(frames) != 3:
                continue
            _topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if self._last_seq is not None and seq != self._last_seq + 1 and seq >= 0:
                log.warning("%s KV events %d..%d were lost; the router may miss those blocks",
                            self.sink.translator.engine, self._last_seq + 1, seq - 1)
            self._last_seq = seq
            try:
                self.sink.handle_payload(payload)
            except Exception:  # never let one bad batch stop the stream
                log.exception("KV event batch failed")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


# -- load metrics ---------------------------------------------------------------------------------------

HIT_RATE_WINDOW = 64  # scheduler records with prefix-cache queries that the hit rate averages over
METRICS_INTERVAL_S = 0.01


class SchedulerStatsMetrics:
    """vLLM's per-step ``SchedulerStats`` -> ForwardPassMetrics (the mocker's shape), published on change.

    ``record`` may be called from any thread; the publishing happens on ``loop``.  Like the mocker, a
    change is published at most every 10 ms, and a change inside that window when the window ends.  The
    prefix-cache hit rate is a change of its own: a short request can start and finish between two of
    vLLM's stat records, so the load alone may not move while the hit rate does.
    """

    def __init__(self, *, total_blocks: int, max_num_seqs: int, worker_id: int = 0,
                 publish: Publisher | None = None, loop: asyncio.AbstractEventLoop | None = None,
                 dp_rank: int = 0, clock: Callable[[], float] = time.monotonic):
        self.total_blocks = int(total_blocks)
        self.max_num_seqs = int(max_num_seqs)
        self.worker_id = worker_id
        self.publish = publish
        self.loop = loop
        self.dp_rank = dp_rank
        self.clock = clock
        self.running = 0
        self.waiting = 0
        self.usage = 0.0
        self._hits: deque[tuple[int, int]] = deque(maxlen=HIT_RATE_WINDOW)
        self._last_key: tuple[int, int, int, float] | None = None
        self._last_at = float("-inf")
        self._timer: asyncio.TimerHandle | None = None

    # vLLM's stat-logger interface (a per-engine logger factory: ``factory(vllm_config, engine_index)``)
    def factory(self, vllm_config: Any = None, engine_index: int = 0) -> "SchedulerStatsMetrics":
        return self

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_admission_rejection(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, scheduler_stats: Any, iteration_stats: Any = None, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is None:
            return
        self.update(running=getattr(scheduler_stats, "num_running_reqs", 0),
                    waiting=getattr(scheduler_stats, "num_waiting_reqs", 0)
                    + getattr(scheduler_stats, "num_skipped_waiting_reqs", 0),
                    usage=getattr(scheduler_stats, "kv_cache_usage", 0.0),
                    prefix=getattr(scheduler_stats, "prefix_cache_stats", None))

    def update(self, *, running: int, waiting: int, usage: float, prefix: Any = None) -> None:
        self.running, self.waiting, self.usage = int(running), int(waiting), float(usage)
        if prefix is not None:
            if getattr(prefix, "reset", False):
                self._hits.clear()
            queries = int(getattr(prefix, "queries", 0) or 0)
            if queries > 0:
                self._hits.append((int(getattr(prefix, "hits", 0) or 0), queries))
        loop = self.loop
        if loop is None:
            self._maybe_publish()
            return
        try:
            running_loop = asyncio.get_running_loop()
        except RuntimeError:
            running_loop = None
        if running_loop is loop:
            self._maybe_publish()
        else:
            loop.call_soon_threadsafe(self._maybe_publish)

    @property
    def active_blocks(self) -> int:
        return round(self.usage * self.total_blocks)

    def hit_rate(self) -> float:
        """Prefix-cache hits over queried tokens, over the last HIT_RATE_WINDOW records that queried."""
        queries = sum(q for _, q in self._hits)
        return sum(h for h, _ in self._hits) / queries if queries else 0.0

    def _key(self) -> tuple[int, int, int, float]:
        return (self.active_blocks, self.waiting, self.running, round(self.hit_rate(), 3))

    def metrics(self) -> dict[str, Any]:
        return {
            "worker_stats": {"data_parallel_rank": self.dp_rank, "request_active_slots": self.running,
                             "request_total_slots": self.max_num_seqs, "num_requests_waiting": self.waiting},
            "kv_stats": {"kv_active_blocks": self.active_blocks, "kv_total_blocks": self.total_blocks,
                         "gpu_cache_usage_perc": self.usage,
                         "gpu_prefix_cache_hit_rate": self.hit_rate()},
            "spec_decode_stats": None,
        }

    def _maybe_publish(self) -> None:
        key = self._key()
        if key == self._last_key or self.publish is None:
            return
        now = self.clock()
        wait = self._last_at + METRICS_INTERVAL_S - now
        if wait > 0:
            if self._timer is None and self.loop is not None:
                self._timer = self.loop.call_later(wait, self._flush)
            return
        self._send(now, key)

    def _flush(self) -> None:
        self._timer = None
        key = self._key()
        if key != self._last_key:
            self._send(self.clock(), key)

    def _send(self, now: float, key: tuple[int, int, int, float]) -> None:
        self._last_key, self._last_at = key, now
        emit(self.publish, {"worker_id": self.worker_id, "data": self.metrics()}, "load metrics")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def trtllm_events_to_common(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """TensorRT-LLM's ``get_kv_cache_events`` dicts -> the vLLM-style events :class:`KvEventTranslator` reads.

    TensorRT-LLM (``KvCacheConfig(event_buffer_max_size=N, enable_block_reuse=True)``) reports
    ``{"event_id", "data": {"type": "stored", "parent_hash", "blocks": [{"block_hash", "tokens":
    [{"token_id", ...}], "lora_id", "cache_level"}]}, "window_size"}``, ``{"type": "removed",
    "block_hashes"}``, and ``created``/``updated`` events (capacity and priority changes, which the router
    does not need).  Each stored block carries its own tokens; ``cache_level`` 0 is the GPU (primary) pool.
    Not run here (TensorRT-LLM needs CUDA): built and unit-tested from the documented shapes.
    """
    out: list[dict[str, Any]] = []
    for ev in events:
        data = ev.get("data") or {}
        kind = data.get("type")
        if kind == "stored":
            blocks = data.get("blocks") or []
            if not blocks:
                continue
            sizes = {len(b.get("tokens") or ()) for b in blocks}
            tokens = [int(t["token_id"]) if isinstance(t, Mapping) else int(t)
                      for b in blocks for t in (b.get("tokens") or ())]
            primary = all(int(b.get("cache_level", 0) or 0) == 0 for b in blocks)
            # a token_extra_id (multimodal content) makes the block match only requests with that content
            extra = any(isinstance(t, Mapping) and t.get("token_extra_id") for b in blocks for t in (b.get("tokens") or ()))
            lora = next((b.get("lora_id") for b in blocks if b.get("lora_id") is not None), None)
            out.append({"type": "BlockStored", "block_hashes": [b["block_hash"] for b in blocks],
                        "parent_block_hash": data.get("parent_hash"), "token_ids": tokens,
                        "block_size": sizes.pop() if len(sizes) == 1 else -1, "lora_id": lora,
                        "medium": "GPU" if primary else "CPU", "extra_keys": [True] if extra else None})
        elif kind == "removed":
            out.append({"type": "BlockRemoved", "block_hashes": list(data.get("block_hashes") or ()),
                        "medium": None})
        elif kind in ("cleared", "all_blocks_cleared"):
            out.append({"type": "AllBlocksCleared"})
    return out
