"""The KV router's decision log: one JSON line per routing decision, KV event and request milestone,
opt-in (``DYN_ROUTER_LOG=PATH`` on a frontend), for finding out *why* a request went where it went.

A TTFT tail under ``--router-mode kv`` has few possible causes: the router did not know a prefix was
cached (its KV event came after the next request of that prefix was routed), it knew but the worker was
busy, or the worker did not reuse what it reported.  Telling them apart needs, per request, what the
router saw at the moment it decided and when the events arrived relative to that moment; the debug log
line has the costs but neither the in-flight shares nor the event times.  So each line carries the
router's own monotonic clock (``t``, seconds), and ``benchmarks/router/decisions.py`` joins them:

* ``{"t", "ev": "route", "id", "worker", "isl", "blocks": [sequence hashes of the complete blocks], "candidates": {<worker hex>:
  {"overlap", "inflight", "prefill", "decode", "logit", "active_tokens", "active_blocks", "requests"}}}``:
  ``overlap`` is the cached prefix the indexer knew of (blocks), ``inflight`` the prefix shared with
  requests in flight there (routed, not yet finished), the rest the cost terms and the load;
* ``{"t", "ev": "stored" | "removed" | "cleared", "worker", "tier", "blocks": [block hashes]}``: a KV event
  as it was applied;
* ``{"t", "ev": "first" | "done", "id"}``: the request's first token arrived; its stream ended.

Lines are written to a buffered file (a few hundred bytes each, one ``write`` system call per 64 KiB or
per half second: the frontend's router timer flushes it), so logging costs the event loop microseconds
per decision; it is meant for a benchmark or a diagnosis, not for serving at rates where even that
matters.  The file is closed with the router.  Several models on one frontend each append their own
lines to the same file (each line is written whole).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import IO, Any, Callable

import orjson

log = logging.getLogger(__name__)

ENV = "DYN_ROUTER_LOG"


class DecisionLog:
    """Append JSON lines to ``path`` (``-`` or an empty value: off)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.clock = clock
        self._file: IO[bytes] | None = open(self.path, "ab", buffering=1 << 16)  # noqa: SIM115 - closed in close()

    @classmethod
    def from_env(cls) -> DecisionLog | None:
        """The log ``DYN_ROUTER_LOG`` names, or None.  A path that cannot be opened is a one-line warning,
        not a failed frontend: the log is a diagnosis aid."""
        raw = os.environ.get(ENV, "").strip()
        if not raw or raw == "-":
            return None
        try:
            return cls(raw)
        except OSError as e:
            log.warning("%s=%s: cannot open the router decision log: %s", ENV, raw, e.strerror or e)
            return None

    def write(self, record: dict[str, Any]) -> None:
        f = self._file
        if f is None:
            return
        record.setdefault("t", round(self.clock(), 6))
        f.write(orjson.dumps(record) + b"\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()
