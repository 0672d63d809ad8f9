"""The endpoints beyond chat and completions: /tokenize, /detokenize, --chat-template,
/v1/embeddings and /v1/responses, through the ``openai`` SDK where it has them, on real processes.

``plain`` is ``echo_core`` on the tiny model with ``--chat-template`` set to a template that writes
``[role] content`` lines and no end-of-turn token: echo_core answers with the whole templated prompt, so
every answer shows exactly what the template, the conversation store and the tokenizer did.  ``emb`` is
``echo_core --embedding``: deterministic vectors from the tokens.
"""

from __future__ import annotations

import base64
import math
import struct
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from harness.proc import DynamoRun, run_cli

pytestmark = pytest.mark.timeout(120)

PLAIN_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}[assistant]{% endif %}")


def rendered(*turns: tuple[str, str], prompt: bool = True) -> str:
    return "".join(f"[{role}] {content}\n" for role, content in turns) + ("[assistant]" if prompt else "")


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tpl") / "plain.jinja"
    path.write_text(PLAIN_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def plain(tiny_model: Path, template_file: Path) -> Iterator[DynamoRun]:
    with DynamoRun("out=echo_core", str(tiny_model), "--model-name", "plain", "--chat-template",
                   str(template_file)) as srv:
        yield srv


@pytest.fixture(scope="module")
def emb(tiny_model: Path) -> Iterator[DynamoRun]:
    with DynamoRun("out=echo_core", str(tiny_model), "--model-name", "emb", "--embedding") as srv:
        yield srv


def sdk(srv: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.api_url, api_key="unused", max_retries=0, timeout=30)


# -- --chat-template, /tokenize, /detokenize -----------------------------------------------------------------


def test_chat_template_file_replaces_the_models_template(plain: DynamoRun):
    r = sdk(plain).chat.completions.create(
        model="plain", messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "Hi there"}])
    assert r.choices[0].message.content == rendered(("system", "S"), ("user", "Hi there"))


def test_tokenize_messages_and_detokenize_round_trip(plain: DynamoRun):
    with httpx.Client(base_url=plain.base_url, timeout=10) as c:
        r = c.post("/tokenize", json={"model": "plain", "messages": [{"role": "user", "content": "héllo 🙂"}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > 0
        assert body["token_strs"] is None
        back = c.post("/detokenize", json={"model": "plain", "tokens": body["tokens"]}).json()
        assert back == {"prompt": rendered(("user", "héllo 🙂"))}
        # no generation prompt; and the model may be left out when only one is served
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False})
        assert c.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"] == rendered(
            ("user", "x"), prompt=False)
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "q"},
                                                   {"role": "assistant", "content": "The answer is"}],
                                      "continue_final_message": True, "add_generation_prompt": False})
        assert c.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"] == (
            "[user] q\n[assistant] The answer is")
        r = c.post("/tokenize", json={"prompt": "abc abc", "return_token_strs": True}).json()
        assert "".join(r["token_strs"]).replace("Ġ", " ") == "abc abc"


def test_tokenizer_info_describes_the_served_tokenizer(plain: DynamoRun, tiny_model: Path):
    """vLLM's shape, what lm-evaluation-harness reads to use our tokenizer: the special tokens as strings,
    the context length, the class a client rebuilds the tokenizer with, the template in use."""
    import json

    config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    info = httpx.get(plain.base_url + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<|im_end|>" and info["eos_token"] == config["eos_token"]
    assert {"bos_token", "pad_token", "unk_token"} <= info.keys()
    assert info["tokenizer_class"] == config.get("tokenizer_class", "PreTrainedTokenizerFast")
    assert isinstance(info["model_max_length"], int) and info["model_max_length"] > 0
    assert info["chat_template"] == PLAIN_TEMPLATE  # --chat-template replaced the model's
    assert httpx.get(plain.base_url + "/tokenizer_info", params={"model": "plain"}, timeout=10).json() == info
    assert httpx.get(plain.base_url + "/tokenizer_info", params={"model": "nope"}, timeout=10).status_code == 404
    # the eos token round-trips through /tokenize as one id, as the harness finds its id
    eos = httpx.post(plain.base_url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False},
                     timeout=10).json()["tokens"]
    assert len(eos) == 1


