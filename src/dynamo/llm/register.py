"""``register_llm``: make a served endpoint discoverable as a model: its ``v1/mdc`` record (Dynamo 1.x's
Model, with our card as an extra field: llm/v1_card.py), under the endpoint's lease.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dynamo.llm.model_card import ModelCard
from dynamo.llm.model_entry import OBJECT_BUCKET, ModelEntry, publish_card
from dynamo.llm.model_type import ModelType
from dynamo.llm.v1_card import record_of

log = logging.getLogger(__name__)


async def register_llm(
    model_type: ModelType | str,
    endpoint: Any,
    model_path: str | None,
    model_name: str | None = None,
    context_length: int | None = None,
    kv_cache_block_size: int | None = None,
    router_mode: Any = None,
    migration_limit: int = 0,
    runtime_config: dict[str, Any] | None = None,
    user_data: dict[str, Any] | None = None,
    custom_template_path: str | None = None,
) -> ModelCard:
    """Resolve ``model_path`` (HF repo id, folder or GGUF) into a card and publish it for ``endpoint``.

    The entry is bound to the process's lease: it disappears when the worker stops or dies.
    ``custom_template_path`` (a Jinja file, as ``--chat-template``) replaces the model's chat template in
    the published card, so frontends template with it.
    """
    from dynamo.llm.model_source import resolve_card

    card = await asyncio.to_thread(
        resolve_card, model_path, name=model_name, context_length=context_length,
        kv_cache_block_size=kv_cache_block_size, migration_limit=migration_limit,
    )
    card.user_data = user_data
    if custom_template_path is not None:
        from pathlib import Path

        from dynamo.llm.model_source import apply_chat_template_file

        await asyncio.to_thread(apply_chat_template_file, card, Path(custom_template_path))
    await publish_model(endpoint, card, ModelType.parse(model_type), runtime_config=runtime_config)
    return card


async def publish_model(endpoint: Any, card: ModelCard, model_type: ModelType,
                        runtime_config: dict[str, Any] | None = None) -> ModelEntry:
    runtime = endpoint.runtime
    if runtime.is_static:
        raise RuntimeError("Cannot attach to static endpoint: a static worker is not discoverable")
    ident = endpoint.id
    entry = ModelEntry(
        name=card.display_name, namespace=ident.namespace, component=ident.component, endpoint=ident.name,
        model_type=model_type, instance_id=endpoint.lease_id(), card=await publish_card(runtime.object_store(OBJECT_BUCKET), card),
        runtime_config=runtime_config,
    )
    # 1.x frontends send to workers over TCP: a model served over NATS is not theirs to serve
    reachable = runtime.request_plane_kind == "tcp"
    await runtime.discovery().put(entry.key(), await asyncio.to_thread(record_of, entry, card, reachable=reachable),
                                  lease=True)
    log.info("registered model %s (%s) at %s", card.display_name, model_type.value, ident)
    return entry
