"""The frontend's disaggregated engine: prefill worker, then decode worker, per :mod:`.plan`.

It wraps the model's ordinary :class:`~dynamo.frontend.remote.RemoteCoreEngine` (the decode workers: routing,
migration and liveness stay theirs) and, when the model has prefill workers, a second one over those
(KV-aware under ``--router-mode kv``).  The prefill request is the same pre-processed request with
``max_tokens`` 1; its answer's ``disaggregated_params`` is the KV transfer ticket, which rides on the
request to the decode worker.  Everything that goes wrong on the prefill side ends in local prefill.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, AsyncIterator, Callable

from dynamo.disagg.handover import HandOver
from dynamo.disagg.plan import DEFAULT_MAX_LOCAL_PREFILL_LENGTH, DisaggStats, serve
from dynamo.errors import EngineError
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest

log = logging.getLogger(__name__)


def decode_cached_tokens(policy: Any, token_ids: list[int]) -> int:
    """Longest cached prefix of the prompt on any decode worker, in tokens, when a KV router knows it."""
    kv = getattr(policy, "router", None)
    find = getattr(kv, "find_matches", None)
    if find is None:
        return 0
    scores = find(token_ids)
    return max(scores.values(), default=0) * int(getattr(kv, "block_size", 0) or 0)


class DisaggCoreEngine:
    """A core engine that prefills on a prefill worker when the rule says so, then decodes."""

    kind = "core"

    def __init__(self, decode: Any, prefill: Callable[[], Any | None], *,
                 max_local_prefill_length: int | None = None, stats: DisaggStats | None = None):
        self.decode = decode  # RemoteCoreEngine over the decode (Backend) workers
        self.prefill = prefill  # -> RemoteCoreEngine over the prefill workers, or None when there are none
        self.max_local_prefill_length = (DEFAULT_MAX_LOCAL_PREFILL_LENGTH if max_local_prefill_length is None
                                         else max_local_prefill_length)
        self.stats = stats or DisaggStats()

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        pf = self.prefill()
        workers = len(pf.client.instance_ids()) if pf is not None else 0
        if request.output_options.logprobs is not None:
            # logprobs need the logits the first token was sampled from (and echo the prompt's), which only
            # the engine that computes the prompt has: prefill on the decode worker
            workers = 0
        cached = decode_cached_tokens(getattr(self.decode, "router", None), request.token_ids) if workers else 0

        async def prefill(req: PreprocessedRequest) -> dict[str, Any]:
            preq = copy.deepcopy(req)
            preq.stop_conditions.max_tokens = 1
            preq.disaggregated_params = None
            pctx = Context(f"{context.id}-prefill")
            context.on_stop(lambda kind: pctx.kill() if kind == "kill" else pctx.stop_generating())
            ticket = None
            assert pf is not None  # prefill() is only called when a prefill worker was found
            async for out in pf.generate(preq, pctx):
                if out.disaggregated_params:
                    ticket = out.disaggregated_params
            if ticket is None:
                raise EngineError("the prefill worker returned no KV transfer ticket")
            return ticket

        async def decode(req: PreprocessedRequest, ticket: HandOver | None) -> AsyncIterator[EngineOutput]:
            req.disaggregated_params = ticket.to_dict() if ticket is not None else None
            async for out in self.decode.generate(req, context):
                yield out

        async for out in serve(request, prompt_tokens=len(request.token_ids), decode_cached_tokens=cached,
                               prefill_workers=workers, prefill=prefill, decode=decode,
                               max_local_prefill_length=self.max_local_prefill_length, stats=self.stats):
            yield out
