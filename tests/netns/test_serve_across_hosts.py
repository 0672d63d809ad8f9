"""``dynamo serve`` with a graph split over hosts (tests/netns/conftest.py): examples/hello_world's three
services, each started on a host of its own by ``dynamo serve --service-name NAME`` (Dynamo 0.x's way to
run one service of a graph), all on the fleet's etcd and NATS with the settings docs/runtime.md tells a
user to set on each machine. A request to the Frontend's route on one host goes through Middle on a
second and Backend on a third, whatever order the hosts started in."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from harness.proc import free_port
from harness.serve_graph import Graph

pytestmark = pytest.mark.timeout(180)

HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello_world"


def test_a_graph_split_over_three_hosts_answers_through_all_three(fleet, topology):
    """Frontend on ``fe``, Middle on ``w2``, Backend on ``w1``: each host's ``dynamo serve`` starts only its
    service and says which it calls elsewhere. A request sent before Backend's host started waits for it
    (the graph's clients wait for their service's instances) and is answered once it is up; so are the
    requests after it."""
    port = free_port()
    fe_address = topology["fe"].address
    graphs: list[Graph] = []

    def serve(host: str, service: str, *extra: str) -> Graph:
        env = {**fleet.host_env(host), "DYN_WORKER_GRACEFUL_SHUTDOWN_TIMEOUT": "5"}
        g = Graph("hello_world:Frontend", "-f", "config.yaml", "--service-name", service, *extra,
                  cwd=HELLO, env=env, port=port, host=fe_address, prefix=topology[host].prefix)
        graphs.append(g)
        g.start()
        g.wait_replicas({service: 1}, timeout=60)
        return g

    try:
        front = serve("fe", "Frontend", f"--Frontend.host={fe_address}", f"--Frontend.port={port}")
        middle = serve("w2", "Middle")
        answer: list[httpx.Response | BaseException] = []

        def early() -> None:  # sent while no Backend is anywhere
            try:
                answer.append(front.post("generate", {"text": "early"}, timeout=90))
            except BaseException as e:  # the assertion below reports it
                answer.append(e)

        t = threading.Thread(target=early, daemon=True)
        t.start()
        t.join(2)
        assert not answer, f"answered with no Backend anywhere: {answer}"
        back = serve("w1", "Backend")
        t.join(90)
        assert answer and isinstance(answer[0], httpx.Response), answer
        assert answer[0].status_code == 200, answer[0].text
        assert answer[0].text == "Frontend: Middle: Backend: early-mid-back"

        for i in range(3):
            r = front.post("generate", {"text": f"q{i}"})
            assert r.status_code == 200, r.text
            assert r.text == f"Frontend: Middle: Backend: q{i}-mid-back"

        for g, service in ((front, "Frontend"), (middle, "Middle"), (back, "Backend")):
            assert list(g.pids()) == [f"{service}:0"], f"{service}'s host started {g.pids()}"
        assert "dynamo serve: only Frontend here; it calls Middle, served elsewhere" in front.stderr_text()
        assert "dynamo serve: only Middle here; it calls Backend, served elsewhere" in middle.stderr_text()
        assert "dynamo serve: only Backend here\n" in back.stderr_text()
    finally:
        for g in reversed(graphs):
            g.stop(timeout=30)
