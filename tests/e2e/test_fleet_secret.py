"""A fleet with a secret, as real ``dynamo-run`` processes on the one-machine default (file store, TCP
requests, ZMQ events), every member given ``DYN_FLEET_SECRET_FILE`` (a 0600 file):

* it serves end to end, KV-routed on the worker's events (which now travel over CURVE);
* a process with another secret, or none, that dials the worker's request-plane port (its address in
  discovery) gets no token, and the worker says why in one line and keeps serving;
* a fake worker with another secret, registered in discovery under the same endpoint and model, never
  receives a request (its request counter stays at zero) while the real worker serves every one;
* a subscriber with another secret, or none, reads none of the worker's KV events that a member reads;
* a secret file others may read is refused in one line.

``tests/e2e/fleet_peer.py`` is the stranger (and the member it is compared with). ``ETCD_ENDPOINTS`` and
``NATS_SERVER`` are emptied; the module is skipped when an etcd or NATS answers on the default ports.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from harness.fleet import NO_INFRA_ENV, WORKER_LOG, scrape, served_by, wait_for_model
from harness.proc import DynamoRun, DynamoWorker, cli_env, run_cli
from harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_default_infra"), pytest.mark.timeout(180)]

NS, COMP = "sec", "mocker"
ENDPOINT = f"dyn://{NS}.{COMP}.generate"
MODEL = "sec"
SECRET = "the fleet's secret, 32 characters"
OTHER = "another fleet's secret, not ours"
PEER = Path(__file__).with_name("fleet_peer.py")
UNSET = {**NO_INFRA_ENV, "DYN_TCP_RPC_HOST": "", "DYN_TCP_RPC_PORT": "", "DYN_FLEET_SECRET": "",
         "DYN_FLEET_SECRET_FILE": ""}


def worker_args(model: Path, mocker_args: Path) -> list[str]:
    return [f"in={ENDPOINT}", "out=mocker", str(model), "--model-name", MODEL, "--extra-engine-args", str(mocker_args)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fleetsecret")
    secret_file = tmp / "fleet.secret"
    secret_file.write_text(SECRET + "\n")
    os.chmod(secret_file, 0o600)
    mocker_args = tmp / "mocker.json"
    mocker_args.write_text(json.dumps({"num_gpu_blocks": 512, "block_size": 16, "speedup_ratio": 20.0}))
    base = {**UNSET, "DYN_FILE_KV": str(tmp / "store")}
    member = {**base, "DYN_FLEET_SECRET_FILE": str(secret_file)}
    decisions = tmp / "decisions.jsonl"
    worker = DynamoWorker(*worker_args(tiny_model, mocker_args), env={**member, **WORKER_LOG}).start()
    fe = None
    try:
        fe = DynamoRun("out=dyn", "--router-mode", "kv", env={**member, "DYN_ROUTER_LOG": str(decisions)}).start()
        wait_for_model(fe, MODEL, ENDPOINT, 1)
        yield {"worker": worker, "frontend": fe, "base": base, "member": member, "decisions": decisions,
               "model": tiny_model, "mocker_args": mocker_args, "secret_file": secret_file}
    finally:
        if fe is not None:
            fe.stop()
        worker.stop()


def ask(fe: DynamoRun, content: str, rid: str) -> None:
    r = httpx.post(fe.api_url + "/chat/completions", timeout=30, headers={"x-request-id": rid}, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def decisions(path: Path, ev: str) -> list[dict[str, Any]]:
    try:
        return [x for x in map(json.loads, path.read_text().splitlines()) if x["ev"] == ev]
    except (OSError, ValueError):
        return []


def peer(mode: str, *args: str, env: dict[str, str]) -> dict[str, Any]:
    """Run fleet_peer.py with ``env``; its one JSON line."""
    done = subprocess.run([sys.executable, str(PEER), mode, *args], env=cli_env(env), capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fleet_with_the_secret_serves_kv_routed(fleet):
    fe, worker, log = fleet["frontend"], fleet["worker"], fleet["decisions"]
    for proc in (worker, fe):
        line = [x for x in proc.stderr_text().splitlines() if "runtime.distributed: discovery " in x]
        assert len(line) == 1 and "(loopback only; one machine; fleet secret on)" in line[0], line
    prefix = " ".join(f"block{i}" for i in range(100))
    ask(fe, prefix + " first", "secret-first")
    # the worker's KV events reached the frontend over CURVE before the second request is routed
    wait_until(lambda: decisions(log, "stored"), 10, "the first request's KV events in the decision log")
    ask(fe, prefix + " again", "secret-again")
    first, again = wait_until(lambda: (r := decisions(log, "route")) and len(r) >= 2 and r[:2], 10, "two decisions")
    assert again["candidates"][again["worker"]]["overlap"] > 0
    assert "fleet-secret" not in fe.stderr_text() + worker.stderr_text()  # no refusal among members


@pytest.mark.parametrize("secret", [OTHER, None], ids=["another-secret", "no-secret"])
def test_a_stranger_gets_no_token_out_of_a_worker(fleet, secret):
    worker = fleet["worker"]
    env = {**fleet["base"], **({"DYN_FLEET_SECRET": secret} if secret else {})}
    result = peer("ask", f"{NS}.{COMP}.generate", env=env)
    assert result["instances"] == 1 and result["tokens"] == 0, result
    assert result["errors"] and all(e.startswith("NoRespondersError") for e in result["errors"]), result
    why = "another DYN_FLEET_SECRET" if secret else "no DYN_FLEET_SECRET there"
    wait_until(lambda: re.search(r"request plane: refused a connection from 127\.0\.0\.1:\d+: .*(" + why + ")",
                                 worker.stderr_text()), 10, "the worker's line about the stranger")
    # the same program with the fleet's secret gets its tokens: the refusal was the secret, nothing else
    member = peer("ask", f"{NS}.{COMP}.generate", env={**fleet["base"], "DYN_FLEET_SECRET": SECRET})
    assert member["tokens"] > 0 and not member["errors"], member
    ask(fleet["frontend"], "still serving", f"after-stranger-{secret is None}")


def test_a_fake_worker_with_another_secret_never_receives_a_request(fleet):
    fe, worker = fleet["frontend"], fleet["worker"]
    fake = DynamoWorker(*worker_args(fleet["model"], fleet["mocker_args"]),
                        env={**fleet["base"], **WORKER_LOG, "DYN_FLEET_SECRET": OTHER, "DYN_SYSTEM_PORT": "0"}).start()
    try:
        status = wait_until(lambda: re.search(r"system status server listening on (http://127\.0\.0\.1:\d+)",
                                              fake.stderr_text()), 10, "the fake's status server")
        wait_for_model(fe, MODEL, ENDPOINT, 2)  # the frontend sees both instances
        rids = [f"fake-{i}" for i in range(8)]
        for i, rid in enumerate(rids):
            ask(fe, f"question {i} " + "word " * i, rid)  # every one answered
        assert all(served_by([worker], rid) for rid in rids)
        assert not any(served_by([fake], rid) for rid in rids)
        requests = [s.value for s in scrape(status.group(1) + "/metrics")
                    if s.name == "dynamo_component_requests_total"]
        assert sum(requests) == 0, requests
        # the frontend tried it and said why, the fake said why too
        assert re.search(r"request plane: 127\.0\.0\.1:\d+ failed the fleet-secret check: .*another DYN_FLEET_SECRET",
                         fe.stderr_text()), fe.stderr_text()[-3000:]
        assert "request plane: refused a connection from 127.0.0.1:" in fake.stderr_text()
    finally:
        fake.stop()


def test_a_subscriber_with_another_secret_reads_no_event(fleet):
    worker, fe = fleet["worker"], fleet["frontend"]
    assert worker.instance_hex
    result = peer("listen", f"{NS}.{COMP}", worker.instance_hex, fe.api_url, MODEL, SECRET, OTHER, "-",
                  env=fleet["base"])
    member, other, none = result["read"]
    assert member > 0 and other == 0 and none == 0, result
    failures = " ".join(result["failures"])
    assert "another DYN_FLEET_SECRET, or none" in failures and "this process has none" in failures, failures
    wait_until(lambda: "events: refused a subscriber on tcp://127.0.0.1:" in worker.stderr_text(), 10,
               "the worker's line about the strangers")


def test_planes_opened_to_the_network_with_the_secret_do_not_warn(fleet, tmp_path):
    env = {**fleet["member"], "DYN_FILE_KV": str(tmp_path / "store"), "DYN_TCP_RPC_HOST": "0.0.0.0"}
    with DynamoWorker(*worker_args(fleet["model"], fleet["mocker_args"]), env=env) as worker:
        line = [x for x in worker.stderr_text().splitlines() if "runtime.distributed: discovery " in x]
    assert len(line) == 1 and "requests 0.0.0.0" in line[0] and "fleet secret on" in line[0], line
    assert "have no authentication" not in worker.stderr_text()


def test_a_secret_file_others_may_read_is_refused(fleet, tmp_path):
    loose = tmp_path / "loose.secret"
    loose.write_text(SECRET)
    os.chmod(loose, 0o644)
    result = run_cli(worker_args(fleet["model"], fleet["mocker_args"]),
                     env={**fleet["base"], "DYN_FILE_KV": str(tmp_path / "store"), "DYN_FLEET_SECRET_FILE": str(loose)})
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert str(loose) in lines[0] and f"chmod 600 {loose}" in lines[0], lines[0]
