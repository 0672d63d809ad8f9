"""Structured output on the real SmolLM2 GGUF through llama.cpp grammars: the openai SDK's ``parse`` with
a pydantic model, ``json_object``, ``guided_choice``, GBNF; and the 400s for what llama.cpp cannot do.
Skipped like tests/integration/test_llamacpp.py when the GGUF or llama-cpp-python is missing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from harness.proc import DynamoRun  # noqa: E402
from harness.smollm2 import SMOLLM2_MODEL as MODEL  # noqa: E402

pytestmark = pytest.mark.timeout(300)


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def client(gguf: Path) -> Iterator["openai.OpenAI"]:
    with DynamoRun("out=llamacpp", str(gguf), startup_timeout=120) as server:
        yield openai.OpenAI(base_url=server.api_url, api_key="none", timeout=120, max_retries=0)


def ask(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=ask("Invent a person: a name and an age."),
                                      response_format=Person, temperature=0, max_tokens=60)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.name
    # the same request unconstrained is not JSON at all: the grammar did the work
    free = client.chat.completions.create(model=MODEL, messages=ask("Invent a person: a name and an age."),
                                          temperature=0, max_tokens=60)
    with pytest.raises(ValueError):
        Person.model_validate_json(free.choices[0].message.content)


def test_json_object_streamed(client):
    stream = client.chat.completions.create(model=MODEL, messages=ask("Describe a cat in JSON."), temperature=0.7,
                                            seed=3, max_tokens=40, response_format={"type": "json_object"},
                                            stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a JSON object's beginning
        assert text.lstrip().startswith("{")


def test_guided_choice_and_grammar(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("Is the sky blue?"), temperature=0, max_tokens=10,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(model=MODEL, messages=ask("Count."), temperature=0, max_tokens=10,
                                       extra_body={"guided_grammar": 'root ::= [0-9] [0-9] " apples"'})
    text = r.choices[0].message.content
    assert text[:2].isdigit() and text.endswith(" apples")


@pytest.mark.parametrize("fields,param", [
    ({"guided_regex": "[0-9]+"}, "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
])
def test_what_llamacpp_cannot_do_is_a_400(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=5, extra_body=fields)
    assert e.value.body["param"] == param


def test_n3_sampled_choices_differ(client):
    r = client.chat.completions.create(model=MODEL, messages=ask("Write a short poem."), n=3, temperature=1.0,
                                       seed=7, max_tokens=12)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    again = client.chat.completions.create(model=MODEL, messages=ask("Write a short poem."), n=3, temperature=1.0,
                                           seed=7, max_tokens=12)
    assert [c.message.content for c in again.choices] == texts  # choice i is seeded with seed + i


def test_logit_bias(client, tok):
    (banana,) = tok.encode(" banana")
    r = client.chat.completions.create(model=MODEL, messages=ask("What is 2+2?"), temperature=0, max_tokens=4,
                                       logit_bias={str(banana): 100})
    assert r.choices[0].message.content == " banana" * 4
    free = client.chat.completions.create(model=MODEL, messages=ask("What is 2+2?"), temperature=0, max_tokens=4)
    first = tok.encode(free.choices[0].message.content)[0]
    r = client.chat.completions.create(model=MODEL, messages=ask("What is 2+2?"), temperature=0, max_tokens=4,
                                       logit_bias={str(first): -100})
    assert tok.encode(r.choices[0].message.content)[0] != first


def test_tool_choice_named_and_required_through_a_grammar(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = client.chat.completions.create(model=MODEL, messages=ask("Weather in Paris?"), tools=tools,
                                           tool_choice=choice, temperature=0, max_tokens=40)
        assert r.choices[0].finish_reason == "tool_calls", r
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments)["city"], str)
