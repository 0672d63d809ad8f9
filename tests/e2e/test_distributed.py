"""Distributed serving end to end: a frontend (``in=http out=dyn``) and workers (``in=dyn://...``) as real
``dynamo-run`` processes, under each configuration of harness/dist_configs.py: etcd and nats-server
(the original's layout), and nothing started at all (the file discovery store, the TCP request plane,
the ZMQ event plane). The processes get the configuration through the environment only, so their
command lines are the documented ones.

The frontend and most workers are started once per configuration (the workers in parallel); each test
uses its own namespace and model name, so tests do not see each other's workers.  Which worker served a
request is read from the workers' logs: at debug level a worker logs ``request <id>`` for each request,
and the tests set the id with an ``x-request-id`` header.  Registrations are read and planted through
the runtime's own discovery clients (``DistConfig.keys`` / ``put`` / ``delete``).

The kill -9 test crashes its worker early in the module and the check that the crashed worker's keys
and instance are gone within the lease (``DYN_LEASE_TTL``) runs last, so the wait overlaps the other
tests.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from dynamo.runtime.file_v1 import STALE_AFTER
from harness.dist_configs import DistConfig
from harness.fleet import (
    WORKER_LOG,
    chat,
    client_for,
    health_instances,
    model_ids,
    request_id,
    served_by,
    stream_killing_its_worker,
    wait_for_model,
)
from harness.proc import DynamoRun, DynamoWorker, free_port, run_cli
from harness.servers import EtcdServer, NatsServer
from harness.wait import wait_until

pytestmark = pytest.mark.timeout(120)

DATA = Path(__file__).parent / "data"
LONG_PROMPT = " ".join(f"word{i}" for i in range(80))


# -- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rt_env(dist_config: DistConfig) -> dict[str, str]:
    return dist_config.env


@pytest.fixture(scope="module")
def frontend(rt_env) -> Iterator[DynamoRun]:
    with DynamoRun("out=dyn", env=rt_env) as fe:
        yield fe


class Fleet(dict):
    """name -> started worker; all stopped at the end of the module."""


@pytest.fixture(scope="module")
def fleet(rt_env, tiny_model: Path) -> Iterator[Fleet]:
    """The module's long-lived workers, started in parallel."""
    model = str(tiny_model)
    env = {**rt_env, **WORKER_LOG}
    specs: dict[str, tuple[list[str], float]] = {
        # data parallel: two instances of one endpoint (the brief's names)
        "rr1": (["in=dyn://test.backend.generate", "out=echo_core", model, "--model-name", "rr"], 1),
        "rr2": (["in=dyn://test.backend.generate", "out=echo_core", model, "--model-name", "rr"], 1),
        # one of these is killed -9
        "crash1": (["in=dyn://crash.backend.generate", "out=echo_core", model, "--model-name", "crash"], 1),
        "crash2": (["in=dyn://crash.backend.generate", "out=echo_core", model, "--model-name", "crash"], 1),
        # two pipelines; b's name is defaulted (dyn://test -> NS.test.E)
        "a": (["in=dyn://alpha.backend.generate", "out=echo_core", model, "--model-name", "a"], 1),
        "b": (["in=dyn://test", "out=echo_core", model, "--model-name", "b"], 1),
        # a full engine: registers as Chat
        "e": (["in=dyn://full.frontend.generate", "out=echo_full", "--model-name", "e"], 1),
        # migration: slow echo, two workers that allow 3 migrations, one that allows none
        "mig1": (["in=dyn://mig.backend.generate", "out=echo_core", model, "--model-name", "mig",
                  "--migration-limit", "3"], 50),
        "mig2": (["in=dyn://mig.backend.generate", "out=echo_core", model, "--model-name", "mig",
                  "--migration-limit", "3"], 50),
        "nomig": (["in=dyn://nomig.backend.generate", "out=echo_core", model, "--model-name", "nomig"], 50),
        # SIGTERM with a stream in flight
        "term": (["in=dyn://term.backend.generate", "out=echo_core", model, "--model-name", "term"], 30),
    }
    workers = Fleet()
    try:
        for name, (args, delay) in specs.items():
            workers[name] = DynamoWorker(*args, env=env, delay_ms=delay).start(wait=False)
        for w in workers.values():
            w.wait_ready()
        yield workers
    finally:
        for w in workers.values():
            w.kill()


@pytest.fixture(scope="module")
def etcd_nats() -> Iterator[dict[str, str]]:
    """etcd and nats-server of their own, for the tests of what happens when one is missing or lacking."""
    with EtcdServer() as etcd, NatsServer() as nats:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url}


