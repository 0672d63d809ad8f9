"""``out=vllm``'s LoRA arguments and adapter checks, without vLLM: the PEFT folders harness/lora_peft.py
writes (and broken ones) checked as the engine checks them before vLLM sees them, and the engine
arguments that turn vLLM's LoRA on.  Where vLLM is importable (its tier) the arguments go to its real
``AsyncEngineArgs``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynamo.engines.vllm import engine as vl
from dynamo.engines.vllm.lora import adapter_rank, lora_engine_args, vllm_load_error
from dynamo.errors import UserError
from dynamo.llm.model_card import ModelCard
from dynamo.run_config import RunConfig
from harness.lora_peft import write_peft_lora


@pytest.fixture
def model(tmp_path: Path) -> Path:
    d = tmp_path / "tiny"
    d.mkdir()
    d.joinpath("config.json").write_text(json.dumps({
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
        "head_dim": 32, "num_hidden_layers": 2}))
    return d


def test_the_harness_adapter_is_a_peft_folder(model: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    folder = write_peft_lora(tmp_path / "a", model, rank=8, scale=0.0)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    a = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert a.shape == (8, 128) and b.shape == (64, 8)
    assert not b.any() and a.any()  # scale 0: B = 0, an adapter that changes nothing
    assert len(tensors) == 2 * 7 * 2
    assert adapter_rank(folder) == 8


def test_what_is_wrong_with_an_adapter_folder(model: Path, tmp_path: Path) -> None:
    good = write_peft_lora(tmp_path / "good", model)
    cases = {
        tmp_path / "nowhere": "no such folder",
        good / "adapter_model.safetensors": "not a file",
        write_peft_lora(tmp_path / "noweights", model, with_weights=False): "no adapter_model.safetensors",
    }
    empty = tmp_path / "empty"
    empty.mkdir()
    cases[empty] = "no adapter_config.json"
    for name, content, says in (("badjson", "{", "not valid JSON"),
                                ("prefix", json.dumps({"peft_type": "PREFIX_TUNING", "r": 8}), "not 'LORA'"),
                                ("norank", json.dumps({"peft_type": "LORA"}), "'r' (the rank)")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(content)
        (folder / "adapter_model.safetensors").write_bytes(b"")
        cases[folder] = says
    for path, says in cases.items():
        with pytest.raises(UserError, match=says.replace("(", r"\(").replace(")", r"\)")):
            adapter_rank(path)


def test_lora_is_on_for_start_adapters_or_run_time_loading(model: Path, tmp_path: Path) -> None:
    small = write_peft_lora(tmp_path / "r8", model, rank=8)
    big = write_peft_lora(tmp_path / "r40", model, rank=40)
    assert lora_engine_args([], runtime=False) == {}
    assert lora_engine_args([], runtime=True) == {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16}
    assert lora_engine_args([str(small)], runtime=False)["max_lora_rank"] == 16  # vLLM's default at least
    assert lora_engine_args([str(small), str(big)], runtime=False)["max_lora_rank"] == 64  # a rank vLLM has
    with pytest.raises(UserError, match="no such folder"):  # a bad start adapter stops before vLLM starts
        lora_engine_args([str(tmp_path / "nowhere")], runtime=False)
    with pytest.raises(UserError, match="enable_lora to false"):
        lora_engine_args([str(small)], runtime=False, extra={"enable_lora": False})


def test_engine_args_take_lora_and_extra_args_win(model: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("DYN_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    card = ModelCard(display_name="tiny", path=model)
    assert "enable_lora" not in vl.engine_args(RunConfig(output="vllm"), card)
    cfg = RunConfig(output="vllm", loras=[("a", str(write_peft_lora(tmp_path / "a", model)))])
    args = vl.engine_args(cfg, card, {"max_lora_rank": 64, "max_loras": 2})
    assert args["enable_lora"] is True and args["max_lora_rank"] == 64 and args["max_loras"] == 2
    monkeypatch.setenv("DYN_ALLOW_RUNTIME_LORA_UPDATING", "true")
    assert vl.engine_args(RunConfig(output="vllm"), card)["enable_lora"] is True
    assert "enable_lora" not in vl.engine_args(RunConfig(output="vllm"), card, pooling=True)


def test_vllms_load_error_in_one_line() -> None:
    wrapped = Exception("Call to add_lora method failed: Worker failed with error 'The size of tensor a (64) "
                        "must match the size of tensor b (96) at non-singleton dimension 1', please check the "
                        "stack trace above for the root cause")
    assert vllm_load_error(wrapped) == ("The size of tensor a (64) must match the size of tensor b (96) at "
                                        "non-singleton dimension 1")
    assert vllm_load_error(ValueError("plain\nerror")) == "plain error"


@pytest.mark.vllm
def test_vllm_takes_the_lora_arguments(model: Path, tmp_path: Path) -> None:
    vllm = pytest.importorskip("vllm")
    cfg = RunConfig(output="vllm", loras=[("a", str(write_peft_lora(tmp_path / "a", model, rank=32)))])
    args = vllm.AsyncEngineArgs(**vl.engine_args(cfg, ModelCard(display_name="tiny", path=model)))
    assert args.enable_lora and args.max_lora_rank == 32 and args.max_loras == 4


async def test_lora_with_an_embedding_model_is_an_error(tmp_path: Path) -> None:
    from dynamo.engines.served_model import build_served_model

    cfg = RunConfig(output="vllm", embedding=True, loras=[("a", str(tmp_path))])
    with pytest.raises(UserError, match="embedding model"):
        await build_served_model(cfg, ModelCard(display_name="tiny", path=tmp_path), "vllm")
