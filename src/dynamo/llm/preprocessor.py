"""OpenAI request -> PreprocessedRequest: chat template, tokenization, stop and sampling options.

As the original pre-processor does, with our decisions (docs/decisions.md): completions prompts are used raw (OpenAI), stop
strings apply to completions too, ``ignore_eos`` ignores EOS only (vLLM), and a request that cannot fit
the context window gets a 400 like vLLM's.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from dynamo.errors import ModelError, RequestError
from dynamo.llm.chat_template import ChatTemplate, cut_after_final
from dynamo.llm.constraints import check_guided, check_unhonoured, logit_bias_of, response_format_guided
from dynamo.llm.image_prompt import image_inputs, new_marker, prompt_ids
from dynamo.llm.media import MediaError, current_policy, image_parts, load_images
from dynamo.llm.model_card import ModelCard
from dynamo.llm.parsers.registry import TOOL_CALL_PARSERS, resolve
from dynamo.llm.parsers.tool_calls.forced import named_schema, required_schema
from dynamo.llm.parsers.tool_calls.generic import GENERIC, generic_tool_messages
from dynamo.llm.protocols.common import (
    ImageInput,
    OutputOptions,
    PreprocessedRequest,
    ResponseParsing,
    Routing,
    SamplingOptions,
    StopConditions,
)
from dynamo.llm.protocols.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ContentPart,
    content_text,
    ignore_eos,
    max_tokens_of,
    stop_list,
)
from dynamo.llm.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class Preprocessed:
    request: PreprocessedRequest
    formatted_prompt: str | None
    prompt_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs), no generated token


@dataclass
class RenderedChat:
    """A chat request with its template applied, not yet tokenized."""

    req: ChatCompletionRequest
    raw: dict[str, Any]
    prompt: str
    tool_parser: Any
    forced: Any
    images: list[str] = field(default_factory=list)  # the image URLs, in prompt order
    marker: str = ""  # where each image is in ``prompt`` (llm/image_prompt.py)


class Preprocessor:
    def __init__(self, card: ModelCard):
        if not card.has_tokenizer:
            raise ModelError(f"model {card.display_name!r} has no tokenizer; pass a model folder or GGUF file")
        self.card = card
        self.tokenizer = Tokenizer(card.tokenizer_json)  # type: ignore[arg-type]
        self._template: ChatTemplate | None = None
        # a card says a parser name, None (none), or "auto" (a card nobody resolved, e.g. an older worker's)
        tool, reasoning = card.tool_call_parser, card.reasoning_parser
        self._tool_parser = resolve("tool", tool, card.chat_template) if tool is not None else None
        self._reasoning_parser = resolve("reasoning", reasoning, card.chat_template) if reasoning is not None else None
        self._generic_said = False  # the generic tool-call format's fallback is logged once per model
        if card.chat_template:
            self._template = ChatTemplate(
                card.chat_template,
                {
                    name: card.special_token(name)
                    for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                },
            )

    # -- chat
    def chat(self, req: ChatCompletionRequest, raw: dict[str, Any]) -> Preprocessed:
        rendered = self.render_chat(req, raw)
        if rendered.images:
            raise RequestError("images are loaded asynchronously: use chat_async", param="messages")
        return self.finish_chat(rendered, self.tokenizer.encode_prompt(rendered.prompt))

    async def chat_async(self, req: ChatCompletionRequest, raw: dict[str, Any]) -> Preprocessed:
        """:meth:`chat`, with a long prompt tokenized off the event loop, and images loaded."""
        rendered = self.render_chat(req, raw)
        if rendered.images:
            ids, images = await self.image_prompt(rendered)
            pre = self.finish_chat(rendered, ids)
            pre.request.multi_modal_data = images
            return pre
        return self.finish_chat(rendered, await self.tokenizer.encode_prompt_async(rendered.prompt))

    def render_chat(self, req: ChatCompletionRequest, raw: dict[str, Any]) -> RenderedChat:
        """The chat template applied (template errors are raised here, before any tokenizing)."""
        if self._template is None:
            raise RequestError(
                f"model {self.card.display_name!r} has no chat template; use /v1/completions", status=400
            )
        urls = image_parts(raw["messages"])
        marker = ""
        if urls:
            if not self.card.image_tokens:
                raise MediaError(f"model {self.card.display_name!r} does not accept images (it was started without "
                                 "an image encoder)")
            marker = new_marker()
        messages = [_template_message(m, _marked(parsed.content, marker))
                    for m, parsed in zip(raw["messages"], req.messages, strict=True)]
        add_generation_prompt = req.add_generation_prompt
        if req.continue_final_message:
            add_generation_prompt = False
        elif add_generation_prompt is None:
            # continue a trailing assistant message (prefill); otherwise open an assistant turn
            add_generation_prompt = req.messages[-1].role != "assistant"
        tools, tool_parser, forced = self._tools(req, raw)
        if tool_parser == GENERIC and tools is not None:  # the template knows no tools: the prompt tells them
            messages, tools = generic_tool_messages(messages, tools), None
        prompt = self._template.render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            extra=req.chat_template_kwargs,
        )
        if req.continue_final_message:  # the template's end of turn after the last message goes
            prompt = cut_after_final(prompt, content_text(req.messages[-1].content))
        return RenderedChat(req, raw, prompt, tool_parser, forced, urls, marker)

    async def image_prompt(self, rendered: RenderedChat) -> tuple[list[int], list[ImageInput]]:
        """A prompt with images: the images loaded and checked (MediaError: refused, broken, too many), the
        text tokenized around each image's placeholder run."""
        images = await load_images(rendered.images, current_policy())
        ids, runs = prompt_ids(rendered.prompt, rendered.marker, [i.mm_hash for i in images],
                               self.card.image_tokens, self.tokenizer.encode_prompt)
        return ids, image_inputs(images, runs)

    def finish_chat(self, rendered: RenderedChat, token_ids: list[int]) -> Preprocessed:
        req, raw, prompt, forced = rendered.req, rendered.raw, rendered.prompt, rendered.forced
        request = self._build(req, token_ids, max_tokens_of(req))
        self._constrain(request, raw, forced[1] if forced else None)
        request.parsing = self._parsing(req, prompt, rendered.tool_parser, forced[0] if forced else None)
        return Preprocessed(request, prompt)

    def _constrain(self, request: PreprocessedRequest, raw: dict[str, Any] | None,
                   tool_schema: dict[str, Any] | None = None) -> None:
        """Add ``response_format`` / a forced tool call to the guided-decoding options; refuse what the
        engine cannot honour (constraints.py)."""
        so = request.sampling_options
        guided, source = so.guided_decoding, None
        if raw is not None:
            check_unhonoured(raw)
            so.logit_bias = logit_bias_of(raw, self.card.logit_bias, self.tokenizer.vocab_size)
            fmt = response_format_guided(raw.get("response_format"))
            if fmt is not None:
                if guided:
                    raise RequestError("response_format cannot be combined with guided_* fields", param="response_format")
                guided, source = fmt, "response_format"
        if tool_schema is not None:
            if guided:
                raise RequestError("tool_choice required or a named function cannot be combined with "
                                   f"{source or 'guided_*'} constraints", param="tool_choice")
            guided, source = {"json": tool_schema}, "tool_choice"
        check_guided(guided, source, self.card.guided_decoding, self.card.display_name)
        so.guided_decoding = guided

    def _tools(
        self, req: ChatCompletionRequest, raw: dict[str, Any]
    ) -> tuple[Any, str | None, tuple[str, dict[str, Any]] | None]:
        """(the tools for the template, the tool-call parser to run, and for ``required`` or a named
        function: the forced mode and its guided-decoding JSON schema) as ``tool_choice`` asks."""
        tools = raw.get("tools") or None
        choice = tool_choice_kind(req.tool_choice, bool(tools))
        if tools is None or choice == "none":
            return None, None, None  # "none": the model is not told about tools, so it cannot call one
        if choice == "auto":
            if self._tool_parser is None:
                if not self._generic_said:
                    self._generic_said = True
                    log.info("model %r: its chat template shows no tool-call format we know; requests with tools "
                             "use the generic JSON format (--tool-call-parser NAME picks one of: %s)",
                             self.card.display_name, ", ".join(TOOL_CALL_PARSERS))
                return tools, GENERIC, None
            return tools, self._tool_parser, None
        what = "required" if choice == "required" else "naming a function"
        if "json" not in self.card.guided_decoding:
            raise RequestError(
                f"tool_choice {what} needs guided decoding, which this model's engine does not do "
                "(vllm and sglang do); use tool_choice 'auto'",
                param="tool_choice",
            )
        if choice == "required":
            return tools, None, ("required", required_schema(tools, req.parallel_tool_calls is False))
        name = req.tool_choice["function"]["name"]
        tool = next((t for t in tools if isinstance(t, dict) and (t.get("function") or {}).get("name") == name), None)
        if tool is None:
            raise RequestError(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
        return tools, None, (f"function:{name}", named_schema(tool))

    def _parsing(
        self, req: ChatCompletionRequest, prompt: str, tool_parser: str | None, forced: str | None
    ) -> ResponseParsing | None:
        if forced is not None:  # guided decoding: the output is the JSON of the call(s), nothing else
            return ResponseParsing(forced_tool=forced, parallel_tool_calls=req.parallel_tool_calls)
        reasoning = self._reasoning_parser
        if tool_parser is None and reasoning is None:
            return None
        started = None
        if reasoning is not None:
            if (req.chat_template_kwargs or {}).get("enable_thinking") is False:
                started = False
            elif prompt.rstrip().endswith("<think>"):
                started = True  # the template opened the think block: the output starts inside it
        return ResponseParsing(
            tool_call_parser=tool_parser,
            reasoning_parser=reasoning,
            reasoning_started=started,
            parallel_tool_calls=req.parallel_tool_calls if tool_parser else None,
        )

    # -- completions: the prompt is used raw, as the OpenAI API defines it
    @staticmethod
    def completion_text(req: CompletionRequest) -> str | None:
        """The prompt of a completions request when it is one text (to be tokenized)."""
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else None

    @staticmethod
    def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
        """The request's prompts: one text or token-id list, or several (a batch, one choice each)."""
        prompt = req.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        return list(prompt)

    def completion(self, req: CompletionRequest, raw: dict[str, Any] | None = None,
                   token_ids: list[int] | None = None, prompt: str | list[int] | None = None) -> Preprocessed:
        """``token_ids``: the prompt text already tokenized (off the loop, by the caller); ``prompt``: one
        of a batch's prompts (else the request's only one)."""
        if prompt is None:
            prompts = self.completion_prompts(req)
            if len(prompts) != 1:
                raise RequestError("One prompt expected here", param="prompt")
            prompt = prompts[0]
        if isinstance(prompt, str):
            token_ids = token_ids if token_ids is not None else self.tokenizer.encode_prompt(prompt)
            text: str | None = prompt
        else:
            token_ids = list(prompt)
            text = None
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"Token id {bad} is out of vocabulary (size {vocab})", param="prompt")
        if not token_ids:
            raise RequestError("The prompt is empty", param="prompt")
        request = self._build(req, token_ids, req.max_tokens)
        self._constrain(request, raw if raw is not None else {k: getattr(req, k) for k in ("best_of", "suffix")})
        return Preprocessed(request, text)

    def _build(
        self, req: ChatCompletionRequest | CompletionRequest, token_ids: list[int], max_tokens: int | None
    ) -> PreprocessedRequest:
        ctx_len = self.card.context_length
        n_prompt = len(token_ids)
        if ctx_len > 0:
            if n_prompt >= ctx_len:
                raise RequestError(
                    f"This model's maximum context length is {ctx_len} tokens. However, your request has "
                    f"{n_prompt} input tokens. Please reduce the length of the input.",
                    param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                )
            if max_tokens is not None and n_prompt + max_tokens > ctx_len:
                raise RequestError(
                    f"This model's maximum context length is {ctx_len} tokens. However, you requested "
                    f"{n_prompt + max_tokens} tokens ({n_prompt} in the input, {max_tokens} in the "
                    "completion). Please reduce the length of the input or of max_tokens.",
                    param="max_tokens",
                )
            if max_tokens is None:
                max_tokens = ctx_len - n_prompt

        no_eos = ignore_eos(req)
        eos = list(self.card.eos_token_ids)
        hidden = list(req.stop_token_ids or [])
        if not no_eos:
            hidden += [e for e in eos if e not in hidden]
        min_tokens = req.min_tokens
        nv = req.nvext
        top_k = req.top_k if req.top_k is not None else (nv.top_k if nv else None)
        rep = req.repetition_penalty if req.repetition_penalty is not None else (nv.repetition_penalty if nv else None)
        temperature, top_p = req.temperature, req.top_p
        if nv and nv.greed_sampling:
            temperature, top_p = 0.0, None
        guided = _guided(req)
        logprobs = None
        if isinstance(req, ChatCompletionRequest):
            if req.logprobs:
                logprobs = req.top_logprobs or 0  # alternatives besides the chosen token
        elif req.logprobs is not None:
            logprobs = req.logprobs
        return PreprocessedRequest(
            token_ids=token_ids,
            model=req.model,
            stop_conditions=StopConditions(
                max_tokens=max_tokens,
                stop=stop_list(req.stop),
                stop_token_ids_hidden=hidden or None,
                min_tokens=min_tokens,
                ignore_eos=no_eos or None,
            ),
            sampling_options=SamplingOptions(
                n=req.n,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=rep,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=req.min_p,
                seed=req.seed,
                guided_decoding=guided,
            ),
            output_options=OutputOptions(logprobs=logprobs),
            eos_token_ids=[] if no_eos else eos,
            annotations=list(nv.annotations or []) if nv else [],
            routing=Routing(backend_instance_id=nv.backend_instance_id)
            if nv and nv.backend_instance_id is not None else None,
        )


