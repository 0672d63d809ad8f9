"""What a model is, as far as serving it goes: name, tokenizer, chat template, limits, stop ids.

A card is built from a local Hugging Face folder (config.json, tokenizer files) or a GGUF file (its metadata, in
``gguf_card.py``).  It is the only thing the pre- and post-processors need, and the thing a worker
publishes so a frontend on another machine can do the same work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo.errors import ModelError

DEFAULT_KV_CACHE_BLOCK_SIZE = 16


@dataclass
class ModelCard:
    display_name: str
    path: Path | None = None
    config: dict[str, Any] = field(default_factory=dict)
    tokenizer_json: str | None = None  # the tokenizer.json text (kept as text: it travels in cards)
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    chat_template: str | list[dict[str, str]] | None = None
    generation_config: dict[str, Any] | None = None
    context_length: int = 0
    kv_cache_block_size: int = DEFAULT_KV_CACHE_BLOCK_SIZE
    migration_limit: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    user_data: dict[str, Any] | None = None
    gguf_path: Path | None = None
    # response parsers (parsers/registry.py): "auto" until launch resolves it from the flags and the
    # chat template; then a parser name, or None for none.  A worker publishes its choice here.
    tool_call_parser: str | None = "auto"
    reasoning_parser: str | None = "auto"
    # the kinds of ``sampling_options.guided_decoding`` the engine honours (json, regex, grammar, choice:
    # vllm and sglang all, pytok files what they declare); others are 400s (constraints.py)
    guided_decoding: list[str] = field(default_factory=list)
    logit_bias: bool = False  # the engine applies ``sampling_options.logit_bias`` (llamacpp, vllm)
    # the engine reports logprobs of generated tokens / of the prompt (llm/logprobs.py; llamacpp, vllm);
    # a card without them (another engine, an older worker) makes requests asking for them 400s
    logprobs: bool = False
    prompt_logprobs: bool = False
    # a LoRA adapter of a base model, served under its own name (llm/lora.py): Dynamo's ``lora`` field
    # (``name``, ``max_gpu_lora_count``) plus ours, ``base_model`` (the parent's served name) and ``path``
    lora: dict[str, Any] | None = None
    # images: the placeholder positions one image takes in a prompt (the worker's image encoder decides;
    # a projector that tiles by size may use more, and the engine rewrites the run); 0: text only
    image_tokens: int = 0
    # images for an engine given the request as sent (a pystr file that sets ``generate.images = True``):
    # the frontend loads them and hands them on as checked ``data:`` URLs (llm/media/inline.py)
    image_urls: bool = False

    @property
    def takes_images(self) -> bool:
        """Whether requests with images reach the engine (else they are 400s)."""
        return bool(self.image_tokens or self.image_urls)

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter this card serves (None: a base model)."""
        return str(self.lora["name"]) if self.lora and self.lora.get("name") else None

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer_json is not None

    def special_token(self, name: str) -> str | None:
        """``bos_token``/``eos_token``/... from tokenizer_config, plain or as an added-token object."""
        value = self.tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None

    @classmethod
    def placeholder(cls, name: str) -> "ModelCard":
        """A name-only card, for full engines such as echo_full that need no model files."""
        return cls(display_name=name)

    # -- serialisation for discovery (the files are inlined so a remote frontend needs no shared disk)
    def to_json(self) -> dict[str, Any]:
        return {
            "display_name": self.display_name,
            "config": self.config,
            "tokenizer_json": self.tokenizer_json,
            "tokenizer_config": self.tokenizer_config,
            "chat_template": self.chat_template,
            "generation_config": self.generation_config,
            "context_length": self.context_length,
            "kv_cache_block_size": self.kv_cache_block_size,
            "migration_limit": self.migration_limit,
            "eos_token_ids": self.eos_token_ids,
            "bos_token_id": self.bos_token_id,
            "user_data": self.user_data,
            "tool_call_parser": self.tool_call_parser,
            "reasoning_parser": self.reasoning_parser,
            "guided_decoding": self.guided_decoding,
            "logit_bias": self.logit_bias,
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
            "lora": self.lora,
            "image_tokens": self.image_tokens,
            "image_urls": self.image_urls,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelCard":
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data and k not in ("path", "gguf_path")}
        return cls(**known)


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelError(f"{path.parent}: missing {path.name} (not a Hugging Face model folder?)")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return data


def _int_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def load_hf_folder(path: Path, *, name: str | None = None) -> ModelCard:
    """Card from a local Hugging Face checkout: config.json and tokenizer.json are required."""
    path = path.resolve()
    if not path.is_dir():
        raise ModelError(f"{path}: not a directory")
    if not any(path.iterdir()):
        raise ModelError(f"{path}: empty folder; expected a Hugging Face model folder (config.json, "
                         "tokenizer.json, weights) or a GGUF file")
    tokenizer_file = path / "tokenizer.json"
    config = _read_json(path / "config.json", required=False)
    if not tokenizer_file.is_file():
        raise ModelError(
            f"{path}: no tokenizer.json found. A model folder needs config.json, tokenizer.json and "
            "tokenizer_config.json (a Hugging Face checkout)"
        )
    if config is None:
        raise ModelError(f"{path}: missing config.json (not a Hugging Face model folder?)")
    tokenizer_config = _read_json(path / "tokenizer_config.json", required=False) or {}
    generation_config = _read_json(path / "generation_config.json", required=False)

    chat_template: Any = tokenizer_config.get("chat_template")
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        chat_template = template_file.read_text(encoding="utf-8")
    elif chat_template is None and (path / "chat_template.json").is_file():
        chat_template = (_read_json(path / "chat_template.json", required=False) or {}).get("chat_template")

    text_config: dict[str, Any] = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    eos = _int_list(config.get("eos_token_id"))
    if not eos:
        eos = _int_list(text_config.get("eos_token_id"))
    if generation_config:
        # generation_config's list is the fuller one (Llama 3: [128001, 128009]); keep the union
        for e in _int_list(generation_config.get("eos_token_id")):
            if e not in eos:
                eos.append(e)
    bos = text_config.get("bos_token_id")
    if bos is None and generation_config:
        bos = generation_config.get("bos_token_id")

    context_length = (
        text_config.get("max_position_embeddings")
        or config.get("max_position_embeddings")
        or _sane_model_max_length(tokenizer_config.get("model_max_length"))
        or 0
    )
    return ModelCard(
        display_name=name or path.name,
        path=path,
        config=config,
        tokenizer_json=tokenizer_file.read_text(encoding="utf-8"),
        tokenizer_config=tokenizer_config,
        chat_template=chat_template,
        generation_config=generation_config,
        context_length=int(context_length),
        eos_token_ids=eos,
        bos_token_id=bos if isinstance(bos, int) else None,
    )


def _sane_model_max_length(value: Any) -> int | None:
    # transformers writes 1e30 when the length is unknown
    if isinstance(value, (int, float)) and 0 < value < 10_000_000:
        return int(value)
    return None
