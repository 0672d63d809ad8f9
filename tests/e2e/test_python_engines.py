"""``out=pystr:FILE.py`` and ``out=pytok:FILE.py`` end to end: the real CLI in a subprocess.

The seeds' example engines (tests/e2e/data/seed_*.py, copied unchanged from the docs) must run as they
are; the other engines in tests/e2e/data/ record their arguments or misbehave on request.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import openai
import pytest

from harness.proc import DynamoRun, free_port, run_cli
from harness.wait import wait_until

DATA = Path(__file__).parent / "data"
SENTENCE = "The capital of France is Paris."


class PyEngineServer(DynamoRun):
    """DynamoRun, but with the arguments after ``--`` kept last (they belong to the engine)."""

    def __init__(self, *args: str, engine_args: tuple[str, ...] = (), **kw):
        super().__init__(*args, **kw)
        self.engine_args = list(engine_args)

    def command(self) -> list[str]:
        cmd = super().command()
        return cmd + (["--", *self.engine_args] if self.engine_args else [])


def _client(server: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=30)


def _stream_text(client: openai.OpenAI, model: str, prompt: str) -> tuple[str, list[str | None]]:
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], stream=True
    )
    parts, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    return "".join(parts), reasons


# -- servers (one per module for the engines that many tests share) ----------------------------------


@pytest.fixture(scope="module")
def seed_pystr():
    with PyEngineServer(f"out=pystr:{DATA / 'seed_pystr_engine.py'}", "--model-name", "llama_3.2") as server:
        yield server


@pytest.fixture(scope="module")
def behaviour(tmp_path_factory: pytest.TempPathFactory):
    events = tmp_path_factory.mktemp("events") / "events.txt"
    events.touch()
    with PyEngineServer(
        f"out=pystr:{DATA / 'behaviour_engine.py'}", "--model-name", "behave",
        env={"DYN_TEST_EVENTS": str(events)},
    ) as server:
        server.events = events  # type: ignore[attr-defined]
        yield server


@pytest.fixture(scope="module")
def token_engine(tiny_model: Path):
    with PyEngineServer(f"out=pytok:{DATA / 'token_engine.py'}", str(tiny_model)) as server:
        yield server


# -- pystr: the seeds' example -------------------------------------------------------------------------


def test_seed_pystr_example_streams_through_openai_sdk(seed_pystr: DynamoRun):
    client = _client(seed_pystr)
    assert [m.id for m in client.models.list().data] == ["llama_3.2"]
    text, reasons = _stream_text(client, "llama_3.2", "What is the capital of France?")
    assert text == SENTENCE
    assert reasons[-1] == "stop"


def test_seed_pystr_chunks_reach_the_client_as_yielded(seed_pystr: DynamoRun):
    body = {"model": "llama_3.2", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", seed_pystr.api_url + "/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # as yielded, but for the role: the stream opens with it alone (as OpenAI's do), the first chunk without it
    assert len(chunks) == 9
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]
    assert chunks[1] == {"id": "1", "choices": [{"index": 0, "delta": {"content": "The"}}],
                         "created": 1841762283, "model": "Llama-3.2-3B-Instruct", "system_fingerprint": "local",
                         "object": "chat.completion.chunk"}
    assert chunks[2]["choices"][0]["delta"] == {"content": " capital", "role": "assistant"}  # the rest untouched


def test_seed_pystr_unary(seed_pystr: DynamoRun):
    resp = _client(seed_pystr).chat.completions.create(
        model="llama_3.2", messages=[{"role": "user", "content": "hi"}]
    )
    assert resp.choices[0].message.content == SENTENCE
    assert resp.choices[0].finish_reason == "stop"


def test_seed_pystr_completions_endpoint(seed_pystr: DynamoRun):
    client = _client(seed_pystr)
    stream = client.completions.create(model="llama_3.2", prompt="The capital of France", stream=True)
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == SENTENCE
    unary = client.completions.create(model="llama_3.2", prompt="Q: capital of France?\nA:", echo=True)
    assert unary.choices[0].text == "Q: capital of France?\nA:" + SENTENCE
    assert unary.choices[0].finish_reason == "stop"


def test_seed_pystr_stdin():
    result = run_cli([f"out=pystr:{DATA / 'seed_pystr_engine.py'}"], input="hi\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == SENTENCE + "\n"


def test_seed_pystr_text_mode_piped_lines():
    result = run_cli(["in=text", f"out=pystr:{DATA / 'seed_pystr_engine.py'}"], input="one\ntwo\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(SENTENCE) == 2


# -- the argument list ---------------------------------------------------------------------------------


def _argv_engine_in(folder: Path) -> Path:
    shutil.copy(DATA / "argv_engine.py", folder / "my_engine.py")
    shutil.copy(DATA / "argv_engine_helper.py", folder / "argv_engine_helper.py")
    return folder / "my_engine.py"


def test_argv_is_exactly_as_documented(tmp_path: Path, tiny_model: Path):
    """The seeds' example: the same command line, our tiny model folder in place of /opt/models/..."""
    _argv_engine_in(tmp_path)
    record = tmp_path / "argv.json"
    model = str(tiny_model) + "/"
    result = run_cli(
        ["out=pystr:my_engine.py", model, "--model-name", "llama_3.2", "--tensor-parallel-size", "4",
         "--", "-n", "1"],
        input="hi\n", cwd=tmp_path, env={"DYN_TEST_ARGV_OUT": str(record)},
    )
    assert result.returncode == 0, result.stderr
    expected = ["my_engine.py", "--model-path", model, "--model-name", "llama_3.2", "--http-port", "8080",
                "--tensor-parallel-size", "4", "--base-gpu-id", "0", "--num-nodes", "1", "--node-rank", "0",
                "-n", "1"]
    assert result.stdout.splitlines()[0] == f"MAIN: {expected}"  # the __main__ block ran, as documented
    assert "argv ok" in result.stdout
    seen = json.loads(record.read_text())
    assert seen["main"] == expected
    assert seen["initialize"] == expected[1:]  # initialize(args) gets the arguments without the file
    assert seen["argv_at_initialize"] == expected
    assert seen["helper"] == "helper imported"  # the engine's folder is on sys.path


