"""The one TCP request wire (1.x's, runtime/v1_wire.py) between 1.6.1's real processes and ours, both ways.

* Our worker served to 1.6.1's own Python client (``dynamo.runtime``'s ``client.generate`` and ``direct``):
  its instance record is written by hand into 1.6.1's file store (``v1/instances``), as discovery will write
  it, with our worker's own address; a request without our client's mark gets 1.x's token items.
* Our client and our frontend's pipeline in front of 1.6.1's mocker: the instance built by hand from the
  mocker's own ``v1/instances`` file; our extras offered and ignored; a ping and a probe acked as taken;
  its token ids are detokenized by our pipeline; a consumer that leaves
  sends ``kill``; a mocker killed mid-stream is :class:`StreamIncompleteError` (what migration acts on);
  our fields in the one request are ignored by it, and what it would ignore wrongly is refused before sending.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from dynamo.engines.echo import EchoCoreEngine
from dynamo.llm.engine import Context
from dynamo.llm.model_card import ModelCard, load_hf_folder
from dynamo.llm.pipeline import CorePipeline
from dynamo.llm.protocols.common import PreprocessedRequest, StopConditions
from dynamo.llm.protocols.openai import parse_chat_request
from dynamo.runtime import DistributedRuntime, StreamIncompleteError
from dynamo.runtime.config import RuntimeSettings
from dynamo.runtime.instance import Instance
from dynamo.runtime.names import EndpointId, signed_id
from dynamo.runtime.probe import reachable
from dynamo.runtime.request_plane import NoResponders
from dynamo.runtime.transport import PING
from dynamo.runtime.v1_wire import v1_path
from dynamo.worker.handlers import backend_handler
from harness.dynamo1x import d16_env, d16_mocker, d16_python

D16_CLIENT = """
import asyncio, json, sys
from dynamo.runtime import DistributedRuntime

async def main():
    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    client = await rt.endpoint(sys.argv[1]).client()
    ids = await asyncio.wait_for(client.wait_for_instances(), 30)
    for how in ("generate", "direct"):
        stream = await (client.generate(json.loads(sys.argv[2])) if how == "generate"
                        else client.direct(json.loads(sys.argv[2]), ids[0]))
        async for item in stream:
            print(json.dumps({how: item.data()}), flush=True)
    rt.shutdown()

