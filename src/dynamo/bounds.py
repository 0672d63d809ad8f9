"""The structures a serving process keeps across requests, by name, with their sizes: what
``/debug/memory`` (frontend/http/debug_memory.py) reports and what the memory test checks return to
their baseline after load (tests/integration/test_memory_bounded.py).

Why a registry: a frontend that grew 1.6 KB per request (59 MB -> 115 MB in 900 s of unique prompts) grew in
structures spread over the router, the KV index, the HTTP routes and the runtime; each one that lives
across requests names itself here once, with how to measure it, so a leak shows as a name and a number
rather than as RSS.  Owners are held weakly (a model removed takes its router's entries with it).
Registering costs one list append per owner; nothing here is on the request path.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

_tracked: list[tuple[str, "weakref.ref[Any]", Callable[[Any], int]]] = []


def track(name: str, owner: object, size: Callable[[Any], int]) -> None:
    """Report ``size(owner)`` under ``name`` while ``owner`` lives (summed over owners of one name)."""
    _tracked.append((name, weakref.ref(owner), size))


def sizes() -> dict[str, int]:
    """The current size of every tracked structure, by name (owners that are gone are dropped)."""
    out: dict[str, int] = {}
    alive = []
    for entry in _tracked:
        name, ref, size = entry
        owner = ref()
        if owner is None:
            continue
        alive.append(entry)
        out[name] = out.get(name, 0) + int(size(owner))
    _tracked[:] = alive
    return out