def test_argv_with_multinode_flags_and_extras(tmp_path: Path, tiny_model: Path):
    _argv_engine_in(tmp_path)
    record = tmp_path / "argv.json"
    result = run_cli(
        ["out=pystr:my_engine.py", "--num-nodes", "2", "--node-rank", "1", "--leader-addr", "10.0.0.1:5000",
         "--model-config", str(tiny_model), "--base-gpu-id", "3", "--http-port", "9123",
         "--", "-n", "42", "--custom-arg", "Orange", "--yes"],
        input="hi\n", cwd=tmp_path, env={"DYN_TEST_ARGV_OUT": str(record)},
    )
    assert result.returncode == 0, result.stderr
    # no model: no --model-path, and the served name is the default
    assert json.loads(record.read_text())["main"] == [
        "my_engine.py", "--model-name", "dynamo", "--http-port", "9123", "--tensor-parallel-size", "1",
        "--base-gpu-id", "3", "--num-nodes", "2", "--node-rank", "1", "--leader-addr", "10.0.0.1:5000",
        "--model-config", str(tiny_model), "-n", "42", "--custom-arg", "Orange", "--yes",
    ]


def test_argv_over_http_has_the_real_port(tmp_path: Path):
    _argv_engine_in(tmp_path)
    record = tmp_path / "argv.json"
    # a port named on the command line (the others bind port 0, which the engine would be told instead)
    with PyEngineServer(f"out=pystr:{tmp_path / 'my_engine.py'}", "--model-name", "argv", port=free_port(),
                        env={"DYN_TEST_ARGV_OUT": str(record)}, engine_args=("--flag",)) as server:
        text, _ = _stream_text(_client(server), "argv", "hi")
        port = server.port
    assert text == "argv ok"
    argv = json.loads(record.read_text())["main"]
    assert argv[argv.index("--http-port") + 1] == str(port)
    assert argv[-1] == "--flag"


