"""What the configurations (harness/dist_configs.py: etcd+nats, file+tcp+zmq) add to the distributed suite
(test_distributed.py runs the rest under both): KV routing on the mocker's KV events, heard by two
frontends (the second one started after the events were published, so it catches up from the workers'
recovery endpoint), a killed worker's registration gone within the lease and its files cleaned up, and what
the processes say about their choices."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from harness.dist_configs import DistConfig
from harness.fleet import WORKER_LOG, chat, client_for, health_instances, request_id, served_by, wait_for_model
from harness.proc import DynamoRun, DynamoWorker, free_port, run_cli
from harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MOCKER_ARGS = {"num_gpu_blocks": 512, "block_size": 16, "speedup_ratio": 20.0}


@pytest.fixture(scope="module")
def fleet(dist_config: DistConfig, tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DynamoWorker]]:
    model, flags = str(tiny_model), dist_config.flags
    mocker_args = tmp_path_factory.mktemp("mocker") / "mocker.json"
    mocker_args.write_text(json.dumps(MOCKER_ARGS))
    env = {**dist_config.env, **WORKER_LOG}
    specs = {
        "mock": (["in=dyn://mockns.backend.generate", "out=mocker", model, "--model-name", "mock"], 0),
        "kv1": (["in=dyn://kvns.mocker.generate", "out=mocker", model, "--model-name", "kv",
                 "--extra-engine-args", str(mocker_args)], 0),
        "kv2": (["in=dyn://kvns.mocker.generate", "out=mocker", model, "--model-name", "kv",
                 "--extra-engine-args", str(mocker_args)], 0),
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
    text, reason = chat(client_for(frontend), "mock", "Hello there", stream=True, max_tokens=8)
    assert text and reason in ("length", "stop")
    text, reason = chat(client_for(frontend), "mock", "Hello again", stream=False, max_tokens=8)
    assert text and reason in ("length", "stop")
    # the choice is logged once, with its reason
    lines = [line for line in frontend.stderr_text().splitlines() if "runtime.distributed: discovery " in line]
    assert len(lines) == 1 and f"discovery {dist_config.discovery} (" in lines[0] and "as asked" in lines[0], lines


def logged(log: Path, ev: str) -> list[dict[str, Any]]:
    """The lines of kind ``ev`` in a decision log (DYN_ROUTER_LOG) so far."""
    try:
        lines = [json.loads(x) for x in log.read_text().splitlines()]
    except (OSError, ValueError):  # not there yet, or a line being written
        return []
    return [x for x in lines if x["ev"] == ev]


def routes(log: Path, n: int) -> list[dict[str, Any]] | None:
    """The first ``n`` routing decisions, once there are ``n``."""
    found = logged(log, "route")
    return found[:n] if len(found) >= n else None


def stored(log: Path) -> bool:
    return bool(logged(log, "stored"))


def test_kv_routing_on_the_workers_events_from_two_frontends(dist_config, fleet, tmp_path):
    """A repeated prefix goes to the worker that holds it: the router knew (overlap), from KV events on
    this configuration's event plane; a frontend started afterwards knows it too."""
    kv = [fleet["kv1"], fleet["kv2"]]
    prefix = " ".join(f"block{i}" for i in range(200))
    logs = [tmp_path / "fe1.jsonl", tmp_path / "fe2.jsonl"]

    def kv_frontend(log: Path) -> DynamoRun:
        fe = DynamoRun("out=dyn", "--router-mode", "kv", *dist_config.flags,
                       env={**dist_config.env, "DYN_ROUTER_LOG": str(log)}).start()
        wait_for_model(fe, "kv", "dyn://kvns.mocker.generate", 2)
        return fe

    fe1 = kv_frontend(logs[0])
    try:
        rid = request_id("kv-first")
        chat(client_for(fe1), "kv", prefix + " first", stream=False, rid=rid, max_tokens=4)
        holder = wait_until(lambda: served_by(kv, rid), 5, "the worker of the first request")[0]
        rid = request_id("kv-again")
        wait_until(lambda: stored(logs[0]), 10, "the first request's KV events on frontend 1")
        chat(client_for(fe1), "kv", prefix + " again", stream=False, rid=rid, max_tokens=4)
        assert served_by(kv, rid) == [holder]
        first, again = wait_until(lambda: routes(logs[0], 2), 5, "two decisions on frontend 1")
        assert again["worker"] == f"{holder.instance_id:x}"
        assert first["candidates"][again["worker"]]["overlap"] == 0 < again["candidates"][again["worker"]]["overlap"]
        fe2 = kv_frontend(logs[1])  # joins after the events: catches up from the workers' recovery endpoints
        try:
            rid = request_id("kv-late")
            chat(client_for(fe2), "kv", prefix + " late", stream=False, rid=rid, max_tokens=4)
            assert served_by(kv, rid) == [holder]
            (late,) = wait_until(lambda: routes(logs[1], 1), 5, "the decision on frontend 2")
            assert late["worker"] == again["worker"] and late["candidates"][late["worker"]]["overlap"] > 0
        finally:
            fe2.stop()
    finally:
        fe1.stop()


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
