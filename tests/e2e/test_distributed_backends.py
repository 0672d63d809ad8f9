"""The distributed essentials under every configuration (harness/dist_configs.py: etcd+nats, file+tcp+zmq):
workers found and served (mocker and echo engines), round-robin, a stream migrated after kill -9, a
killed worker's registration gone within the lease; and, for the file store, what it tells the user."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from harness.dist_configs import DistConfig
from harness.fleet import WORKER_LOG, chat, client_for, health_instances, request_id, served_by, wait_for_model
from harness.proc import DynamoRun, DynamoWorker, free_port, run_cli
from harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LONG_PROMPT = " ".join(f"word{i}" for i in range(80))


@pytest.fixture(scope="module")
def fleet(dist_config: DistConfig, tiny_model: Path) -> Iterator[dict[str, DynamoWorker]]:
    model, flags = str(tiny_model), dist_config.flags
    env = {**dist_config.env, **WORKER_LOG}
    specs = {
        "mock": (["in=dyn://mockns.backend.generate", "out=mocker", model, "--model-name", "mock"], 0),
        "rr1": (["in=dyn://rrns.backend.generate", "out=echo_core", model, "--model-name", "rr"], 1),
        "rr2": (["in=dyn://rrns.backend.generate", "out=echo_core", model, "--model-name", "rr"], 1),
        "mig1": (["in=dyn://migns.backend.generate", "out=echo_core", model, "--model-name", "mig",
                  "--migration-limit", "3"], 50),
        "mig2": (["in=dyn://migns.backend.generate", "out=echo_core", model, "--model-name", "mig",
                  "--migration-limit", "3"], 50),
        "crash": (["in=dyn://crashns.backend.generate", "out=echo_core", model, "--model-name", "crash"], 1),
    }
    workers: dict[str, DynamoWorker] = {}
    try:
        for name, (args, delay) in specs.items():
            workers[name] = DynamoWorker(*args, *flags, env=env, delay_ms=delay).start(wait=False)
        for w in workers.values():
            w.wait_ready(60)
        yield workers
    finally:
        for w in workers.values():
            w.kill()


@pytest.fixture(scope="module")
def frontend(dist_config: DistConfig, fleet) -> Iterator[DynamoRun]:
    with DynamoRun("out=dyn", *dist_config.flags, env=dist_config.env) as fe:
        yield fe


def test_workers_found_and_mocker_answers(frontend, fleet, dist_config):
    wait_for_model(frontend, "mock", "dyn://mockns.backend.generate", 1)
    wait_for_model(frontend, "rr", "dyn://rrns.backend.generate", 2)
    text, reason = chat(client_for(frontend), "mock", "Hello there", stream=True, max_tokens=8)
    assert text and reason in ("length", "stop")
    text, reason = chat(client_for(frontend), "mock", "Hello again", stream=False, max_tokens=8)
    assert text and reason in ("length", "stop")
    # the choice is logged once, with its reason
    lines = [line for line in frontend.stderr_text().splitlines() if "runtime.distributed: discovery " in line]
    assert len(lines) == 1 and f"discovery {dist_config.discovery} (" in lines[0] and "as asked" in lines[0], lines


def test_requests_spread_round_robin(frontend, fleet):
    rr = [fleet["rr1"], fleet["rr2"]]
    wait_for_model(frontend, "rr", "dyn://rrns.backend.generate", 2)
    client = client_for(frontend)
    order = []
    for i in range(6):
        rid = request_id(f"rr{i}")
        text, reason = chat(client, "rr", "Hello distributed world", stream=bool(i % 2), rid=rid)
        assert reason == "stop" and text
        who = wait_until(lambda: served_by(rr, rid), 5, f"a worker logging request {rid}")
        order.append(rr.index(who[0]))
    assert sorted(order) == [0, 0, 0, 1, 1, 1] and all(order[i] != order[i + 1] for i in range(5)), order


def test_migration_after_kill9(frontend, fleet):
    workers = [fleet["mig1"], fleet["mig2"]]
    wait_for_model(frontend, "mig", "dyn://migns.backend.generate", 2)
    rid = request_id("mig")
    body = {"model": "mig", "messages": [{"role": "user", "content": LONG_PROMPT}], "stream": True,
            "max_tokens": 40, "ignore_eos": True}
    events: list[dict] = []
    victim, done = None, False
    with httpx.stream("POST", frontend.api_url + "/chat/completions", json=body, timeout=30,
                      headers={"x-request-id": rid}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            events.append(json.loads(line[6:]))
            content = [e for e in events if e.get("choices") and e["choices"][0]["delta"].get("content")]
            if victim is None and len(content) >= 8:
                victim = wait_until(lambda: served_by(workers, rid), 2, f"the worker serving {rid}")[0]
                victim.kill()
    assert victim is not None and done
    assert not [e for e in events if "error" in e], events
    finishes = [e["choices"][0]["finish_reason"] for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert finishes == ["length"]
    other = workers[1 - workers.index(victim)]
    assert f"request {rid}" in other.stderr_text(), "the stream did not move to the other worker"


def test_kill9_registration_gone_within_the_lease(frontend, fleet, dist_config):
    wait_for_model(frontend, "crash", "dyn://crashns.backend.generate", 1)
    fleet["crash"].kill()
    killed = time.monotonic()
    ttl = float(dist_config.env["DYN_LEASE_TTL"])
    wait_until(lambda: not health_instances(frontend, "dyn://crashns.backend.generate"), ttl + 5,
               "the killed worker to leave the frontend's instances", interval=0.1)
    assert time.monotonic() - killed < ttl + 5
    if dist_config.file_kv is not None:  # and its files are gone from the store (the frontend cleans up)
        keys_dir = dist_config.file_kv / "kv"
        wait_until(lambda: not any("crashns" in p.name for p in keys_dir.iterdir()), 5,
                   "the killed worker's key files to be cleaned up")


def test_nats_asked_and_absent_is_one_clear_line(tmp_path, tiny_model):
    """Nothing needs NATS by default, but a NATS plane asked for and not there is one line, no traceback."""
    env = {"DYN_FILE_KV": str(tmp_path), "NATS_SERVER": f"nats://127.0.0.1:{free_port()}"}
    r = run_cli(["in=dyn://nonats.backend.generate", "out=echo_core", str(tiny_model), "--discovery-backend", "file",
                 "--request-plane", "nats"], env=env, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "cannot reach NATS at nats://127.0.0.1:" in r.stderr, r.stderr


def test_bad_discovery_backend_is_one_line(tiny_model):
    r = run_cli(["in=dyn://x.y.z", "out=echo_core", str(tiny_model)], env={"DYN_DISCOVERY_BACKEND": "zookeeper"},
                timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "DYN_DISCOVERY_BACKEND='zookeeper'" in r.stderr, r.stderr
    r = run_cli(["in=text", "out=echo_core", str(tiny_model), "--discovery-backend", "file"], timeout=60)
    assert r.returncode != 0 and "--discovery-backend is for the distributed runtime" in r.stderr, r.stderr
