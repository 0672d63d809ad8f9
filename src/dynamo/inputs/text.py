"""``in=text`` (interactive chat with history) and ``in=stdin`` (one prompt from stdin, one answer).

On a terminal the prompt is a prompt_toolkit line editor (history with the arrow keys); Ctrl-C or Ctrl-D
at the prompt ends the session, and so does Ctrl-C during an answer (the engine is stopped, exit code 0).  When stdin is not a
terminal, ``in=text`` reads one user turn per line, which makes scripted conversations possible.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from dynamo.errors import EngineError, RequestError
from dynamo.llm.chunks import chunk_text
from dynamo.llm.engine import Context
from dynamo.llm.pipeline import ServedModel
from dynamo.inputs.chat_request import chat_request

log = logging.getLogger(__name__)


async def answer(model: ServedModel, messages: list[dict[str, Any]], *, ignore_eos: bool, out: Any = None) -> str:
    """Stream one answer to ``out`` (stdout) and return its text."""
    out = out or sys.stdout
    req, raw = chat_request(model.name, messages, ignore_eos=ignore_eos)
    ctx = Context()
    parts: list[str] = []
    stream = model.chat(req, raw, ctx)
    try:
        async for chunk in stream:
            if type(chunk) is not dict:
                continue
            text = chunk_text(chunk)
            if text:
                parts.append(text)
                out.write(text)
                out.flush()
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    return "".join(parts)


async def run_stdin(model: ServedModel, *, ignore_eos: bool) -> int:
    loop = asyncio.get_running_loop()
    prompt = await loop.run_in_executor(None, sys.stdin.read)
    if not prompt.strip():
        print("Error: nothing on stdin to send", file=sys.stderr)
        return 1
    try:
        await answer(model, [{"role": "user", "content": prompt}], ignore_eos=ignore_eos)
    except (RequestError, EngineError) as e:
        print(f"\nError: {e}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


async def run_text(model: ServedModel, *, ignore_eos: bool) -> int:
    history: list[dict[str, Any]] = []
    read = _terminal_reader() if sys.stdin.isatty() else _pipe_reader()
    if sys.stdin.isatty():
        print(f"Chatting with {model.name}. Ctrl-D or Ctrl-C at the prompt to exit.", file=sys.stderr)
    while True:
        try:
            line = await read()
        except (EOFError, KeyboardInterrupt):
            break
        if line is None:
            break
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        task = asyncio.ensure_future(answer(model, history, ignore_eos=ignore_eos))
        try:
            reply = await task
        except (RequestError, EngineError) as e:
            print(f"\nError: {e}", file=sys.stderr)
            history.pop()
            continue
        except KeyboardInterrupt:
            task.cancel()
            print("\n[interrupted]", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})
        sys.stdout.write("\n")
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


def _terminal_reader():
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import InMemoryHistory

    session: PromptSession[str] = PromptSession(history=InMemoryHistory())

    async def read() -> str | None:
        # handle_sigint=False: prompt_toolkit would otherwise replace the loop's SIGINT handler (ours) and
        # not put it back, so a Ctrl-C during a later answer would be swallowed.  Ctrl-C at the prompt is
        # a key press in raw mode and still ends the session (KeyboardInterrupt).
        return await session.prompt_async("User › ", handle_sigint=False)

    return read


def _pipe_reader():
    loop = asyncio.get_running_loop()

    async def read() -> str | None:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return None
        return line.rstrip("\n")

    return read
