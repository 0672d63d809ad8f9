"""A chat request's images as checked ``data:`` URLs, for engines that take the request as sent.

An engine given the client's JSON (``out=pystr:FILE.py``, a remote Chat worker) would otherwise see image
URLs as the client wrote them, and fetching one there would bypass the media policy.  So the frontend
loads every image under the policy first, exactly as for a token engine, and hands the engine a copy of
the request whose ``image_url`` parts each carry the checked bytes as ``data:<mime>;base64,...`` (the
mime type the bytes really are) and a ``uuid``: ``mm-<16 hex digits>``, the image's ``mm_hash``, the
content key vLLM's chat API reads from the same field.  The engine never fetches anything.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from dynamo.llm.media.decode import LoadedImage
from dynamo.llm.media.load import image_parts, load_images
from dynamo.llm.media.policy import MediaPolicy


def image_uuid(mm_hash: int) -> str:
    """An image's content key as engines get it (the vLLM engine's ``multi_modal_uuids`` too)."""
    return f"mm-{mm_hash:016x}"


def data_url(image: LoadedImage) -> str:
    """The checked bytes as a ``data:`` URL of the type they are."""
    return f"data:{image.mime};base64,{base64.b64encode(image.data).decode('ascii')}"


async def inline_images(raw: dict[str, Any], policy: MediaPolicy) -> tuple[dict[str, Any], list[LoadedImage]]:
    """``raw`` (a chat request as sent) with each ``image_url`` part's URL replaced by its checked
    ``data:`` URL, and the images in order; refused or broken images are a :class:`MediaError`.  The
    client's dict is not changed: messages with images are copied.  Base64 runs in a thread, as the
    loading does: a 12.6 MB PNG takes 57-124 ms on this (shared) machine, a third of its decode
    (benchmarks/media_decode.py)."""
    images = await load_images(image_parts(raw.get("messages")), policy)
    if not images:
        return raw, images
    urls = await asyncio.to_thread(lambda: [data_url(i) for i in images])
    found = iter(zip(urls, images, strict=True))
    messages = []
    for msg in raw["messages"]:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            messages.append(msg)
            continue
        parts = []
        for part in content:
            if _is_image(part):
                url, image = next(found)
                ref = part["image_url"]
                kept = {k: v for k, v in ref.items() if k != "url"} if isinstance(ref, dict) else {}
                part = {**part, "image_url": {**kept, "url": url}, "uuid": image_uuid(image.mm_hash)}
            parts.append(part)
        messages.append({**msg, "content": parts})
    return {**raw, "messages": messages}, images


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"
