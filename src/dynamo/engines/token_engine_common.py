"""What the in-process token engines (``out=vllm``, ``out=sglang``, ``out=trtllm``) share.

All three take our pre-processed token ids, leave detokenizing and stop strings to our post-processor, and
stream token ids back.  So they map a :class:`PreprocessedRequest` onto their sampling parameters the same
way in most respects (which token ids stop generation, the float sampling knobs, one choice per request,
the guided-decoding kinds), read a "stop" finish the same way, and need the same plumbing to abort a
request whose consumer stops.  Those shared pieces live here, free of any engine import, so they are
unit-tested without the engines installed.  Each engine module keeps its own differences in its own code
(parameter names, what ``top_k`` 0 means, greedy decoding, finish-reason names, how a request is aborted).
"""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import contextmanager
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping, MutableMapping, Sequence

from dynamo.errors import EngineError, ModelError, UserError
from dynamo.llm.engine import Context
from dynamo.llm.protocols.common import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineOutput,
    PreprocessedRequest,
)

# the sampling options every engine takes as floats under the same name
FLOAT_SAMPLING_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                         "repetition_penalty")
# the kinds of our ``guided_decoding`` dict an engine can constrain generation with
GUIDED_DECODING_KINDS = ("json", "regex", "grammar", "choice")


def one_line(e: BaseException) -> str:
    """An exception as one line: the engines' (and pydantic's) messages span several, our errors take one."""
    text = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
    return text or type(e).__name__


# -- request mapping ----------------------------------------------------------------------------------

def engine_eos_ids(request: PreprocessedRequest) -> list[int]:
    """The request's EOS ids as ints, or none when it sets ``ignore_eos`` (generation must run past them)."""
    if request.stop_conditions.ignore_eos:
        return []
    return [int(t) for t in request.eos_token_ids or []]


def stop_token_ids(request: PreprocessedRequest) -> list[int]:
    """The token ids that must end generation inside the engine, each once, in order.

    The EOS ids (none with ``ignore_eos``) and the request's hidden stop token ids.  They go to the engine,
    unlike stop strings, so that it stops generating at once instead of our post-processor discarding what
    it generates after them.
    """
    ids: list[int] = []
    for tok in engine_eos_ids(request) + [int(t) for t in request.stop_conditions.stop_token_ids_hidden or []]:
        if tok not in ids:
            ids.append(tok)
    return ids


def common_sampling_params(request: PreprocessedRequest, engine: str) -> dict[str, Any]:
    """The sampling parameters all three engines name and value as we do.

    ``ignore_eos``, ``stop_token_ids`` (:func:`stop_token_ids`) and the float knobs (those set: left out, an
    engine applies its own default or the model's generation config).  ``n`` > 1 is refused: the engines
    stream one sequence per request here, and quietly serving one choice would mislead the client.
    """
    so = request.sampling_options
    if so.n is not None and so.n > 1:
        raise UserError(f"out={engine} serves one choice per request (n > 1 is not supported)")
    params: dict[str, Any] = {}
    if request.stop_conditions.ignore_eos:
        params["ignore_eos"] = True
    stop_ids = stop_token_ids(request)
    if stop_ids:
        params["stop_token_ids"] = stop_ids
    for name in FLOAT_SAMPLING_FIELDS:
        value = getattr(so, name)
        if value is not None:
            params[name] = float(value)
    return params


