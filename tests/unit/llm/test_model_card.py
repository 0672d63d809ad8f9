"""Model cards from a local Hugging Face folder, and the model argument's resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamo.errors import ModelError
from dynamo.llm.model_card import load_hf_folder
from dynamo.llm.model_source import resolve_card
from harness.tiny_model import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, build_tiny_hf_model


def test_card_from_folder(tiny_model: Path):
    card = load_hf_folder(tiny_model)
    assert card.display_name == "tiny-chat"
    assert card.context_length == 2048
    assert card.eos_token_ids == [IM_END_ID, ENDOFTEXT_ID]
    assert card.bos_token_id == IM_START_ID
    assert card.kv_cache_block_size == 16
    assert card.has_tokenizer
    assert "<|im_start|>" in card.chat_template
    assert card.special_token("eos_token") == "<|im_end|>"


def test_eos_from_generation_config_when_config_has_none(tmp_path: Path):
    folder = build_tiny_hf_model(tmp_path, with_weights=False)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["eos_token_id"]
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_hf_folder(folder).eos_token_ids == [IM_END_ID, ENDOFTEXT_ID]


def test_context_length_falls_back_to_model_max_length(tmp_path: Path):
    folder = build_tiny_hf_model(tmp_path, with_weights=False, max_position_embeddings=777)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["max_position_embeddings"]
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_hf_folder(folder).context_length == 777


def test_chat_template_file_wins(tmp_path: Path):
    folder = build_tiny_hf_model(tmp_path, with_chat_template_file=True, with_weights=False)
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in load_hf_folder(folder).chat_template


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path):
    folder = build_tiny_hf_model(tmp_path, with_weights=False)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="no tokenizer.json"):
        load_hf_folder(folder)


def test_missing_config_is_a_clear_error(tmp_path: Path):
    folder = build_tiny_hf_model(tmp_path, with_weights=False)
    (folder / "config.json").unlink()
    with pytest.raises(ModelError, match="config.json"):
        load_hf_folder(folder)


def test_broken_json_is_a_clear_error(tmp_path: Path):
    folder = build_tiny_hf_model(tmp_path, with_weights=False)
    (folder / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ModelError, match="not valid JSON"):
        load_hf_folder(folder)


def test_resolve_no_model_is_a_placeholder_named_dynamo():
    card = resolve_card(None, name=None)
    assert card.display_name == "dynamo"
    assert not card.has_tokenizer
    assert resolve_card(None, name="demo").display_name == "demo"


def test_resolve_folder_with_name_and_overrides(tiny_model: Path):
    card = resolve_card(str(tiny_model), name="served", context_length=100, kv_cache_block_size=32,
                        migration_limit=2)
    assert card.display_name == "served"
    assert (card.context_length, card.kv_cache_block_size, card.migration_limit) == (100, 32, 2)


def test_context_length_cannot_exceed_the_model(tiny_model: Path):
    with pytest.raises(ModelError, match="larger than the model's context length 2048"):
        resolve_card(str(tiny_model), name=None, context_length=4096)


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path: Path):
    with pytest.raises(ModelError, match="no such file or directory"):
        resolve_card(str(tmp_path / "no-such-model"), name=None)


def test_model_config_folder_supplies_the_tokenizer(tiny_model: Path, tmp_path: Path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    (bare / "tokenizer.json").write_text((tiny_model / "tokenizer.json").read_text())
    card = resolve_card(str(bare), name=None, model_config=str(tiny_model))
    assert card.display_name == "bare"
    assert card.chat_template
