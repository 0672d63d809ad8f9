"""The sequence slots of ``out=llamacpp`` and the KV caches they keep: which slot a request takes, how much
of its prompt it reuses, and copying, offloading and restoring those caches.

A slot keeps the KV cache of its last sequence; a new request goes to the free slot sharing the longest
prefix with its prompt, and only the tail after the shared prefix is computed again (multi-turn chats
and shared system prompts skip most of their prefill).  When a *busy* slot shares a clearly longer
prefix (a group of users on one system prompt, sent here together by a KV router), that slot's cache is
copied into the least recently used free slot (through the sequence's state, its used cells only, or
``llama_memory_seq_cp``, which copies its whole stream: see :meth:`SlotCaches.copy_cache`; either far
cheaper than recomputing a long prefix).  So every block any slot holds can be reused, which is what
the KV router assumes.

KV offloading: a slot cache about to be overwritten is saved to the host-memory tier (host_tier.py),
whose LRU spills to the disk tier (disk_tier.py); a later prompt with that prefix gets it loaded back
into a slot instead of computing it again.  Once a worker attaches, every complete block a slot holds is
named with the router's hashes (slot_blocks.py), and the tiers' blocks likewise, for the KV events.

LoRA adapters (lora.py): a slot's cache is tagged with the adapter it was computed under, and a prompt
reuses (or copies) only caches of its own adapter, so an adapter request never reuses the base model's
keys and values or another adapter's, and its ``cached_tokens`` count only its own.  The host and disk
tiers keep base-model caches only.

Every method here runs on the scheduler thread (scheduler.py), which owns the llama.cpp calls.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo.engines.llamacpp.disk_tier import DiskKvTier
from dynamo.engines.llamacpp.host_tier import HostKvTier, common_prefix
from dynamo.engines.llamacpp.lora import Adapter
from dynamo.engines.llamacpp.model import Llama
from dynamo.engines.llamacpp.vision import ImageSpan, cut_before_images
from dynamo.errors import EngineError
from dynamo.kv.events import DEVICE, DISK, HOST
from dynamo.kv.slot_blocks import SlotBlocks
from dynamo.llm.engine import Context
from dynamo.llm.first_token import Stamps

log = logging.getLogger(__name__)

# KV offloading: a slot cache is saved to the host tier when at least this many of its tokens would be lost
OFFLOAD_MIN_TOKENS = 32
# copy a busy slot's cache into a free slot when that saves at least this many prompt tokens of prefill
COPY_MIN_TOKENS = 16
# a free slot holding at least this many tokens past what a new prompt shares with it holds another
# conversation: the prompt takes an empty or older slot instead (its own follow-up turn loses only the
# tail that differs, the last answer's tokens at most, when the client sends back a different text)
SPARE_MIN_TOKENS = 64


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    eos: frozenset[int]
    sampling: Any
    ctx: Context
    out: asyncio.Queue[Any]
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False
    grammar: str | None = None  # GBNF from guided decoding (grammar.py)
    cached_tokens: int = 0  # prompt tokens reused from the cache (set on admission)
    state_io: Any = None  # disaggregation (disagg/worker.py StateIO): export or import the sequence state
    prefix_state: Any = None  # another worker's KV of this prompt's prefix (disagg/prefix_share.py PrefixState)
    # the prefix state still on its way (a concurrent future of one, or of None); admitted once it is
    # done or at ``prefix_deadline`` (time.monotonic()), whichever is first
    prefix_wait: Any = None
    prefix_deadline: float = 0.0
    logprobs: int | None = None  # report each token's logprob and this many alternatives (None: no logprobs)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens: the whole prompt is computed
    stamps: Stamps | None = None  # time-to-first-token stamps (first_token.py; -v only)
    adapter: Adapter | None = None  # the LoRA adapter it runs with (None: the base model)
    images: list[ImageSpan] = field(default_factory=list)  # its images' places in the prompt (vision.py)

    def image_at(self, pos: int) -> ImageSpan | None:
        """The image that starts at prompt position ``pos``, if one does."""
        return next((s for s in self.images if s.offset == pos), None)

    def next_image(self, pos: int) -> int:
        """Where the first image at or after ``pos`` starts (the prompt's length if none does)."""
        return min((s.offset for s in self.images if s.offset >= pos), default=len(self.prompt))

    @property
    def lora_uid(self) -> int:
        return self.adapter.uid if self.adapter is not None else 0


@dataclass
class Slot:
    seq_id: int
    cached: list[int] = field(default_factory=list)  # tokens whose KV is in this sequence
    req: Request | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens still to evaluate
    last: int = -1  # the token to feed next in decode
    generated: int = 0
    sampler: Any = None
    greedy: bool = False  # plain argmax: no llama.cpp sampler needed
    prompt_lp: list[Any] | None = None  # the prompt's logprobs so far (requests that asked for them)
    used_at: float = 0.0
    lora_uid: int = 0  # the LoRA adapter its cache was computed under (0: the base model)
    lora_name: str | None = None  # that adapter's name (its blocks' hash salt)

    def take_adapter(self, req: Request) -> None:
        """The slot's cache is (about to be) computed under ``req``'s adapter."""
        self.lora_uid = req.lora_uid
        self.lora_name = req.adapter.name if req.adapter is not None else None


class SlotCaches:
    """The slots, what their caches hold (named as the router names blocks, once ``tracking``), and the
    host and disk tiers behind them.  ``host_bytes``: the host tier's size (0: no offloading)."""

    def __init__(self, n_ctx_seq: int, block_size: int, host_bytes: int = 0):
        self.slots: list[Slot] = []  # made by bind, once the model is loaded
        self.block_size = block_size
        self.slot_blocks = SlotBlocks(block_size)
        self.tracking = False  # name blocks for KV events (a worker attached)
        self.host_tier = HostKvTier(host_bytes, block_size, spill=self.spill) if host_bytes > 0 else None
        self.disk_tier: DiskKvTier | None = None  # made by open_disk
        self.copies = 0
        self.state_copies = 0  # copies made through the sequence state (copy_cache)
        self.borrowed = 0  # prefixes loaded from another worker's state (load_prefix)
        self.lent = 0  # prefix states exported for another worker (export_prefix)
        self.lent_at_once = 0  # of them, served from the host tier without waiting for a step (lend_from_host)
        # a lending worker keeps every finished sequence's state in the host tier (keep_finished)
        self.keep_finished_states = False
        # a donor holding at most this many tokens is copied through its state, a longer one with seq_cp
        self.state_copy_max_tokens = n_ctx_seq // 4
        self._llama: Llama | None = None

    def open_disk(self, root: Path, max_bytes: int) -> None:
        """The disk tier under ``root`` (OSError: it cannot be made there)."""
        self.disk_tier = DiskKvTier(root, max_bytes, self.block_size)

    def bind(self, llama: Llama, n_parallel: int) -> None:
        """The loaded model's context: one slot per sequence."""
        self._llama = llama
        self.slots = [Slot(seq_id=i) for i in range(n_parallel)]

    @property
    def llama(self) -> Llama:
        assert self._llama is not None, "the model is not loaded"
        return self._llama

    # -- KV events ----------------------------------------------------------------------------
    def track(self) -> list[tuple[str, Any]]:
        """Name every block from scratch and from now on; the events (tier, data) that describe what the
        slots and the tiers hold now."""
        self.slot_blocks = SlotBlocks(self.block_size)
        for slot in self.slots:  # anything cached before now is named from scratch
            self.slot_blocks.extend(slot.seq_id, slot.cached, slot.lora_name)
        self.tracking = True
        events = [(DEVICE, d) for d in self.slot_blocks.take_events()]
        for tier, store in ((HOST, self.host_tier), (DISK, self.disk_tier)):
            if store is not None:
                events += [(tier, d) for d in store.names.rename_all(store.keys())]
        return events

    def take_events(self) -> list[tuple[str, Any]]:
        """The KV events (tier, data) since the last call, the slots' first; none while not tracking."""
        lower = [(tier, d) for tier, store in ((HOST, self.host_tier), (DISK, self.disk_tier)) if store is not None
                 for d in store.names.take_events()]  # taken even when nobody listens: they would pile up
        if not self.tracking:
            return []
        return [(DEVICE, d) for d in self.slot_blocks.take_events()] + lower

    def name_blocks(self) -> None:
        """After a step: name the blocks it completed in the busy slots."""
        if self.tracking:
            for slot in self.slots:
                if slot.req is not None:
                    self.slot_blocks.extend(slot.seq_id, slot.cached, slot.lora_name)

    def cached_blocks(self) -> int:
        """Complete blocks the slots hold (shared prefixes counted once while tracking)."""
        return self.slot_blocks.cached_blocks if self.tracking else sum(
            len(s.cached) // self.block_size for s in self.slots)

    def forget_adapter(self, uid: int) -> None:
        """Empty the free slots whose caches an unloaded adapter computed (nothing can reuse them)."""
        for slot in self.slots:
            if slot.lora_uid == uid and slot.req is None:
                self.drop(slot)
                slot.lora_uid, slot.lora_name = 0, None

    def drop(self, slot: Slot) -> None:
        """Empty the slot's cache (a failed decode left it undefined)."""
        self.llama.L.llama_memory_seq_rm(self.llama.mem, slot.seq_id, -1, -1)
        slot.cached = []
        if self.tracking:
            self.slot_blocks.truncate(slot.seq_id, 0)

    # -- admission ------------------------------------------------------------------------------
    def place(self, req: Request, free: list[Slot]) -> Slot | None:
        """Pick the free slot for ``req`` and make its cache hold the longest prefix of the prompt there is
        (its own, a copy of another slot's, or a restored tier entry); sets ``req.cached_tokens`` and the
        slot's pending prompt tokens.  None: a busy slot is still computing much more of this prompt, so
        the request should wait for it (and copy it) instead of computing it a second time beside it."""
        last = len(req.prompt) - 1
        uid = req.lora_uid  # only caches computed under the request's own adapter are reusable
        prefix = {s.seq_id: common_prefix(s.cached, req.prompt) if s.lora_uid == uid else 0 for s in self.slots}
        best = max(free, key=lambda s: (prefix[s.seq_id], -s.used_at))
        if len(best.cached) - prefix[best.seq_id] >= SPARE_MIN_TOKENS:
            # this prompt would overwrite another conversation in that slot (a shared system prompt, then
            # that conversation's turns): take an empty slot, or one used longer ago, and copy the shared
            # prefix there (below), so that conversation's next turn still finds it.  Before, a slot was
            # only spared when it held twice what the request reused, and a new conversation of a group
            # overwrote the history of the group's conversation whose next turn was a second away.
            others = [s for s in free if s is not best]
            spare = min(others, key=lambda s: (bool(s.cached), s.used_at), default=None)
            if spare is not None and (not spare.cached or spare.used_at < best.used_at):
                best = spare
        keep = min(prefix[best.seq_id], last)
        busy = [s for s in self.slots if s.req is not None]
        # any other slot, busy or free, whose cache holds more of this prompt can lend it
        donor = max((s for s in self.slots if s is not best), key=lambda s: prefix[s.seq_id], default=None)
        now = max(keep, min(prefix[donor.seq_id], last) if donor is not None else 0)
        later = max((min(common_prefix(s.req.prompt, req.prompt), last)  # type: ignore[union-attr]
                     for s in busy if s.pending and s.lora_uid == uid), default=0)
        if later >= now + COPY_MIN_TOKENS:
            return None  # admitted (with a copy) once that slot's prefill is done
        L = self.llama.L
        if donor is not None and min(prefix[donor.seq_id], last) >= keep + COPY_MIN_TOKENS:
            # another slot holds much more of this prompt: copy its cache over the least recently used
            # free slot (the copy runs at the start of the next llama_decode)
            targets = [s for s in free if s is not donor]
            best = min([s for s in targets if not s.cached] or targets, key=lambda s: s.used_at)
            keep = min(prefix[donor.seq_id], last)
            self.offload(best, 0)
            t0 = time.perf_counter()
            how = self.copy_cache(donor, best)
            self.copies += 1
            if self.tracking:
                self.slot_blocks.copy(donor.seq_id, best.seq_id, keep)
            log.debug("request %s: slot %d copies %d cached tokens from slot %d (%s of %d tokens, %.1f ms)",
                      req.ctx.id, best.seq_id, keep, donor.seq_id, how, len(donor.cached),
                      1e3 * (time.perf_counter() - t0))
            best.cached = donor.cached[:keep]
        else:
            self.offload(best, keep)
        if req.prefix_state is not None and uid == 0:
            keep = self.load_prefix(best, req, keep)
        best.take_adapter(req)
        if uid == 0:
            keep = self.restore(best, req.prompt, keep)
        keep = cut_before_images(keep, req.images)  # an image is evaluated whole
        if not L.llama_memory_seq_rm(self.llama.mem, best.seq_id, keep, -1):
            L.llama_memory_seq_rm(self.llama.mem, best.seq_id, -1, -1)
            keep = 0
        if self.tracking:
            self.slot_blocks.truncate(best.seq_id, keep)
        best.cached = req.prompt[:keep]
        req.cached_tokens = keep
        best.pending = req.prompt[keep:]
        return best

    def place_whole(self, req: Request, free: list[Slot]) -> Slot:
        """A request for the prompt's logprobs needs the logits at every prompt position, so nothing of
        it comes from a cache: it takes the least recently used free slot and computes it all."""
        best = min(free, key=lambda s: s.used_at)
        self.offload(best, 0)
        self.llama.L.llama_memory_seq_rm(self.llama.mem, best.seq_id, -1, -1)
        if self.tracking:
            self.slot_blocks.truncate(best.seq_id, 0)
        best.take_adapter(req)
        best.cached = []
        req.cached_tokens = 0
        best.pending = list(req.prompt)
        return best

    def place_imported(self, req: Request, free: list[Slot], data: bytes) -> Slot | None:
        """Load a prefill worker's state of ``req.prompt`` into the least recently used free slot; None
        (nothing changed, prefill locally) if llama.cpp refuses the state."""
        L, lctx, mem = self.llama.L, self.llama.lctx, self.llama.mem
        slot = min(free, key=lambda s: s.used_at)
        L.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
        t0 = time.perf_counter()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        n = L.llama_state_seq_set_data(lctx, buf, len(data), slot.seq_id)
        ok = n == len(data) and L.llama_memory_seq_pos_max(mem, slot.seq_id) == len(req.prompt) - 1
        if self.tracking:
            self.slot_blocks.truncate(slot.seq_id, 0)
        if not ok:
            L.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
            slot.cached = []
            log.warning("request %s: llama.cpp refused the transferred KV state (%d of %d bytes read); "
                        "prefilling locally", req.ctx.id, n, len(data))
            return None
        slot.take_adapter(req)
        slot.cached = list(req.prompt)
        slot.pending = []
        if self.tracking:
            self.slot_blocks.extend(slot.seq_id, slot.cached, slot.lora_name)
        log.debug("request %s: slot %d loaded the KV state of %d prompt tokens (%d bytes) in %.1f ms", req.ctx.id,
                  slot.seq_id, len(req.prompt), len(data), 1e3 * (time.perf_counter() - t0))
        return slot

    # -- copies, offloading, restoring ------------------------------------------------------------
    def copy_cache(self, donor: Slot, dst: Slot) -> str:
        """Make ``dst``'s sequence a copy of ``donor``'s (the caller truncates it to the shared prefix).

        With a cache stream per sequence, ``llama_memory_seq_cp`` copies the donor's whole stream,
        ``n_ctx_seq`` cells whatever it holds (about 30 ms for SmolLM2's 8,192 cells here: a quarter of a
        short prompt's prefill, docs/performance.md).  The sequence's state holds only its used cells, so while
        the donor holds less than a quarter of its stream (an export and an import: two passes over them
        and the buffer) that is the cheaper copy: 2 ms for 180 tokens.  seq_cp otherwise, and if
        llama.cpp refuses the state."""
        L, lctx, mem = self.llama.L, self.llama.lctx, self.llama.mem
        L.llama_memory_seq_rm(mem, dst.seq_id, -1, -1)
        if len(donor.cached) <= self.state_copy_max_tokens:
            np = self.llama.np
            size = L.llama_state_seq_get_size(lctx, donor.seq_id)
            buf = np.empty(size, dtype=np.uint8)  # (not zero-filled, unlike a ctypes array)
            ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            if (L.llama_state_seq_get_data(lctx, ptr, size, donor.seq_id) == size
                    and L.llama_state_seq_set_data(lctx, ptr, size, dst.seq_id) == size
                    and L.llama_memory_seq_pos_max(mem, dst.seq_id) == len(donor.cached) - 1):
                self.state_copies += 1
                return "sequence state"
            L.llama_memory_seq_rm(mem, dst.seq_id, -1, -1)
            log.warning("copying slot %d's cache through its state failed; copying its stream", donor.seq_id)
        # (the copy runs at the start of the next llama_decode)
        L.llama_memory_seq_cp(mem, donor.seq_id, dst.seq_id, -1, -1)
        return "whole stream"

    def offload(self, slot: Slot, keep: int) -> None:
        """Save ``slot``'s cache to the host tier if more than OFFLOAD_MIN_TOKENS of it are about to go."""
        tier = self.host_tier
        if tier is None or len(slot.cached) - keep < OFFLOAD_MIN_TOKENS or slot.lora_uid != 0:
            return
        if tier.touch(tuple(slot.cached)):  # kept when its request finished (keep_finished)
            return
        try:
            tier.put(list(slot.cached), self.export_state(slot))
        except EngineError as e:
            log.warning("KV offload of slot %d failed: %s", slot.seq_id, e)

    def keep_finished(self, slot: Slot) -> None:
        """A lending worker, after a request finished: the slot's state into the host tier, from where
        :meth:`lend_from_host` serves it without waiting for the engine's step.  Exported between steps,
        a fetch from a holder in a long prefill waited for the whole of it (300 to 800 ms in the peers
        benchmark), about as long as the request would have waited at the holder; this costs the holder
        a state export per request (1.3 ms and a copy for 246 tokens)."""
        tier = self.host_tier
        if (not self.keep_finished_states or tier is None or slot.lora_uid != 0
                or len(slot.cached) < OFFLOAD_MIN_TOKENS or tier.touch(tuple(slot.cached))):
            return
        try:
            tier.put(list(slot.cached), self.export_state(slot))
        except EngineError as e:
            log.warning("keeping slot %d's state for lending failed: %s", slot.seq_id, e)

    def lend_from_host(self, tokens: list[int]) -> tuple[int, int, Any] | None:
        """From any thread, for another worker: the host-tier state sharing the longest prefix with
        ``tokens`` (tokens it covers, tokens shared, state) when no slot shares more, else None (then
        :meth:`export_prefix`, between two steps).  The slots' tokens are read off the engine's thread: a
        step behind at worst, which sends the export to the engine's thread or lends a few tokens less,
        never a state that is not the one it names (host entries do not change)."""
        host = self.host_tier
        found = host.lookup(tokens) if host is not None and len(host) else None
        if found is None or found[1] < COPY_MIN_TOKENS:
            return None
        if any(common_prefix(s.cached, tokens) > found[1] for s in list(self.slots) if s.lora_uid == 0):
            return None
        self.lent += 1
        self.lent_at_once += 1
        return len(found[0]), found[1], found[2]

    def spill(self, key: tuple[int, ...], data: bytes) -> None:
        """The host tier's LRU pushed an entry out: keep it on disk if there is a disk tier."""
        if self.disk_tier is not None:
            self.disk_tier.put(key, data)

    def restore(self, slot: Slot, prompt: list[int], keep: int) -> int:
        """Load the best host or disk entry for ``prompt`` into ``slot`` if it saves OFFLOAD_MIN_TOKENS of
        prefill over ``keep``; returns the tokens now reusable (the caller truncates to it).  An entry read
        from disk moves back to host memory; a damaged one is dropped and the prompt computed."""
        host, disk = self.host_tier, self.disk_tier
        if host is None:
            return keep
        found = host.best(prompt) if len(host) else None
        source: HostKvTier | DiskKvTier = host
        if disk is not None and len(disk):
            on_disk = disk.best(prompt)
            if on_disk is not None and (found is None or on_disk[1] > found[1]):
                found, source = on_disk, disk
        if found is None:
            return keep
        key, n = found
        n = min(n, len(prompt) - 1)
        if n < keep + OFFLOAD_MIN_TOKENS:
            return keep
        data = source.get(key)
        if data is None:  # a damaged file (logged, removed): compute the prompt
            return keep
        if source is disk and len(data) <= host.max_bytes:  # back to host memory (it never fits: stays on disk)
            disk.remove(key)
            host.put(key, data)
        tier = source
        L, lctx, mem = self.llama.L, self.llama.lctx, self.llama.mem
        L.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        ok = (L.llama_state_seq_set_data(lctx, buf, len(data), slot.seq_id) == len(data)
              and L.llama_memory_seq_pos_max(mem, slot.seq_id) == len(key) - 1)
        if self.tracking:
            self.slot_blocks.truncate(slot.seq_id, 0)
        if not ok:
            L.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
            slot.cached = []
            log.warning("KV restore into slot %d failed; computing the prompt", slot.seq_id)
            return 0
        slot.cached = list(key)
        if self.tracking:
            self.slot_blocks.extend(slot.seq_id, slot.cached, slot.lora_name)
        tier.restored += 1
        log.debug("slot %d: restored %d cached tokens from the %s tier", slot.seq_id, n,
                  "disk" if tier is disk else "host")
        return n

    def load_prefix(self, slot: Slot, req: Request, keep: int) -> int:
        """Load another worker's state of this prompt's prefix (``req.prefix_state``) into ``slot`` if it
        saves COPY_MIN_TOKENS of prefill over ``keep``; returns the tokens now reusable.  The state covers
        that worker's whole cache: the tokens past the shared prefix are dropped (the caller truncates)."""
        state, req.prefix_state = req.prefix_state, None
        n = min(state.n_shared, len(req.prompt) - 1)
        if n < keep + COPY_MIN_TOKENS:
            return keep
        L, lctx, mem = self.llama.L, self.llama.lctx, self.llama.mem
        t0 = time.perf_counter()
        L.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
        data = state.data
        array = ctypes.c_uint8 * len(data)
        buf = array.from_buffer(data) if isinstance(data, bytearray) else array.from_buffer_copy(data)
        ok = (L.llama_state_seq_set_data(lctx, buf, len(data), slot.seq_id) == len(data)
              and L.llama_memory_seq_pos_max(mem, slot.seq_id) == state.n_state - 1)
        if self.tracking:
            self.slot_blocks.truncate(slot.seq_id, 0)
        if not ok:
            L.llama_memory_seq_rm(mem, slot.seq_id, -1, -1)
            slot.cached = []
            log.warning("request %s: llama.cpp refused another worker's KV prefix (%d bytes); computing the "
                        "prompt", req.ctx.id, len(data))
            return 0
        slot.cached = req.prompt[:n]
        if self.tracking:
            self.slot_blocks.extend(slot.seq_id, slot.cached, slot.lora_name)
        self.borrowed += 1
        log.debug("request %s: slot %d loaded %d prompt tokens from another worker's KV (%d bytes) in %.1f ms",
                  req.ctx.id, slot.seq_id, n, len(data), 1e3 * (time.perf_counter() - t0))
        return n

    def export_prefix(self, tokens: list[int]) -> tuple[int, int, Any] | None:
        """For another worker: the state of the base-model cache sharing the longest prefix with
        ``tokens`` (a slot's, or a host-tier entry's), as (tokens it covers, tokens shared, state); None
        when no cache shares COPY_MIN_TOKENS.  Between two steps every slot's cache is exactly its
        ``cached`` tokens."""
        best = max((s for s in self.slots if s.lora_uid == 0), key=lambda s: common_prefix(s.cached, tokens),
                   default=None)
        shared = common_prefix(best.cached, tokens) if best is not None else 0
        host = self.host_tier
        found = host.best(tokens) if host is not None and len(host) else None
        if found is not None and found[1] > shared:
            data = host.get(found[0])  # type: ignore[union-attr]
            if data is not None and found[1] >= COPY_MIN_TOKENS:
                self.lent += 1
                return len(found[0]), found[1], data
        if best is None or shared < COPY_MIN_TOKENS:
            return None
        L, lctx = self.llama.L, self.llama.lctx
        size = L.llama_state_seq_get_size(lctx, best.seq_id)
        buf = self.llama.np.empty(size, dtype=self.llama.np.uint8)  # (not zero-filled; sent from here as is)
        if L.llama_state_seq_get_data(lctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size,
                                      best.seq_id) != size:
            return None
        self.lent += 1
        return len(best.cached), shared, buf

    def export_state(self, slot: Slot) -> bytes:
        """The slot's sequence state (its KV cache of the prompt), for a decode worker or the host tier.
        Read into an uninitialised numpy buffer: a zero-filled ctypes array turned into bytes took 16 ms
        for 246 tokens here (5.7 MB), this 1.3 ms plus one copy."""
        L, np = self.llama.L, self.llama.np
        t0 = time.perf_counter()
        size = L.llama_state_seq_get_size(self.llama.lctx, slot.seq_id)
        buf = np.empty(size, dtype=np.uint8)
        n = L.llama_state_seq_get_data(self.llama.lctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size,
                                       slot.seq_id)
        if n != size:
            raise EngineError(f"llama.cpp exported {n} of {size} bytes of sequence state")
        data = buf.tobytes()
        log.debug("slot %d: exported the KV state of %d tokens (%d bytes) in %.1f ms", slot.seq_id, len(slot.cached),
                  size, 1e3 * (time.perf_counter() - t0))
        return data
