"""The ``v1/mdc`` record, Dynamo 1.x's Model, both ways: the one record by which any worker (ours or
1.6.1's) announces a model, and the :class:`~dynamo.llm.model_entry.ModelEntry` a frontend reads from it.

Writing (:func:`record_of`): ``card_json`` is the card in 1.x's shape, so a 1.6.1 frontend loads it; and
one extra field, :data:`EXTRAS`, carries what 1.x's card has no field for: our card (template, parsers,
LoRA base, capabilities; the tokenizer by its object-store digest, so a frontend of ours on another
machine needs no shared disk), our model type and our runtime config. 1.6.1 ignores the unknown field
(tests/dynamo1x/test_d16_discovery.py serves our models with it present). Where our model is one a 1.6.1
frontend must not serve (a LoRA adapter: 1.x's requests name no adapter our worker reads; a prefill
worker: 1.x hands KV state over its own transfer; a card with no tokenizer: 1.x has nothing to load; an
endpoint served over NATS), the card's ``model_type`` is one flag 1.6.1 does not know, naming why
(``LoraAdapter``, ...): 1.6.1 rejects that record in one log line naming the flag and serves the rest
(observed; tests/dynamo1x/test_d16_discovery.py).

Why files: a 1.x card does not carry the tokenizer or the template, it names files (path, blake3
checksum, size) that the frontend reads from its own disk (or, when the path is not there, fetches from
the Hugging Face hub by ``source_path``). So our worker names the files of its HF folder, and for what
has no such file (a GGUF model, whose tokenizer we build from its metadata; a ``--chat-template`` that
replaced the folder's) writes them into a cache directory (``$XDG_CACHE_HOME/dynamo/v1_cards/<digest>``,
content-addressed: every worker of a model shares one copy) and names those. The paths are local: a 1.x
frontend on another machine finds them only on a shared disk, or by the hub when ``source_path`` is a
repo id.

Reading (:func:`entry_from_record`): a record with :data:`EXTRAS` is one of our workers' (its card is
ours); one without is a 1.x worker's, whose card is loaded from the files it names.

The fields and their order are those 1.6.1 writes; ``runtime_config`` takes 1.6.1's defaults and what we
know (the worker's concurrency limit, its parsers, whether it publishes KV events).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import orjson

from dynamo.errors import ModelError
from dynamo.llm.model_card import ModelCard, load_hf_folder
from dynamo.llm.model_entry import PUBLISHES_KV_EVENTS, V1_CARD, ModelEntry, load_card
from dynamo.llm.model_type import ModelType
from dynamo.runtime.names import slugify
from dynamo.runtime.object_store import ObjectStore
from dynamo.runtime.v1_records import model_record, signed_id

log = logging.getLogger(__name__)

# card_json's extra field: {"model_type": ours, "card": our card (publish_card's), "runtime_config": ours}
EXTRAS = "dynamo_py"
# card_json's model_type for a card with no tokenizer (1.6.1 rejects the unknown flag, naming it; an empty
# model_type would be worse: 1.6.1 lists such a "topology-only" model and answers 404 to its requests)
NO_FILES = "NoTokenizerFiles"

# ModelType -> (1.x model_type flags, 1.x model_input)
_TO_V1 = {
    ModelType.Backend: ("Chat | Completions", "Tokens"),
    ModelType.Chat: ("Chat", "Text"),
    ModelType.Completion: ("Completions", "Text"),
    ModelType.Embedding: ("Embedding", "Tokens"),
    ModelType.Prefill: ("Prefill", "Tokens"),
}


def v1_model_type(model_type: ModelType) -> tuple[str, str]:
    """1.x's ``model_type`` text (bitflags, ``"Chat | Completions"``) and ``model_input`` for ours."""
    return _TO_V1[model_type]


def model_type_from_v1(flags: str, model_input: str) -> ModelType | None:
    """Our ModelType of a 1.x card: token input for chat or completions is a Backend model (our frontend
    templates and tokenizes); None for what we do not serve (tensors, images, ...)."""
    names = {f.strip() for f in str(flags).split("|") if f.strip()}
    if "Prefill" in names:
        return ModelType.Prefill
    if "Embedding" in names:
        return ModelType.Embedding
    if names & {"Chat", "Completions"}:
        if model_input == "Tokens":
            return ModelType.Backend
        return ModelType.Chat if "Chat" in names else ModelType.Completion
    return None


