"""Wire the chosen input to the chosen engine and run until done or signalled."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dynamo.engines.served_model import build_served_model, choose_engine
from dynamo.errors import ModelError, UserError
from dynamo.frontend.model_manager import ModelManager
from dynamo.llm.engine import close_engine
from dynamo.llm.model_card import ModelCard
from dynamo.llm.model_source import resolve_card
from dynamo.llm.parsers.registry import resolve as resolve_parser
from dynamo.llm.pipeline import ServedModel
from dynamo.run_config import RunConfig

if TYPE_CHECKING:
    from dynamo.frontend.http.metrics import FrontendMetrics
    from dynamo.runtime.distributed import DistributedRuntime

log = logging.getLogger(__name__)

async def run(cfg: RunConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main_task = asyncio.current_task()

    def on_signal(sig: int) -> None:
        if stop.is_set():  # second signal: stop waiting for in-flight work
            log.warning("second %s: exiting now", signal.Signals(sig).name)
            if main_task is not None:
                main_task.cancel()
            return
        log.info("%s received, shutting down", signal.Signals(sig).name)
        stop.set()
        if cfg.input_kind in ("text", "stdin", "batch") and main_task is not None:
            main_task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    if cfg.engine == "dyn":
        return await _run_frontend(cfg, stop)

    try:
        card = await asyncio.to_thread(
            resolve_card, cfg.model, name=cfg.model_name, model_config=cfg.model_config,
            context_length=cfg.context_length, kv_cache_block_size=cfg.kv_cache_block_size,
            migration_limit=cfg.migration_limit,
            need_tokenizer=not (cfg.embedding and cfg.engine in (None, "llamacpp")),
        )
    except ModelError:
        # a pystr engine loads its own model: any existing path is its business, not ours
        if cfg.engine != "pystr" or cfg.model is None or not Path(cfg.model).exists():
            raise
        card = ModelCard.placeholder(cfg.model_name or Path(cfg.model).name)
    if cfg.chat_template is not None:
        from dynamo.llm.model_source import apply_chat_template_file

        apply_chat_template_file(card, cfg.chat_template)
    engine_name = choose_engine(cfg, card)
    card.tool_call_parser = resolve_parser("tool", cfg.tool_call_parser, card.chat_template)
    card.reasoning_parser = resolve_parser("reasoning", cfg.reasoning_parser, card.chat_template)
    log.debug(
        "model %r: engine %s, context length %d, kv block size %d, eos ids %s, chat template %s",
        card.display_name, engine_name, card.context_length, card.kv_cache_block_size, card.eos_token_ids,
        "yes" if card.chat_template else "no",
    )
    log.debug("model %r: tool-call parser %s, reasoning parser %s", card.display_name,
             card.tool_call_parser or "none", card.reasoning_parser or "none")
    if cfg.input_kind == "endpoint":
        from dynamo.worker.serve import run_worker

        if cfg.num_workers > 1 or cfg.worker_start_delay > 0:
            return await _run_workers(cfg, card, engine_name, stop)
        return await run_worker(cfg, card, engine_name, stop)
    model = await build_served_model(cfg, card, engine_name)
    try:
        return await _run_input(cfg, model, engine_name, stop)
    finally:
        await close_engine(model.engine)


async def _run_workers(cfg: RunConfig, card: ModelCard, engine_name: str, stop: asyncio.Event) -> int:
    """``num_workers`` workers in this process (Dynamo 1.x's mocker ``--num-workers``): each its own engine,
    runtime connection and instance id, so frontends see N workers; the worst exit status.  Worker ``i``
    starts ``worker_start_delay + i * worker_stagger`` seconds in (the mocker's ``--startup-time``: a
    simulated engine start, during which the worker is not registered)."""
    from dynamo.worker.serve import run_worker

    async def one(i: int) -> int:
        delay = cfg.worker_start_delay + i * cfg.worker_stagger
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return 0  # stopped before this one started
            except TimeoutError:
                pass
        return await run_worker(cfg, copy.copy(card), engine_name, stop)

    codes = await asyncio.gather(*(one(i) for i in range(cfg.num_workers)))
    return max(codes)


async def _run_input(cfg: RunConfig, model: ServedModel, engine_name: str, stop: asyncio.Event) -> int:
    # the echo engine would stop at the template's first end-of-turn token; real engines stop normally
    ignore_eos = engine_name == "echo_core"
    kind = cfg.input_kind
    try:
        if kind == "http":
            manager = ModelManager()
            manager.add(model)
            from dynamo.llm.lora import served_adapters

            for adapter in served_adapters(model):
                manager.add(adapter)
            return await _serve_http(cfg, manager, stop)
        if kind == "text":
            from dynamo.inputs.text import run_text

            return await run_text(model, ignore_eos=ignore_eos)
        if kind == "stdin":
            from dynamo.inputs.text import run_stdin

            return await run_stdin(model, ignore_eos=ignore_eos)
        if kind == "batch":
            from dynamo.inputs.batch import run_batch

            return await run_batch(model, Path(cfg.input[6:]), concurrency=cfg.batch_concurrency, ignore_eos=ignore_eos)
        if kind == "none":
            log.info("engine %s started for %s; nothing to serve (in=none). Ctrl-C to exit.", engine_name, model.name)
            await stop.wait()
            return 0
    except asyncio.CancelledError:
        sys.stdout.write("\n")
        sys.stdout.flush()
        return 130 if kind != "text" else 0
    raise UserError(f"in={cfg.input} is not supported")


async def _serve_http(cfg: RunConfig, manager: ModelManager, stop: asyncio.Event,
                      metrics: "FrontendMetrics | None" = None, runtime: "DistributedRuntime | None" = None) -> int:
    """Serve until ``stop``; with ``runtime`` (``out=dyn``) the frontend is registered in discovery while it
    listens (frontend/registration.py), so the planner finds it."""
    from dynamo.frontend.http.options import build_http_options
    from dynamo.frontend.http.service import DEFAULT_MAX_INFLIGHT, HttpService
    from dynamo.heap import settle_heap

    options = build_http_options(api_keys=cfg.api_keys, allowed_origins=cfg.allowed_origins,
                                 tls_cert_path=cfg.tls_cert_path, tls_key_path=cfg.tls_key_path,
                                 anthropic_api=cfg.anthropic_api,
                                 allowed_local_media_path=cfg.allowed_local_media_path,
                                 limit_mm_per_prompt=cfg.limit_mm_per_prompt)
    service = HttpService(manager, metrics=metrics, max_inflight=cfg.max_inflight or DEFAULT_MAX_INFLIGHT,
                          options=options)
    await service.start(cfg.http_host, cfg.http_port)
    entry = None
    if runtime is not None and service.port is not None:
        from dynamo.frontend.http.listen import worker_index
        from dynamo.frontend.registration import advertised_url, register_frontend

        url = await asyncio.to_thread(advertised_url, options.scheme, cfg.http_host, service.port)  # may resolve
        entry = await register_frontend(runtime, url, worker_index())
    settle_heap()
    await stop.wait()
    if entry is not None and runtime is not None:
        from dynamo.frontend.registration import deregister_frontend

        await deregister_frontend(runtime, entry)
    await service.stop(grace=shutdown_grace())
    return 0


def shutdown_grace() -> float:
    """Seconds in-flight HTTP requests get to finish on SIGINT/SIGTERM: ``DYN_HTTP_GRACEFUL_SHUTDOWN_TIMEOUT_SECS``
    (Dynamo 1.x's name), else ``DYN_HTTP_GRACEFUL_SHUTDOWN_TIMEOUT`` (ours before), default 5."""
    for name in ("DYN_HTTP_GRACEFUL_SHUTDOWN_TIMEOUT_SECS", "DYN_HTTP_GRACEFUL_SHUTDOWN_TIMEOUT"):
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            value = float(raw)
            if value >= 0:
                return value
        except ValueError:
            pass
        log.warning("%s=%r is not a number of seconds; using 5", name, raw)
        return 5.0
    return 5.0


async def _run_frontend(cfg: RunConfig, stop: asyncio.Event) -> int:
    """``out=dyn``: models come and go as workers register in etcd."""
    from dynamo.frontend.discovery import start_frontend

    metrics = None
    if cfg.input_kind == "http":  # the workers' load goes on the service's /metrics
        from dynamo.frontend.http.metrics import FrontendMetrics

        metrics = FrontendMetrics()
    runtime, manager, watcher = await start_frontend(cfg, metrics)
    try:
        if cfg.input_kind == "http":
            return await _serve_http(cfg, manager, stop, metrics, runtime)
        if cfg.input_kind == "none":
            await stop.wait()
            return 0
        log.info("Waiting for remote model..")
        model = await manager.wait_for_any()
        log.info("Connected to %s", model.name)
        return await _run_input(cfg, model, "dyn", stop)
    finally:
        await watcher.close()
        await runtime.close()
