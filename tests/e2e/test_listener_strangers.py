"""What a stranger gets from the fleet's other internal listeners (the request plane's own test is
test_request_plane_strangers.py, the KV transfer server's tests/unit/disagg/test_kv_transfer.py): a
disaggregated mocker fleet of real processes on the one-machine default, with and without a fleet secret,
whose ports are

* the frontend's response-stream (call-home) listener and its ZMQ publisher (read from the kernel's socket
  table: every TCP port the frontend listens on but its HTTP port),
* the prefill worker's ZMQ publisher and its system status server (from its log).

Each gets the payloads of harness/strangers.py (garbage, an HTTP request, truncated messages of every
framing the fleet speaks, some announcing 256 MiB or 2^62 bytes), and then a flood of connections held
open, half of them with a partial message. While the flood is held and afterwards, a long prompt is served
through the frontend with its prefill done by the prefill worker, every process is still running, and none
logged a traceback.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from harness.fleet import NO_INFRA_ENV
from harness.proc import DynamoRun, DynamoWorker
from harness.sockets import listening_sockets, proc_net_available
from harness.strangers import flood, payloads, poke
from harness.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_default_infra"), pytest.mark.timeout(240),
              pytest.mark.skipif(not proc_net_available(), reason="reads the socket table from /proc (Linux)")]

MODEL = "lstr"
SECRET = "the listener strangers' secret, 32"
UNSET = {**NO_INFRA_ENV, "DYN_TCP_RPC_HOST": "", "DYN_TCP_RPC_PORT": "", "DYN_FLEET_SECRET": "",
         "DYN_FLEET_SECRET_FILE": "", "DYN_SYSTEM_HOST": ""}
MOCKER_ARGS = {"num_gpu_blocks": 512, "block_size": 16, "speedup_ratio": 20.0}


def logged_port(proc: DynamoWorker | DynamoRun, pattern: str) -> int:
    return int(wait_until(lambda: re.search(pattern, proc.stderr_text()), 15, pattern).group(1))


@pytest.fixture(scope="module", params=[None, SECRET], ids=["no-secret", "secret"])
def fleet(request, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("listener-strangers")
    args_file = tmp / "mocker.json"
    args_file.write_text(json.dumps(MOCKER_ARGS))
    env = {**UNSET, "DYN_FILE_KV": str(tmp / "store")}
    if request.param:
        env["DYN_FLEET_SECRET"] = request.param
    common = ["out=mocker", str(tiny_model), "--model-name", MODEL, "--extra-engine-args", str(args_file)]
    prefill = DynamoWorker(f"in=dyn://{MODEL}.prefill.generate", *common, "--disaggregation-mode", "prefill",
                           env={**env, "DYN_SYSTEM_PORT": "0"}).start(wait=False)
    decode = DynamoWorker(f"in=dyn://{MODEL}.backend.generate", *common, "--disaggregation-mode", "decode",
                          env=env).start(wait=False)
    fe = None
    try:
        prefill.wait_ready(60)
        decode.wait_ready(60)
        fe = DynamoRun("out=dyn", "--router-mode", "kv", "--max-local-prefill-length", "32", env=env).start()
        wait_until(lambda: ready(fe, {prefill.instance_id, decode.instance_id}), 30, "the frontend to see both")
        served_remotely(fe)  # the call-home listener and the transfer server are open from here on
        http_port = int(fe.base_url.rsplit(":", 1)[1])
        ports = {
            "prefill events": logged_port(prefill, r"events: publishing kv-events of .* on tcp://127\.0\.0\.1:(\d+)"),
            "prefill status": logged_port(prefill, r"system status server listening on http://127\.0\.0\.1:(\d+)"),
        }
        for sock in listening_sockets(fe.pid):
            if sock.port != http_port:
                ports[f"frontend {sock.port}"] = sock.port  # its response streams and its publisher
        assert len(ports) >= 4, ports
        yield {"frontend": fe, "workers": [prefill, decode], "ports": ports}
    finally:
        if fe is not None:
            fe.stop()
        prefill.stop()
        decode.stop()


def ready(fe: DynamoRun, want: set[int]) -> bool:
    health = httpx.get(fe.base_url + "/health", timeout=5).json()
    return want <= {i["instance_id"] for i in health.get("instances", [])} and bool(health.get("models"))


def remote_prefills(fe: DynamoRun) -> float:
    found = re.search(rf'disagg_prefill_total\{{model="{MODEL}",where="remote"\}} ([0-9.e+]+)',
                      httpx.get(fe.base_url + "/metrics", timeout=5).text)
    return float(found.group(1)) if found else 0.0


def served_remotely(fe: DynamoRun) -> None:
    """A long prompt answered, its prefill done by the prefill worker (the mocker hands no KV state over)."""
    before = remote_prefills(fe)
    prompt = " ".join(f"w{os.urandom(3).hex()}" for _ in range(120))
    r = httpx.post(fe.api_url + "/completions", timeout=30,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert remote_prefills(fe) == before + 1


def still_serving(fleet: dict[str, Any]) -> None:
    served_remotely(fleet["frontend"])
    for proc in (fleet["frontend"], *fleet["workers"]):
        assert proc.running, proc.stderr_text()[-3000:]
        assert "Traceback" not in proc.stderr_text(), proc.stderr_text()[-5000:]


def test_every_kind_of_bad_message_on_every_listener_leaves_the_fleet_serving(fleet):
    async def everything() -> None:
        await asyncio.gather(*(poke(port, data) for port in fleet["ports"].values()
                               for data in payloads().values()))

    asyncio.run(everything())
    still_serving(fleet)


def test_a_flood_of_connections_on_every_listener_leaves_the_fleet_serving(fleet):
    asyncio.run(flood(list(fleet["ports"].values()), lambda: asyncio.to_thread(still_serving, fleet)))
    still_serving(fleet)
