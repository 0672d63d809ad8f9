"""What a KV-routed fleet does while etcd is down, under both etcd configurations (harness/dist_configs.py:
NATS planes, or the TCP request plane and the ZMQ event plane with no NATS server at all).

Real processes: etcd, two ``mocker`` workers (which publish KV events), a frontend with ``--router-mode kv``
writing its decisions to ``DYN_ROUTER_LOG``. etcd is killed with SIGKILL and the tests check, in file
order on one fleet per configuration:

* with etcd down, the workers' KV events still reach the frontend on the event plane (a ``stored`` line
  in the decision log after the kill) and a repeated prefix goes to the worker that holds it, with its
  overlap seen; a stream in flight when etcd dies ends normally;
* a worker killed with SIGKILL while etcd is down costs no request (the frontend stops sending it work
  once a request to it fails); a worker started while etcd is down refuses to start with one line;
* etcd back with its data: the surviving worker's keys are back under its lease, the killed worker's
  lease expires so that its keys and its place on the frontend go, and a new worker is discovered and
  served.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from harness.dist_configs import ETCD_CONFIGS, DistConfig, dist_config
from harness.fleet import WORKER_LOG, chat, client_for, health_instances, request_id, served_by, wait_for_model
from harness.proc import DynamoRun, DynamoWorker, run_cli
from harness.wait import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

LEASE_TTL = 2
ENDPOINT = "dyn://kvchaos.mocker.generate"
MODEL = "kvchaos"
MOCKER_ARGS = {"num_gpu_blocks": 512, "block_size": 16, "speedup_ratio": 20.0}
PREFIX = " ".join(f"block{i}" for i in range(200))


@pytest.fixture(scope="module", params=ETCD_CONFIGS)
def config(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DistConfig]:
    with dist_config(request.param, tmp_path_factory.mktemp("config"), lease_ttl=LEASE_TTL) as cfg:
        yield cfg


@pytest.fixture(scope="module")
def fleet(config: DistConfig, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("kvchaos")
    (folder / "mocker.json").write_text(json.dumps(MOCKER_ARGS))
    decisions = folder / "decisions.jsonl"

    def worker() -> DynamoWorker:
        return DynamoWorker(f"in={ENDPOINT}", "out=mocker", str(tiny_model), "--model-name", MODEL,
                            "--extra-engine-args", str(folder / "mocker.json"), *config.flags,
                            env={**config.env, **WORKER_LOG})

    workers = [worker().start(wait=False) for _ in range(2)]
    frontend = DynamoRun("out=dyn", "--router-mode", "kv", *config.flags,
                         env={**config.env, "DYN_ROUTER_LOG": str(decisions)})
    state: dict[str, Any] = {"workers": workers, "frontend": frontend, "decisions": decisions, "new_worker": worker,
                             "killed": None}
    try:
        for w in workers:
            w.wait_ready(60)
        frontend.start()
        wait_for_model(frontend, MODEL, ENDPOINT, 2)
        yield state
    finally:
        for proc in (frontend, *state["workers"], *([state["killed"]] if state["killed"] else [])):
            proc.kill()
        if config.etcd is not None and not config.etcd.running:
            config.etcd.restart()  # the config's own clean-up talks to nothing, but leave it as found


def decisions(log: Path, ev: str) -> list[dict[str, Any]]:
    try:
        lines = [json.loads(x) for x in log.read_text().splitlines()]
    except (OSError, ValueError):  # not there yet, or a line being written
        return []
    return [x for x in lines if x["ev"] == ev]


def route_of(log: Path, rid: str) -> dict[str, Any]:
    """The routing decision of request ``rid``, once the log has it (it is flushed every half second)."""
    return wait_until(lambda: next((d for d in decisions(log, "route") if rid in d["id"]), None), 5,
                      f"the decision on {rid} in the log")


def instance_keys(config: DistConfig) -> dict[str, int]:
    """``{instance key: lease}`` of the endpoint, read through the runtime's own etcd client."""
    return {k: lease for k, (_, lease) in config.keys("v1/instances/kvchaos/mocker/generate/").items()}


