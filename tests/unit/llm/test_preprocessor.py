"""OpenAI request -> pre-processed request: template, tokens, stop conditions, sampling options."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo.errors import RequestError
from dynamo.llm.model_card import load_hf_folder
from dynamo.llm.preprocessor import Preprocessor
from dynamo.llm.protocols.openai import parse_chat_request, parse_completion_request
from harness.tiny_model import ENDOFTEXT_ID, IM_END_ID, IM_START_ID


@pytest.fixture(scope="module")
def pre(tiny_model: Path) -> Preprocessor:
    return Preprocessor(load_hf_folder(tiny_model))


def chat(pre: Preprocessor, **fields):
    raw = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hello"}], **fields}
    return pre.chat(parse_chat_request(raw), raw)


def completion(pre: Preprocessor, **fields):
    raw = {"model": "tiny-chat", "prompt": "Hello world", **fields}
    return pre.completion(parse_completion_request(raw))


def test_chat_is_templated_and_tokenized(pre):
    out = chat(pre)
    assert out.formatted_prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert out.request.token_ids == pre.tokenizer.encode(out.formatted_prompt)
    assert out.request.token_ids[0] == IM_START_ID  # the template supplies BOS; none added twice
    assert out.request.model == "tiny-chat"


def test_trailing_assistant_message_is_continued_not_reopened(pre):
    raw_msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]
    out = chat(pre, messages=raw_msgs)
    assert out.formatted_prompt.endswith("<|im_start|>assistant\nSure, <|im_end|>\n")
    out = chat(pre, messages=raw_msgs, add_generation_prompt=True)
    assert out.formatted_prompt.endswith("<|im_start|>assistant\n")


def test_content_parts_are_joined_for_the_template(pre):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert "user\none\ntwo<|im_end|>" in chat(pre, messages=msgs).formatted_prompt


def test_completions_prompt_is_used_raw(pre):
    out = completion(pre)
    assert out.request.token_ids == pre.tokenizer.encode("Hello world")
    assert "<|im_start|>" not in pre.tokenizer.decode(out.request.token_ids)


def test_completions_single_element_string_list_is_a_plain_prompt(pre):
    out = completion(pre, prompt=["Hello world"])
    assert out.request.token_ids == pre.tokenizer.encode("Hello world")


def test_completions_token_id_prompt_is_used_directly(pre):
    out = completion(pre, prompt=[IM_START_ID, 300, 301])
    assert out.request.token_ids == [IM_START_ID, 300, 301]


def test_completions_token_id_prompt_out_of_vocabulary_is_rejected(pre):
    with pytest.raises(RequestError, match="out of vocabulary") as e:
        completion(pre, prompt=[1, 999999])
    assert e.value.status == 400


def test_completions_batch_is_one_engine_request_per_prompt(pre):
    req = parse_completion_request({"model": "m", "prompt": [[IM_START_ID, 300], [301]]})
    prompts = pre.completion_prompts(req)
    assert prompts == [[IM_START_ID, 300], [301]]
    assert [pre.completion(req, prompt=p).request.token_ids for p in prompts] == prompts
    assert pre.completion_prompts(parse_completion_request({"model": "m", "prompt": ["a", "b"]})) == ["a", "b"]
    assert pre.completion_prompts(parse_completion_request({"model": "m", "prompt": [1, 2]})) == [[1, 2]]
    with pytest.raises(RequestError, match="One prompt"):  # a batch is the pipeline's to split
        completion(pre, prompt=["a", "b"])


def test_completions_empty_prompt_is_rejected(pre):
    with pytest.raises(RequestError, match="empty"):
        completion(pre, prompt="")


def test_stop_strings_apply_to_completions_too(pre):
    assert completion(pre, stop=["END"]).request.stop_conditions.stop == ["END"]
    assert completion(pre, stop="END").request.stop_conditions.stop == ["END"]


def test_model_eos_ids_are_hidden_stop_tokens(pre):
    req = chat(pre).request
    assert req.eos_token_ids == [IM_END_ID, ENDOFTEXT_ID]  # config.json plus generation_config.json
    assert set(req.stop_conditions.stop_token_ids_hidden) == {IM_END_ID, ENDOFTEXT_ID}
    assert not req.stop_conditions.ignore_eos


def test_ignore_eos_drops_eos_only_and_keeps_explicit_stops(pre):
    req = chat(pre, nvext={"ignore_eos": True}, stop=["x"], stop_token_ids=[300]).request
    sc = req.stop_conditions
    assert sc.ignore_eos is True
    assert sc.stop == ["x"]
    assert sc.stop_token_ids_hidden == [300]
    assert req.eos_token_ids == []


def test_root_ignore_eos_takes_precedence_over_nvext(pre):
    req = chat(pre, ignore_eos=False, nvext={"ignore_eos": True}).request
    assert not req.stop_conditions.ignore_eos
    assert IM_END_ID in req.stop_conditions.stop_token_ids_hidden
    req = chat(pre, ignore_eos=True, nvext={"ignore_eos": False}).request
    assert req.stop_conditions.ignore_eos is True


def test_max_tokens_defaults_to_the_rest_of_the_context(pre):
    req = chat(pre).request
    assert req.stop_conditions.max_tokens == pre.card.context_length - len(req.token_ids)


def test_max_completion_tokens_wins_over_max_tokens_for_chat(pre):
    req = chat(pre, max_tokens=50, max_completion_tokens=7).request
    assert req.stop_conditions.max_tokens == 7
    assert chat(pre, max_tokens=50).request.stop_conditions.max_tokens == 50


def test_min_tokens_is_forwarded(pre):
    assert chat(pre, min_tokens=3).request.stop_conditions.min_tokens == 3


def small_context(tiny_model: Path, n: int) -> Preprocessor:
    card = load_hf_folder(tiny_model)
    card.context_length = n
    return Preprocessor(card)


def test_prompt_longer_than_context_is_a_400(tiny_model):
    p = small_context(tiny_model, 20)
    with pytest.raises(RequestError) as e:
        chat(p)
    assert e.value.status == 400
    assert "maximum context length is 20 tokens" in str(e.value)
    assert e.value.param == "messages"


def test_prompt_plus_max_tokens_over_context_is_a_400(tiny_model):
    p = small_context(tiny_model, 100)
    with pytest.raises(RequestError) as e:
        completion(p, max_tokens=99)
    assert e.value.status == 400
    assert "maximum context length is 100 tokens" in str(e.value)
    assert e.value.param == "max_tokens"
    # just fitting is fine
    n = len(p.tokenizer.encode("Hello world"))
    assert completion(p, max_tokens=100 - n).request.stop_conditions.max_tokens == 100 - n


def test_unknown_context_length_leaves_max_tokens_unset(tiny_model):
    p = small_context(tiny_model, 0)
    assert chat(p).request.stop_conditions.max_tokens is None


def test_sampling_options_are_mapped(pre):
    s = chat(pre, temperature=0.5, top_p=0.9, presence_penalty=0.1, frequency_penalty=-0.2,
             seed=42, min_p=0.05, top_k=40, repetition_penalty=1.1).request.sampling_options
    assert (s.temperature, s.top_p, s.presence_penalty, s.frequency_penalty) == (0.5, 0.9, 0.1, -0.2)
    assert (s.seed, s.min_p, s.top_k, s.repetition_penalty) == (42, 0.05, 40, 1.1)


def test_nvext_sampling_fields_are_used_and_root_level_wins(pre):
    s = chat(pre, nvext={"top_k": 5, "repetition_penalty": 1.3}).request.sampling_options
    assert (s.top_k, s.repetition_penalty) == (5, 1.3)
    s = chat(pre, top_k=9, repetition_penalty=1.05, nvext={"top_k": 5, "repetition_penalty": 1.3}).request.sampling_options
    assert (s.top_k, s.repetition_penalty) == (9, 1.05)


def test_greedy_sampling_clears_temperature_and_top_p(pre):
    s = chat(pre, temperature=1.2, top_p=0.5, nvext={"greed_sampling": True}).request.sampling_options
    assert not s.temperature
    assert s.top_p is None


def test_guided_decoding_root_wins_over_nvext(pre):
    import dataclasses

    pre = Preprocessor(dataclasses.replace(pre.card, guided_decoding=["json", "regex", "grammar", "choice"]))
    g = chat(pre, guided_regex="[0-9]+", nvext={"guided_regex": "[a-z]+"}).request.sampling_options.guided_decoding
    assert g == {"regex": "[0-9]+"}
    g = chat(pre, nvext={"guided_choice": ["yes", "no"]}).request.sampling_options.guided_decoding
    assert g == {"choice": ["yes", "no"]}


def test_annotations_are_copied(pre):
    req = chat(pre, nvext={"annotations": ["formatted_prompt", "token_ids"]}).request
    assert req.annotations == ["formatted_prompt", "token_ids"]


def test_logprobs_mapping(pre):
    assert chat(pre, logprobs=True, top_logprobs=3).request.output_options.logprobs == 3
    assert chat(pre, logprobs=True).request.output_options.logprobs == 0  # the chosen token, no alternatives
    assert chat(pre).request.output_options.logprobs is None
    assert completion(pre, logprobs=2).request.output_options.logprobs == 2


def test_wire_format_is_1_6_1s_with_ours_after(pre):
    """The request in the order and with the fields 1.6.1's frontend sends (nulls included; measured on the
    wire), our own fields after them."""
    d = chat(pre, max_tokens=5).request.to_dict()
    assert list(d)[:10] == ["model", "token_ids", "stop_conditions", "sampling_options", "output_options",
                            "eos_token_ids", "mdc_sum", "annotations", "routing", "router_config_override"]
    assert list(d["stop_conditions"]) == ["max_tokens", "stop", "stop_token_ids", "stop_token_ids_visible",
                                          "stop_token_ids_hidden", "min_tokens", "ignore_eos", "max_thinking_tokens"]
    assert list(d["output_options"])[:5] == ["logprobs", "prompt_logprobs", "skip_special_tokens",
                                             "formatted_prompt", "return_tokens_as_token_ids"]
    assert list(d["sampling_options"])[-3:-1] == ["include_stop_str_in_output", "guided_decoding"]


def test_model_without_chat_template_rejects_chat_but_serves_completions(tmp_path):
    from harness.tiny_model import build_tiny_hf_model

    folder = build_tiny_hf_model(tmp_path, chat_template=None, with_weights=False)
    p = Preprocessor(load_hf_folder(folder))
    with pytest.raises(RequestError, match="no chat template"):
        chat(p)
    assert completion(p).request.token_ids


def test_chat_template_jinja_file_is_used(tmp_path):
    from harness.tiny_model import build_tiny_hf_model

    folder = build_tiny_hf_model(tmp_path, with_chat_template_file=True, with_weights=False)
    out = chat(Preprocessor(load_hf_folder(folder)))
    assert out.formatted_prompt.endswith("<|im_start|>assistant\n")
