"""``register_llm``: make a served endpoint discoverable as a model: its model entry, under the endpoint's lease.

An endpoint that Dynamo 1.x frontends can reach (it has a ``v1/instances`` record: served over TCP) also
gets 1.x's ``v1/mdc`` record, written after our entry (a frontend of ours that reads both then keeps
ours, which carries what 1.x's card has no field for).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dynamo.errors import ModelError
from dynamo.llm.model_card import ModelCard
from dynamo.llm.model_entry import OBJECT_BUCKET, ModelEntry, publish_card
from dynamo.llm.model_type import ModelType
from dynamo.runtime.v1_records import endpoint_key, model_key, model_record

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
    store = runtime.discovery()
    await store.put(entry.key(), entry.to_json(), lease=True)
    await _publish_v1(store, ident, entry, card, runtime_config)
    log.info("registered model %s (%s) at %s", card.display_name, model_type.value, ident)
    return entry


async def _publish_v1(store: Any, ident: Any, entry: ModelEntry, card: ModelCard,
                      runtime_config: dict[str, Any] | None) -> None:
    """The ``v1/mdc`` record of an entry whose endpoint 1.x frontends can reach; a card they cannot load
    (no tokenizer), a LoRA adapter or a prefill worker (1.x's disaggregation is its own) are skipped."""
    from dynamo.llm.v1_card import v1_card_json

    lease = entry.instance_id
    if endpoint_key(ident.namespace, ident.component, ident.name, lease) not in store.lease_keys:
        return  # served over NATS (component.py said so) or not served by this process
    if card.lora is not None:
        log.debug("model %s: a LoRA adapter, not announced to Dynamo 1.x frontends", card.display_name)
        return
    if entry.model_type is ModelType.Prefill:  # 1.x's decode workers take the KV state their own way
        log.info("model %s: a prefill worker, not announced to Dynamo 1.x frontends", card.display_name)
        return
    try:
        card_json = await asyncio.to_thread(v1_card_json, card, entry.model_type, runtime_config)
    except (ModelError, OSError) as exc:
        log.info("model %s: no Dynamo 1.x card (%s); 1.x frontends will not list it", card.display_name, exc)
        return
    await store.put(model_key(ident.namespace, ident.component, ident.name, lease),
                    model_record(ident.namespace, ident.component, ident.name, lease, card_json), lease=True)
