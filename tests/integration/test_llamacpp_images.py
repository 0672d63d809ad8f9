"""Images through ``dynamo-run in=http out=llamacpp model.gguf --mmproj proj.gguf``, from the openai SDK, with
the real SmolLM2 GGUF and the closed-form colour projector (harness/colour_projector.py): an image's tokens
are the embeddings of its colour's word, so the model names the colour, and an answer that names it shows
the image reached the model where the message put it.

The answers: solid and noisy images of odd sizes are named; the same image twice gives the same answer and
hits the prefix cache past the image; a different image with the same text gives another answer and shares
no cache from the image on; two images in one message are both named, in their order; a user's literal
marker text stays text; a corrupt image and an image to a model without a projector are 400s, and the
server keeps serving.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any, Iterator

import anthropic
import openai
import pytest

from harness.colour_projector import COLOURS, NAMED, QUESTION, solid_png
from harness.proc import DynamoRun

pytestmark = pytest.mark.timeout(300)


def image_url(colour: str, size: tuple[int, int] = (64, 64), noise: int = 0, fmt: str = "PNG", seed: int = 0) -> str:
    rgb = tuple(255 * c for c in COLOURS[colour])
    data = solid_png(rgb, size, noise=noise, seed=seed, fmt=fmt)  # type: ignore[arg-type]
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(client: openai.OpenAI, content: list[dict[str, Any]], max_tokens: int = 10, **extra: Any) -> Any:
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens,
                                          messages=[{"role": "user", "content": content}], **extra)


def colours_named(answer: str) -> list[str]:
    """The colour words in ``answer``, in order of first mention."""
    words = [w.strip(".,!:;\n").lower() for w in answer.split()]
    seen: list[str] = []
    for w in words:
        if w in COLOURS and w not in seen:
            seen.append(w)
    return seen


@pytest.fixture(scope="module")
def server(gguf: Path, colour_projector: Path) -> Iterator[DynamoRun]:
    with DynamoRun("out=llamacpp", str(gguf), "--mmproj", str(colour_projector), "--context-length", "512",
                   "--enable-anthropic-api", startup_timeout=120) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0)


def test_models_list_says_the_model_takes_images(client):
    (model,) = client.models.list().data
    assert model.model_extra["input_modalities"] == ["text", "image"]


@pytest.mark.parametrize("colour", NAMED)
def test_solid_and_noisy_images_of_odd_sizes_are_named(client, colour):
    for size, noise, fmt in (((37, 53), 0, "PNG"), ((101, 67), 24, "PNG"), ((64, 64), 12, "WEBP")):
        answer = ask(client, [image_part(image_url(colour, size, noise, fmt)),
                              {"type": "text", "text": QUESTION}]).choices[0].message.content
        assert colours_named(answer) == [colour], (size, noise, fmt, answer)


def test_same_image_same_answer_and_cache_hit_different_image_no_shared_cache(client):
    question = {"type": "text", "text": QUESTION}
    first = ask(client, [image_part(image_url("yellow", (50, 50))), question])
    again = ask(client, [image_part(image_url("yellow", (50, 50))), question])
    assert again.choices[0].message.content == first.choices[0].message.content
    n = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == n - 1  # all but the last token, image included
    # the same text with another image: another answer, and the cache ends before the image (its 16 tokens
    # are followed by the question, so a hit ending before the image is short of the last 16 + a few)
    other = ask(client, [image_part(image_url("green", (50, 50))), question])
    assert colours_named(other.choices[0].message.content) == ["green"]
    assert other.usage.prompt_tokens == n
    assert other.usage.prompt_tokens_details.cached_tokens < n - 16


def test_two_images_in_one_message_are_named_in_order(client):
    def content(a: str, b: str) -> list[dict[str, Any]]:
        return [{"type": "text", "text": "Image 1:"}, image_part(image_url(a, (45, 61), 20)),
                {"type": "text", "text": "Image 2:"}, image_part(image_url(b)),
                {"type": "text", "text": "What colours are these two images? Answer with two words."}]

    for a, b in (("red", "green"), ("green", "red")):
        answer = ask(client, content(a, b), max_tokens=16).choices[0].message.content
        assert colours_named(answer)[:2] == [a, b], answer


def test_concurrent_image_and_text_requests_each_get_their_own_answer(server, client):
    """Continuous batching: five image requests and a text one at once, each answered as alone; and a
    streamed image request whose client goes away mid-answer frees its slot for the next."""
    import concurrent.futures

    colours = list(NAMED)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        images = [pool.submit(ask, client, [image_part(image_url(c, (29 + i, 31), 16, seed=i)),
                                            {"type": "text", "text": QUESTION}]) for i, c in enumerate(colours)]
        text = pool.submit(ask, client, [{"type": "text", "text": "What is 2+2?"}])
        answers = [f.result().choices[0].message.content for f in images]
        assert text.result().choices[0].message.content
    assert [colours_named(a) for a in answers] == [[c] for c in colours]
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=200, stream=True,
        messages=[{"role": "user", "content": [image_part(image_url("red", (80, 80), 30, seed=9)),
                                               {"type": "text", "text": "Describe this image at length."}]}])
    next(iter(stream))
    stream.close()  # the client goes away
    answer = ask(client, [image_part(image_url("black", (80, 80), 30, seed=9)), {"type": "text", "text": QUESTION}])
    assert colours_named(answer.choices[0].message.content) == ["black"]


def test_a_users_marker_text_stays_text(client):
    """llama.cpp's default marker typed by a user is characters, not an image slot (with or without images)."""
    plain = ask(client, [{"type": "text", "text": "Say <__media__> twice."}])
    assert plain.choices[0].finish_reason in ("stop", "length")
    with_image = ask(client, [image_part(image_url("red")), {"type": "text", "text": "<__media__> " + QUESTION}])
    assert "red" in colours_named(with_image.choices[0].message.content)


