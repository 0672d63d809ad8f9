"""Bring-your-own Python engines: ``out=pystr:FILE.py`` and ``out=pytok:FILE.py``.

The user's file provides ``async def generate(request)``, an async generator:

* ``pystr`` (a *full* engine): ``request`` is the OpenAI chat-completion request as the client sent it
  (a dict); it yields chat-completion chunk dicts, which go to the client as they are.  A
  ``/v1/completions`` request is handed over as a chat request with the prompt as the one user message,
  and the chunks it yields are reshaped into ``text_completion`` chunks.
* ``pytok`` (a *core* engine): ``request`` is the pre-processed request dict (``token_ids``,
  ``stop_conditions``, ``sampling_options``, ``eos_token_ids``, ...); it yields ``{"token_ids": [...]}``
  dicts (``finish_reason`` optional) and our post-processor detokenises and applies the stop conditions.

Loading (once, at start-up, in ``start()``, off the server's event loop): ``sys.argv`` is set as the seeds document it (:func:`engine_argv`), the
file's directory goes first on ``sys.path``, the file runs as ``__main__`` (so an
``if __name__ == "__main__":`` block runs), then an optional ``initialize(args)`` hook is called with
``sys.argv[1:]`` (awaited if it is a coroutine function).  A file that fails to load, has no async
generator ``generate``, or whose ``initialize`` raises is a one-line :class:`UserError`.

Where it runs: the file, ``initialize`` and every ``generate`` call run on a private asyncio event loop in
a daemon thread (as the original did), not on the server's loop.  An engine that blocks (``time.sleep``,
a synchronous HTTP call, a long computation between awaits) therefore slows only itself: the HTTP server
keeps answering ``/health``, other requests' streams and Ctrl-C.  Items cross between the two loops with
a credit of one: the user's generator runs at most one item ahead of what the client has taken, and is
parked at its ``yield`` otherwise.

Failures stay inside one request: an exception raised by ``generate`` (or ``SystemExit``), a yielded item
of the wrong shape or one that is not JSON-serialisable becomes an :class:`EngineError` for that request
(HTTP 500, or an SSE error event once streaming started) and is logged with its traceback; the server
keeps serving.  When the consumer goes away (client disconnect, stop condition, Ctrl-C in text mode) the
user's generator is cancelled if it is inside an ``await``, else closed at its ``yield``
(``aclose``: ``GeneratorExit``), so its ``finally`` blocks run.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import runpy
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import msgspec
import orjson

from dynamo.errors import EngineError, RequestError, UserError
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest
from dynamo.llm.protocols.openai import CompletionRequest
from dynamo.run_config import RunConfig

log = logging.getLogger(__name__)

# how long the consumer waits for the user's generator to finish closing before giving up on it
CLOSE_TIMEOUT_S = 5.0
# how long close() waits for the engine thread to wind down at exit
SHUTDOWN_TIMEOUT_S = 5.0

_JSON_LENIENT = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


# -- the argument list ------------------------------------------------------------------------------


def engine_argv(cfg: RunConfig, file_arg: str, served_name: str) -> list[str]:
    """``sys.argv`` for the engine file, as the seeds document it.

    ``[file, --model-path <model as given>, --model-name <served name>, --http-port N,
    --tensor-parallel-size N, --base-gpu-id N, --num-nodes N, --node-rank N, [--leader-addr A],
    [--model-config P], [--extra-engine-args P], <everything after -->]``.  ``--model-path`` is left out
    when no model was given.
    """
    argv = [file_arg]
    if cfg.model is not None:
        argv += ["--model-path", str(cfg.model)]
    argv += [
        "--model-name", served_name,
        "--http-port", str(cfg.http_port),
        "--tensor-parallel-size", str(cfg.tensor_parallel_size),
        "--base-gpu-id", str(cfg.base_gpu_id),
        "--num-nodes", str(cfg.num_nodes),
        "--node-rank", str(cfg.node_rank),
    ]
    if cfg.leader_addr:
        argv += ["--leader-addr", str(cfg.leader_addr)]
    if cfg.model_config:
        argv += ["--model-config", str(cfg.model_config)]
    if cfg.extra_engine_args:
        argv += ["--extra-engine-args", str(cfg.extra_engine_args)]
    argv += list(cfg.extra_args or ())
    return argv


# -- the engine's own event loop --------------------------------------------------------------------


class _EngineThread:
    """A daemon thread that runs ``setup()`` with its loop set as current, then runs the loop forever."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._ready = threading.Event()
        self._setup: Callable[[asyncio.AbstractEventLoop], Any] | None = None
        self._result: Any = None
        self._error: BaseException | None = None

    def start(self, setup: Callable[[asyncio.AbstractEventLoop], Any]) -> Any:
        """Run ``setup(loop)`` in the thread and return its result (or raise its exception)."""
        self._setup = setup
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._result

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self._result = self._setup(self.loop)  # type: ignore[misc]
        except BaseException as e:  # noqa: BLE001 - handed to the starting thread
            self._error = e
            self._ready.set()
            self._close_loop()
            return
        asyncio.set_event_loop(self.loop)  # the file's own asyncio.run() would have cleared it
        self._ready.set()
        try:
            self.loop.run_forever()
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        loop = self.loop
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=SHUTDOWN_TIMEOUT_S))
            loop.run_until_complete(loop.shutdown_asyncgens())
        except Exception:  # noqa: BLE001 - best effort at exit
            log.debug("python engine loop cleanup failed", exc_info=True)
        finally:
            loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn`` on the engine loop; EngineError if the loop is gone."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed
            raise EngineError("the Python engine has stopped") from None

    def stop(self) -> None:
        if self._thread.is_alive():
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:
                pass
            self._thread.join(SHUTDOWN_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("the Python engine did not stop within %ss; exiting anyway", SHUTDOWN_TIMEOUT_S)


class _Pump:
    """One request on the engine loop: calls the user's ``generate``, sends items back one credit at a time.

    Messages to the consumer: ``("item", value)``, ``("end", None)``, ``("error", exc)``, and always last
    ``("done", None)`` when the task has finished (the generator is closed by then).
    """

    __slots__ = ("fn", "request", "convert", "send", "credit", "closing", "task")

    def __init__(self, fn: Callable[[Any], Any], request: Any, convert: Callable[[Any], Any],
                 send: Callable[[tuple[str, Any]], None]):
        self.fn = fn
        self.request = request
        self.convert = convert
        self.send = send
        self.credit = asyncio.Semaphore(0)  # bound to the engine loop on first use
        self.closing = False
        self.task: asyncio.Task[None] | None = None

    # these three run on the engine loop
    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.run())
        self.task.add_done_callback(lambda _t: self.send(("done", None)))

    def grant(self) -> None:
        self.credit.release()

    def cancel(self) -> None:
        self.closing = True
        if self.task is not None and not self.task.done():
            self.task.cancel()

    async def run(self) -> None:
        agen: Any = None
        try:
            try:
                agen = self.fn(self.request)
            except BaseException as e:  # noqa: BLE001 - the user's code
                self.send(("error", e))
                return
            if not hasattr(agen, "__anext__"):
                if inspect.iscoroutine(agen):
                    agen.close()
                self.send(("error", EngineError(
                    f"generate() returned {type(agen).__name__}, not an async generator: "
                    "write it as 'async def generate(request): ... yield {...}'"
                )))
                agen = None
                return
            while not self.closing:
                await self.credit.acquire()
                if self.closing:
                    return
                try:
                    item = await agen.__anext__()
                except StopAsyncIteration:
                    self.send(("end", None))
                    return
                except asyncio.CancelledError:
                    raise
                except BaseException as e:  # noqa: BLE001 - SystemExit included: it must not end the thread
                    self.send(("error", e))
                    return
                try:
                    value = self.convert(item)
                except EngineError as e:
                    self.send(("error", e))
                    return
                self.send(("item", value))
        finally:
            if agen is not None and hasattr(agen, "aclose"):
                try:
                    await agen.aclose()
                except BaseException as e:  # noqa: BLE001
                    if not isinstance(e, (asyncio.CancelledError, StopAsyncIteration, GeneratorExit)):
                        log.warning("the Python engine's generate() raised while closing: %s: %s",
                                    type(e).__name__, e)


