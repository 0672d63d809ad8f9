"""Images across the fleet: two ``out=llamacpp --mmproj`` workers behind ``out=dyn --router-mode kv``, on real
etcd and NATS, asked from the openai SDK with the colour projector (harness/colour_projector.py).

The workers announce images in their model card (``/v1/models`` lists the model as taking them); the
frontend loads each image once and sends its bytes and hash; the KV router sees the image in the block
hashes.  Worker A answers a red image, worker B a green one, with the same text (so both hold the same
system-prompt blocks and differ only from the image on): a repeat of the red request goes to A and of the
green one to B (three rounds), and each is a prefix-cache hit past the image there.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import nats
import openai
import pytest

from harness.colour_projector import QUESTION
from harness.events import kv_events, nats_subject, payload
from harness.fleet import kv_frontend, read_kv_states, workers_running, write_engine_args
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import etcd_and_nats_env
from harness.wait import until
from tests.integration.test_kv_routing import frontend_caught_up
from tests.integration.test_llamacpp_images import colours_named, image_part, image_url

pytestmark = pytest.mark.timeout(300)
MODEL = "colourllama"
EVENTS = nats_subject(MODEL, "kv-events", "llamacpp", "generate")


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with etcd_and_nats_env() as env:
        yield env


def _worker(servers: dict[str, str], gguf: Path, projector: Path, args_file: Path) -> DynamoWorker:
    write_engine_args(args_file, {"n_parallel": 2, "n_threads": 1})
    return DynamoWorker(f"in=dyn://{MODEL}.llamacpp.generate", "out=llamacpp", str(gguf), "--model-name", MODEL,
                        "--mmproj", str(projector), "--context-length", "512", "--extra-engine-args",
                        str(args_file), env=servers, startup_timeout=120)


def _ask(client: openai.OpenAI, colour: str, worker: int | None = None) -> Any:
    extra = {"nvext": {"backend_instance_id": worker}} if worker is not None else {}
    return client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=8, extra_body=extra,
        messages=[{"role": "user", "content": [image_part(image_url(colour, (40, 30))),
                                               {"type": "text", "text": QUESTION}]}])


async def _scenario(servers: dict[str, str], fe: DynamoRun, a: DynamoWorker, b: DynamoWorker) -> None:
    client = openai.OpenAI(base_url=fe.api_url, api_key="none", max_retries=0)
    (model,) = client.models.list().data
    assert model.model_extra["input_modalities"] == ["text", "image"]
    nc = await nats.connect(servers["NATS_SERVER"])
    decisions: list[dict[str, Any]] = []
    stored: dict[int, int] = {}

    async def on_event(msg: Any) -> None:
        for e in kv_events(msg.data):
            on_kv(e)

    def on_kv(e: dict[str, Any]) -> None:
        if isinstance(e.get("event", {}).get("data"), dict) and "stored" in e["event"]["data"]:
            stored[e["worker_id"]] = stored.get(e["worker_id"], 0) + 1

    async def on_decision(msg: Any) -> None:
        decisions.append(payload(msg.data))

    try:
        await nc.subscribe(EVENTS, cb=on_event)
        await nc.subscribe(nats_subject(MODEL, "kv-hit-rate"), cb=on_decision)
        await nc.flush()
        red = await asyncio.to_thread(_ask, client, "red", a.instance_id)
        green = await asyncio.to_thread(_ask, client, "green", b.instance_id)
        assert colours_named(red.choices[0].message.content) == ["red"]
        assert colours_named(green.choices[0].message.content) == ["green"]
        await until(lambda: stored.get(a.instance_id) and stored.get(b.instance_id), 10, "both workers' KV events")
        await frontend_caught_up(nc, fe, EVENTS)
        # three rounds: a router blind to the image would see a tie each time (both workers hold the same
        # token blocks) and pass all six by chance once in 64 runs
        for colour, worker, first in [("red", a, red), ("green", b, green)] * 3:
            decisions.clear()
            again = await asyncio.to_thread(_ask, client, colour)
            await until(lambda: decisions, 10, "the router's decision")
            (decision,) = decisions
            assert decision["worker_id"] == worker.instance_id, (colour, decision)
            assert again.choices[0].message.content == first.choices[0].message.content
            assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    finally:
        await nc.close()


def test_the_same_image_goes_back_to_the_worker_that_cached_it(gguf, colour_projector, servers, tmp_path):
    a = _worker(servers, gguf, colour_projector, tmp_path / "a.json")
    b = _worker(servers, gguf, colour_projector, tmp_path / "b.json")
    with workers_running([a, b]):
        with kv_frontend(servers, ready=read_kv_states(2), what="the frontend to read both workers' KV state") as fe:
            asyncio.run(_scenario(servers, fe, a, b))
