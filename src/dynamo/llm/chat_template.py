"""Chat-template rendering compatible with Hugging Face ``apply_chat_template``.

Same Jinja environment as transformers (sandboxed, trim_blocks, lstrip_blocks, loop controls, the
``generation`` block tag), the same helpers (``raise_exception``, ``strftime_now``, a ``tojson`` that does
not escape non-ASCII), and the same variables (``messages``, ``tools``, ``add_generation_prompt``,
``bos_token``/``eos_token``/...), so templates written for transformers render the same text here.

jinja2 is imported when the first template is compiled (:func:`_make_env`): a server whose engine applies
its own template (echo_full, pystr:, remote chat workers) never needs it, and it is a tenth of start-up.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cache
from typing import TYPE_CHECKING, Any

from dynamo.errors import ModelError, RequestError

if TYPE_CHECKING:
    from jinja2.sandbox import ImmutableSandboxedEnvironment


@cache
def _generation_block() -> type:
    """The ``{% generation %}...{% endgeneration %}`` extension: transformers marks assistant spans with
    it; we only need the text, so the block renders its body unchanged."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class _GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return _GenerationBlock


class TemplateError(RequestError):
    """The template refused the conversation (``raise_exception``) or failed to render it."""


def _raise_exception(message: str) -> None:
    raise TemplateError(f"Chat template error: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_env() -> ImmutableSandboxedEnvironment:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_block(), loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template; ``default`` and ``tool_use`` variants as transformers picks them."""

    def __init__(self, source: str | list[dict[str, str]] | dict[str, str], special_tokens: dict[str, str | None]):
        import jinja2

        self._env = _make_env()
        if isinstance(source, str):
            named = {"default": source}
        elif isinstance(source, dict):
            named = dict(source)
        else:
            named = {item["name"]: item["template"] for item in source if "name" in item and "template" in item}
        if "default" not in named:
            raise ModelError("chat_template has no 'default' template")
        try:
            self._templates = {k: self._env.from_string(v) for k, v in named.items()}
        except jinja2.TemplateSyntaxError as e:
            raise ModelError(f"chat template does not compile: {e}") from None
        self._special = {k: v for k, v in special_tokens.items() if v is not None}

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        import jinja2

        template = self._templates["default"]
        if tools and "tool_use" in self._templates:
            template = self._templates["tool_use"]
        context: dict[str, Any] = dict(self._special)
        if extra:
            context.update(extra)
        context.update(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
        try:
            return template.render(**context)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"Chat template failed to render: {e}") from None
        except (TypeError, KeyError, AttributeError, ValueError, IndexError) as e:
            raise TemplateError(f"Chat template failed to render this conversation: {e}") from None


def cut_after_final(text: str, final: Any) -> str:
    """``continue_final_message``: the rendered text ends where the last message's content ends (what
    transformers does), so the template's end-of-turn after it is dropped and the model continues it."""
    body = final.strip() if isinstance(final, str) else ""
    at = text.rfind(body) if body else -1
    if at < 0:
        raise RequestError("continue_final_message: the last message's content is not in the rendered prompt",
                           param="continue_final_message")
    return text[: at + len(body)]
