"""OpenAI request -> PreprocessedRequest: chat template, tokenization, stop and sampling options.

Follows spec 3.2-3.6 with our decisions (docs/decisions): completions prompts are used raw (OpenAI), stop
strings apply to completions too, ``ignore_eos`` ignores EOS only (vLLM), and a request that cannot fit
the context window gets a 400 like vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynamo.errors import ModelError, RequestError
from dynamo.llm.chat_template import ChatTemplate
from dynamo.llm.model_card import ModelCard
from dynamo.llm.protocols.common import (
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)
from dynamo.llm.protocols.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    content_text,
    ignore_eos,
    max_tokens_of,
    stop_list,
)
from dynamo.llm.tokenizer import Tokenizer


@dataclass
class Preprocessed:
    request: PreprocessedRequest
    formatted_prompt: str | None


class Preprocessor:
    def __init__(self, card: ModelCard):
        if not card.has_tokenizer:
            raise ModelError(f"model {card.display_name!r} has no tokenizer; pass a model folder or GGUF file")
        self.card = card
        self.tokenizer = Tokenizer(card.tokenizer_json)  # type: ignore[arg-type]
        self._template: ChatTemplate | None = None
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
        if self._template is None:
            raise RequestError(
                f"model {self.card.display_name!r} has no chat template; use /v1/completions", status=400
            )
        messages = [_template_message(m, parsed.content) for m, parsed in zip(raw["messages"], req.messages)]
        add_generation_prompt = req.add_generation_prompt
        if add_generation_prompt is None:
            # continue a trailing assistant message (prefill); otherwise open an assistant turn
            add_generation_prompt = req.messages[-1].role != "assistant"
        prompt = self._template.render(
            messages,
            tools=raw.get("tools"),
            add_generation_prompt=add_generation_prompt,
            extra=req.chat_template_kwargs,
        )
        token_ids = self.tokenizer.encode(prompt)
        return Preprocessed(self._build(req, token_ids, max_tokens_of(req)), prompt)

    # -- completions: the prompt is used raw, as the OpenAI API defines it
    def completion(self, req: CompletionRequest) -> Preprocessed:
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        elif all(isinstance(t, int) for t in prompt):
            token_ids = list(prompt)  # type: ignore[arg-type]
            text = None
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"Token id {bad} is out of vocabulary (size {vocab})", param="prompt")
        else:
            raise RequestError("Batched prompts (several prompts in one request) are not supported; "
                               "send one request per prompt", param="prompt")
        if not token_ids:
            raise RequestError("The prompt is empty", param="prompt")
        return Preprocessed(self._build(req, token_ids, req.max_tokens), text)

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
                logprobs = req.top_logprobs or 1
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
            backend_instance_id=nv.backend_instance_id if nv else None,
        )


def _template_message(raw: dict[str, Any], content: Any) -> dict[str, Any]:
    """The message as the template sees it: as sent, with text parts joined into a string."""
    if isinstance(raw.get("content"), list):
        raw = dict(raw)
        raw["content"] = content_text(content)
    return raw


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
