"""Logprobs through the post-processor, the chunk shapes, the unary fold, the worker's wire items and the
capability checks (llm/logprobs.py), on the tiny byte-level BPE tokenizer with a scripted engine."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

import numpy as np
import pytest

from dynamo.engines.llamacpp.sampling import logsumexp, token_logprobs
from dynamo.engines.vllm import engine as vl
from dynamo.errors import RequestError
from dynamo.llm.aggregate import fold_chat, fold_completion
from dynamo.llm.backend import PostProcessor
from dynamo.llm.engine import Context
from dynamo.llm.logprobs import CompletionLogprobs, token_bytes
from dynamo.llm.model_card import load_hf_folder
from dynamo.llm.pipeline import CorePipeline
from dynamo.llm.protocols.common import EngineOutput, OutputOptions, PreprocessedRequest, StopConditions
from dynamo.llm.protocols.openai import parse_chat_request, parse_completion_request
from dynamo.llm.protocols.wire import read_output
from dynamo.llm.tokenizer import Tokenizer
from dynamo.worker.handlers import backend_handler
from harness.tiny_model import IM_END_ID


def lp_of(token_id: int) -> float:
    """A made-up logprob per token id, so an entry can be traced back to its token."""
    return -token_id / 1000


def items(ids: list[int], final: str | None = "stop", per_item: int = 1) -> list[EngineOutput]:
    out = []
    for i in range(0, len(ids), per_item):
        chunk = ids[i:i + per_item]
        out.append(EngineOutput(token_ids=chunk, log_probs=[lp_of(t) for t in chunk],
                                top_logprobs=[[{"token_id": t, "logprob": lp_of(t)},
                                               {"token_id": 5, "logprob": -9.0}, {"token_id": 6, "logprob": -0.001}]
                                              for t in chunk]))
    if final:
        out.append(EngineOutput(token_ids=[], finish_reason=final))
    return out


def post_for(tok: Tokenizer, n: int | None = 1, **stop: Any) -> PostProcessor:
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    return PostProcessor(tok, PreprocessedRequest(token_ids=prompt, stop_conditions=StopConditions(**stop),
                                                  output_options=OutputOptions(logprobs=n)))


def drive(post: PostProcessor, outs: list[EngineOutput]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(text, entries) per process() call, as the pipeline sends them."""
    got = []
    for out in outs:
        text, reason = post.process(out)
        got.append((text, post.take_logprobs() or []))
        if reason is not None:
            return got
    tail = post.end()
    got.append((tail, post.take_logprobs() or []))
    return got


def bytes_of(entries: list[dict[str, Any]]) -> bytes:
    return b"".join(bytes(e["bytes"]) for e in entries)


def test_each_step_carries_the_entries_of_its_text(tok):
    ids = tok.encode("hello world")
    got = drive(post_for(tok, n=2), items(ids))
    for text, entries in got:
        assert bytes_of(entries) == text.encode()  # every chunk: its text and its tokens agree
    entries = [e for _, es in got for e in es]
    assert [e["logprob"] for e in entries] == [lp_of(t) for t in ids]
    assert "".join(e["token"] for e in entries) == "hello world"
    # the two likeliest alternatives, best first, whatever order the engine gave
    assert [t["logprob"] for t in entries[0]["top_logprobs"]] == [-0.001, lp_of(ids[0])]


def test_a_character_split_over_tokens_goes_out_with_its_last_token(tok):
    ids = tok.encode("a日b")  # 日 is two byte tokens here: the first ends inside the character
    pieces = [token_bytes(tok).piece(i) for i in ids]
    assert ("\\xe6\\x97", [230, 151]) in pieces  # OpenAI writes the partial bytes as escapes; bytes exact
    got = drive(post_for(tok), items(ids))
    assert ("", []) in got  # the first half: no text, so its entry waits
    for text, entries in got:
        assert bytes_of(entries) == text.encode()
    assert bytes_of([e for _, es in got for e in es]).decode() == "a日b"


def test_held_back_text_keeps_its_entries_until_released(tok):
    # " ST" could start the stop string " STOP": held back with its entries, then released with them
    ids = tok.encode("go STAY")
    got = drive(post_for(tok, stop=[" STOP"]), items(ids))
    held = [entries for text, entries in got if text == "" and entries == []]
    assert held, got  # something was held back without its entries leaking early
    for text, entries in got:
        assert bytes_of(entries) == text.encode()
    assert "".join(t for t, _ in got) == "go STAY"
    assert len([e for _, es in got for e in es]) == len(ids)