asyncio.run(main())
"""


def file_key(key: str) -> str:
    """1.6.1's file store names a key's file with every non-alphanumeric byte as %XX."""
    return "".join(c if c.isalnum() else f"%{ord(c):02X}" for c in key)


@pytest.fixture
async def our_runtime(tmp_path: Path):
    rt = await DistributedRuntime.connect(RuntimeSettings(discovery_backend="file", file_kv=str(tmp_path / "ours"),
                                                          request_plane="tcp", event_plane="zmq"))
    yield rt
    await rt.close()


async def test_d16_client_streams_from_our_core_worker(store: Path, our_runtime) -> None:
    ident = EndpointId("rp16", "backend", "generate")
    endpoint = our_runtime.namespace(ident.namespace).component(ident.component).endpoint(ident.name)
    card = ModelCard(display_name="echo")  # no tokenizer: a 1.x frontend detokenizes anyway
    ready = asyncio.Event()
    serving = asyncio.create_task(endpoint.serve_endpoint(backend_handler(card, EchoCoreEngine(delay=0)), ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    kv = await our_runtime.discovery().get(endpoint.instance_key)
    ours = Instance.from_json(kv.value)
    iid = our_runtime.instance_id & 0xFFFFFFFFFFFFFFFF
    assert ours.ours and ours.subject.partition("/")[2] == v1_path(iid, ident.namespace, ident.component, ident.name)
    # our worker's one record, extra field and all, copied into the 1.6.1 client's store as it is
    folder = store / "v1" / "instances"
    folder.mkdir(parents=True)
    path = folder / file_key(f"{ident.namespace}/{ident.component}/{ident.name}/{iid:x}")
    path.write_bytes(kv.value)

    async def keep_alive() -> None:  # 1.6.1 treats a record untouched for 10 s as gone
        while True:
            await asyncio.sleep(2)
            os.utime(path)

    toucher = asyncio.create_task(keep_alive())
    request = {"model": "echo", "token_ids": [11, 12, 13], "eos_token_ids": [],
               "stop_conditions": {"max_tokens": 8, "stop_token_ids_visible": [13], "max_thinking_tokens": None},
               "sampling_options": {}, "output_options": {}, "routing": {"dp_rank": 0}, "annotations": []}
    try:
        proc = await asyncio.create_subprocess_exec(
            str(d16_python()), "-c", D16_CLIENT, "rp16.backend.generate", json.dumps(request),
            env=d16_env(store), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        toucher.cancel()
        serving.cancel()
    lines = [json.loads(ln) for ln in out.decode().splitlines() if ln.startswith("{")]
    assert proc.returncode == 0, err.decode()[-3000:]
    for how in ("generate", "direct"):
        items = [ln[how] for ln in lines if how in ln]
        assert [i["token_ids"] for i in items] == [[11], [12], [13]], err.decode()[-3000:]
        assert items[-1]["finish_reason"] == "stop" and items[-1]["text"] is None  # 13: a visible stop id
        assert items[-1]["completion_usage"]["total_tokens"] == 6


@pytest.fixture
def d16_mocker_instance(tiny_chat_5k: Path, store: Path):
    """1.6.1's mocker (real time: 1.0 speed-up) and its instance as its v1/instances file says."""
    with d16_mocker(tiny_chat_5k, "dyn://m16.backend.generate", d16_env(store), store=store) as mocker:
        files = [p for p in (store / "v1" / "instances").iterdir() if "%2Fgenerate%2F" in p.name]
        record = json.loads(files[0].read_text())
        yield mocker, Instance("m16", "backend", "generate", record["instance_id"], record["transport"]["tcp"], ours=False)


async def our_client_of(rt: DistributedRuntime, instance: Instance):
    """Our client of the endpoint of a 1.6.1 worker whose record (as 1.6.1 wrote it) is copied into our store."""
    ident = EndpointId(instance.namespace, instance.component, instance.endpoint)
    await rt.discovery().put(ident.instance_key(instance.instance_id), instance.to_json(), lease=True)
    client = await rt.namespace(ident.namespace).component(ident.component).endpoint(ident.name).client()
    await client.wait_for_instances(10)
    return client


async def test_our_client_and_pipeline_in_front_of_d16_mocker(d16_mocker_instance, our_runtime,
                                                              tiny_chat_5k: Path) -> None:
    from dynamo.frontend.remote import RemoteCoreEngine, SimpleRouter

    mocker, instance = d16_mocker_instance
    client = await our_client_of(our_runtime, instance)
    request = PreprocessedRequest(token_ids=[1, 2, 3, 4, 5], model="tiny-chat",
                                  stop_conditions=StopConditions(max_tokens=4))
    # our client offers its extras (heartbeats, a multiplexed call-home) and marks its request: 1.6.1 ignores
    # them and streams per connection, which our client reads as it reads ours
    items = [x async for x in client.round_robin(request.to_dict())]
    assert [len(i["token_ids"]) for i in items] == [1, 1, 1, 1, 0] and items[-1]["finish_reason"] == "length"
    assert all(1000 <= t < 5000 for i in items for t in i["token_ids"])

    # a ping (an empty request) and a probe: 1.6.1 acks both as taken and answers neither, which counts
    assert await our_runtime.request_plane().send(instance.subject, PING, 5) == b""
    receiver = await our_runtime.response_streams().receiver()
    assert await reachable(our_runtime.request_plane(), receiver, instance.subject, instance.instance_id, 5)
    # a path it serves nothing under: 1.6.1's words, which our workers use too, read as "no responders"
    with pytest.raises(NoResponders, match="Server unavailable: unknown endpoint .*/m16/backend/nosuch"):
        await our_runtime.request_plane().send(instance.subject.rpartition("/")[0] + "/nosuch", PING, 5)

    # our frontend's pipeline: the remote engine asks for text, the mocker ignores that and sends token ids, and
    # the post-processor detokenizes them
    card = load_hf_folder(tiny_chat_5k)
    engine = RemoteCoreEngine(client, SimpleRouter("round-robin"))
    pipeline = CorePipeline("tiny-chat", card, engine)
    raw = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
           "stream": True, "stream_options": {"include_usage": True}}
    chunks = [c async for c in pipeline.chat(parse_chat_request(raw), raw, Context())]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text.count(" w") == 4, chunks
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}

    # a consumer that leaves: "kill" reaches the mocker, which cancels the request
    stream = client.round_robin(PreprocessedRequest(token_ids=[7, 8, 9], model="tiny-chat",
                                                    stop_conditions=StopConditions(max_tokens=2000)).to_dict())
    await stream.__anext__()
    await stream.aclose()
    await asyncio.sleep(1.0)
    mocker.stop()
    log = re.sub(r"\x1b\[[0-9;]*m", "", mocker.stderr_text())  # its log's colours off
    assert 'cancellation.signal="kill"' in log


