"""``dynamo-run-infra``: etcd + NATS in one command, usable by a real runtime, stopped cleanly by Ctrl-C."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from asyncio.subprocess import Process
from pathlib import Path

import nats
import pytest

from dynamo.runtime import DistributedRuntime, RuntimeSettings
from dynamo.runtime.config import EtcdSettings, NatsSettings
from dynamo.runtime.v1_event_wire import EndpointScope
from harness.servers import free_port

pytestmark = pytest.mark.slow


def _infra_cmd(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "dynamo-run-infra"), *args]


async def _start_infra(etcd_port: int, peer_port: int, nats_port: int, data_dir: Path) -> Process:
    return await asyncio.create_subprocess_exec(
        *_infra_cmd("--etcd-port", str(etcd_port), "--etcd-peer-port", str(peer_port),
                    "--nats-port", str(nats_port), "--data-dir", str(data_dir)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def _stop(proc: Process) -> int:
    """Ctrl-C, as a user stops it; its exit status."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGINT)
    return await asyncio.wait_for(proc.wait(), 20)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


async def test_infra_serves_a_runtime_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    etcd_port, peer_port, nats_port = free_port(), free_port(), free_port()
    proc = await _start_infra(etcd_port, peer_port, nats_port, tmp_path / "infra")
    try:
        banner = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()  # type: ignore[union-attr]
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
        rc = await _stop(proc)
    assert rc == 0, (await proc.stderr.read()).decode()  # type: ignore[union-attr]
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


def _child_pid(parent: int, name: str) -> int:
    """The pid of ``parent``'s child whose command names ``name`` (Linux /proc)."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    for pid in children:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        if Path(cmd).name == name:
            return int(pid)
    raise AssertionError(f"no {name} child of {parent}: {children}")


async def _stderr_line(proc: Process, needle: str, timeout: float = 30) -> str:
    async def read() -> str:
        while True:
            line = (await proc.stderr.readline()).decode()  # type: ignore[union-attr]
            if not line:
                raise AssertionError(f"dynamo-run-infra ended before saying {needle!r}")
            if needle in line:
                return line
    return await asyncio.wait_for(read(), timeout)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the server children through /proc")
async def test_infra_restarts_a_server_killed_9_and_clients_reconnect(tmp_path: Path) -> None:
    """kill -9 nats-server, then etcd: each comes back on its port with its data, the other stays up, and
    a connected runtime keeps working (NATS reconnects; the etcd key under its lease is still there)."""
    etcd_port, peer_port, nats_port = free_port(), free_port(), free_port()
    proc = await _start_infra(etcd_port, peer_port, nats_port, tmp_path / "infra")
    rt = listener = None
    try:
        await asyncio.wait_for(proc.stdout.readline(), 30)  # type: ignore[union-attr]
        settings = RuntimeSettings(etcd=EtcdSettings(endpoints=[f"http://127.0.0.1:{etcd_port}"]),
                                   nats=NatsSettings(server=f"nats://127.0.0.1:{nats_port}"))
        rt = await DistributedRuntime.connect(settings)
        listener = await DistributedRuntime.connect(settings)  # (a process does not hear its own events)
        await rt.etcd.put("infra-test/mine", {"ok": True}, lease=True)
        got: asyncio.Queue[bytes] = asyncio.Queue()

        scope = EndpointScope("infra-test", "c", "e")
        pub = await rt.event_plane().publisher(scope, "events")
        await listener.event_plane().subscribe(scope, "events", lambda env: got.put_nowait(env.payload))

        etcd_pid = _child_pid(proc.pid, "etcd")
        os.kill(_child_pid(proc.pid, "nats-server"), signal.SIGKILL)
        line = await _stderr_line(proc, "nats-server exited")
        assert "-9" in line and "restarting" in line, line
        await _stderr_line(proc, "nats-server restarted")
        assert _child_pid(proc.pid, "etcd") == etcd_pid  # the other server was left alone
        # the runtime's NATS connection comes back by itself: an event goes through again
        for _ in range(100):
            await pub.publish(b"after")
            try:
                assert await asyncio.wait_for(got.get(), 0.2) == b"after"
                break
            except asyncio.TimeoutError:
                continue
        else:
            raise AssertionError("no event through the restarted nats-server")

        os.kill(etcd_pid, signal.SIGKILL)
        await _stderr_line(proc, "etcd exited")
        await _stderr_line(proc, "etcd restarted")
        # same data dir: the key is there, its lease kept alive by the runtime, and writes work again
        kv = await rt.etcd.get("infra-test/mine")
        assert kv is not None and kv.json() == {"ok": True}
        await rt.etcd.put("infra-test/after", "1")
        assert proc.returncode is None
    finally:
        for runtime in (rt, listener):
            if runtime is not None:
                await runtime.close()
        rc = await _stop(proc)
    assert rc == 0
    assert not _listening(etcd_port) and not _listening(nats_port)