def test_kv_events_and_prefix_routing_go_on_with_etcd_down(config, fleet):
    frontend, workers, log = fleet["frontend"], fleet["workers"], fleet["decisions"]
    client = client_for(frontend)
    assert config.etcd is not None
    # a stream in flight when etcd dies finishes (the mocker at 20x speed: 400 tokens take a while)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long one"}],
                                            stream=True, max_tokens=400)
    first = next(iter(stream))
    config.etcd.crash()
    parts = [c.choices[0].delta.content or "" for c in [first, *stream] if c.choices]
    assert len("".join(parts)) > 0 and not config.etcd.running

    stored_before = len(decisions(log, "stored"))
    rid = request_id("kv-first")
    text, _ = chat(client, MODEL, PREFIX + " first", stream=False, rid=rid, max_tokens=4)
    assert text
    (holder,) = wait_until(lambda: served_by(workers, rid), 5, "the worker of the first request")
    # its KV events came over the event plane with etcd down
    wait_until(lambda: len(decisions(log, "stored")) > stored_before, 10, "the first request's KV events")
    rid = request_id("kv-again")
    chat(client, MODEL, PREFIX + " again", stream=False, rid=rid, max_tokens=4)
    assert served_by(workers, rid) == [holder]
    again = route_of(log, rid)
    assert again["worker"] == holder.instance_hex
    assert again["candidates"][again["worker"]]["overlap"] > 0, again
    fleet["holder"] = holder


def test_worker_killed_and_worker_started_while_etcd_is_down(config, fleet, tiny_model):
    frontend, workers = fleet["frontend"], fleet["workers"]
    assert config.etcd is not None and not config.etcd.running
    victim = next(w for w in workers if w is not fleet["holder"])
    victim.kill()
    workers.remove(victim)
    fleet["killed"] = victim
    client = client_for(frontend)
    # no etcd to say it went: the frontend finds out from the request plane, and no request fails
    for i in range(12):
        rid = request_id(f"after-kill-{i}")
        text, _ = chat(client, MODEL, f"question {i} " + "x " * (i * 20), stream=bool(i % 2), rid=rid, max_tokens=4)
        assert text
        assert served_by(workers, rid) == workers
    # a worker cannot register without etcd: it says so in one line and exits
    r = run_cli([f"in={ENDPOINT}", "out=mocker", str(tiny_model), "--model-name", MODEL, *config.flags],
                env=config.env, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "etcd" in r.stderr.strip().splitlines()[-1], r.stderr[-3000:]


def test_after_etcd_returns_the_dead_worker_goes_and_a_new_one_comes(config, fleet):
    frontend, workers, victim = fleet["frontend"], fleet["workers"], fleet["killed"]
    assert config.etcd is not None
    config.etcd.restart(wipe=False)
    back = time.monotonic()
    survivor_key = f"v1/instances/kvchaos/mocker/generate/{workers[0].instance_hex}"
    victim_key = f"v1/instances/kvchaos/mocker/generate/{victim.instance_hex}"
    # the survivor's lease was kept alive again; the victim's, with nobody to keep it, expires
    wait_until(lambda: victim_key not in (keys := instance_keys(config)) and keys.get(survivor_key)
               == workers[0].instance_id, LEASE_TTL + 15, "the dead worker's key gone, the live one's kept")
    wait_until(lambda: health_instances(frontend, ENDPOINT) == {workers[0].instance_id}, 10,
               "the frontend to list the live worker only")
    print(f"\nFIGURES {config.name}: dead worker dropped {time.monotonic() - back:.1f}s after etcd returned")
    new = fleet["new_worker"]().start()
    workers.append(new)
    wait_until(lambda: health_instances(frontend, ENDPOINT) == {w.instance_id for w in workers}, 15,
               "the new worker on the frontend")
    # the router weighs the new worker (it hears of it from discovery) and sends it work: prompts that share
    # no block with anything cached (completions, no template) go to the least loaded, cold worker
    client = client_for(frontend)
    seen: set[int] = set()
    for i in range(20):
        rid = request_id(f"after-return-{i}")
        client.completions.create(model=MODEL, prompt=f"{rid} " + "z " * 40, max_tokens=4,
                                  extra_headers={"x-request-id": rid})
        seen.update(w.instance_id for w in served_by(workers, rid))
        if new.instance_id in seen:
            break
    assert new.instance_id in seen, "the new worker never got a request"
    assert set(route_of(fleet["decisions"], rid)["candidates"]) == {w.instance_hex for w in workers}
    for w in workers:
        assert w.running, w.stderr_text()[-3000:]
    assert frontend.running, frontend.stderr_text()[-3000:]
