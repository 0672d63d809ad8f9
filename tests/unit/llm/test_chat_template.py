"""Chat templates render as Hugging Face transformers renders them."""

from __future__ import annotations

import json

import pytest

from dynamo.errors import ModelError, RequestError
from dynamo.llm.chat_template import ChatTemplate, TemplateError
from harness.tiny_model import DEFAULT_CHAT_TEMPLATE, DEFAULT_SYSTEM_PROMPT, render_chat_template

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": None}


def render(source, messages, **kw):
    return ChatTemplate(source, SPECIAL).render(messages, **kw)


def test_chatml_template_matches_reference_rendering():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    ours = render(DEFAULT_CHAT_TEMPLATE, messages, add_generation_prompt=True)
    assert ours == render_chat_template(DEFAULT_CHAT_TEMPLATE, messages, add_generation_prompt=True)
    assert ours == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_add_generation_prompt_controls_the_open_assistant_turn():
    msgs = [{"role": "user", "content": "Hi"}]
    with_prompt = render(DEFAULT_CHAT_TEMPLATE, msgs, add_generation_prompt=True)
    without = render(DEFAULT_CHAT_TEMPLATE, msgs, add_generation_prompt=False)
    assert with_prompt == without + "<|im_start|>assistant\n"
    assert f"system\n{DEFAULT_SYSTEM_PROMPT}" in without


def test_trim_blocks_and_lstrip_blocks_like_transformers():
    # without trim/lstrip this renders with blank lines and indentation around every tag
    src = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "U: {{ m.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
    )
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render(src, msgs) == "U: a\nU: b\n"
    assert render(src, msgs) == render_chat_template(src, msgs)


def test_raise_exception_becomes_a_clear_request_error():
    with pytest.raises(RequestError) as e:
        render(DEFAULT_CHAT_TEMPLATE, [{"role": "wizard", "content": "x"}])
    assert isinstance(e.value, TemplateError)
    assert "Unsupported message role: wizard" in str(e.value)
    assert e.value.status == 400


def test_undefined_attribute_errors_are_request_errors_not_crashes():
    with pytest.raises(RequestError, match="Chat template"):
        render("{{ messages[0].content.nope() }}", [{"role": "user", "content": "x"}])


def test_tojson_keeps_non_ascii_and_does_not_html_escape():
    src = "{{ messages[0] | tojson }}"
    out = render(src, [{"role": "user", "content": "café <b> & 'x' 日本 🙂"}])
    assert json.loads(out) == {"role": "user", "content": "café <b> & 'x' 日本 🙂"}
    assert "café <b> & 'x' 日本 🙂" in out


def test_tojson_indent_argument():
    out = render("{{ messages | tojson(indent=2) }}", [{"role": "user", "content": "x"}])
    assert out == json.dumps([{"role": "user", "content": "x"}], indent=2)


def test_tools_are_passed_to_the_template():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = render(DEFAULT_CHAT_TEMPLATE, [{"role": "user", "content": "Weather?"}], tools=tools)
    assert "# Tools" in out
    assert '"name": "get_weather"' in out
    # transformers' tojson keeps key order (jinja2's built-in one would sort keys and HTML-escape)
    assert json.dumps(tools, ensure_ascii=False) in out


def test_no_tools_means_no_tools_section():
    out = render(DEFAULT_CHAT_TEMPLATE, [{"role": "user", "content": "Hi"}])
    assert "# Tools" not in out


def test_special_tokens_and_strftime_now_are_available():
    out = render("{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') }}", [])
    bos, eos, year = out.split("|")
    assert (bos, eos) == ("<s>", "</s>")
    assert year.isdigit() and len(year) == 4


def test_python_string_methods_work_as_in_transformers():
    out = render("{{ messages[0].content.strip().upper() }}|{{ 'a,b'.split(',') | length }}",
                 [{"role": "user", "content": "  hi  "}])
    assert out == "HI|2"


def test_loop_controls_and_generation_block():
    src = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %};{% endfor %}"
    )
    out = render(src, [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert out == "U;"


def test_named_templates_pick_tool_use_when_tools_are_given():
    source = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools:{{ tools | length }}"}]
    assert render(source, [{"role": "user", "content": "x"}]) == "plain"
    assert render(source, [{"role": "user", "content": "x"}], tools=[{"type": "function"}]) == "tools:1"


def test_template_that_does_not_compile_is_a_model_error():
    with pytest.raises(ModelError, match="does not compile"):
        ChatTemplate("{% for x in %}", SPECIAL)


def test_chat_template_kwargs_reach_the_template():
    out = render("{{ enable_thinking }}", [], extra={"enable_thinking": False})
    assert out == "False"
