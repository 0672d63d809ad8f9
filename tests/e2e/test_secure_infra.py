"""A fleet on locked servers: ``dynamo-run-infra --secure`` starts etcd (TLS with client certificates, a
user and password) and nats-server (TLS with client certificates, a token), and ``dynamo-run`` processes
given only what its ``secure.env`` says serve end to end over them: discovery on etcd, requests, events and
the model card's files on NATS, KV-routed on the mocker's events, and a stream whose worker is killed -9
carries on on the other worker. A process with a wrong password, a wrong token or no client certificate
stops with one line naming what to check and a non-zero status; the generated secrets are the owner's alone.
"""

from __future__ import annotations

import json
import ssl
import stat
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from harness.fleet import (
    WORKER_LOG,
    chat,
    client_for,
    request_id,
    served_by,
    stream_killing_its_worker,
    wait_for_model,
)
from harness.proc import DynamoRun, DynamoWorker, run_cli
from harness.secure_infra import secure_infra
from harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FLAGS = ["--discovery-backend", "etcd", "--request-plane", "nats", "--event-plane", "nats"]
MOCKER_ARGS = {"num_gpu_blocks": 512, "block_size": 16, "speedup_ratio": 20.0}
LONG_PROMPT = " ".join(f"word{i}" for i in range(80))


@pytest.fixture(scope="module")
def infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with secure_infra(tmp_path_factory.mktemp("secure-infra") / "infra") as started:
        yield started


@pytest.fixture(scope="module")
def fleet_env(infra: dict[str, Any]) -> dict[str, str]:
    return {**infra["env"], "DYN_LEASE_TTL": "3", "DYN_FILE_KV": "", "DYN_TCP_RPC_HOST": ""}


@pytest.fixture(scope="module")
def workers(fleet_env: dict[str, str], tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DynamoWorker]]:
    mocker_args = tmp_path_factory.mktemp("mocker") / "mocker.json"
    mocker_args.write_text(json.dumps(MOCKER_ARGS))
    model = str(tiny_model)
    specs = {
        "kv1": (["in=dyn://skv.mocker.generate", "out=mocker", model, "--model-name", "skv",
                 "--extra-engine-args", str(mocker_args)], 0),
        "kv2": (["in=dyn://skv.mocker.generate", "out=mocker", model, "--model-name", "skv",
                 "--extra-engine-args", str(mocker_args)], 0),
        "mig1": (["in=dyn://smig.backend.generate", "out=echo_core", model, "--model-name", "smig",
                  "--migration-limit", "3"], 50),
        "mig2": (["in=dyn://smig.backend.generate", "out=echo_core", model, "--model-name", "smig",
                  "--migration-limit", "3"], 50),
    }
    started: dict[str, DynamoWorker] = {}
    try:
        for name, (args, delay) in specs.items():
            started[name] = DynamoWorker(*args, *FLAGS, env={**fleet_env, **WORKER_LOG},
                                         delay_ms=delay).start(wait=False)
        for w in started.values():
            w.wait_ready(60)
        yield started
    finally:
        for w in started.values():
            w.kill()


def test_the_servers_are_locked_and_the_secrets_private(infra):
    env, data, ports = infra["env"], infra["data"], infra["ports"]
    assert env["ETCD_ENDPOINTS"] == f"https://127.0.0.1:{ports['etcd']}"
    assert env["NATS_SERVER"] == f"tls://127.0.0.1:{ports['nats']}"
    assert env["ETCD_AUTH_USERNAME"] and env["ETCD_AUTH_PASSWORD"] and env["NATS_AUTH_TOKEN"]
    assert len(env["DYN_FLEET_SECRET"]) >= 16
    for secret in [infra["env_file"], *(data / "tls").glob("*key.pem"), *(data / "credentials").iterdir()]:
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    # etcd answers nobody without a client certificate, and nobody without a password with one
    tls = ssl.create_default_context(cafile=env["ETCD_AUTH_CA"])
    with pytest.raises(httpx.HTTPError):
        httpx.post(env["ETCD_ENDPOINTS"] + "/v3/kv/range", json={"key": "AA=="}, verify=tls)
    tls.load_cert_chain(env["ETCD_AUTH_CLIENT_CERT"], env["ETCD_AUTH_CLIENT_KEY"])
    r = httpx.post(env["ETCD_ENDPOINTS"] + "/v3/kv/range", json={"key": "AA=="}, verify=tls)
    assert r.status_code != 200 and "user name is empty" in r.text, r.text


