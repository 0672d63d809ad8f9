"""Images through the three APIs against a real ``dynamo-run in=http`` and the official SDKs: a model
without an image encoder answers each API's own 400 (never a silent drop of the image), as do too many
images and malformed image parts, and the server keeps serving; the media settings are checked at
start-up (one line, exit status not 0).

``out=echo_core`` on the tiny model runs the real pre-processor (the path every token engine takes);
``out=echo_full`` is an engine that takes the OpenAI request itself.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from harness.images import image_bytes, png_url
from harness.proc import DynamoRun, run_cli

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-chat"
LOOK = "What colour is this image?"


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[DynamoRun]:
    with DynamoRun("out=echo_core", str(tiny_model), "--enable-anthropic-api", "--limit-mm-per-prompt",
                   '{"image": 2}') as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def ant(server: DynamoRun) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=30)


def image_message(*urls: str) -> list[Any]:
    return [{"role": "user", "content": [{"type": "text", "text": LOOK},
                                         *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]


def openai_400(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.status_code == 400
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error", body
    return body


def still_serving(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still there?"}], max_tokens=5)
    assert r.choices[0].message.content


# -- /v1/chat/completions ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_chat_image_to_a_text_only_model_is_a_400(oai: openai.OpenAI, stream: bool):
    body = openai_400(lambda: oai.chat.completions.create(model=MODEL, messages=image_message(png_url()),
                                                          max_tokens=5, stream=stream))
    assert "'tiny-chat' does not accept images" in body["message"]
    still_serving(oai)


def test_chat_image_url_string_form_and_remote_url_are_refused_without_fetching(oai: openai.OpenAI):
    """The model cannot use the image, so nothing is fetched: even a URL the policy would refuse gets the
    model's answer, not a fetch error."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": "http://169.254.169.254/x.png"}]}]
    assert "does not accept images" in openai_400(
        lambda: oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5))["message"]


def test_too_many_images_is_a_400(oai: openai.OpenAI):
    body = openai_400(lambda: oai.chat.completions.create(model=MODEL, messages=image_message(*[png_url()] * 3),
                                                          max_tokens=5))
    assert "At most 2 image(s)" in body["message"]
    still_serving(oai)


def test_malformed_image_part_is_a_400_naming_it(server: DynamoRun):
    r = httpx.post(server.api_url + "/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "image_url" in r.json()["error"]["param"]


def test_full_engine_refuses_images_too(full_server: DynamoRun):
    client = openai.OpenAI(base_url=full_server.api_url, api_key="none", max_retries=0, timeout=30)
    body = openai_400(lambda: client.chat.completions.create(model="echo", messages=image_message(png_url()),
                                                             max_tokens=5))
    assert "does not accept images" in body["message"]
    assert client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "ok"}]).choices


def test_engine_given_the_raw_request_never_sees_image_urls():
    """pystr engines (and remote Chat workers) get the request as sent: image URLs would reach them
    unchecked, so a model that has not said it takes images refuses them first."""
    engine = Path(__file__).parents[1] / "e2e" / "data" / "seed_pystr_engine.py"
    with DynamoRun(f"out=pystr:{engine}", "--model-name", "raw") as srv:
        client = openai.OpenAI(base_url=srv.api_url, api_key="none", max_retries=0, timeout=30)
        body = openai_400(lambda: client.chat.completions.create(
            model="raw", messages=image_message("http://127.0.0.1:1/x.png"), max_tokens=5))
        assert "'raw' does not accept images" in body["message"]
        assert client.chat.completions.create(model="raw", messages=[{"role": "user", "content": "ok"}]).choices


# -- /v1/messages ----------------------------------------------------------------------------------------------


def anthropic_400(call: Any) -> str:
    with pytest.raises(anthropic.BadRequestError) as e:
        call()
    body = e.value.body
    assert e.value.status_code == 400
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


PNG_B64 = base64.b64encode(image_bytes(4, 4)).decode()


@pytest.mark.parametrize("source", [
    {"type": "base64", "media_type": "image/png", "data": PNG_B64},
    {"type": "url", "url": "https://images.example.com/cat.png"},
])
def test_messages_image_to_a_text_only_model_is_a_400(ant: anthropic.Anthropic, oai: openai.OpenAI,
                                                       source: dict[str, Any]):
    content = [{"type": "image", "source": source}, {"type": "text", "text": LOOK}]
    message = anthropic_400(lambda: ant.messages.create(model=MODEL, max_tokens=5,
                                                        messages=[{"role": "user", "content": content}]))
    assert "does not accept images" in message
    message = anthropic_400(lambda: ant.messages.count_tokens(model=MODEL,
                                                              messages=[{"role": "user", "content": content}]))
    assert "does not accept images" in message
    assert ant.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}]).content
    still_serving(oai)


def test_messages_file_source_and_bad_media_type_are_400s(ant: anthropic.Anthropic):
    def send(source: dict[str, Any]) -> str:
        return anthropic_400(lambda: ant.messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [{"type": "image", "source": source}]}]))

    assert "file sources" in send({"type": "file", "file_id": "file_011"})
    assert "media_type" in send({"type": "base64", "media_type": "image/tiff", "data": PNG_B64})


def test_messages_too_many_images_is_a_400(ant: anthropic.Anthropic):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
    assert "At most 2 image(s)" in anthropic_400(lambda: ant.messages.create(
        model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [image] * 3}]))


# -- /v1/responses -----------------------------------------------------------------------------------------------


def test_responses_input_image_to_a_text_only_model_is_a_400(oai: openai.OpenAI):
    content = [{"type": "input_text", "text": LOOK}, {"type": "input_image", "image_url": png_url(), "detail": "auto"}]
    body = openai_400(lambda: oai.responses.create(model=MODEL, input=[{"role": "user", "content": content}]))
    assert "does not accept images" in body["message"]
    assert oai.responses.create(model=MODEL, input="hello", max_output_tokens=5).output_text


def test_responses_file_id_is_a_400(oai: openai.OpenAI):
    content = [{"type": "input_image", "file_id": "file-abc", "detail": "auto"}]
    body = openai_400(lambda: oai.responses.create(model=MODEL, input=[{"role": "user", "content": content}]))
    assert body["param"] == "input[0].content[0].file_id" and "Files API" in body["message"]


# -- settings at start-up ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "env", "words"), [
    (["in=http", "out=echo_full", "--limit-mm-per-prompt", '{"video": 1}'], {}, "only 'image'"),
    (["in=http", "out=echo_full", "--limit-mm-per-prompt", "image=lots"], {}, "whole number"),
    (["in=http", "out=echo_full", "--allowed-local-media-path", "/no/such/dir"], {}, "no such directory"),
    (["in=text", "out=echo_full", "--limit-mm-per-prompt", "image=1"], {}, "only for in=http"),
    (["in=http", "out=echo_full"], {"DYN_MM_ALLOW_INTERNAL": "perhaps"}, "DYN_MM_ALLOW_INTERNAL"),
    (["in=http", "out=echo_full"], {"DYN_MM_LOCAL_PATH": "/no/such/dir"}, "DYN_MM_LOCAL_PATH"),
])
def test_bad_media_settings_fail_at_start_in_one_line(args: list[str], env: dict[str, str], words: str):
    r = run_cli(args, env=env)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in r.stderr, r.stderr
