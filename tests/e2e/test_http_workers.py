"""``--http-workers N``: N frontend processes on one port under a supervising parent.

Real processes throughout: the ``dynamo-run`` console script, its forked HTTP workers, and for out=dyn a
real etcd, nats-server and echo worker.  Which process answered is read from ``/metrics`` (each sample
carries ``http_worker="<index>"``); the processes themselves from ``/proc/<pid>/task/<pid>/children``.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from harness.proc import DynamoRun, DynamoWorker, free_port, run_cli
from harness.servers import EtcdServer, NatsServer
from harness.wait import wait_until

pytestmark = pytest.mark.timeout(90)

REQUESTS = re.compile(r'_requests_total\{[^}]*http_worker="(\d+)"[^}]*status="success"[^}]*\} (\d+)')




def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def chat(base_url: str, model: str, text: str, stream: bool = False) -> str:
    """One chat completion on a fresh connection (so the kernel picks a process for it anew)."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream}
    with httpx.Client(timeout=20) as client:
        resp = client.post(base_url + "/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    if not stream:
        return resp.json()["choices"][0]["message"]["content"]
    return "".join(c for c in re.findall(r'"content":"([^"]*)"', resp.text))


def served_by_worker(base_url: str) -> dict[str, int]:
    """Successful requests per HTTP worker, gathered by scraping /metrics on fresh connections until every
    process answered at least once (each scrape reaches one of them)."""
    seen: dict[str, int] = {}
    for _ in range(40):
        text = httpx.get(base_url + "/metrics", timeout=5).text
        for index, count in REQUESTS.findall(text):
            seen[index] = seen.get(index, 0) + int(count)  # one line per endpoint/type: add them
        if len(seen) == 2:
            break
    return seen


def busy_until_both_served(frontend: DynamoRun, model: str) -> dict[str, int]:
    """Requests on fresh connections until /metrics shows both processes served some."""
    def both() -> dict[str, int] | None:
        for i in range(4):
            assert chat(frontend.base_url, model, f"hello {i}") == f"hello {i}"
        seen = served_by_worker(frontend.base_url)
        return seen if len(seen) == 2 and all(seen.values()) else None

    return wait_until(both, 20, "requests served by both HTTP workers")


# -- local echo engine ---------------------------------------------------------------------------------


def test_two_workers_serve_restart_a_killed_one_and_stop_on_sigterm():
    with DynamoRun("out=echo_full", "--model-name", "echo", "--http-workers", "2") as frontend:
        kids = wait_until(lambda: len(children(frontend.pid)) == 2 and children(frontend.pid), 10, "two workers")
        busy_until_both_served(frontend, "echo")

        # kill -9 one worker: the parent forks a new one on the same socket; nothing else changes
        victim, survivor = kids
        os.kill(victim, signal.SIGKILL)
        new = wait_until(lambda: [p for p in children(frontend.pid) if p not in kids], 10, "a restarted worker")
        assert survivor in children(frontend.pid)
        assert len(children(frontend.pid)) == 2
        for i in range(20):  # every request is answered, by either process, while and after it restarts
            assert chat(frontend.base_url, "echo", f"again {i}", stream=True) == f"again {i}"
        busy_until_both_served(frontend, "echo")
        assert "HTTP worker" in frontend.stderr_text() and "killed by SIGKILL; restarted" in frontend.stderr_text()

        # SIGTERM to the parent stops every worker gracefully; exit status 0
        procs = [survivor, *new]
        assert frontend.stop(timeout=15) == 0
        assert not any(alive(p) for p in procs), frontend.stderr_text()
        assert "Traceback" not in frontend.stderr_text()


def test_sigterm_lets_streams_in_flight_finish():
    with DynamoRun("out=echo_full", "--model-name", "echo", "--http-workers", "2", delay_ms=20) as frontend:
        wait_until(lambda: len(children(frontend.pid)) == 2, 10, "two workers")
        with httpx.Client(timeout=20) as client:
            body = {"model": "echo", "messages": [{"role": "user", "content": "x" * 50}], "stream": True}
            with client.stream("POST", frontend.base_url + "/v1/chat/completions", json=body) as resp:
                chunks = resp.iter_text()
                first = next(chunks)  # the stream is under way (50 tokens at 20 ms: about 1 s)
                frontend.terminate(signal.SIGTERM)
                text = first + "".join(chunks)
        assert text.count('"content":"x"') == 50
        assert text.rstrip().endswith("data: [DONE]")
        assert frontend.wait(15) == 0


def test_ctrl_c_at_the_terminal_stops_everything_gracefully():
    # a terminal sends SIGINT to the whole foreground process group: the workers are in their own group,
    # so each gets exactly one SIGTERM from the parent (a second signal would make them exit at once)
    with DynamoRun("out=echo_full", "--model-name", "echo", "--http-workers", "2") as frontend:
        kids = wait_until(lambda: len(children(frontend.pid)) == 2 and children(frontend.pid), 10, "two workers")
        os.killpg(frontend.pid, signal.SIGINT)
        assert frontend.wait(15) == 0
        assert not any(alive(p) for p in kids)
        log = frontend.stderr_text()
        assert "SIGINT received, stopping 2 HTTP worker(s)" in log
        assert "second" not in log and "Traceback" not in log, log


def test_a_worker_that_keeps_dying_stops_the_frontend():
    with DynamoRun("out=echo_full", "--model-name", "echo", "--http-workers", "2") as frontend:
        kids = wait_until(lambda: len(children(frontend.pid)) == 2 and children(frontend.pid), 10, "two workers")
        seen = set(kids)
        for _ in range(6):  # the 6th death within a minute is one too many
            victim = children(frontend.pid)[0]
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda: not frontend.running or set(children(frontend.pid)) - seen, 10, "a restart or the end")
            seen.update(children(frontend.pid))
        assert frontend.wait(15) == 1
        assert "giving up" in frontend.stderr_text()
        assert not any(alive(p) for p in seen)


