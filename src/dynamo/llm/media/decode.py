"""From bytes to a checked image: ``data:`` URLs, local files, decoding and the content hash.

All of it is CPU or disk work, run in a thread by the loader.  The format is what the bytes are, not
what the URL or the client claimed: Pillow is asked to try PNG, JPEG, WEBP and GIF only, so a file of
any other kind (or a text file named ``.png``) is refused before any other decoder sees it.  The
pixel count is checked from the header, before the pixels are decoded, so a small file that unpacks
to gigabytes (a decompression bomb) costs nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import struct
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlsplit

import msgspec
import xxhash

from dynamo.llm.media.policy import LOCAL_PATH_ENV, LOCAL_PATH_FLAG, MediaError, MediaPolicy

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


class LoadedImage(msgspec.Struct, frozen=True):
    """An image a request may use: its bytes as sent (still encoded), the format they really are, its
    size, and ``mm_hash``: xxh3-64 of the width, the height and the decoded RGB pixels, so the same picture
    is the same hash whatever its encoding, and the prefix cache and the KV router can key on it."""

    data: bytes
    mime: str
    width: int
    height: int
    mm_hash: int


def decode_image(data: bytes, policy: MediaPolicy) -> LoadedImage:
    """``data`` decoded and hashed; not an image of the four formats, corrupt, or too many pixels: a
    :class:`MediaError`."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise MediaError("The image is empty")
    try:
        with Image.open(io.BytesIO(data), formats=list(FORMATS)) as img:
            width, height = img.size
            if width * height > policy.max_pixels:
                raise MediaError(f"Image too large: {width}x{height} pixels (at most {policy.max_pixels} pixels)")
            mime = FORMATS[str(img.format)]
            img.seek(0)  # an animated GIF or WEBP: its first frame
            pixels = img.convert("RGB").tobytes()
    except UnidentifiedImageError:
        raise MediaError("Not a supported image: PNG, JPEG, WEBP and GIF are") from None
    except Image.DecompressionBombError:
        raise MediaError(f"Image too large (at most {policy.max_pixels} pixels)") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error) as e:
        raise MediaError(f"The image is corrupt or truncated ({e})") from None
    digest = xxhash.xxh3_64(struct.pack("<II", width, height))
    digest.update(pixels)
    return LoadedImage(data=data, mime=mime, width=width, height=height, mm_hash=digest.intdigest())


def data_url_bytes(url: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:[<mime>][;base64],<data>`` URL, at most ``max_bytes`` of them."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise MediaError("Malformed data: URL (expected data:<mime>;base64,<data>)")
    if header.lower().endswith(";base64"):
        if len(payload) * 3 // 4 > max_bytes + 3:
            raise MediaError(f"Image too large: more than {max_bytes} bytes")
        try:
            data = base64.b64decode(payload.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise MediaError("Malformed data: URL: the data is not valid base64") from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaError(f"Image too large: more than {max_bytes} bytes")
    return data


def local_file_bytes(url: str, policy: MediaPolicy) -> bytes:
    """The bytes of a ``file://`` URL whose real path (symlinks and ``..`` resolved) is under the
    policy's local directory."""
    root = policy.local_path
    if root is None:
        raise MediaError(f"Local files are not allowed as images (the server allows them under {LOCAL_PATH_ENV} "
                         f"or {LOCAL_PATH_FLAG})")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError("file:// URLs must name a file on this server (file:///path)")
    try:
        real = Path(unquote(parts.path)).resolve(strict=True)
    except (OSError, RuntimeError):
        raise MediaError("No such local image file") from None
    if not real.is_relative_to(root):
        raise MediaError("Local image file refused: it is outside the allowed directory")
    if not real.is_file():
        raise MediaError("The local image path is not a file")
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        raise MediaError("Cannot read the local image file") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(policy.max_bytes + 1)
    if len(data) > policy.max_bytes:
        raise MediaError(f"Image too large: more than {policy.max_bytes} bytes")
    return data