def _marked(content: Any, marker: str) -> Any:
    """Parsed content with each image part as a text part of the request's image marker."""
    if not marker or not isinstance(content, list):
        return content
    return [ContentPart(type="text", text=marker) if p.type == "image_url" else p for p in content]


def _template_message(raw: dict[str, Any], content: Any) -> dict[str, Any]:
    """The message as the template sees it: as sent, with text parts joined into a string.

    An assistant turn that only called tools comes back from clients with ``content: null`` and the
    arguments as a JSON string; templates expect a string content (Qwen3's tests ``'</think>' in
    content``) and the arguments as an object (Llama 3's writes ``arguments | tojson``), as vLLM and
    transformers give them."""
    if isinstance(raw.get("content"), list):
        raw = dict(raw)
        raw["content"] = content_text(content)
    if raw.get("role") == "assistant":
        if raw.get("content") is None:
            raw = dict(raw)
            raw["content"] = ""
        calls = raw.get("tool_calls")
        if calls:
            raw = dict(raw)
            raw["tool_calls"] = [_call_with_object_args(c) for c in calls]
    return raw


def _call_with_object_args(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    if not isinstance(args, dict):
        return call
    return {**call, "function": {**fn, "arguments": args}}


def tool_choice_kind(choice: Any, have_tools: bool) -> str:
    """``tool_choice`` as one of none/auto/required/named; a malformed one is a 400."""
    if choice is None:
        return "auto" if have_tools else "none"
    if choice in ("none", "auto", "required"):
        kind = choice
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)):
        kind = "named"
    else:
        raise RequestError(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}', param="tool_choice"
        )
    if kind in ("required", "named") and not have_tools:
        raise RequestError(f"tool_choice '{kind if kind == 'required' else 'function'}' needs tools", param="tool_choice")
    return kind


def _guided(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    for key, short in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar"),
                       ("guided_choice", "choice"), ("guided_decoding_backend", "backend")):
        value = getattr(req, key)
        if value is None and req.nvext is not None:
            value = getattr(req.nvext, key)
        if value is not None:
            out[short] = value
    return out or None
