"""Resolve the model argument into a card: a local HF folder, a GGUF file or a hub repo id."""

from __future__ import annotations

from pathlib import Path

from dynamo.errors import ModelError
from dynamo.llm.model_card import ModelCard, load_hf_folder


def looks_like_repo_id(arg: str) -> bool:
    if arg.startswith("hf://"):
        return True
    if arg.lower().endswith(".gguf"):  # a model file that is not there, not a repo
        return False
    parts = arg.split("/")
    return len(parts) == 2 and all(parts) and not arg.startswith((".", "/", "~"))


def resolve_card(model: str | None, *, name: str | None, model_config: str | None = None,
                 context_length: int | None = None, kv_cache_block_size: int | None = None,
                 migration_limit: int = 0, need_tokenizer: bool = True) -> ModelCard:
    """``need_tokenizer=False``: a GGUF whose vocabulary we cannot convert is still served (an engine that
    tokenizes by itself, e.g. llama.cpp embeddings of a BERT-style model)."""
    need_tokenizer = need_tokenizer and not model_config
    if model is None:
        card = ModelCard.placeholder(name or "dynamo")
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            gguf = _lone_gguf(path)
            card = _load_gguf(gguf, name=name, need_tokenizer=need_tokenizer) if gguf else load_hf_folder(path, name=name)
        elif path.is_file():
            card = _load_gguf(path, name=name, need_tokenizer=need_tokenizer)
        elif path.exists():
            raise ModelError(f"{model}: not a file or directory")
        elif looks_like_repo_id(model):
            from dynamo.llm.hub import download

            repo = model.removeprefix("hf://")
            local = download(repo)
            gguf = _lone_gguf(local)
            card = (_load_gguf(gguf, name=name or repo, need_tokenizer=need_tokenizer) if gguf
                    else load_hf_folder(local, name=name or repo))
        else:
            hint = "" if model.lower().endswith(".gguf") or model.startswith((".", "/", "~")) else \
                " (and not a Hugging Face repo id like org/name)"
            raise ModelError(f"{model}: no such file or directory{hint}")
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


def _lone_gguf(folder: Path) -> Path | None:
    """The GGUF file of a folder that holds one and is not a Hugging Face checkout (None otherwise)."""
    if (folder / "config.json").is_file() or (folder / "tokenizer.json").is_file():
        return None
    ggufs = sorted(p for p in folder.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs[:4]) + (", ..." if len(ggufs) > 4 else "")
        raise ModelError(f"{folder}: a folder of {len(ggufs)} GGUF files ({names}): pass the one to serve")
    return None


def _load_gguf(path: Path, *, name: str | None, need_tokenizer: bool = True) -> ModelCard:
    from dynamo.llm.gguf_card import GGUF_MAGIC, load_gguf

    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ModelError(f"{path}: cannot read the model file ({e.strerror or e})") from None
    if head != GGUF_MAGIC:
        kind = "an empty file" if not head else "not a GGUF file (no GGUF magic)"
        raise ModelError(f"{path}: {kind}; the model must be a GGUF file, a Hugging Face model folder "
                         "or a Hugging Face repo id")
    return load_gguf(path, name=name, need_tokenizer=need_tokenizer)


def apply_chat_template_file(card: ModelCard, path: Path) -> None:
    """``--chat-template FILE``: the file's Jinja replaces the card's template (and so travels with the
    card to remote frontends).  A file that does not compile is a ModelError now, not on the first request."""
    from dynamo.llm.chat_template import ChatTemplate

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"--chat-template {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not text.strip():
        raise ModelError(f"--chat-template {path}: the file is empty")
    try:
        ChatTemplate(text, {})
    except ModelError as e:
        raise ModelError(f"--chat-template {path}: {e}") from None
    card.chat_template = text