def test_a_worker_exiting_with_an_error_stops_the_whole_frontend():
    # etcd unreachable: each worker reports it and exits 1; the parent stops and exits 1 too, no restart loop
    port = free_port()
    t0 = time.monotonic()
    p = run_cli(["in=http", "out=dyn", "--http-workers", "2", "--http-port", str(port)],
                env={"ETCD_ENDPOINTS": f"http://127.0.0.1:{free_port()}"}, timeout=30)
    assert p.returncode == 1
    assert "Error: cannot reach etcd" in p.stderr
    assert "Traceback" not in p.stderr
    assert "restarted" not in p.stderr
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("args, needle", [
    (["in=text", "out=echo_full"], "needs in=http"),
    (["in=http", "out=echo_full", "--http-workers", "0"], "--http-workers must be between 1 and 64"),
])
def test_flag_errors_are_one_line(args: list[str], needle: str):
    if "--http-workers" not in args:
        args = args + ["--http-workers", "2"]
    p = run_cli(args)
    assert p.returncode != 0
    assert p.stderr.strip().startswith("Error:") and needle in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_an_engine_that_loads_a_model_is_refused(tmp_path: Path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    p = run_cli(["in=http", "out=llamacpp", str(gguf), "--http-workers", "2"])
    assert p.returncode != 0
    assert "would load the model 2 times" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_port_in_use_is_an_error_even_for_a_reuseport_group():
    with DynamoRun("out=echo_full", "--model-name", "echo", "--http-workers", "2") as first:
        p = run_cli(["in=http", "out=echo_full", "--http-workers", "2", "--http-host", "127.0.0.1",
                     "--http-port", str(first.port)])
        assert p.returncode == 1
        assert f"cannot listen on 127.0.0.1:{first.port}" in p.stderr and "in use" in p.stderr, p.stderr


# -- out=dyn over real etcd and NATS -------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with EtcdServer() as etcd, NatsServer() as nats:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url}


def test_two_dyn_frontends_each_discover_the_worker_and_serve(servers: dict[str, str]):
    with DynamoWorker("in=dyn://hw.backend.generate", "out=echo_full", "--model-name", "hw-echo", env=servers):
        with DynamoRun("out=dyn", "--http-workers", "2", env=servers) as frontend:
            def listed() -> bool:  # each process found the model in etcd by itself
                return all("hw-echo" in httpx.get(frontend.base_url + "/v1/models", timeout=5).text
                           for _ in range(10))

            wait_until(listed, 20, "the model on both frontends")
            seen = busy_until_both_served(frontend, "hw-echo")
            assert set(seen) == {"0", "1"}
            assert chat(frontend.base_url, "hw-echo", "streamed", stream=True) == "streamed"
            kids = children(frontend.pid)
            assert frontend.stop(timeout=15) == 0
            assert not any(alive(p) for p in kids)
