"""Data-plane fault figures for docs/reliability.md: frozen workers (SIGSTOP) with and without migration,
kill -9 mid-stream, a NATS restart, and 10x overload, against real etcd, nats-server, frontend and
workers (``dynamo-run`` processes running harness/det_engine.py, so every output is checked
token for token).

    PYTHONPATH=src .venv/bin/python -m benchmarks.reliability [freeze|nofreeze|kill|nats|overload ...]

Uses the production liveness bound unless DYN_STREAM_LIVENESS_S is set. Prints one block per fault.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import httpx

from harness.det_engine import next_token, word_tokens
from harness.proc import DynamoRun, DynamoWorker
from harness.servers import EtcdServer, NatsServer
from harness.tiny_model import build_tiny_hf_model

ENGINE = Path(__file__).resolve().parents[1] / "harness" / "det_engine.py"
TOKEN_MS = 25
LIVENESS = float(os.environ.get("DYN_STREAM_LIVENESS_S", "5"))


class Checker:
    def __init__(self, model: Path) -> None:
        words = word_tokens(model)
        self.ids = sorted(words)
        self.by_word = {w: i for i, w in words.items()}

    def errors(self, text: str, n: int) -> tuple[int, int]:
        """(tokens missing or extra vs n, chain breaks): (0, 0) for an exact output."""
        words = text.split()
        ids = [self.by_word.get(w, -1) for w in words]
        breaks = sum(1 for a, b in itertools.pairwise(ids) if b != next_token(a, self.ids))
        return len(words) - n, breaks


async def stream(client: httpx.AsyncClient, base: str, model: str, n: int, rid: str) -> dict:
    out = {"rid": rid, "text": "", "errors": 0, "done": False, "times": [], "status": None, "end": 0.0}
    body = {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": n, "stream": True}
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body,
                                 headers={"x-request-id": rid}) as resp:
            out["status"] = resp.status_code
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    out["errors"] += 1
                for c in ev.get("choices", []):
                    if c["delta"].get("content"):
                        out["text"] += c["delta"]["content"]
                        out["times"].append(time.monotonic())
    except httpx.HTTPError as e:
        out["exc"] = type(e).__name__
    out["end"] = time.monotonic()
    return out


def gap(times: list[float]) -> float:
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def served_by(workers: list[DynamoWorker], rid: str) -> list[DynamoWorker]:
    return [w for w in workers if f"request {rid}" in w.stderr_text()]


def worker(env: dict, model: Path, name: str, *extra: str) -> DynamoWorker:
    """A worker of ``dyn://rel.<name>.generate`` serving model ``name`` (one model name per scenario: a
    frontend uses the first endpoint it saw for a name, and a killed worker's entry outlives it 10 s)."""
    return DynamoWorker(f"in=dyn://rel.{name}.generate", f"out=pytok:{ENGINE}", str(model), "--model-name", name,
                        *extra, env=env)


def wait_instances(fe: DynamoRun, endpoint: str, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        inst = httpx.get(fe.base_url + "/health", timeout=5).json().get("instances", [])
        if len([i for i in inst if i["endpoint"] == endpoint]) >= n:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{n} instances of {endpoint} not seen")


def report(title: str, cmd: str, rows: dict) -> None:
    print(f"\n== {title}  ({cmd})")
    for k, v in rows.items():
        print(f"   {k}: {v}")


async def streams_with_fault(fe: DynamoRun, name: str, n_streams: int, n_tokens: int,
                             fault_after: float, fault) -> tuple[list[dict], float]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=500)) as client:
        tasks = [asyncio.create_task(stream(client, fe.base_url, name, n_tokens, f"s{i}-{uuid.uuid4().hex[:8]}"))
                 for i in range(n_streams)]
        await asyncio.sleep(fault_after)
        at = time.monotonic()
        fault()
        results = await asyncio.gather(*tasks)
    return results, at


