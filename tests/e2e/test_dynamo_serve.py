"""``dynamo serve`` as a user runs it: real processes per service, on the zero-infrastructure default.

Each test starts ``python -m dynamo.sdk.cli serve ...`` (the ``dynamo`` console script's code) in its own
file-store directory, waits for the ready lines the replicas log (through the supervisor, prefixed
``[Service:replica]``), and talks to the graph over HTTP.  Graphs: examples/hello_world and
tests/e2e/data/serve_graphs/.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from harness.proc import cli_env, free_port, in_thread
from harness.serve_graph import SERVE, STARTED, GraphStarter, alive, env_for
from harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_default_infra"), pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = Path(__file__).parent / "data" / "serve_graphs"
HELLO = ROOT / "examples" / "hello_world"


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[GraphStarter]:
    with GraphStarter(tmp_path, GRAPHS) as starter:
        yield starter


def test_hello_world_answers_through_three_processes(serve):
    g = serve("hello_world:Frontend", "-f", "config.yaml", cwd=HELLO,
              want={"Frontend": 1, "Middle": 1, "Backend": 1})
    r = g.post("generate", {"text": "test"})
    assert r.status_code == 200, r.text
    assert r.text == "Frontend: Middle: Backend: test-mid-back"
    assert set(g.pids()) == {"Frontend:0", "Middle:0", "Backend:0"}
    assert "[Backend:0] " in g.stderr_text()


def test_two_workers_both_serve_and_config_layers_reach_the_service(serve):
    g = serve("replicas:Front", "-f", "replicas.yaml", "--Leaf.message=from-cli", "--Common.shared=cli-common",
              want={"Front": 1, "Leaf": 2})
    pids = g.pids()
    leaf_pids = {pids["Leaf:0"][0], pids["Leaf:1"][0]}
    seen = set()
    for i in range(8):
        r = g.post("generate", {"text": f"q{i}"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["text"] == f"q{i}-from-cli"  # the command line beat the YAML
        seen.add(body["pid"])
    assert seen == leaf_pids  # round-robin reached both replicas
    section = g.post("settings", {}).json()
    assert section["section"]["greeting"] == "yaml-hello"  # from the YAML
    assert section["section"]["shared"] == "cli-common"  # --Common reaches the section through common-configs
    assert section["section"]["model"] == "leaf-model"  # the section's own YAML value beats YAML's Common
    assert section["section"]["ServiceArgs"]["workers"] == 2
    assert section["common"]["shared"] == "cli-common"
    log = g.stderr_text()  # Front started only once both Leaf replicas were ready
    assert max(log.index(f"service Leaf replica {i} ready") for i in (0, 1)) < log.index("dynamo serve: started Front:0")
    assert "dynamo serve: Front starts once Leaf is ready" in log


def test_a_replica_killed_is_restarted_and_serves_again(serve):
    g = serve("replicas:Front", "-f", "replicas.yaml", want={"Front": 1, "Leaf": 2})
    victim = g.pids()["Leaf:1"][0]
    results: list[int | str] = []
    done = False

    def load() -> None:  # requests all along: before, during and after the kill and the restart
        i = 0
        while not done:
            try:
                r = g.post("generate", {"text": f"k{i}"})
                results.append(r.json()["pid"] if r.status_code == 200 else f"{r.status_code} {r.text}")
            except httpx.HTTPError as e:
                results.append(repr(e))
            i += 1

    t = in_thread(load)
    wait_until(lambda: len(results) >= 5, 30, "requests flowing")
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: len(g.pids()["Leaf:1"]) == 2 and g.ready_count("Leaf", 1) == 2, 60,
               "Leaf:1 restarted and ready")
    assert f"Leaf:1 (pid {victim}) killed by SIGKILL; restarting" in g.stderr_text()
    new = g.pids()["Leaf:1"][1]
    wait_until(lambda: new in results, 30, "the restarted replica answering")
    done = True
    t.join(30)
    failed = [x for x in results if isinstance(x, str)]
    assert not failed, failed  # a request reaching the dead replica was resent to a live one


def test_sigterm_stops_dependents_first_finishes_streams_and_leaves_no_process(serve):
    g = serve("replicas:Front", "-f", "replicas.yaml", want={"Front": 1, "Leaf": 2})
    children = [pid for pids in g.pids().values() for pid in pids]
    chunks: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"http://127.0.0.1:{g.http_port}/slow", json={"text": "s"}, timeout=30) as r:
            for text in r.iter_text():
                chunks.append(text)

    t = in_thread(stream)
    wait_until(lambda: chunks, 30, "the first streamed chunk")
    g.terminate(signal.SIGTERM)
    assert g.wait(60) == 0, g.stderr_text()
    t.join(30)
    assert "".join(chunks) == "".join(f"s{i};" for i in range(6))  # the stream in flight finished
    assert not [pid for pid in children if alive(pid)]
    log = g.stderr_text()
    stops = [m.group(1) for m in re.finditer(r"\[(\w+):\d\] .*received SIGTERM", log)]
    assert stops == ["Front", "Leaf", "Leaf"], log  # dependents first
    assert "dynamo serve: stopped" in log


def test_init_raising_is_one_line_a_nonzero_exit_and_nothing_left(tmp_path):
    p = subprocess.run(SERVE + ["broken:Top", f"--Top.port={free_port()}"], cwd=GRAPHS, capture_output=True, text=True,
                       env=cli_env(env_for(tmp_path)), timeout=120)
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["error: service Broken failed to start: __init__ raised ValueError: no model here"], p.stderr
    assert "Traceback" not in p.stderr
    pids = [int(m.group(3)) for m in STARTED.finditer(p.stderr)]
    assert pids and not [pid for pid in pids if alive(pid)]
    assert "restarting" not in p.stderr


def test_a_cycle_in_depends_is_refused_before_anything_starts(tmp_path):
    p = subprocess.run(SERVE + ["cycle:A"], cwd=GRAPHS, capture_output=True, text=True,
                       env=cli_env(env_for(tmp_path)), timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == "error: cycle in depends: A -> B -> C -> A"
    assert "started" not in p.stderr + p.stdout


def test_dry_run_prints_graph_processes_and_config(tmp_path):
    p = subprocess.run(SERVE + ["hello_world:Frontend", "-f", "config.yaml", "--dry-run", "--Backend.ServiceArgs.workers=3"],
                       cwd=HELLO, capture_output=True, text=True, env=cli_env(env_for(tmp_path)), timeout=60)
    assert p.returncode == 0, p.stderr
    assert "Backend x3:" in p.stdout and "Middle x1:" in p.stdout
    assert "depends on: Backend" in p.stdout
    assert "message: mid" in p.stdout


def test_service_name_starts_one_service_and_an_unknown_name_is_one_line(tmp_path):
    """``--service-name`` (one service of the graph, as on one machine of several): the dry run lists that
    service's processes only; a name the graph does not have is refused before anything starts."""
    p = subprocess.run(SERVE + ["hello_world:Frontend", "-f", "config.yaml", "--service-name", "Middle", "--dry-run"],
                       cwd=HELLO, capture_output=True, text=True, env=cli_env(env_for(tmp_path)), timeout=60)
    assert p.returncode == 0, p.stderr
    processes = p.stdout.split("processes:\n")[1].split("config:")[0]
    assert re.findall(r"^  (\w+) x\d+:", processes, re.M) == ["Middle"]
    assert "(after" not in processes  # what Middle calls runs elsewhere: nothing to wait for here
    p = subprocess.run(SERVE + ["hello_world:Frontend", "--service-name", "Nope"], cwd=HELLO, capture_output=True,
                       text=True, env=cli_env(env_for(tmp_path)), timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == "error: --service-name Nope: no such service in this graph (Backend, Middle, Frontend)"