async def test_d16_mocker_ignores_our_fields_and_what_it_would_ignore_wrongly_is_refused(d16_mocker_instance,
                                                                                        our_runtime) -> None:
    """Our one request, with every field of ours that 1.x has no place for set, reaches 1.6.1's mocker and is
    answered as the same request without them (serde skips the unknown fields); images and ``logit_bias``,
    which it would ignore and so answer differently, are refused by name before anything is sent."""
    from dynamo.errors import RequestError
    from dynamo.llm.protocols.common import ImageInput, OutputOptions, ResponseParsing, SamplingOptions
    from dynamo.llm.protocols.wire import PeerRequest

    mocker, instance = d16_mocker_instance
    client = await our_client_of(our_runtime, instance)

    def request(**ours) -> PreprocessedRequest:
        return PreprocessedRequest(token_ids=[1, 2, 3, 4, 5], model="tiny-chat",
                                   stop_conditions=StopConditions(max_tokens=3), **ours)

    with_ours = request(detokenize=True, parsing=ResponseParsing(tool_call_parser="hermes", reasoning_started=True),
                        prefix_source={"address": "127.0.0.1:1", "tokens": 4}, estimated_prefix_hit_num_blocks=2,
                        disaggregated_params={"ticket": "x"}, output_options=OutputOptions(stop_token_logprobs=True))
    for req in (request(), with_ours):
        items = [x async for x in client.round_robin(PeerRequest(req))]
        assert [len(i["token_ids"]) for i in items] == [1, 1, 1, 0] and items[-1]["finish_reason"] == "length"
        assert items[-1]["completion_usage"]["completion_tokens"] == 3 and items[0]["text"] is None
    for refused, named in ((request(multi_modal_data=[ImageInput(b"x", 1, 0, 1)]), "images"),
                           (request(sampling_options=SamplingOptions(logit_bias={"3": 1.0})), "logit_bias")):
        with pytest.raises(RequestError, match=named):
            async for _ in client.round_robin(PeerRequest(refused)):
                pass


async def test_d16_mocker_killed_mid_stream_is_an_incomplete_stream(d16_mocker_instance, our_runtime) -> None:
    mocker, instance = d16_mocker_instance
    client = await our_client_of(our_runtime, instance)
    stream = client.round_robin(PreprocessedRequest(token_ids=[1, 2, 3], model="tiny-chat",
                                                    stop_conditions=StopConditions(max_tokens=5000)).to_dict())
    await stream.__anext__()
    mocker.kill()
    with pytest.raises(StreamIncompleteError):
        async for _ in stream:
            pass



