"""Fixtures of more than one e2e module: for the LoRA tests on llama.cpp (tests/e2e/test_lora_*.py), an
adapter that changes the greedy output of the real SmolLM2 GGUF (tests/conftest.py's ``gguf``) and engine
arguments that keep two slots on one thread each; for the tracing tests (test_tracing*.py), an OTLP
receiver."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from harness.lora_gguf import write_lora_gguf


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Scale 1: a sentence of its own.  A scale-4 adapter writes noise whose near-tied logits flip between a
    prompt computed whole and one computed after a cached prefix (AMX kernels for the one, VNNI for the
    other), so the same request could answer two ways."""
    return write_lora_gguf(tmp_path_factory.mktemp("lora") / "strong.gguf", seed=1, scale=1.0)


@pytest.fixture(scope="module")
def args_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("args") / "args.json"
    p.write_text(json.dumps({"n_parallel": 2, "n_threads": 1}))
    return p


@pytest.fixture(scope="module")
def receiver() -> Iterator[Any]:
    """An OTLP trace receiver (gRPC and HTTP) the module's processes export to (harness/otlp.py; imported
    here only when a test asks for it: grpc and the OTLP messages come with the tracing extra)."""
    from harness.otlp import OtlpReceiver

    with OtlpReceiver() as r:
        yield r
