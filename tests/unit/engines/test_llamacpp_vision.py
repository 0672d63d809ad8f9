"""The engine's side of image prompts (engines/llamacpp/vision.py), without llama.cpp: the frontend's
placeholder runs checked against the projector's real count (rewritten when a tiling projector needs
another), malformed runs refused, and a cached prefix never ending inside an image."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dynamo.engines.llamacpp.vision import ImageSpan, cut_before_images, expand
from dynamo.errors import RequestError
from dynamo.llm.image_prompt import placeholder_ids
from dynamo.llm.protocols.common import ImageInput


@dataclass
class Chunks:
    n_pos: int


class Projector:
    """Stands in for vision.Projector: an image of ``len(data)`` bytes takes that many positions."""

    def tokenize(self, data: bytes) -> Chunks:
        return Chunks(len(data))


def item(h: int, offset: int, length: int, n_real: int) -> ImageInput:
    return ImageInput(data=b"x" * n_real, mm_hash=h, offset=offset, length=length)


def test_runs_of_the_right_length_are_kept_as_sent():
    prompt = [1, 2, *placeholder_ids(7, 4), 3, *placeholder_ids(8, 4), 4]
    out, spans = expand(prompt, [item(8, 7, 4, 4), item(7, 2, 4, 4)], Projector())  # type: ignore[arg-type]
    assert out == prompt
    assert [(s.offset, s.length) for s in spans] == [(2, 4), (7, 4)]


def test_a_run_of_another_length_is_rewritten_to_the_real_count():
    prompt = [1, *placeholder_ids(7, 4), 3, 4]
    out, spans = expand(prompt, [item(7, 1, 4, 6)], Projector())  # type: ignore[arg-type]
    assert out == [1, *placeholder_ids(7, 6), 3, 4]
    assert [(s.offset, s.length) for s in spans] == [(1, 6)]


@pytest.mark.parametrize("items", [
    [item(7, 1, 4, 4), item(8, 3, 4, 4)],  # overlapping runs
    [item(7, 5, 4, 4)],  # past the end of the prompt
    [item(7, 1, 0, 4)],  # an empty run
])
def test_malformed_runs_are_refused(items):
    with pytest.raises(RequestError):
        expand([1, *placeholder_ids(7, 4), 3, 4, 5, 6], items, Projector())  # type: ignore[arg-type]


def test_a_prompt_ending_with_an_image_is_refused():
    with pytest.raises(RequestError, match="ends with an image"):
        expand([1, *placeholder_ids(7, 4)], [item(7, 1, 4, 4)], Projector())  # type: ignore[arg-type]


def test_a_cached_prefix_is_cut_back_to_the_start_of_an_image_it_ends_in():
    spans = [ImageSpan(5, 16, None), ImageSpan(30, 16, None)]  # type: ignore[arg-type]
    assert cut_before_images(5, spans) == 5
    assert cut_before_images(12, spans) == 5
    assert cut_before_images(21, spans) == 21  # the whole first image
    assert cut_before_images(45, spans) == 30
    assert cut_before_images(3, []) == 3