def guided_decoding(guided: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Our ``guided_decoding`` dict reduced to the constraint kinds (json/regex/grammar/choice) that are set.

    None when nothing constrains the output; other keys (e.g. ``backend``) are our options, not the engine's.
    """
    if not guided:
        return None
    out = {k: guided[k] for k in GUIDED_DECODING_KINDS if guided.get(k) is not None}
    return out or None


# -- output conversion --------------------------------------------------------------------------------

def stop_finish_reason(matched: Any, eos_token_ids: Sequence[int]) -> str:
    """An engine's "stop" finish -> ``eos`` or ``stop``, from what it says matched.

    We pass our EOS ids among the engine's stop token ids, so a match on one of them (or no match at all:
    the model's own EOS) is an EOS; any other token id or string is a stop condition.
    """
    if matched is None or (isinstance(matched, int) and matched in eos_token_ids):
        return FINISH_EOS
    return FINISH_STOP


def completion_finish_reason(reason: str | None, stop_reason: Any, eos_token_ids: Sequence[int], *,
                             cancelled: str, engine: str) -> Any:
    """A ``CompletionOutput``'s ``finish_reason``/``stop_reason`` pair -> ours.

    vLLM and TensorRT-LLM (whose LLM API follows vLLM's) report a finish the same way but for the word
    for a request aborted on our behalf (``cancelled``).  None while the request runs; a reason we do not
    know is an error, naming ``engine``.
    """
    if reason is None:
        return None
    if reason == "stop":
        return stop_finish_reason(stop_reason, eos_token_ids)
    if reason == "length":
        return FINISH_LENGTH
    if reason == cancelled:
        return FINISH_CANCELLED
    return {"error": f"{engine} finished the request with reason {reason!r}"}


# -- GPUs ---------------------------------------------------------------------------------------------

def gpus_per_node(tensor_parallel_size: int, num_nodes: int) -> int:
    """GPUs each node contributes: ``--tensor-parallel-size`` is the total over all nodes (rounded up)."""
    return max(1, -(-tensor_parallel_size // max(num_nodes, 1)))


def cuda_visible_devices(base_gpu_id: int, count: int, current: str | None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` selecting ``count`` GPUs from ``base_gpu_id`` on, or None to leave it as is.

    vLLM and TensorRT-LLM have no ``base_gpu_id`` argument, so ``--base-gpu-id`` is applied by hiding the GPUs
    below it.  With ``CUDA_VISIBLE_DEVICES`` already set to a list, ``base_gpu_id`` indexes into that list.
    """
    if base_gpu_id <= 0:
        return None
    count = max(count, 1)
    if current is not None and current.strip():
        devices = [d.strip() for d in current.split(",") if d.strip()]
        chosen = devices[base_gpu_id:base_gpu_id + count]
        if len(chosen) < count:
            raise UserError(f"--base-gpu-id {base_gpu_id} with {count} GPU(s) needs more GPUs than "
                            f"CUDA_VISIBLE_DEVICES={current} lists")
        return ",".join(chosen)
    return ",".join(str(i) for i in range(base_gpu_id, base_gpu_id + count))


def apply_base_gpu_id(base_gpu_id: int, count: int, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set ``CUDA_VISIBLE_DEVICES`` in ``environ`` for ``--base-gpu-id`` (before the engine sees the GPUs).

    Returns the new value for the caller to log, or None when nothing changed.
    """
    visible = cuda_visible_devices(base_gpu_id, count, environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None:
        environ["CUDA_VISIBLE_DEVICES"] = visible
    return visible


# -- engine start-up ----------------------------------------------------------------------------------

@contextmanager
def engine_start_errors(engine: str, where: str = "") -> Iterator[None]:
    """Turn an engine constructor's exceptions into our one-line errors.

    ``TypeError``: an argument it does not know; ``ValueError`` (pydantic's validation included): a value
    it cannot use; both are the user's to fix (``where`` names the ``--extra-engine-args`` file).
    ``RuntimeError``: the engine itself failed (no GPU, out of memory, a bad model).
    """
    try:
        yield
    except TypeError as e:
        raise UserError(f"{where}{engine} rejected its engine arguments: {one_line(e)}") from None
    except ValueError as e:
        raise UserError(f"{where}{engine} cannot use these engine arguments: {one_line(e)}") from None
    except RuntimeError as e:
        raise ModelError(f"{engine} engine failed to start: {one_line(e)}") from None


# -- streaming and abort ------------------------------------------------------------------------------

async def relay_outputs(
    stream: AsyncIterator[Any],
    convert: Callable[[Any], EngineOutput],
    context: Context,
    abort: Callable[[], Awaitable[Any] | None],
    *,
    engine: str,
    log: logging.Logger,
    tag: str,
    request_id: str,
) -> AsyncGenerator[EngineOutput, None]:
    """Yield ``convert(item)`` for each item of an engine's stream, until one carries a finish reason.

    The request is aborted in the engine, at most once, when it is no longer wanted: when ``context`` is
    stopped or killed (a stop string matched, the client went away), and when this generator is closed or
    cancelled before the engine finished.  Otherwise the engine would go on generating for nobody.
    ``abort`` is the engine's own call; it may return an awaitable (vLLM's ``abort`` is a coroutine),
    which is scheduled from the stop callback and awaited (shielded) on close.  An engine's exception
    becomes an :class:`EngineError` prefixed with ``engine``; ``log``/``tag`` name the engine in debug logs.

    Close it with ``contextlib.aclosing`` when relaying it from another generator, so that the abort
    happens when the consumer stops, not when the garbage collector gets to it.
    """
    loop = asyncio.get_running_loop()
    done = aborted = False
    produced = 0

    def on_stop(_why: str) -> None:  # runs on the event loop
        nonlocal aborted
        if done or aborted:
            return
        aborted = True
        log.debug("%s: aborting request %s", tag, request_id)
        pending = abort()
        if pending is not None:
            asyncio.ensure_future(pending, loop=loop)

    context.on_stop(lambda why: loop.call_soon_threadsafe(on_stop, why))
    try:
        async for raw in stream:
            item = convert(raw)
            produced += len(item.token_ids)
            if item.finish_reason is not None:
                done = True
                if item.finish_reason == FINISH_CANCELLED:
                    log.debug("%s: request %s aborted after %d tokens", tag, request_id, produced)
            yield item
            if done:
                return
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the engine died, or rejected the request
        raise EngineError(f"{engine}: {one_line(e)}") from e
    finally:
        if not done:
            done = True
            if not aborted:
                aborted = True
                log.debug("%s: aborting request %s after %d tokens (consumer stopped)", tag, request_id, produced)
                try:
                    pending = abort()
                    if pending is not None:
                        await asyncio.shield(pending)
                except Exception:  # the engine is gone: nothing left to abort
                    pass
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
