"""Retry delays with jitter, shared by everything that retries a store or a connection."""

from __future__ import annotations

import random
from typing import Iterator


def backoff_delays(first: float = 0.25, cap: float = 2.0) -> Iterator[float]:
    """Retry delays: ``first`` doubling up to ``cap``, each with +-20 % jitter (so a fleet that lost etcd
    at the same moment does not hammer it in step when it returns)."""
    delay = first
    while True:
        yield delay * random.uniform(0.8, 1.2)
        delay = min(delay * 2, cap)
