"""Run the ``dynamo-run`` CLI as a user would: a real subprocess, talked to over real sockets.

:class:`DynamoRun` starts ``dynamo-run in=http ...`` on a free port, waits until ``/v1/models`` answers,
and stops it with SIGTERM.  Everything the process writes to stderr is collected so a failing test can
show it (``proc.stderr_text()``).  :func:`run_cli` runs a one-shot command (stdin / batch / errors).

The command is the ``dynamo-run`` console script beside the test interpreter, so the tests exercise the
installed entry point; ``DYN_TOKEN_ECHO_DELAY_MS`` defaults to 0 to keep the suite fast.
"""

from __future__ import annotations

import os
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
from typing import Mapping, Sequence

__all__ = ["DynamoRun", "run_cli", "cli_command", "free_port", "cli_env"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_command(name: str = "dynamo-run") -> list[str]:
    """The installed console script, else ``python -m dynamo.run`` (same code)."""
    script = Path(sys.executable).parent / name
    if script.exists():
        return [str(script)]
    found = shutil.which(name)
    if found:
        return [found]
    if name == "dynamo-run":
        return [sys.executable, "-m", "dynamo.run"]
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


class DynamoRun:
    """``dynamo-run in=http <args>`` on a free loopback port, for the duration of a ``with`` block."""

    def __init__(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        delay_ms: float | int = 0,
        startup_timeout: float = 30.0,
    ) -> None:
        self.args = list(args)
        self.port = free_port()
        self.env = cli_env(env, delay_ms=delay_ms)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr = tempfile.TemporaryFile()
        self.returncode: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def command(self) -> list[str]:
        return cli_command() + ["in=http", *self.args, "--http-host", "127.0.0.1", "--http-port", str(self.port)]

    def start(self) -> "DynamoRun":
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            env=self.env,
            start_new_session=True,  # a Ctrl-C in the test runner must not reach it first
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"dynamo-run exited with {self.proc.returncode} before serving:\n{self.stderr_text()}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/v1/models", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"dynamo-run not serving after {self.startup_timeout}s:\n{self.stderr_text()}")

    def stderr_text(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", errors="replace")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Send SIGTERM (graceful shutdown; or ``sig``) without waiting."""
        assert self.proc is not None
        self.proc.send_signal(sig)

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
                raise RuntimeError(f"dynamo-run ignored SIGTERM for {timeout}s:\n{self.stderr_text()}")
        self.returncode = self.proc.returncode
        return self.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "DynamoRun":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def in_thread(fn, *args, **kwargs) -> threading.Thread:
    """Run ``fn`` in a daemon thread (for a client that must be busy while the test does something)."""
    t = threading.Thread(target=fn, args=args, kwargs=kwargs, daemon=True)
    t.start()
    return t
