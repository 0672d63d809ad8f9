"""The frontend-wide limit (``--max-inflight`` on in=http): past it a request gets a 503 with Retry-After
and an OpenAI error body at once, and the server serves again as soon as requests finish. The per-worker
limit and the queue in front of workers are in tests/chaos/test_stream_faults.py."""

from __future__ import annotations

import contextlib

import httpx

from harness.proc import DynamoRun


def chat(content: str, stream: bool) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "stream": stream}


def test_past_max_inflight_a_503_with_retry_after_then_serving_again():
    with DynamoRun("out=echo_full", "--model-name", "m", "--max-inflight", "2", delay_ms=20) as server:
        url = server.api_url + "/chat/completions"
        with contextlib.ExitStack() as held, httpx.Client(timeout=30) as client:
            readers = []  # kept: a dropped line iterator closes its response
            for _ in range(2):  # two long streams in progress
                resp = held.enter_context(client.stream("POST", url, json=chat("x" * 500, True)))
                assert resp.status_code == 200
                readers.append(resp.iter_lines())
                next(readers[-1])
            refused = httpx.post(url, json=chat("hi", False), timeout=10)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "service_unavailable" and "limit 2" in error["message"]
        # the held streams were closed: room again
        ok = httpx.post(url, json=chat("hi", False), timeout=10)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "hi"
        # counted as a rejection; the body was not read, so the model label is empty
        metrics = httpx.get(server.base_url + "/metrics", timeout=5).text
        assert 'dynamo_frontend_model_rejection_total{endpoint="chat_completions",model=""} 1.0' in metrics


def test_embeddings_and_responses_are_refused_and_counted_like_chat():
    """One gate for every route that runs an engine: past ``--max-inflight`` /v1/embeddings and /v1/responses
    get the same 503 (status, Retry-After, OpenAI error body) as chat, counted in the same metric under
    their own endpoint."""
    with DynamoRun("out=echo_full", "--model-name", "m", "--max-inflight", "2", delay_ms=20) as server:
        with contextlib.ExitStack() as held, httpx.Client(timeout=30) as client:
            readers = []
            for _ in range(2):
                resp = held.enter_context(client.stream("POST", server.api_url + "/chat/completions",
                                                        json=chat("x" * 500, True)))
                assert resp.status_code == 200
                readers.append(resp.iter_lines())
                next(readers[-1])
            refusals = {}
            for path, body in (("/chat/completions", chat("hi", False)),
                               ("/embeddings", {"model": "m", "input": "hi"}),
                               ("/responses", {"model": "m", "input": "hi"}),
                               ("/responses", {"model": "m", "input": "hi", "stream": True})):
                refused = httpx.post(server.api_url + path, json=body, timeout=10)
                assert refused.status_code == 503, (path, refused.text)
                assert refused.headers["retry-after"] == "1", path
                assert refused.headers["content-type"].startswith("application/json"), path
                refusals[path] = refused.json()
        assert refusals["/embeddings"] == refusals["/responses"] == refusals["/chat/completions"]
        error = refusals["/chat/completions"]["error"]
        assert error["type"] == "service_unavailable" and error["code"] == 503 and "limit 2" in error["message"]
        metrics = httpx.get(server.base_url + "/metrics", timeout=5).text
        for endpoint, n in (("chat_completions", 1), ("embeddings", 1), ("responses", 2)):
            assert f'dynamo_frontend_model_rejection_total{{endpoint="{endpoint}",model=""}} {n}.0' in metrics, endpoint
