"""What a prefill worker's answer hands to the decode request (``disaggregated_params``).

Two kinds, told apart by their keys:

* a :class:`~.transfer.Ticket` (llamacpp, the mocker): where our transfer server keeps the exported state;
* :class:`EngineParams`: an engine's own connector parameters, passed through untouched (vLLM's
  ``kv_transfer_params``: the prefill request asked ``do_remote_decode``, vLLM answered where its
  connector holds the blocks, e.g. NixlConnector's ``remote_engine_id``/``remote_block_ids``/host/port;
  the decode request carries them back to vLLM, which pulls the blocks itself).  Empty (or null) is
  what connectors that share a store keyed by content return (vLLM's ExampleConnector, LMCache): there is
  nothing to carry, and the decode worker's connector finds the blocks by the prompt.

Anything else is malformed: the frontend prefills locally (plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .transfer import Ticket, TransferError

KV_TRANSFER_PARAMS = "kv_transfer_params"


@dataclass(frozen=True)
class EngineParams:
    kv_transfer_params: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {KV_TRANSFER_PARAMS: dict(self.kv_transfer_params)}


HandOver = Ticket | EngineParams


def parse_hand_over(d: Any) -> HandOver:
    """A prefill answer's ``disaggregated_params`` -> Ticket or EngineParams; TransferError if neither."""
    if isinstance(d, dict) and KV_TRANSFER_PARAMS in d:
        params = d[KV_TRANSFER_PARAMS]
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise TransferError(f"malformed {KV_TRANSFER_PARAMS}: {params!r}")
        return EngineParams(params)
    if not isinstance(d, dict):
        raise TransferError(f"malformed KV hand-over: {d!r}")
    return Ticket.from_dict(d)
