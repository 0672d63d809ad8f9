"""Embedding workers and ``--chat-template`` across the distributed runtime, real processes under each
distributed configuration (harness/dist_configs.py): a frontend (``in=http out=dyn``) and workers
(``in=dyn://...``), one of them a Python worker on the runtime API.

An ``--embedding`` worker registers as ``ModelType.Embedding``; the frontend lists it and routes
``/v1/embeddings`` to it (a 400 from the worker stays a 400).  A worker's ``--chat-template`` travels in
its model card, so the frontend templates with it (chat, /tokenize, /v1/responses).  One of two
embedding workers is killed -9: requests keep succeeding on the other before its lease even expires.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from harness.dist_configs import DistConfig
from harness.proc import DynamoRun, DynamoWorker

pytestmark = pytest.mark.timeout(120)

PLAIN_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")


def wait_for_models(frontend: DynamoRun, names: set[str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = {m["id"] for m in httpx.get(frontend.api_url + "/models", timeout=5).json()["data"]}
        if names <= got:
            return
        time.sleep(0.05)
    pytest.fail(f"models {names} not on the frontend after {timeout}s")


@pytest.fixture(scope="module")
def rt_env(dist_config: DistConfig) -> dict[str, str]:
    return dist_config.env


@pytest.fixture(scope="module")
def workers(rt_env, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DynamoWorker]]:
    tpl = tmp_path_factory.mktemp("tpl") / "plain.jinja"
    tpl.write_text(PLAIN_TEMPLATE)
    specs = {
        "emb1": ["in=dyn://emb.worker.generate", "out=echo_core", str(tiny_model), "--embedding", "--model-name", "d-emb"],
        "emb2": ["in=dyn://emb.worker.generate", "out=echo_core", str(tiny_model), "--embedding", "--model-name", "d-emb"],
        "plain": ["in=dyn://tpl.backend.generate", "out=echo_core", str(tiny_model), "--chat-template", str(tpl),
                  "--model-name", "d-plain"],
    }
    started = {name: DynamoWorker(*args, env=rt_env).start(wait=False) for name, args in specs.items()}
    try:
        for w in started.values():
            w.wait_ready()
        yield started
    finally:
        for w in started.values():
            w.kill()


@pytest.fixture(scope="module")
def frontend(rt_env, workers) -> Iterator[DynamoRun]:
    with DynamoRun("out=dyn", env=rt_env) as fe:
        wait_for_models(fe, {"d-emb", "d-plain"})
        yield fe


def sdk(frontend: DynamoRun) -> openai.OpenAI:
    return openai.OpenAI(base_url=frontend.api_url, api_key="unused", max_retries=0, timeout=30)


def test_embedding_worker_registers_as_embedding(workers):
    assert workers["emb1"].ready_match.group("type") == "Embedding"
    assert workers["plain"].ready_match.group("type") == "Backend"


def test_embeddings_through_the_frontend(frontend: DynamoRun):
    client = sdk(frontend)
    r = client.embeddings.create(model="d-emb", input=["one two", "three", "one two"], encoding_format="float")
    vecs = [d.embedding for d in r.data]
    assert len(vecs) == 3 and len(vecs[0]) == 32 and vecs[0] == vecs[2] != vecs[1]
    assert r.usage.prompt_tokens > 0
    assert len(client.embeddings.create(model="d-emb", input="x", dimensions=4).data[0].embedding) == 4
    with pytest.raises(openai.BadRequestError) as info:  # the worker's 400 stays a 400
        client.embeddings.create(model="d-emb", input="x", dimensions=1000)
    assert info.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="d-emb", messages=[{"role": "user", "content": "hi"}])


def test_chat_template_travels_in_the_card(frontend: DynamoRun):
    client = sdk(frontend)
    r = client.chat.completions.create(model="d-plain", messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content == "<user>Hi\n<assistant>"
    tok = httpx.post(frontend.base_url + "/tokenize",
                     json={"model": "d-plain", "messages": [{"role": "user", "content": "Hi"}]}, timeout=10).json()
    text = httpx.post(frontend.base_url + "/detokenize", json={"model": "d-plain", "tokens": tok["tokens"]},
                      timeout=10).json()["prompt"]
    assert text == "<user>Hi\n<assistant>"
    resp = client.responses.create(model="d-plain", input="Yo", instructions="Sys")
    assert resp.output_text == "<system>Sys\n<user>Yo\n<assistant>"


def test_embeddings_survive_a_worker_killed(frontend: DynamoRun, workers):
    client = sdk(frontend)
    expected = client.embeddings.create(model="d-emb", input="steady", encoding_format="float").data[0].embedding
    workers["emb1"].kill()  # kill -9: its lease and instance key stay until the TTL runs out
    for _ in range(6):  # round-robin reaches the dead instance too; each request must still succeed
        got = client.embeddings.create(model="d-emb", input="steady", encoding_format="float").data[0].embedding
        assert got == expected
    assert "sending it to another worker" in frontend.stderr_text()  # the dead instance was tried, and skipped


def test_a_python_embedding_worker_gets_token_ids(rt_env, frontend: DynamoRun, tiny_model: Path, tmp_path: Path):
    """A worker using only the original's API: token ids in, ``embeddings`` out (the Embedding wire format); its
    ``register_llm(custom_template_path=...)`` template reaches the frontend in the card."""
    import sys

    data = Path(__file__).parent / "data" / "embedding_dyn_worker.py"
    tpl = tmp_path / "py.jinja"
    tpl.write_text("{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}")
    worker = DynamoWorker(str(tiny_model), str(tpl), command=[sys.executable, str(data)], env=rt_env,
                          ready=None).start()
    try:
        wait_for_models(frontend, {"py-emb"})
        tok = httpx.post(frontend.base_url + "/tokenize",
                         json={"model": "py-emb", "messages": [{"role": "user", "content": "hey"}]}, timeout=10).json()
        assert httpx.post(frontend.base_url + "/detokenize", json={"model": "py-emb", "tokens": tok["tokens"]},
                          timeout=10).json()["prompt"] == "user=hey;"
        ids = httpx.post(frontend.base_url + "/tokenize", json={"model": "py-emb", "prompt": "alpha beta gamma"},
                         timeout=10).json()["tokens"]
        client = sdk(frontend)
        r = client.embeddings.create(model="py-emb", input=["alpha beta gamma", "x"], encoding_format="float")
        assert r.data[0].embedding == [len(ids), ids[0], ids[-1]]
        assert r.usage.prompt_tokens == len(ids) + int(r.data[1].embedding[0])
        r = client.embeddings.create(model="py-emb", input=[[7, 8], [9]], encoding_format="float")
        assert [d.embedding for d in r.data] == [[2, 7, 8], [1, 9, 9]]
    finally:
        worker.stop()
