"""Small test images made with Pillow: solid colours and noise of any size, in any of the formats the
server takes, and as ``data:`` URLs; and a real HTTP server on 127.0.0.1 to fetch them from
(``http.server`` in a thread: the media policy's tests need a server the frontend really connects to)."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import random
import threading
from typing import Iterator

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


class ImageHandler(http.server.BaseHTTPRequestHandler):
    """A request handler that answers with image bytes and logs nothing."""

    def send_image(self, body: bytes, mime: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def image_server(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """``handler`` served on a free loopback port for the block; yields ``127.0.0.1:PORT``."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
