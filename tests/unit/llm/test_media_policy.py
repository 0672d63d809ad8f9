"""The media policy, without a network: every refusal (schemes, internal addresses in all their spellings,
names that resolve to loopback, local files outside the allowed directory, oversize, disguised and
corrupt images, decompression bombs, too many images), the settings, and what a loaded image is."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from dynamo.errors import UserError
from dynamo.llm.media import (
    LoadedImage,
    MediaError,
    MediaPolicy,
    image_parts,
    is_internal_address,
    load_image,
    load_images,
    parse_limit_mm_per_prompt,
)
from dynamo.llm.model_card import load_hf_folder
from dynamo.llm.preprocessor import Preprocessor
from dynamo.llm.protocols.openai import parse_chat_request
from harness.images import GREEN, RED, data_url, image_bytes, png_url

STRICT = MediaPolicy()  # the defaults: https:// and data: only


def load(url: str, policy: MediaPolicy = STRICT) -> LoadedImage:
    return asyncio.run(load_image(url, policy))


def refused(url: str, policy: MediaPolicy = STRICT) -> str:
    with pytest.raises(MediaError) as e:
        load(url, policy)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value.message


# -- what a loaded image is ------------------------------------------------------------------------------


def test_data_url_image_is_decoded_with_its_real_format_and_size():
    img = load(png_url(7, 5))
    assert (img.mime, img.width, img.height) == ("image/png", 7, 5)
    assert img.data == image_bytes(7, 5)


def test_format_comes_from_the_bytes_not_the_claimed_type():
    img = load(data_url(image_bytes(4, 4, fmt="JPEG"), mime="image/png"))
    assert img.mime == "image/jpeg"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_the_four_formats_are_taken(fmt: str):
    assert load(data_url(image_bytes(9, 3, fmt=fmt))).width == 9


def test_mm_hash_is_of_the_pixels_not_the_encoding():
    png = load(data_url(image_bytes(6, 6, RED, "PNG")))
    webp = load(data_url(_lossless_webp(6, 6, RED)))
    assert png.data != webp.data and png.mm_hash == webp.mm_hash
    assert load(png_url(6, 6, GREEN)).mm_hash != png.mm_hash
    assert load(png_url(6, 7, RED)).mm_hash != png.mm_hash  # same colour, other size
    noisy = [load(data_url(image_bytes(6, 6, noise_seed=s))).mm_hash for s in (1, 1, 2)]
    assert noisy[0] == noisy[1] != noisy[2]


def _lossless_webp(w: int, h: int, color: tuple[int, int, int]) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "WEBP", lossless=True)
    return buf.getvalue()


def test_load_images_keeps_the_order():
    imgs = asyncio.run(load_images([png_url(1, 1), png_url(2, 2), png_url(3, 3)], STRICT))
    assert [i.width for i in imgs] == [1, 2, 3]


# -- schemes and addresses -------------------------------------------------------------------------------


def test_http_is_refused_without_allow_internal():
    assert "DYN_MM_ALLOW_INTERNAL=1" in refused("http://images.example.com/cat.png")


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "gopher://example.com/", "javascript:alert(1)",
                                 "/etc/passwd", "cat.png"])
def test_other_schemes_are_refused(url: str):
    refused(url, MediaPolicy(allow_http=True, allow_private=True))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.9.9", "[::1]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]",
                                  "10.0.0.7", "172.16.5.4", "192.168.1.1", "169.254.169.254", "[fe80::1]",
                                  "[fd12:3456::1]", "100.64.0.1", "0.0.0.0", "[::]", "224.0.0.1",
                                  "[2002:7f00:1::1]", "2130706433", "0x7f.0.0.1", "017700000001", "127.1"])
def test_internal_addresses_are_refused(host: str):
    assert "internal address" in refused(f"https://{host}/a.png")


def test_a_name_that_resolves_to_loopback_is_refused_before_connecting():
    """``localhost`` comes from /etc/hosts: the check is on what the name resolves to, not the name."""
    message = refused("https://localhost:1/a.png")
    assert "localhost" in message and "internal address" in message


@pytest.mark.parametrize("address", ["8.8.8.8", "2606:4700:4700::1111", "93.184.216.34"])
def test_public_addresses_are_not_internal(address: str):
    assert not is_internal_address(address)


def test_nonsense_is_treated_as_internal():
    assert is_internal_address("not-an-address")


# -- local files -----------------------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "red.png").write_bytes(image_bytes(3, 3))
    (tmp_path / "secret.png").write_bytes(image_bytes(4, 4))
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    (root / "inside.png").symlink_to(root / "red.png")
    return root


def test_local_files_are_refused_without_a_local_path(media_dir: Path):
    assert "DYN_MM_LOCAL_PATH" in refused((media_dir / "red.png").as_uri())


def test_local_file_under_the_local_path_is_read(media_dir: Path):
    policy = MediaPolicy(local_path=media_dir.resolve())
    assert load((media_dir / "red.png").as_uri(), policy).width == 3
    assert load((media_dir / "inside.png").as_uri(), policy).width == 3  # a link that stays inside


@pytest.mark.parametrize("name", ["../secret.png", "escape.png", "sub/../../secret.png"])
def test_local_file_outside_the_local_path_is_refused(media_dir: Path, name: str):
    (media_dir / "sub").mkdir(exist_ok=True)
    policy = MediaPolicy(local_path=media_dir.resolve())
    message = refused(f"file://{media_dir}/{name}", policy)
    assert "outside the allowed directory" in message


def test_missing_local_file_and_remote_host_are_refused(media_dir: Path):
    policy = MediaPolicy(local_path=media_dir.resolve())
    assert "No such" in refused(f"file://{media_dir}/nope.png", policy)
    refused(f"file://otherhost{media_dir}/red.png", policy)
    assert "not a file" in refused(media_dir.as_uri(), policy)


# -- sizes and contents ----------------------------------------------------------------------------------


def test_oversize_data_url_is_refused():
    big = image_bytes(64, 64, noise_seed=3)
    assert "too large" in refused(data_url(big), MediaPolicy(max_bytes=len(big) - 1))
    assert load(data_url(big), MediaPolicy(max_bytes=len(big))).width == 64


def test_oversize_local_file_is_refused(media_dir: Path):
    size = (media_dir / "red.png").stat().st_size
    policy = MediaPolicy(local_path=media_dir.resolve(), max_bytes=size - 1)
    assert "too large" in refused((media_dir / "red.png").as_uri(), policy)


def test_decompression_bomb_is_refused_from_its_header():
    """A 2000x2000 PNG of one colour is a few kilobytes; the pixel limit refuses it before decoding."""
    bomb = image_bytes(2000, 2000)
    assert len(bomb) < 64 * 1024
    assert "2000x2000" in refused(data_url(bomb), MediaPolicy(max_pixels=1000 * 1000))


@pytest.mark.parametrize("payload", [b"hello, I am text", b"<svg xmlns='http://www.w3.org/2000/svg'/>",
                                     b"%PDF-1.4\n"])
def test_not_an_image_disguised_as_png_is_refused(payload: bytes):
    assert "PNG, JPEG, WEBP and GIF" in refused(data_url(payload, "image/png"))


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "ICO"])
def test_an_image_of_another_format_is_refused(fmt: str):
    assert "PNG, JPEG, WEBP and GIF" in refused(data_url(image_bytes(8, 8, fmt=fmt), "image/png"))


def test_corrupt_image_is_refused():
    png = image_bytes(32, 32, noise_seed=5)
    assert "corrupt" in refused(data_url(png[: len(png) // 2]))
    broken = bytearray(png)
    broken[60:80] = b"\x00" * 20
    refused(data_url(bytes(broken)))


@pytest.mark.parametrize("url", ["data:image/png;base64", "data:image/png;base64,!!!notbase64!!!", "data:,"])
def test_malformed_data_urls_are_refused(url: str):
    refused(url)


# -- counting ----------------------------------------------------------------------------------------------


def test_image_parts_finds_both_forms_in_order():
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": "U1"},
                                     {"type": "image_url", "image_url": {"url": "U2", "detail": "low"}}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "U3"}}]},
    ]
    assert image_parts(messages) == ["U1", "U2", "U3"]
    with pytest.raises(MediaError) as e:
        image_parts([{"role": "user", "content": [{"type": "image_url"}]}])
    assert e.value.param == "messages[0].content[0].image_url"


def test_too_many_images_are_refused():
    with pytest.raises(MediaError) as e:
        asyncio.run(load_images([png_url()] * 3, MediaPolicy(max_images=2)))
    assert "At most 2 image(s)" in e.value.message and "--limit-mm-per-prompt" in e.value.message


@pytest.mark.parametrize("text,limit", [('{"image": 3}', 3), ("image=5", 5), (" image = 0 ", 0), ('{"image":"2"}', 2)])
def test_limit_mm_per_prompt_syntax(text: str, limit: int):
    assert parse_limit_mm_per_prompt(text) == limit


@pytest.mark.parametrize("text", ['{"image": -1}', '{"video": 1}', "image", "[1]", '{"image": 1.5}', "image=x",
                                  '{"image": true}', "{}"])
def test_bad_limit_mm_per_prompt_is_a_user_error(text: str):
    with pytest.raises(UserError):
        parse_limit_mm_per_prompt(text)


# -- settings ----------------------------------------------------------------------------------------------


def test_from_env_defaults_are_strict():
    policy = MediaPolicy.from_env({})
    assert (policy.allow_http, policy.allow_private, policy.local_path) == (False, False, None)


def test_from_env_reads_the_settings_and_flags_win(tmp_path: Path):
    env = {"DYN_MM_ALLOW_INTERNAL": "1", "DYN_MM_LOCAL_PATH": str(tmp_path), "DYN_MM_MAX_IMAGE_BYTES": "1000",
           "DYN_MM_MAX_IMAGE_PIXELS": "4096", "DYN_MM_FETCH_TIMEOUT_SECS": "2.5"}
    policy = MediaPolicy.from_env(env)
    assert policy.allow_http and policy.allow_private and policy.local_path == tmp_path.resolve()
    assert (policy.max_bytes, policy.max_pixels, policy.timeout_s) == (1000, 4096, 2.5)
    other = tmp_path / "other"
    other.mkdir()
    flagged = MediaPolicy.from_env(env, local_path=str(other), limit_mm_per_prompt="image=1")
    assert flagged.local_path == other.resolve() and flagged.max_images == 1


@pytest.mark.parametrize("env", [{"DYN_MM_ALLOW_INTERNAL": "maybe"}, {"DYN_MM_LOCAL_PATH": "/no/such/dir"},
                                 {"DYN_MM_LOCAL_PATH": "relative/dir"}, {"DYN_MM_MAX_IMAGE_BYTES": "-1"},
                                 {"DYN_MM_FETCH_TIMEOUT_SECS": "soon"}])
def test_bad_settings_are_user_errors(env: dict[str, str]):
    with pytest.raises(UserError):
        MediaPolicy.from_env(env)


# -- the chat path of a model without an image encoder -----------------------------------------------------


def test_text_only_model_refuses_images_by_name(tiny_model: Path):
    pre = Preprocessor(load_hf_folder(tiny_model))
    raw = {"model": "tiny-chat", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": png_url()}}]}]}
    with pytest.raises(MediaError) as e:
        pre.chat(parse_chat_request(raw), raw)
    assert "does not accept images" in e.value.message and "tiny-chat" in e.value.message


def test_chat_request_over_the_image_limit_is_refused_at_parse():
    raw = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": png_url()} for _ in range(17)]}]}
    with pytest.raises(MediaError) as e:
        parse_chat_request(raw)
    assert "At most 16" in e.value.message
