"""A served model as discovery knows it: one worker's (instance's) model, announced by Dynamo 1.x's
``v1/mdc`` record under the worker's lease, so the model lives exactly as long as the worker
(decisions.md: no card outliving every worker).  The record's JSON is built and read in v1_card.py.

The tokenizer, which can be megabytes (too big for an etcd value), goes to the NATS JetStream object
store under its content hash, so every worker of a model shares one copy and a frontend of ours on
another machine needs no shared disk (a 1.x frontend reads the files the card names instead).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from dynamo.errors import ModelError
from dynamo.llm.model_card import ModelCard
from dynamo.llm.model_type import ModelType
from dynamo.runtime.names import slugify
from dynamo.runtime.object_store import ObjectStore, ObjectStoreError
from dynamo.runtime.v1_records import model_key

log = logging.getLogger(__name__)

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

    @property
    def lora_suffix(self) -> str | None:
        """The key's last segment for a LoRA adapter's entry (1.x's ``model_suffix``): the adapter's slug."""
        lora = self.card.get("lora")
        name = lora.get("name") if isinstance(lora, dict) else None
        return slugify(str(name)) if name else None

    def key(self) -> str:
        """``v1/mdc/{ns}/{comp}/{ep}/{id:x}[/{adapter slug}]``: one per worker and model."""
        return model_key(self.namespace, self.component, self.endpoint, self.instance_id, self.lora_suffix)


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
# in a ModelEntry's card: a 1.x worker's card_json (no card of ours in its record), loaded from the files it names
V1_CARD = "v1_card_json"


def is_1x_worker(entry: ModelEntry) -> bool:
    """A worker of Dynamo 1.x's own (its ``v1/mdc`` record carries no card of ours): it says it publishes KV
    events with 1.x's key (``kv_event_publishing_enabled``), ours with their own; both publish and are
    recovered alike (dynamo/kv/v1_events.py)."""
    return V1_CARD in entry.card