def checked_file(path: Path) -> dict[str, Any]:
    """1.x's CheckedFile of a local file: its absolute path, ``blake3:<hex>`` and size."""
    import blake3  # the checksum 1.x writes and checks

    data = path.read_bytes()
    return {"path": str(path), "checksum": f"blake3:{blake3.blake3(data).hexdigest()}", "size": len(data)}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dynamo" / "v1_cards"


def _write_cached(files: dict[str, bytes], root: Path | None) -> Path:
    """``files`` (name -> bytes) in a directory named by their digest; written once, atomically."""
    digest = hashlib.sha256(b"".join(hashlib.sha256(n.encode() + b"\0" + d).digest()
                                     for n, d in sorted(files.items()))).hexdigest()[:32]
    folder = (root or cache_root()) / digest
    if not folder.is_dir():
        tmp = folder.parent / f".{digest}.{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        try:
            tmp.rename(folder)
        except OSError:  # another worker wrote it first: same content
            for name in files:
                (tmp / name).unlink(missing_ok=True)
            tmp.rmdir()
    return folder


def card_files(card: ModelCard, *, root: Path | None = None) -> dict[str, Path]:
    """The local files a 1.x frontend loads ``card`` from: ``config``, ``tokenizer``, ``tokenizer_config``
    and (if any) ``generation_config``. The HF folder's own where they say what the card says; the rest
    written into the cache. ModelError for a card without a tokenizer."""
    if card.tokenizer_json is None:
        raise ModelError(f"model {card.display_name}: no tokenizer, so Dynamo 1.x frontends cannot serve it")
    folder = card.path if card.path is not None and card.path.is_dir() else None
    out: dict[str, Path] = {}
    made: dict[str, bytes] = {}
    if folder is not None and (folder / "config.json").is_file():
        out["config"] = folder / "config.json"
    else:
        config = dict(card.config)
        config.setdefault("max_position_embeddings", card.context_length or None)
        config.setdefault("eos_token_id", card.eos_token_ids[0] if len(card.eos_token_ids) == 1 else card.eos_token_ids)
        config.setdefault("bos_token_id", card.bos_token_id)
        made["config.json"] = json.dumps(config, default=str).encode()
    if folder is not None and (folder / "tokenizer.json").is_file():
        out["tokenizer"] = folder / "tokenizer.json"
    else:
        made["tokenizer.json"] = card.tokenizer_json.encode()
    own_config = folder / "tokenizer_config.json" if folder is not None else None
    if own_config is not None and own_config.is_file() and card.tokenizer_config.get("chat_template") == card.chat_template:
        out["tokenizer_config"] = own_config
    else:  # the template from a chat_template.jinja, --chat-template or a GGUF goes into tokenizer_config
        made["tokenizer_config.json"] = json.dumps(dict(card.tokenizer_config, chat_template=card.chat_template)).encode()
    if folder is not None and (folder / "generation_config.json").is_file():
        out["generation_config"] = folder / "generation_config.json"
    elif card.generation_config or card.eos_token_ids:
        made["generation_config.json"] = json.dumps(
            card.generation_config or {"eos_token_id": card.eos_token_ids, "bos_token_id": card.bos_token_id}).encode()
    if made:
        cached = _write_cached(made, root)
        for name in made:
            out[name.removesuffix(".json")] = cached / name
    return out


