"""A fleet across hosts on one machine (harness/netns.py): etcd and nats-server on a host of their own
(``infra``), two worker hosts (``w1``, ``w2``) and a frontend host (``fe``), each a network namespace with
its own address. The module is skipped, with the reason, where namespaces cannot be made (not root, no
``ip``); every namespace a test made is gone after it, whatever happened."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from harness.fleet import WORKER_LOG
from harness.netns import Topology, netns_unavailable
from harness.proc import DynamoRun, DynamoWorker, cli_command
from harness.servers import EtcdServer, NatsServer

BLOCK_SIZE = 16


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/netns/" in str(item.fspath):
            item.add_marker(pytest.mark.netns)


@pytest.fixture(scope="module")
def topology() -> Iterator[Topology]:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    with Topology(["infra", "w1", "w2", "fe"]) as topo:
        yield topo


@pytest.fixture(scope="module")
def infra(topology: Topology) -> Iterator[dict[str, str]]:
    """etcd and NATS on the infra host: the environment every process of the fleet gets."""
    host = topology["infra"]
    with EtcdServer(host=host.address, command_prefix=host.prefix) as etcd, \
            NatsServer(host=host.address, command_prefix=host.prefix) as nats:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url}


class Fleet:
    """Start workers and frontends on the topology's hosts with the settings docs/runtime.md tells a user
    to set on each machine (``DYN_TCP_RPC_HOST``: the host's own address); all stopped at the end."""

    def __init__(self, topology: Topology, env: dict[str, str], model: Path, args_file: Path) -> None:
        self.topology = topology
        self.env = env
        self.model = model
        self.args_file = args_file
        self.started: list[DynamoWorker | DynamoRun] = []

    def host_env(self, host: str, **extra: str) -> dict[str, str]:
        return {**self.env, "DYN_TCP_RPC_HOST": self.topology[host].address, **extra}

    def worker(self, host: str, endpoint: str, model: str, *, env: dict[str, str] | None = None) -> DynamoWorker:
        w = DynamoWorker(f"in=dyn://{endpoint}", "out=mocker", str(self.model), "--model-name", model,
                         "--extra-engine-args", str(self.args_file),
                         env=env if env is not None else self.host_env(host, **WORKER_LOG),
                         command=[*self.topology[host].prefix, *cli_command()])
        self.started.append(w)
        return w.start()

    def frontend(self, *flags: str, host: str = "fe", env: dict[str, str] | None = None) -> DynamoRun:
        fe = DynamoRun("out=dyn", *flags, env=env if env is not None else self.host_env(host),
                       host=self.topology[host].address, command_prefix=self.topology[host].prefix)
        self.started.append(fe)
        return fe.start()

    def stop(self) -> None:
        for p in reversed(self.started):
            p.kill()


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
        for name in ("w1", "w2", "fe", "infra"):  # a test that failed half-way leaves no cut behind
            topology.heal(name)
        for a, b in (("w1", "infra"), ("w2", "infra"), ("fe", "w1"), ("fe", "w2")):
            topology.heal_between(a, b)
