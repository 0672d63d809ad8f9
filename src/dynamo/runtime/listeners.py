"""Where this process's internal listeners are, said once at start-up, and a warning when any of them is
reachable from other machines.

Why: without a fleet secret the request plane, the response streams, the ZMQ publisher and the status
server take no credentials (the HTTP frontend's API key guards only the frontend), so whoever reaches one
can send a worker requests past the frontend, or read every KV event (block hashes of every user's
prompts). On one machine they listen on loopback (:func:`~dynamo.runtime.tcp.listen_hosts`); a fleet
across machines has to open them, and the operator should know what that exposes and what closes it:
``DYN_FLEET_SECRET`` authenticates the first three (:mod:`.fleet_auth`), never the status server.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tcp import ListenHosts, is_loopback

# what a stranger who reaches each listener gets, for the warning
_EXPOSES = {
    "requests": "send this process requests past the frontend's API key",
    "response streams": "forge tokens in the response streams it receives",
    "events": "read its KV events (block hashes of users' prompts)",
    "status": "read its health and metrics",
}
AUTHENTICATED = frozenset(("requests", "response streams", "events"))  # by the fleet secret, when set
TCP_PLANES = frozenset(("requests", "response streams"))  # by mutual TLS (DYN_TCP_TLS_CLIENT_CA_CERT_PATH), when set


@dataclass(frozen=True, slots=True)
class Listener:
    name: str  # a key of _EXPOSES
    host: str
    port: int = 0  # 0: chosen when it starts (the request plane's, at the first endpoint served)

    def __str__(self) -> str:
        where = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.name} {where}:{self.port}" if self.port else f"{self.name} {where}"


def listeners_line(listeners: list[Listener], hosts: ListenHosts, *, authenticated: bool = False,
                   tls: str = "") -> str:
    """The start-up line's part that says where each plane listens (empty when none does), whether
    the fleet secret guards them, and ``tls``: what TLS the TCP planes have (empty: none)."""
    if not listeners:
        return ""
    if all(is_loopback(x.host) for x in listeners):
        scope = "loopback only"
    else:
        scope = "reachable from other machines"
    secret = "; fleet secret on" if authenticated else ""
    tls = f"; {tls}" if tls else ""
    return f"; listening: {', '.join(map(str, listeners))} ({scope}; {hosts.why}{secret}{tls})"


def exposure_warning(listeners: list[Listener], *, authenticated: bool = False,
                     mutual_tls: bool = False) -> str | None:
    """One line naming the listeners other machines can reach without a credential and what that gives
    them; None when there is none (every one on loopback, guarded by the fleet secret, or the TCP planes by
    mutual TLS)."""
    exposed = [x for x in listeners if not is_loopback(x.host) and not (authenticated and x.name in AUTHENTICATED)
               and not (mutual_tls and x.name in TCP_PLANES)]
    if not exposed:
        return None
    gains = list(dict.fromkeys(_EXPOSES[x.name] for x in exposed))
    what = gains[0] if len(gains) == 1 else f"{', '.join(gains[:-1])} and {gains[-1]}"
    if any(x.name in AUTHENTICATED for x in exposed):
        fix = ("set DYN_FLEET_SECRET (the same on every process of the fleet) to authenticate the planes, admit "
               "only the fleet's machines with a firewall, or on one machine set DYN_TCP_RPC_HOST=127.0.0.1")
    else:  # the status server only: the secret does not guard it
        fix = "admit only the fleet's machines with a firewall, or set DYN_SYSTEM_HOST=127.0.0.1"
    return (f"internal listeners reachable from other machines ({', '.join(map(str, exposed))}) have no "
            f"authentication: anyone who reaches them can {what}; {fix} (docs/security.md)")
