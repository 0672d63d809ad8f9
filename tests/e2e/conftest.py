"""Fixtures of the LoRA tests on llama.cpp (tests/e2e/test_lora_*.py): the real SmolLM2 GGUF, an adapter
that changes its greedy output, and engine arguments that keep two slots on one thread each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.lora_gguf import write_lora_gguf
from tests.integration.test_llamacpp import _smollm2


@pytest.fixture(scope="module")
def gguf() -> Path:
    return _smollm2()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_lora_gguf(tmp_path_factory.mktemp("lora") / "strong.gguf", seed=1, scale=4.0)


@pytest.fixture(scope="module")
def args_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("args") / "args.json"
    p.write_text(json.dumps({"n_parallel": 2, "n_threads": 1}))
    return p
