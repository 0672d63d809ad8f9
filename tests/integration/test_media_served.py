"""The media policy through a server whose model takes images (SmolLM2 with the closed-form colour
projector, ``out=llamacpp --mmproj``), from the three APIs' SDKs: what the policy allows reaches the model
(it names the colour), what it refuses is each API's 400 and the server keeps serving.

A real HTTP image server on 127.0.0.1 (``http.server`` in a thread) serves the pictures: refused by
default (``http://`` and loopback), fetched once ``DYN_MM_ALLOW_INTERNAL=1`` says so, redirects included.
Local files are served from ``--allowed-local-media-path`` only, symbolic links that leave it refused.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Iterator

import anthropic
import openai
import pytest

from harness.colour_projector import COLOURS, QUESTION, solid_png
from harness.images import ImageHandler, image_server
from harness.proc import DynamoRun

pytestmark = pytest.mark.timeout(300)


def png(colour: str) -> bytes:
    return solid_png(tuple(255 * c for c in COLOURS[colour]), (64, 64))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of pictures (the allowed local path), a secret outside it and a link out of it."""
    base = tmp_path_factory.mktemp("media")
    root = base / "allowed"
    root.mkdir()
    (root / "red.png").write_bytes(png("red"))
    (root / "green.png").write_bytes(png("green"))
    (base / "secret.png").write_bytes(png("yellow"))
    (root / "link.png").symlink_to(base / "secret.png")
    return root


class _Pictures(ImageHandler):
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/yellow.png")
            self.end_headers()
            return
        colour = self.path.strip("/").removesuffix(".png")
        if colour not in COLOURS:
            self.send_error(404)
            return
        self.send_image(png(colour), "image/png")


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    with image_server(_Pictures) as host:
        yield host


@pytest.fixture(scope="module")
def server(gguf: Path, colour_projector: Path, pictures: Path) -> Iterator[DynamoRun]:
    with DynamoRun("out=llamacpp", str(gguf), "--mmproj", str(colour_projector), "--context-length", "512",
                   "--enable-anthropic-api", "--allowed-local-media-path", str(pictures),
                   "--limit-mm-per-prompt", '{"image": 2}', startup_timeout=120) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, *urls: str) -> str:
    content = [*({"type": "image_url", "image_url": {"url": u}} for u in urls), {"type": "text", "text": QUESTION}]
    r = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, max_tokens=8,
                                       messages=[{"role": "user", "content": content}])
    return r.choices[0].message.content.lower()


def refused(client: openai.OpenAI, url: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, url)
    assert isinstance(e.value.body, dict) and e.value.body["type"] == "invalid_request_error"
    return e.value.body["message"]


def test_a_local_file_under_the_allowed_path_reaches_the_model(oai: openai.OpenAI, pictures: Path):
    assert "red" in chat(oai, (pictures / "red.png").as_uri())
    assert "green" in chat(oai, (pictures / "green.png").as_uri())


def test_local_files_outside_the_allowed_path_are_refused(oai: openai.OpenAI, pictures: Path):
    assert "outside the allowed directory" in refused(oai, f"file://{pictures}/../secret.png")
    assert "outside the allowed directory" in refused(oai, (pictures / "link.png").as_uri())
    assert "red" in chat(oai, (pictures / "red.png").as_uri())  # still serving


def test_internal_urls_are_refused_by_default(oai: openai.OpenAI, image_host: str):
    assert "DYN_MM_ALLOW_INTERNAL" in refused(oai, f"http://{image_host}/red.png")
    port = image_host.split(":")[1]
    for host in ("127.0.0.1", "localhost", "[::ffff:127.0.0.1]", "169.254.169.254"):
        assert "internal address" in refused(oai, f"https://{host}:{port}/red.png")
    assert "green" in chat(oai, "data:image/png;base64," + base64.b64encode(png("green")).decode())


def test_too_many_images_and_a_disguised_file_are_refused(oai: openai.OpenAI, pictures: Path):
    red = (pictures / "red.png").as_uri()
    with pytest.raises(openai.BadRequestError, match="At most 2"):
        chat(oai, red, red, red)
    assert "PNG, JPEG, WEBP and GIF" in refused(oai, "data:image/png;base64," + base64.b64encode(b"not a png").decode())


def test_anthropic_and_responses_images_reach_the_model(server: DynamoRun, oai: openai.OpenAI, pictures: Path):
    ant = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    model = oai.models.list().data[0].id
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png("yellow")).decode()}
    m = ant.messages.create(model=model, max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
        {"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}])
    assert "yellow" in m.content[0].text.lower()
    m = ant.messages.create(model=model, max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": (pictures / "red.png").as_uri()}},
        {"type": "text", "text": QUESTION}]}])
    assert "red" in m.content[0].text.lower()
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:1/x.png"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    r = oai.responses.create(model=model, temperature=0, max_output_tokens=8, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": (pictures / "green.png").as_uri(), "detail": "auto"},
        {"type": "input_text", "text": QUESTION}]}])
    assert "green" in r.output_text.lower()


def test_allow_internal_fetches_from_the_image_server_with_redirects(gguf: Path, colour_projector: Path,
                                                                     image_host: str):
    with DynamoRun("out=llamacpp", str(gguf), "--mmproj", str(colour_projector), "--context-length", "512",
                   env={"DYN_MM_ALLOW_INTERNAL": "1"}, startup_timeout=120) as srv:
        client = openai.OpenAI(base_url=srv.api_url, api_key="none", max_retries=0, timeout=120)
        assert "red" in chat(client, f"http://{image_host}/red.png")
        assert "yellow" in chat(client, f"http://{image_host}/moved")
        assert "HTTP 404" in refused(client, f"http://{image_host}/no-such-picture.png")
        assert "Local files are not allowed" in refused(client, "file:///etc/passwd")
