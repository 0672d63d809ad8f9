"""Bad requests get OpenAI-shaped JSON errors with the right status, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from harness.proc import DynamoRun

CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def http(core_server: DynamoRun):
    with httpx.Client(base_url=core_server.base_url, timeout=30) as client:
        yield client


def assert_openai_error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else err["type"])
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


def assert_still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "<|im_start|>sy"


BAD_REQUESTS = [
    # (path, body as JSON or raw bytes, status, words in the message, param)
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, ["nope"], "model"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, ["nope"], "model"),
    ("/v1/chat/completions", b'{"model": "tiny-chat", "messages": [', 400, ["JSON"], None),
    ("/v1/chat/completions", b"", 400, ["JSON"], None),
    ("/v1/chat/completions", b"[1, 2, 3]", 400, ["JSON object"], None),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, ["messages"], "messages"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, ["temperature"], "temperature"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 1.5}, 400, ["max_tokens"], "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT["messages"]}, 400, ["model"], "model"),
    ("/v1/chat/completions", {"model": "tiny-chat"}, 400, ["messages"], "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, ["'messages' field cannot be empty"], "messages"),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400,
     ["Error validating temperature: Value 3.0 is out of range [0.0, 2.0]"], "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": -1}, 400, ["top_p"], "top_p"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, ["robot"],
     "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, ["stop"], "stop"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 100000}, 400, ["maximum context length"], "max_tokens"),
    ("/v1/completions", {"model": "tiny-chat"}, 400, ["prompt"], "prompt"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": []}, 400, ["prompt"], "prompt"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": [1, 10**9]}, 400, ["out of vocabulary"], "prompt"),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "frequency_penalty": 9}, 400,
     ["frequency_penalty"], "frequency_penalty"),
]


@pytest.mark.parametrize("path,body,status,needles,param", BAD_REQUESTS)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_bad_request_then_good_request(http: httpx.Client, path, body, status, needles, param, stream):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json={**body, "stream": stream})
    err = assert_openai_error(r, status, *needles)
    if param is not None:
        assert err["param"] == param
    assert_still_serving(http)


def test_wrong_content_type_is_415(http: httpx.Client):
    r = http.post("/v1/chat/completions", content=b"model=x", headers={"content-type": "application/x-www-form-urlencoded"})
    assert_openai_error(r, 415, "Content-Type: application/json")
    assert_still_serving(http)


def test_json_body_with_a_curl_default_content_type_is_accepted(http: httpx.Client):
    # `curl -d '{...}'` sends application/x-www-form-urlencoded
    r = http.post("/v1/completions", content=b'{"model": "tiny-chat", "prompt": "curl"}',
                  headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == "curl"


@pytest.mark.parametrize("method,path", [("GET", "/v1/chat/completions"), ("GET", "/v1/completions"),
                                         ("PUT", "/v1/chat/completions"), ("POST", "/v1/models"),
                                         ("DELETE", "/health")])
def test_wrong_method_is_405(http: httpx.Client, method, path):
    assert_openai_error(http.request(method, path), 405, method)
    assert_still_serving(http)


@pytest.mark.parametrize("path", ["/", "/v1", "/v1/chat", "/v2/chat/completions", "/v1/embeddings/x"])
def test_unknown_path_is_404(http: httpx.Client, path):
    assert_openai_error(http.get(path), 404)
    assert_still_serving(http)


def test_errors_are_json_even_for_a_client_that_sends_garbage_bytes(http: httpx.Client):
    r = http.post("/v1/chat/completions", content=b"\xff\xfe\x00garbage", headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    assert_still_serving(http)


def test_echo_full_needs_a_user_message_last(full_server: DynamoRun):
    with httpx.Client(base_url=full_server.base_url, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={"model": "echo", "messages": [{"role": "assistant", "content": "x"}]})
        assert_openai_error(r, 400, "expected User message")
        r = http.post("/v1/chat/completions", json={"model": "echo", "messages": [{"role": "user", "content": "ok"}]})
        assert r.json()["choices"][0]["message"]["content"] == "ok"


def test_body_over_the_limit_is_413_json(full_server: DynamoRun):
    big = b'{"model": "echo", "messages": [{"role": "user", "content": "' + b"x" * (33 * 1024 * 1024) + b'"}]}'
    with httpx.Client(base_url=full_server.base_url, timeout=60) as http:
        r = http.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
        assert_openai_error(r, 413, "too large")
        r = http.post("/v1/completions", json={"model": "echo", "prompt": "still here"})
        assert r.json()["choices"][0]["text"] == "still here"
