"""Small test images made with Pillow: solid colours and noise of any size, in any of the formats the
server takes, and as ``data:`` URLs."""

from __future__ import annotations

import base64
import io
import random

RED = (255, 0, 0)
GREEN = (0, 255, 0)


def image_bytes(width: int = 8, height: int = 8, color: tuple[int, int, int] = RED, fmt: str = "PNG",
                noise_seed: int | None = None) -> bytes:
    """An image ``width`` x ``height`` of one colour (or seeded noise), encoded as ``fmt``."""
    from PIL import Image

    img = Image.new("RGB", (width, height), color)
    if noise_seed is not None:
        rng = random.Random(noise_seed)
        img.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(width * height)])
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_url(width: int = 8, height: int = 8, color: tuple[int, int, int] = RED) -> str:
    return data_url(image_bytes(width, height, color))