def test_a_stop_string_drops_the_entries_of_the_tokens_it_cut(tok):
    ids = tok.encode("ab STOP here")
    got = drive(post_for(tok, stop=[" STOP"]), items(ids, final=None))
    text = "".join(t for t, _ in got)
    entries = [e for _, es in got for e in es]
    assert text == "ab"
    assert "".join(e["token"] for e in entries) == "ab"


def test_a_stop_string_inside_a_token_keeps_the_token_that_was_partly_shown(tok):
    ids = tok.encode("hello world")  # he ll o ' w' or ld: the stop "lo w" starts inside "ll"
    got = drive(post_for(tok, stop=["lo w"]), items(ids, final=None))
    assert "".join(t for t, _ in got) == "hel"
    assert [e["token"] for _, es in got for e in es] == ["he", "ll"]  # "o" and " w" were wholly cut


def test_hidden_eos_has_no_entry_and_max_tokens_keeps_all(tok):
    ids = tok.encode("ab") + [IM_END_ID]
    post = PostProcessor(tok, PreprocessedRequest(
        token_ids=[1], stop_conditions=StopConditions(stop_token_ids_hidden=[IM_END_ID]),
        output_options=OutputOptions(logprobs=0)))
    got = drive(post, items(ids, final=None))
    assert [e["token"] for _, es in got for e in es] == ["a", "b"]
    assert all(e["top_logprobs"] == [] for _, es in got for e in es)  # top_logprobs 0: none
    got = drive(post_for(tok, max_tokens=2), items(tok.encode("hello"), final=None, per_item=3))
    assert "".join(e["token"] for _, es in got for e in es) == "hell"


def test_without_logprobs_nothing_is_computed(tok):
    post = post_for(tok, n=None)
    post.process(items(tok.encode("ab"))[0])
    assert post.take_logprobs() is None


def test_completions_shape_offsets_and_top_dict(tok):
    ids = tok.encode("a日b")
    entries = [token_bytes(tok).entry(t, lp_of(t), [{"token_id": 5, "logprob": -0.5}], 1) for t in ids]
    shaper = CompletionLogprobs()
    first = shaper.shape(entries[:2])
    second = shaper.shape(entries[2:])
    offsets = first["text_offset"] + second["text_offset"]
    assert offsets == [0, 1, 1, 2]  # the split character counts once
    top = first["top_logprobs"][0]
    assert top == {token_bytes(tok).piece(5)[0]: -0.5, "a": lp_of(ids[0])}  # the N best and the chosen one


class _Engine:
    """A core engine that reports logprobs of the tokens it was given, and of the prompt when asked."""

    kind = "core"
    logprobs = True
    prompt_logprobs = True

    def __init__(self, ids: list[int], finish: str = "length"):
        self.ids = ids
        self.finish = finish
        self.requests: list[PreprocessedRequest] = []

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
        self.requests.append(request)
        outs = items(self.ids, final=None)
        outs[-1].finish_reason = self.finish
        if request.output_options.prompt_logprobs is not None:
            outs[0].prompt_logprobs = [None] + [{"logprob": lp_of(t), "top_logprobs": []}
                                                for t in request.token_ids[1:]]
        for out in outs:
            yield out


