"""Block hashing: vectors computed here straight from struct + xxhash, not through our code."""

import struct

import pytest
import xxhash

from dynamo.kv.hashing import (
    KV_HASH_SEED,
    block_hash,
    compute_block_hashes,
    compute_hashes,
    compute_seq_hashes,
    sequence_hash,
)


def ref_local(tokens):
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=1337)


def ref_seq(prev, local):
    return xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, local), seed=1337)


def test_seed():
    assert KV_HASH_SEED == 1337


def test_known_vector():
    # tokens [1, 2, 3, 4], one block of 4: the value the original's own tests use for this block
    assert compute_block_hashes([1, 2, 3, 4], 4) == [14643705804678351452]
    assert ref_local([1, 2, 3, 4]) == 14643705804678351452


def test_local_hashes_match_reference():
    tokens = list(range(100, 140))
    got = compute_block_hashes(tokens, 8)
    assert got == [ref_local(tokens[i:i + 8]) for i in range(0, 40, 8)]
    assert all(0 <= h < 2**64 for h in got)


def test_little_endian_u32_encoding():
    # a token id > 255 checks the byte order; > 2^16 the width
    tokens = [0x01020304, 70000, 151643, 7]
    assert block_hash(tokens) == xxhash.xxh3_64_intdigest(
        bytes([4, 3, 2, 1, 0x70, 0x11, 0x01, 0, 0x5B, 0x50, 0x02, 0, 7, 0, 0, 0]), seed=1337)


def test_partial_tail_ignored():
    tokens = list(range(1, 20))  # 4 full blocks of 4 and 3 tokens
    assert compute_block_hashes(tokens, 4) == compute_block_hashes(tokens[:16], 4)
    assert len(compute_block_hashes(tokens, 4)) == 4


def test_empty_and_short():
    assert compute_block_hashes([], 16) == []
    assert compute_block_hashes([1, 2, 3], 16) == []
    assert compute_seq_hashes([]) == []
    assert compute_hashes([], 4) == ([], [])


def test_sequence_hash_chain():
    tokens = list(range(1, 13))
    local = [ref_local(tokens[0:4]), ref_local(tokens[4:8]), ref_local(tokens[8:12])]
    h0 = local[0]
    h1 = ref_seq(h0, local[1])
    h2 = ref_seq(h1, local[2])
    assert compute_seq_hashes(local) == [h0, h1, h2]
    assert compute_hashes(tokens, 4) == (local, [h0, h1, h2])
    assert sequence_hash(None, local[0]) == h0
    assert sequence_hash(h0, local[1]) == h1
    # continuing a chain from a parent gives the same tail
    assert compute_seq_hashes(local[1:], parent=h0) == [h1, h2]


def test_sequence_hash_depends_on_prefix():
    a = compute_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = compute_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[0][1] == b[0][1]  # same tokens in the second block: same local hash
    assert a[1][1] != b[1][1]  # different prefix: different sequence hash


def test_bad_input():
    with pytest.raises(ValueError):
        compute_block_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        compute_block_hashes([-1, 2], 2)
    with pytest.raises(ValueError):
        compute_block_hashes([2**32, 2], 2)


# -- long prompts: hashed in slices, so that the frontend's event loop keeps running ---------------------

@pytest.mark.parametrize("n_tokens,chunk", [(0, 4), (15, 4), (16, 4), (16 * 9 + 5, 4), (16 * 8, 8), (1000, 1)])
async def test_hashing_in_slices_gives_the_same_hashes(n_tokens, chunk):
    from dynamo.kv.hashing import compute_hashes, compute_hashes_async

    tokens = [(i * 7919) % 50000 for i in range(n_tokens)]
    assert await compute_hashes_async(tokens, 16, chunk_blocks=chunk) == compute_hashes(tokens, 16)


async def test_hashing_a_long_prompt_lets_the_loop_run():
    import asyncio

    from dynamo.kv.hashing import compute_hashes_async

    ticks = 0
    done = False

    async def ticker():
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    await compute_hashes_async(list(range(128 * 1024)), 16, chunk_blocks=512)  # 8,192 blocks, 16 slices
    done = True
    await t
    assert ticks >= 15


async def test_the_kv_policy_routes_a_long_prompt_on_hashes_made_beforehand():
    from types import SimpleNamespace

    from dynamo.frontend.kv_policy import HASH_OFF_LOOP_TOKENS, KvRouterPolicy
    from dynamo.kv import KvRouter
    from dynamo.kv.hashing import compute_hashes
    from dynamo.llm.protocols.common import PreprocessedRequest

    router = KvRouter(block_size=16, seed=1)
    tokens = [(i * 31) % 40000 for i in range(HASH_OFF_LOOP_TOKENS + 100)]
    local, seq = compute_hashes(tokens, 16)
    router.apply_event({"worker_id": 2, "event": {"event_id": 1, "data": {"stored": {
        "parent_hash": None, "blocks": [{"block_hash": s, "tokens_hash": lo} for s, lo in zip(seq, local, strict=True)]}}}})
    policy = KvRouterPolicy(router, events=None)
    request = PreprocessedRequest(token_ids=tokens, model="m")
    await policy.prepare(request)
    assert len(policy._prepared) == 1
    sent = []
    client = SimpleNamespace(free_instance_ids=lambda: [1, 2, 3], instance_ids=lambda: [1, 2, 3],
                             direct=lambda body, worker, context=None: sent.append(worker) or "stream")
    assert policy.open(client, request, SimpleNamespace(id=lambda: "r1")) == "stream"
    assert sent == [2] and request.estimated_prefix_hit_num_blocks == len(seq)
    assert policy._prepared == {}  # used once, then dropped
