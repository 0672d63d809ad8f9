"""``--disaggregation-mode``: the role a worker plays for its model."""

from __future__ import annotations

import enum

from dynamo.errors import UserError


class DisaggregationMode(enum.Enum):
    """``agg`` prefills and decodes (the default); ``prefill`` only prefills and hands the KV state over
    (registers as ``ModelType.Prefill``); ``decode`` decodes, importing the state when a prefill worker
    made it, prefilling itself otherwise (as ``agg`` does; it is the same worker, named for clarity)."""

    AGG = "agg"
    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def parse(cls, value: "DisaggregationMode | str | None") -> "DisaggregationMode":
        if value is None:
            return cls.AGG
        if isinstance(value, DisaggregationMode):
            return value
        for m in cls:
            if m.value == str(value).lower():
                return m
        raise UserError(f"--disaggregation-mode must be one of {[m.value for m in cls]}, not {value!r}")
