"""``out=sglang``: SGLang's offline ``sgl.Engine`` in this process, token ids in and token ids out.

**Not run on the project's machines**: SGLang needs CUDA (``sgl_kernel`` loads libcuda).  The argument
mapping and the request/response conversion are pure functions below, unit-tested with objects shaped
like SGLang's (tests/unit/engines/test_engine_args.py); the engine class is a thin shell around them.

* The engine is built with ``skip_tokenizer_init=True`` (our pre-processor tokenizes, our post-processor
  detokenizes and applies stop strings) and ``incremental_streaming_output=True`` (each streamed item
  carries only the new ``output_ids``; a cumulative stream is handled too if an extra argument turns it
  off).
* Requests: ``async_generate(input_ids=..., sampling_params={...}, stream=True, rid=...)``; a request
  whose consumer stops is aborted with ``tokenizer_manager.abort_request(rid)``.
* Arguments (``ServerArgs`` fields), in increasing precedence: ``model_path``, ``tp_size``
  (``--tensor-parallel-size``, the total over all nodes), ``nnodes``/``node_rank``/``dist_init_addr``
  (``--num-nodes``/``--node-rank``/``--leader-addr``), ``base_gpu_id``, ``context_length``,
  ``page_size`` (``--kv-cache-block-size``), then ``--extra-engine-args`` JSON (any ``ServerArgs``
  field; unknown keys are rejected by SGLang's own ``ServerArgs``).
* Multi-node as the seeds describe: the leader (rank 0) runs ``dynamo-run in=... out=sglang
  --num-nodes N --node-rank 0 --leader-addr HOST:PORT``; each follower either runs ``dynamo-run in=none
  out=sglang ... --node-rank R`` (the engine starts its schedulers and serves nothing) or SGLang's own
  ``python -m sglang.launch_server ... --dist-init-addr HOST:PORT --nnodes N --node-rank R``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
from contextlib import aclosing
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

from dynamo.engines.off_loop import run_off_loop_with_signals
from dynamo.engines.token_engine_common import (
    common_sampling_params,
    engine_start_errors,
    guided_decoding,
    one_line,
    relay_outputs,
    stop_finish_reason,
)
from dynamo.errors import EngineError, UserError
from dynamo.kv.engine_sources import (
    PublishesEngineKvEvents,
    SglangKvEvents,
    serves_router,
    sglang_kv_events_wanted,
)
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.common import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    EngineOutput,
    PreprocessedRequest,
)
from dynamo.run_config import RunConfig

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install sglang (SGLang needs an NVIDIA GPU with CUDA)"


def engine_args(cfg: RunConfig, card: ModelCard, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``sgl.Engine(**kwargs)`` for this run: the flags, then ``--extra-engine-args`` on top."""
    if card.gguf_path is not None:
        model = str(card.gguf_path)
    elif card.path is not None:
        model = str(card.path)
    else:
        raise UserError("out=sglang needs a model: a Hugging Face folder or repo id")
    args: dict[str, Any] = {
        "model_path": model,
        "skip_tokenizer_init": True,
        "incremental_streaming_output": True,
        "tp_size": int(cfg.tensor_parallel_size or 1),
    }
    if card.gguf_path is not None and card.path is not None and Path(card.path).is_dir():
        args["tokenizer_path"] = str(card.path)
    num_nodes = int(cfg.num_nodes or 1)
    if num_nodes > 1:
        args["nnodes"] = num_nodes
        args["node_rank"] = int(cfg.node_rank or 0)
    if cfg.leader_addr:
        args["dist_init_addr"] = cfg.leader_addr
    base = int(cfg.base_gpu_id or 0)
    if base:
        args["base_gpu_id"] = base
    if cfg.context_length is not None:
        args["context_length"] = int(cfg.context_length)
    if cfg.kv_cache_block_size is not None:
        args["page_size"] = int(cfg.kv_cache_block_size)
    if extra:
        args.update(extra)
    return args


