"""A fleet across hosts on one machine (harness/netns.py): etcd and nats-server each on a host of their
own (``etcd``, ``nats``), two worker hosts (``w1``, ``w2``) and a frontend host (``fe``), each a network
namespace with its own address. The module is skipped, with the reason, where namespaces cannot be made
(not root, no ``ip``); every namespace a test made is gone after it, whatever happened."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from harness.netns import Topology, netns_unavailable
from harness.netns_fleet import NATS_CONFIG, Fleet
from harness.servers import EtcdServer, NatsServer

BLOCK_SIZE = 16
HOSTS = ["etcd", "nats", "w1", "w2", "fe"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/netns/" in str(item.fspath):
            item.add_marker(pytest.mark.netns)


@pytest.fixture(scope="module")
def topology() -> Iterator[Topology]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    with Topology(HOSTS) as topo:
        yield topo


@pytest.fixture(scope="module")
def infra(topology: Topology) -> Iterator[dict[str, str]]:
    """etcd and NATS, each on its host: the environment every process of the fleet gets."""
    etcd_host, nats_host = topology["etcd"], topology["nats"]
    with EtcdServer(host=etcd_host.address, command_prefix=etcd_host.prefix) as etcd, \
            NatsServer(host=nats_host.address, command_prefix=nats_host.prefix, config=NATS_CONFIG) as nats:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url}


@pytest.fixture
def fleet(topology: Topology, infra: dict[str, str], tiny_model: Path, tmp_path: Path) -> Iterator[Fleet]:
    args_file = tmp_path / "mocker.json"
    # about 40 ms a token: a stream of 200 tokens is still running when a test cuts its worker's cable
    args_file.write_text('{"num_gpu_blocks": 512, "block_size": %d, "speedup_ratio": 0.5}' % BLOCK_SIZE)
    f = Fleet(topology, infra, tiny_model, args_file)
    try:
        yield f
    finally:
        f.stop()
        topology.heal_all()
