"""The supervisor of ``dynamo serve``: one child process per replica, restarted when it dies, stopped in order.

Plain asyncio subprocesses, not a process-manager library: the original used circus, which runs its own
daemon and control sockets and would be a new dependency; what a graph needs is small and is all here:

* **start** every service's replicas, dependencies first: a service starts once every replica of each
  service it depends on has said it is ready (the runner's ready line, :data:`READY_MARK`), so a frontend
  never takes requests before what it calls serves; services with no edge between them start together;
* **logs**: each child's stdout and stderr lines are written to ours, prefixed ``[Service:replica]``;
* **restart**: a replica that dies (killed, crashed, exited) is started again after a backoff (0.5 s,
  doubling to 10 s; back to 0.5 s after 30 s of running), so a crash loop does not spin;
* **fatal**: a replica that reports it cannot start (the runner's fatal line and exit status) is not
  restarted: its line is shown once, the graph is stopped and ``dynamo serve`` exits 1;
* **stop**: SIGINT/SIGTERM stop the services in reverse start order, dependents first, so a frontend stops
  taking requests before what it calls goes away; each replica gets SIGTERM (it drains), then SIGKILL
  after ``stop_timeout``.  Children run in their own sessions (a terminal's Ctrl-C reaches only us, and we
  keep the order) with ``PR_SET_PDEATHSIG``, so they get SIGTERM if the supervisor itself is killed.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import IO

from dynamo.aio import cancel_and_wait

from .runner import FATAL_EXIT, FATAL_MARK, READY_MARK

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 10.0
STABLE_S = 30.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the supervisor's own stop still covers the usual cases
        pass


@dataclass
class ServiceProcs:
    """What to run for one service: its command per replica and its environment."""

    name: str
    workers: int
    command: list[str]  # the replica index is appended
    env: dict[str, str]
    cwd: str | None = None
    depends: list[str] = field(default_factory=list)  # services that must be ready before this one starts


@dataclass
class Replica:
    service: str
    index: int
    proc: asyncio.subprocess.Process | None = None
    task: "asyncio.Task[None] | None" = None
    pumps: list["asyncio.Task[None]"] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set by its first ready line, for good

    @property
    def label(self) -> str:
        return f"{self.service}:{self.index}"


class Supervisor:
    def __init__(self, services: list[ServiceProcs], *, stop_timeout: float = 30.0,
                 out: IO[str] | None = None) -> None:
        self.services = services  # start order: dependencies first
        self.stop_timeout = stop_timeout
        self.out = out or sys.stderr
        self.replicas = {s.name: [Replica(s.name, i) for i in range(s.workers)] for s in services}
        self.stopping = asyncio.Event()
        self.fatal: str | None = None

    def say(self, text: str) -> None:
        self.out.write(f"dynamo serve: {text}\n")
        self.out.flush()

    async def _pump(self, replica: Replica, stream: asyncio.StreamReader, sink: IO[str]) -> None:
        prefix = f"[{replica.label}] "
        while True:
            line = await stream.readline()
            if not line:
                return
            text = line.decode("utf-8", errors="replace").rstrip("\n")
            if text.startswith(FATAL_MARK):
                self.fatal = self.fatal or text[len(FATAL_MARK):]
                continue
            if text.startswith(READY_MARK):
                replica.ready.set()
                continue
            sink.write(prefix + text + "\n")
            sink.flush()

    async def _spawn(self, svc: ServiceProcs, replica: Replica) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            *svc.command, str(replica.index), env=svc.env, cwd=svc.cwd, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
            preexec_fn=_die_with_parent)
        assert proc.stdout is not None and proc.stderr is not None
        replica.proc = proc
        replica.pumps = [asyncio.create_task(self._pump(replica, proc.stdout, sys.stdout)),
                         asyncio.create_task(self._pump(replica, proc.stderr, sys.stderr))]
        self.say(f"started {replica.label} (pid {proc.pid})")
        return proc

    async def _keep(self, svc: ServiceProcs, replica: Replica) -> None:
        """Run one replica until the graph stops, restarting it with backoff when it dies."""
        backoff = BACKOFF_START_S
        while not self.stopping.is_set():
            started = time.monotonic()
            proc = await self._spawn(svc, replica)
            if self.stopping.is_set():  # the stop pass may have run while it was being spawned
                proc.send_signal(signal.SIGTERM)
            rc = await proc.wait()
            await asyncio.gather(*replica.pumps)  # its last lines, the fatal one included
            if self.stopping.is_set():
                return
            if rc == FATAL_EXIT:
                self.fatal = self.fatal or f"service {svc.name} failed to start (exit {rc})"
                self.stopping.set()
                return
            if time.monotonic() - started >= STABLE_S:
                backoff = BACKOFF_START_S
            how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"
            self.say(f"{replica.label} (pid {proc.pid}) {how}; restarting in {backoff:g}s")
            try:
                await asyncio.wait_for(self.stopping.wait(), backoff)
                return
            except asyncio.TimeoutError:
                pass
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _stop_service(self, name: str) -> None:
        replicas = self.replicas[name]
        for r in replicas:
            if r.proc is not None and r.proc.returncode is None:
                r.proc.send_signal(signal.SIGTERM)
        waits = [r.proc.wait() for r in replicas if r.proc is not None and r.proc.returncode is None]
        if not waits:
            return
        done, pending = await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=self.stop_timeout)
        if pending:
            self.say(f"{name}: {len(pending)} replica(s) still running {self.stop_timeout:g}s after SIGTERM: killing")
            for r in replicas:
                if r.proc is not None and r.proc.returncode is None:
                    r.proc.kill()
            await asyncio.gather(*pending)

    async def _wait_ready(self, svc: ServiceProcs) -> None:
        """Until every replica of every service ``svc`` depends on has been ready once."""
        waiting = [r for dep in svc.depends for r in self.replicas.get(dep, []) if not r.ready.is_set()]
        if waiting:
            names = ", ".join(dict.fromkeys(r.service for r in waiting))
            self.say(f"{svc.name} starts once {names} {'is' if ',' not in names else 'are'} ready")
        for r in waiting:
            await r.ready.wait()

    async def _start_all(self) -> None:
        """Each service once its dependencies are ready; services are started in parallel where the graph
        allows (a service waits only for its own dependencies)."""
        async def start(svc: ServiceProcs) -> None:
            await self._wait_ready(svc)
            for replica in self.replicas[svc.name]:
                replica.task = asyncio.create_task(self._keep(svc, replica))

        await asyncio.gather(*(start(svc) for svc in self.services))

    async def run(self) -> int:
        """Start the graph, supervise it until a signal or a fatal failure, stop it; the exit status."""
        loop = asyncio.get_running_loop()
        signals = 0

        def on_signal(signum: int) -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                self.say(f"received {signal.Signals(signum).name}: stopping the graph, dependents first")
                self.stopping.set()
            else:  # a second signal: stop now
                for replicas in self.replicas.values():
                    for r in replicas:
                        if r.proc is not None and r.proc.returncode is None:
                            r.proc.kill()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        starting = asyncio.create_task(self._start_all())
        try:
            await self.stopping.wait()
            await cancel_and_wait(starting)
            for svc in reversed(self.services):
                await self._stop_service(svc.name)
            await asyncio.gather(*(r.task for rs in self.replicas.values() for r in rs if r.task is not None))
        finally:
            for replicas in self.replicas.values():  # whatever happened above, leave nothing running
                for r in replicas:
                    if r.proc is not None and r.proc.returncode is None:
                        r.proc.kill()
                        await r.proc.wait()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if self.fatal:
            self.out.write(f"error: {self.fatal}\n")
            self.out.flush()
            return 1
        self.say("stopped")
        return 0


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """Our environment for a child, plus ``extra``; unbuffered, so its lines reach us as written."""
    env = dict(os.environ)
    if env.get("PYTHONPATH"):  # the children start in the working directory: relative entries would move
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env
