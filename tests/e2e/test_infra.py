"""``dynamo-run-infra``: etcd + NATS in one command, usable by a real runtime, stopped cleanly by Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from dynamo.runtime import DistributedRuntime, RuntimeSettings
from dynamo.runtime.config import EtcdSettings, NatsSettings
from harness.servers import free_port

pytestmark = pytest.mark.slow


def _infra_cmd(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "dynamo-run-infra"), *args]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


async def test_infra_serves_a_runtime_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    etcd_port, peer_port, nats_port = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        _infra_cmd("--etcd-port", str(etcd_port), "--etcd-peer-port", str(peer_port),
                   "--nats-port", str(nats_port), "--data-dir", str(tmp_path / "infra")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)  # type: ignore[union-attr]
        assert f"127.0.0.1:{etcd_port}" in banner and f"127.0.0.1:{nats_port}" in banner, banner
        # a real runtime connects, registers a key with its lease, and JetStream answers
        settings = RuntimeSettings(etcd=EtcdSettings(endpoints=[f"http://127.0.0.1:{etcd_port}"]),
                                   nats=NatsSettings(server=f"nats://127.0.0.1:{nats_port}"))
        rt = await DistributedRuntime.connect(settings)
        try:
            await rt.etcd.put("infra-test/key", {"ok": True}, lease=True)
            got = await rt.etcd.get("infra-test/key")
            assert got is not None and got.json() == {"ok": True}
        finally:
            await rt.close()
        nc = await nats.connect(f"nats://127.0.0.1:{nats_port}")
        try:
            info = await nc.jetstream().account_info()
            assert info is not None
        finally:
            await nc.close()
        assert (tmp_path / "infra" / "etcd").is_dir()
    finally:
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.to_thread(proc.wait, 20)
    assert rc == 0, proc.stderr.read()  # type: ignore[union-attr]
    assert not _listening(etcd_port) and not _listening(nats_port)


def test_infra_port_in_use_is_one_line_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(_infra_cmd("--nats-port", str(port), "--etcd-port", str(free_port()),
                                      "--etcd-peer-port", str(free_port()), "--data-dir", str(tmp_path)),
                           capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"NATS port 127.0.0.1:{port} is in use" in lines[0], r.stderr
