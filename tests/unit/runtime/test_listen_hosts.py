"""Where the internal listeners bind (runtime/tcp.py ``listen_hosts``) and what the start-up line and the
exposure warning say about them (runtime/listeners.py)."""

from __future__ import annotations

import pytest

from dynamo.runtime.listeners import Listener, exposure_warning, listeners_line
from dynamo.runtime.tcp import advertise_host, is_loopback, listen_hosts


def test_one_machine_listens_on_loopback_only() -> None:
    hosts = listen_hosts(None, one_machine=True)
    assert (hosts.bind, hosts.callhome, hosts.advertise) == ("127.0.0.1", "127.0.0.1", "127.0.0.1")
    assert hosts.loopback


def test_a_fleet_on_etcd_stays_reachable_as_before() -> None:
    hosts = listen_hosts(None, one_machine=False)
    assert hosts.bind == "0.0.0.0"
    assert hosts.callhome == hosts.advertise == advertise_host(None)
    assert not hosts.loopback


@pytest.mark.parametrize("one_machine", [True, False])
def test_dyn_tcp_rpc_host_opens_the_planes_to_that_address(one_machine: bool) -> None:
    hosts = listen_hosts("10.1.2.3", one_machine=one_machine)
    assert (hosts.bind, hosts.callhome, hosts.advertise, hosts.why) == ("10.1.2.3",) * 3 + ("DYN_TCP_RPC_HOST",)


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "*"])
def test_a_wildcard_binds_every_interface_and_advertises_a_dialable_address(wildcard: str) -> None:
    hosts = listen_hosts(wildcard, one_machine=True)
    assert hosts.bind == hosts.callhome == "0.0.0.0"
    assert hosts.advertise == advertise_host(None)  # never 0.0.0.0: another machine could not dial that


def test_is_loopback() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "example.com", ""))


def test_the_start_up_line_names_each_listener() -> None:
    hosts = listen_hosts(None, one_machine=True)
    line = listeners_line([Listener("requests", "127.0.0.1"), Listener("events", "127.0.0.1", 4567)], hosts)
    assert line == "; listening: requests 127.0.0.1, events 127.0.0.1:4567 (loopback only; one machine)"
    assert listeners_line([], hosts) == ""
    assert exposure_warning([Listener("requests", "127.0.0.1")]) is None


def test_the_warning_names_what_is_exposed_in_one_line() -> None:
    listeners = [Listener("requests", "0.0.0.0"), Listener("events", "0.0.0.0", 4567),
                 Listener("status", "127.0.0.1", 8081)]
    warning = exposure_warning(listeners)
    assert warning is not None and "\n" not in warning
    assert "(requests 0.0.0.0, events 0.0.0.0:4567)" in warning  # the loopback one is not exposed
    assert "no authentication" in warning and "past the frontend's API key" in warning
    assert "past the frontend's API key and read its KV events" in warning and "metrics" not in warning
    assert "DYN_TCP_RPC_HOST=127.0.0.1" in warning  # the fix on one machine, with etcd or without


def test_the_warning_suggests_a_fleet_secret_and_goes_once_one_guards_the_planes() -> None:
    listeners = [Listener("requests", "0.0.0.0"), Listener("response streams", "10.0.0.5"),
                 Listener("events", "0.0.0.0", 4567)]
    warning = exposure_warning(listeners)
    assert warning is not None and "set DYN_FLEET_SECRET (the same on every process of the fleet)" in warning
    assert exposure_warning(listeners, authenticated=True) is None  # the secret guards all three
    # the status server is not guarded by the secret: still named, with its own fix
    status = exposure_warning([*listeners, Listener("status", "0.0.0.0", 8081)], authenticated=True)
    assert status is not None and "(status 0.0.0.0:8081)" in status and "read its health and metrics" in status
    assert "DYN_FLEET_SECRET" not in status and "DYN_SYSTEM_HOST=127.0.0.1" in status
    hosts = listen_hosts(None, one_machine=True)
    assert listeners_line([Listener("requests", "127.0.0.1")], hosts, authenticated=True) == (
        "; listening: requests 127.0.0.1 (loopback only; one machine; fleet secret on)")


def test_a_fleet_on_etcd_whose_host_name_is_loopback_says_which_setting_it_lacks(monkeypatch) -> None:
    """A machine whose host name resolves to 127.0.0.1 (a common /etc/hosts) gives out loopback for its
    response streams: a worker on another machine would dial itself. The start-up line says so."""
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "box")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.0.1")
    hosts = listen_hosts(None, one_machine=False)
    assert hosts.advertise == "127.0.0.1"
    assert "'box' resolves to loopback" in hosts.why and "set DYN_TCP_RPC_HOST" in hosts.why
    line = listeners_line([Listener("response streams", hosts.callhome)], hosts)
    assert "set DYN_TCP_RPC_HOST to its address" in line
