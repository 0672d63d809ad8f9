"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` in vLLM's shape.

``/tokenize`` takes a ``prompt`` (special tokens added by default, as the tokenizer's post-processor
defines them) or chat ``messages`` (rendered through the model's chat template, the same text
``/v1/chat/completions`` would feed the engine; no special tokens added by default) and answers
``{"count", "max_model_len", "tokens", "token_strs"}``.  ``/detokenize`` turns ``tokens`` back into
``{"prompt": text}``.  ``/tokenizer_info`` answers what tokenizer_config.json says (the special tokens as
strings, ``model_max_length``, ``tokenizer_class``, ``chat_template``): lm-evaluation-harness looks for it
to use the server's own tokenizer instead of downloading one.  ``model`` (a query parameter for
``/tokenizer_info``) may be left out when one model is served.  vLLM serves ``/tokenizer_info`` only behind
a flag; we always do, since it says nothing the model card does not already publish to every frontend,
and API keys guard it like every other route.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from dynamo.errors import RequestError
from dynamo.frontend.http.body import json_response, read_json
from dynamo.frontend.model_manager import ModelManager
from dynamo.llm.chat_template import ChatTemplate, cut_after_final
from dynamo.llm.model_card import ModelCard
from dynamo.llm.pipeline import ServedModel
from dynamo.llm.protocols.extra import parse_detokenize_request, parse_tokenize_request
from dynamo.llm.protocols.openai import content_text
from dynamo.llm.tokenizer import Tokenizer

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
# the class transformers loads a bare tokenizer.json with (GGUF tokenizers too): what a client told
# "tokenizer_class" can rebuild the same tokenizer from
_FAST_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def pick_model(models: ModelManager, name: str | None) -> Any:
    """The named model, or the only one served when no name is given."""
    if name is not None:
        return models.get(name)
    names = models.names()
    if len(names) != 1:
        raise RequestError("Give 'model': this server serves " + (", ".join(names) or "no model"), param="model")
    return models.get(names[0])


class TokenizeRoutes:
    def __init__(self, models: ModelManager):
        self.models = models
        self._templates: dict[tuple[str, int], ChatTemplate] = {}

    def _tokenizer(self, model: ServedModel) -> Tokenizer:
        tok = model.tokenizer
        if tok is None:
            raise RequestError(f"The model '{model.name}' has no tokenizer on this server", param="model")
        return tok

    def _template(self, model: Any) -> ChatTemplate:
        card = model.card
        if not card.chat_template:
            raise RequestError(f"The model '{model.name}' has no chat template; tokenize a 'prompt' instead",
                               param="messages")
        key = (model.name, id(card))
        tpl = self._templates.get(key)
        if tpl is None:
            if len(self._templates) > 64:
                self._templates.clear()
            tpl = ChatTemplate(card.chat_template, {n: card.special_token(n) for n in _SPECIAL})
            self._templates[key] = tpl
        return tpl

    async def tokenize(self, request: web.Request) -> web.Response:
        raw = await read_json(request)
        req = parse_tokenize_request(raw)
        model = pick_model(self.models, req.model)
        tok = self._tokenizer(model)
        if req.messages is not None:
            messages = []
            for sent, parsed in zip(raw["messages"], req.messages, strict=True):
                if isinstance(sent.get("content"), list):
                    sent = dict(sent, content=content_text(parsed.content))
                messages.append(sent)
            text = self._template(model).render(
                messages, tools=req.tools,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                extra=req.chat_template_kwargs,
            )
            if req.continue_final_message:
                text = cut_after_final(text, messages[-1].get("content"))
            add_special = bool(req.add_special_tokens)
        else:
            text = req.prompt or ""
            add_special = req.add_special_tokens is not False
        enc = tok.hf.encode(text, add_special_tokens=add_special)
        ids = list(enc.ids)
        body: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": model.card.context_length or None,
            "tokens": ids,
            "token_strs": list(enc.tokens) if req.return_token_strs else None,
        }
        return json_response(body)

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        model = pick_model(self.models, request.query.get("model"))
        self._tokenizer(model)  # a model without a tokenizer here has no tokenizer to describe
        return json_response(tokenizer_info(model.card))

    async def detokenize(self, request: web.Request) -> web.Response:
        raw = await read_json(request)
        req = parse_detokenize_request(raw)
        model = pick_model(self.models, req.model)
        tok = self._tokenizer(model)
        vocab = tok.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"Token id {bad} is out of vocabulary (size {vocab})", param="tokens")
        return json_response({"prompt": tok.decode(req.tokens)})


def tokenizer_info(card: ModelCard) -> dict[str, Any]:
    """tokenizer_config.json as a Hugging Face tokenizer's ``init_kwargs`` hold it, in vLLM's shape: the
    special tokens as plain strings (None when the model has none), the served context length as
    ``model_max_length``, the template (the default one when the model names several)."""
    info: dict[str, Any] = {k: v for k, v in card.tokenizer_config.items() if k != "chat_template"}
    for name in _SPECIAL:
        info[name] = card.special_token(name)
    if card.context_length:
        info["model_max_length"] = card.context_length
    info.setdefault("model_max_length", None)
    info["tokenizer_class"] = info.get("tokenizer_class") or _FAST_TOKENIZER_CLASS
    template = card.chat_template
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    info["chat_template"] = template
    return info
