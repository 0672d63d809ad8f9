"""A llama.cpp worker whose native library dies of SIGILL while serving, behind a KV-less frontend on the
zero-infrastructure default: the worker passes the preflight (its child decodes twice), then traps inside
``llama_decode`` on a later step (harness/native_fault.py sends it a real SIGILL from there).  The worker's
log says what killed it (Python's fault handler: the signal and the stacks, ``llama_decode`` among them), the
request it was serving fails or moves, and the frontend routes every later request to the worker that is left,
as for any dead worker; with no worker left it answers 503s.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from harness.fleet import NO_INFRA_ENV, WORKER_LOG, served_by, wait_for_model
from harness.native_fault import native_fault_env
from harness.proc import DynamoRun, DynamoWorker
from harness.smollm2 import SMOLLM2_MODEL
from harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ENDPOINT = "dyn://ns.backend.generate"


@pytest.fixture(scope="module")
def fleet(gguf: Path, no_default_infra: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("native-fault")
    env = {**NO_INFRA_ENV, "DYN_FILE_KV": str(tmp / "store")}
    args = (f"in={ENDPOINT}", "out=llamacpp", str(gguf), "--context-length", "512")
    doomed = DynamoWorker(*args, env={**env, **WORKER_LOG, **native_fault_env(tmp, "after:4")}).start(wait=False)
    healthy = DynamoWorker(*args, env={**env, **WORKER_LOG}).start(wait=False)
    fe = None
    try:
        for w in (doomed, healthy):
            w.wait_ready(180)
        fe = DynamoRun("out=dyn", "--router-mode", "round-robin", env=env).start()
        wait_for_model(fe, SMOLLM2_MODEL, ENDPOINT, 2, timeout=30)
        yield {"doomed": doomed, "healthy": healthy, "frontend": fe}
    finally:
        if fe is not None:
            fe.stop()
        for w in (doomed, healthy):
            w.kill()


def ask(fe: DynamoRun, rid: str) -> httpx.Response:
    return httpx.post(fe.api_url + "/chat/completions", timeout=60, headers={"x-request-id": rid}, json={
        "model": SMOLLM2_MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
        "temperature": 0})


def test_worker_dying_in_the_library_is_routed_around(fleet):
    fe, doomed, healthy = fleet["frontend"], fleet["doomed"], fleet["healthy"]
    statuses = [ask(fe, f"before-{i}").status_code for i in range(4)]  # round-robin: two reach the doomed one
    assert doomed.wait(30) == -signal.SIGILL
    log = doomed.stderr_text()
    assert "Fatal Python error: Illegal instruction" in log and "llama_decode" in log, log[-2000:]
    assert statuses.count(200) >= 3, statuses  # only the request it was serving may fail
    after = [ask(fe, f"after-{i}") for i in range(6)]
    assert [r.status_code for r in after] == [200] * 6, [r.text for r in after]
    assert all(served_by([healthy], f"after-{i}") for i in range(6))
    # the last worker gone: 503s, and the frontend keeps serving its other routes
    healthy.kill()
    healthy.wait(10)
    r = wait_until(lambda: (x := ask(fe, "none-left")).status_code == 503 and x, 30, "a 503 with no worker left")
    assert r.json()["error"]["code"] == 503 or r.json()["error"]["type"], r.text
    assert httpx.get(fe.base_url + "/health", timeout=10).status_code in (200, 503)
