"""A model's one record, ``v1/mdc``, end to end on a file store: a worker's ``publish_model`` writes 1.x's
Model with our card in ``dynamo_py`` (and nothing under a key of ours); a frontend's model watcher serves
it from that record alone, drops it when the record is replaced by one it does not serve (a 1.x LoRA
adapter's, said once however often it is written), and serves it again when ours comes back."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest

from dynamo.frontend.discovery import ModelWatcher
from dynamo.frontend.model_manager import ModelManager
from dynamo.frontend.remote import RouterConfig
from dynamo.llm.model_card import load_hf_folder
from dynamo.llm.model_type import ModelType
from dynamo.llm.register import publish_model
from dynamo.runtime.v1_records import model_record
from harness.tiny_model import build_tiny_hf_model
from harness.wait import until


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_model(tmp_path_factory.mktemp("hf"), with_weights=False)


async def test_a_model_is_served_from_its_v1_mdc_record_alone(file_runtimes, hf: Path, caplog) -> None:
    worker, frontend = await file_runtimes(), await file_runtimes()
    endpoint = worker.namespace("mr").component("backend").endpoint("generate")
    entry = await publish_model(endpoint, load_hf_folder(hf, name="rec-model"), ModelType.Backend,
                                runtime_config={"max_inflight_requests": 3})
    key = f"v1/mdc/mr/backend/generate/{worker.instance_id:x}"
    assert entry.key() == key
    assert [kv.key for kv in await frontend.discovery().get_prefix("")
            if "mr" in kv.key and not kv.key.startswith("v1/")] == []  # no record of ours beside 1.x's
    kv = await frontend.discovery().get(key)
    assert kv is not None
    record = orjson.loads(kv.value)
    assert record["card_json"]["dynamo_py"]["runtime_config"] == {"max_inflight_requests": 3}

    manager = ModelManager()
    watcher = ModelWatcher(frontend, manager, RouterConfig(), namespace="mr")
    await watcher.start()
    try:
        await until(lambda: "rec-model" in manager.names(), 10, "the model served from its record")
        caplog.set_level(logging.WARNING, logger="dynamo.frontend.discovery")
        for adapter in ("ad", "ad2"):  # two writes of records we do not serve
            lora = dict(record["card_json"], lora={"name": adapter})
            del lora["dynamo_py"]  # a 1.x worker's adapter: nothing of ours in it
            await worker.discovery().put(key, model_record("mr", "backend", "generate", worker.instance_id, lora),
                                         lease=True)
            await until(lambda: "rec-model" not in manager.names(), 10, "the model dropped with its record")
        await publish_model(endpoint, load_hf_folder(hf, name="rec-model"), ModelType.Backend)
        await until(lambda: "rec-model" in manager.names(), 10, "the model served again from our record")
        # events come in order: both adapters' records were seen before ours came back, and said once
        said = [r.getMessage() for r in caplog.records if "skipping model record" in r.getMessage()]
        assert len(said) == 1 and key in said[0] and "LoRA" in said[0], said
    finally:
        await watcher.close()