def summarise(results: list[dict], n_tokens: int, checker: Checker, at: float, victims: list[DynamoWorker],
              bound: float) -> dict:
    on_victim = [r for r in results if served_by(victims, r["rid"])]
    failed = [r for r in results if r["errors"] or not r["done"] or r.get("exc") or r["status"] != 200]
    exact = [r for r in results if r not in failed and checker.errors(r["text"], n_tokens) == (0, 0)]
    lost = sum(max(0, -checker.errors(r["text"], n_tokens)[0]) for r in results if r not in failed)
    extra = sum(max(0, checker.errors(r["text"], n_tokens)[0]) for r in results if r not in failed)
    breaks = sum(checker.errors(r["text"], n_tokens)[1] for r in results if r not in failed)
    stall = max((gap(r["times"]) for r in on_victim), default=0.0)
    hung = [r for r in results if gap(r["times"]) > bound * 1.25 + 2 or (r["end"] - at) > 60]
    return {"sent": len(results), "on the faulty worker": len(on_victim), "completed exactly": len(exact),
            "failed (error event + [DONE])": len(failed), "hung past the bound": len(hung),
            "tokens lost / repeated / out of order (completed streams)": f"{lost} / {extra} / {breaks}",
            "longest stall of a stream on the faulty worker (detect + resume)": f"{stall:.2f} s",
            "failed streams ended after the fault": (f"{min(r['end'] - at for r in failed):.2f}-"
                                                     f"{max(r['end'] - at for r in failed):.2f} s") if failed else "-"}


def until_serves(fe: DynamoRun, name: str, who: DynamoWorker, timeout: float = 60) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        rid = f"t-{uuid.uuid4().hex[:10]}"
        r = httpx.post(fe.api_url + "/chat/completions", timeout=30, headers={"x-request-id": rid}, json={
            "model": name, "messages": [{"role": "user", "content": "go"}], "max_tokens": 2})
        if r.status_code == 200 and served_by([who], rid):
            return time.monotonic() - start
        time.sleep(0.05)
    return float("nan")


def run_freeze(env, model, checker, migrate: bool, frozen_for: float | None = None) -> None:
    """SIGSTOP one of two workers 1 s into 20 streams; SIGCONT after ``frozen_for`` seconds (default: the
    bound + 2 s, within the 10 s lease; longer: the lease expires and the worker re-registers)."""
    args = ["out=dyn"] + (["--migration-limit", "3"] if migrate else [])
    name = ("frz" if migrate else "frznomig") + ("long" if frozen_for else "")
    frozen_for = frozen_for or LIVENESS + 2
    ws = [worker(env, model, name) for _ in range(2)]
    for w in ws:
        w.start(wait=False)
    for w in ws:
        w.wait_ready()
    try:
        with DynamoRun(*args, env=env) as fe:
            wait_instances(fe, f"dyn://rel.{name}.generate", 2)
            victim = ws[0]

            async def scenario() -> tuple[list[dict], float, float]:
                async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=500)) as client:
                    tasks = [asyncio.create_task(stream(client, fe.base_url, name, 200, f"s{i}-{uuid.uuid4().hex[:8]}"))
                             for i in range(20)]
                    await asyncio.sleep(1.0)
                    at = time.monotonic()
                    os.kill(victim.pid, signal.SIGSTOP)
                    await asyncio.sleep(frozen_for)
                    os.kill(victim.pid, signal.SIGCONT)
                    thawed = time.monotonic()
                    while True:  # small requests, alongside the streams still running, until the thawed one serves
                        rid = f"t-{uuid.uuid4().hex[:10]}"
                        r = await client.post(fe.api_url + "/chat/completions", headers={"x-request-id": rid}, json={
                            "model": name, "messages": [{"role": "user", "content": "go"}], "max_tokens": 2})
                        if r.status_code == 200 and served_by([victim], rid):
                            back = time.monotonic() - thawed
                            break
                        await asyncio.sleep(0.05)
                    return await asyncio.gather(*tasks), at, back

            results, at, back = asyncio.run(scenario())
            rows = summarise(results, 200, checker, at, [victim], LIVENESS)
            rows["thawed worker serving again, after SIGCONT"] = f"{back:.2f} s"
            title = (f"SIGSTOP one of 2 workers for {frozen_for:g} s, 20 streams x 200 tokens"
                     + (", --migration-limit 3" if migrate else ", no migration"))
            report(title, f"liveness {LIVENESS:g} s", rows)
    finally:
        for w in ws:
            w.kill()


