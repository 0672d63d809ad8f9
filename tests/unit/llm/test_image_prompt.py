"""Images in a chat prompt, on the frontend's side (llm/image_prompt.py and the pre-processor): where each
image goes, the placeholder runs that carry the image hash into the block hashes, the bytes that travel to
the engine, and the refusals."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest

from dynamo.errors import RequestError
from dynamo.kv.hashing import compute_block_hashes
from dynamo.llm.image_prompt import PLACEHOLDER_BIT, placeholder_ids, prompt_ids
from dynamo.llm.media import MediaError
from dynamo.llm.model_card import load_hf_folder
from dynamo.llm.preprocessor import Preprocessor
from dynamo.llm.protocols.common import PreprocessedRequest
from dynamo.llm.protocols.openai import parse_chat_request

N = 6  # placeholder positions per image in these tests


def png(rgb: tuple[int, int, int]) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (9, 7), rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def pre(tiny_model: Path) -> Preprocessor:
    card = load_hf_folder(tiny_model)
    card.image_tokens = N
    return Preprocessor(card)


def raw_chat(*parts: str) -> dict[str, object]:
    """A user message of text parts and, for each ``data:`` URL, an image part."""
    content = [{"type": "image_url", "image_url": {"url": p}} if p.startswith("data:") else {"type": "text", "text": p}
               for p in parts]
    return {"model": "tiny-chat", "messages": [{"role": "user", "content": content}]}


async def preprocess(pre: Preprocessor, raw: dict[str, object]) -> PreprocessedRequest:
    return (await pre.chat_async(parse_chat_request(raw), raw)).request


def test_placeholders_carry_the_hash_and_stay_out_of_any_vocabulary():
    a, b = placeholder_ids(0x0123456789ABCDEF, 4), placeholder_ids(0x0123456789ABCDEE, 4)
    assert all(t >= PLACEHOLDER_BIT and t < 1 << 32 for t in a)
    assert a != b  # a one-bit difference shows in a run of two or more
    assert compute_block_hashes(a, 4) != compute_block_hashes(b, 4)
    assert placeholder_ids(5, 3) == placeholder_ids(5, 3)


def test_prompt_ids_cut_at_the_marker_and_refuse_a_template_that_drops_an_image():
    ids, runs = prompt_ids("ab<M>cd<M>e", "<M>", [1, 2], 3, lambda s: [ord(c) for c in s])
    assert runs == [(2, 3), (7, 3)]
    assert ids[:2] == [97, 98] and ids[5:7] == [99, 100] and ids[-1] == 101
    assert ids[2:5] == placeholder_ids(1, 3) and ids[7:10] == placeholder_ids(2, 3)
    with pytest.raises(RequestError, match="placed 1 of the request's 2 images"):
        prompt_ids("ab<M>cd", "<M>", [1, 2], 3, lambda s: [ord(c) for c in s])


async def test_an_image_becomes_a_run_where_it_was_and_its_bytes_travel(pre):
    red, green = png((255, 0, 0)), png((0, 255, 0))
    req = await preprocess(pre, raw_chat("Look:", red, "and", green, "<__media__> done"))
    (one, two) = req.multi_modal_data
    assert one.length == two.length == N
    assert req.token_ids[one.offset:one.offset + N] == placeholder_ids(one.mm_hash, N)
    assert req.token_ids[two.offset:two.offset + N] == placeholder_ids(two.mm_hash, N)
    assert one.offset < two.offset and one.mm_hash != two.mm_hash
    assert one.data == base64.b64decode(red.split(",", 1)[1])
    # the user's marker text is tokens of text, not a third run
    assert sum(1 for t in req.token_ids if t >= PLACEHOLDER_BIT) == 2 * N
    # and it all survives the wire (bytes as base64 in JSON)
    again = PreprocessedRequest.from_dict(req.to_dict())
    assert again.multi_modal_data == req.multi_modal_data


async def test_the_same_image_is_the_same_prompt_another_image_another(pre):
    a = await preprocess(pre, raw_chat(png((1, 2, 3)), "What is it?"))
    b = await preprocess(pre, raw_chat(png((1, 2, 3)), "What is it?"))
    c = await preprocess(pre, raw_chat(png((1, 2, 4)), "What is it?"))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids and len(a.token_ids) == len(c.token_ids)


async def test_images_to_a_text_model_and_broken_images_are_refused(pre, tiny_model):
    text_only = Preprocessor(load_hf_folder(tiny_model))
    raw = raw_chat(png((0, 0, 0)), "Hi")
    with pytest.raises(MediaError, match="does not accept images"):
        text_only.render_chat(parse_chat_request(raw), raw)
    with pytest.raises(MediaError):
        await preprocess(pre, raw_chat("data:image/png;base64,aGVsbG8=", "Hi"))
    with pytest.raises(RequestError, match="chat_async"):
        pre.chat(parse_chat_request(raw), raw)
