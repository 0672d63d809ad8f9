"""Every API's images become the one chat shape the pre-processor reads: OpenAI ``image_url`` parts (a
string or ``{url, detail}``), Anthropic ``image`` blocks (base64 as a ``data:`` URL, url as is) and
Responses ``input_image`` parts; what cannot be served (a Files API id, a media type the API does not
allow, an image where it cannot go) is a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from dynamo.errors import RequestError
from dynamo.llm.media import MediaError, image_parts
from dynamo.llm.protocols.anthropic import chat_request, parse_messages_request
from dynamo.llm.protocols.openai import ImageUrl, content_text, parse_chat_request
from dynamo.llm.protocols.responses import input_messages, parse_responses_request

B64 = "iVBORw0KGgo="


def anthropic_messages(content: Any, **extra: Any) -> list[dict[str, Any]]:
    raw = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": content}], **extra}
    return chat_request(parse_messages_request(raw))["messages"]


def test_openai_image_url_parts_parse_in_both_forms():
    raw = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "two"}, {"type": "image_url", "image_url": "data:image/png;base64,AA"},
        {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "high"}}]}]}
    parts = parse_chat_request(raw).messages[0].content
    assert isinstance(parts, list)
    assert parts[1].image_url == "data:image/png;base64,AA"
    assert parts[2].image_url == ImageUrl(url="https://x/y.png", detail="high")
    assert image_parts(raw["messages"]) == ["data:image/png;base64,AA", "https://x/y.png"]
    with pytest.raises(MediaError, match="does not accept images"):
        content_text(parts)


def test_openai_bad_detail_is_a_400():
    raw = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "ultra"}}]}]}
    with pytest.raises(RequestError) as e:
        parse_chat_request(raw)
    assert "detail" in (e.value.param or "")


def test_anthropic_base64_and_url_images_become_image_url_parts_in_order():
    messages = anthropic_messages([
        {"type": "text", "text": "first"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
        {"type": "text", "text": "then"},
        {"type": "image", "source": {"type": "url", "url": "https://img.example/cat.jpg"}, "cache_control": {}},
    ])
    assert messages[-1] == {"role": "user", "content": [
        {"type": "text", "text": "first"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{B64}"}},
        {"type": "text", "text": "then"},
        {"type": "image_url", "image_url": {"url": "https://img.example/cat.jpg"}},
    ]}
    assert image_parts(messages) == [f"data:image/png;base64,{B64}", "https://img.example/cat.jpg"]


def test_anthropic_text_only_turn_is_still_a_string():
    assert anthropic_messages([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])[-1] == {
        "role": "user", "content": "a\nb"}


@pytest.mark.parametrize(("block", "param"), [
    ({"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": B64}},
     "messages.0.content.0.source.media_type"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/png"}}, "messages.0.content.0.source.data"),
    ({"type": "image", "source": {"type": "file", "file_id": "file_1"}}, "messages.0.content.0.source.type"),
    ({"type": "image", "source": {"type": "url"}}, "messages.0.content.0.source.url"),
    ({"type": "image", "source": {"type": "url", "url": "https://x", "extra": 1}},
     "messages.0.content.0.source.extra"),
    ({"type": "image"}, "messages.0.content.0.source"),
    ({"type": "document", "source": {}}, "messages.0.content.0.type"),
])
def test_anthropic_bad_images_are_400s_naming_the_field(block: dict[str, Any], param: str):
    with pytest.raises(RequestError) as e:
        anthropic_messages([block])
    assert e.value.status == 400 and e.value.param == param


def test_anthropic_image_outside_a_user_turn_is_a_400():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    with pytest.raises(RequestError) as e:
        anthropic_messages("q", system=[image])
    assert e.value.param == "system.0.type"
    raw = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "q"},
                                                       {"role": "assistant", "content": [image]}]}
    with pytest.raises(RequestError) as e:
        chat_request(parse_messages_request(raw))
    assert e.value.param == "messages.1.content.0.type"


def responses_messages(content: Any, role: str = "user") -> list[dict[str, Any]]:
    return input_messages(parse_responses_request({"model": "m", "input": [{"role": role, "content": content}]}))


def test_responses_input_image_becomes_an_image_url_part():
    messages = responses_messages([{"type": "input_text", "text": "look"},
                                   {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "low"}])
    assert messages == [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA", "detail": "low"}}]}]
    assert responses_messages([{"type": "input_text", "text": "plain"}]) == [{"role": "user", "content": "plain"}]


@pytest.mark.parametrize(("part", "param"), [
    ({"type": "input_image", "file_id": "file-123"}, "input[0].content[0].file_id"),
    ({"type": "input_image"}, "input[0].content[0].image_url"),
    ({"type": "input_image", "image_url": "https://x", "detail": "max"}, "input[0].content[0].detail"),
])
def test_responses_bad_input_image_is_a_400(part: dict[str, Any], param: str):
    with pytest.raises(RequestError) as e:
        responses_messages([part])
    assert e.value.param == param


def test_responses_input_image_outside_a_user_message_is_a_400():
    with pytest.raises(RequestError):
        responses_messages([{"type": "input_image", "image_url": "https://x"}], role="assistant")