def run_kill(env, model, checker) -> None:
    ws = [worker(env, model, "kill") for _ in range(3)]
    for w in ws:
        w.start(wait=False)
    for w in ws:
        w.wait_ready()
    try:
        with DynamoRun("out=dyn", "--migration-limit", "3", env=env) as fe:
            wait_instances(fe, "dyn://rel.kill.generate", 3)
            victim = ws[0]
            results, at = asyncio.run(streams_with_fault(fe, "kill", 60, 100, 1.0, victim.kill))
            report("kill -9 one of 3 workers, 60 streams x 100 tokens, --migration-limit 3", "",
                   summarise(results, 100, checker, at, [victim], LIVENESS))
    finally:
        for w in ws:
            w.kill()


def run_nats(env, model, checker, nats: NatsServer) -> None:
    ws = [worker(env, model, "nats") for _ in range(2)]
    for w in ws:
        w.start(wait=False)
    for w in ws:
        w.wait_ready()
    try:
        with DynamoRun("out=dyn", "--migration-limit", "3", env=env) as fe:
            wait_instances(fe, "dyn://rel.nats.generate", 2)
            results, at = asyncio.run(streams_with_fault(fe, "nats", 20, 120, 0.5, nats.kill))
            rows = summarise(results, 120, checker, at, ws, LIVENESS)
            statuses, spans = [], []
            for _ in range(3):  # requests while NATS is down
                t = time.monotonic()
                r = httpx.post(fe.api_url + "/chat/completions", timeout=120, json={
                    "model": "nats", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2})
                statuses.append(r.status_code)
                spans.append(time.monotonic() - t)
            rows["requests while NATS is down"] = f"statuses {statuses}, answered in {min(spans):.1f}-{max(spans):.1f} s"
            nats.tmpdir.mkdir(parents=True, exist_ok=True)
            nats.start()
            back = time.monotonic()
            while True:
                r = httpx.post(fe.api_url + "/chat/completions", timeout=120, json={
                    "model": "nats", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2})
                if r.status_code == 200:
                    break
                time.sleep(0.1)
            rows["first success after NATS restarted"] = f"{time.monotonic() - back:.2f} s"
            report("kill -9 NATS with 20 streams in flight, restart it", "", rows)
    finally:
        for w in ws:
            w.kill()


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def run_overload(env, model, checker) -> None:
    per_worker, queue = 4, 16
    ws = [worker(env, model, "load", "--max-inflight", str(per_worker)) for _ in range(2)]
    for w in ws:
        w.start(wait=False)
    for w in ws:
        w.wait_ready()
    try:
        with DynamoRun("out=dyn", "--queue-size", str(queue), "--queue-timeout", "5", env=env) as fe:
            wait_instances(fe, "dyn://rel.load.generate", 2)
            capacity = per_worker * len(ws)
            for factor in (1, 10, 30):
                clients = capacity * factor
                stats = asyncio.run(closed_loop(fe, clients, 20.0, checker, [fe.pid] + [w.pid for w in ws]))
                report(f"{clients} clients back to back for 20 s ({factor}x the {capacity} requests the workers take; "
                       f"queue {queue}, 5 s)", "", stats)
    finally:
        for w in ws:
            w.kill()


