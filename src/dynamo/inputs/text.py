"""``in=text`` (interactive chat with history) and ``in=stdin`` (one prompt from stdin, one answer).

On a terminal the prompt is a prompt_toolkit line editor (history with the arrow keys); Ctrl-C or Ctrl-D
at the prompt ends the session, and so does Ctrl-C during an answer (the engine is stopped, exit code 0).
When stdin is not a terminal, ``in=text`` reads one user turn per line, which makes scripted conversations
possible.

Piped stdin is read with ``os.read`` in a daemon thread: a read blocked on a pipe nobody writes to must
not keep the process alive after Ctrl-C or SIGTERM (the default executor is joined at exit, and a thread
inside ``sys.stdin.read`` holds the stream's lock that interpreter shutdown wants).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from typing import Any, Callable, TypeVar

from dynamo.errors import EngineError, RequestError
from dynamo.inputs.chat_request import chat_request
from dynamo.llm.chunks import chunk_text
from dynamo.llm.engine import Context
from dynamo.llm.pipeline import ServedModel

log = logging.getLogger(__name__)
T = TypeVar("T")


async def _in_daemon_thread(fn: Callable[[], T]) -> T:
    """Run a blocking call in a thread that never delays exit (unlike the loop's default executor)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def deliver(result: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, exc = fn(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(deliver, result, exc)
        except RuntimeError:  # the loop is gone: nobody is waiting any more
            pass

    threading.Thread(target=run, name="stdin-reader", daemon=True).start()
    return await fut


class StdinReader:
    """Reads file descriptor 0 (pipe, file or terminal) without the ``sys.stdin`` object."""

    def __init__(self, fd: int = 0):
        self._fd = fd
        self._buf = b""
        self._eof = False

    def _read_chunk(self) -> bytes:
        try:
            return os.read(self._fd, 1 << 16)
        except OSError:  # closed or unreadable stdin reads as end of input
            return b""

    async def _fill(self) -> bool:
        chunk = await _in_daemon_thread(self._read_chunk)
        if not chunk:
            self._eof = True
            return False
        self._buf += chunk
        return True

    async def read_all(self) -> str:
        while not self._eof:
            await self._fill()
        data, self._buf = self._buf, b""
        return _decode(data)

    async def readline(self) -> str | None:
        """The next line without its line ending, or None at the end of input."""
        while b"\n" not in self._buf and not self._eof:
            await self._fill()
        if not self._buf:
            return None
        line, _, self._buf = self._buf.partition(b"\n")
        return _decode(line).removesuffix("\r")


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n")


async def answer(model: ServedModel, messages: list[dict[str, Any]], *, ignore_eos: bool, out: Any = None) -> str:
    """Stream one answer to ``out`` (stdout) and return its text."""
    out = out or sys.stdout
    req, raw = chat_request(model.name, messages, ignore_eos=ignore_eos)
    ctx = Context()
    parts: list[str] = []
    stream = model.chat(req, raw, ctx)
    try:
        async for chunk in stream:
            if not isinstance(chunk, dict):
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
    prompt = await StdinReader().read_all()
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
    return StdinReader().readline