def pipeline(tiny_model: Path, engine: Any, logprobs: bool = True, prompt: bool = True) -> CorePipeline:
    card = load_hf_folder(tiny_model)
    card.logprobs, card.prompt_logprobs = logprobs, prompt
    return CorePipeline("tiny", card, engine)


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_unary_and_streamed(tiny_model: Path, tok, stream: bool):
    ids = tok.encode("hello world")
    p = pipeline(tiny_model, _Engine(ids))
    raw = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1,
           "max_tokens": len(ids), "stream": stream}
    ctx = Context()
    chunks = p.chat(parse_chat_request(raw), raw, ctx)
    if stream:
        got = [c async for c in chunks]
        content = [e for c in got for e in c["choices"][0]["logprobs"]["content"]]
        for c in got:  # each chunk's entries are its text's tokens
            assert "".join(e["token"] for e in c["choices"][0]["logprobs"]["content"]) == \
                (c["choices"][0]["delta"].get("content") or "")
    else:
        r = await fold_chat(chunks, ctx, "tiny")
        assert r["choices"][0]["message"]["content"] == "hello world"
        content = r["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in content] == [lp_of(t) for t in ids]
    assert all(len(e["top_logprobs"]) == 1 and set(e) == {"token", "logprob", "bytes", "top_logprobs"}
               for e in content)


async def test_completions_echo_gives_the_prompts_logprobs_first(tiny_model: Path, tok):
    ids = tok.encode("ld")
    engine = _Engine(ids)
    p = pipeline(tiny_model, engine)
    raw = {"model": "tiny", "prompt": "hello wor", "logprobs": 2, "echo": True, "max_tokens": len(ids)}
    ctx = Context()
    r = await fold_completion(p.completions(parse_completion_request(raw), raw, ctx), ctx, "tiny")
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "hello world" and "".join(lp["tokens"]) == "hello world"
    n_prompt = len(tok.encode("hello wor"))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [lp_of(t) for t in tok.encode("hello wor")[1:] + ids]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert engine.requests[0].output_options.prompt_logprobs == 2 and n_prompt > 1
    # top_logprobs: the 2 best alternatives and the chosen token
    assert all(len(d) <= 3 and lp["tokens"][i] in d for i, d in enumerate(lp["top_logprobs"]) if d)


async def test_engines_without_logprobs_are_a_400_naming_the_field(tiny_model: Path, tok):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    with pytest.raises(RequestError) as e:
        pipeline(tiny_model, _Engine([5]), logprobs=False).chat(parse_chat_request(chat), chat, Context())
    assert e.value.param == "logprobs"
    comp = {"model": "tiny", "prompt": "hi", "logprobs": 1, "echo": True}
    with pytest.raises(RequestError) as e:
        pipeline(tiny_model, _Engine([5]), prompt=False).completions(parse_completion_request(comp), comp, Context())
    assert e.value.param == "echo"
    comp["echo"] = False  # without echo that engine is fine
    pipeline(tiny_model, _Engine([5]), prompt=False).completions(parse_completion_request(comp), comp, Context())


@pytest.mark.parametrize("raw,param", [
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
])
def test_out_of_range_requests(raw, param):
    parse = parse_chat_request if "messages" in raw else parse_completion_request
    with pytest.raises(RequestError) as e:
        parse({"model": "m", **raw})
    assert e.value.param == param


async def test_a_worker_sends_entries_that_match_its_text_and_the_frontend_passes_them(tiny_model: Path, tok):
    """out=dyn: the worker post-processes (hold-back applied) and puts the entries in its wire items;
    the frontend's post-processor hands them on as they came."""
    ids = tok.encode("go STAY here")
    card = load_hf_folder(tiny_model)
    handler = backend_handler(card, _Engine(ids))
    req = PreprocessedRequest(token_ids=[5, 6], stop_conditions=StopConditions(max_tokens=len(ids), stop=[" STOP"]),
                              output_options=OutputOptions(logprobs=1), detokenize=True)
    wire = [item async for item in handler(req.to_dict())]
    for item in wire:
        assert bytes_of(item["logprobs_content"]) == item["text"].encode()
    front = PostProcessor(tok, req)
    texts = []
    for item in wire:
        text, _ = front.process(read_output(item))
        assert front.take_logprobs() == item["logprobs_content"]
        texts.append(text)
    assert "".join(texts) == "go STAY here"


def test_vllm_prompt_logprobs_are_converted_on_the_first_output():
    lp = SimpleNamespace
    out = SimpleNamespace(
        outputs=[SimpleNamespace(token_ids=[7], finish_reason=None, stop_reason=None, logprobs=None,
                                 cumulative_logprob=None)],
        finished=False, prompt_token_ids=[3, 4],
        prompt_logprobs=[None, {4: lp(logprob=-0.25, rank=2), 9: lp(logprob=-0.1, rank=1)}])
    item = vl.convert_output(out, [2], prompt_logprobs=True)
    assert item.prompt_logprobs == [None, {"logprob": -0.25, "top_logprobs": [
        {"token_id": 4, "logprob": -0.25}, {"token_id": 9, "logprob": -0.1}]}]
    assert vl.convert_output(out, [2]).prompt_logprobs is None


def test_llamacpp_log_softmax_matches_a_reference():
    rng = np.random.default_rng(0)
    row = (rng.standard_normal(49152) * 8).astype(np.float32)
    lp, tops = token_logprobs(np, row, 17, 3)
    ref = row.astype(np.float64) - math.log(np.exp(row.astype(np.float64)).sum())
    assert lp == pytest.approx(ref[17], abs=1e-5)
    best = np.argsort(-ref)[:3]
    assert sorted(t["token_id"] for t in tops) == sorted(best.tolist())
    assert all(t["logprob"] == pytest.approx(ref[t["token_id"]], abs=1e-5) for t in tops)
    rows = np.stack([row, row[::-1]])
    assert logsumexp(np, rows).shape == (2,)


async def test_disaggregation_prefills_on_the_decode_worker_when_logprobs_are_asked():
    """The first token's logprob needs the logits of the engine that ran the prompt."""
    from dynamo.frontend.disagg import DisaggCoreEngine

    class _Remote:
        def __init__(self) -> None:
            self.client = SimpleNamespace(instance_ids=lambda: [1])
            self.requests: list[PreprocessedRequest] = []

        async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EngineOutput]:
            self.requests.append(request)
            yield EngineOutput(token_ids=[1], finish_reason="length", disaggregated_params=None)

    decode, prefill = _Remote(), _Remote()
    engine = DisaggCoreEngine(decode, lambda: prefill, max_local_prefill_length=0)
    for logprobs in (None, 0):
        req = PreprocessedRequest(token_ids=list(range(10, 60)), output_options=OutputOptions(logprobs=logprobs))
        _ = [o async for o in engine.generate(req, Context())]
    assert len(prefill.requests) == 1 and prefill.requests[0].output_options.logprobs is None
    assert len(decode.requests) == 2 and decode.requests[1].disaggregated_params is None


