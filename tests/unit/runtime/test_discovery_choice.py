"""Which discovery backend a process picks when nobody said, and the warning when two processes picked
differently: against a real etcd (harness) and a real file store directory."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from dynamo.runtime import DistributedRuntime, RuntimeSettings
from dynamo.runtime.config import EtcdSettings, NatsSettings, discovery_backend_name
from dynamo.runtime.discovery_choice import MismatchCheck, choose_discovery, etcd_answers, live_leases_in
from dynamo.runtime.errors import RuntimeConfigError
from dynamo.runtime.file_store import FileStore
from harness.servers import EtcdServer, NatsServer, free_port


def test_backend_names() -> None:
    assert discovery_backend_name("kv_store") == "etcd"
    assert discovery_backend_name("FILE") == "file"
    assert discovery_backend_name(None) is None and discovery_backend_name("auto") is None
    with pytest.raises(RuntimeConfigError, match="DYN_DISCOVERY_BACKEND='mem'"):
        discovery_backend_name("mem", "DYN_DISCOVERY_BACKEND")


async def test_default_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ETCD_ENDPOINTS", raising=False)
    monkeypatch.delenv("DYN_DISCOVERY_BACKEND", raising=False)
    nothing = f"http://127.0.0.1:{free_port()}"
    settings = RuntimeSettings.from_env()
    settings.etcd.endpoints = [nothing]
    backend, why = await choose_discovery(settings)
    assert backend == "file" and "no etcd at" in why
    with EtcdServer() as etcd:
        settings.etcd.endpoints = [etcd.url]
        assert await etcd_answers(etcd.url)
        assert (await choose_discovery(settings))[0] == "etcd"
        settings.discovery_backend = "file"
        assert await choose_discovery(settings) == ("file", "as asked")
    monkeypatch.setenv("ETCD_ENDPOINTS", nothing)  # given: etcd, even if it does not answer (then an error)
    assert (await choose_discovery(RuntimeSettings.from_env()))[0] == "etcd"


async def test_file_runtime_alone_while_etcd_answers_warns_once(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real runtime: a file-store process that sees nobody while an etcd answers says so;
    its object store is the file one."""
    monkeypatch.setattr("dynamo.runtime.discovery_choice.MISMATCH_AFTER", 0.3)
    with EtcdServer() as etcd, NatsServer() as nats:
        settings = RuntimeSettings(etcd=EtcdSettings([etcd.url]), nats=NatsSettings(nats.url),
                                   discovery_backend="file", file_kv=str(tmp_path))
        with caplog.at_level(logging.INFO, logger="dynamo.runtime"):
            rt = await DistributedRuntime.connect(settings)
            try:
                assert rt.discovery_backend == "file" and rt.etcd is not None
                await rt.object_store("mdc").put_if_absent("x", b"1")
                assert await rt.object_store("mdc").get("x") == b"1"
                assert (tmp_path / "objects" / "mdc").is_dir()
                for _ in range(50):
                    if "processes on different discovery backends never find each other" in caplog.text:
                        break
                    await asyncio.sleep(0.1)
            finally:
                await rt.close()
    assert f"an etcd answers at {etcd.url}" in caplog.text
    assert caplog.text.count("discovery file (") == 1


async def test_mismatch_check_is_quiet_when_others_are_here() -> None:
    async def yes() -> bool:
        return True

    async def other() -> str | None:
        return "somewhere"

    check = MismatchCheck("file", yes, other, after=0.01)
    await asyncio.wait_for(check.run(), 2)
    assert not check.warned


async def test_live_leases_in_a_file_store(tmp_path: Path) -> None:
    assert live_leases_in(tmp_path / "none") == 0
    store = FileStore(tmp_path)
    await store.connect()
    await store.grant_lease(10)
    assert live_leases_in(tmp_path) == 1
    await store.close()
