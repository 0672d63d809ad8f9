"""The parsing stage over the post-processor's text: reasoning first, then tool calls in the content.

It runs where detokenization runs: in a remote Backend worker (which sends the resulting deltas in its
items' ``deltas`` field) or in the frontend for a local engine, so local and ``out=dyn`` serving give
the same chunks.  A frontend passes a worker's deltas through and only parses text nobody parsed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from dynamo.llm.parsers.base import Delta, ToolCallParser
from dynamo.llm.parsers.harmony import HarmonyParser
from dynamo.llm.parsers.reasoning import ThinkParser
from dynamo.llm.parsers.registry import REASONING_PARSERS, TOOL_CALL_PARSERS
from dynamo.llm.parsers.tool_calls.forced import NamedFunctionParser, RequiredCallsParser
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest, ResponseParsing

if TYPE_CHECKING:
    from dynamo.llm.tokenizer import Tokenizer


class ResponseParser:
    """Text in, OpenAI deltas out (pure: no I/O, no clock)."""

    __slots__ = ("_reasoning", "_tools", "_single", "called")

    _reasoning: "ThinkParser | HarmonyParser | None"

    def __init__(self, opts: ResponseParsing):
        self._reasoning = None
        if opts.reasoning_parser == "gpt_oss" or opts.tool_call_parser == "harmony":
            # one parser for both: harmony channels carry reasoning, answer and calls alike
            self._reasoning = HarmonyParser(tools=opts.tool_call_parser == "harmony" and not opts.forced_tool)
            opts = msgspec.structs.replace(opts, reasoning_parser=None, tool_call_parser=None)
        elif opts.reasoning_parser:
            make = REASONING_PARSERS[opts.reasoning_parser]
            self._reasoning = make(opts.reasoning_started) if opts.reasoning_started is not None else make()
        self._tools: ToolCallParser | None = None
        if opts.forced_tool == "required":
            self._tools = RequiredCallsParser()
        elif opts.forced_tool and opts.forced_tool.startswith("function:"):
            self._tools = NamedFunctionParser(opts.forced_tool[len("function:"):])
        elif opts.tool_call_parser:
            self._tools = TOOL_CALL_PARSERS[opts.tool_call_parser]()
        self._single = opts.parallel_tool_calls is False
        self.called = False

    def feed(self, text: str, final: bool = False) -> list[Delta]:
        if self._reasoning is None:
            staged = [{"content": text}] if text else []
        else:
            staged = self._reasoning.feed(text) if text else []
            if final:
                staged += self._reasoning.finish()
        if self._tools is None:
            return self._calls_seen(staged)  # harmony's calls come from the first stage
        out: list[Delta] = []
        for d in staged:
            if "content" in d:
                out += self._tools.feed(d["content"])
            else:
                out.append(d)
        if final:
            out += self._tools.finish()
        return self._calls_seen(out)

    def _calls_seen(self, deltas: list[Delta]) -> list[Delta]:
        kept = []
        for d in deltas:
            calls = d.get("tool_calls")
            if calls is not None:
                if self._single:  # parallel_tool_calls: false: the first call only
                    calls = [c for c in calls if c["index"] == 0]
                    if not calls:
                        continue
                    d = {"tool_calls": calls}
                self.called = True
            kept.append(d)
        return kept


class ParseStage:
    """One request's parser, wired into a token stream (see module docstring)."""

    __slots__ = ("_parser", "called")

    def __init__(self, opts: ResponseParsing):
        self._parser = ResponseParser(opts)
        self.called = False

    @staticmethod
    def for_request(request: PreprocessedRequest, tokenizer: Tokenizer | None = None) -> "ParseStage | None":
        opts = request.parsing
        if opts is None or not (opts.tool_call_parser or opts.reasoning_parser or opts.forced_tool):
            return None
        stage = ParseStage(opts)
        n = opts.resumed_tokens
        if n and tokenizer is not None and n <= len(request.token_ids):
            # a migrated request: replay what the failed worker generated, so the parser is where that
            # worker's was (inside a <think>, mid-call); what it sent then is not sent again
            ids = request.token_ids
            context = ids[max(0, len(ids) - n - 8): len(ids) - n]
            text = tokenizer.decode(context + ids[len(ids) - n:])[len(tokenizer.decode(context)):]
            stage.parse(text, False)
        return stage

    def parse(self, text: str, final: bool) -> list[Delta]:
        deltas = self._parser.feed(text, final)
        self.called = self._parser.called
        return deltas

    def deltas(self, out: EngineOutput, text: str, final: bool) -> list[Delta]:
        """Frontend: a worker's deltas as sent, else our own parse of the text."""
        if out.deltas is not None:
            for d in out.deltas:
                if "tool_calls" in d:
                    self.called = True
            return out.deltas
        return self.parse(text, final)

    def annotate(self, item: dict[str, Any]) -> dict[str, Any]:
        """Worker: replace an item's text by the deltas parsed from it."""
        item["deltas"] = self.parse(item["text"], item["finish_reason"] is not None)
        item["text"] = ""
        return item

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.called and reason == "stop" else reason
