"""The request plane's body codec, JSON or msgpack (1.6's ``payload_codec``), priced where our processes pay it.

    PYTHONPATH=src .venv/bin/python -m benchmarks.request_codec [--repeat 200000]

Per request: encoding a preprocessed request (a 2,000-token prompt) on the frontend and decoding it on the
worker. Per item, the two paths a stream item takes back: a token item (``LLMEngineOutput``-like) encoded by
the worker and decoded by the frontend; and a Chat worker's chunk, which the frontend passes to the client as
the JSON bytes it received (``LazyJson``: no decode at all) where msgpack would have it decoded and
re-encoded as JSON for the SSE line. Prints microseconds per operation, best of 5.
"""

from __future__ import annotations

import argparse
import timeit

import msgspec
import orjson

REQUEST = {
    "model": "tiny-chat", "token_ids": list(range(1000, 3000)), "eos_token_ids": [2],
    "stop_conditions": {"max_tokens": 64, "stop": None, "ignore_eos": False, "min_tokens": None},
    "sampling_options": {"temperature": 0.7, "top_p": 0.9, "seed": None, "n": None},
    "output_options": {"logprobs": None, "skip_special_tokens": True}, "annotations": [],
    "routing": {"backend_instance_id": 1234567890123, "dp_rank": None}, "mdc_sum": "abc123",
}
TOKEN_ITEM = {"data": {"data": {"token_ids": [1234], "tokens": None, "text": None, "output_type": "text",
                                "cum_log_probs": None, "log_probs": None, "top_logprobs": None,
                                "finish_reason": None, "index": None}}, "complete_final": False}
CHUNK = {"id": "chatcmpl-1b2c3d", "object": "chat.completion.chunk", "created": 1765100000, "model": "tiny-chat",
         "choices": [{"index": 0, "delta": {"content": " word"}, "finish_reason": None, "logprobs": None}]}


def best(stmt, repeat: int) -> float:
    """Microseconds per call, best of 5 runs of ``repeat`` calls."""
    return min(timeit.repeat(stmt, number=repeat, repeat=5)) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=200_000)
    n = parser.parse_args().repeat
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    req_json, req_mp = orjson.dumps(REQUEST), enc.encode(REQUEST)
    item_json, item_mp = orjson.dumps(TOKEN_ITEM), enc.encode(TOKEN_ITEM)
    chunk_json, chunk_mp = orjson.dumps(CHUNK), enc.encode(CHUNK)
    rows = [
        ("request: encode + decode (2,000 tokens)", best(lambda: orjson.loads(orjson.dumps(REQUEST)), n // 100),
         best(lambda: dec.decode(enc.encode(REQUEST)), n // 100), len(req_json), len(req_mp)),
        ("token item: encode + decode", best(lambda: orjson.loads(orjson.dumps(TOKEN_ITEM)), n),
         best(lambda: dec.decode(enc.encode(TOKEN_ITEM)), n), len(item_json), len(item_mp)),
        ("Chat chunk: worker encodes, frontend forwards as JSON", best(lambda: orjson.dumps(CHUNK), n),
         best(lambda: orjson.dumps(dec.decode(enc.encode(CHUNK))), n), len(chunk_json), len(chunk_mp)),
    ]
    print(f"{'operation':56} {'JSON us':>8} {'msgpack us':>10} {'JSON B':>7} {'msgpack B':>9}")
    for name, j, m, jb, mb in rows:
        print(f"{name:56} {j:8.3f} {m:10.3f} {jb:7d} {mb:9d}")


if __name__ == "__main__":
    main()