def test_completions_echo_a_token_id_prompt(plain: DynamoRun):
    with httpx.Client(base_url=plain.base_url, timeout=10) as c:
        ids = c.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()["tokens"]
        r = sdk(plain).completions.create(model="plain", prompt=ids, echo=True, max_tokens=0)
        assert r.choices[0].text == "hello world" and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 0
        head = c.post("/detokenize", json={"tokens": ids[:2]}).json()["prompt"]
        both = sdk(plain).completions.create(model="plain", prompt=[ids, ids[:2]], echo=True, max_tokens=0)
        assert [(ch.index, ch.text) for ch in both.choices] == [(0, "hello world"), (1, head)]
        assert both.usage.prompt_tokens == len(ids) + 2
        streamed: dict[int, str] = {}
        for chunk in sdk(plain).completions.create(model="plain", prompt=[ids, ids[:2]], echo=True, max_tokens=0,
                                                   stream=True):
            for ch in chunk.choices:
                streamed[ch.index] = streamed.get(ch.index, "") + ch.text
        assert streamed == {0: "hello world", 1: head}
        r = c.post("/v1/completions", json={"model": "plain", "prompt": [ids, [10 ** 9]], "max_tokens": 1})
        assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]


def test_tokenize_errors(plain: DynamoRun, full_server: DynamoRun):
    with httpx.Client(base_url=plain.base_url, timeout=10) as c:
        assert c.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
        r = c.post("/tokenize", json={"model": "plain"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = c.post("/detokenize", json={"model": "plain", "tokens": [10 ** 9]})
        assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]
    r = httpx.post(full_server.base_url + "/tokenize", json={"model": "echo", "prompt": "x"}, timeout=10)
    assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]


@pytest.mark.parametrize("content, message", [
    ("{% for m in messages %}", "does not compile"),
    ("", "empty"),
])
def test_a_bad_chat_template_file_is_a_start_up_error(tiny_model: Path, tmp_path: Path, content, message):
    path = tmp_path / "bad.jinja"
    path.write_text(content)
    r = run_cli(["in=http", "out=echo_core", str(tiny_model), "--chat-template", str(path)])
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr
    r = run_cli(["in=http", "out=echo_full", "--chat-template", str(tmp_path / "missing.jinja")])
    assert r.returncode != 0 and "no such file" in r.stderr


def test_chat_template_with_a_full_engine_is_refused(template_file: Path):
    r = run_cli(["in=http", "out=echo_full", "--chat-template", str(template_file)])
    assert r.returncode != 0 and "applies its own template" in r.stderr


# -- /v1/responses -----------------------------------------------------------------------------------------


def test_responses_unary_with_instructions(plain: DynamoRun):
    r = sdk(plain).responses.create(model="plain", input="Hello", instructions="Be brief")
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == rendered(("system", "Be brief"), ("user", "Hello"))
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_responses_message_items_and_previous_response_id(plain: DynamoRun):
    client = sdk(plain)
    first = client.responses.create(
        model="plain", instructions="First rules",
        input=[{"role": "developer", "content": "Dev"},
               {"role": "user", "content": [{"type": "input_text", "text": "one"}]}])
    assert first.output_text == rendered(("system", "First rules"), ("system", "Dev"), ("user", "one"))
    second = client.responses.create(model="plain", input="two", previous_response_id=first.id)
    # the earlier turns and answer come back; the earlier instructions do not (as the API defines)
    assert second.output_text == rendered(("system", "Dev"), ("user", "one"), ("assistant", first.output_text),
                                          ("user", "two"))
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="plain", input="x", previous_response_id="resp_unknown")
    unstored = client.responses.create(model="plain", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="plain", input="y", previous_response_id=unstored.id)


