"""Publishing a served model for discovery, and reading it back on a frontend.

A worker writes one entry per (instance, model) under ``models/`` bound to its lease, so the entry
lives exactly as long as the worker (decisions.md: no card outliving every worker).  The entry carries
the model card; the tokenizer, which can be megabytes (too big for an etcd value), goes to the NATS
JetStream object store under its content hash, so every worker of a model shares one copy and a
frontend on another machine needs no shared disk.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import orjson

from dynamo.errors import ModelError
from dynamo.llm.model_card import ModelCard
from dynamo.llm.model_type import ModelType
from dynamo.runtime.names import lease_hex, slugify
from dynamo.runtime.object_store import ObjectStore, ObjectStoreError

log = logging.getLogger(__name__)

MODELS_PREFIX = "models/"
OBJECT_BUCKET = "dynamo_mdc"
# runtime_config key: true when the worker publishes KV events (and answers the recovery query); a KV
# router uses the approximate indexer for a model whose workers do not say so
PUBLISHES_KV_EVENTS = "publishes_kv_events"
# runtime_config key: the address a worker lends its cached KV prefixes from (disagg/prefix_share.py); a KV
# router names it to another such worker that it sends a prompt whose prefix this one holds
KV_PREFIX_SHARE = "kv_prefix_share"
# runtime_config key: the overlap weight this worker's engine suggests to a KV router whose operator set
# none (--kv-overlap-score-weight); how dear a block of prefill is against a block of decode load depends
# on the engine (frontend/kv_policy.py)
SUGGESTED_OVERLAP_WEIGHT = "kv_overlap_score_weight"


@dataclass
class ModelEntry:
    name: str
    namespace: str
    component: str
    endpoint: str
    model_type: ModelType
    instance_id: int
    card: dict[str, Any]
    runtime_config: dict[str, Any] | None = None

    def key(self) -> str:
        return (f"{MODELS_PREFIX}{self.namespace}/{self.component}/{self.endpoint}/"
                f"{lease_hex(self.instance_id)}/{slugify(self.name)}")

    def to_json(self) -> bytes:
        return orjson.dumps({
            "name": self.name,
            "endpoint": {"namespace": self.namespace, "component": self.component, "name": self.endpoint},
            "model_type": self.model_type.value,
            "instance_id": self.instance_id,
            "runtime_config": self.runtime_config,
            "card": self.card,
        }, option=orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, data: bytes | str) -> "ModelEntry":
        obj = orjson.loads(data)
        ep = obj["endpoint"]
        return cls(
            name=obj["name"], namespace=ep["namespace"], component=ep["component"], endpoint=ep["name"],
            model_type=ModelType.parse(obj["model_type"]), instance_id=int(obj.get("instance_id") or 0),
            card=obj.get("card") or {}, runtime_config=obj.get("runtime_config"),
        )


async def publish_card(store: ObjectStore, card: ModelCard) -> dict[str, Any]:
    """The card as it goes into a model entry, with the tokenizer uploaded to the object store."""
    data = card.to_json()
    tokenizer = data.pop("tokenizer_json", None)
    if tokenizer is not None:
        blob = tokenizer.encode("utf-8")
        digest = hashlib.sha256(blob).hexdigest()
        try:
            uploaded = await store.put_if_absent(digest, blob)
        except ObjectStoreError as e:
            raise ModelError(f"cannot publish the model card: {e}") from None
        if uploaded:
            log.debug("uploaded tokenizer of %s (%d bytes) as %s", card.display_name, len(blob), digest)
        data["tokenizer_object"] = digest
    return data


async def load_card(store: ObjectStore, data: dict[str, Any]) -> ModelCard:
    """The card of an entry, with its tokenizer fetched from the object store."""
    data = dict(data)
    digest = data.pop("tokenizer_object", None)
    card = ModelCard.from_json(data)
    if digest:
        try:
            blob = await store.get(digest)
        except ObjectStoreError as e:
            raise ModelError(f"cannot load the model card's tokenizer: {e}") from None
        if hashlib.sha256(blob).hexdigest() != digest:
            raise ModelError(f"tokenizer object {digest} is corrupt")
        card.tokenizer_json = blob.decode("utf-8")
    return card


# a Dynamo 1.x worker's runtime_config says it publishes KV events under this name (ours: PUBLISHES_KV_EVENTS)
V1_PUBLISHES_KV_EVENTS = "kv_event_publishing_enabled"


def is_1x_worker(entry: Any) -> bool:
    """A worker of Dynamo 1.x's own (its card came from a ``v1/mdc`` record): it says it publishes KV events
    with 1.x's key (``kv_event_publishing_enabled``), ours with their own; both publish and are recovered
    alike (dynamo/kv/v1_events.py)."""
    rc = getattr(entry, "runtime_config", None) or {}
    return PUBLISHES_KV_EVENTS not in rc and V1_PUBLISHES_KV_EVENTS in rc
