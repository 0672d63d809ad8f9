"""Images to a Python engine given the request as sent (``out=pystr:FILE.py``), locally and behind
``out=dyn``, from the openai SDK against real ``dynamo-run`` processes.

The engine is the documented example (``examples/python_engines/image_sizes.py``): it declares
``generate.images = True`` and answers, per image, the ``data:`` URL's type, the size Pillow decodes
from it and its ``uuid``.  So each test sees what the engine received: checked bytes, never the URL the
client sent.  A real HTTP image server on 127.0.0.1 (``http.server`` in a thread) serves a picture, which
the default policy refuses (``http://``, loopback) and ``DYN_MM_ALLOW_INTERNAL=1`` lets the frontend
fetch.  The same file without the declaration keeps refusing images.
"""

from __future__ import annotations

import base64
import re
import threading
from pathlib import Path
from typing import Iterator

import anthropic
import openai
import pytest

from harness.images import GREEN, ImageHandler, data_url, image_bytes, image_server
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until

pytestmark = pytest.mark.timeout(180)

ENGINE = Path(__file__).parents[2] / "examples" / "python_engines" / "image_sizes.py"
MODEL = "sizes"
ANSWER = re.compile(r"^(image/\w+) (\d+)x(\d+) (mm-[0-9a-f]{16})$")


HUNG = threading.Event()  # set by /hang once the fetcher closed the connection it never got an answer on


class _Picture(ImageHandler):
    """``/photo.jpg``: a 40x30 JPEG (named and typed as one, and one); ``/hang``: never answers, and
    notes when the other side gives up (:data:`HUNG`); anything else 404."""

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path == "/hang":
            if self.connection.recv(1) == b"":  # blocks until the fetcher closes its side
                HUNG.set()
            return
        if self.path != "/photo.jpg":
            self.send_error(404)
            return
        self.send_image(image_bytes(40, 30, GREEN, "JPEG"), "image/jpeg")


@pytest.fixture(scope="module")
def photo_url() -> Iterator[str]:
    with image_server(_Picture) as host:
        yield f"http://{host}/photo.jpg"


def client(srv: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.api_url, api_key="none", max_retries=0, timeout=60)


