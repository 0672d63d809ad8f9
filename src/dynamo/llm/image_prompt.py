"""Images in a chat prompt, on the frontend's side: where each image goes in the template's text, and the
token ids and ``multi_modal_data`` the engine gets.

The chat template sees each ``image_url`` part as a marker text, one per request and random (a user who
types ``<__media__>`` or any other marker gets those characters as text: only the request's own marker,
which nobody can guess, becomes an image).  The rendered prompt is cut at the markers; the text pieces are
tokenized as usual and each image becomes a run of placeholder ids, as many as the model card's
``image_tokens`` (the worker's image encoder says how many positions an image takes), built from the
image's ``mm_hash`` (engines/llamacpp/vision.py ``placeholder_ids``): so the KV router's block hashes and
the engine's prefix cache see the image's content, and two requests with the same text and different
images share no block from the image on.

The images themselves travel as ``ImageInput`` items (their encoded bytes, hash, and run) in
``PreprocessedRequest.multi_modal_data``: loaded and checked once, here.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable, Sequence

from dynamo.errors import RequestError
from dynamo.llm.protocols.common import ImageInput

PLACEHOLDER_BIT = 0x80000000  # placeholder ids are 0x80000000 | 31 bits of the image hash


def placeholder_ids(mm_hash: int, n: int) -> list[int]:
    """The ``n`` placeholder ids of the image whose hash is ``mm_hash``: alternately its high and low 31
    bits, so every block of two or more of them carries 62 bits of the hash (token ids are hashed as
    u32, and a real vocabulary never reaches 2**31)."""
    hi = PLACEHOLDER_BIT | ((mm_hash >> 33) & 0x7FFFFFFF)
    lo = PLACEHOLDER_BIT | (mm_hash & 0x7FFFFFFF)
    return [hi if i % 2 == 0 else lo for i in range(n)]


def new_marker() -> str:
    """A marker for one request's images that no user text contains."""
    return f"<__image_{secrets.token_hex(12)}__>"


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def with_markers(content: Any, marker: str) -> Any:
    """A message's content (as sent) with each ``image_url`` part replaced by a text part of ``marker``."""
    if not isinstance(content, list):
        return content
    return [{"type": "text", "text": marker} if is_image_part(p) else p for p in content]


def prompt_ids(prompt: str, marker: str, hashes: Sequence[int], image_tokens: int,
               encode: Callable[[str], list[int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt's token ids with each image's placeholder run, and each run's (offset, length)."""
    pieces = prompt.split(marker)
    if len(pieces) != len(hashes) + 1:
        raise RequestError(f"the chat template placed {len(pieces) - 1} of the request's {len(hashes)} images "
                           "(it drops or repeats some message content)", param="messages")
    ids: list[int] = []
    runs: list[tuple[int, int]] = []
    for i, piece in enumerate(pieces):
        if piece:
            ids.extend(encode(piece))
        if i < len(hashes):
            runs.append((len(ids), image_tokens))
            ids.extend(placeholder_ids(hashes[i], image_tokens))
    return ids, runs


def image_inputs(images: Sequence[Any], runs: list[tuple[int, int]]) -> list[ImageInput]:
    """The ``multi_modal_data`` items of loaded images (``LoadedImage``: ``data``, ``mm_hash``) and their runs."""
    return [ImageInput(data=img.data, mm_hash=img.mm_hash, offset=off, length=n)
            for img, (off, n) in zip(images, runs, strict=True)]