def test_responses_retrieve_and_delete(plain: DynamoRun):
    client = sdk(plain)
    first = client.responses.create(model="plain", input="Keep me", instructions="Rules", metadata={"k": "v"})
    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()  # the stored object, as it was returned
    streamed = [e for e in client.responses.create(model="plain", input="Streamed", stream=True)][-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text == rendered(("user", "Streamed"))
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                 lambda: client.responses.create(model="plain", input="x", previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model="plain", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    r = httpx.delete(plain.api_url + "/responses/" + streamed.id, timeout=10)
    assert r.json() == {"id": streamed.id, "object": "response", "deleted": True}


def test_responses_input_items_are_listed_back(plain: DynamoRun):
    client = sdk(plain)
    given = [{"role": "developer", "content": "Dev"}, {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
             {"type": "message", "role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    r = client.responses.create(model="plain", input=given)
    items = list(client.responses.input_items.list(r.id))  # newest first, every page
    assert [(i.role, i.content[0].text) for i in items] == [("user", "c"), ("assistant", "b"), ("user", "a"),
                                                             ("developer", "Dev")]
    assert all(i.id.startswith("msg_") and i.type == "message" for i in items)
    page = client.responses.input_items.list(r.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["Dev", "a"] and page.has_more
    rest = client.responses.input_items.list(r.id, limit=2, order="asc", after=page.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["b", "c"] and not rest.has_more
    one = client.responses.create(model="plain", input="just text")
    (item,) = client.responses.input_items.list(one.id).data
    assert item.role == "user" and item.content[0].type == "input_text" and item.content[0].text == "just text"
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(r.id, limit=101)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")


def test_responses_stream_event_sequence(plain: DynamoRun):
    events = list(sdk(plain).responses.create(model="plain", input="Stream me", stream=True))
    types = [e.type for e in events]
    n = types.count("response.output_text.delta")
    assert n > 1
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * n
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == rendered(("user", "Stream me"))
    done = events[-1].response
    assert done.status == "completed" and done.output_text == text and done.usage.output_tokens > 0
    assert events[0].response.status == "in_progress"


def test_responses_max_output_tokens_is_incomplete(plain: DynamoRun):
    client = sdk(plain)
    r = client.responses.create(model="plain", input="A long enough input", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    events = list(client.responses.create(model="plain", input="A long enough input", max_output_tokens=3,
                                          stream=True))
    assert events[-1].type == "response.incomplete"


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "name": "f"}, {"type": "web_search"}]}, "tools[1].type"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "messages"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
])
def test_responses_unsupported_parts_are_400(plain: DynamoRun, extra, param):
    body = {"model": "plain", "input": "hi", **extra}
    r = httpx.post(plain.api_url + "/responses", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_responses_on_a_full_engine(full_server: DynamoRun):
    r = sdk(full_server).responses.create(model="echo", input="echoed back")
    assert r.output_text == "echoed back"


# -- /v1/embeddings ----------------------------------------------------------------------------------------


def test_embeddings_float(emb: DynamoRun):
    client = sdk(emb)
    r = client.embeddings.create(model="emb", input=["alpha beta", "gamma", "alpha beta"], encoding_format="float")
    assert r.object == "list" and r.model == "emb"
    vecs = [d.embedding for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2]
    assert all(len(v) == 32 for v in vecs)
    assert vecs[0] == vecs[2] and vecs[0] != vecs[1]
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-9 for v in vecs)
    tokens = [httpx.post(emb.base_url + "/tokenize", json={"prompt": t, "add_special_tokens": False}).json()["count"]
              for t in ("alpha beta", "gamma", "alpha beta")]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(tokens)
    assert "emb" in [m.id for m in client.models.list()]


def test_embeddings_base64(emb: DynamoRun):
    client = sdk(emb)
    floats = client.embeddings.create(model="emb", input="some text", encoding_format="float").data[0].embedding
    raw = client.embeddings.create(model="emb", input="some text", encoding_format="base64").data[0].embedding
    assert isinstance(raw, str)
    decoded = struct.unpack(f"<{len(floats)}f", base64.b64decode(raw))
    assert all(abs(a - b) < 1e-6 for a, b in zip(decoded, floats, strict=True))
    # the SDK's default asks for base64 and decodes it itself
    default = client.embeddings.create(model="emb", input="some text").data[0].embedding
    assert all(abs(a - b) < 1e-6 for a, b in zip(default, floats, strict=True))


def test_embeddings_token_ids_and_dimensions(emb: DynamoRun):
    client = sdk(emb)
    ids = httpx.post(emb.base_url + "/tokenize", json={"prompt": "alpha beta", "add_special_tokens": False}).json()
    by_ids = client.embeddings.create(model="emb", input=[ids["tokens"]], encoding_format="float").data[0]
    by_text = client.embeddings.create(model="emb", input="alpha beta", encoding_format="float").data[0]
    assert by_ids.embedding == by_text.embedding
    short = client.embeddings.create(model="emb", input="alpha beta", dimensions=8, encoding_format="float")
    assert len(short.data[0].embedding) == 8
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="emb", input="x", dimensions=64)
    assert info.value.body["param"] == "dimensions"


def test_embeddings_errors(emb: DynamoRun, core_server: DynamoRun):
    client = sdk(emb)
    for bad in ([], [""], [1, "a"], [[-1]]):
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model="emb", input=bad)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="emb", messages=[{"role": "user", "content": "hi"}])
    assert "/v1/embeddings" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        sdk(core_server).embeddings.create(model="tiny-chat", input="x")
    assert "not an embedding model" in info.value.body["message"]