def sampling_params(request: PreprocessedRequest) -> dict[str, Any]:
    """SGLang's ``sampling_params`` dict for a pre-processed request.

    Stop strings stay with our post-processor (SGLang cannot match text without its tokenizer); EOS ids
    (unless ``ignore_eos``) and the request's stop token ids go to SGLang.
    """
    sc, so = request.stop_conditions, request.sampling_options
    params: dict[str, Any] = {}
    if sc.max_tokens is not None:
        params["max_new_tokens"] = int(sc.max_tokens)
    if sc.min_tokens:
        params["min_new_tokens"] = int(sc.min_tokens)
    params.update(common_sampling_params(request, "sglang"))
    if so.top_k is not None and so.top_k > 0:  # SGLang's default (-1) is all tokens: leave it
        params["top_k"] = int(so.top_k)
    if so.seed is not None:
        params["sampling_seed"] = int(so.seed)
    # SGLang takes one constraint, under its own names: the first of json, regex, grammar, choice
    guided = guided_decoding(so.guided_decoding) or {}
    if guided.get("json") is not None:
        schema = guided["json"]
        import json

        params["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
    elif guided.get("regex") is not None:
        params["regex"] = guided["regex"]
    elif guided.get("grammar") is not None:
        params["ebnf"] = guided["grammar"]
    elif guided.get("choice"):
        params["regex"] = "(" + "|".join(_regex_escape(c) for c in guided["choice"]) + ")"
    return params


def _regex_escape(text: str) -> str:
    import re

    return re.escape(str(text))


def finish_reason(reason: Any, eos_token_ids: list[int] | tuple[int, ...]) -> Any:
    """SGLang's ``meta_info["finish_reason"]`` (a dict, or None while running) -> ours."""
    if reason is None:
        return None
    if isinstance(reason, str):
        reason = {"type": reason}
    kind = reason.get("type")
    if kind == "stop":
        return stop_finish_reason(reason.get("matched"), eos_token_ids)
    if kind == "length":
        return FINISH_LENGTH
    if kind == "abort":
        status = reason.get("status_code")
        message = reason.get("message") or "aborted"
        if status is not None and int(status) >= 400:
            return {"error": f"SGLang: {message}"}
        return FINISH_CANCELLED
    return {"error": f"SGLang finished the request with {reason!r}"}


class OutputConverter:
    """SGLang's streamed dicts -> our :class:`EngineOutput`s, for incremental or cumulative streams."""

    def __init__(self, eos_token_ids: list[int] | tuple[int, ...], *, incremental: bool = True):
        self.eos = tuple(eos_token_ids)
        self.incremental = incremental
        self.seen = 0
        self._cached_reported = False

    def convert(self, item: Mapping[str, Any]) -> EngineOutput:
        ids = [int(t) for t in item.get("output_ids") or []]
        if not self.incremental:
            ids, self.seen = ids[self.seen:], max(self.seen, len(ids))
        meta = item.get("meta_info") or {}
        reason = finish_reason(meta.get("finish_reason"), self.eos)
        # ``meta_info["cached_tokens"]``: prompt tokens SGLang's radix cache served; reported once
        cached = meta.get("cached_tokens")
        if self._cached_reported or isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            cached = None
        else:
            self._cached_reported = True
        return EngineOutput(token_ids=ids, finish_reason=reason, cached_tokens=cached)


class SglangEngine(PublishesEngineKvEvents):
    kind = "core"
    guided_decoding = True  # sampling_options.guided_decoding -> structured outputs

    def __init__(self, cfg: RunConfig, card: ModelCard, extra: Mapping[str, Any] | None = None,
                 extra_path: Path | None = None):
        self.cfg = cfg
        self.card = card
        self.args = engine_args(cfg, card, extra)
        self.extra_path = extra_path
        self.follower = int(self.args.get("node_rank", 0) or 0) > 0
        self.incremental = bool(self.args.get("incremental_streaming_output", False))
        self._engine: Any = None
        self._ids = itertools.count()
        # KV events for a KV router (a dyn:// worker with the radix cache; engine_kv_events.py)
        self._kv: Any = None
        why_not = sglang_kv_events_wanted(cfg, self.args, extra)
        if why_not is None:
            self._kv = SglangKvEvents(card.kv_cache_block_size)
        elif serves_router(cfg):
            log.info("sglang: no KV events for the router: %s", why_not)

    async def start(self) -> None:
        if self.follower:
            # followers: start the schedulers and return, instead of blocking inside sgl.Engine()
            os.environ.setdefault("SGLANG_BLOCK_NONZERO_RANK_CHILDREN", "0")
        try:
            import sglang
        except ImportError as e:
            raise UserError(f"out=sglang cannot import SGLang ({one_line(e)}): {INSTALL_HINT}") from None
        log.info("starting SGLang for %s", self.card.display_name)
        if self._kv is not None:
            try:
                self._kv.configure(self.args, self.card.kv_cache_block_size)
            except ImportError:  # pragma: no cover - pyzmq comes with SGLang
                log.warning("sglang: pyzmq is missing: no KV events for the router")
                self._kv = None
        where = f"--extra-engine-args {self.extra_path}: " if self.extra_path else ""
        with engine_start_errors("SGLang", where):
            # built in a thread so the loop (lease keep-alive, NATS) keeps running during a long load; the
            # signal handlers SGLang installs meanwhile are installed on the main thread for it
            self._engine = await run_off_loop_with_signals(lambda: sglang.Engine(**self.args))
        tm = getattr(self._engine, "tokenizer_manager", None)
        if tm is not None:
            _keep_our_sigterm(tm)
            context_len = getattr(tm, "context_len", None)
            if context_len:
                self.card.context_length = int(context_len)
        page = self.args.get("page_size")
        if page:
            self.card.kv_cache_block_size = int(page)
        if self._kv is not None:
            self._kv.set_block_size(self.card.kv_cache_block_size)
            self._kv.start()

    async def close(self) -> None:
        kv, self._kv = self._kv, None
        if kv is not None:
            await kv.close()
        engine, self._engine = self._engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        engine = self._engine
        if engine is None or getattr(engine, "tokenizer_manager", None) is None:
            if self.follower:
                raise EngineError(f"this node (rank {self.args.get('node_rank')}) runs SGLang schedulers for the "
                                  f"leader at {self.args.get('dist_init_addr')}; send requests to the leader")
            raise EngineError("sglang engine is not started")
        try:
            params = sampling_params(request)
        except UserError as e:
            raise EngineError(str(e)) from None
        rid = f"{context.id}-{next(self._ids)}"
        converter = OutputConverter(request.eos_token_ids or self.card.eos_token_ids, incremental=self.incremental)
        stream = await engine.async_generate(input_ids=list(request.token_ids), sampling_params=params,
                                             stream=True, rid=rid)
        # abort: by request id, through the tokenizer manager (a plain call)
        async with aclosing(relay_outputs(stream, converter.convert, context,
                                          lambda: engine.tokenizer_manager.abort_request(rid), engine="SGLang",
                                          log=log, tag="sglang", request_id=rid)) as items:
            async for item in items:
                yield item


def _keep_our_sigterm(tokenizer_manager: Any) -> None:
    """SGLang's tokenizer manager puts its own SIGTERM handler on our event loop at the first request.

    Ours (drain the HTTP server, revoke the etcd lease) must keep working: SGLang's SIGTERM handler is
    replaced by one that raises SIGINT, which dynamo-run handles exactly like SIGTERM.  Its SIGQUIT
    handler (a child process died) stays.
    """
    base = getattr(tokenizer_manager, "signal_handler_class", None)
    if base is None:
        return

    class _ForwardSigterm(base):  # type: ignore[misc, valid-type]
        def sigterm_handler(self, signum: Any = None, frame: Any = None) -> None:
            signal.raise_signal(signal.SIGINT)

    tokenizer_manager.signal_handler_class = _ForwardSigterm


def create(cfg: RunConfig, card: ModelCard, extra: Mapping[str, Any] | None, extra_path: Path | None) -> SglangEngine:
    return SglangEngine(cfg, card, extra, extra_path)
