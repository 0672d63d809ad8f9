"""The pytest fixtures over harness/servers.py: real etcd and nats-server, session-scoped (starting etcd
costs ~0.5 s, and tests isolate themselves by using unique namespaces rather than fresh servers; tests that
kill a server start their own); and ``no_default_infra``, for the modules that must find none.

tests/conftest.py loads this module as a plugin (``pytest_plugins``), so every test can name the fixtures
without importing them; a module of its own so that harness/servers.py, which the benchmarks use too,
needs no pytest.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from harness.servers import EtcdServer, NatsServer, RuntimeServers


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="session")
def runtime_servers(etcd_server: EtcdServer, nats_server: NatsServer) -> RuntimeServers:
    return RuntimeServers(etcd_server, nats_server)


@pytest.fixture
def runtime_env(runtime_servers: RuntimeServers, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point ETCD_ENDPOINTS / NATS_SERVER at the test servers for one test; returns that env."""
    for key, value in runtime_servers.env.items():
        monkeypatch.setenv(key, value)
    return runtime_servers.env


@pytest.fixture(scope="module")
def no_default_infra() -> None:
    """Skip the module when an etcd or NATS answers on this machine's default ports: the zero-infrastructure
    default rule would use it, and the module would not test what it claims to.  A module opts in with
    ``pytest.mark.usefixtures("no_default_infra")`` in its ``pytestmark`` (or its fleet fixture names it);
    module-scoped, so the check comes before the module's fleet starts."""
    from harness.fleet import infra_on_default_ports  # openai and prometheus, only for the modules that ask

    if infra_on_default_ports():
        pytest.skip("an etcd or NATS answers on this machine's default ports: the default rule would use it")
