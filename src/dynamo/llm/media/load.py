"""Images in a chat request: finding them, counting them and loading them.

The HTTP routes turn every API's image (an OpenAI ``image_url`` part, an Anthropic ``image`` block, a
Responses ``input_image``) into the OpenAI part ``{"type": "image_url", "image_url": {"url": ...}}``,
so the pre-processor finds them all with :func:`image_parts` and loads them with :func:`load_images`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from dynamo.llm.media.decode import LoadedImage, data_url_bytes, decode_image, local_file_bytes
from dynamo.llm.media.fetch import Fetcher
from dynamo.llm.media.policy import MediaError, MediaPolicy


def image_parts(messages: Any) -> list[str]:
    """The URLs of the ``image_url`` parts of chat ``messages`` (dicts as sent), in order; a malformed
    part is a :class:`MediaError` naming it."""
    urls: list[str] = []
    if not isinstance(messages, list):
        return urls
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise MediaError("an image_url part needs a URL: {\"image_url\": \"...\"} or "
                                 "{\"image_url\": {\"url\": \"...\"}}", param=f"messages[{i}].content[{j}].image_url")
            urls.append(url)
    return urls


def check_image_count(urls: list[str], policy: MediaPolicy) -> None:
    """Not more images than ``--limit-mm-per-prompt`` allows."""
    policy.check_count(len(urls))


async def load_image(url: str, policy: MediaPolicy) -> LoadedImage:
    """The image at ``url`` (``data:``, ``https://``, and where the policy allows ``http://`` and
    ``file://``), checked and hashed; anything refused or broken is a :class:`MediaError`.  Decoding runs
    in a thread: a 1024x1024 PNG of random pixels takes 65-200 ms on this (shared) machine, a 2048x2048
    one 300-740 ms (benchmarks/media_decode.py; the hash is under 1% of it)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return await asyncio.to_thread(lambda: decode_image(data_url_bytes(url, policy.max_bytes), policy))
    if scheme == "file":
        return await asyncio.to_thread(lambda: decode_image(local_file_bytes(url, policy), policy))
    if scheme in ("http", "https"):
        data = await Fetcher(policy).fetch(url)
        return await asyncio.to_thread(decode_image, data, policy)
    raise MediaError(f"Image URL scheme '{scheme or url[:16]}' is not supported (https:// and data: are)")


async def load_images(urls: list[str], policy: MediaPolicy) -> list[LoadedImage]:
    """Every image of a request, the count checked first, fetched concurrently, in order.  The first
    failure ends the others' fetches (the request is refused anyway)."""
    check_image_count(urls, policy)
    tasks = [asyncio.ensure_future(load_image(u, policy)) for u in urls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