# -- errors: per request, and the server keeps serving ------------------------------------------------


def test_raise_before_first_chunk_is_a_500_then_next_request_fine(behaviour: DynamoRun):
    client = _client(behaviour)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="behave", messages=[{"role": "user", "content": "raise"}])
    body = err.value.response.json()
    assert "ValueError: boom requested" in body["error"]["message"]
    assert body["error"]["type"] == "server_error"
    with pytest.raises(openai.InternalServerError):
        _stream_text(client, "behave", "raise")
    text, _ = _stream_text(client, "behave", "hello")
    assert text == "Hello from the behaviour engine."
    assert "ValueError: boom requested" in behaviour.stderr_text()  # logged with its traceback
    assert "Traceback" in behaviour.stderr_text()


def test_raise_mid_stream_is_an_error_event(behaviour: DynamoRun):
    body = {"model": "behave", "messages": [{"role": "user", "content": "raise-mid"}], "stream": True}
    with httpx.stream("POST", behaviour.api_url + "/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # the opening
    assert json.loads(events[1])["choices"][0]["delta"]["content"] == "partial"
    error = json.loads(events[2])["error"]
    assert "RuntimeError: mid-stream failure" in error["message"]
    assert events[-1] == "[DONE]"
    # and the openai SDK surfaces it as an error
    with pytest.raises(openai.APIError):
        _stream_text(_client(behaviour), "behave", "raise-mid")
    assert _stream_text(_client(behaviour), "behave", "hello")[0] == "Hello from the behaviour engine."


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("nondict", "generate() yielded str 'just a string', expected a dict"),
        ("notjson", "not JSON"),
        ("exit", "called exit (3)"),
    ],
)
def test_bad_engine_behaviour_is_a_clean_error(behaviour: DynamoRun, prompt: str, message: str):
    resp = httpx.post(behaviour.api_url + "/chat/completions", timeout=30,
                      json={"model": "behave", "messages": [{"role": "user", "content": prompt}]})
    assert resp.status_code == 500
    assert message in resp.json()["error"]["message"]
    assert behaviour.running
    assert _stream_text(_client(behaviour), "behave", "hello")[0] == "Hello from the behaviour engine."


def test_pystr_gets_the_request_dict_as_sent(behaviour: DynamoRun):
    client = _client(behaviour)
    resp = client.chat.completions.create(
        model="behave", messages=[{"role": "user", "content": "echo-request"}], temperature=0.5,
        extra_body={"my_extension": {"a": 1}},
    )
    seen = json.loads(resp.choices[0].message.content)
    assert seen == {"model": "behave", "messages": [{"role": "user", "content": "echo-request"}],
                    "temperature": 0.5, "my_extension": {"a": 1}}


def test_pystr_completions_request_is_handed_over_as_chat(behaviour: DynamoRun):
    resp = _client(behaviour).completions.create(model="behave", prompt="echo-request", max_tokens=7)
    seen = json.loads(resp.choices[0].text)
    assert seen == {"model": "behave", "messages": [{"role": "user", "content": "echo-request"}], "max_tokens": 7}
    bad = httpx.post(behaviour.api_url + "/completions", json={"model": "behave", "prompt": [1, 2, 3]}, timeout=30)
    assert bad.status_code == 400
    assert "token ids" in bad.json()["error"]["message"]


