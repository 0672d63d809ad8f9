"""Which KV blocks the sequence slots of an engine hold, as the KV router names them.

For engines that keep one token sequence per slot (llama.cpp: a slot's cache is the prefix of tokens
it last computed).  Each slot's cached tokens are cut into complete blocks of ``block_size`` and named
by the router's hashes (hashing.py: ``block_hash`` = sequence hash, ``tokens_hash`` = local hash), so
the router's radix tree for this worker is exactly the union of the slots' prefixes.

A block held by several slots (a shared system prompt) is reference-counted: ``stored`` is reported
when the first slot computes it, ``removed`` when the last one drops it (its cache cut back for a new
prompt, or lost).  Runs of new consecutive blocks make one ``stored`` event whose ``parent_hash`` is the
block before them in that slot.  Changes collect as event *data* until :meth:`take_events`, so the
engine's compute thread can hand them to the event loop in one go.  Not thread-safe: one thread.

A slot computed under a LoRA adapter names its blocks with the adapter's salted hashes (hashing.py), so
the router matches them only for requests of that adapter; a slot that changes adapter starts from
nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

from dynamo.kv.events import CLEARED_DATA, removed_data, stored_data
from dynamo.kv.hashing import compute_block_hashes, compute_seq_hashes


class SlotBlocks:
    def __init__(self, block_size: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.block_size = block_size
        self._slots: dict[int, list[int]] = {}  # slot -> sequence hashes of its complete blocks
        self._refs: dict[int, int] = {}  # sequence hash -> number of slots holding it
        self._lora: dict[int, str | None] = {}  # slot -> the LoRA adapter its blocks were computed under
        self._events: list[Any] = []

    @property
    def cached_blocks(self) -> int:
        """Distinct blocks held by any slot."""
        return len(self._refs)

    def blocks(self, slot: int) -> list[int]:
        return list(self._slots.get(slot, ()))

    def clear(self) -> None:
        """Forget every slot (the engine's cache is empty): one ``cleared`` event."""
        self._slots.clear()
        self._refs.clear()
        self._lora.clear()
        self._events.append(CLEARED_DATA)

    def truncate(self, slot: int, n_tokens: int) -> None:
        """The slot now holds only its first ``n_tokens`` tokens."""
        blocks = self._slots.get(slot)
        keep = n_tokens // self.block_size
        if not blocks or len(blocks) <= keep:
            return
        gone = []
        for h in reversed(blocks[keep:]):  # children before parents
            n = self._refs[h] - 1
            if n:
                self._refs[h] = n
            else:
                del self._refs[h]
                gone.append(h)
        del blocks[keep:]
        if gone:
            self._events.append(removed_data(gone))

    def extend(self, slot: int, tokens: Sequence[int], lora_name: str | None = None) -> None:
        """The slot holds ``tokens`` (its previous tokens, plus what it computed since), computed under
        the LoRA adapter ``lora_name`` (None: the base model): name the new complete blocks."""
        if self._lora.get(slot) != lora_name:
            self.truncate(slot, 0)
            self._lora[slot] = lora_name
        blocks = self._slots.setdefault(slot, [])
        have = len(blocks)
        bs = self.block_size
        n = len(tokens) // bs
        if n <= have:
            return
        local = compute_block_hashes(tokens[have * bs:n * bs], bs, lora_name)
        seq = compute_seq_hashes(local, blocks[-1] if blocks else None)
        parent = blocks[-1] if blocks else None
        run: list[tuple[int, int]] = []
        run_parent = parent
        for s, loc in zip(seq, local, strict=True):
            held = self._refs.get(s, 0)
            self._refs[s] = held + 1
            if held:  # another slot has it: the router knows it already
                if run:
                    self._events.append(stored_data(run_parent, run))
                    run = []
            else:
                if not run:
                    run_parent = parent
                run.append((s, loc))
            parent = s
        if run:
            self._events.append(stored_data(run_parent, run))
        blocks.extend(seq)

    def copy(self, src: int, dst: int, n_tokens: int) -> None:
        """``dst`` now holds the first ``n_tokens`` tokens of ``src`` (and nothing else)."""
        self.truncate(dst, 0)
        shared = self._slots.get(src, [])[: n_tokens // self.block_size]
        for h in shared:
            self._refs[h] += 1
        self._slots[dst] = list(shared)
        self._lora[dst] = self._lora.get(src)

    def take_events(self) -> list[Any]:
        events, self._events = self._events, []
        return events
