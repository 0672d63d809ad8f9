"""The HTTP service's own endpoints and wire format: SSE, annotations, /health, /live, /metrics."""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harness.proc import DynamoRun


def metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    """All samples of /metrics as {(name, sorted labels): value}."""
    r = httpx.get(base_url + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def sse_events(r: httpx.Response) -> list[dict]:
    """Parse an SSE body into events: {'event': name or None, 'data': [...], 'comments': [...]}."""
    events, cur = [], {"event": None, "data": [], "comments": []}
    for line in r.iter_lines():
        if line == "":
            if cur["event"] or cur["data"] or cur["comments"]:
                events.append(cur)
            cur = {"event": None, "data": [], "comments": []}
        elif line.startswith(":"):
            cur["comments"].append(line[1:].strip())
        elif line.startswith("event:"):
            cur["event"] = line[6:].strip()
        elif line.startswith("data:"):
            cur["data"].append(line[5:].strip())
    if cur["event"] or cur["data"] or cur["comments"]:
        events.append(cur)
    return events


def test_live_health_models(core_server: DynamoRun):
    base = core_server.base_url
    r = httpx.get(base + "/live")
    assert (r.status_code, r.json()["status"]) == (200, "live")
    r = httpx.get(base + "/health")
    assert r.status_code == 200
    assert r.json()["status"] == "healthy"
    assert "tiny-chat" in r.json()["models"]
    r = httpx.get(base + "/v1/models")
    body = r.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"]) for m in body["data"]] == [("tiny-chat", "model")]
    assert isinstance(body["data"][0]["created"], int) and body["data"][0]["owned_by"]


def test_sse_wire_format(full_server: DynamoRun):
    body = {"model": "echo", "messages": [{"role": "user", "content": "ab"}], "stream": True}
    with httpx.stream("POST", full_server.api_url + "/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert all(e["event"] is None for e in events)
    datas = [e["data"][0] for e in events]
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * len(chunks)
    assert all(c["id"].startswith("chatcmpl-") for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "ab"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_unary_has_no_stream_framing(full_server: DynamoRun):
    r = httpx.post(full_server.api_url + "/completions", json={"model": "echo", "prompt": "xyz"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "xyz"


def test_formatted_prompt_annotation_is_an_sse_event(core_server: DynamoRun):
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 3, "nvext": {"annotations": ["formatted_prompt", "token_ids"], "ignore_eos": True}}
    with httpx.stream("POST", core_server.api_url + "/chat/completions", json=body) as r:
        events = sse_events(r)
    named = {e["event"]: e for e in events if e["event"]}
    prompt = json.loads(named["formatted_prompt"]["comments"][0])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    token_ids = json.loads(json.loads(named["token_ids"]["comments"][0]))
    assert token_ids[0] == 1 and len(token_ids) > 10
    # the annotations come before the generated chunks, which are unaffected
    first_data = next(i for i, e in enumerate(events) if e["data"])
    assert all(e["event"] for e in events[:first_data])
    assert events[-1]["data"] == ["[DONE]"]
    chunks = [json.loads(e["data"][0]) for e in events if e["data"] and e["data"][0] != "[DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "<|im_start|>sy"


def test_annotations_do_not_change_unary_responses(core_server: DynamoRun):
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "nvext": {"annotations": ["formatted_prompt"], "ignore_eos": True}}
    r = httpx.post(core_server.api_url + "/chat/completions", json=body)
    assert r.json()["choices"][0]["message"]["content"] == "<|im_start|>sy"


def test_request_id_header_names_the_response(core_server: DynamoRun):
    r = httpx.post(core_server.api_url + "/completions", json={"model": "tiny-chat", "prompt": "x"},
                   headers={"x-dynamo-request-id": "my-request-42"})
    assert r.json()["id"] == "cmpl-my-request-42"


def test_metrics_move_after_requests(core_server: DynamoRun):
    base = core_server.base_url
    before = metrics(base)
    chat = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "nvext": {"ignore_eos": True}}
    assert httpx.post(base + "/v1/chat/completions", json={**chat, "stream": True}).status_code == 200
    assert httpx.post(base + "/v1/chat/completions", json=chat).status_code == 200
    assert httpx.post(base + "/v1/completions", json={"model": "tiny-chat", "prompt": "hello"}).status_code == 200
    assert httpx.post(base + "/v1/chat/completions", json={**chat, "temperature": 0.5, "top_p": 7}).status_code == 400
    after = metrics(base)

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    total = "dynamo_frontend_requests_total"
    common = {"model": "tiny-chat"}
    ok = {"status": "success", "error_type": "", **common}
    assert delta(total, endpoint="chat_completions", request_type="stream", **ok) == 1
    assert delta(total, endpoint="chat_completions", request_type="unary", **ok) == 1
    assert delta(total, endpoint="completions", request_type="unary", **ok) == 1
    assert delta("dynamo_frontend_requests_started_total", endpoint="completions", request_type="unary", **common) == 1
    assert sample(after, "dynamo_frontend_inflight_requests", **common) == 0
    assert sample(after, "dynamo_frontend_active_requests", **common) == 0
    # the token counter agrees with the histogram of output lengths
    assert delta("dynamo_frontend_output_tokens_total", **common) == delta("dynamo_frontend_output_sequence_tokens_sum",
                                                                          **common)
    for hist in ("request_duration_seconds", "time_to_first_token_seconds", "input_sequence_tokens",
                 "output_sequence_tokens"):
        assert delta(f"dynamo_frontend_{hist}_count", **common) >= 3, hist
    assert delta("dynamo_frontend_inter_token_latency_seconds_count", **common) > 10
    assert delta("dynamo_frontend_output_sequence_tokens_sum", **common) > 30
    assert delta("dynamo_frontend_input_sequence_tokens_sum", **common) > 30


def test_metric_model_label_is_lowercased(tiny_model):
    with DynamoRun("out=echo_core", str(tiny_model), "--model-name", "Tiny-Chat") as srv:
        r = httpx.post(srv.api_url + "/completions", json={"model": "Tiny-Chat", "prompt": "hi"})
        assert r.status_code == 200
        m = metrics(srv.base_url)
        assert sample(m, "dynamo_frontend_requests_total", model="tiny-chat", endpoint="completions",
                      request_type="unary", status="success", error_type="") == 1


def test_unknown_model_is_not_counted(full_server: DynamoRun):
    before = metrics(full_server.base_url)
    r = httpx.post(full_server.api_url + "/completions", json={"model": "ghost", "prompt": "hi"})
    assert r.status_code == 404
    after = metrics(full_server.base_url)
    assert not any(labels and dict(labels).get("model") == "ghost" for _, labels in after)
    assert sum(v for (n, _), v in after.items() if n == "dynamo_frontend_requests_total") == \
        sum(v for (n, _), v in before.items() if n == "dynamo_frontend_requests_total")


def test_metrics_prefix_from_environment():
    with DynamoRun("out=echo_full", "--model-name", "echo", env={"DYN_METRICS_PREFIX": "my-app"}) as srv:
        assert httpx.post(srv.api_url + "/completions", json={"model": "echo", "prompt": "hi"}).status_code == 200
        m = metrics(srv.base_url)
        names = {n for n, _ in m}
        assert "my_app_requests_total" in names
        assert "my_app_inflight_requests" in names
        assert not any(n.startswith("dynamo_frontend") for n in names)
        assert sample(m, "my_app_requests_total", model="echo", endpoint="completions",
                      request_type="unary", status="success", error_type="") == 1


def test_invalid_echo_delay_falls_back_with_a_warning():
    with DynamoRun("out=echo_full", "--model-name", "echo", env={"DYN_TOKEN_ECHO_DELAY_MS": "fast"}) as srv:
        r = httpx.post(srv.api_url + "/completions", json={"model": "echo", "prompt": "still works"})
        assert r.json()["choices"][0]["text"] == "still works"
        assert "DYN_TOKEN_ECHO_DELAY_MS" in srv.stderr_text()


def test_the_matched_stop_string_is_named_streamed_and_unary(core_server: DynamoRun):
    """vLLM's ``stop_reason``: the stop string that ended the choice, on the last chunk and on the unary
    choice alike (the echo engine returns the prompt, so the stop string is met)."""
    body = {"model": "tiny-chat", "prompt": "hello world again", "stop": ["world"], "max_tokens": 20}
    unary = httpx.post(core_server.api_url + "/completions", json=body).json()["choices"][0]
    assert unary["finish_reason"] == "stop" and unary["stop_reason"] == "world"
    assert "world" not in unary["text"]
    with httpx.stream("POST", core_server.api_url + "/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(e["data"][0]) for e in sse_events(r) if e["data"] and e["data"][0] != "[DONE]"]
    assert chunks[-1]["choices"][0]["stop_reason"] == "world"
    no_stop = httpx.post(core_server.api_url + "/completions", json={**body, "stop": None}).json()["choices"][0]
    assert "stop_reason" not in no_stop
