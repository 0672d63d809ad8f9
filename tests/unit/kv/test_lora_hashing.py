"""The LoRA salt of block hashes: Dynamo's seed (1337 + xxh3_64(name)), the base model unchanged."""

import xxhash

from dynamo.kv.api import compute_block_hash_for_seq
from dynamo.kv.hashing import KV_HASH_SEED, MASK64, compute_block_hashes, lora_seed


def test_an_adapters_blocks_hash_with_its_own_seed_and_the_base_models_do_not_change():
    tokens = list(range(1, 33))
    base = compute_block_hashes(tokens, 16)
    assert compute_block_hashes(tokens, 16, None) == compute_block_hashes(tokens, 16, "") == base
    seed = (KV_HASH_SEED + xxhash.xxh3_64_intdigest(b"sql")) & MASK64
    assert lora_seed("sql") == seed
    raw = b"".join(t.to_bytes(4, "little") for t in tokens[:16])
    assert compute_block_hashes(tokens, 16, "sql")[0] == xxhash.xxh3_64_intdigest(raw, seed=seed)
    assert compute_block_hash_for_seq(tokens, 16, lora_name="sql") == compute_block_hashes(tokens, 16, "sql")
    assert set(compute_block_hashes(tokens, 16, "sql")).isdisjoint(base + compute_block_hashes(tokens, 16, "chat"))
