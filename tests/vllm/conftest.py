"""Fixtures of the vLLM tier: real etcd and NATS for the tests that run vLLM workers behind a frontend."""

from __future__ import annotations

from typing import Iterator

import pytest

from harness.servers import EtcdServer, NatsServer


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    """One etcd and one nats-server per test module, as the environment a worker and a frontend need."""
    with EtcdServer() as etcd, NatsServer() as nats_srv:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url}
