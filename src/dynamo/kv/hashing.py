"""KV block hashing, bit-compatible with the original and any engine that speaks its format.

* **Local block hash**: the token ids are cut into *complete* blocks of ``block_size`` (a partial tail
  is ignored); each block's ids are written as little-endian u32 and hashed with xxh3-64, seed 1337.
* **Sequence hash**: ``h0 = local0``; ``hi = xxh3_64(LE64(h(i-1)) || LE64(local_i), seed=1337)``.  It
  names a block *and everything before it*, so two sequences share a sequence hash only if they share
  the whole prefix up to and including that block.

**LoRA adapters.**  A block computed under a LoRA adapter holds other keys and values than the same
tokens under the base model or another adapter, so the adapter's name salts its local hashes, as Dynamo
does: the xxh3 seed becomes ``1337 + xxh3_64(name)`` (wrapping at 64 bits; an empty name is no adapter).
Sequence hashes chain those local hashes as usual, so an adapter's chain never meets the base model's.

The indexer keys blocks by sequence hash, which it computes from each stored block's local hash and its
parent's (a chain of sequence hashes *is* the prefix); engines name
their blocks by sequence hash in KV events (``block_hash``) and send the local hash as ``tokens_hash``.
All hashes are unsigned 64-bit integers.
"""

from __future__ import annotations

import asyncio
import struct
import sys
from array import array
from typing import Iterable, Sequence

import xxhash

KV_HASH_SEED = 1337
MASK64 = (1 << 64) - 1

_xxh3 = xxhash.xxh3_64_intdigest
_PAIR = struct.Struct("<QQ")


def lora_seed(lora_name: str | None) -> int:
    """The seed of the local block hashes of blocks computed under the LoRA adapter ``lora_name``."""
    if not lora_name:
        return KV_HASH_SEED
    return (KV_HASH_SEED + _xxh3(lora_name.encode("utf-8"))) & MASK64


def hash_bytes(data: bytes | memoryview) -> int:
    """xxh3-64 with the KV seed."""
    return _xxh3(data, seed=KV_HASH_SEED)


def block_hash(tokens: Sequence[int], lora_name: str | None = None) -> int:
    """The local hash of one block of token ids (any length; callers pass complete blocks)."""
    return _xxh3(_le_u32(tokens), seed=lora_seed(lora_name))


def block_hash_mm(tokens: Sequence[int], mm_hashes: Iterable[int], lora_name: str | None = None) -> int:
    """The local hash of a block that shows multimodal objects (images...): its token ids as for
    :func:`block_hash`, then the objects' hashes, sorted, as little-endian u64.  Two blocks of the same
    placeholder tokens showing different images must not share a hash."""
    try:
        extra = b"".join(struct.pack("<Q", h) for h in sorted(mm_hashes))
    except struct.error:
        raise ValueError("mm_hash values must fit in an unsigned 64-bit integer") from None
    return _xxh3(_le_u32(tokens) + extra, seed=lora_seed(lora_name))


_U32 = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"


def _le_u32(tokens: Sequence[int]) -> bytes:
    try:
        a = array(_U32, tokens)
    except OverflowError:
        raise ValueError("token ids must fit in an unsigned 32-bit integer") from None
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def compute_block_hashes(token_ids: Sequence[int], block_size: int, lora_name: str | None = None) -> list[int]:
    """Local hashes of the complete blocks of ``token_ids`` (the partial tail is ignored), under the LoRA
    adapter ``lora_name`` (None: the base model)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    # one conversion for the whole prompt, then hash slices of it
    data = _le_u32(token_ids[: n_blocks * block_size])
    step = block_size * 4
    h = _xxh3
    seed = lora_seed(lora_name)
    return [h(data[i:i + step], seed) for i in range(0, n_blocks * step, step)]


def sequence_hash(parent: int | None, local: int) -> int:
    """The sequence hash of a block whose local hash is ``local`` and whose predecessor is ``parent``."""
    if parent is None:
        return local
    return _xxh3(_PAIR.pack(parent, local), seed=KV_HASH_SEED)


def compute_seq_hashes(local_hashes: Iterable[int], parent: int | None = None) -> list[int]:
    """Chained sequence hashes of consecutive blocks; ``parent`` is the sequence hash before the first."""
    out: list[int] = []
    prev = parent
    h, pack, seed = _xxh3, _PAIR.pack, KV_HASH_SEED
    for local in local_hashes:
        prev = local if prev is None else h(pack(prev, local), seed)
        out.append(prev)
    return out


def compute_hashes(token_ids: Sequence[int], block_size: int,
                   lora_name: str | None = None) -> tuple[list[int], list[int]]:
    """(local hashes, sequence hashes) of the complete blocks of ``token_ids``."""
    local = compute_block_hashes(token_ids, block_size, lora_name)
    return local, compute_seq_hashes(local)


# blocks hashed between two yields to the event loop (~0.3 ms of work here; see compute_hashes_async)
YIELD_EVERY_BLOCKS = 512


async def compute_hashes_async(token_ids: Sequence[int], block_size: int, chunk_blocks: int = YIELD_EVERY_BLOCKS,
                               lora_name: str | None = None) -> tuple[list[int], list[int]]:
    """:func:`compute_hashes` for long prompts, giving the event loop a turn every ``chunk_blocks`` blocks.

    A thread would not free the loop: each block is a Python call holding the GIL, so the loop would
    wait for the interpreter's switch interval (5 ms) instead.  A 128k-token prompt at block size 16 is
    8,000 blocks, about 6 ms of hashing in one piece; in slices the loop never waits more than one slice.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    n_blocks = len(token_ids) // block_size
    step = max(1, chunk_blocks) * block_size
    local: list[int] = []
    seq: list[int] = []
    for start in range(0, n_blocks * block_size, step):
        part = compute_block_hashes(token_ids[start:min(start + step, n_blocks * block_size)], block_size,
                                    lora_name)
        seq.extend(compute_seq_hashes(part, seq[-1] if seq else None))
        local.extend(part)
        if start + step < n_blocks * block_size:
            await asyncio.sleep(0)
    return local, seq
