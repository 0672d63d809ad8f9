"""The connector seam: how a decision (so many prefill and decode workers) becomes workers.

``local`` (:mod:`.local_connector`) runs worker processes on this machine; ``virtual``
(:mod:`.virtual_connector`) hands decisions to an outside orchestrator through the discovery store.  The
planner sees only this Protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

PREFILL = "prefill"
DECODE = "decode"
POOLS = (PREFILL, DECODE)


@dataclass(frozen=True, slots=True)
class PoolState:
    """A pool's workers: serving, on their way (started, not yet serving), leaving (draining)."""

    ready: int = 0
    starting: int = 0
    draining: int = 0

    @property
    def coming(self) -> int:
        """Capacity the planner counts: a starting worker will serve soon, so it is not started twice."""
        return self.ready + self.starting


@dataclass(frozen=True, slots=True)
class FleetState:
    prefill: PoolState
    decode: PoolState

    def pool(self, name: str) -> PoolState:
        return self.prefill if name == PREFILL else self.decode


class Connector(Protocol):
    """Makes the fleet the size the planner decides."""

    async def start(self) -> FleetState:
        """Take charge: find (adopt) the workers already running; the fleet as found."""
        ...

    async def fleet(self) -> FleetState: ...

    async def scale(self, prefill: int, decode: int) -> bool:
        """Ask for this many workers per pool; False when the request could not be made now (the virtual
        connector's orchestrator has not acknowledged the previous one)."""
        ...

    async def close(self) -> None: ...
