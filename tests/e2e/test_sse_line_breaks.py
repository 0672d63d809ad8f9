"""Streams whose text holds characters that Python's ``str.splitlines()`` takes for line ends (NEL, LINE
SEPARATOR, PARAGRAPH SEPARATOR: JSON may leave them raw), read as many Python clients read SSE, with
httpx's ``iter_lines()``: every ``data:`` line is one whole JSON event and the text comes back whole, on
the chat, completions, Responses and Anthropic Messages streams. (``out=echo_full`` streams the prompt
back.)"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from harness.proc import DynamoRun

pytestmark = pytest.mark.usefixtures("no_default_infra")

TEXT = "one\u2028two\x85three\u2029four"


@pytest.fixture(scope="module")
def frontend() -> Iterator[DynamoRun]:
    with DynamoRun("out=echo_full", "--model-name", "echo", "--enable-anthropic-api") as fe:
        yield fe


def _events(fe: DynamoRun, path: str, body: dict[str, Any]) -> list[Any]:
    """Every ``data:`` line of the stream, parsed: a line that is half an event fails here."""
    events = []
    with httpx.stream("POST", fe.base_url + path, json=body, timeout=30,
                      headers={"x-api-key": "unused", "anthropic-version": "2023-06-01"}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_chat_and_completions_streams_stay_whole(frontend):
    chat = _events(frontend, "/v1/chat/completions",
                   {"model": "echo", "messages": [{"role": "user", "content": TEXT}], "stream": True})
    assert TEXT in "".join(e["choices"][0]["delta"].get("content") or "" for e in chat if e.get("choices"))
    completion = _events(frontend, "/v1/completions", {"model": "echo", "prompt": TEXT, "stream": True})
    assert TEXT in "".join(e["choices"][0].get("text") or "" for e in completion if e.get("choices"))


def test_responses_and_messages_streams_stay_whole(frontend):
    responses = _events(frontend, "/v1/responses", {"model": "echo", "input": TEXT, "stream": True})
    assert TEXT in "".join(e.get("delta") or "" for e in responses if e.get("type") == "response.output_text.delta")
    messages = _events(frontend, "/v1/messages", {"model": "echo", "max_tokens": 200, "stream": True,
                                                  "messages": [{"role": "user", "content": TEXT}]})
    assert TEXT in "".join(e["delta"].get("text") or "" for e in messages if e.get("type") == "content_block_delta")
