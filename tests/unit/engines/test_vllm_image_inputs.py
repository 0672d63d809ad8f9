"""out=vllm's image plumbing that needs no vLLM: placeholder runs -> the model's image tokens, image
decoding, the identifiers vLLM keys its caches on (the engine itself: tests/vllm/test_vllm_images.py)."""

from __future__ import annotations

import pytest

from dynamo.engines.vllm.images import decode_images, image_uuids, vllm_prompt_ids
from dynamo.errors import RequestError
from dynamo.llm.image_prompt import placeholder_ids
from dynamo.llm.protocols.common import ImageInput
from harness.images import RED, image_bytes

GREEN = (0, 255, 0)


def item(offset: int, length: int, mm_hash: int = 0x1234_5678_9ABC_DEF0, data: bytes = b"") -> ImageInput:
    return ImageInput(data=data, mm_hash=mm_hash, offset=offset, length=length)


def test_each_run_becomes_the_models_image_placeholder() -> None:
    a, b = item(2, 4, 1), item(8, 4, 2)
    ids = [10, 11, *placeholder_ids(1, 4), 12, 13, *placeholder_ids(2, 4), 14]
    # the runs in any order in multi_modal_data; the prompt keeps the text between and around them
    assert vllm_prompt_ids(ids, [b, a], [99]) == [10, 11, 99, 12, 13, 99, 14]
    assert vllm_prompt_ids(ids, [a, b], [7, 99, 8]) == [10, 11, 7, 99, 8, 12, 13, 7, 99, 8, 14]


@pytest.mark.parametrize("images", [
    [item(3, 4)],                    # runs past the prompt's end
    [item(0, 3), item(2, 2)],        # overlapping runs
    [item(1, 0)],                    # an empty run
])
def test_runs_out_of_place_are_refused(images: list[ImageInput]) -> None:
    with pytest.raises(RequestError, match="out of place"):
        vllm_prompt_ids([1, 2, 3, 4, 5], images, [99])


def test_images_decode_to_rgb_in_prompt_order() -> None:
    red = item(5, 2, data=image_bytes(3, 2, RED, fmt="PNG"))
    green = item(1, 2, data=image_bytes(4, 5, GREEN, fmt="JPEG"))
    first, second = decode_images([red, green])
    assert (first.mode, first.size) == ("RGB", (4, 5)) and second.size == (3, 2)
    assert second.getpixel((0, 0)) == RED


def test_a_broken_image_is_a_request_error() -> None:
    with pytest.raises(RequestError, match="cannot be decoded"):
        decode_images([item(0, 2, data=b"\x89PNG\r\n\x1a\n" + b"\0" * 20)])


def test_vllm_keys_images_by_the_frontends_content_hash() -> None:
    assert image_uuids([item(4, 1, mm_hash=2), item(0, 1, mm_hash=0xFFFF_FFFF_FFFF_FFFF)]) == [
        "mm-ffffffffffffffff", "mm-0000000000000002"]
