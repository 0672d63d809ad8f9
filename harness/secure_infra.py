"""``dynamo-run-infra --secure`` as a test fixture: locked etcd and NATS on free ports, and the settings its
``secure.env`` gives every process of the fleet."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from harness.proc import free_port


def read_env_file(path: Path) -> dict[str, str]:
    """``NAME=value`` lines as a shell's ``. file`` would read them (values are shell-quoted)."""
    env = {}
    for line in path.read_text().splitlines():
        name, _, value = line.partition("=")
        env[name] = shlex.split(value)[0] if value else ""
    return env


@contextmanager
def secure_infra(data: Path) -> Iterator[dict[str, Any]]:
    """Started and ready: ``data`` (its folder), ``ports``, ``banner`` (its first two lines), ``env`` (what
    ``secure.env`` says) and ``env_file``; stopped with SIGINT on leaving."""
    ports = {"etcd": free_port(), "peer": free_port(), "nats": free_port()}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "dynamo-run-infra"), "--secure", "--data-dir", str(data),
         "--etcd-port", str(ports["etcd"]), "--etcd-peer-port", str(ports["peer"]),
         "--nats-port", str(ports["nats"])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        banner = [proc.stdout.readline() for _ in range(2)]
        assert "set -a; . " in banner[1], (banner, proc.poll())
        env_file = data / "secure.env"
        yield {"data": data, "ports": ports, "banner": banner, "env": read_env_file(env_file),
               "env_file": env_file}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
