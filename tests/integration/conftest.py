"""Servers for the HTTP integration tests: ``dynamo-run in=http`` as a real subprocess.

The echo servers are session-scoped so the suite starts each configuration once; tests that change the
server's state (signals, environment) start their own with :class:`harness.proc.DynamoRun`.  The SmolLM2
ones (``smollm2_client``: ``out=llamacpp``; ``smollm2_dyn_client``: a llamacpp worker behind ``out=dyn``
on its own etcd and nats-server) are module-scoped, one per module that uses them, as is ``tok``, the
GGUF's own tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.smollm2 import SMOLLM2_MODEL
from harness.wait import wait_until


@pytest.fixture(scope="session")
def full_server() -> Iterator[DynamoRun]:
    """``out=echo_full`` with no model: served as ``echo``."""
    with DynamoRun("out=echo_full", "--model-name", "echo") as srv:
        yield srv


@pytest.fixture(scope="session")
def core_server(tiny_model: Path) -> Iterator[DynamoRun]:
    """``out=echo_core`` on the tiny model folder: served as ``tiny-chat``."""
    with DynamoRun("out=echo_core", str(tiny_model)) as srv:
        yield srv


@pytest.fixture(scope="module")
def tok(gguf: Path) -> Any:
    """The SmolLM2 GGUF's tokenizer, as the engine and the frontend build it."""
    from dynamo.llm.gguf_card import load_gguf
    from dynamo.llm.tokenizer import Tokenizer

    return Tokenizer(load_gguf(gguf).tokenizer_json)


@pytest.fixture(scope="module")
def smollm2_client(gguf: Path) -> Iterator[Any]:
    """An openai SDK client of ``out=llamacpp`` on SmolLM2 (context 1024)."""
    openai = pytest.importorskip("openai")
    with DynamoRun("out=llamacpp", str(gguf), "--context-length", "1024", startup_timeout=120) as server:
        yield openai.OpenAI(base_url=server.api_url, api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def smollm2_dyn_client(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An openai SDK client of ``out=dyn`` whose one worker is ``out=llamacpp`` on SmolLM2 (two slots, one
    thread each), over a real etcd and nats-server; yielded once the frontend lists the model."""
    openai = pytest.importorskip("openai")
    args = tmp_path_factory.mktemp("smollm2-dyn") / "args.json"
    args.write_text(json.dumps({"n_parallel": 2, "n_threads": 1}))
    with EtcdServer() as etcd, NatsServer() as nats_srv:
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url}
        worker = DynamoWorker("in=dyn://lp.llamacpp.generate", "out=llamacpp", str(gguf), "--context-length", "1024",
                              "--extra-engine-args", str(args), env=env, startup_timeout=120).start()
        try:
            with DynamoRun("out=dyn", env=env, startup_timeout=60) as frontend:
                c = openai.OpenAI(base_url=frontend.api_url, api_key="none", timeout=120, max_retries=0)
                wait_until(lambda: any(m.id == SMOLLM2_MODEL for m in c.models.list().data), 30,
                           f"{SMOLLM2_MODEL} discovered")
                yield c
        finally:
            worker.kill()