# -- loading the file -------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _where(e: BaseException, path: Path) -> str:
    """`` (file.py, line N)`` for the innermost frame of the traceback that is in the engine file."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f" ({Path(e.filename or str(path)).name}, line {e.lineno})"
    line = None
    for frame in traceback.extract_tb(e.__traceback__):
        try:
            if Path(frame.filename).resolve() == path:
                line = frame.lineno
        except OSError:
            continue
    return f" ({path.name}, line {line})" if line else ""


def _describe(e: BaseException) -> str:
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg}"
    text = _one_line(str(e))
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _load(label: str, file_arg: str, argv: list[str], loop: asyncio.AbstractEventLoop) -> Callable[[Any], Any]:
    """Run the file as ``__main__`` with ``argv``, call ``initialize``; return ``generate``.  Engine thread."""
    path = Path(file_arg).resolve()
    folder = str(path.parent)
    if folder not in sys.path[:1]:
        sys.path.insert(0, folder)
    # sys.argv stays set afterwards too: an engine may read it lazily (first request, initialize)
    sys.argv = list(argv)
    try:
        namespace = runpy.run_path(file_arg, run_name="__main__")
    except SystemExit as e:
        code = e.code if e.code is not None else 0
        raise UserError(f"{label}: the engine file exited while loading (exit status {code})") from None
    except BaseException as e:  # noqa: BLE001 - anything the user's file raises
        log.debug("loading %s failed", file_arg, exc_info=True)
        raise UserError(f"{label}: loading the engine file failed: {_describe(e)}{_where(e, path)}") from None
    finally:
        # runpy restores argv[0] to what it was, which is already the file; keep the list we set
        if sys.argv[:1] != argv[:1]:
            sys.argv = list(argv)

    generate = namespace.get("generate")
    if generate is None:
        raise UserError(f"{label}: the engine file has no 'generate' function: "
                        "define 'async def generate(request):' yielding dicts")
    if not callable(generate):
        raise UserError(f"{label}: 'generate' in the engine file is a {type(generate).__name__}, not a function")
    if inspect.iscoroutinefunction(generate):
        raise UserError(f"{label}: 'generate' must be an async generator (use 'yield', not 'return')")
    if inspect.isgeneratorfunction(generate):
        raise UserError(f"{label}: 'generate' must be an async generator: write 'async def generate(request):'")

    initialize = namespace.get("initialize")
    if initialize is not None:
        if not callable(initialize):
            raise UserError(f"{label}: 'initialize' in the engine file is not a function")
        args = list(argv[1:])
        try:
            try:
                takes_args = bool(inspect.signature(initialize).parameters)
            except (TypeError, ValueError):
                takes_args = True
            result = initialize(args) if takes_args else initialize()
            if inspect.isawaitable(result):
                loop.run_until_complete(result)
        except SystemExit as e:
            code = e.code if e.code is not None else 0
            raise UserError(f"{label}: initialize() exited (exit status {code})") from None
        except BaseException as e:  # noqa: BLE001
            log.debug("initialize() in %s failed", file_arg, exc_info=True)
            raise UserError(f"{label}: initialize() failed: {_describe(e)}{_where(e, path)}") from None
        asyncio.set_event_loop(loop)
    return generate


# -- the engines -----------------------------------------------------------------------------------


class _PythonEngine:
    mode = ""

    def __init__(self, file_arg: str, argv: list[str]):
        self.file = file_arg
        self.label = f"out={self.mode}:{file_arg}"
        self.argv = argv
        self._thread = _EngineThread(f"{self.mode}-engine")
        self._generate: Callable[[Any], Any] | None = None

    async def start(self) -> None:
        """Load the file (and run ``initialize``) on the engine's thread, waiting for it in another thread:
        a load that takes minutes must not stall this loop, whose lease keep-alive, NATS pings and
        health answers go on meanwhile."""
        file_arg, argv = self.file, self.argv
        self._generate = await asyncio.to_thread(
            self._thread.start, lambda loop: _load(self.label, file_arg, argv, loop))
        log.info("%s loaded", self.label)

    async def _run(self, request: Any, convert: Callable[[Any], Any]) -> AsyncIterator[Any]:
        """The user's generator driven on the engine loop, its converted items delivered here."""
        ours = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def send(msg: tuple[str, Any]) -> None:  # engine thread -> our loop
            try:
                ours.call_soon_threadsafe(queue.put_nowait, msg)
            except RuntimeError:  # our loop is closed: nobody is listening
                pass

        if self._generate is None:
            raise EngineError(f"{self.label}: the engine is not started")
        pump = _Pump(self._generate, request, convert, send)
        self._thread.call_soon(pump.start)
        finished = False
        try:
            while True:
                self._thread.call_soon(pump.grant)
                kind, value = await queue.get()
                if kind == "item":
                    yield value
                elif kind == "end":
                    return
                elif kind == "error":
                    raise self._failure(value)
                else:  # "done" with neither end nor error: the task was cancelled from inside
                    finished = True
                    raise EngineError("the Python engine's generate() was cancelled before it finished")
        finally:
            if not finished:
                await self._close(pump, queue)

    async def _close(self, pump: _Pump, queue: asyncio.Queue[tuple[str, Any]]) -> None:
        try:
            self._thread.call_soon(pump.cancel)
        except EngineError:
            return

        async def until_done() -> None:
            while (await queue.get())[0] != "done":
                pass

        try:
            await asyncio.wait_for(until_done(), CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.warning("%s: generate() did not finish closing within %ss (is it blocking?)",
                        self.label, CLOSE_TIMEOUT_S)

    def _failure(self, e: BaseException) -> EngineError:
        if isinstance(e, (EngineError, RequestError)):
            return e  # type: ignore[return-value]
        tb = e.__traceback__
        if tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # the traceback starts in the user's file, not in our pump
        log.error("%s: generate() raised %s", self.label, type(e).__name__, exc_info=(type(e), e, tb))
        if isinstance(e, SystemExit):
            return EngineError(f"the Python engine's generate() called exit ({e.code})")
        return EngineError(f"a Python exception was caught while processing the async generator: {_describe(e)}")

    def close(self) -> None:
        self._thread.stop()


def _short(item: Any) -> str:
    text = repr(item)
    return text if len(text) <= 120 else text[:117] + "..."


def _json_dict(item: Any, what: str) -> dict[str, Any]:
    """A yielded item as a JSON-safe dict (a copy: the engine may reuse its dict), else EngineError."""
    if not isinstance(item, dict):
        raise EngineError(
            f"invalid response object from the Python engine: generate() yielded {type(item).__name__} "
            f"{_short(item)}, expected a dict ({what})"
        )
    try:
        return orjson.loads(orjson.dumps(item, option=_JSON_LENIENT))
    except (TypeError, orjson.JSONEncodeError) as e:
        raise EngineError(f"invalid response object from the Python engine: the yielded dict is not JSON: {e}") from None


class PyStrEngine(_PythonEngine):
    """``out=pystr:FILE.py``: OpenAI chat requests in, chat-completion chunk dicts out."""

    kind = "full"
    mode = "pystr"
    wants_raw_request = True  # FullPipeline passes the client's dict as ``raw=``

    @property
    def image_urls(self) -> bool:
        """The file takes images and says so with ``generate.images = True``: a chat's ``image_url`` parts
        then reach it as ``data:`` URLs the frontend loaded and checked (else images are 400s)."""
        return bool(getattr(self._generate, "images", False))

    async def generate(self, request: Any, context: Context, raw: dict[str, Any] | None = None) -> AsyncIterator[dict[str, Any]]:
        if raw is None:
            raw = request if isinstance(request, dict) else _struct_dict(request)
        completion = isinstance(request, CompletionRequest) or (
            isinstance(request, dict) and "prompt" in request and "messages" not in request
        )
        if completion:
            text = _completion_prompt(raw)
            user_request = _completion_as_chat(raw, text)
            convert: Callable[[Any], Any] = _completion_chunk
        else:
            user_request = raw
            convert = _chat_chunk
        first = True
        async for chunk in self._run(user_request, convert):
            if first and completion and raw.get("echo"):
                yield _echo_chunk(chunk, text)
            first = False
            _count(chunk, context, completion)
            yield chunk


class PyTokEngine(_PythonEngine):
    """``out=pytok:FILE.py``: pre-processed request dicts in, ``{"token_ids": [...]}`` dicts out."""

    kind = "core"
    mode = "pytok"

    @property
    def guided_decoding(self) -> Any:
        """The guided-decoding kinds the file honours: it says so with ``generate.guided_decoding = True``
        (all) or a list such as ``["json", "choice"]``; requests asking for others are 400s."""
        return getattr(self._generate, "guided_decoding", False)

    @property
    def logprobs(self) -> bool:
        """The file yields ``log_probs`` / ``top_logprobs`` when ``output_options.logprobs`` asks, and says
        so with ``generate.logprobs = True`` (else requests asking for logprobs are 400s)."""
        return bool(getattr(self._generate, "logprobs", False))

    @property
    def prompt_logprobs(self) -> bool:
        """``generate.prompt_logprobs = True``: the first item carries ``prompt_logprobs`` when asked."""
        return bool(getattr(self._generate, "prompt_logprobs", False))

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        async for out in self._run(request.to_dict(), _engine_output):
            yield out


def _struct_dict(request: Any) -> dict[str, Any]:
    data = msgspec.to_builtins(request)
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def _chat_chunk(item: Any) -> dict[str, Any]:
    return _json_dict(item, "a chat.completion.chunk")


def _completion_chunk(item: Any) -> dict[str, Any]:
    chunk = _json_dict(item, "a chat.completion.chunk")
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return chunk
    if chunk.get("object") == "text_completion" or any(isinstance(c, dict) and "text" in c for c in choices):
        return chunk  # already a completions chunk
    out: dict[str, Any] = {
        "id": chunk.get("id"),
        "object": "text_completion",
        "created": chunk.get("created"),
        "model": chunk.get("model"),
        "choices": [
            {
                "index": c.get("index", 0),
                "text": (c.get("delta") or {}).get("content") or "",
                "logprobs": None,
                "finish_reason": c.get("finish_reason"),
            }
            for c in choices
            if isinstance(c, dict)
        ],
    }
    for key in ("system_fingerprint", "usage"):
        if key in chunk:
            out[key] = chunk[key]
    return out


def _completion_prompt(raw: dict[str, Any]) -> str:
    prompt = raw.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise RequestError("this model (a pystr engine) takes one prompt per request", param="prompt")
    raise RequestError("this model (a pystr engine) takes text prompts, not token ids", param="prompt")


_COMPLETION_ONLY = ("prompt", "echo", "suffix", "best_of", "logprobs")


def _completion_as_chat(raw: dict[str, Any], text: str) -> dict[str, Any]:
    chat = {k: v for k, v in raw.items() if k not in _COMPLETION_ONLY}
    chat["messages"] = [{"role": "user", "content": text}]
    if raw.get("logprobs") is not None:
        chat["logprobs"] = True
        chat["top_logprobs"] = raw["logprobs"]
    return chat


def _echo_chunk(template: dict[str, Any], text: str) -> dict[str, Any]:
    return {
        "id": template.get("id"),
        "object": "text_completion",
        "created": template.get("created"),
        "model": template.get("model"),
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}],
    }


