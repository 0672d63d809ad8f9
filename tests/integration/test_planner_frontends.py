"""The planner finds its frontends through discovery (no ``--frontend-url``) on real etcd and NATS: two
frontends, load through either is seen; one killed with SIGKILL is left out and leaves discovery when its
lease expires; started again, it is found and read again.  Another namespace's load is not counted."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from typing import Iterator

import pytest

from dynamo.frontend.registration import FRONTENDS_PREFIX, FrontendEntry
from dynamo.runtime.distributed import DistributedRuntime
from harness.chat_load import ChatLoad
from harness.fleet import scrape
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.wait import wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

NS = "pf"
MODEL = "found-model"
OTHER = "elsewhere-model"
LEASE_TTL = "3"  # the frontends' lease: a SIGKILLed one leaves discovery within about 3 s


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with EtcdServer() as etcd, NatsServer() as nats_srv:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url}


def planner_metrics(port: int) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("quantity", "")): s.value
            for s in scrape(f"http://127.0.0.1:{port}/metrics", down_ok=True)}


def frontends_seen(port: int) -> float | None:
    return planner_metrics(port).get(("dynamo_planner_frontends", ""))


def intervals(port: int) -> float:
    return planner_metrics(port).get(("dynamo_planner_intervals_total", ""), 0.0)


def rate_seen(port: int) -> float:
    return planner_metrics(port).get(("dynamo_planner_observed_load", "request_rate"), 0.0)


def test_frontends_found_lost_and_found_again(servers, tiny_model, tmp_path):
    args = tmp_path / "mocker.json"
    args.write_text(json.dumps({"num_gpu_blocks": 256, "block_size": 16}))
    env = {**servers, "DYN_LEASE_TTL": LEASE_TTL}
    ours = DynamoWorker(f"in=dyn://{NS}.backend.generate", "out=mocker", str(tiny_model), "--model-name", MODEL,
                        "--extra-engine-args", str(args), env=env)
    theirs = DynamoWorker("in=dyn://otherns.backend.generate", "out=mocker", str(tiny_model), "--model-name", OTHER,
                          "--extra-engine-args", str(args), env=env)
    planner = DynamoWorker(
        "--namespace", NS, "--environment", "virtual", "--adjustment-interval", "1", "--metrics-port", "0",
        "--itl", "1000", "--ttft", "100000",
        command=[sys.executable, "-m", "dynamo.planner"], ready=r"planner for namespace", env=servers)
    fe1 = DynamoRun("out=dyn", env=env)
    fe2 = DynamoRun("out=dyn", env=env)
    with ours, theirs, fe1, fe2, planner:
        port = planner.logged_port(planner.PLANNER_METRICS)
        wait_until(lambda: frontends_seen(port) == 2, 20, "both frontends found in discovery")
        log = planner.stderr_text()
        assert f"frontend {fe1.base_url} found in discovery" in log and f"{fe2.base_url} found" in log

        # another namespace's load is not the planner's
        with ChatLoad(fe1.api_url, OTHER, n=2) as load:
            wait_until(lambda: load.ok >= 2, 30, "the other model's requests")
            start = intervals(port)
            wait_until(lambda: intervals(port) >= start + 3, 10, "three intervals under that load")
            assert rate_seen(port) == 0.0 and load.failed == []
        # load through the second frontend only is seen
        with ChatLoad(fe2.api_url, MODEL, n=2) as load:
            wait_until(lambda: rate_seen(port) > 0.5, 20, "the load through frontend 2")
        assert load.failed == []

        # the first frontend crashes: left out at once, out of discovery once its lease expires
        fe1.kill()
        wait_until(lambda: frontends_seen(port) == 1, 10, "the dead frontend left out")
        wait_until(lambda: f"frontend {fe1.base_url} left discovery" in planner.stderr_text(), 15,
                   "its lease expiring")
        assert len(re.findall(rf"frontend {re.escape(fe1.base_url)} did not answer", planner.stderr_text())) == 1

        # started again (same port): found again, and the load through it counts
        fe1.start()
        wait_until(lambda: frontends_seen(port) == 2, 20, "the frontend found again")
        with ChatLoad(fe1.api_url, MODEL, n=2) as load:
            wait_until(lambda: load.ok >= 4, 30, "requests through the restarted frontend")
            fe2.kill()  # only the restarted frontend is left to see the load
            wait_until(lambda: frontends_seen(port) == 1 and rate_seen(port) > 0.5, 20,
                       "the load through the restarted frontend")
        assert planner.running


def registered_frontends(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> list[FrontendEntry]:
    async def read() -> list[FrontendEntry]:
        runtime = await DistributedRuntime.connect()
        try:
            return [FrontendEntry.from_json(kv.value) for kv in await runtime.discovery().get_prefix(FRONTENDS_PREFIX)]
        finally:
            await runtime.close()

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return asyncio.run(read())


def test_each_http_worker_process_registers_and_a_clean_stop_deregisters(servers, monkeypatch):
    env = {**servers, "DYN_LEASE_TTL": "30"}  # a clean stop must not rely on the lease expiring
    before = {e.instance_id for e in registered_frontends(servers, monkeypatch)}
    with DynamoRun("out=dyn", "--http-workers", "2", env=env) as fe:
        def mine() -> list[FrontendEntry]:
            return [e for e in registered_frontends(servers, monkeypatch) if e.instance_id not in before]

        entries = wait_until(lambda: len(mine()) == 2 and mine(), 20, "both processes registered")
        assert {e.url for e in entries} == {fe.base_url} and {e.http_worker for e in entries} == {0, 1}
        assert {e.metrics_url for e in entries} == {fe.base_url + "/metrics"}
        assert fe.stop(timeout=15) == 0
    assert mine() == []