def test_anthropic_image_blocks_and_responses_input_images_are_seen(server, client):
    data = image_url("green", (33, 47)).split(",", 1)[1]
    ant = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    content: Any = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                    {"type": "text", "text": QUESTION}]
    msg = ant.messages.create(model=model, max_tokens=10, messages=[{"role": "user", "content": content}],
                              extra_body={"temperature": 0})
    assert colours_named(msg.content[0].text) == ["green"]
    counted = ant.messages.count_tokens(model=model, messages=[{"role": "user", "content": content}])
    assert counted.input_tokens == msg.usage.input_tokens  # the image's positions counted as served
    resp = client.responses.create(model=model, temperature=0, max_output_tokens=10, input=[{
        "role": "user", "content": [{"type": "input_image", "image_url": image_url("black", (71, 29))},
                                    {"type": "input_text", "text": QUESTION}]}])
    assert colours_named(resp.output_text) == ["black"]


def test_a_corrupt_image_is_a_400_and_the_server_keeps_serving(client):
    good = image_url("white")
    head, data = good.split(",", 1)
    broken = head + "," + base64.b64encode(base64.b64decode(data)[:60]).decode()  # a truncated PNG
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, [image_part(broken), {"type": "text", "text": QUESTION}])
    assert err.value.body["type"] == "invalid_request_error"
    answer = ask(client, [image_part(good), {"type": "text", "text": QUESTION}]).choices[0].message.content
    assert colours_named(answer) == ["white"]


def test_a_model_without_a_projector_refuses_images_with_a_400(gguf):
    with DynamoRun("out=llamacpp", str(gguf), "--context-length", "512", startup_timeout=120) as srv:
        client = openai.OpenAI(base_url=srv.api_url, api_key="none", max_retries=0)
        assert client.models.list().data[0].model_extra["input_modalities"] == ["text"]
        with pytest.raises(openai.BadRequestError) as err:
            ask(client, [image_part(image_url("red")), {"type": "text", "text": QUESTION}])
        assert "does not accept images" in err.value.message
        assert ask(client, [{"type": "text", "text": "Hi"}]).choices[0].message.content
