"""Types of the C extension dynamo.kv.native.blockcore (blockcore.c): the KV block index."""

from typing import Any, Hashable, Iterable, Sequence

def sequence_hash(parent: int, local: int, /) -> int:
    """xxh3-64 (seed 1337) of LE64(parent) || LE64(local): hashing.sequence_hash for a parent."""

class BlockIndex:
    """Which worker holds which block: sequence hash -> workers, and per worker block name -> sequence
    hash.  Workers are any hashable (ints here); hashes are unsigned 64-bit ints (OverflowError else)."""

    def __init__(self) -> None: ...
    def apply_stored(self, worker: Hashable, parent_hash: int | None, blocks: Iterable[Any], /) -> bool:
        """Add a chain of blocks ((block_hash, tokens_hash) pairs or objects with those attributes), the
        first a child of ``parent_hash``; False (nothing changed) when the worker does not hold that parent."""
    def apply_own_chain(self, worker: Hashable, seq_hashes: Sequence[int], /) -> None:
        """``worker`` holds these blocks, a chain from the root named by their sequence hashes."""
    def apply_removed(self, worker: Hashable, block_hashes: Iterable[int], /) -> int:
        """Forget these blocks of ``worker`` (by its names); returns how many it did not hold."""
    def apply_json(self, raw: bytes | str, worker: Hashable | None = None, /) -> int:
        """Parse and apply one event's JSON: a bare event of ``worker`` (Dynamo's RadixTree shape, rank 0)
        or, with no worker, a wrapped device-tier event.  0 applied; -1 not parsed here (nothing changed:
        decode it in Python); -2 parent unknown (nothing changed); n > 0: n removed blocks were unknown."""
    def remove_worker(self, worker: Hashable, /) -> None: ...
    def clear_worker(self, worker: Hashable, /) -> None: ...
    def find_matches(self, local_hashes: Sequence[int], seq_hashes: Sequence[int] | None = None, /) -> dict[Any, int]:
        """For each worker, how many leading blocks of the query it holds (only workers with > 0)."""
    def walk(self, seq_hashes: Sequence[int], early_exit: bool = False) -> tuple[dict[Any, int], int]:
        """(each worker's contiguous prefix, blocks looked at); ``early_exit``: stop at one worker left."""
    def walk_local(self, local_hashes: Sequence[int], early_exit: bool = False) -> tuple[dict[Any, int], int]:
        """:meth:`walk` on local hashes, chained into sequence hashes as the walk goes."""
    def holders(self, seq_hash: int, /) -> list[Any]: ...
    def workers(self) -> list[Any]: ...
    def num_blocks(self, worker: Hashable, /) -> int: ...
    def node_count(self) -> int: ...
    def compact(self) -> None:
        """Lay the worker sets out again in block order now (done by itself once half is garbage)."""
    def memory_bytes(self) -> int:
        """Bytes of the tables and sets (not counting the worker objects)."""