def ask(oai: openai.OpenAI, *urls: str, stream: bool = False) -> list[tuple[str, int, int, str]]:
    """What the engine received, one (mime, width, height, uuid) per image."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "What sizes?"},
                                             *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
            model=MODEL, messages=messages, stream=True) if c.choices)
    else:
        text = oai.chat.completions.create(model=MODEL, messages=messages).choices[0].message.content or ""
    found = [ANSWER.match(line) for line in text.splitlines()]
    assert found and all(found), text  # every image reached the engine as a data: URL
    return [(m[1], int(m[2]), int(m[3]), m[4]) for m in found if m]


def refused(oai: openai.OpenAI, url: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        ask(oai, url)
    body = e.value.body
    assert e.value.status_code == 400 and isinstance(body, dict) and body["type"] == "invalid_request_error", body
    return str(body["message"])


def modalities(oai: openai.OpenAI) -> list[str]:
    (model,) = oai.models.list().data
    return model.model_extra["input_modalities"]


# -- in=http out=pystr: -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def https_only() -> Iterator[DynamoRun]:
    with DynamoRun(f"out=pystr:{ENGINE}", "--model-name", MODEL, "--enable-anthropic-api",
                   env={"DYN_MM_ALLOW_INTERNAL": "0"}) as srv:
        yield srv


def test_a_declared_engine_is_listed_as_taking_images(https_only: DynamoRun):
    assert modalities(client(https_only)) == ["text", "image"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_data_url_reaches_the_engine_as_checked_bytes(https_only: DynamoRun, stream: bool):
    """A JPEG sent under a PNG label reaches the engine typed as what its bytes are; two images in order,
    the same picture with the same uuid however it was encoded."""
    oai = client(https_only)
    jpeg = image_bytes(40, 30, GREEN, "JPEG")
    got = ask(oai, data_url(jpeg, "image/png"), data_url(image_bytes(7, 5, GREEN)), data_url(jpeg), stream=stream)
    assert [g[:3] for g in got] == [("image/jpeg", 40, 30), ("image/png", 7, 5), ("image/jpeg", 40, 30)]
    assert got[0][3] == got[2][3] != got[1][3]


def test_loopback_http_is_refused_by_default_and_the_server_keeps_serving(https_only: DynamoRun, photo_url: str):
    oai = client(https_only)
    assert refused(oai, photo_url).startswith("Image URLs must be https:// or data:")
    assert refused(oai, "data:image/png;base64,bm90IGFuIGltYWdl").startswith("Not a supported image")
    assert ask(oai, data_url(image_bytes(3, 2)))[0][:3] == ("image/png", 3, 2)


def test_anthropic_and_responses_images_reach_the_engine_too(https_only: DynamoRun):
    png = image_bytes(9, 4)
    ant = anthropic.Anthropic(base_url=https_only.base_url, api_key="none", max_retries=0, timeout=60)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}
    answer = ant.messages.create(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": [
        {"type": "image", "source": source}, {"type": "text", "text": "What size?"}]}])
    assert ANSWER.match(answer.content[0].text).groups()[:3] == ("image/png", "9", "4")  # type: ignore[union-attr]
    response = client(https_only).responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What size?"}, {"type": "input_image", "image_url": data_url(png), "detail": "auto"}]}])
    assert ANSWER.match(response.output_text).groups()[:3] == ("image/png", "9", "4")  # type: ignore[union-attr]


def test_loopback_http_is_fetched_by_the_frontend_when_allowed(photo_url: str):
    with DynamoRun(f"out=pystr:{ENGINE}", "--model-name", MODEL, env={"DYN_MM_ALLOW_INTERNAL": "1"}) as srv:
        oai = client(srv)
        (got,) = ask(oai, photo_url)
        assert got[:3] == ("image/jpeg", 40, 30)
        # a client that leaves while its image is being fetched ends the fetch, and the server keeps serving
        hang = photo_url.replace("/photo.jpg", "/hang")
        impatient = oai.with_options(timeout=2)
        with pytest.raises(openai.APITimeoutError):
            ask(impatient, hang)
        assert HUNG.wait(15), "the frontend kept fetching the image of a request whose client went away"
        assert ask(oai, photo_url) == [got]


def test_an_engine_that_does_not_declare_images_still_refuses_them(tmp_path: Path):
    plain = tmp_path / "plain_sizes.py"
    plain.write_text(ENGINE.read_text().replace("generate.images = True", ""))
    with DynamoRun(f"out=pystr:{plain}", "--model-name", MODEL) as srv:
        oai = client(srv)
        assert modalities(oai) == ["text"]
        assert f"'{MODEL}' does not accept images" in refused(oai, data_url(image_bytes(3, 2)))
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "no picture"}])
        assert r.choices[0].message.content == "no images"


# -- in=dyn out=pystr: behind out=dyn -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    store = tmp_path_factory.mktemp("store")
    store.chmod(0o700)
    return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(store), "DYN_REQUEST_PLANE": "tcp",
            "DYN_EVENT_PLANE": "zmq"}


def test_a_remote_pystr_worker_gets_images_loaded_by_the_frontend(fleet_env: dict[str, str], photo_url: str):
    """The frontend may fetch loopback http (``DYN_MM_ALLOW_INTERNAL=1``), the worker may not: the image
    still arrives, because the frontend loaded it and the worker got a ``data:`` URL.  The worker's card
    says it takes images, so the frontend's ``/v1/models`` does."""
    with DynamoWorker(f"in=dyn://{MODEL}.pystr.generate", f"out=pystr:{ENGINE}", "--model-name", MODEL,
                      env={**fleet_env, "DYN_MM_ALLOW_INTERNAL": "0"}), \
            DynamoRun("out=dyn", env={**fleet_env, "DYN_MM_ALLOW_INTERNAL": "1"}) as fe:
        oai = client(fe)
        wait_until(lambda: [m.id for m in oai.models.list().data] == [MODEL], 30, "the frontend to see the worker")
        assert modalities(oai) == ["text", "image"]
        (fetched,) = ask(oai, photo_url)
        assert fetched[:3] == ("image/jpeg", 40, 30)
        (sent,) = ask(oai, data_url(image_bytes(40, 30, GREEN, "JPEG")), stream=True)
        assert sent == fetched  # same bytes, same uuid
        assert "Not a supported image" in refused(oai, "data:image/png;base64,bm90IGFuIGltYWdl")
        assert ask(oai, data_url(image_bytes(3, 2)))[0][:3] == ("image/png", 3, 2)