def v1_card_json(card: ModelCard, model_type: ModelType, runtime_config: dict[str, Any] | None = None, *,
                 root: Path | None = None) -> dict[str, Any]:
    """The ``card_json`` of a ``v1/mdc`` record for ``card`` served as ``model_type``, in 1.x's fields only
    (reads the files for their checksums: call it off the event loop). A card with no tokenizer names no
    files, and its ``model_type`` is :data:`NO_FILES`, which 1.x rejects: it has nothing to load."""
    files = card_files(card, root=root) if card.tokenizer_json is not None else {}
    flags, model_input = v1_model_type(model_type) if files else (NO_FILES, "Tokens")
    ours = runtime_config or {}
    parser = {name: (value if value != "auto" else None)
              for name, value in (("tool_call_parser", card.tool_call_parser), ("reasoning_parser", card.reasoning_parser))}
    source = card.gguf_path or card.path

    def named(kind: str, name: str) -> dict[str, Any] | None:
        return {kind: checked_file(files[name])} if name in files else None

    return {
        "display_name": card.display_name,
        "slug": slugify(card.display_name),
        "source_path": str(source) if source is not None else card.display_name,
        "model_info": named("hf_config_json", "config"),
        "tokenizer": named("hf_tokenizer_json", "tokenizer"),
        "prompt_formatter": named("hf_tokenizer_config_json", "tokenizer_config"),
        "gen_config": named("hf_generation_config_json", "generation_config"),
        "architectural_max_context_length": card.context_length,
        "context_length": card.context_length,
        "kv_cache_block_size": card.kv_cache_block_size,
        "migration_limit": card.migration_limit,
        "model_type": flags,
        "model_input": model_input,
        "worker_type": "aggregated",
        "needs": [],
        "runtime_config": {
            "context_length": card.context_length,
            "total_kv_blocks": ours.get("total_kv_blocks"),
            "max_num_seqs": ours.get("max_num_seqs") or ours.get("max_inflight_requests"),
            "max_num_batched_tokens": ours.get("max_num_batched_tokens"),
            **parser,
            "tool_call_arguments_format": "json_string",
            "structural_tag_mode": "off", "structural_tag_scope": "auto", "structural_tag_schema": "auto",
            "exclude_tools_when_tool_choice_none": True,
            "data_parallel_start_rank": 0, "data_parallel_size": 1,
            # a 1.x KV router asks a worker with a local indexer for a dump of it at start: we serve none
            "enable_local_indexer": False,
            "kv_event_publishing_enabled": bool(ours.get(PUBLISHES_KV_EVENTS)),
            "runtime_data": {},
            "enable_eagle": False,
        },
        "media_decoder": None,
        "media_fetcher": None,
    }


def hidden_from_1x(entry: ModelEntry, *, reachable: bool = True) -> tuple[str, str] | None:
    """Why a 1.x frontend must not serve ``entry``: the ``model_type`` flag that tells 1.6.1 (it rejects a
    flag it does not know, in one line naming it, and keeps serving the rest) and the reason; None: it may."""
    if not reachable:
        return "ServedOverNats", "served over NATS (1.x sends to workers over TCP)"
    if entry.card.get("lora"):
        return "LoraAdapter", "a LoRA adapter (1.x's requests name no adapter our worker reads)"
    if entry.model_type is ModelType.Prefill:
        return "PrefillOverOurTransfer", "a prefill worker (1.x's decode workers take the KV state their own way)"
    return None


def record_of(entry: ModelEntry, card: ModelCard | None = None, *, reachable: bool = True,
              root: Path | None = None) -> bytes:
    """The ``v1/mdc`` record announcing ``entry`` (its ``card`` is the one loaded, with the tokenizer
    ``entry.card`` names by digest; without it, 1.x gets no files): 1.x's card plus :data:`EXTRAS`. Reads
    the card's files: call it off the event loop. ``reachable``: whether the endpoint has a
    ``v1/instances`` record 1.x can reach."""
    if card is None:
        card = ModelCard.placeholder(entry.name)
    try:
        card_json = v1_card_json(card, entry.model_type, entry.runtime_config, root=root)
    except (ModelError, OSError) as exc:  # files 1.x would load cannot be named: 1.x skips the model
        log.info("model %s: Dynamo 1.x frontends will not list it (%s)", entry.name, exc)
        card_json = v1_card_json(dataclasses.replace(card, tokenizer_json=None), entry.model_type,
                                 entry.runtime_config)
    hidden = hidden_from_1x(entry, reachable=reachable)
    if hidden is not None:
        log.info("model %s: %s, not served by Dynamo 1.x frontends", entry.name, hidden[1])
        card_json["model_type"] = hidden[0]
    card_json[EXTRAS] = {"model_type": entry.model_type.value, "card": entry.card,
                         "runtime_config": entry.runtime_config}
    return model_record(entry.namespace, entry.component, entry.endpoint, entry.instance_id, card_json,
                        entry.lora_suffix)


# ---------------------------------------------------------------------------------------- reading

def _file(section: Any, *names: str) -> Path | None:
    if not isinstance(section, dict):
        return None
    for name in names:
        entry = section.get(name)
        if isinstance(entry, dict) and isinstance(entry.get("path"), str):
            return Path(entry["path"])
        if isinstance(entry, str):  # a bare path
            return Path(entry)
    return None