@pytest.mark.parametrize("remote", [False, True])
async def test_with_a_tool_call_parser_every_token_keeps_its_entry(tiny_model: Path, tok, remote: bool):
    """Parsed text (a call's markup, reasoning) has no content to match, but its tokens' entries still go
    out, in order, with the chunks that follow; locally and from a worker."""
    import json

    from tests.unit.llm.test_parse_stage import ANSWER, TOOLS, Relay

    card = load_hf_folder(tiny_model)
    card.logprobs = True
    ids = tok.encode(ANSWER)
    engine: Any = _Engine(ids, finish="stop")
    if remote:
        engine = Relay(backend_handler(card, engine))
    p = CorePipeline("tiny-chat", card, engine)
    raw = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
           "logprobs": True, "stream": True}
    chunks = [c async for c in p.chat(parse_chat_request(raw), raw, Context())]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    entries = [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]]
    assert "".join(e["token"] for e in entries) == ANSWER
    unary = await fold_chat(p.chat(parse_chat_request({**raw, "stream": False}), {**raw, "stream": False},
                                   Context()), Context(), "tiny-chat")
    assert unary["choices"][0]["logprobs"]["content"] == entries
    assert json.loads(unary["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("decoder", ["sequence", "metaspace"])
def test_sentencepiece_style_tokens_bytes(decoder: str):
    """Llama/Mistral-style vocabularies: "▁" is a space and <0xNN> pieces are single bytes."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "\u2581hello": 1, "<0xE6>": 2, "<0x97>": 3, "<0xA5>": 4, "world": 5}
    hf = HF(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    hf.decoder = (decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)]) if decoder == "sequence" else decoders.Metaspace())
    tb = token_bytes(Tokenizer(hf.to_str()))
    assert tb.piece(1) == (" hello", list(b" hello"))  # the leading space a decoder strips at the start
    assert tb.piece(5) == ("world", list(b"world"))
    if decoder == "sequence":
        assert [tb.piece(i) for i in (2, 3, 4)] == [("\\xe6", [0xE6]), ("\\x97", [0x97]), ("\\xa5", [0xA5])]
        assert bytes(b for i in (2, 3, 4) for b in tb.piece(i)[1]).decode() == "日"
