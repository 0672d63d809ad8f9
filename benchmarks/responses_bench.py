#!/usr/bin/env python3
"""What ``/v1/responses`` costs on top of ``/v1/chat/completions`` for the same streamed answer.

    PYTHONPATH=src .venv/bin/python -m benchmarks.responses_bench [--rounds 7] [--words 300]

1. In-process: microseconds per delta for ``OutputItems.feed`` plus serialising the events it makes (what
   the responses layer adds per token), against building and serialising a chat chunk (``ChatChunks``),
   over a Qwen3-shaped answer: reasoning deltas, text deltas, one call's argument fragments.
2. End to end: one ``out=echo_core`` server on the tiny test model (``DYN_TOKEN_ECHO_DELAY_MS=0``, so the
   engine costs next to nothing; a chat template without an end-of-turn token, so the whole prompt is
   echoed), streaming the same echoed answer (a few tokens per word of the tiny vocabulary) as chat
   chunks and as Responses events, one request at a time over a keep-alive connection; rounds alternate
   between the two, and the median time per request of each is printed with the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from dynamo.frontend.http.responses_output import OutputItems
from dynamo.llm.chunks import ChatChunks
from harness.proc import DynamoRun
from harness.tiny_model import build_tiny_hf_model


def deltas() -> list[dict]:
    out: list[dict] = [{"reasoning_content": f"thought {i} "} for i in range(150)]
    out += [{"content": f"word{i} "} for i in range(100)]
    out.append({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]})
    out += [{"tool_calls": [{"index": 0, "function": {"arguments": f'"k{i}": {i}, '}}]} for i in range(50)]
    return out


def in_process(rounds: int) -> None:
    ds = deltas()
    resp, chat = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(20):
            out = OutputItems()
            for d in ds:
                for kind, fields in out.feed(d):
                    orjson.dumps({"type": kind, "sequence_number": 0, **fields})
            out.finish("completed")
        resp.append((time.perf_counter() - t) / (20 * len(ds)) * 1e6)
        t = time.perf_counter()
        for _ in range(20):
            cc = ChatChunks("m")
            for d in ds:
                orjson.dumps(cc.parsed(d))
        chat.append((time.perf_counter() - t) / (20 * len(ds)) * 1e6)
    print(f"in-process, per delta: responses items+events {statistics.median(resp):.2f} us "
          f"(min {min(resp):.2f}, max {max(resp):.2f}); chat chunk {statistics.median(chat):.2f} us "
          f"(min {min(chat):.2f}, max {max(chat):.2f})")


def end_to_end(rounds: int, words: int) -> None:
    text = " ".join(f"token{i % 50}" for i in range(words))
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_hf_model(Path(tmp))
        template = Path(tmp) / "plain.jinja"  # no end-of-turn token, so echo_core echoes the whole prompt
        template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
        with DynamoRun("out=echo_core", str(model), "--model-name", "m", "--chat-template", str(template),
                       env={"DYN_TOKEN_ECHO_DELAY_MS": "0"}) as srv, \
                httpx.Client(base_url=srv.api_url, timeout=60) as c:
            bodies = {
                "chat": ("/chat/completions", {"model": "m", "messages": [{"role": "user", "content": text}],
                                               "stream": True}),
                "responses": ("/responses", {"model": "m", "input": text, "stream": True}),
            }
            times: dict[str, list[float]] = {k: [] for k in bodies}
            sizes: dict[str, int] = {}
            for name, (path, body) in bodies.items():  # warm-up
                with c.stream("POST", path, json=body) as r:
                    sizes[name] = sum(len(b) for b in r.iter_bytes())
            for _ in range(rounds):
                for name, (path, body) in bodies.items():
                    t = time.perf_counter()
                    for _ in range(5):
                        with c.stream("POST", path, json=body) as r:
                            for _ in r.iter_bytes():
                                pass
                    times[name].append((time.perf_counter() - t) / 5 * 1e3)
            chat, resp = statistics.median(times["chat"]), statistics.median(times["responses"])
            for name in bodies:
                print(f"{name:9s} median {statistics.median(times[name]):.1f} ms per streamed request "
                      f"(min {min(times[name]):.1f}, max {max(times[name]):.1f}; {sizes[name]} bytes)")
            print(f"responses / chat: {resp / chat:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--words", type=int, default=300)
    args = ap.parse_args()
    in_process(args.rounds)
    end_to_end(args.rounds, args.words)


if __name__ == "__main__":
    main()
