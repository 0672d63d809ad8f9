"""The fleet's own planes on one machine: real ``dynamo-run`` processes with no etcd and no NATS (the file
store, TCP requests, ZMQ events), as a user starts them with no setting.

* every internal listener of a worker (request plane, ZMQ publisher, status server) and of a frontend
  (response streams, its publisher) is bound to 127.0.0.1, read from the kernel's socket table (a test
  may only send loopback traffic, and a socket on 0.0.0.0 answers on loopback too);
* ``DYN_TCP_RPC_HOST`` opens them, and the worker says in one warning line what that exposes;
* the store's directory is created 0700 and its records 0600 even under umask 000, and a directory some
  other user could have planted (mode 0777, or another owner) is refused in one line, exit status 1.

``ETCD_ENDPOINTS`` and ``NATS_SERVER`` are emptied; an etcd or NATS on the default ports would change the
rule's choice, so the module is skipped when one answers there.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from harness.fleet import NO_INFRA_ENV, wait_for_model
from harness.proc import DynamoRun, DynamoWorker, cli_command, run_cli
from harness.sockets import Listening, listening_sockets, proc_net_available
from harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_default_infra"), pytest.mark.timeout(120),
              pytest.mark.skipif(not proc_net_available(), reason="reads the socket table from /proc (Linux)")]

ENDPOINT = "dyn://sec.backend.generate"
MODEL = "sec"
UNSET = {**NO_INFRA_ENV, "DYN_TCP_RPC_HOST": "", "DYN_TCP_RPC_PORT": "", "DYN_SYSTEM_HOST": "", "DYN_FILE_KV": ""}
UMASK_000 = ["sh", "-c", 'umask 000 && exec "$@"', "sh"]  # the modes must come from the code, not the umask
REFUSED_AS_ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")


def worker_args(model: Path) -> list[str]:
    return [f"in={ENDPOINT}", "out=echo_core", str(model), "--model-name", MODEL]


def logged_port(proc: DynamoWorker | DynamoRun, pattern: str) -> int:
    found = wait_until(lambda: re.search(pattern, proc.stderr_text()), 10, pattern)
    return int(found.group(1))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[dict[str, Any]]:
    """A worker (status server on) and a frontend on the defaults, the worker under umask 000."""
    tmp = tmp_path_factory.mktemp("planes")
    store = tmp / "store"
    env = {**UNSET, "DYN_FILE_KV": str(store)}
    worker = DynamoWorker(*worker_args(tiny_model), command=UMASK_000 + cli_command(),
                          env={**env, "DYN_SYSTEM_PORT": "0"}).start()
    fe = None
    try:
        fe = DynamoRun("out=dyn", env=env).start()
        wait_for_model(fe, MODEL, ENDPOINT, 1)
        # a request: the frontend opens its response-stream listener, the worker calls it
        r = httpx.post(fe.api_url + "/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        yield {"worker": worker, "frontend": fe, "store": store}
    finally:
        if fe is not None:
            fe.stop()
        worker.stop()


def test_every_internal_listener_is_on_loopback_by_default(fleet):
    worker, fe = fleet["worker"], fleet["frontend"]
    requests = logged_port(worker, r"request plane: listening for requests on 127\.0\.0\.1:(\d+)")
    status = logged_port(worker, r"system status server listening on http://127\.0\.0\.1:(\d+)")
    mine = listening_sockets(worker.pid)  # (an echo engine publishes no events: no event socket)
    assert {Listening("127.0.0.1", p) for p in (requests, status)} <= mine, mine
    assert all(x.loopback for x in mine), mine
    # the frontend: its HTTP port (the harness's --http-host 127.0.0.1) and its response streams (a
    # round-robin frontend publishes no events)
    theirs = listening_sockets(fe.pid)
    assert len(theirs) >= 2 and all(x.loopback for x in theirs), theirs
    for proc in (worker, fe):
        line = [x for x in proc.stderr_text().splitlines() if "runtime.distributed: discovery " in x]
        assert len(line) == 1 and "(loopback only; one machine)" in line[0], line
        assert "request plane tcp, event plane zmq (no NATS at nats://localhost:4222)" in line[0], line
        assert "reachable from other machines" not in proc.stderr_text()


def test_a_fresh_store_is_created_0700_with_0600_records(fleet):
    store = fleet["store"]
    paths = [store, *store.rglob("*")]
    dirs = {str(p): stat.S_IMODE(p.stat().st_mode) for p in paths if p.is_dir()}
    files = {str(p): stat.S_IMODE(p.stat().st_mode) for p in paths if p.is_file()}
    assert set(dirs.values()) == {0o700}, dirs
    assert set(files.values()) == {0o600}, files
    assert any("/kv/" in f for f in files) and any("/leases/" in f for f in files), files  # the worker's records


def test_dyn_tcp_rpc_host_opens_the_planes_and_says_what_is_exposed(tmp_path, tiny_model):
    env = {**UNSET, "DYN_FILE_KV": str(tmp_path / "store"), "DYN_TCP_RPC_HOST": "0.0.0.0"}
    with DynamoWorker(*worker_args(tiny_model), env=env) as worker:
        requests = logged_port(worker, r"request plane: listening for requests on 0\.0\.0\.0:(\d+)")
        mine = listening_sockets(worker.pid)
        assert Listening("0.0.0.0", requests) in mine, mine
        warnings = [x for x in worker.stderr_text().splitlines() if "reachable from other machines (" in x]
    assert len(warnings) == 1, worker.stderr_text()
    assert "WARNING" in warnings[0] and "no authentication" in warnings[0]
    assert "requests 0.0.0.0" in warnings[0] and "past the frontend's API key" in warnings[0]
    assert "events 0.0.0.0" in warnings[0]  # where its publishers would bind (an echo engine has none)
    assert "set DYN_FLEET_SECRET" in warnings[0]  # what closes them


def refused(args: list[str], env: dict[str, str]) -> str:
    """The one line a worker that refuses its store prints, after checking it exited with status 1."""
    result = run_cli(args, env=env, timeout=30)
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.returncode == 1, result.stderr
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_store_others_may_write_is_refused(tmp_path, tiny_model):
    planted = tmp_path / "store"
    planted.mkdir()
    os.chmod(planted, 0o777)
    line = refused(worker_args(tiny_model), {**UNSET, "DYN_FILE_KV": str(planted)})
    assert f"{planted} is writable by group or others (mode 0777)" in line, line
    assert f"chmod 700 {planted}" in line and "DYN_FILE_KV" in line
    assert os.listdir(planted) == []  # nothing written into it


def test_the_default_store_planted_open_is_refused(tmp_path, tiny_model):
    planted = tmp_path / "dynamo_store_kv"  # $TMPDIR/dynamo_store_kv, the default
    planted.mkdir()
    os.chmod(planted, 0o777)
    line = refused(worker_args(tiny_model), {**UNSET, "TMPDIR": str(tmp_path)})
    assert f"{planted} is writable by group or others" in line, line


@REFUSED_AS_ROOT_ONLY
def test_the_default_store_owned_by_another_user_is_refused_unless_named(tmp_path, tiny_model):
    planted = tmp_path / "dynamo_store_kv"
    planted.mkdir()
    os.chmod(planted, 0o755)
    os.chown(planted, 65534, 65534)
    line = refused(worker_args(tiny_model), {**UNSET, "TMPDIR": str(tmp_path)})
    assert f"{planted} is owned by another user (uid 65534)" in line, line
    # named deliberately, a trusted owner's directory is used (root may write it)
    with DynamoWorker(*worker_args(tiny_model), env={**UNSET, "TMPDIR": str(tmp_path), "DYN_FILE_KV": str(planted)}):
        assert (planted / "leases").is_dir()


def test_turning_kv_events_off_apart_is_refused_in_one_line(tmp_path, tiny_model):
    """``DYN_KV_EVENTS_1X=0`` chose whether Dynamo 1.x's form went out beside ours; there is one form now,
    so a worker refuses it rather than publish what the setting asked it not to."""
    env = {**UNSET, "DYN_FILE_KV": str(tmp_path / "store"), "DYN_KV_EVENTS_1X": "0"}
    line = refused([f"in={ENDPOINT}", "out=mocker", str(tiny_model), "--model-name", MODEL], env)
    assert "DYN_KV_EVENTS_1X=0" in line and "one form" in line, line