def card_from_v1(card_json: dict[str, Any]) -> ModelCard:
    """Our card of a 1.x worker's model, from the files its card names (reads them: call it off the
    event loop). ModelError, naming the model and the file, when they are not on this machine."""
    name = str(card_json.get("display_name") or "?")
    tokenizer = _file(card_json.get("tokenizer"), "hf_tokenizer_json")
    if tokenizer is None:
        raise ModelError(f"model {name} (a Dynamo 1.x worker's): its card names no tokenizer.json "
                         f"(tokenizer {card_json.get('tokenizer')!r}), the only kind this frontend loads")
    if not tokenizer.is_file():
        raise ModelError(f"model {name} (a Dynamo 1.x worker's): its tokenizer {tokenizer} is not on this machine "
                         f"(the worker runs elsewhere; source_path {card_json.get('source_path')!r}); run this "
                         "frontend where the model's files are")
    folder = tokenizer.parent
    card = load_hf_folder(folder, name=name) if (folder / "config.json").is_file() else \
        ModelCard(display_name=name, path=folder, tokenizer_json=tokenizer.read_text(encoding="utf-8"))
    if card.tokenizer_json is None or (folder / "tokenizer.json") != tokenizer:
        card.tokenizer_json = tokenizer.read_text(encoding="utf-8")
    tokenizer_config = _file(card_json.get("prompt_formatter"), "hf_tokenizer_config_json")
    if tokenizer_config is not None and tokenizer_config.is_file() and tokenizer_config != folder / "tokenizer_config.json":
        card.tokenizer_config = json.loads(tokenizer_config.read_text(encoding="utf-8"))
        card.chat_template = card.tokenizer_config.get("chat_template")
    template = _file(card_json.get("prompt_formatter"), "hf_chat_template", "hf_chat_template_jinja")
    if template is not None and template.is_file():
        card.chat_template = template.read_text(encoding="utf-8")
    context = card_json.get("context_length") or card_json.get("architectural_max_context_length")
    if isinstance(context, int) and context > 0:
        card.context_length = context
    if isinstance(card_json.get("kv_cache_block_size"), int) and card_json["kv_cache_block_size"] > 0:
        card.kv_cache_block_size = card_json["kv_cache_block_size"]
    card.migration_limit = int(card_json.get("migration_limit") or 0)
    rc = card_json.get("runtime_config") or {}
    card.tool_call_parser = rc.get("tool_call_parser")
    card.reasoning_parser = rc.get("reasoning_parser")
    return card


def entry_from_record(value: bytes | str) -> ModelEntry:
    """The :class:`ModelEntry` of a ``v1/mdc`` record: ours from :data:`EXTRAS`, a 1.x worker's with its
    card kept 1.x's (``V1_CARD``, loaded from its files when the model is built). ValueError for a record
    we do not serve (another type, a model type we have no pipeline for, 1.x's LoRA or prefill workers)."""
    obj = orjson.loads(value)
    if not isinstance(obj, dict) or obj.get("type") != "Model":
        raise ValueError("not a Model record")
    card_json = obj.get("card_json")
    if not isinstance(card_json, dict):
        raise ValueError("no card_json")
    name = str(card_json.get("display_name") or "")
    if not name:
        raise ValueError("the card has no display_name")
    where = {"namespace": obj["namespace"], "component": obj["component"], "endpoint": obj["endpoint"],
             "instance_id": signed_id(int(obj["instance_id"]))}
    extras = card_json.get(EXTRAS)
    if isinstance(extras, dict):
        return ModelEntry(name=name, model_type=ModelType.parse(extras["model_type"]), card=extras.get("card") or {},
                          runtime_config=extras.get("runtime_config"), **where)
    model_type = model_type_from_v1(card_json.get("model_type", ""), card_json.get("model_input", ""))
    if model_type is None:
        raise ValueError(f"model type {card_json.get('model_type')!r} with {card_json.get('model_input')!r} "
                         "input is not served by this frontend")
    if model_type is ModelType.Prefill:
        raise ValueError("a Dynamo 1.x prefill worker hands its KV state over 1.x's transfer, which our decode "
                         "workers do not take")
    if obj.get("model_suffix") or card_json.get("lora"):
        raise ValueError("LoRA adapters of Dynamo 1.x workers are not served by this frontend")
    return ModelEntry(name=name, model_type=model_type, card={V1_CARD: card_json},
                      runtime_config=card_json.get("runtime_config"), **where)


async def load_entry_card(store: ObjectStore, card: dict[str, Any]) -> ModelCard:
    """The card of a model entry: a 1.x worker's from the files it names, ours from the entry and the
    object store (:func:`~dynamo.llm.model_entry.load_card`)."""
    if V1_CARD in card:
        return await asyncio.to_thread(card_from_v1, card[V1_CARD])
    return await load_card(store, card)