def test_client_disconnect_closes_the_generator(behaviour: DynamoRun):
    events: Path = behaviour.events  # type: ignore[attr-defined]
    body = {"model": "behave", "messages": [{"role": "user", "content": "slow-disconnect"}], "stream": True}
    with httpx.stream("POST", behaviour.api_url + "/chat/completions", json=body, timeout=30) as resp:
        got = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break  # leave mid-stream
    wait_until(lambda: "closed slow-disconnect" in events.read_text().splitlines(), 10,
               "the engine's generator closed")
    lines = events.read_text().splitlines()
    assert "start slow-disconnect" in lines
    assert "closed slow-disconnect" in lines
    # closed at its yield (aclose) or cancelled inside its sleep: either way the generator saw it
    assert "generator-exit slow-disconnect" in lines or "cancelled slow-disconnect" in lines
    assert _stream_text(_client(behaviour), "behave", "hello")[0] == "Hello from the behaviour engine."


def test_responses_stream_mid_stream_failure_and_client_disconnect(behaviour: DynamoRun):
    """/v1/responses streams as chat does: an engine failure after the start is an ``error`` event (no
    ``response.completed``), and a client that leaves closes the engine's generator."""
    body = {"model": "behave", "input": "raise-mid", "stream": True}
    with httpx.stream("POST", behaviour.api_url + "/responses", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    types = [e["type"] for e in events]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["partial"]
    assert types[-1] == "error" and "mid-stream failure" in events[-1]["message"]
    assert "response.completed" not in types
    events_file: Path = behaviour.events  # type: ignore[attr-defined]
    body = {"model": "behave", "input": "slow-responses", "stream": True}
    with httpx.stream("POST", behaviour.api_url + "/responses", json=body, timeout=30) as resp:
        deltas = 0
        for line in resp.iter_lines():
            deltas += '"response.output_text.delta"' in line
            if deltas == 3:
                break  # leave mid-stream
    wait_until(lambda: "closed slow-responses" in events_file.read_text().splitlines(), 10,
               "the engine's generator closed")
    r = _client(behaviour).responses.create(model="behave", input="hello")
    assert r.output_text == "Hello from the behaviour engine."


def test_blocking_engine_does_not_freeze_the_server(behaviour: DynamoRun):
    result: dict[str, object] = {}

    def blocked_request() -> None:
        r = httpx.post(behaviour.api_url + "/chat/completions", timeout=30,
                       json={"model": "behave", "messages": [{"role": "user", "content": "block"}]})
        result["text"] = r.json()["choices"][0]["message"]["content"]

    events_file: Path = behaviour.events  # type: ignore[attr-defined]
    t = threading.Thread(target=blocked_request, daemon=True)
    t.start()
    wait_until(lambda: "blocking" in events_file.read_text().splitlines(), 15, "the engine to block its loop")
    health = httpx.get(behaviour.base_url + "/health", timeout=5)
    assert health.status_code == 200
    # answered while the engine was still inside its time.sleep(3)
    assert "unblocked" not in events_file.read_text().splitlines()
    t.join(15)
    assert result["text"] == "unblocked"
    assert "unblocked" in events_file.read_text().splitlines()


def test_engine_error_in_stdin_mode():
    result = run_cli([f"out=pystr:{DATA / 'behaviour_engine.py'}"], input="raise")
    assert result.returncode == 1
    assert "Error: a Python exception was caught while processing the async generator: ValueError: boom requested" \
        in result.stderr


# -- loading errors: one line, exit 1 -----------------------------------------------------------------


@pytest.mark.parametrize(
    "file, message",
    [
        ("no_generate.py", "the engine file has no 'generate' function"),
        ("raises_on_load.py", "loading the engine file failed: RuntimeError: cannot load weights from "
                              "/nonexistent/weights.bin (raises_on_load.py, line 5)"),
        ("not_async_generator.py", "'generate' must be an async generator"),
        ("initialize_fails.py", "initialize() failed: ValueError: unknown option --opt"),
        ("syntax_error.py", "SyntaxError: expected ':' (syntax_error.py, line 1)"),
        ("exits_on_load.py", "the engine file exited while loading (exit status 2)"),
    ],
)
def test_broken_engine_files(file: str, message: str):
    path = DATA / "broken" / file
    result = run_cli([f"out=pystr:{path}", "--", "--opt"], input="hi")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"Error: out=pystr:{path}: ")
    assert message in errors[0]
    assert "Traceback" not in result.stderr


