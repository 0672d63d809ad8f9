"""``out=mistralrs``: the PyPI ``mistralrs`` package as a full engine (OpenAI request in, chunks out).

mistral.rs applies the chat template, tokenizes, samples and detokenizes itself, so this engine maps our
validated OpenAI request onto mistral.rs's request and its streamed chunks back onto ours
(:class:`~dynamo.llm.chunks.ChatChunks`).  It loads a GGUF file (``Which.GGUF``) or a local Hugging Face
folder (``Which.Plain``); nothing is fetched from the hub (``token_source="none"``; repo ids were already
downloaded by ``dynamo.llm.hub``).

Threading: a ``mistralrs.Runner`` must not be used from two threads at once ("Already borrowed"), its
calls block, and interleaving several streams of a GGUF model fails inside the library.  So one worker
thread owns the runner: it loads the model, then takes requests from a queue and serves them one at a
time, handing each chunk to the event loop with ``call_soon_threadsafe``.  The event loop never blocks.
A request whose consumer went away (``ctx.is_stopped``, or the generator closed) is skipped if still
queued, or dropped between two chunks if running: dropping the library's stream ends its sequence.

Completions are not streamed by the library's Python API (``send_completion_request`` returns the whole
text), so a streaming completions request gets its text in one chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import shutil
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from dynamo.errors import EngineError, ModelError, RequestError, UserError
from dynamo.llm.chunks import ChatChunks, CompletionChunks
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    content_text,
    ignore_eos,
    max_tokens_of,
    stop_list,
)

log = logging.getLogger(__name__)

ENGINE_ARGS = {"seed", "max_seqs", "prefix_cache_n", "in_situ_quant", "dtype", "jinja_explicit", "no_kv_cache",
               "n_threads"}
_DTYPES = {"auto": "Auto", "bf16": "BF16", "f16": "F16", "f32": "F32"}
_DONE = object()


@dataclass
class _Job:
    kind: str  # "chat" | "completion"
    params: dict[str, Any]  # keyword arguments of the mistralrs request (built on the worker thread)
    ctx: Context
    out: asyncio.Queue[Any]
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False

    @property
    def gone(self) -> bool:
        return self.cancelled or self.ctx.is_stopped


@dataclass
class _Piece:
    """One streamed step: text, finish reason, usage and logprobs, as plain Python values."""

    text: str | None
    finish_reason: str | None = None
    usage: tuple[int, int] | None = None
    logprobs: dict[str, Any] | None = None


class MistralRsEngine:
    kind = "full"

    def __init__(self, card: ModelCard, *, args: dict[str, Any] | None = None, verbose: int = 0):
        args = dict(args or {})
        unknown = set(args) - ENGINE_ARGS
        if unknown:
            raise UserError(f"--extra-engine-args: unknown mistralrs argument(s) {sorted(unknown)}; "
                            f"valid: {sorted(ENGINE_ARGS)}")
        if card.path is None and card.gguf_path is None:
            raise UserError("out=mistralrs needs a model: a GGUF file, a Hugging Face folder or a repo id")
        dtype = str(args.get("dtype", "auto")).lower()
        if dtype not in _DTYPES:
            raise UserError(f"--extra-engine-args: mistralrs dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
        threads = args.get("n_threads")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise UserError(f"--extra-engine-args: mistralrs n_threads must be a positive integer, not {threads!r}")
        self.card = card
        self.args = args
        self.verbose = verbose
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._shadow: Path | None = None  # a patched copy of the model folder's config, if one was needed
        self._model_limit: int | None = None

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if "RUST_LOG" not in os.environ:
            # mistral.rs logs every load step at INFO on stderr; keep that for -vv
            os.environ["RUST_LOG"] = "info" if self.verbose >= 2 else "warn" if self.verbose == 1 else "error"
        if "n_threads" in self.args:
            # mistral.rs computes on a rayon pool sized once, when the model loads; on a busy machine one
            # thread can beat several that wait on each other
            os.environ["RAYON_NUM_THREADS"] = str(self.args["n_threads"])
        loaded: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(loaded,), name="mistralrs-worker", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(loaded)

    async def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None
        if self._shadow is not None:
            shutil.rmtree(self._shadow, ignore_errors=True)
            self._shadow = None

    def _which(self) -> Any:
        import mistralrs as M

        dtype = getattr(M.ModelDType, _DTYPES[str(self.args.get("dtype", "auto")).lower()])
        card = self.card
        if card.gguf_path is not None:
            gguf = Path(card.gguf_path)
            kw: dict[str, Any] = {}
            if card.path is not None and Path(card.path).is_dir():
                kw["tok_model_id"] = str(card.path)  # --model-config: tokenizer and template from the folder
            return M.Which.GGUF(quantized_model_id=str(gguf.parent), quantized_filename=gguf.name, dtype=dtype, **kw)
        folder = Path(card.path)  # type: ignore[arg-type]
        return M.Which.Plain(model_id=str(self._loadable_folder(folder)), dtype=dtype)

    def _loadable_folder(self, folder: Path) -> Path:
        """``folder``, or a shadow copy whose config.json mistral.rs can parse.

        transformers 5 writes ``rope_parameters`` instead of ``rope_theta``/``rope_scaling``; mistral.rs
        0.9 requires ``rope_theta``.  The shadow folder links every file and carries a patched config.
        """
        config_file = folder / "config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return folder
        patched = _patch_rope(config)
        if patched is None:
            return folder
        shadow = Path(tempfile.mkdtemp(prefix="dynamo-mistralrs-"))
        for item in folder.iterdir():
            if item.name != "config.json":
                (shadow / item.name).symlink_to(item.resolve())
        (shadow / "config.json").write_text(json.dumps(patched, indent=2), encoding="utf-8")
        self._shadow = shadow
        log.info("config.json has rope_parameters but no rope_theta (transformers 5); "
                 "giving mistral.rs a patched copy")
        return shadow

    def _load(self) -> Any:
        import mistralrs as M

        which = self._which()
        kw: dict[str, Any] = {"token_source": "none"}
        for key in ("seed", "max_seqs", "prefix_cache_n", "in_situ_quant", "no_kv_cache"):
            if key in self.args:
                kw[key] = self.args[key]
        template = self.args.get("jinja_explicit")
        if template is None and self.card.gguf_path is None and self.card.path is not None:
            jinja = Path(self.card.path) / "chat_template.jinja"
            if jinja.is_file():  # newer HF folders keep the template beside tokenizer_config.json
                template = str(jinja)
        if template is not None:
            kw["jinja_explicit"] = str(template)
        where = self.card.gguf_path or self.card.path
        try:
            runner = M.Runner(which=which, **kw)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # pyo3 panics derive from BaseException
            raise ModelError(f"mistral.rs cannot load {where}: {_first_line(e)}") from None
        try:
            self._model_limit = runner.max_sequence_length()
        except Exception:
            self._model_limit = None
        log.info("mistral.rs loaded %s (max sequence length %s)", where, self._model_limit)
        return runner

    # -- the worker thread --------------------------------------------------------------------
    def _run(self, loaded: Future[None]) -> None:
        try:
            runner = self._load()
        except BaseException as e:
            if self._shadow is not None:
                shutil.rmtree(self._shadow, ignore_errors=True)
                self._shadow = None
            loaded.set_exception(e)
            return
        loaded.set_result(None)
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if job.gone:
                _deliver(job, _DONE)
                continue
            try:
                if job.kind == "chat":
                    self._serve_chat(runner, job)
                else:
                    self._serve_completion(runner, job)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:
                _deliver(job, _to_error(e))
            _deliver(job, _DONE)
        # fail whatever is still queued
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                _deliver(job, EngineError("mistralrs engine is shutting down"))
                _deliver(job, _DONE)
        del runner

    def _serve_chat(self, runner: Any, job: _Job) -> None:
        import mistralrs as M

        stream = runner.send_chat_completion_request(M.ChatCompletionRequest(**job.params))
        try:
            for chunk in stream:
                if job.gone:
                    break  # dropping the stream ends the sequence inside mistral.rs
                choice = chunk.choices[0] if chunk.choices else None
                usage = chunk.usage
                piece = _Piece(
                    text=choice.delta.content if choice is not None else None,
                    finish_reason=choice.finish_reason if choice is not None else None,
                    usage=(usage.prompt_tokens, usage.completion_tokens) if usage is not None else None,
                    logprobs=_logprobs(choice.logprobs) if choice is not None and choice.logprobs is not None else None,
                )
                _deliver(job, piece)
        finally:
            del stream

    def _serve_completion(self, runner: Any, job: _Job) -> None:
        import mistralrs as M

        params = dict(job.params)
        prompt = params["prompt"]
        if isinstance(prompt, list):  # token ids
            params["prompt"] = runner.detokenize_text(prompt, False)
        resp = runner.send_completion_request(M.CompletionRequest(**params))
        choice = resp.choices[0]
        usage = resp.usage
        _deliver(job, _Piece(text=choice.text, finish_reason=choice.finish_reason,
                             usage=(usage.prompt_tokens, usage.completion_tokens) if usage is not None else None))

    # -- the asyncio side ---------------------------------------------------------------------
    async def generate(self, request: ChatCompletionRequest | CompletionRequest,
                       context: Context) -> AsyncIterator[dict[str, Any]]:
        if self._thread is None:
            raise EngineError("mistralrs engine is not started")
        if isinstance(request, ChatCompletionRequest):
            kind, params = "chat", self._chat_params(request)
            chunks: ChatChunks | CompletionChunks = ChatChunks(request.model, context.id)
        else:
            kind, params = "completion", self._completion_params(request)
            chunks = CompletionChunks(request.model, context.id)
        job = _Job(kind, params, context, asyncio.Queue(), asyncio.get_running_loop())
        self._jobs.put(job)
        finished = False
        try:
            while True:
                item = await job.out.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                if item.usage is not None:
                    context.prompt_tokens, context.completion_tokens = item.usage
                elif item.text:
                    context.completion_tokens += 1  # one chunk per token; the final usage corrects it
                if not item.text and item.finish_reason is None:
                    continue
                chunk = chunks.delta(item.text or None, _finish_reason(item.finish_reason))
                if item.logprobs is not None and chunk["choices"]:
                    chunk["choices"][0]["logprobs"] = {"content": [item.logprobs]}
                yield chunk
                if item.finish_reason is not None:
                    finished = True
            if not finished and not context.is_stopped:
                yield chunks.delta(None, "stop")
        finally:
            job.cancelled = True  # the worker skips it, or drops its stream at the next chunk

    def _sampling(self, req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
        nv = req.nvext
        p: dict[str, Any] = {"model": "default"}
        temperature = req.temperature
        if nv is not None and nv.greed_sampling:
            temperature = 0.0
        if temperature is not None:
            p["temperature"] = float(temperature)
        if req.top_p is not None:
            p["top_p"] = float(req.top_p)
        top_k = req.top_k if req.top_k is not None else (nv.top_k if nv else None)
        if top_k is not None and top_k > 0:
            p["top_k"] = int(top_k)
        if req.min_p:
            p["min_p"] = float(req.min_p)
        if req.presence_penalty:
            p["presence_penalty"] = float(req.presence_penalty)
        if req.frequency_penalty:
            p["frequency_penalty"] = float(req.frequency_penalty)
        rep = req.repetition_penalty if req.repetition_penalty is not None else (nv.repetition_penalty if nv else None)
        if rep is not None and rep != 1.0:
            p["repetition_penalty"] = float(rep)
        max_tokens = max_tokens_of(req)
        if max_tokens is not None:
            p["max_tokens"] = int(max_tokens)
        stops = stop_list(req.stop)
        if stops:
            p["stop_seqs"] = stops
        if ignore_eos(req):
            p["ignore_eos"] = True
        if req.seed is not None:
            log.debug("mistralrs has no per-request seed; request seed %s ignored (use --extra-engine-args "
                      "'{\"seed\": N}' for a fixed engine seed)", req.seed)
        grammar = _grammar(req)
        if grammar is not None:
            p["grammar"], p["grammar_type"] = grammar
        return p

    def _chat_params(self, req: ChatCompletionRequest) -> dict[str, Any]:
        if req.tools:
            raise RequestError("out=mistralrs does not support 'tools' in this version", param="tools")
        messages = []
        for m in req.messages:
            role = "system" if m.role == "developer" else m.role
            messages.append({"role": role, "content": content_text(m.content)})
        p = self._sampling(req)
        p["messages"] = messages
        p["stream"] = True
        if req.logprobs:
            p["logprobs"] = True
            if req.top_logprobs:
                p["top_logprobs"] = int(req.top_logprobs)
        kwargs = req.chat_template_kwargs or {}
        if isinstance(kwargs.get("enable_thinking"), bool):
            p["enable_thinking"] = kwargs["enable_thinking"]
        return p

    def _completion_params(self, req: CompletionRequest) -> dict[str, Any]:
        prompt = req.prompt
        if isinstance(prompt, list):
            if all(isinstance(t, int) for t in prompt):
                pass  # token ids: detokenized on the worker
            elif len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            else:
                raise RequestError("Send one request per prompt: several prompts in one completions "
                                   "request are not supported", param="prompt")
        p = self._sampling(req)
        p["prompt"] = prompt
        if req.echo:
            p["echo_prompt"] = True
        if req.suffix:
            p["suffix"] = req.suffix
        return p


# -- helpers ------------------------------------------------------------------------------------

def _deliver(job: _Job, item: Any) -> None:
    try:
        job.loop.call_soon_threadsafe(job.out.put_nowait, item)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    if reason in ("stop", "length", "tool_calls", "content_filter"):
        return reason
    if reason.lower().startswith("cancel"):
        return "stop"
    return reason


def _to_error(e: BaseException) -> Exception:
    text = _first_line(e)
    if isinstance(e, ValueError):  # the library's request validation (prompt too long, bad values)
        return RequestError(f"mistral.rs: {text}")
    return EngineError(f"mistral.rs failed: {text}")


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def _logprobs(lp: Any) -> dict[str, Any]:
    raw = getattr(lp, "bytes", None)
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(raw) if raw is not None else None,
        "top_logprobs": [_top_logprob(t) for t in (lp.top_logprobs or [])],
    }


def _top_logprob(t: Any) -> dict[str, Any]:
    # mistral.rs gives the token id in ``token`` and its text in ``bytes``
    text = getattr(t, "bytes", None)
    if not isinstance(text, str):
        text = str(getattr(t, "token", ""))
    return {"token": text, "logprob": t.logprob, "bytes": list(text.encode())}


def _grammar(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    nv = req.nvext

    def pick(name: str) -> Any:
        value = getattr(req, name)
        return value if value is not None else (getattr(nv, name) if nv is not None else None)

    if (schema := pick("guided_json")) is not None:
        return (schema if isinstance(schema, str) else json.dumps(schema)), "json_schema"
    if (regex := pick("guided_regex")) is not None:
        return regex, "regex"
    if (grammar := pick("guided_grammar")) is not None:
        return grammar, "lark"
    if (choice := pick("guided_choice")) is not None:
        import re

        return "|".join(re.escape(c) for c in choice), "regex"
    return None


def _patch_rope(config: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of ``config`` with ``rope_theta`` (and ``rope_scaling``) restored, or None if not needed."""

    def fix(cfg: dict[str, Any]) -> bool:
        if "rope_theta" in cfg:
            return False
        params = cfg.get("rope_parameters")
        if not isinstance(params, dict):
            return False
        if "rope_theta" not in params:  # per-layer-type parameters: take the full-attention ones
            inner = [v for v in params.values() if isinstance(v, dict) and "rope_theta" in v]
            if not inner:
                return False
            params = params.get("full_attention", inner[0])
        cfg["rope_theta"] = params["rope_theta"]
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default" and not cfg.get("rope_scaling"):
            cfg["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
        return True

    patched = json.loads(json.dumps(config))
    changed = fix(patched)
    if isinstance(patched.get("text_config"), dict):
        changed = fix(patched["text_config"]) or changed
    return patched if changed else None
