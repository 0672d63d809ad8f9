"""A worker's capacity at the targets, read from a ``dynamo-planner profile`` result
(:mod:`dynamo.planner.profile_data`), as the sizing math asks for it (:class:`~.sizing.WorkerCapacity`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dynamo.errors import UserError

log = logging.getLogger(__name__)


class ProfileCapacity:
    def __init__(self, profile: Any) -> None:
        self.profile = profile
        self.warned_ttft = False

    @classmethod
    def load(cls, directory: Path) -> "ProfileCapacity":
        from dynamo.planner.profile_data import WorkerProfile

        try:
            return cls(WorkerProfile.load(directory))
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"--profile-results-dir {directory}: not a profile ({e})") from None

    def prefill_tok_s(self, ttft_ms: float, isl: float) -> float | None:
        if isl <= 0:
            return None
        if not self.warned_ttft and self.profile.ttft_ms(isl) > ttft_ms:
            log.warning("the profile's TTFT for %.0f-token prompts is over the %.0f ms target even on an idle "
                        "worker: no number of workers meets it; sizing for throughput", isl, ttft_ms)
            self.warned_ttft = True
        return float(self.profile.max_prefill_tok_s(isl))

    def decode_concurrency(self, itl_ms: float) -> float | None:
        value = self.profile.max_decode_concurrency(itl_ms)
        return float(value) if value else None