def test_embedding_flag_needs_a_supporting_engine():
    r = run_cli(["in=http", "out=echo_full", "--embedding"])
    assert r.returncode != 0 and "--embedding is supported by" in r.stderr and "Traceback" not in r.stderr
    r = run_cli(["in=stdin", "out=echo_full", "--embedding"], input="x")
    assert r.returncode != 0 and "in=http or in=dyn://" in r.stderr


def test_responses_and_embeddings_count_against_max_inflight(tiny_model: Path):
    """Two /v1/responses streams hold both places of ``--max-inflight 2``: chat, responses and embeddings
    get the overload 503 until they end."""
    import contextlib

    with DynamoRun("out=echo_full", "--model-name", "m", "--max-inflight", "2", delay_ms=20) as srv:
        with contextlib.ExitStack() as held, httpx.Client(timeout=30) as client:
            readers = []
            for _ in range(2):
                resp = held.enter_context(client.stream("POST", srv.api_url + "/responses",
                                                        json={"model": "m", "input": "x" * 500, "stream": True}))
                assert resp.status_code == 200
                readers.append(resp.iter_lines())
                next(readers[-1])
            for path, body in (("/responses", {"model": "m", "input": "hi"}),
                               ("/embeddings", {"model": "m", "input": "hi"}),
                               ("/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})):
                refused = httpx.post(srv.api_url + path, json=body, timeout=10)
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1", (path, refused.text)
        ok = sdk(srv).responses.create(model="m", input="again")
        assert ok.output_text == "again"


# -- continue_final_message on /v1/chat/completions ----------------------------------------------------------


def test_continue_final_message_continues_the_last_assistant_message(plain: DynamoRun):
    """vLLM's field: the prompt ends where the last message's content ends (no end of turn after it, no new
    assistant turn), so the model continues that message; echo_core shows the prompt it got."""
    turns = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "A colour: "}]
    r = sdk(plain).chat.completions.create(model="plain", messages=turns,  # type: ignore[arg-type]
                                           extra_body={"continue_final_message": True})
    assert r.choices[0].message.content == "[user] Name a colour\n[assistant] A colour:"
    closed = sdk(plain).chat.completions.create(model="plain", messages=turns)  # type: ignore[arg-type]
    assert closed.choices[0].message.content == rendered(("user", "Name a colour"), ("assistant", "A colour: "),
                                                         prompt=False)


def test_continue_final_message_with_add_generation_prompt_is_a_400(plain: DynamoRun):
    with pytest.raises(openai.BadRequestError) as err:
        sdk(plain).chat.completions.create(
            model="plain", messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
            extra_body={"continue_final_message": True, "add_generation_prompt": True})
    assert err.value.body["message"] == (  # type: ignore[index]
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    assert err.value.body["param"] == "continue_final_message"  # type: ignore[index]
