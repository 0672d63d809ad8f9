"""``<prefix>_model_*``: each served model's limits, as Dynamo 1.6.1's frontend exports them.

Read when /metrics is scraped (nothing per request): ``context_length``, ``kv_cache_block_size`` and
``migration_limit`` from the model's card, ``total_kv_blocks``, ``max_num_seqs`` and
``max_num_batched_tokens`` from its first worker's ``runtime_config`` (absent when the worker does not
say), and ``model_ready``: 1 while the model has an instance to send a request to.  Label ``model``
(lowercased, as on every frontend series).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

# gauge suffix -> help; the keys of ModelLimits.values
LIMITS = {
    "context_length": "Most tokens (prompt and output) a request of the model may hold",
    "kv_cache_block_size": "Tokens per KV cache block of the model's workers",
    "migration_limit": "Times a request of the model may move to another worker (the worker's card)",
    "total_kv_blocks": "KV cache blocks of the model's worker (its runtime_config)",
    "max_num_seqs": "Most requests the model's worker runs at once (its runtime_config)",
    "max_num_batched_tokens": "Most tokens the model's worker batches in one step (its runtime_config)",
}
RUNTIME_CONFIG_KEYS = ("total_kv_blocks", "max_num_seqs", "max_num_batched_tokens")


@dataclass
class ModelLimits:
    """What the model_* gauges show of one served model."""

    values: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, card: Any, runtime_config: dict[str, Any] | None) -> "ModelLimits":
        values: dict[str, float] = {"context_length": card.context_length,
                                    "kv_cache_block_size": card.kv_cache_block_size,
                                    "migration_limit": card.migration_limit}
        rc = runtime_config or {}
        for key in RUNTIME_CONFIG_KEYS:
            value = rc.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[key] = value
        return cls(values)


class ModelLimitsCollector:
    """The model_* gauges; ``models()`` gives (model name, its limits, whether it has an instance now)."""

    def __init__(self, models: Callable[[], Iterable[tuple[str, ModelLimits, bool]]], prefix: str) -> None:
        self.models = models
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        families = {key: GaugeMetricFamily(f"{self.prefix}_model_{key}", doc, labels=["model"])
                    for key, doc in LIMITS.items()}
        ready = GaugeMetricFamily(f"{self.prefix}_model_ready", "1 while the model has a worker to send to",
                                  labels=["model"])
        for name, limits, has_instance in sorted(self.models(), key=lambda m: m[0]):
            model = name.lower()
            for key, value in limits.values.items():
                families[key].add_metric([model], value)
            ready.add_metric([model], 1.0 if has_instance else 0.0)
        yield from families.values()
        yield ready
