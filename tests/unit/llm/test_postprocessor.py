"""Post-processing of a core engine's tokens: hidden EOS, stop ids/strings, min/max tokens, finish reasons."""

from __future__ import annotations

import pytest

from dynamo.errors import EngineError
from dynamo.llm.backend import PostProcessor
from dynamo.llm.protocols.common import EngineOutput, PreprocessedRequest, StopConditions
from dynamo.llm.tokenizer import Tokenizer
from harness.tiny_model import ENDOFTEXT_ID, IM_END_ID


def make(tok: Tokenizer, **stop: object) -> PostProcessor:
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    return PostProcessor(tok, PreprocessedRequest(token_ids=prompt, stop_conditions=StopConditions(**stop)))


def drive(post: PostProcessor, items: list[EngineOutput]) -> tuple[str, str | None, int]:
    """Feed items like the pipeline does; return (text shown, finish reason, items consumed)."""
    shown = []
    for n, item in enumerate(items, start=1):
        text, reason = post.process(item)
        shown.append(text)
        if reason is not None:
            return "".join(shown), reason, n
    shown.append(post.end())
    return "".join(shown), post.finished, len(items)


def one_per_item(ids: list[int], final: str | None = "stop") -> list[EngineOutput]:
    items = [EngineOutput(token_ids=[i]) for i in ids]
    if final:
        items.append(EngineOutput(token_ids=[], finish_reason=final))
    return items


def test_plain_stream_is_decoded_and_finishes_with_engine_reason(tok):
    text, reason, _ = drive(make(tok), one_per_item(tok.encode("Hello world")))
    assert (text, reason) == ("Hello world", "stop")


def test_eos_is_hidden_and_stops(tok):
    ids = tok.encode("Hello") + [IM_END_ID] + tok.encode(" after")
    text, reason, consumed = drive(make(tok, stop_token_ids_hidden=[IM_END_ID]), one_per_item(ids))
    assert text == "Hello"
    assert "<|im_end|>" not in text
    assert reason == "stop"
    assert consumed == len(tok.encode("Hello")) + 1  # nothing read after the stop


def test_eos_in_the_middle_of_a_multi_token_item_cuts_the_item(tok):
    ids = tok.encode("Hello") + [IM_END_ID] + tok.encode(" after")
    text, reason, _ = drive(make(tok, stop_token_ids_hidden=[IM_END_ID]), [EngineOutput(token_ids=ids)])
    assert (text, reason) == ("Hello", "stop")


def test_a_visible_stop_id_is_shown_and_ends_the_answer(tok):
    """1.x's ``stop_token_ids_visible``, honoured by a worker that detokenizes as by one that does not."""
    ids = tok.encode("Hello") + [IM_END_ID] + tok.encode(" after")
    text, reason, _ = drive(make(tok, stop_token_ids_visible=[IM_END_ID]), [EngineOutput(token_ids=ids)])
    assert (text, reason) == ("Hello<|im_end|>", "stop")


def test_without_hidden_ids_eos_text_is_shown(tok):
    # what ignore_eos gives: the pre-processor leaves EOS out of the hidden ids
    ids = tok.encode("Hi") + [IM_END_ID] + tok.encode(" more")
    text, reason, _ = drive(make(tok, ignore_eos=True), one_per_item(ids))
    assert text == "Hi<|im_end|> more"
    assert reason == "stop"


def test_explicit_stop_token_ids_still_apply_with_ignore_eos(tok):
    ids = tok.encode("Hi") + [IM_END_ID] + tok.encode(" more") + [ENDOFTEXT_ID] + tok.encode(" tail")
    post = make(tok, ignore_eos=True, stop_token_ids_hidden=[ENDOFTEXT_ID])
    text, reason, _ = drive(post, one_per_item(ids))
    assert text == "Hi<|im_end|> more"
    assert reason == "stop"