async def closed_loop(fe: DynamoRun, clients: int, seconds: float, checker: Checker, pids: list[int]) -> dict:
    counts: dict[str, int] = {}
    bad_outputs = 0
    latencies: list[float] = []
    retry_after: set[str] = set()
    end = time.monotonic() + seconds
    samples: list[tuple[float, list[int]]] = []

    async def sample() -> None:
        t0 = time.monotonic()
        while time.monotonic() < end:
            samples.append((time.monotonic() - t0, [rss_kb(p) for p in pids]))
            await asyncio.sleep(0.5)

    busy_lat: list[float] = []
    body = {"model": "load", "messages": [{"role": "user", "content": "go"}], "max_tokens": 20}
    # aiohttp: a cheaper client than httpx, which matters when it shares 2 cores with the server
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients + 10),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def one() -> None:
            nonlocal bad_outputs
            while time.monotonic() < end:
                t = time.monotonic()
                try:
                    async with session.post(fe.api_url + "/chat/completions", json=body) as r:
                        text = await r.text()
                        status, ra = r.status, r.headers.get("retry-after", "none")
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1
                    continue
                counts[str(status)] = counts.get(str(status), 0) + 1
                if status == 200:
                    latencies.append(time.monotonic() - t)
                    if checker.errors(json.loads(text)["choices"][0]["message"]["content"], 20) != (0, 0):
                        bad_outputs += 1
                elif status == 503:
                    busy_lat.append(time.monotonic() - t)
                    retry_after.add(ra)
                    await asyncio.sleep(0.05)  # an impatient client: retries long before Retry-After says

        await asyncio.gather(sample(), *(one() for _ in range(clients)))
    first = [s for t, s in samples if t < 5]
    last = [s for t, s in samples if t >= seconds - 5]
    fe_first = max(s[0] for s in first) // 1024
    fe_last = max(s[0] for s in last) // 1024
    fe_peak = max(s[0] for _, s in samples) // 1024
    w_peak = max(max(s[1:]) for _, s in samples) // 1024
    latencies.sort()
    busy_lat.sort()
    return {"responses by status": dict(sorted(counts.items())), "Retry-After values": sorted(retry_after),
            "503 latency p50 / p99": (f"{busy_lat[len(busy_lat) // 2]:.2f} / "
                                      f"{busy_lat[int(len(busy_lat) * 0.99)]:.2f} s") if busy_lat else "-",
            "200s with a wrong output": bad_outputs,
            "200 latency p50 / p99": (f"{latencies[len(latencies) // 2]:.2f} / "
                                      f"{latencies[int(len(latencies) * 0.99)]:.2f} s") if latencies else "-",
            "frontend RSS first 5 s / last 5 s / peak": f"{fe_first} / {fe_last} / {fe_peak} MiB",
            "worker RSS peak": f"{w_peak} MiB"}


FAULTS = ["freeze", "nofreeze", "longfreeze", "kill", "nats", "overload"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("faults", nargs="*", metavar="FAULT",
                    help=f"which faults to run, of {', '.join(FAULTS)} (default: all)")
    which = ap.parse_args().faults or FAULTS
    if unknown := set(which) - set(FAULTS):
        ap.error(f"unknown fault(s) {', '.join(sorted(unknown))}; known: {', '.join(FAULTS)}")
    model = build_tiny_hf_model(Path(tempfile.mkdtemp()), with_weights=False)
    checker = Checker(model)
    print(f"liveness bound {LIVENESS:g} s, {TOKEN_MS} ms per token; machine: {os.cpu_count()} cores (shared)")
    with EtcdServer() as etcd, NatsServer() as nats:
        env = {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url, "DET_TOKEN_DELAY_MS": str(TOKEN_MS),
               "DYN_LOG": "info,dynamo.worker.handlers=debug"}
        if "DYN_STREAM_LIVENESS_S" in os.environ:
            env["DYN_STREAM_LIVENESS_S"] = os.environ["DYN_STREAM_LIVENESS_S"]
        if "freeze" in which:
            run_freeze(env, model, checker, migrate=True)
        if "nofreeze" in which:
            run_freeze(env, model, checker, migrate=False)
        if "longfreeze" in which:
            run_freeze(env, model, checker, migrate=True, frozen_for=15)
        if "kill" in which:
            run_kill(env, model, checker)
        if "overload" in which:
            run_overload(env, model, checker)
        if "nats" in which:
            run_nats(env, model, checker, nats)


if __name__ == "__main__":
    main()
