"""Test engine (pystr): what it does depends on the last user message."""

import asyncio
import json
import os
import sys
import time

STATE = {"initialized": False}


async def initialize(args):
    # awaited before serving starts, on the loop that later runs generate()
    await asyncio.sleep(0)
    STATE["initialized"] = True
    STATE["loop"] = id(asyncio.get_running_loop())


def chunk(text, finish=None):
    return {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1700000000,
            "model": "behaviour", "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                                               "finish_reason": finish}]}


def event(text):
    path = os.environ.get("DYN_TEST_EVENTS")
    if path:
        with open(path, "a") as f:
            f.write(text + "\n")


async def generate(request):
    assert STATE["initialized"], "initialize() was not awaited first"
    assert STATE["loop"] == id(asyncio.get_running_loop()), "generate() runs on another loop"
    messages = request["messages"]
    prompt = messages[-1]["content"]
    if prompt == "raise":
        raise ValueError("boom requested")
    if prompt == "raise-mid":
        yield chunk("partial")
        raise RuntimeError("mid-stream failure")
    if prompt == "nondict":
        yield chunk("ok so far")
        yield "just a string"
        return
    if prompt == "notjson":
        yield {"choices": [{"index": 0, "delta": {"content": "x"}}], "bad": {1, 2}}
        return
    if prompt == "exit":
        sys.exit(3)
    if prompt == "echo-request":
        yield chunk(json.dumps(request, sort_keys=True), "stop")
        return
    if prompt == "block":
        event("blocking")
        time.sleep(3)  # noqa: ASYNC251 - a badly behaved engine: blocks its loop
        event("unblocked")
        yield chunk("unblocked", "stop")
        return
    if prompt.startswith("slow"):
        tag = prompt
        event(f"start {tag}")
        try:
            for i in range(100):
                yield chunk(f"{i} ")
                await asyncio.sleep(0.1)
            yield chunk("", "stop")
        except GeneratorExit:
            event(f"generator-exit {tag}")
            raise
        except asyncio.CancelledError:
            event(f"cancelled {tag}")
            raise
        finally:
            event(f"closed {tag}")
        return
    for word in ["Hello", " from", " the", " behaviour", " engine."]:
        yield chunk(word)
    yield chunk("", "stop")
