"""Dynamo's Python API to the KV index, driven as a Dynamo 1.x user script would drive it.

The expected scores are worked out by hand from Dynamo's semantics (a worker scores the leading blocks
of the query it holds without a gap; workers are ``(worker_id, dp_rank)``; ``early_exit`` stops once
one worker is left; ``cleared`` and ``remove_worker`` drop every rank), never read back from the
implementation.  Hashes are checked against xxh3 directly.
"""

import json
import os
import struct
import subprocess
import sys

import pytest
import xxhash

from dynamo.llm import OverlapScores, RadixTree, compute_block_hash_for_seq

BS = 4
PROMPT_A = list(range(1, 17))                     # 4 blocks
PROMPT_B = PROMPT_A[:8] + list(range(90, 98))     # shares A's first 2 blocks, then diverges
A = compute_block_hash_for_seq(PROMPT_A, BS)
B = compute_block_hash_for_seq(PROMPT_B, BS)


def ev(event_id, data, dp_rank=None):
    event = {"event_id": event_id, "data": data}
    if dp_rank is not None:
        event["dp_rank"] = dp_rank
    return json.dumps(event).encode()


def stored(event_id, parent, blocks, dp_rank=None):
    """``blocks``: (block_hash, tokens_hash) pairs; block_hash is the worker's own name for a block."""
    return ev(event_id, {"stored": {"parent_hash": parent,
                                    "blocks": [{"block_hash": b, "tokens_hash": t} for b, t in blocks]}},
              dp_rank)


def removed(event_id, block_hashes):
    return ev(event_id, {"removed": {"block_hashes": block_hashes}})


# -- compute_block_hash_for_seq --------------------------------------------------------------------
def xxh(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=1337)


def test_block_hashes_are_xxh3_of_each_full_block():
    assert A == [xxh(struct.pack("<4I", *PROMPT_A[i:i + 4])) for i in range(0, 16, 4)]
    assert A[:2] == B[:2] and A[2] != B[2]
    # a partial last block has no hash
    assert compute_block_hash_for_seq(PROMPT_A[:15], BS) == A[:3]
    assert compute_block_hash_for_seq([1, 2, 3], BS) == []
    with pytest.raises(ValueError):
        compute_block_hash_for_seq(PROMPT_A, 0)


def test_block_hashes_with_multimodal_objects():
    infos = [None, {"mm_objects": [{"mm_hash": 0xBEEF}, {"mm_hash": 0xABC}]}]
    got = compute_block_hash_for_seq(PROMPT_A[:8], BS, infos)
    block1 = struct.pack("<4I", *PROMPT_A[4:8]) + struct.pack("<QQ", 0xABC, 0xBEEF)  # hashes sorted
    assert got == [A[0], xxh(block1)]
    # fewer infos than blocks: the rest hash as text
    assert compute_block_hash_for_seq(PROMPT_A, BS, [None]) == A


