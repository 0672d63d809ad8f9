"""Whether a worker lends its cached prefixes when nobody said: on exactly where a stranger cannot read them
(a fleet secret, or one machine on loopback with a store of this user's alone), off in one line elsewhere;
``DYN_KV_PREFIX_SHARING`` always wins."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from dynamo.disagg.prefix_share import PrefixShareServer, choose_sharing, fetch_prefix
from dynamo.disagg.transfer import TransferError
from dynamo.errors import UserError
from dynamo.runtime.config import RuntimeSettings
from dynamo.runtime.distributed import DistributedRuntime
from dynamo.runtime.fleet_auth import FleetAuth
from dynamo.runtime.store_dir import FileStoreError, is_private_dir, local_secret
from dynamo.worker.serve import prefix_sharing

SAFE = {"fleet_secret": False, "loopback": True, "private_store": True}


def test_unset_it_is_on_with_a_fleet_secret_wherever_the_worker_listens():
    for loopback in (True, False):
        for private in (True, False):
            got = choose_sharing(None, fleet_secret=True, loopback=loopback, private_store=private)
            assert (got.on, got.auth, got.warn) == (True, "fleet", False)


def test_unset_it_is_on_on_one_machine_with_the_stores_key():
    got = choose_sharing(None, **SAFE)
    assert (got.on, got.auth, got.warn) == (True, "machine", False)
    assert "loopback" in got.line
    assert choose_sharing("", **SAFE).auth == "machine"  # set to nothing: as unset


def test_unset_it_is_off_where_a_stranger_could_reach_it_and_the_line_says_how_to_turn_it_on():
    beyond = choose_sharing(None, fleet_secret=False, loopback=False, private_store=True)
    shared_store = choose_sharing(None, fleet_secret=False, loopback=True, private_store=False)
    for got in (beyond, shared_store):
        assert (got.on, got.auth) == (False, "none")
        assert "\n" not in got.line and "DYN_FLEET_SECRET" in got.line and "DYN_KV_PREFIX_SHARING=1" in got.line
    assert "beyond loopback" in beyond.line
    assert "file store" in shared_store.line


def test_zero_always_turns_it_off():
    for value in ("0", "off", "false", " No "):
        for secret in (True, False):
            got = choose_sharing(value, fleet_secret=secret, loopback=True, private_store=True)
            assert not got.on and not got.warn


def test_one_turns_it_on_and_without_a_protection_it_says_so_in_one_warning():
    assert choose_sharing("1", **SAFE).auth == "machine"  # still the store's key where there is one
    assert choose_sharing("on", fleet_secret=True, loopback=False, private_store=False).auth == "fleet"
    got = choose_sharing("1", fleet_secret=False, loopback=False, private_store=False)
    assert (got.on, got.auth, got.warn) == (True, "none", True)
    assert "WITHOUT authentication" in got.line and "DYN_FLEET_SECRET" in got.line and "\n" not in got.line


def test_anything_else_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"DYN_KV_PREFIX_SHARING='maybe': use 1 \(on\) or 0 \(off\)"):
        choose_sharing("maybe", **SAFE)


def test_the_stores_secret_is_made_once_private_and_the_same_for_every_process(tmp_path: Path):
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    first = local_secret(root)
    assert len(first) == 64 and local_secret(root) == first
    assert stat.S_IMODE(os.stat(root / "local_secret").st_mode) == 0o600
    assert [p.name for p in root.iterdir()] == ["local_secret"]  # no temporary file left
    assert is_private_dir(root)
    os.chmod(root, 0o750)  # group may read: not private, whoever owns it
    assert not is_private_dir(root)
    os.chmod(root, 0o700)
    os.chmod(root / "local_secret", 0o644)  # readable by others: proves nothing
    with pytest.raises(FileStoreError, match="not this user's alone"):
        local_secret(root)


def test_processes_starting_together_agree_on_one_secret(tmp_path: Path):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        got = set(pool.map(lambda _: local_secret(tmp_path), range(16)))
    assert len(got) == 1


async def test_the_stores_key_keeps_out_whoever_cannot_read_the_store(tmp_path: Path):
    """Another local user reaches a loopback port but not this user's store: without its key they get
    nothing; a worker of the fleet, which reads the same store, gets the state."""
    member = FleetAuth(local_secret(tmp_path))
    asked: list[int] = []

    async def export(tokens: list[int]) -> tuple[int, int, bytes] | None:
        asked.append(len(tokens))
        return len(tokens), len(tokens), b"state" * 100

    srv = PrefixShareServer(export, auth=member)
    await srv.start()
    try:
        for stranger in (None, FleetAuth(b"a guess at the secret, 64 characters long.....")):
            with pytest.raises(TransferError):
                await fetch_prefix(srv.address, list(range(40)), timeout=5, auth=stranger)
        assert asked == []
        neighbour = FleetAuth(local_secret(tmp_path))  # another process of the fleet
        assert (await fetch_prefix(srv.address, list(range(40)), auth=neighbour)).n_shared == 40
    finally:
        await srv.close()


async def _runtime(store: Path) -> DistributedRuntime:
    settings = RuntimeSettings(discovery_backend="file", file_kv=str(store), request_plane="tcp", event_plane="zmq",
                               graceful_shutdown_timeout=0.2)
    return await DistributedRuntime.connect(settings)


async def test_a_worker_on_one_machine_lends_by_default_with_the_stores_key(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("DYN_KV_PREFIX_SHARING", raising=False)
    monkeypatch.delenv("DYN_TCP_RPC_HOST", raising=False)
    store = tmp_path / "kv"
    a, b = await _runtime(store), await _runtime(store)
    try:
        (got_a, key_a), (got_b, key_b) = await asyncio.gather(prefix_sharing(a), prefix_sharing(b))
        assert got_a.on and got_a.auth == "machine" and key_a is not None and key_b is not None
        assert key_a.derive("x") == key_b.derive("x")  # both workers prove the same key
        monkeypatch.setenv("DYN_KV_PREFIX_SHARING", "0")
        assert not (await prefix_sharing(a))[0].on
    finally:
        await a.close()
        await b.close()


async def test_a_store_others_may_read_gets_no_secret_and_no_sharing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("DYN_KV_PREFIX_SHARING", raising=False)
    monkeypatch.delenv("DYN_TCP_RPC_HOST", raising=False)
    store = tmp_path / "shared"
    store.mkdir()
    os.chmod(store, 0o755)  # named deliberately (accepted: nobody else may write it), but anyone may read it
    rt = await _runtime(store)
    try:
        got, key = await prefix_sharing(rt)
        assert (got.on, key) == (False, None) and "file store" in got.line
        assert not (store / "local_secret").exists()
    finally:
        await rt.close()
