"""``out=mocker``: a simulated vLLM engine for testing and benchmarking routing (see docs/routing.md)."""

from dynamo.engines.mocker.args import MockerArgs
from dynamo.engines.mocker.engine import DEFAULT_MAX_TOKENS, MockerEngine, create_mocker
from dynamo.engines.mocker.kv_manager import Block, KvManager
from dynamo.engines.mocker.scheduler import MockRequest, Scheduler, decode_time_ms, prefill_time_ms

__all__ = ["MockerArgs", "DEFAULT_MAX_TOKENS", "MockerEngine", "create_mocker", "Block", "KvManager",
           "MockRequest", "Scheduler", "decode_time_ms", "prefill_time_ms"]