# -- discovery, health, round-robin --------------------------------------------------------------------


@pytest.mark.slow
def test_two_workers_listed_and_healthy(frontend, fleet):
    rr = [fleet["rr1"], fleet["rr2"]]
    wait_for_model(frontend, "rr", "dyn://test.backend.generate", 2)
    assert health_instances(frontend, "dyn://test.backend.generate") == {w.instance_id for w in rr}
    assert all(w.ready_match["type"] == "Backend" for w in rr)
    health = httpx.get(frontend.base_url + "/health", timeout=5).json()
    assert health["status"] == "healthy" and "rr" in health["models"]


@pytest.mark.slow
def test_requests_spread_round_robin(frontend, fleet):
    rr = [fleet["rr1"], fleet["rr2"]]
    wait_for_model(frontend, "rr", "dyn://test.backend.generate", 2)
    client = client_for(frontend)
    order = []
    for i in range(8):
        rid = request_id(f"rr{i}")
        text, reason = chat(client, "rr", "Hello distributed world", stream=bool(i % 2), rid=rid)
        # echo_core echoes the templated prompt and stops at its first end-of-turn token
        assert text.startswith("<|im_start|>system") and reason == "stop", (text, reason)
        who = wait_until(lambda rid=rid: served_by(rr, rid), 5, f"a worker logging request {rid}")
        assert len(who) == 1
        order.append(rr.index(who[0]))
    assert sorted(order) == [0, 0, 0, 0, 1, 1, 1, 1], order
    assert all(order[i] != order[i + 1] for i in range(len(order) - 1)), f"not round-robin: {order}"


