#!/usr/bin/env python3
"""CPU cost of checking an image: decode (Pillow), convert to RGB and hash (xxh3-64), as the image loader
does in a thread for every image of a request (llm/media/decode.py), against the cost of the hash alone,
and of writing the checked bytes as a ``data:`` URL (what an engine given the request as sent, a pystr
file that takes images, costs on top: llm/media/inline.py).

    .venv/bin/python -m benchmarks.media_decode [--repeat 7]

Noisy images (so the encoders cannot shrink them to nothing) of four sizes, PNG and JPEG; prints the
median and the spread (min-max) of the repeats in milliseconds, and the load average.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import xxhash

from dynamo.llm.media import MediaPolicy
from dynamo.llm.media.decode import decode_image
from dynamo.llm.media.inline import data_url
from harness.images import image_bytes

SIZES = (256, 512, 1024, 2048)


def _noisy(side: int, fmt: str) -> bytes:
    """Random pixels: the worst case for the decoders (nothing compresses)."""
    import io
    import random

    from PIL import Image

    rng = random.Random(side)
    img = Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3))
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _times(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    policy = MediaPolicy()
    image_bytes(4, 4)  # Pillow's plugins loaded before timing
    print(f"load average {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    print(f"{'image':<16}{'bytes':>10}{'decode+hash ms':>18}{'spread':>16}{'hash only ms':>14}"
          f"{'data: URL ms':>14}{'spread':>14}")
    for fmt in ("PNG", "JPEG"):
        for side in SIZES:
            data = _noisy(side, fmt)
            img = decode_image(data, policy)
            assert img.width == side
            full = _times(lambda d=data: decode_image(d, policy), args.repeat)
            pixels = os.urandom(side * side * 3)
            hashed = _times(lambda p=pixels: xxhash.xxh3_64(p).intdigest(), args.repeat)
            inlined = _times(lambda i=img: data_url(i), args.repeat)
            print(f"{fmt} {side}x{side:<10}{len(data):>10}{statistics.median(full):>18.2f}"
                  f"{f'{min(full):.2f}-{max(full):.2f}':>16}{statistics.median(hashed):>14.2f}"
                  f"{statistics.median(inlined):>14.2f}{f'{min(inlined):.2f}-{max(inlined):.2f}':>14}")


if __name__ == "__main__":
    main()
