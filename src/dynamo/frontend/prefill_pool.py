"""The prefill workers of each model (``--disaggregation-mode prefill`` workers), kept apart from the
models the frontend serves: nobody sends a request to them by name.  A Backend model's engine asks the
pool for the engine over its prefill workers on every request (frontend/disagg.py) and prefills on the
decode worker while there is none.

With metrics, where each prompt was prefilled is counted in ``<prefix>_disagg_prefill``: remote (a
prefill worker), local (the decode worker; includes fallbacks), fallback (a remote prefill that failed).
"""

from __future__ import annotations

from typing import Any, Callable

from dynamo.frontend.model_builder import RemoteModel


class PrefillPool:
    def __init__(self, metrics: Any = None):
        self.served: dict[str, RemoteModel] = {}  # model name -> its prefill workers
        self._counter: Any = None
        if metrics is not None:
            from prometheus_client import Counter

            self._counter = Counter(
                f"{metrics.prefix}_disagg_prefill", "Prompts by where they were prefilled: remote (a prefill "
                "worker), local (the decode worker; includes fallbacks), fallback (a remote prefill that failed)",
                ["model", "where"], registry=metrics.registry)

    def engine(self, name: str) -> Any:
        """The engine over ``name``'s prefill workers, or None while it has none."""
        served = self.served.get(name)
        return served.engine if served is not None else None

    def stats(self, name: str) -> Callable[[str], None] | None:
        """Counts one prompt of ``name`` by where it was prefilled; None without metrics."""
        if self._counter is None:
            return None
        counter = self._counter
        return lambda kind: counter.labels(model=name, where=kind).inc()
