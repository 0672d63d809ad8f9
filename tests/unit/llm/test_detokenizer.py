"""Incremental detokenisation of byte-level BPE: streamed text equals the full decode, with no U+FFFD."""

from __future__ import annotations

import pytest

from dynamo.llm.detokenizer import IncrementalDetokenizer
from dynamo.llm.tokenizer import Tokenizer
from harness.tiny_model import MULTIBYTE_SAMPLES

TEXTS = [
    "Hello world, how are you?",
    "emoji 🙂 and 🚀!",
    "z🦀z 😀😀 ẞ",  # characters the tokenizer never saw: one byte per token
    " 日本語のテキスト",
    "  two leading spaces and\nnew lines\n\n",
    *MULTIBYTE_SAMPLES,
]


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    d = IncrementalDetokenizer(tok, prompt)
    deltas = [d.step(i) for i in ids]
    deltas.append(d.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tok: Tokenizer, text: str):
    ids = tok.encode(text)
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    for delta in deltas:
        assert "\ufffd" not in delta, f"replacement character streamed in {delta!r}"


def test_multibyte_character_split_over_tokens_is_held_until_complete(tok: Tokenizer):
    ids = tok.encode("🦀")
    assert len(ids) > 1, "the test needs a character that spans several tokens"
    deltas = stream(tok, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1)  # nothing shown while incomplete
    assert "".join(deltas) == "🦀"


@pytest.mark.parametrize("text", TEXTS)
def test_after_a_prompt_leading_spaces_are_kept(tok: Tokenizer, text: str):
    prompt = tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text)
    deltas = stream(tok, ids, prompt)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_prompt_ending_mid_character_does_not_corrupt_output(tok: Tokenizer):
    # the detokenizer seeds its window with the prompt's tail; a tail that starts inside a
    # multi-byte character must not leak into the generated text
    prompt = tok.encode("日本語のテキスト")
    out = "".join(stream(tok, tok.encode(" and more"), prompt))
    assert out == " and more"


def test_special_tokens_are_rendered(tok: Tokenizer):
    ids = tok.encode("<|im_start|>assistant\nhi<|im_end|>")
    assert "".join(stream(tok, ids)) == "<|im_start|>assistant\nhi<|im_end|>"


def test_incomplete_character_at_end_is_flushed(tok: Tokenizer):
    ids = tok.encode("🦀")[:-1]
    d = IncrementalDetokenizer(tok)
    assert [d.step(i) for i in ids] == [""] * len(ids)
    assert d.flush() != ""  # whatever there is (U+FFFD) is given back at the end, not lost silently


def test_long_stream_keeps_working_past_the_window_trim(tok: Tokenizer):
    text = "The quick brown fox jumps over the lazy dog. 🙂 " * 20
    ids = tok.encode(text)
    assert "".join(stream(tok, ids)) == text


@pytest.fixture(scope="module")
def sp_tok() -> Tokenizer:
    """A SentencePiece-style tokenizer (Metaspace ``▁`` word marks, byte fallback), as Llama 2 / Mistral use:
    decoding a word token on its own drops its leading space, so naive per-token decoding glues words."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from harness.tiny_model import CORPUS

    hf = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    hf.train_from_iterator(CORPUS.splitlines(), trainer=trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                                           show_progress=False))
    return Tokenizer(hf.to_str())


@pytest.mark.parametrize("text", ["Hello world, how are you?", "emoji 🙂 and 🚀!", "z🦀z 😀 ẞ"])
def test_sentencepiece_word_spaces_survive_streaming(sp_tok: Tokenizer, text: str):
    ids = sp_tok.encode(text)
    naive = "".join(sp_tok.decode([i]) for i in ids)
    assert naive != text  # per-token decoding glues the words: what the streaming decoder must avoid
    deltas = stream(sp_tok, ids)
    assert "".join(deltas) == sp_tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    # after a prompt, the first word keeps its space too
    after = "".join(stream(sp_tok, ids, sp_tok.encode("Say something")))
    assert after == " " + text


def test_unknown_id_mid_stream_loses_no_text(tok: Tokenizer):
    # an engine emitting an id past the vocabulary (a padded lm_head) must not wedge the stream
    before, after = tok.encode("Hello world"), tok.encode(", how are you?")
    d = IncrementalDetokenizer(tok)
    out = [d.step(i) for i in [*before, tok.vocab_size + 7, *after]]
    out.append(d.flush())
    assert "".join(out) == "Hello world, how are you?"


class _FailingStream:
    """Stands in for a DecodeStream whose Rust side raises (e.g. a decoder it cannot stream)."""

    def __init__(self, fail_after: int) -> None:
        self.left = fail_after
        self.real = None

    def step(self, hf, token_id):  # noqa: ANN001 - mirrors DecodeStream.step
        if self.left == 0:
            raise Exception("decoder cannot stream")
        self.left -= 1
        return self.real.step(hf, token_id)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("fail_after", [0, 3])
def test_fallback_after_decode_stream_error_gives_the_same_text(tok: Tokenizer, text: str, fail_after: int):
    prompt = tok.encode("<|im_start|>assistant\n")
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt)
    failing = _FailingStream(fail_after)
    failing.real, d._stream = d._stream, failing  # type: ignore[assignment]
    deltas = [d.step(i) for i in ids] + [d.flush()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)
