"""The virtual connector end to end: ``dynamo-planner --environment virtual`` decides, the example
orchestrator (examples/planner_virtual_orchestrator.py) starts and stops real mocker workers with
``VirtualConnectorClient``, behind a real frontend (found through discovery), under each distributed
configuration (harness/dist_configs.py: etcd and NATS, or nothing started).

The ITL target (1 ms) is below anything a mocker gives, so load makes the planner ask for its budget (2);
without load it asks for ``--min-endpoint`` (1) after two quiet intervals.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import pytest

from harness.chat_load import ChatLoad
from harness.dist_configs import DistConfig
from harness.fleet import mocker_worker_cmd
from harness.proc import DynamoRun, DynamoWorker
from harness.wait import wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

NS = "vo"
MODEL = "orchestrated"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "planner_virtual_orchestrator.py"


@pytest.fixture(scope="module")
def servers(dist_config: DistConfig) -> dict[str, str]:
    return dist_config.env


def instances(fe: DynamoRun) -> int:
    return len(httpx.get(fe.base_url + "/health", timeout=5).json().get("instances", []))


def carried_out(orchestrator: DynamoWorker) -> list[int]:
    return [int(n) for n in re.findall(r"decision (\d+) carried out", orchestrator.stderr_text())]


def test_orchestrator_follows_the_planners_decisions(servers, tiny_model, tmp_path):
    worker = mocker_worker_cmd(tmp_path, tiny_model, f"{NS}.backend.generate", MODEL,
                               {"num_gpu_blocks": 256, "block_size": 16})
    orchestrator = DynamoWorker(
        str(EXAMPLE), "--namespace", NS, "--decode-cmd", worker, "--log-dir", str(tmp_path / "logs"),
        command=[sys.executable], ready=r"orchestrating namespace", env=servers)
    planner = DynamoWorker(
        "--namespace", NS, "--environment", "virtual", "--adjustment-interval", "1", "--itl", "1",
        "--ttft", "100000", "--min-endpoint", "1", "--max-workers", "2", "--scale-down-after", "2",
        command=[sys.executable, "-m", "dynamo.planner"], ready=r"planner for namespace", env=servers)
    with DynamoRun("out=dyn", env=servers) as fe, orchestrator, planner:
        # the planner's first decision: --min-endpoint workers; the orchestrator starts one and acknowledges
        wait_until(lambda: 1 in carried_out(orchestrator), 60, "decision 1 carried out")
        wait_until(lambda: instances(fe) == 1, 10, "the frontend sees the worker")
        assert "decision 1: 0 prefill, 1 decode worker(s)" in orchestrator.stderr_text()

        # load over the target: decision 2 asks for two; a second worker serves before it is acknowledged
        with ChatLoad(fe.api_url, MODEL, n=4) as load:
            wait_until(lambda: 2 in carried_out(orchestrator), 60, "decision 2 carried out")
            wait_until(lambda: instances(fe) == 2, 10, "the frontend sees two workers")
            assert "decision 2: 0 prefill, 2 decode worker(s)" in orchestrator.stderr_text()
            assert re.search(r"decision: prefill 0->0 decode 1->2 .*ITL \d+ ms over 1 ms", planner.stderr_text()), \
                planner.stderr_text()
        assert load.failed == [] and load.ok > 0

        # no load: decision 3 asks for one; the newest worker is drained (SIGTERM) and leaves discovery
        wait_until(lambda: 3 in carried_out(orchestrator), 30, "decision 3 carried out")
        assert "decision 3: 0 prefill, 1 decode worker(s)" in orchestrator.stderr_text()
        assert "SIGTERM: it drains and exits" in orchestrator.stderr_text()
        wait_until(lambda: instances(fe) == 1, 10, "the frontend sees one worker")
        # one decision at a time: every decision was acknowledged before the next was written
        assert carried_out(orchestrator) == [1, 2, 3]

        planner.stop()
        orchestrator.stop()  # it stops the workers it started
        wait_until(lambda: instances(fe) == 0, 15, "the orchestrator's workers gone")
