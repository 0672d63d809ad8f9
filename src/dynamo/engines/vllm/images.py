"""Images for ``out=vllm``: the frontend's placeholder runs become vLLM's own image tokens and
``multi_modal_data``, and vLLM's renderer does the rest (its model's image processor, the expansion of the
image token into the model's positions, the encoder).

Why the prompt is rewritten.  The frontend (llm/image_prompt.py) gives each image a run of placeholder ids
built from the image's ``mm_hash``; they lie above any vocabulary, so vLLM must never see them.  Each run
becomes the model's image placeholder text (``get_placeholder_str`` of vLLM's model class: ``<image>`` for
Idefics3/SmolVLM, PaliGemma, ...) tokenized, and vLLM's multimodal processor expands it in token space to
as many image tokens as its processor makes of that image (for a tiling processor, a count that depends on
the image's size).  The images go along as PIL images, with the frontend's ``mm_hash`` as their
``multi_modal_uuids``: vLLM keys its processor cache and its prefix-cache blocks on that identifier (it
puts ``(identifier, offset)`` in the hash of each block an image touches), so the same picture, however it
was encoded or sent, is a prefix hit and two pictures never share a block from the image on.

``image_tokens`` (what the card announces, so the frontend counts an image's positions) is measured once
at start: the length of the rendered probe prompt with one 64x64 image minus its text.  Exact for a model
whose processor makes a fixed count per image; for a tiling one, the count of a small image.

Nothing here imports vLLM at module level; the pure parts are unit-tested without it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Sequence

from dynamo.engines.token_engine_common import one_line
from dynamo.errors import RequestError
from dynamo.llm.protocols.common import ImageInput


def vllm_prompt_ids(token_ids: Sequence[int], images: Sequence[ImageInput], image_ids: Sequence[int]) -> list[int]:
    """``token_ids`` with each image's placeholder run replaced by ``image_ids`` (the model's image
    placeholder, tokenized), in the order of the runs (RequestError: runs out of place)."""
    out: list[int] = []
    at = 0
    for item in sorted(images, key=lambda i: i.offset):
        if item.offset < at or item.length < 1 or item.offset + item.length > len(token_ids):
            raise RequestError("image placeholders out of place in the prompt", param="messages")
        out.extend(token_ids[at:item.offset])
        out.extend(image_ids)
        at = item.offset + item.length
    out.extend(token_ids[at:])
    return out


def decode_images(images: Sequence[ImageInput]) -> list[Any]:
    """The PIL images (RGB, in prompt order) of the request's items (a thread: this decodes pixels).  The
    frontend already checked them; a worker checks again because the bytes crossed the network."""
    from PIL import Image

    out = []
    for item in sorted(images, key=lambda i: i.offset):
        try:
            with Image.open(io.BytesIO(item.data)) as img:
                img.seek(0)
                out.append(img.convert("RGB"))
        except Exception as e:  # noqa: BLE001 - Pillow raises many kinds for a bad file
            raise RequestError(f"The image cannot be decoded ({one_line(e)})", param="messages") from None
    return out


def image_uuids(images: Sequence[ImageInput]) -> list[str]:
    """vLLM's ``multi_modal_uuids`` for the images (prompt order): the frontend's content hash."""
    return [f"mm-{item.mm_hash:016x}" for item in sorted(images, key=lambda i: i.offset)]


@dataclass(frozen=True)
class VllmVision:
    """What a started vision model takes: its image placeholder's ids and an image's positions."""

    image_ids: tuple[int, ...]
    image_tokens: int

    async def engine_input(self, llm: Any, token_ids: Sequence[int], images: Sequence[ImageInput]) -> Any:
        """vLLM's rendered engine input for a prompt with images (its renderer preprocesses the images off
        the event loop)."""
        import asyncio

        pil = await asyncio.to_thread(decode_images, images)
        prompt = {"prompt_token_ids": vllm_prompt_ids(token_ids, images, self.image_ids),
                  "multi_modal_data": {"image": pil},
                  "multi_modal_uuids": {"image": image_uuids(images)}}
        try:
            (rendered,) = await llm.renderer.render_cmpl_async([prompt])
        except (ValueError, TypeError, RuntimeError) as e:  # too many images, a size the processor refuses
            raise RequestError(f"vLLM cannot take these images: {one_line(e)}", param="messages") from None
        return rendered


async def probe_vision(llm: Any) -> VllmVision | None:
    """The started model's image placeholder and positions per image, or None: it takes no images."""
    import asyncio

    config = llm.model_config
    if not getattr(config, "is_multimodal_model", False):
        return None
    from vllm.model_executor.models import ModelRegistry

    cls, _ = ModelRegistry.resolve_model_cls(config.architectures, model_config=config)
    try:
        text = cls.get_placeholder_str("image", 1)
    except (ValueError, NotImplementedError, AttributeError):
        return None  # a multimodal model of other modalities (audio, video only)
    if not text:
        return None
    ids = tuple(int(t) for t in llm.renderer.tokenizer.encode(text, add_special_tokens=False))

    def probe_image() -> Any:
        from PIL import Image

        return Image.new("RGB", (64, 64), (128, 128, 128))

    prompt = {"prompt_token_ids": list(ids), "multi_modal_data": {"image": [await asyncio.to_thread(probe_image)]}}
    (rendered,) = await llm.renderer.render_cmpl_async([prompt], skip_mm_cache=True)
    return VllmVision(image_ids=ids, image_tokens=len(rendered["prompt_token_ids"]))