@pytest.mark.slow
def test_completions_through_frontend(frontend, fleet):
    wait_for_model(frontend, "rr", "dyn://test.backend.generate", 2)
    client = client_for(frontend)
    resp = client.completions.create(model="rr", prompt="one two three", max_tokens=50)
    assert resp.choices[0].text == "one two three"  # raw prompt (no template), echoed token by token
    chunks = list(client.completions.create(model="rr", prompt="four five", stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "four five"


def test_worker_status_server_counts_frontend_requests(frontend, rt_env, tiny_model):
    """A dynamo-run worker with DYN_SYSTEM_PORT: ready on /health, dynamo_component_* counts what it served."""
    env = {**rt_env, "DYN_SYSTEM_ENABLED": "true", "DYN_SYSTEM_PORT": "0", "DYN_SYSTEM_HOST": "127.0.0.1"}
    with DynamoWorker("in=dyn://sys.backend.generate", "out=echo_core", str(tiny_model), "--model-name", "sys",
                      env=env).start() as worker:
        port = worker.system_port()
        base = f"http://127.0.0.1:{port}"
        health = httpx.get(base + "/health", timeout=5)
        assert health.status_code == 200, worker.stderr_text()
        assert health.json()["endpoints"] == {"generate": "ready"}
        wait_for_model(frontend, "sys", "dyn://sys.backend.generate", 1)
        client = client_for(frontend)
        for _ in range(3):
            assert client.completions.create(model="sys", prompt="one two", max_tokens=5).choices[0].text == "one two"
        text = httpx.get(base + "/metrics", timeout=5).text
        labels = ('{dynamo_component="backend",dynamo_endpoint="generate",dynamo_namespace="sys",'
                  f'worker_id="{worker.instance_hex}"}}')
        assert f"dynamo_component_requests_total{labels} 3.0" in text
        assert f"dynamo_component_inflight_requests{labels} 0.0" in text
        assert f"dynamo_component_request_duration_seconds_count{labels} 3.0" in text
        assert f"dynamo_component_response_bytes_total{labels} 0.0" not in text


@pytest.mark.slow
def test_router_mode_random_uses_both_workers(rt_env, fleet):
    rr = [fleet["rr1"], fleet["rr2"]]
    with DynamoRun("out=dyn", "--router-mode", "random", env=rt_env) as fe:
        wait_for_model(fe, "rr", "dyn://test.backend.generate", 2)
        client = client_for(fe)
        rids = [request_id(f"rand{i}") for i in range(16)]
        for rid in rids:
            chat(client, "rr", "hi", stream=True, rid=rid)
        counts = [0, 0]
        for rid in rids:
            who = wait_until(lambda rid=rid: served_by(rr, rid), 5, f"a worker logging request {rid}")
            counts[rr.index(who[0])] += 1
    # all 16 on one worker has probability 2**-15
    assert counts[0] > 0 and counts[1] > 0, counts


# -- kill -9 ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crashed(frontend, fleet) -> dict[str, Any]:
    """crash1 killed -9 while crash2 keeps serving; records when (the lease check runs at the end)."""
    wait_for_model(frontend, "crash", "dyn://crash.backend.generate", 2)
    victim = fleet["crash1"]
    victim.kill()
    return {"victim": victim, "survivor": fleet["crash2"], "killed_at": time.monotonic()}


@pytest.mark.slow
def test_kill9_service_carries_on(frontend, crashed):
    client = client_for(frontend, timeout=10)
    survivor = crashed["survivor"]
    failures = []
    start = time.monotonic()
    for i in range(8):
        rid = request_id(f"crash{i}")
        try:
            text, reason = chat(client, "crash", "still there?", stream=bool(i % 2), rid=rid)
            assert reason == "stop" and text
            assert served_by([survivor], rid)
        except openai.APIError as e:
            failures.append(f"request {i}: {e}")
    assert not failures, failures
    assert time.monotonic() - start < 5, "requests after the crash were slow"
    # the transport saw the dead instance fail: it is no longer offered (at the latest after the lease)
    assert "crash" in model_ids(frontend)


# -- SIGTERM: deregister at once, finish in-flight work, exit 0; last worker gone -> 404 ----------------


@pytest.mark.slow
def test_sigterm_deregisters_finishes_stream_and_exits_zero(frontend, fleet, dist_config):
    worker = fleet["term"]
    wait_for_model(frontend, "term", "dyn://term.backend.generate", 1)
    lease = worker.instance_id
    keys = dist_config.keys("v1/mdc/term/")  # the worker's one model record, 1.x's, keyed by its instance
    assert keys and all(record["instance_id"] == lease for record, _ in keys.values())
    assert dist_config.keys("v1/instances/term/")

    client = client_for(frontend)
    stream = client.chat.completions.create(
        model="term", messages=[{"role": "user", "content": LONG_PROMPT}], stream=True, max_tokens=40,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    received = [first]
    for _ in range(3):
        received.append(next(chunks))
    worker.terminate()
    signalled = time.monotonic()
    # deregistered at once: the model entry and the instance key are gone, the frontend drops the model
    wait_until(lambda: not dist_config.keys("v1/mdc/term/") and not dist_config.keys("v1/instances/term/"),
               1.5, "the worker's keys to be deleted")
    wait_until(lambda: "term" not in model_ids(frontend), 1.5, "the model to leave /v1/models")
    # ... but the stream in flight finishes normally
    received.extend(chunks)
    reasons = [c.choices[0].finish_reason for c in received if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"], reasons
    text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
    assert text.startswith("<|im_start|>system")
    assert worker.wait(10) == 0, worker.stderr_text()
    assert time.monotonic() - signalled < 8

    # no worker serves it any more: a clear 404, quickly
    start = time.monotonic()
    with pytest.raises(openai.NotFoundError) as info:
        chat(client_for(frontend, timeout=10), "term", "anyone?", stream=False)
    assert time.monotonic() - start < 2
    assert info.value.code == "model_not_found"


@pytest.mark.slow
def test_model_entry_without_instances_gives_503(frontend, fleet, dist_config):
    """A model whose entry exists but with no live instance behind it: 503 quickly, not a hang."""
    wait_for_model(frontend, "a", "dyn://alpha.backend.generate", 1)
    (key, (record, _)), = dist_config.keys("v1/mdc/alpha/").items()
    ghost = dict(record, namespace="ghost", card_json=dict(record["card_json"], display_name="ghost"))
    ghost_key = "v1/mdc/ghost/backend/generate/1"
    dist_config.put(ghost_key, json.dumps(ghost))
    try:
        wait_until(lambda: "ghost" in model_ids(frontend), 5, "the ghost model to be listed")
        start = time.monotonic()
        resp = httpx.post(frontend.api_url + "/chat/completions", timeout=30, json={
            "model": "ghost", "messages": [{"role": "user", "content": "hi"}]})
        elapsed = time.monotonic() - start
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["message"]
        assert elapsed < 7, f"503 took {elapsed:.1f}s"
    finally:
        dist_config.delete(ghost_key)
    wait_until(lambda: "ghost" not in model_ids(frontend), 5, "the ghost model to be removed")


# -- two pipelines, defaulted names, full engines -------------------------------------------------------


@pytest.mark.slow
def test_two_models_on_one_frontend(frontend, fleet):
    wait_for_model(frontend, "a", "dyn://alpha.backend.generate", 1)
    wait_for_model(frontend, "b", "dyn://NS.test.E", 1)  # in=dyn://test: namespace and endpoint defaulted
    assert {"a", "b"} <= model_ids(frontend)
    assert health_instances(frontend, "dyn://alpha.backend.generate") == {fleet["a"].instance_id}
    assert health_instances(frontend, "dyn://NS.test.E") == {fleet["b"].instance_id}
    client = client_for(frontend)
    for model in ("a", "b"):
        rid = request_id(model)
        text, reason = chat(client, model, f"to {model}", stream=True, rid=rid, extra_body={"ignore_eos": True})
        assert f"to {model}" in text and reason == "stop"
        assert served_by([fleet["a"], fleet["b"]], rid) == [fleet[model]]


@pytest.mark.slow
def test_full_engine_worker_registers_as_chat(frontend, fleet, dist_config):
    wait_for_model(frontend, "e", "dyn://full.frontend.generate", 1)
    (record, _), = dist_config.keys("v1/mdc/full/").values()
    card = record["card_json"]
    assert card["dynamo_py"]["model_type"] == "Chat" and card["display_name"] == "e"
    assert record["instance_id"] == fleet["e"].instance_id
    client = client_for(frontend)
    text, reason = chat(client, "e", "echo me fully", stream=True)
    assert (text, reason) == ("echo me fully", "stop")
    text, reason = chat(client, "e", "and unary", stream=False)
    assert (text, reason) == ("and unary", "stop")
    resp = client.completions.create(model="e", prompt="a completion")
    assert resp.choices[0].text == "a completion"


# -- the seeds' Python worker --------------------------------------------------------------------------


@pytest.mark.slow
def test_seed_python_worker_served_by_frontend(frontend, rt_env, tiny_model, dist_config):
    """The seeds' Python worker (the runtime API, ``@dynamo_worker``), configured by the environment alone."""
    worker = DynamoWorker(str(tiny_model), command=[sys.executable, str(DATA / "seed_dyn_worker.py")],
                          env=rt_env, ready=None).start()
    try:
        wait_for_model(frontend, "tiny-chat", "dyn://namespace.component.endpoint", 1)
        (record, _), = dist_config.keys("v1/mdc/namespace/component/endpoint/").values()
        assert record["card_json"]["dynamo_py"]["model_type"] == "Backend"
        client = client_for(frontend)
        text, reason = chat(client, "tiny-chat", "seeds say hello", stream=True, extra_body={"ignore_eos": True})
        assert "seeds say hello" in text and reason == "stop"
        text, reason = chat(client, "tiny-chat", "unary too", stream=False, extra_body={"ignore_eos": True})
        assert "unary too" in text
        # without ignore_eos the frontend's post-processing stops at the template's first end of turn
        text, reason = chat(client, "tiny-chat", "zebra", stream=False)
        assert text.startswith("<|im_start|>system") and "zebra" not in text and reason == "stop"
        worker.terminate()
        assert worker.wait(10) == 0, worker.stderr_text()
        wait_until(lambda: "tiny-chat" not in model_ids(frontend), 2, "the model to go with its worker")
    finally:
        worker.kill()


# -- migration ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_migration_continues_stream_on_other_worker(frontend, fleet):
    workers = [fleet["mig1"], fleet["mig2"]]
    wait_for_model(frontend, "mig", "dyn://mig.backend.generate", 2)
    start = time.monotonic()
    events, victim, done = stream_killing_its_worker(frontend, "mig", LONG_PROMPT, workers, after_chunks=8,
                                                    rid=request_id("mig"))
    assert done
    assert not [e for e in events if "error" in e], events
    finishes = [e["choices"][0]["finish_reason"] for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert finishes == ["length"], finishes  # max_tokens=40 counted over both workers
    other = workers[1 - workers.index(victim)]
    rid_line = f"request {events[0]['id'].removeprefix('chatcmpl-')}"
    assert rid_line in other.stderr_text(), "the stream did not move to the other worker"
    assert time.monotonic() - start < 10


@pytest.mark.slow
def test_no_migration_gives_error_event_and_clean_end(frontend, fleet):
    wait_for_model(frontend, "nomig", "dyn://nomig.backend.generate", 1)
    events, victim, done = stream_killing_its_worker(frontend, "nomig", LONG_PROMPT, [fleet["nomig"]],
                                                    after_chunks=5, rid=request_id("nomig"))
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["message"], events
    assert "error" in events[-1]  # nothing after the error but [DONE]
    assert done, "the stream did not end cleanly with [DONE]"


# -- text and batch inputs in front of workers ----------------------------------------------------------


@pytest.fixture(scope="module")
def solo(tiny_model) -> Iterator[dict[str, str]]:
    """Separate servers with a single echo_full worker: in=text/batch out=dyn serve the first model found."""
    with EtcdServer() as etcd, NatsServer() as nats:
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url}
        with DynamoWorker("in=dyn://solo.backend.generate", "out=echo_full", "--model-name", "solo", env=env):
            yield env


@pytest.mark.slow
def test_text_input_against_worker(solo):
    result = run_cli(["in=text", "out=dyn"], input="hello over the network\nsecond turn\n", env=solo, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "hello over the network" in result.stdout and "second turn" in result.stdout


@pytest.mark.slow
def test_batch_input_against_worker(solo, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    texts = ["first prompt", "second prompt", "third prompt"]
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    result = run_cli([f"in=batch:{prompts}", "out=dyn"], env=solo, timeout=30)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "output.jsonl").read_text().splitlines()]
    assert sorted(r["response"] for r in records) == sorted(texts)
    assert all(r["finish_reason"] == "stop" for r in records)


# -- unreachable etcd / NATS ---------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["frontend", "worker"])
@pytest.mark.parametrize("down", ["etcd", "nats"])
def test_unreachable_server_is_one_clear_line(etcd_nats, tiny_model, role, down):
    port = free_port()
    env = dict(etcd_nats)
    if down == "etcd":
        env["ETCD_ENDPOINTS"] = f"http://127.0.0.1:{port}"
    else:  # asked for NATS (without a request plane named, no NATS means TCP and ZMQ instead)
        env["NATS_SERVER"] = f"nats://127.0.0.1:{port}"
        env["DYN_REQUEST_PLANE"] = "nats"
    args = (["in=http", "out=dyn", "--http-host", "127.0.0.1", "--http-port", str(free_port())] if role == "frontend"
            else ["in=dyn://down.backend.generate", "out=echo_core", str(tiny_model)])
    start = time.monotonic()
    result = run_cli(args, env=env, timeout=20)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 8, f"took {elapsed:.1f}s to give up"
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    naming = [line for line in lines if f"127.0.0.1:{port}" in line]
    assert len(naming) == 1, result.stderr
    assert len(lines) <= 2, result.stderr  # the error, at most one log line before it


def test_nats_without_jetstream_is_one_clear_line(etcd_nats, tiny_model):
    """The model card's tokenizer goes to the runtime's object store (JetStream on NATS): a worker on a
    nats-server started without ``-js`` stops with one line saying so, not a traceback."""
    with NatsServer(jetstream=False) as plain:
        env = dict(etcd_nats, NATS_SERVER=plain.url)
        result = run_cli(["in=dyn://nojs.backend.generate", "out=echo_core", str(tiny_model)], env=env, timeout=30)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "JetStream" in line]
    assert len(errors) == 1 and "nats-server -js" in errors[0], result.stderr


# -- last: the crashed worker's lease has expired --------------------------------------------------------


@pytest.mark.slow
def test_kill9_keys_and_instance_vanish_after_lease(frontend, crashed, dist_config):
    victim, survivor = crashed["victim"], crashed["survivor"]
    dead = victim.instance_hex
    # the records go with the lease: on etcd, and on the file store too (the lease's record lists its v1/ files,
    # removed by whoever finds it expired, long before 1.x's 10 s staleness)
    expiry = float(dist_config.env["DYN_LEASE_TTL"])
    assert expiry < STALE_AFTER
    remaining = expiry + 3 - (time.monotonic() - crashed["killed_at"])

    def gone() -> bool:
        keys = list(dist_config.keys("v1/instances/crash/")) + list(dist_config.keys("v1/mdc/crash/"))
        return not any(dead in k for k in keys)

    wait_until(gone, max(remaining, 0.5), "the crashed worker's keys to expire with its lease", interval=0.2)
    assert health_instances(frontend, "dyn://crash.backend.generate") == {survivor.instance_id}
    keys = dist_config.keys("v1/mdc/crash/")
    assert keys and all(record["instance_id"] == survivor.instance_id for record, _ in keys.values())
    assert "crash" in model_ids(frontend)
