"""The planner's learned capacity on a real fleet: mocker workers whose ITL rises with their load, a real
frontend, real etcd and NATS, the local connector, no profile.

The mocker's decode step takes ``(19.44 + 43.88 a - 5.47 a^2) / speedup`` ms, ``a`` the share of its KV
blocks in use.  With 80 blocks of 16 tokens, speedup 0.8 and requests of about 45 + 100 tokens, eight
streams on one worker hold about 60% of its blocks: about 55 ms a token, over the 50 ms target; four
streams on each of two workers about 40 ms, within it; three workers would idle.  So the right fleet for
eight streams is two.  The planner must get there from one worker and stay there: its first step is the
reaction to a missed target (capacity unknown), after that the line fitted to what it saw (and the bound
the missed p90 set) must keep the fleet at two, neither back to one nor on to three.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Iterator

import pytest

from harness.chat_load import ChatLoad
from harness.fleet import mocker_worker_cmd, scrape
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.wait import wait_until

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

NS = "cap"
MODEL = "capacity-model"
INTERVAL = 2.0


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with EtcdServer() as etcd, NatsServer() as nats_srv:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats_srv.url}


def planner_gauges(port: int) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("pool", "") + s.labels.get("state", "")): s.value
            for s in scrape(f"http://127.0.0.1:{port}/metrics", down_ok=True)}


def fleet_size(state: Path) -> int:
    try:
        return len(json.loads((state / f"local-{NS}.json").read_text())["workers"])
    except (OSError, ValueError):
        return 0


def test_learned_capacity_converges_to_the_right_fleet(servers, tiny_model, tmp_path):
    cmd = mocker_worker_cmd(tmp_path, tiny_model, f"{NS}.backend.generate", MODEL,
                            {"num_gpu_blocks": 64, "block_size": 16, "speedup_ratio": 0.9})
    state = tmp_path / "state"
    planner = DynamoWorker(
        "--namespace", NS, "--adjustment-interval", str(INTERVAL), "--itl", "50", "--ttft", "10000",
        "--min-endpoint", "1", "--max-workers", "4", "--scale-down-after", "3", "--decode-cmd", cmd,
        "--state-dir", str(state), "--metrics-port", "0", "-v",
        command=[sys.executable, "-m", "dynamo.planner"], ready=r"planner for namespace", env=servers)
    with DynamoRun("out=dyn", env=servers) as fe, planner:
        port = planner.logged_port(planner.PLANNER_METRICS)
        try:
            wait_until(lambda: planner_gauges(port).get(("dynamo_planner_workers", "decodeready")) == 1, 60,
                       "the first worker serving")
            with ChatLoad(fe.api_url, MODEL, n=8, max_tokens=100, stagger=0.5) as load:
                wait_until(lambda: planner_gauges(port).get(("dynamo_planner_workers", "decodeready")) == 2, 60,
                           "a second worker serving")
                # from here, twelve intervals: the fleet wanted must settle at two
                desired: list[float] = []
                seen = planner_gauges(port).get(("dynamo_planner_intervals_total", ""), 0.0)
                while len(desired) < 12:
                    wait_until(lambda before=seen: planner_gauges(port).get(("dynamo_planner_intervals_total", ""),
                                                                         0.0) > before, 10, "the next interval")
                    g = planner_gauges(port)
                    seen = g[("dynamo_planner_intervals_total", "")]
                    desired.append(g[("dynamo_planner_desired_workers", "decode")])
            assert load.failed == []
            log = planner.stderr_text()
            assert desired[-6:] == [2.0] * 6, f"wanted {desired}\n{log[-6000:]}"
            assert fleet_size(state) == 2
            # the last intervals were sized from the learned capacity: more than one worker's worth, at most two
            # (the load comes in bursts, so some intervals alone would want one: hysteresis holds those)
            worths = [float(w) for w in re.findall(r"aggregated (\d+\.\d+) workers' worth", log)][-6:]
            assert len(worths) == 6 and 1.0 < max(worths) <= 2.0, log[-6000:]
            lines = log.splitlines()
            grown = max(i for i, line in enumerate(lines) if "decode 1->2" in line)
            assert not [line for line in lines[grown + 1:] if "over 50 ms" in line], log[-6000:]  # no reaction since
        finally:
            planner.stop()
            for worker in json.loads((state / f"local-{NS}.json").read_text())["workers"] if fleet_size(state) else []:
                try:
                    os.killpg(worker["pid"], signal.SIGKILL)  # the planner leaves its fleet running on exit
                except OSError:
                    pass