def generate_records(store: Path) -> dict[int, dict]:
    folder = store / "v1" / "instances"
    return {r["instance_id"]: r for r in (json.loads(p.read_text()) for p in folder.iterdir()
                                          if "%2Fgenerate%2F" in p.name)}


@asynccontextmanager
async def two_mockers(tiny_chat_5k: Path, store: Path, rt: DistributedRuntime, *flags: str):
    """Two 1.6.1 mockers at one endpoint, our client following both: (the client, the mocker round-robin sends
    the first request to, the engine routing round-robin with one migration allowed)."""
    from dynamo.frontend.remote import RemoteCoreEngine, SimpleRouter

    env = d16_env(store)
    with d16_mocker(tiny_chat_5k, "dyn://m16.backend.generate", env, *flags, store=store) as first:
        [first_id] = generate_records(store)
        with d16_mocker(tiny_chat_5k, "dyn://m16.backend.generate", env, *flags, store=store) as second:
            for _ in range(100):  # the second record may land a moment after the first's
                if len(generate_records(store)) == 2:
                    break
                await asyncio.sleep(0.1)
            records = generate_records(store)
            # our client keeps ids above i64's maximum negative, as it reads them from a record's key
            by_id = {signed_id(first_id): first, signed_id(next(i for i in records if i != first_id)): second}
            for record in records.values():
                client = await our_client_of(rt, Instance("m16", "backend", "generate", record["instance_id"],
                                                          record["transport"]["tcp"], ours=False))
            while len(client.instance_ids()) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            # round-robin's first pick is the lowest id
            yield by_id[min(client.instance_ids())], RemoteCoreEngine(client, SimpleRouter("round-robin"),
                                                                      migration_limit=1)


async def test_a_request_migrates_off_a_d16_mocker_killed_mid_stream(tiny_chat_5k: Path, store: Path,
                                                                     our_runtime) -> None:
    async with two_mockers(tiny_chat_5k, store, our_runtime) as (victim, engine):
        request = PreprocessedRequest(token_ids=[1, 2, 3], model="tiny-chat",
                                      stop_conditions=StopConditions(max_tokens=40))
        outs = []
        async for out in engine.generate(request, Context()):
            outs.append(out)
            if len(outs) == 1:
                victim.kill()  # -9 after the first token
        assert not victim.running
        assert sum(len(o.token_ids) for o in outs) == 40 and outs[-1].finish_reason == "length"


async def test_a_request_migrates_off_a_d16_mocker_frozen_mid_stream(tiny_chat_5k: Path, store: Path,
                                                                    tmp_path: Path) -> None:
    """A 1.x worker sends no heartbeats, and a stopped process's kernel keeps its sockets open: without a
    bound the stream would wait for ever. Silent past DYN_STREAM_SILENCE_1X_S after its first token, it is
    treated as dead, and the request goes on on the other mocker with its tokens so far."""
    rt = await DistributedRuntime.connect(RuntimeSettings(discovery_backend="file", file_kv=str(tmp_path / "ours"),
                                                          request_plane="tcp", event_plane="zmq",
                                                          stream_silence_1x=2.0))
    try:
        async with two_mockers(tiny_chat_5k, store, rt, "--speedup-ratio", "0.2") as (victim, engine):
            request = PreprocessedRequest(token_ids=[1, 2, 3], model="tiny-chat",
                                          stop_conditions=StopConditions(max_tokens=30))
            outs = []
            loop = asyncio.get_running_loop()
            frozen_at = None
            try:
                async with asyncio.timeout(60):
                    async for out in engine.generate(request, Context()):
                        outs.append(out)
                        if len(outs) == 2:
                            victim.proc.send_signal(signal.SIGSTOP)
                            frozen_at = loop.time()
            finally:
                victim.proc.send_signal(signal.SIGCONT)
            assert frozen_at is not None and loop.time() - frozen_at >= 2.0  # no sooner than the bound
            assert sum(len(o.token_ids) for o in outs) == 30 and outs[-1].finish_reason == "length"
    finally:
        await rt.close()
