"""NATS restarted again and again under CPU load, end to end: a frontend (``in=http out=dyn``) and two
``echo_core`` workers as real processes, nats-server killed with SIGKILL, kept down for the outage and
restarted on the same port with its JetStream store, while a client sends one request every quarter
second. After every restart both workers must serve again and requests must succeed.

Why the workers are sometimes frozen across the restart: every process reconnects to NATS on its own
retry timer, so which one is back first is luck. On a quiet machine they all retry within milliseconds
of each other; on a busy one a frontend can be back a retry period (or more) before its workers, and
its requests then find nobody subscribed on their subjects ("no responders"), exactly what a dead
worker gives, while etcd, where a dead worker would disappear, never changes. The frontend used to
mark such a worker down until the next etcd update for the endpoint, which never came: after one
unlucky restart every request failed for good. Freezing workers (SIGSTOP) while NATS comes back forces
that order instead of waiting for it: the cycles put both workers, one, or none behind the frontend,
with a busy-loop process per core on top so the rest of the timing is not a quiet machine's either.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

import httpx
import pytest

from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.wait import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]

ENDPOINT = "dyn://chaosnats.backend.generate"
MODEL = "chaos-nats"
OUTAGE_S = 3.0
# which workers (indexes) stay frozen while NATS comes back, cycle by cycle: the race, forced both
# ways and once left to the load alone
LATE = [(0, 1), (1,), (), (0, 1)]
STEADY = 8  # requests that must all succeed once both workers serve again, per cycle
LOG = "info,dynamo.worker.handlers=debug"  # a worker logs "request <id>" for each request


@dataclass
class Sent:
    rid: str
    status: int  # -1: no HTTP answer at all
    detail: str
    started: float


class Client:
    """One completion every quarter second through the frontend until stopped; what each one gave."""

    def __init__(self, frontend: DynamoRun) -> None:
        self.url = frontend.api_url + "/completions"
        self.sent: list[Sent] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Client":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as http:
            n = 0
            while not self._stop.is_set():
                n += 1
                rid = f"nats-{n}-{uuid.uuid4().hex[:8]}"
                started = time.monotonic()
                try:
                    resp = http.post(self.url, json={"model": MODEL, "prompt": f"request {n}"},
                                     headers={"x-request-id": rid})
                    if resp.status_code == 200:
                        text = resp.json()["choices"][0]["text"]
                        status, detail = (200, "") if text == f"request {n}" else (0, f"wrong text {text!r}")
                    else:
                        status = resp.status_code
                        detail = f"{resp.text[:200]} (Retry-After: {resp.headers.get('retry-after')})"
                except httpx.HTTPError as exc:
                    status, detail = -1, repr(exc)
                self.sent.append(Sent(rid, status, detail, started))
                self._stop.wait(max(0.0, 0.25 - (time.monotonic() - started)))

    def since(self, t: float) -> list[Sent]:
        return [s for s in list(self.sent) if s.started >= t]


def served(worker: DynamoWorker, sent: list[Sent]) -> bool:
    """``worker`` served one of these (successful) requests."""
    log = worker.stderr_text()
    return any(s.status == 200 and f"request {s.rid}" in log for s in sent)


def no_responders(frontend: DynamoRun, worker: DynamoWorker) -> int:
    """How many requests the frontend found nobody subscribed on ``worker``'s subject (it logs each)."""
    return frontend.stderr_text().count(f"no responders on subject chaosnats_backend.generate-{worker.instance_hex};")


@pytest.fixture
def cpu_load() -> Iterator[None]:
    """A busy-loop process per core, for the length of the test."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for p in burners:
            p.kill()
            p.wait()


def restart_nats(nats: NatsServer, fe: DynamoRun, workers: list[DynamoWorker], client: Client, cycle: int,
                 late: tuple[int, ...]) -> None:
    """Kill NATS, keep it down for the outage, bring it back with the workers in ``late`` frozen until the
    frontend has found them unsubscribed; then both workers must serve again and requests succeed."""
    missed = [no_responders(fe, w) for w in workers]
    nats.crash()
    time.sleep(OUTAGE_S)  # the outage itself
    for i in late:
        workers[i].terminate(signal.SIGSTOP)
    nats.restart()
    wait_until(lambda: fe.stderr_text().count("reconnected after") > cycle, 30,
               f"cycle {cycle}: the frontend to reconnect to NATS")
    # the frontend is back before the frozen workers: requests must find them unsubscribed (the race)
    for i in late:
        wait_until(lambda i=i: no_responders(fe, workers[i]) > missed[i], 30,
                   f"cycle {cycle}: a request to frozen worker {i} to find no responder")
    thawed = time.monotonic()
    for i in late:
        workers[i].terminate(signal.SIGCONT)
    for i, w in enumerate(workers):
        wait_until(lambda w=w: served(w, client.since(thawed)), 30,
                   f"cycle {cycle}: worker {i} to serve again after the restart")
    both = time.monotonic()
    wait_until(lambda: len(client.since(both)) >= STEADY, 60, f"cycle {cycle}: {STEADY} more requests")
    bad = [s for s in client.since(both)[:STEADY] if s.status != 200]
    assert not bad, f"cycle {cycle}: failed once both workers served again: {bad}"


def test_every_nats_restart_is_survived_whichever_process_reconnects_first(tiny_model, cpu_load):
    with EtcdServer() as etcd, NatsServer() as nats:
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url, "DYN_LOG": LOG}
        workers = [DynamoWorker(f"in={ENDPOINT}", "out=echo_core", str(tiny_model), "--model-name", MODEL, env=env)
                   for _ in range(2)]
        try:
            for w in workers:
                w.start(wait=False)
            for w in workers:
                w.wait_ready()
            with DynamoRun("out=dyn", env=env) as fe, Client(fe) as client:
                wait_until(lambda: served(workers[0], client.sent) and served(workers[1], client.sent), 30,
                           "both workers to serve before the first restart")
                for cycle, late in enumerate(LATE):
                    restart_nats(nats, fe, workers, client, cycle, late)
            # around an outage a request may get a clean 503 (NATS away, no worker answering yet); never a
            # 500, a wrong answer or no answer
            unclean = [s for s in client.sent
                       if s.status not in (200, 503) or (s.status == 503 and "Retry-After: 1" not in s.detail)]
            assert not unclean, unclean
            print(f"{len(LATE)} restarts, {len(client.sent)} requests, "
                  f"{sum(s.status != 200 for s in client.sent)} answered 503 around the outages")
        finally:
            for w in workers:
                if w.running:
                    w.terminate(signal.SIGCONT)
                w.kill()
