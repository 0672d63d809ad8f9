"""The planner with the local connector on real etcd and NATS, a real frontend and mocker workers.

The ITL target (1 ms) is below what a mocker worker ever gives (about 20 ms a token at speedup 1), so any
traffic is over the target and the planner grows the fleet to its budget (2); with no traffic it shrinks
back to ``--min-endpoint`` (1) after ``--scale-down-after`` (2) quiet intervals.  Intervals are 1 s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from harness.chat_load import ChatLoad
from harness.fleet import mocker_worker_cmd
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.wait import wait_until

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

NS = "plan"
MODEL = "planned"


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with EtcdServer() as etcd, NatsServer() as nats_srv:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url}


@pytest.fixture(scope="module")
def frontend(servers) -> Iterator[DynamoRun]:
    with DynamoRun("out=dyn", env=servers) as fe:
        yield fe


def planner(servers, fe: DynamoRun, cmd: str, state: Path, *extra: str) -> DynamoWorker:
    return DynamoWorker(
        "--namespace", NS, "--adjustment-interval", "1", "--itl", "1", "--ttft", "100000", "--min-endpoint", "1",
        "--max-workers", "2", "--scale-down-after", "2", "--frontend-url", fe.base_url, "--decode-cmd", cmd,
        "--state-dir", str(state), *extra,
        command=[sys.executable, "-m", "dynamo.planner"], ready=r"planner for namespace", env=servers)


def fleet_pids(state: Path) -> list[int]:
    try:
        return [w["pid"] for w in json.loads((state / f"local-{NS}.json").read_text())["workers"]]
    except (OSError, ValueError):
        return []


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def serving_instances(fe: DynamoRun) -> int:
    health = httpx.get(fe.base_url + "/health", timeout=5).json()
    return len(health.get("instances", []))


def test_scale_up_down_replace_and_adopt(servers, frontend, tiny_model, tmp_path):
    state = tmp_path / "state"
    cmd = mocker_worker_cmd(tmp_path, tiny_model, f"{NS}.backend.generate", MODEL,
                            {"num_gpu_blocks": 256, "block_size": 16, "speedup_ratio": 1.0})
    p = planner(servers, frontend, cmd, state).start()
    try:
        # --min-endpoint: one worker, started and serving
        wait_until(lambda: serving_instances(frontend) == 1, 60, "the first worker serves")
        assert len(fleet_pids(state)) == 1
        first = fleet_pids(state)[0]

        # a load step up: the second worker is started within two intervals of the load being seen
        with ChatLoad(frontend.api_url, MODEL) as load:
            wait_until(lambda: load.ok >= 1, 30, "requests are served")
            seen = time.monotonic()
            wait_until(lambda: len(fleet_pids(state)) == 2, 10, "a scale-up")
            assert time.monotonic() - seen < 2 * 1.0 + 1.5, p.stderr_text()
            wait_until(lambda: serving_instances(frontend) == 2, 60, "the second worker serves")
            assert re.search(r"decision: prefill 0->0 decode 1->2 .*ITL \d+ ms over 1 ms", p.stderr_text())
        assert load.failed == [] and load.ok > 0

        # the load stops: after two quiet intervals one worker drains and exits
        wait_until(lambda: len(fleet_pids(state)) == 1, 30, "a scale-down")
        wait_until(lambda: serving_instances(frontend) == 1, 30, "one worker serves")
        assert "decode 2->1" in p.stderr_text() and "drained and exited" in p.stderr_text()

        # a worker killed is replaced
        survivor = fleet_pids(state)[0]
        os.kill(survivor, signal.SIGKILL)
        wait_until(lambda: fleet_pids(state) and fleet_pids(state)[0] != survivor, 15, "a replacement")
        wait_until(lambda: "replacing it" in p.stderr_text(), 5, "the replacement logged")
        replacement = fleet_pids(state)[0]
        wait_until(lambda: "serving (" in p.stderr_text().split("replacing it")[-1], 60, "the replacement serves")
        assert first in (survivor, replacement) or not alive(first)
    finally:
        p.stop()
    # the planner left: its worker keeps running; a new planner adopts it and starts nothing
    assert alive(replacement)
    p2 = planner(servers, frontend, cmd, state).start()
    try:
        wait_until(lambda: f"adopted decode worker pid {replacement} (serving)" in p2.stderr_text(), 15, "adoption")
        time.sleep(3.0)  # three intervals: nothing is started (an absence cannot be awaited)
        assert fleet_pids(state) == [replacement] and "started decode worker" not in p2.stderr_text()
    finally:
        p2.stop()

    # --no-operation: load over the target gives decisions that change nothing
    p3 = planner(servers, frontend, cmd, state, "--no-operation").start()
    try:
        with ChatLoad(frontend.api_url, MODEL, n=2) as load:
            wait_until(lambda: "[no-operation]" in p3.stderr_text(), 20, "a no-operation decision")
        assert fleet_pids(state) == [replacement] and "started decode worker" not in p3.stderr_text()
        assert load.failed == []
    finally:
        p3.stop()
        os.killpg(replacement, signal.SIGTERM)
