"""Request validation: every bad request becomes a 400 with a message naming the problem."""

from __future__ import annotations

import pytest

from dynamo.errors import RequestError
from dynamo.llm.protocols.openai import (
    include_usage,
    parse_chat_request,
    parse_completion_request,
    prompt_text,
)

MSG = [{"role": "user", "content": "hi"}]


def bad_chat(**fields) -> RequestError:
    raw = {"model": "m", "messages": MSG, **fields}
    with pytest.raises(RequestError) as e:
        parse_chat_request(raw)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    "field,value,lo,hi",
    [
        ("temperature", 3, 0.0, 2.0),
        ("temperature", -0.1, 0.0, 2.0),
        ("top_p", 1.5, 0.0, 1.0),
        ("frequency_penalty", 2.5, -2.0, 2.0),
        ("presence_penalty", -3, -2.0, 2.0),
    ],
)
def test_out_of_range_values(field, value, lo, hi):
    err = bad_chat(**{field: value})
    assert str(err) == f"Error validating {field}: Value {float(value)} is out of range [{lo}, {hi}]"
    assert err.param == field


@pytest.mark.parametrize("field,value", [("temperature", 0), ("temperature", 2), ("top_p", 0), ("top_p", 1),
                                         ("frequency_penalty", -2), ("presence_penalty", 2)])
def test_range_bounds_are_inclusive(field, value):
    parse_chat_request({"model": "m", "messages": MSG, field: value})


def test_repetition_penalty_range_root_and_nvext():
    assert "repetition_penalty" in str(bad_chat(repetition_penalty=0))
    assert "repetition_penalty" in str(bad_chat(nvext={"repetition_penalty": 2.5}))


def test_empty_messages():
    err = bad_chat(messages=[])
    assert "'messages' field cannot be empty" in str(err)
    assert err.param == "messages"


def test_bad_role_names_the_field():
    err = bad_chat(messages=[{"role": "wizard", "content": "x"}])
    assert "wizard" in str(err)
    assert err.param == "messages[0].role"


def test_more_than_four_stop_strings():
    err = bad_chat(stop=["a", "b", "c", "d", "e"])
    assert "4 stop" in str(err)
    assert err.param == "stop"
    parse_chat_request({"model": "m", "messages": MSG, "stop": ["a", "b", "c", "d"]})


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"messages": "hi"}, "messages"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"messages": [{"content": "no role"}]}, "messages[0]"),
    ],
)
def test_wrong_types_name_the_field(fields, param):
    err = bad_chat(**fields)
    assert err.param is not None and err.param.startswith(param)
    assert str(err).startswith("Invalid request")


def test_missing_model():
    with pytest.raises(RequestError) as e:
        parse_chat_request({"messages": MSG})
    assert e.value.status == 400
    assert e.value.param == "model"
    assert "model" in str(e.value)


def test_body_must_be_an_object():
    with pytest.raises(RequestError, match="JSON object"):
        parse_chat_request([1, 2])


@pytest.mark.parametrize("fields", [{"max_tokens": 0}, {"max_completion_tokens": 0}, {"min_tokens": -1},
                                    {"n": 17}, {"n": 0}, {"top_logprobs": 21}])
def test_other_limits(fields):
    bad_chat(**fields)


def test_min_tokens_above_max_tokens():
    err = bad_chat(min_tokens=10, max_tokens=5)
    assert "min_tokens (10) must be less than or equal to max_tokens (5)" in str(err)
    assert "max_tokens (3)" in str(bad_chat(min_tokens=10, max_tokens=50, max_completion_tokens=3))
    with pytest.raises(RequestError):
        parse_completion_request({"model": "m", "prompt": "x", "min_tokens": 3, "max_tokens": 2})
    parse_chat_request({"model": "m", "messages": MSG, "min_tokens": 5, "max_tokens": 5})
    parse_chat_request({"model": "m", "messages": MSG, "min_tokens": 5})


def test_guided_decoding_one_kind_only():
    err = bad_chat(guided_json={"type": "object"}, nvext={"guided_regex": "x"})
    assert "Only one of json, regex, choice, or grammar" in str(err)


def test_unknown_fields_are_ignored():
    req = parse_chat_request({"model": "m", "messages": MSG, "some_future_field": 1, "metadata": {"a": 1}})
    assert req.model == "m"


def test_extra_message_fields_are_accepted():
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x", "weird": True}]})
    assert req.messages[0].content == "x"


def test_usage_in_a_stream_only_when_asked_and_always_in_a_whole_answer():
    def req(**f):
        return parse_chat_request({"model": "m", "messages": MSG, **f})

    assert include_usage(req(stream=True, stream_options={"include_usage": True}))
    assert not include_usage(req(stream=True))
    assert include_usage(req(stream=False, stream_options={"include_usage": True}))
    assert include_usage(req())


@pytest.mark.parametrize(
    "prompt",
    [[], [1, "a"], [[1, 2], "x"], [True, False]],
)
def test_bad_completion_prompts(prompt):
    with pytest.raises(RequestError) as e:
        parse_completion_request({"model": "m", "prompt": prompt})
    assert e.value.param == "prompt"


def test_completion_prompt_required():
    with pytest.raises(RequestError) as e:
        parse_completion_request({"model": "m"})
    assert e.value.param == "prompt"


def test_completion_ranges_checked_too():
    with pytest.raises(RequestError, match="temperature"):
        parse_completion_request({"model": "m", "prompt": "x", "temperature": 9})


def test_prompt_text_as_echo_full_shows_it():
    assert prompt_text("abc") == "abc"
    assert prompt_text(["a", "b"]) == "a b"
    assert prompt_text([1, 2]) == "1 2"
    assert prompt_text([[1, 2], [3]]) == "1 2 | 3"


def test_max_tokens_zero_only_with_echo_on_completions():
    """0 tokens is the prompt alone: what scoring with echo asks for, and nothing else."""
    assert parse_completion_request({"model": "m", "prompt": "x", "max_tokens": 0, "echo": True}).max_tokens == 0
    for raw in ({"prompt": "x", "max_tokens": 0}, {"prompt": "x", "max_tokens": 0, "echo": False}):
        with pytest.raises(RequestError, match="0 only with echo") as e:
            parse_completion_request({"model": "m", **raw})
        assert e.value.param == "max_tokens"
