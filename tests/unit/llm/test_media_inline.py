"""A chat request's images as checked ``data:`` URLs (llm/media/inline.py), and the full pipeline's switch:
an engine given the request as sent gets them only when its card says it takes them."""

from __future__ import annotations

import asyncio
import base64
import copy
from typing import Any, AsyncIterator

import pytest

from dynamo.llm.engine import Context, capabilities_of
from dynamo.llm.media import MediaError, MediaPolicy, image_uuid, inline_images, load_image
from dynamo.llm.model_card import ModelCard
from dynamo.llm.pipeline import FullPipeline
from dynamo.llm.protocols.openai import parse_chat_request
from harness.images import GREEN, RED, data_url, image_bytes

STRICT = MediaPolicy()


def chat(*parts: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}]}


def test_images_become_data_urls_of_their_real_type_with_their_hash():
    jpeg = image_bytes(5, 4, GREEN, "JPEG")
    raw = chat({"type": "image_url", "image_url": {"url": data_url(jpeg, "image/png"), "detail": "low"}},
               {"type": "image_url", "image_url": data_url(image_bytes(2, 2, RED))})
    sent = copy.deepcopy(raw)
    out, images = asyncio.run(inline_images(raw, STRICT))
    assert raw == sent  # the client's dict is left alone
    first, second = out["messages"][1]["content"][1:]
    assert first["image_url"] == {"url": "data:image/jpeg;base64," + base64.b64encode(jpeg).decode(), "detail": "low"}
    assert first["uuid"] == image_uuid(images[0].mm_hash) and first["uuid"].startswith("mm-")
    assert second["image_url"]["url"].startswith("data:image/png;base64,")
    assert second["uuid"] == image_uuid(images[1].mm_hash) != first["uuid"]
    assert out["messages"][0] is raw["messages"][0]  # messages without images are not copied
    assert parse_chat_request(out).messages[1].content  # still a request our parser takes


def test_a_uuid_the_client_wrote_is_replaced():
    raw = chat({"type": "image_url", "image_url": {"url": data_url(image_bytes(2, 2))}, "uuid": "mm-0000000000000000"})
    out, images = asyncio.run(inline_images(raw, STRICT))
    assert out["messages"][1]["content"][1]["uuid"] == image_uuid(images[0].mm_hash) != "mm-0000000000000000"


def test_no_images_is_the_same_request():
    raw = chat()
    assert asyncio.run(inline_images(raw, STRICT)) == (raw, [])


@pytest.mark.parametrize("url", ["http://127.0.0.1/x.png", "file:///etc/passwd", "data:image/png;base64,AAAA"])
def test_refused_images_refuse_the_request(url: str):
    with pytest.raises(MediaError):
        asyncio.run(inline_images(chat({"type": "image_url", "image_url": {"url": url}}), STRICT))


def test_the_data_url_loads_back_to_the_same_image():
    raw = chat({"type": "image_url", "image_url": {"url": data_url(image_bytes(6, 3, GREEN, "WEBP"), "image/gif")}})
    out, (image,) = asyncio.run(inline_images(raw, STRICT))
    again = asyncio.run(load_image(out["messages"][1]["content"][1]["image_url"]["url"], STRICT))
    assert again == image


class _RawEngine:
    kind = "full"
    wants_raw_request = True

    def __init__(self, images: bool):
        self.image_urls = images
        self.seen: list[dict[str, Any]] = []

    async def generate(self, request: Any, context: Context, raw: dict[str, Any] | None = None
                       ) -> AsyncIterator[dict[str, Any]]:
        assert raw is not None
        self.seen.append(raw)
        yield {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}


async def _drain(pipeline: FullPipeline, raw: dict[str, Any]) -> list[Any]:
    return [item async for item in pipeline.chat(parse_chat_request(raw), raw, Context())]


@pytest.mark.parametrize("declared", [True, False])
def test_full_pipeline_passes_images_only_to_an_engine_whose_card_takes_them(declared: bool):
    engine = _RawEngine(declared)
    card = ModelCard.placeholder("m")
    card.image_urls = capabilities_of(engine).image_urls
    assert card.takes_images is declared
    pipeline = FullPipeline("m", card, engine)  # type: ignore[arg-type]
    raw = chat({"type": "image_url", "image_url": {"url": data_url(image_bytes(2, 2))}})
    if not declared:
        with pytest.raises(MediaError, match="'m' does not accept images"):
            asyncio.run(_drain(pipeline, raw))
        assert engine.seen == []
        return
    asyncio.run(_drain(pipeline, raw))
    (seen,) = engine.seen
    assert seen["messages"][1]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")


def test_an_engine_not_given_the_raw_request_cannot_declare_images():
    engine = _RawEngine(True)
    engine.wants_raw_request = False  # type: ignore[misc]
    assert capabilities_of(engine).image_urls is False


def test_the_card_carries_image_urls_to_a_remote_frontend():
    card = ModelCard.placeholder("m")
    card.image_urls = True
    again = ModelCard.from_json(card.to_json())
    assert again.image_urls and again.takes_images and not again.image_tokens