def test_a_fleet_serves_kv_routed_over_the_locked_servers(fleet_env, workers, tmp_path):
    kv = [workers["kv1"], workers["kv2"]]
    log = tmp_path / "decisions.jsonl"
    with DynamoRun("out=dyn", "--router-mode", "kv", *FLAGS, env={**fleet_env, "DYN_ROUTER_LOG": str(log)}) as fe:
        line = [x for x in fe.stderr_text().splitlines() if "runtime.distributed: discovery " in x]
        assert len(line) == 1 and "discovery etcd" in line[0] and "fleet secret on" in line[0], line
        wait_for_model(fe, "skv", "dyn://skv.mocker.generate", 2, timeout=30)
        prefix = " ".join(f"block{i}" for i in range(200))
        rid = request_id("skv-first")
        chat(client_for(fe), "skv", prefix + " first", stream=False, rid=rid, max_tokens=4)
        holder = wait_until(lambda: served_by(kv, rid), 5, "the worker of the first request")[0]
        # the first request's KV events came back over NATS (TLS, token) before the second is routed
        wait_until(lambda: decisions(log, "stored"), 10, "the first request's KV events")
        rid = request_id("skv-again")
        chat(client_for(fe), "skv", prefix + " again", stream=True, rid=rid, max_tokens=4)
        assert served_by(kv, rid) == [holder]
        again = wait_until(lambda: decisions(log, "route")[1:2], 5, "the second routing decision")[0]
        assert again["worker"] == f"{holder.instance_id:x}" and again["candidates"][again["worker"]]["overlap"] > 0


def decisions(path: Path, ev: str) -> list[dict[str, Any]]:
    try:
        return [x for x in map(json.loads, path.read_text().splitlines()) if x["ev"] == ev]
    except (OSError, ValueError):
        return []


def test_a_stream_migrates_when_its_worker_is_killed(fleet_env, workers):
    mig = [workers["mig1"], workers["mig2"]]
    with DynamoRun("out=dyn", *FLAGS, env=fleet_env) as fe:
        wait_for_model(fe, "smig", "dyn://smig.backend.generate", 2, timeout=30)
        rid = request_id("smig")
        events, victim, done = stream_killing_its_worker(fe, "smig", LONG_PROMPT, mig, after_chunks=8, rid=rid)
        assert victim is not None and done
        assert not [e for e in events if "error" in e], events
        finishes = [e["choices"][0]["finish_reason"] for e in events
                    if e.get("choices") and e["choices"][0]["finish_reason"]]
        assert finishes == ["length"], finishes
        other = mig[1 - mig.index(victim)]
        assert served_by([other], rid) == [other], "the stream did not move to the other worker"


@pytest.mark.parametrize("wrong, names", [
    ({"ETCD_AUTH_PASSWORD": "not the password"}, "ETCD_AUTH_PASSWORD"),
    ({"ETCD_AUTH_CLIENT_CERT": "", "ETCD_AUTH_CLIENT_KEY": ""}, "ETCD_AUTH_CLIENT_CERT"),
    ({"ETCD_AUTH_CA": ""}, "ETCD_AUTH_CA"),
    ({"NATS_AUTH_TOKEN": "not the token"}, "NATS_AUTH"),
    ({"NATS_TLS_CLIENT_CERT_PATH": "", "NATS_TLS_CLIENT_KEY_PATH": ""}, "NATS_TLS_CLIENT_CERT_PATH"),
    ({"NATS_TLS_CA_CERT_PATH": "/no/such/ca.pem"}, "NATS_TLS_CA_CERT_PATH"),
], ids=["etcd-password", "etcd-no-client-cert", "etcd-unknown-ca", "nats-token", "nats-no-client-cert",
        "nats-ca-missing"])
def test_wrong_credentials_are_one_line_and_a_failed_exit(fleet_env, tiny_model, wrong, names):
    result = run_cli(["in=dyn://swrong.backend.generate", "out=echo_core", str(tiny_model), *FLAGS],
                     env={**fleet_env, **wrong}, timeout=30)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    naming = [x for x in lines if names in x]
    assert len(naming) == 1, result.stderr
    assert len(lines) <= 2, result.stderr
