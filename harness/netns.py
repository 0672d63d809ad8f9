"""Hosts on one machine: Linux network namespaces on a private switch, for fleets that span machines.

Every fleet test on loopback shares one address and one port space, so a worker that advertises the
wrong address or binds the wrong interface still works there, and a peer can only die (a reset, a FIN),
never vanish. A :class:`Topology` gives each host a network namespace of its own (``dynt-<id>-<host>``),
its loopback up and one interface ``eth0`` with an address from a private /24 (``10.77.X.0/24``, ``X``
chosen per topology among those no route of this machine covers), all joined by a bridge in a namespace
of their own (the switch). The test process keeps a leg on the switch (``10.77.X.254``) so it can reach
the hosts, and sends traffic to nothing but those addresses.

Partitions are silent, like a cut cable: nothing is refused or reset, packets just vanish.

* :meth:`Topology.cut` takes a host's port off the switch (``ip link set ... nomaster``): both ends of
  its cable stay up (no carrier change its kernel could report), and its frames reach nobody.
* :meth:`Topology.cut_between` cuts two hosts from each other only: each one's neighbour entry for the
  other names a MAC address no interface has, so the switch floods the frames and every host drops them.

(``tc netem`` and nftables would do it too, but this machine's kernel has neither; the bridge and the
neighbour table are in every kernel that has namespaces.)

Processes run in a host with ``ip netns exec <ns> <command>`` (:meth:`Host.prefix`); ``ip`` execs the
command, so its pid is the process's own. :meth:`Topology.close` kills what is left in the namespaces
(only this topology's: they were created here) and deletes them, and the test process's leg.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import Self, Sequence

__all__ = ["Host", "Topology", "netns_unavailable"]

SUBNET_BASE = "10.77"
CLIENT_OCTET = 254
BLACKHOLE_MAC = "02:00:00:00:de:ad"  # locally administered; no interface of a topology has it


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {result.stderr.strip()}")
    return result


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (the reason a test skips with), or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"dynt-probe-{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    try:
        bridge = _ip("link", "add", "br0", "type", "bridge", ns=probe, check=False)
        if bridge.returncode != 0:
            return f"no bridge in a namespace: {bridge.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _free_subnet() -> int:
    """A third octet X such that no route of this machine overlaps 10.77.X.0/24."""
    routes = _ip("-4", "route", "show", "table", "all").stdout.splitlines()
    taken = []
    for line in routes:
        word = line.split()[0] if line.split() else ""
        if word in ("broadcast", "local", "unicast") and len(line.split()) > 1:
            word = line.split()[1]
        try:
            taken.append(ipaddress.ip_network(word, strict=False))
        except ValueError:  # "default" and the like
            continue
    candidates = list(range(1, 250))
    random.shuffle(candidates)
    for x in candidates:
        net = ipaddress.ip_network(f"{SUBNET_BASE}.{x}.0/24")
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return x
    raise RuntimeError(f"no free /24 under {SUBNET_BASE}.0.0/16 on this machine")


@dataclass
class Host:
    """One host of a :class:`Topology`: its namespace, its address, its port on the switch."""

    name: str
    ns: str
    address: str
    mac: str
    switch_port: str

    @property
    def prefix(self) -> list[str]:
        """What runs a command on this host: ``ip netns exec <ns>``."""
        return ["ip", "netns", "exec", self.ns]


class Topology:
    """Hosts named ``names`` on one switch (see the module docstring). A context manager: ``close`` runs
    on the way out whatever happened, so no namespace outlives its test."""

    def __init__(self, names: Sequence[str]) -> None:
        self.id = uuid.uuid4().hex[:6]
        self.names = list(names)
        self.hosts: dict[str, Host] = {}
        self.switch = f"dynt-{self.id}-sw"
        self.client_link = f"dt{self.id}c"  # the test process's leg, in this (the root) namespace
        self.subnet = 0
        self._cut_pairs: set[tuple[str, str]] = set()

    @property
    def client_address(self) -> str:
        return f"{SUBNET_BASE}.{self.subnet}.{CLIENT_OCTET}"

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def open(self) -> Self:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        self.subnet = _free_subnet()
        _ip("netns", "add", self.switch)
        _ip("link", "set", "lo", "up", ns=self.switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for i, name in enumerate(self.names, start=1):
            ns = f"dynt-{self.id}-{name}"
            port = f"p{i}"
            address = f"{SUBNET_BASE}.{self.subnet}.{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("link", "set", port, "master", "br0", ns=self.switch)
            _ip("link", "set", port, "up", ns=self.switch)
            _ip("link", "set", "lo", "up", ns=ns)
            _ip("addr", "add", f"{address}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            mac = _ip("-br", "link", "show", "eth0", ns=ns).stdout.split()[2]
            self.hosts[name] = Host(name, ns, address, mac, port)
        # the test process's leg: created in the switch, one end moved here
        _ip("link", "add", "c0", "type", "veth", "peer", "name", self.client_link, ns=self.switch)
        _ip("link", "set", self.client_link, "netns", "1", ns=self.switch)
        _ip("link", "set", "c0", "master", "br0", ns=self.switch)
        _ip("link", "set", "c0", "up", ns=self.switch)
        _ip("addr", "add", f"{self.client_address}/24", "dev", self.client_link)
        _ip("link", "set", self.client_link, "up")

    # -- partitions --------------------------------------------------------------------------------

    def cut(self, name: str) -> None:
        """Host ``name`` off the switch: from now on whatever it sends, and whatever is sent to it, vanishes."""
        _ip("link", "set", self.hosts[name].switch_port, "nomaster", ns=self.switch)

    def heal(self, name: str) -> None:
        """Host ``name`` back on the switch."""
        _ip("link", "set", self.hosts[name].switch_port, "master", "br0", ns=self.switch)
        _ip("link", "set", self.hosts[name].switch_port, "up", ns=self.switch)

    def cut_between(self, a: str, b: str) -> None:
        """``a`` and ``b`` no longer reach each other (both directions); every other path stays."""
        for src, dst in ((a, b), (b, a)):
            _ip("neigh", "replace", self.hosts[dst].address, "lladdr", BLACKHOLE_MAC, "dev", "eth0",
                "nud", "permanent", ns=self.hosts[src].ns)
        self._cut_pairs.add((a, b))

    def heal_between(self, a: str, b: str) -> None:
        for src, dst in ((a, b), (b, a)):
            _ip("neigh", "replace", self.hosts[dst].address, "lladdr", self.hosts[dst].mac, "dev", "eth0",
                "nud", "reachable", ns=self.hosts[src].ns)
        self._cut_pairs.discard((a, b))

    def heal_all(self) -> None:
        """Every host back on the switch and every pair cut by :meth:`cut_between` healed: what a test
        that failed half-way leaves to the next one is no cut."""
        for name in self.names:
            self.heal(name)
        for a, b in list(self._cut_pairs):
            self.heal_between(a, b)

    # -- teardown ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill what still runs in this topology's namespaces, delete them and the test process's leg."""
        for ns in [h.ns for h in self.hosts.values()] + [self.switch]:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        _ip("link", "del", self.client_link, check=False)
        for host in self.hosts.values():
            _ip("netns", "del", host.ns, check=False)
        for name in self.names:  # a host whose build failed half-way
            _ip("netns", "del", f"dynt-{self.id}-{name}", check=False)
        _ip("netns", "del", self.switch, check=False)

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