def test_missing_engine_file():
    result = run_cli(["out=pystr:/nonexistent/engine.py"], input="hi")
    assert result.returncode != 0
    assert "/nonexistent/engine.py" in result.stderr


# -- pytok ---------------------------------------------------------------------------------------------


def test_pytok_needs_a_tokenizer():
    result = run_cli([f"out=pytok:{DATA / 'seed_pytok_engine.py'}"], input="hi")
    assert result.returncode == 1
    assert "needs a model folder with a tokenizer" in result.stderr
    assert "--model-path" in result.stderr


def test_seed_pytok_example_runs_unchanged(tiny_model: Path):
    """The seeds' ids are Llama 3 ids, mostly outside the tiny vocabulary: it must still stream cleanly."""
    with PyEngineServer(f"out=pytok:{DATA / 'seed_pytok_engine.py'}", "--model-path", str(tiny_model)) as server:
        client = _client(server)
        assert [m.id for m in client.models.list().data] == ["tiny-chat"]
        _, reasons = _stream_text(client, "tiny-chat", "What is the capital of France?")
        assert reasons[-1] == "stop"
        usage = client.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "hi"}]).usage
        assert usage.completion_tokens == 7
    result = run_cli([f"out=pytok:{DATA / 'seed_pytok_engine.py'}", str(tiny_model)], input="hi")
    assert result.returncode == 0, result.stderr


def test_pytok_streams_detokenised_text(token_engine: DynamoRun):
    client = _client(token_engine)
    text, reasons = _stream_text(client, "tiny-chat", "What is the capital of France?")
    assert text == SENTENCE
    assert reasons[-1] == "stop"
    completion = client.completions.create(model="tiny-chat", prompt="Capital of France?")
    assert completion.choices[0].text == SENTENCE


def test_pytok_stop_conditions_apply(token_engine: DynamoRun):
    client = _client(token_engine)
    resp = client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hi"}], stop=["France"])
    assert resp.choices[0].message.content == "The capital of "
    resp = client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 2


def test_pytok_request_dict(token_engine: DynamoRun):
    resp = _client(token_engine).chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "show-request"}], max_tokens=1500,
        temperature=0.25)
    seen = json.loads(resp.choices[0].message.content)
    assert {"token_ids", "stop_conditions", "sampling_options", "eos_token_ids", "mdc_sum", "annotations"} \
        <= set(seen["keys"])
    assert {"max_tokens", "stop", "stop_token_ids_hidden", "min_tokens", "ignore_eos"} <= set(seen["stop_conditions"])
    assert {"n", "temperature", "top_p", "top_k", "seed"} <= set(seen["sampling_options"])
    assert seen["max_tokens"] == 1500
    assert seen["temperature"] == 0.25
    assert seen["eos_token_ids"]
    assert seen["prompt_is_ids"]


def test_pytok_errors_are_per_request(token_engine: DynamoRun):
    client = _client(token_engine)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "raise"}])
    assert "KeyError" in err.value.response.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "bad-item"}])
    assert "has no 'token_ids'" in err.value.response.json()["error"]["message"]
    assert _stream_text(client, "tiny-chat", "again")[0] == SENTENCE


def test_pytok_stdin(tiny_model: Path):
    result = run_cli([f"out=pytok:{DATA / 'token_engine.py'}", "--model-path", str(tiny_model)], input="hi\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == SENTENCE + "\n"


def test_pytok_logprobs_when_the_file_declares_them(token_engine: DynamoRun):
    client = _client(token_engine)
    resp = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, top_logprobs=1)
    entries = resp.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == resp.choices[0].message.content == SENTENCE
    assert all(e.logprob == -0.25 and [t.token for t in e.top_logprobs] == [e.token] for e in entries)
    # the file does not declare prompt logprobs: echo + logprobs is a 400 naming echo
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-chat", prompt="hi", logprobs=1, echo=True)
    assert err.value.body["param"] == "echo"  # type: ignore[index]