def _count(chunk: dict[str, Any], context: Context, completion: bool) -> None:
    """Usage for metrics: the engine's own usage if it sends one, else a content-bearing chunk = a token."""
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            context.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            context.completion_tokens = usage["completion_tokens"]
        return
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        text = choice.get("text") if completion else (choice.get("delta") or {}).get("content")
        if text:
            context.completion_tokens += 1
            return


def _engine_output(item: Any) -> EngineOutput:
    if not isinstance(item, dict):
        raise EngineError(
            f"invalid response object from the Python engine: generate() yielded {type(item).__name__} "
            f"{_short(item)}, expected a dict like {{'token_ids': [123]}}"
        )
    if "token_ids" not in item and item.get("finish_reason") is None and item.get("text") is None:
        raise EngineError(
            f"invalid response object from the Python engine: {_short(item)} has no 'token_ids' "
            "(expected a dict like {'token_ids': [123]})"
        )
    try:
        return msgspec.convert(item, EngineOutput)
    except msgspec.ValidationError:
        pass
    try:  # numpy ints and friends
        return msgspec.convert(orjson.loads(orjson.dumps(item, option=_JSON_LENIENT)), EngineOutput)
    except (TypeError, orjson.JSONEncodeError, msgspec.ValidationError) as e:
        raise EngineError(
            f"invalid response object from the Python engine: {_short(item)}: {e} "
            "(expected a dict like {'token_ids': [123]})"
        ) from None


# -- factories (registry) ---------------------------------------------------------------------------


def _file_of(cfg: RunConfig, mode: str) -> str:
    output = cfg.output or ""
    file_arg = output.split(":", 1)[1] if ":" in output else ""
    if not file_arg:
        raise UserError(f"out={mode}: needs a Python file: out={mode}:my_engine.py")
    if not os.path.isfile(file_arg):
        raise UserError(f"out={mode}:{file_arg}: no such Python file")
    return file_arg


def create_pystr(cfg: RunConfig, card: ModelCard) -> PyStrEngine:
    file_arg = _file_of(cfg, "pystr")
    return PyStrEngine(file_arg, engine_argv(cfg, file_arg, card.display_name))


def create_pytok(cfg: RunConfig, card: ModelCard) -> PyTokEngine:
    file_arg = _file_of(cfg, "pytok")
    if not card.has_tokenizer:
        raise UserError(
            f"out=pytok:{file_arg} needs a model folder with a tokenizer (tokenizer.json) for pre- and "
            "post-processing: pass --model-path <hf-repo-checkout>"
        )
    return PyTokEngine(file_arg, engine_argv(cfg, file_arg, card.display_name))
