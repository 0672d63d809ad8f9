"""The planner through etcd outages, under both etcd configurations (harness/dist_configs.py: NATS planes,
or TCP + ZMQ with no NATS server): ``dynamo-planner --environment local`` running mocker workers, one
frontend it finds in discovery (no ``--frontend-url``), load on all the while.

The ITL target (1 ms) is under what any mocker gives, so under load the planner wants its budget (2
workers) and, with ``--scale-down-after 2``, would drain one within two intervals of seeing no load: an
outage that blinded it (no frontend, no models) would show as a drain. etcd is killed with SIGKILL for
longer than the lease TTL, brought back with its data, then killed again and brought back wiped (every
registration, the frontend's ``frontends/<lease>`` included, must be written again). Through both the
planner must keep running, keep the same two worker processes (no start, no drain), keep deciding, and
read the frontend again once etcd is back.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from harness.chat_load import ChatLoad
from harness.dist_configs import ETCD_CONFIGS, DistConfig, dist_config
from harness.fleet import health_instances, mocker_worker_cmd, scrape
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

NS = "planchaos"
MODEL = "planchaos-model"
ENDPOINT = f"dyn://{NS}.backend.generate"
LEASE_TTL = 2
OUTAGE_S = 5.0


@pytest.fixture(scope="module", params=ETCD_CONFIGS)
def config(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DistConfig]:
    with dist_config(request.param, tmp_path_factory.mktemp("config"), lease_ttl=LEASE_TTL) as cfg:
        yield cfg


def planner_metrics(port: int) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("quantity", "") or s.labels.get("state", "")): s.value
            for s in scrape(f"http://127.0.0.1:{port}/metrics", down_ok=True)}


def intervals(port: int) -> float:
    return planner_metrics(port).get(("dynamo_planner_intervals_total", ""), 0.0)


def fleet_pids(state: Path) -> list[int]:
    try:
        return sorted(w["pid"] for w in json.loads((state / f"local-{NS}.json").read_text())["workers"])
    except (OSError, ValueError):
        return []


def frontend_keys(config: DistConfig) -> dict[str, Any]:
    return {k: value for k, (value, _) in config.keys("frontends/").items()}


def sees_load_through(port: int, fe: DynamoRun, after: float) -> bool:
    """The planner has read the frontend (found in discovery) and seen its load, in an interval after ``after``."""
    m = planner_metrics(port)
    return (m.get(("dynamo_planner_intervals_total", ""), 0.0) > after
            and m.get(("dynamo_planner_frontends", ""), 0.0) == 1.0
            and m.get(("dynamo_planner_observed_load", "request_rate"), 0.0) > 0.0)


def test_planner_keeps_its_workers_and_resumes_observing_through_etcd_restarts(config, tiny_model, tmp_path):
    assert config.etcd is not None
    etcd = config.etcd
    state = tmp_path / "state"
    cmd = mocker_worker_cmd(tmp_path, tiny_model, f"{NS}.backend.generate", MODEL,
                            {"num_gpu_blocks": 256, "block_size": 16, "speedup_ratio": 5.0})
    env = {**config.env, "DYN_LOG": "info"}
    frontend = DynamoRun("out=dyn", *config.flags, env=env).start()
    planner = DynamoWorker(
        "--namespace", NS, "--adjustment-interval", "1", "--itl", "1", "--ttft", "100000", "--min-endpoint", "1",
        "--max-workers", "2", "--scale-down-after", "2", "--decode-cmd", f"{cmd} {' '.join(config.flags)}",
        "--state-dir", str(state), "--log-dir", str(tmp_path / "logs"), "--metrics-port", "0",
        "--discovery-backend", "etcd", "--stop-workers-on-exit",
        command=[sys.executable, "-m", "dynamo.planner"], ready=r"planner for namespace", env=env)
    try:
        planner.start()
        port = planner.logged_port(planner.PLANNER_METRICS)
        wait_until(lambda: len(health_instances(frontend, ENDPOINT)) == 1, 90, "the first worker serving")
        with ChatLoad(frontend.api_url, MODEL, n=3, max_tokens=20) as load:
            # under load, over the ITL target: the budget, two workers, both serving
            wait_until(lambda: len(health_instances(frontend, ENDPOINT)) == 2, 90, "two workers serving")
            wait_until(lambda: sees_load_through(port, frontend, 0), 20, "the planner reading the frontend")
            pids = fleet_pids(state)
            assert len(pids) == 2, planner.stderr_text()[-3000:]
            fe_key = wait_until(lambda: list(frontend_keys(config)), 10, "the frontend registered")

            for wipe in (False, True):
                etcd.crash()
                down = time.monotonic()
                start = intervals(port)
                # it goes on deciding with etcd down (at least three intervals), and changes nothing
                wait_until(lambda start=start: intervals(port) >= start + 3, 15, "intervals with etcd down")
                time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down)))  # outlive every lease
                assert planner.running, planner.stderr_text()[-3000:]
                etcd.restart(wipe=wipe)
                back = intervals(port)
                # the frontend's registration is there again (re-written after a wipe) and the planner reads it
                wait_until(lambda: list(frontend_keys(config)) == fe_key, 15, "the frontend's key back")
                wait_until(lambda back=back: sees_load_through(port, frontend, back + 1), 20,
                           "the planner reading the frontend after etcd's return")
                wait_until(lambda: len(health_instances(frontend, ENDPOINT)) == 2, 15, "both workers on the frontend")
                assert fleet_pids(state) == pids, planner.stderr_text()[-4000:]
            assert load.failed == [], load.failed[:5]
        log = planner.stderr_text()
        assert log.count("started decode worker") == 2, log[-4000:]
        assert "draining" not in log and "replacing it" not in log and "Traceback" not in log, log[-4000:]
        assert "planner interval failed" not in log, log[-4000:]
        # each outage said once where it began (the models already seen still count) and once where it ended
        assert log.count(f"cannot list the models of namespace {NS}") == 2, log[-4000:]
        assert log.count(f"the models of namespace {NS} listed again") == 2, log[-4000:]
    finally:
        planner.stop()
        frontend.kill()


async def test_namespace_models_carry_through_an_outage_and_none_known_skips_the_interval(config, caplog):
    """In process, on the same real etcd: the models a planner listed still count while etcd is down; a
    planner that never listed them skips its intervals (no "no load" read, which would drain the fleet);
    both list again once etcd is back."""
    from dynamo.llm.model_entry import ModelEntry
    from dynamo.llm.model_type import ModelType
    from dynamo.llm.v1_card import record_of
    from dynamo.planner.frontends import NamespaceModels
    from dynamo.planner.observe import ObservationUnavailable
    from dynamo.runtime.config import EtcdSettings
    from dynamo.runtime.etcd import EtcdClient

    etcd = config.etcd
    assert etcd is not None
    store = EtcdClient(EtcdSettings([etcd.url]))
    await store.connect()
    try:
        entry = ModelEntry(name="Listed-Model", namespace="nsm", component="backend", endpoint="generate",
                           model_type=ModelType.Backend, instance_id=0x1234, card={})
        await store.put(entry.key(), record_of(entry))
        seen, never = NamespaceModels(store, "nsm"), NamespaceModels(store, "nsm")
        assert await seen() == {"listed-model"}
        caplog.set_level("INFO", logger="dynamo.planner.frontends")
        await asyncio.to_thread(etcd.crash)
        assert await seen() == {"listed-model"} and await seen() == {"listed-model"}
        with pytest.raises(ObservationUnavailable, match="models of namespace nsm are not known yet"):
            await never()
        assert await NamespaceModels(store, "nsm", only="Named")() == {"named"}  # --model needs no discovery
        await asyncio.to_thread(etcd.restart)
        assert await never() == {"listed-model"} and await seen() == {"listed-model"}
        messages = [r.getMessage() for r in caplog.records]
        assert sum("cannot list the models of namespace nsm" in m for m in messages) == 2, messages  # once each
        assert sum("listed again" in m for m in messages) == 2, messages
    finally:
        await store.close()