# -- RadixTree -------------------------------------------------------------------------------------
def test_two_workers_shared_prefix_removed_cleared_and_remove_worker():
    tree = RadixTree()
    # worker 1 caches A in one event
    tree.apply_event(1, stored(1, None, [(101, A[0]), (102, A[1]), (103, A[2]), (104, A[3])]))
    # worker 2 caches B in two events, the second chained to the first by the parent's name
    tree.apply_event(2, stored(1, None, [(201, B[0]), (202, B[1])]))
    tree.apply_event(2, stored(2, 202, [(203, B[2]), (204, B[3])]))
    # worker 2's data-parallel rank 1 caches A's first block
    tree.apply_event(2, stored(3, None, [(301, A[0])], dp_rank=1))

    scores = tree.find_matches(A)
    assert isinstance(scores, OverlapScores)
    assert scores.scores == {(1, 0): 4, (2, 0): 2, (2, 1): 1}
    assert scores.frequencies == []  # no expiration: no access counts
    assert tree.find_matches(B).scores == {(1, 0): 2, (2, 0): 4, (2, 1): 1}
    assert tree.find_matches(A[:1]).scores == {(1, 0): 1, (2, 0): 1, (2, 1): 1}
    assert tree.find_matches([]).scores == {}
    assert tree.find_matches([12345] + A).scores == {}  # the first block is nobody's

    # early_exit: at block 2 only worker 1 is left, so it is credited 3 blocks, not its 4;
    # the workers that dropped out before keep what they had
    assert tree.find_matches(A, early_exit=True).scores == {(1, 0): 3, (2, 0): 2, (2, 1): 1}
    # B: worker 2 (rank 0) is alone from the third block on, and stops there
    assert tree.find_matches(B[:2] + [B[2]], early_exit=True).scores == {(1, 0): 2, (2, 0): 3, (2, 1): 1}

    # worker 1 evicts A's second block: its prefix now ends after the first, though it keeps 3 and 4
    tree.apply_event(1, removed(2, [102]))
    assert tree.find_matches(A).scores == {(1, 0): 1, (2, 0): 2, (2, 1): 1}

    # a removal naming an unknown block is an error, and the known blocks are still removed
    with pytest.raises(RuntimeError):
        tree.apply_event(2, removed(4, [204, 999]))
    assert tree.find_matches(B).scores == {(1, 0): 1, (2, 0): 3, (2, 1): 1}

    # "cleared" from worker 2 (rank 0) drops all of worker 2, both ranks
    tree.apply_event(2, ev(5, "cleared"))
    assert tree.find_matches(A).scores == {(1, 0): 1}
    assert tree.find_matches(B).scores == {(1, 0): 1}

    # worker 2 comes back and is cleared again by the call
    tree.apply_event(2, stored(6, None, [(201, B[0])], dp_rank=3))
    assert tree.find_matches(B).scores == {(1, 0): 1, (2, 3): 1}
    tree.clear_all_blocks(2)
    assert tree.find_matches(B).scores == {(1, 0): 1}

    tree.remove_worker(1)
    assert tree.find_matches(A).scores == {}
    tree.remove_worker(7)  # unknown worker: nothing to do


def test_bad_events():
    tree = RadixTree()
    with pytest.raises(RuntimeError):  # the parent is not a block worker 1 holds
        tree.apply_event(1, stored(1, 555, [(1, A[0])]))
    assert tree.find_matches(A).scores == {}
    with pytest.raises(ValueError):
        tree.apply_event(1, b"not json")
    with pytest.raises(ValueError):  # event_id is required
        tree.apply_event(1, json.dumps({"data": "cleared"}).encode())
    with pytest.raises(ValueError):
        tree.apply_event(1, ev(1, {"stored": {"parent_hash": None}}))
    with pytest.raises(ValueError):
        tree.apply_event(1, ev(1, {"bogus": {}}))


def test_frequencies_count_recent_lookups_of_each_block():
    tree = RadixTree(expiration_duration_secs=600)
    tree.apply_event(1, stored(1, None, [(11, A[0]), (12, A[1]), (13, A[2])]))
    tree.apply_event(2, stored(1, None, [(21, A[0])]))
    first = tree.find_matches(A)
    assert first.scores == {(1, 0): 3, (2, 0): 1}
    assert first.frequencies == []        # looked at for the first time: zeros are left out
    assert tree.find_matches(A).frequencies == [1, 1, 1]
    assert tree.find_matches(A[:2]).frequencies == [2, 2]
    # early exit looks at fewer blocks: the first two (worker 2 drops out at the second)
    assert tree.find_matches(A, early_exit=True).frequencies == [3, 3]
    assert tree.find_matches(A).frequencies == [4, 4, 2]


def test_import_is_cheap_and_names_resolve():
    code = ("import sys, dynamo.llm\n"
            "assert 'dynamo.kv' not in sys.modules\n"
            "from dynamo.llm import RadixTree, compute_block_hash_for_seq\n"
            "from dynamo.kv import RadixTree as R2\n"
            "assert RadixTree is R2\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