def test_max_tokens_gives_length(tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    post = make(tok, max_tokens=3)
    text, reason, consumed = drive(post, one_per_item(ids))
    assert reason == "length"
    assert text == tok.decode(ids[:3])
    assert post.generated == 3
    assert consumed == 3


def test_max_tokens_inside_a_multi_token_item(tok):
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    text, reason, _ = drive(make(tok, max_tokens=4), [EngineOutput(token_ids=ids, finish_reason="stop")])
    assert (text, reason) == (tok.decode(ids[:4]), "length")


def test_min_tokens_suppresses_eos_until_reached(tok):
    ids = [IM_END_ID] + tok.encode("ab") + [IM_END_ID] + tok.encode("cd")
    post = make(tok, min_tokens=2, stop_token_ids_hidden=[IM_END_ID])
    text, reason, _ = drive(post, one_per_item(ids))
    # the first EOS came before min_tokens: not a stop; the next one after it is
    assert reason == "stop"
    assert text.endswith("ab")
    assert "cd" not in text


def test_min_tokens_suppresses_stop_strings_until_reached(tok):
    ids = tok.encode("Hello world. Hello world.")
    n_first = len(tok.encode("Hello world."))
    post = make(tok, min_tokens=n_first + 1, stop=["world"])
    text, reason, _ = drive(post, one_per_item(ids))
    assert reason == "stop"
    assert text == "Hello world. Hello "


def test_stop_string_across_tokens_is_trimmed_and_never_shown(tok):
    ids = tok.encode("Hello world, and more")
    post = make(tok, stop=["o wor"])
    shown = []
    reason = None
    for item in one_per_item(ids):
        text, reason = post.process(item)
        shown.append(text)
        if reason:
            break
    assert reason == "stop"
    assert "".join(shown) == "Hell"
    for i in range(len(shown)):
        assert "o wor" not in "".join(shown[: i + 1])
        assert not "".join(shown[: i + 1]).endswith("o")  # the held-back "o" never went out early


def test_partial_stop_string_released_at_finish(tok):
    ids = tok.encode("Hello wo")
    text, reason, _ = drive(make(tok, stop=["world"]), one_per_item(ids))
    assert (text, reason) == ("Hello wo", "stop")


def test_partial_stop_string_released_when_max_tokens_hits(tok):
    ids = tok.encode("Hello world")
    n = len(tok.encode("Hello w"))
    text, reason, _ = drive(make(tok, stop=["world"], max_tokens=n), one_per_item(ids))
    assert reason == "length"
    assert text == "Hello w"


def test_stream_end_without_finish_reason_releases_held_text(tok):
    ids = tok.encode("Hello wo")
    text, reason, _ = drive(make(tok, stop=["world"]), one_per_item(ids, final=None))
    assert text == "Hello wo"
    assert reason == "stop"


def test_engine_length_maps_to_length(tok):
    text, reason, _ = drive(make(tok), one_per_item(tok.encode("Hi"), final="length"))
    assert (text, reason) == ("Hi", "length")


@pytest.mark.parametrize("engine_reason", ["eos", "stop", "cancelled"])
def test_engine_stop_like_reasons_map_to_stop(tok, engine_reason):
    _, reason, _ = drive(make(tok), one_per_item(tok.encode("Hi"), final=engine_reason))
    assert reason == "stop"


@pytest.mark.parametrize("bad", [{"error": "out of memory"}, "error: out of memory"])
def test_engine_error_finish_raises(tok, bad):
    post = make(tok)
    with pytest.raises(EngineError, match="out of memory"):
        post.process(EngineOutput(token_ids=[], finish_reason=bad))


def test_text_from_upstream_passes_through_unchanged(tok):
    # a remote Backend worker already detokenised and applied stop strings: no second pass
    post = make(tok, stop=["world"])
    text, reason = post.process(EngineOutput(token_ids=[5, 6], text="hello world"))
    assert (text, reason) == ("hello world", None)
    text, reason = post.process(EngineOutput(token_ids=[7], text="!", finish_reason="stop"))
    assert (text, reason) == ("!", "stop")
    assert post.generated == 3


def test_text_passthrough_still_enforces_max_tokens(tok):
    post = make(tok, max_tokens=2)
    assert post.process(EngineOutput(token_ids=[5], text="a")) == ("a", None)
    assert post.process(EngineOutput(token_ids=[6], text="b")) == ("b", "length")


def test_multibyte_tokens_are_never_shown_half_decoded(tok):
    ids = tok.encode("z🦀z 😀😀 ẞ")
    post = make(tok)
    pieces = [post.process(item)[0] for item in one_per_item(ids)]
    assert "".join(pieces) == "z🦀z 😀😀 ẞ"
    assert all("\ufffd" not in p for p in pieces)
