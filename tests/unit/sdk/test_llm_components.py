"""What ``examples/llm``'s services run, from their config sections: the ``dynamo-run`` command line of each
role (no process is started: the roles start in the services' start hooks).  The engines a CPU machine
cannot run (vllm, sglang) are checked here, by the command they would get."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from dynamo.sdk import dynamo_context
from dynamo.sdk.lib.config import ENV_VAR, ServiceConfig

LLM = Path(__file__).resolve().parents[3] / "examples" / "llm"


@pytest.fixture
def components(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.syspath_prepend(str(LLM))
    import graphs.components as components

    saved = dict(dynamo_context)
    dynamo_context.update(namespace="dynamo")
    yield components
    dynamo_context.clear()
    dynamo_context.update(saved)
    ServiceConfig.reset()
    for name in [m for m in sys.modules if m == "graphs" or m.startswith("graphs.")]:
        del sys.modules[name]


def with_config(monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]) -> None:
    monkeypatch.setenv(ENV_VAR, json.dumps(config))
    ServiceConfig.reset()


def test_the_engine_key_picks_the_engine_and_other_keys_become_flags(components, monkeypatch):
    with_config(monkeypatch, {"Worker": {"engine": "vllm", "model": "Qwen/Qwen3-0.6B", "context-length": 1024,
                                         "ServiceArgs": {"workers": 2}, "common-configs": ["model"]}})
    assert components.Worker().role.args == ["in=dyn://dynamo.backend.generate", "out=vllm", "Qwen/Qwen3-0.6B",
                                             "--context-length", "1024"]
    with_config(monkeypatch, {"Worker": {"engine": "sglang", "model": "/m", "endpoint": "dyn://w.backend.generate"}})
    assert components.Worker().role.args[:3] == ["in=dyn://w.backend.generate", "out=sglang", "/m"]


def test_without_a_model_the_workers_use_the_smollm2_gguf(components, monkeypatch):
    with_config(monkeypatch, {"Worker": {}})
    try:
        default = components.default_model()
    except RuntimeError:
        pytest.skip("the SmolLM2 GGUF is not installed")
    args = components.Worker().role.args
    assert args[:3] == ["in=dyn://dynamo.backend.generate", "out=llamacpp", default]
    assert default.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_the_prefill_worker_is_always_a_prefill_worker_of_its_own_endpoint(components, monkeypatch):
    with_config(monkeypatch, {"PrefillWorker": {"engine": "mocker", "model": "/m"}})
    assert components.PrefillWorker().role.args == ["in=dyn://dynamo.prefill.generate", "out=mocker", "/m",
                                                    "--disaggregation-mode", "prefill"]


def test_the_frontend_and_processor_keep_their_own_keys(components, monkeypatch):
    with_config(monkeypatch, {"Frontend": {"port": 8123, "namespace": "dynamo", "router-mode": "kv"},
                              "Processor": {"model": "/m", "router-mode": "kv", "workers-namespace": "w"}})
    assert components.Frontend().role.args == ["in=http", "out=dyn", "--http-host", "127.0.0.1", "--http-port", "8123",
                                               "--namespace", "dynamo", "--router-mode", "kv"]
    args = components.Processor().role.args
    assert args[0] == "in=dyn://dynamo.Processor.chat" and args[1].endswith("graphs/processor_engine.py")
    assert args[2:] == ["/m"]  # router-mode and workers-namespace are its engine's, not dynamo-run flags
