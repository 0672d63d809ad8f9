"""The ``v1/mdc`` record both ways: ours as a 1.6.1 frontend loads it (files it can read, blake3
checksums) with our card beside 1.x's fields, a 1.x worker's as our entry, and the ModelType mapping."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import orjson
import pytest

from dynamo.errors import ModelError
from dynamo.llm.gguf_card import load_gguf
from dynamo.llm.model_card import ModelCard, load_hf_folder
from dynamo.llm.model_entry import V1_CARD, ModelEntry, is_1x_worker
from dynamo.llm.model_source import apply_chat_template_file
from dynamo.llm.model_type import ModelType
from dynamo.llm.v1_card import (
    EXTRAS,
    card_from_v1,
    entry_from_record,
    model_type_from_v1,
    record_of,
    v1_card_json,
    v1_model_type,
)
from dynamo.runtime.v1_records import model_record
from harness.tiny_model import build_tiny_gguf, build_tiny_hf_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_model(tmp_path_factory.mktemp("hf"), with_weights=False)


def test_model_types_both_ways() -> None:
    assert v1_model_type(ModelType.Backend) == ("Chat | Completions", "Tokens")
    assert model_type_from_v1("Chat | Completions", "Tokens") is ModelType.Backend
    assert model_type_from_v1("Chat|Completions", "Text") is ModelType.Chat
    assert model_type_from_v1("Completions", "Text") is ModelType.Completion
    assert model_type_from_v1("Embedding", "Tokens") is ModelType.Embedding
    assert model_type_from_v1("Prefill", "Tokens") is ModelType.Prefill
    assert model_type_from_v1("TensorBased", "Tensor") is None
    for mt in ModelType:
        assert model_type_from_v1(*v1_model_type(mt)) is mt


def test_an_hf_folder_card_names_its_own_files_with_blake3(hf: Path, tmp_path: Path) -> None:
    card = load_hf_folder(hf)
    cj = v1_card_json(card, ModelType.Backend, {"max_inflight_requests": 8, "publishes_kv_events": True},
                      root=tmp_path)
    tok = cj["tokenizer"]["hf_tokenizer_json"]
    assert tok["path"] == str(hf / "tokenizer.json")
    assert tok["checksum"] == "blake3:" + blake3.blake3((hf / "tokenizer.json").read_bytes()).hexdigest()
    assert tok["size"] == (hf / "tokenizer.json").stat().st_size
    assert cj["model_info"]["hf_config_json"]["path"] == str(hf / "config.json")
    assert cj["prompt_formatter"]["hf_tokenizer_config_json"]["path"] == str(hf / "tokenizer_config.json")
    assert cj["model_type"] == "Chat | Completions" and cj["model_input"] == "Tokens"
    assert cj["runtime_config"]["max_num_seqs"] == 8 and cj["runtime_config"]["kv_event_publishing_enabled"]
    assert cj["kv_cache_block_size"] == card.kv_cache_block_size and cj["context_length"] == card.context_length
    assert not list(tmp_path.iterdir())  # nothing needed writing


def test_a_replaced_template_is_written_to_the_cache(hf: Path, tmp_path: Path) -> None:
    card = load_hf_folder(hf)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    apply_chat_template_file(card, template)
    cj = v1_card_json(card, ModelType.Backend, root=tmp_path / "cache")
    path = Path(cj["prompt_formatter"]["hf_tokenizer_config_json"]["path"])
    assert path.parent.parent == tmp_path / "cache"
    assert json.loads(path.read_text())["chat_template"] == card.chat_template
    assert card_from_v1(cj).chat_template == card.chat_template


def test_a_gguf_card_gets_files_derived_from_the_gguf(hf: Path, tmp_path: Path) -> None:
    card = load_gguf(build_tiny_gguf(tmp_path / "m.gguf", hf))
    cj = v1_card_json(card, ModelType.Backend, root=tmp_path / "cache")
    tok = Path(cj["tokenizer"]["hf_tokenizer_json"]["path"])
    assert tok.read_text() == card.tokenizer_json
    assert cj["source_path"] == str(tmp_path / "m.gguf")
    assert json.loads(Path(cj["prompt_formatter"]["hf_tokenizer_config_json"]["path"]).read_text())["chat_template"] \
        == card.chat_template
    again = v1_card_json(card, ModelType.Backend, root=tmp_path / "cache")  # content-addressed: one copy
    assert again == cj and len(list((tmp_path / "cache").iterdir())) == 1
    back = card_from_v1(cj)
    assert back.tokenizer_json == card.tokenizer_json and back.chat_template == card.chat_template
    assert back.eos_token_ids == card.eos_token_ids


def test_a_card_without_tokenizer_names_no_files_and_no_model_type(tmp_path: Path) -> None:
    cj = v1_card_json(ModelCard.placeholder("x"), ModelType.Chat, root=tmp_path)
    assert cj["tokenizer"] is None and cj["model_info"] is None and cj["prompt_formatter"] is None
    assert cj["model_type"] == "NoTokenizerFiles"  # 1.x has nothing to load: it rejects the flag, naming it
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_a_1_x_card_becomes_our_card(hf: Path) -> None:
    cj = {"display_name": "served-name", "source_path": str(hf),
          "tokenizer": {"hf_tokenizer_json": {"path": str(hf / "tokenizer.json"), "checksum": "blake3:00"}},
          "prompt_formatter": {"hf_tokenizer_config_json": {"path": str(hf / "tokenizer_config.json")}},
          "context_length": 0, "architectural_max_context_length": 1024, "kv_cache_block_size": 64,
          "migration_limit": 2, "model_type": "Chat | Completions", "model_input": "Tokens",
          "runtime_config": {"tool_call_parser": None, "reasoning_parser": None}}
    card = card_from_v1(cj)
    ours = load_hf_folder(hf)
    assert card.display_name == "served-name" and card.tokenizer_json == ours.tokenizer_json
    assert card.chat_template == ours.chat_template and card.eos_token_ids == ours.eos_token_ids
    assert (card.context_length, card.kv_cache_block_size, card.migration_limit) == (1024, 64, 2)


def test_files_not_on_this_machine_are_a_clear_error() -> None:
    cj = {"display_name": "far", "source_path": "org/far",
          "tokenizer": {"hf_tokenizer_json": {"path": "/nowhere/tokenizer.json"}}}
    with pytest.raises(ModelError, match="far.*/nowhere/tokenizer.json is not on this machine"):
        card_from_v1(cj)


def test_a_1_x_model_record_becomes_our_entry(hf: Path, tmp_path: Path) -> None:
    cj = v1_card_json(load_hf_folder(hf, name="tiny"), ModelType.Backend, root=tmp_path)
    big = 0xF000_0000_0000_0001
    entry = entry_from_record(model_record("d16", "backend", "generate", big, cj))
    assert entry.key() == "v1/mdc/d16/backend/generate/f000000000000001"
    assert entry.model_type is ModelType.Backend and entry.instance_id < 0 and entry.card == {V1_CARD: cj}
    assert is_1x_worker(entry)
    with pytest.raises(ValueError, match="not served"):
        entry_from_record(model_record("n", "c", "e", 1, dict(cj, model_type="TensorBased", model_input="Tensor")))
    with pytest.raises(ValueError, match="prefill"):
        entry_from_record(model_record("n", "c", "e", 1, dict(cj, model_type="Prefill")))
    with pytest.raises(ValueError, match="LoRA"):
        entry_from_record(model_record("n", "c", "e", 1, dict(cj, lora={"name": "a"}), "a"))
    with pytest.raises(ValueError, match="Model record"):
        entry_from_record(orjson.dumps({"type": "Endpoint"}))


def _ours(card: ModelCard, model_type: ModelType = ModelType.Backend) -> ModelEntry:
    data = card.to_json()
    data["tokenizer_object"] = "digest-of-the-tokenizer"  # publish_card's reference into the object store
    del data["tokenizer_json"]
    return ModelEntry(name=card.display_name, namespace="ns", component="backend", endpoint="generate",
                      model_type=model_type, instance_id=0x1234, card=data,
                      runtime_config={"max_inflight_requests": 4, "publishes_kv_events": True})


def test_our_record_is_1_x_card_with_our_card_beside(hf: Path, tmp_path: Path) -> None:
    card = load_hf_folder(hf, name="tiny")
    entry = _ours(card)
    record = orjson.loads(record_of(entry, card, root=tmp_path))
    assert entry.key() == "v1/mdc/ns/backend/generate/1234"
    assert record["type"] == "Model" and record["instance_id"] == 0x1234 and "model_suffix" not in record
    cj = record["card_json"]
    assert cj["model_type"] == "Chat | Completions" and cj["tokenizer"]["hf_tokenizer_json"]["path"] == str(hf / "tokenizer.json")
    assert cj[EXTRAS]["card"]["tokenizer_object"] == "digest-of-the-tokenizer"
    back = entry_from_record(orjson.dumps(record))
    assert back == entry and not is_1x_worker(back)


@pytest.mark.parametrize("kind", ["lora", "prefill", "nats"])
def test_models_1_x_must_not_serve_have_a_model_type_it_rejects(hf: Path, tmp_path: Path, kind: str) -> None:
    card = load_hf_folder(hf, name="tiny")
    entry = _ours(card, ModelType.Prefill if kind == "prefill" else ModelType.Backend)
    if kind == "lora":
        entry.card["lora"] = {"name": "My.Adapter", "base_model": "tiny", "path": "/a"}
    record = orjson.loads(record_of(entry, card, reachable=kind != "nats", root=tmp_path))
    flag = {"lora": "LoraAdapter", "prefill": "PrefillOverOurTransfer", "nats": "ServedOverNats"}[kind]
    assert record["card_json"]["model_type"] == flag
    assert entry_from_record(orjson.dumps(record)) == entry  # ours still serve it
    if kind == "lora":  # keyed as 1.x keys an adapter
        assert entry.key().endswith("/1234/my_adapter") and record["model_suffix"] == "my_adapter"
