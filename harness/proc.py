"""Run the ``dynamo-run`` CLI as a user would: a real subprocess, talked to over real sockets.

:class:`DynamoRun` starts ``dynamo-run in=http ...`` on a free port, waits until ``/v1/models`` answers,
and stops it with SIGTERM.  Everything the process writes to stderr is collected so a failing test can
show it (``proc.stderr_text()``).  :func:`run_cli` runs a one-shot command (stdin / batch / errors).

The command is the ``dynamo-run`` console script beside the test interpreter, so the tests exercise the
installed entry point; ``DYN_TOKEN_ECHO_DELAY_MS`` defaults to 0 to keep the suite fast.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Mapping, Self, Sequence

ANSI = re.compile(r"\x1b\[[0-9;]*m")

__all__ = ["ChildProcess", "DynamoRun", "DynamoWorker", "run_cli", "cli_command", "free_port", "cli_env"]


def free_port() -> int:
    """A port that was free a moment ago: only for an address where nothing must listen (a dead peer), or
    for a server that cannot bind port 0 and is retried on another port when the bind fails."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_command(name: str = "dynamo-run") -> list[str]:
    """The installed console script, else ``python -m dynamo.cli`` (same code)."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    found = shutil.which(name)
    if found:
        return [found]
    if name == "dynamo-run":
        return [sys.executable, "-m", "dynamo.cli"]
    raise FileNotFoundError(f"{name} console script not found")


def cli_env(extra: Mapping[str, str] | None = None, *, delay_ms: float | int = 0) -> dict[str, str]:
    env = dict(os.environ)
    # a test must not inherit a developer's log filter or metric prefix
    for key in ("DYN_LOG", "DYN_METRICS_PREFIX", "DYN_LOGGING_JSONL"):
        env.pop(key, None)
    env["DYN_TOKEN_ECHO_DELAY_MS"] = str(delay_ms)
    env["HF_HUB_OFFLINE"] = "1"  # never reach for the network from a test
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env


def run_cli(
    args: Sequence[str],
    *,
    input: str | None = None,
    env: Mapping[str, str] | None = None,
    delay_ms: float | int = 0,
    timeout: float = 30.0,
    cwd: str | Path | None = None,
    program: str = "dynamo-run",
) -> subprocess.CompletedProcess[str]:
    """Run the CLI to completion; stdin is ``input`` (or empty, so never a terminal)."""
    return subprocess.run(
        cli_command(program) + list(args),
        input=input if input is not None else "",
        capture_output=True,
        text=True,
        env=cli_env(env, delay_ms=delay_ms),
        timeout=timeout,
        cwd=cwd,
    )


class ChildProcess:
    """The life cycle :class:`DynamoRun` and :class:`DynamoWorker` share.

    A child process in its own session, stdin and stdout closed, stderr in a file readable at any time
    (what a failing test shows); :meth:`start` returns once it is ready, :meth:`stop` ends it with SIGTERM
    (SIGKILL if ignored).  A subclass gives the :meth:`command`, :meth:`start` (how readiness shows) and how
    errors name the process (:meth:`_name`).  A subclass with ``stdout_to_log`` keeps stdout too, in the
    same file (for a command that prints to stdout what a test reads, e.g. ``dynamo serve``'s tables).
    """

    stdout_to_log = False

    def __init__(
        self,
        env: Mapping[str, str] | None,
        delay_ms: float | int,
        startup_timeout: float,
        cwd: str | Path | None = None,
    ) -> None:
        self.env = cli_env(env, delay_ms=delay_ms)
        self.startup_timeout = startup_timeout
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr = tempfile.TemporaryFile()
        self.returncode: int | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> Self:
        """Start the process and return once it is ready."""
        raise NotImplementedError

    def _name(self) -> str:
        return str(self.command())

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._stderr if self.stdout_to_log else subprocess.DEVNULL,
            stderr=self._stderr,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,  # a Ctrl-C in the test runner must not reach it first
        )

    def _wait_serving(self, ready: Callable[[], bool], timeout: float) -> None:
        """Poll ``ready()`` until it holds; raise with the log if the process exits first or ``timeout`` passes
        (then it is killed)."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self._name()} exited with {self.proc.returncode} before serving:\n"
                                   f"{self.stderr_text()}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"{self._name()} not serving after {timeout}s:\n{self.stderr_text()}")

    def stderr_text(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", errors="replace")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Send SIGTERM (graceful shutdown; or ``sig``) without waiting."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL (a crash: nothing is cleaned up, a worker's lease expires by itself) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None:
            self.returncode = self.proc.returncode

    def wait(self, timeout: float = 15.0) -> int:
        assert self.proc is not None
        self.returncode = self.proc.wait(timeout)
        return self.returncode

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in ``timeout``. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(
                    f"{self._name()} ignored SIGTERM for {timeout}s:\n{self.stderr_text()}") from None
        self.returncode = self.proc.returncode
        return self.returncode

    def __enter__(self) -> Self:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# the HTTP service's start-up line: "OpenAI-compatible HTTP service listening on http://127.0.0.1:41234"
LISTENING = re.compile(r"HTTP service listening on https?://\S+?:(?P<port>\d+)")


class DynamoRun(ChildProcess):
    """``dynamo-run in=http <args>`` on a loopback port it binds itself (port 0), for the duration of a
    ``with`` block; :attr:`port` is the one it got (known once :meth:`start` returned).

    ``host`` is its ``--http-host`` and the address the test reaches it at (another network namespace's
    address in a fleet across hosts); ``command_prefix`` runs it inside something (``ip netns exec NS``)."""

    def __init__(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        delay_ms: float | int = 0,
        startup_timeout: float = 30.0,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        command_prefix: Sequence[str] = (),
        port: int = 0,
    ) -> None:
        self.args = list(args)
        self.host = host
        self.command_prefix = list(command_prefix)
        self.port = port  # 0: the kernel picks; _ready reads what it picked from the log
        self.api_key = api_key  # its --api-key: readiness asks /v1/models with it
        super().__init__(env, delay_ms, startup_timeout)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def command(self) -> list[str]:
        key = ["--api-key", self.api_key] if self.api_key else []
        return [*self.command_prefix, *cli_command(), "in=http", *self.args, *key, "--http-host", self.host,
                "--http-port", str(self.port)]

    def _name(self) -> str:
        return "dynamo-run"

    def start(self) -> "DynamoRun":
        """Start it and return once ``/v1/models`` answers (on the port it logged)."""
        self._spawn()
        self._wait_serving(self._ready, self.startup_timeout)
        return self

    def _ready(self) -> bool:
        """The port is known (the log line, when it was started on port 0), then :meth:`_serving`."""
        if self.port == 0:
            found = LISTENING.search(ANSI.sub("", self.stderr_text()))
            if found is None:
                return False
            self.port = int(found.group("port"))
        return self._serving()

    def _serving(self) -> bool:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(self.base_url + "/v1/models", headers=headers),
                                        timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False


def in_thread(fn, *args, **kwargs) -> threading.Thread:
    """Run ``fn`` in a daemon thread (for a client that must be busy while the test does something)."""
    t = threading.Thread(target=fn, args=args, kwargs=kwargs, daemon=True)
    t.start()
    return t


class DynamoWorker(ChildProcess):
    """A background process that is not an HTTP server: a ``dynamo-run in=dyn://... out=...`` worker
    (the default), or any ``command`` (e.g. a Python worker script using ``dynamo.runtime``).

    ``start()`` returns once the worker logged that it serves (``worker dyn://... serving <model> as
    <type> (instance <hex>)``), which also gives :attr:`instance_hex`; with ``ready=None`` (a custom
    command that logs nothing) it returns at once.  stderr goes to a file that can be read at any time
    (:meth:`stderr_text`), e.g. to see which requests a worker served at debug level.  Stop it with
    :meth:`terminate` (SIGTERM, no wait), :meth:`kill` (SIGKILL: a crash) or :meth:`stop`.
    """

    READY = re.compile(r"worker (?P<endpoint>\S+) serving (?P<model>.+) as (?P<type>\w+) \(instance (?P<hex>[0-9a-f]+)\)")

    def __init__(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        delay_ms: float | int = 0,
        command: Sequence[str] | None = None,
        ready: "re.Pattern[str] | None | str" = "default",
        startup_timeout: float = 30.0,
        cwd: str | Path | None = None,
    ) -> None:
        self.args = list(args)
        self._command = list(command) if command is not None else None
        self.ready = self.READY if ready == "default" else (re.compile(ready) if isinstance(ready, str) else ready)
        self.ready_match: "re.Match[str] | None" = None
        super().__init__(env, delay_ms, startup_timeout, cwd)

    def command(self) -> list[str]:
        if self._command is not None:
            return self._command + self.args
        return cli_command() + self.args

    def start(self, wait: bool = True) -> "DynamoWorker":
        """Start the process; with ``wait`` also :meth:`wait_ready`."""
        self._spawn()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float | None = None) -> "DynamoWorker":
        """Block until the ready line appears in stderr (raise with the log if it exits or times out)."""
        assert self.proc is not None, "start() first"
        if self.ready is None or self.ready_match is not None:
            return self
        self._wait_serving(self._logged_ready, self.startup_timeout if timeout is None else timeout)
        return self

    def _logged_ready(self) -> bool:
        assert self.ready is not None
        self.ready_match = self.ready.search(self.stderr_text())
        return self.ready_match is not None

    SYSTEM_LISTENING = r"system status server listening on http://\S+?:(?P<port>\d+)"
    PLANNER_METRICS = r"planner metrics on http://\S+?:(?P<port>\d+)"

    def logged_port(self, pattern: str, timeout: float = 10.0) -> int:
        """The port in the first log line matching ``pattern`` (its group ``port``): where a listener it was
        told to bind on port 0 landed (:attr:`SYSTEM_LISTENING`, :attr:`PLANNER_METRICS`)."""
        regex = re.compile(pattern)
        found: list[int] = []

        def logged() -> bool:
            m = regex.search(self.stderr_text())
            if m:
                found.append(int(m.group("port")))
            return bool(m)

        self._wait_serving(logged, timeout)
        return found[0]

    def system_port(self, timeout: float = 10.0) -> int:
        """The port its status server bound (``DYN_SYSTEM_PORT=0``: the kernel picked it), from its log."""
        return self.logged_port(self.SYSTEM_LISTENING, timeout)

    @property
    def instance_hex(self) -> str:
        """The worker's instance id (its etcd lease) in hex, as in keys and subjects."""
        assert self.ready_match is not None and "hex" in self.ready.groupindex, "no instance id known"
        return self.ready_match.group("hex")

    @property
    def instance_id(self) -> int:
        value = int(self.instance_hex, 16)
        return value - (1 << 64) if value >= (1 << 63) else value
