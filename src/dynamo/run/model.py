"""Resolve the model argument (spec 1.6) into a card: a local HF folder, a GGUF file or a hub repo id."""

from __future__ import annotations

from pathlib import Path

from dynamo.errors import ModelError
from dynamo.llm.model_card import ModelCard, load_hf_folder


def looks_like_repo_id(arg: str) -> bool:
    if arg.startswith("hf://"):
        return True
    parts = arg.split("/")
    return len(parts) == 2 and all(parts) and not arg.startswith((".", "/", "~"))


def resolve_card(model: str | None, *, name: str | None, model_config: str | None = None,
                 context_length: int | None = None, kv_cache_block_size: int | None = None,
                 migration_limit: int = 0) -> ModelCard:
    if model is None:
        card = ModelCard.placeholder(name or "dynamo")
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            card = load_hf_folder(path, name=name)
        elif path.is_file():
            card = _load_gguf(path, name=name)
        elif path.exists():
            raise ModelError(f"{model}: not a file or directory")
        elif looks_like_repo_id(model):
            from dynamo.llm.hub import download

            local = download(model.removeprefix("hf://"))
            card = load_hf_folder(local, name=name or model.removeprefix("hf://"))
        else:
            raise ModelError(f"{model}: no such file or directory (and not a Hugging Face repo id like org/name)")
        if model_config:
            # tokenizer, template and config from the folder; the weights stay where they are
            override = load_hf_folder(Path(model_config).expanduser(), name=card.display_name)
            override.gguf_path = card.gguf_path
            if card.context_length and override.context_length:
                override.context_length = min(card.context_length, override.context_length)
            override.context_length = override.context_length or card.context_length
            card = override
    if context_length is not None:
        if card.context_length and context_length > card.context_length:
            raise ModelError(
                f"--context-length {context_length} is larger than the model's context length {card.context_length}"
            )
        card.context_length = context_length
    if kv_cache_block_size is not None:
        card.kv_cache_block_size = kv_cache_block_size
    card.migration_limit = migration_limit
    return card


def _load_gguf(path: Path, *, name: str | None) -> ModelCard:
    try:
        from dynamo.llm.gguf_card import load_gguf
    except ImportError:  # pragma: no cover - gguf support lands with the llama.cpp engine
        raise ModelError(f"{path}: GGUF files are not supported by this version") from None
    return load_gguf(path, name=name)
