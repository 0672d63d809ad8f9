"""A pystr engine that takes images: it answers with what it received about each one.

    dynamo-run in=http out=pystr:examples/python_engines/image_sizes.py --model-name sizes

``generate.images = True`` (last line) says the engine takes images.  The frontend then loads each
image of a chat under its media policy and hands this file the request with every ``image_url`` part's
URL replaced by a ``data:`` URL of the checked bytes, and a ``uuid`` (``mm-`` and 16 hex digits: the same
picture, however it was sent, has the same one).  The engine fetches nothing; a real vision engine would
give the decoded images to its model where this one describes them.  The answer is one line per image:
``image/png 40x30 mm-...``.
"""

import base64
import io
import time

from PIL import Image


def describe(part):
    url = part["image_url"]["url"]
    header, _, payload = url.partition(",")
    if not header.startswith("data:") or not header.endswith(";base64"):
        return f"not a data URL: {url[:40]}"  # never happens when the frontend loaded the image
    with Image.open(io.BytesIO(base64.b64decode(payload))) as img:
        width, height = img.size
    return f"{header[5:].removesuffix(';base64')} {width}x{height} {part.get('uuid')}"


async def generate(request):
    lines = [describe(part)
             for message in request["messages"] if isinstance(message.get("content"), list)
             for part in message["content"] if part.get("type") == "image_url"]
    chunk = {"id": "sizes", "object": "chat.completion.chunk", "created": int(time.time()),
             "model": request["model"]}
    yield {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "\n".join(lines) or "no images"}}]}
    yield {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}


generate.images = True
