"""The ``local`` connector: worker processes on this machine, started from ``--decode-cmd`` /
``--prefill-cmd``.

* **Start**: the command is split like a shell would (``shlex``), run in its own session and process group
  (a Ctrl-C at the planner's terminal does not reach the workers) with stdout and stderr in a log file per
  worker under ``--log-dir``.  A worker is *starting* until its log says it serves (``worker dyn://...
  serving ...``, the line every ``dynamo-run`` worker writes once registered), then *ready*.
* **Replace**: a worker that exits without being asked to is replaced at once; one that keeps dying before
  it serves (a wrong command) is restarted with a growing delay (1 s doubling to 30 s) and its log's last
  line is logged.
* **Scale down drains**: the chosen worker (a starting one first, else the newest) gets SIGTERM, on which a
  ``dynamo-run`` worker deregisters (frontends stop sending to it), finishes the requests it runs and
  exits; it is killed only if it is still there ``--drain-timeout`` seconds later.  A draining worker no
  longer counts as capacity.
* **Adopt**: the workers it runs are written to a state file (``<state-dir>/local-<namespace>.json``: pid,
  the process's start time from ``/proc``, its command line, pool and log).  A planner that starts again
  reads it and adopts every listed process that is still the same process (same pid, start time and
  command line), so restarting the planner does not disturb the fleet.  On exit the workers keep running
  unless ``--stop-workers-on-exit``.

Hand-written rather than a process supervisor library (supervisor, circus): those run as their own
daemon with their own configuration, and what is needed here (spawn, watch, signal, adopt by pid) is a
few calls to the standard library.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from dynamo.errors import UserError
from dynamo.planner.connector import DECODE, POOLS, PREFILL, FleetState, PoolState

log = logging.getLogger(__name__)

READY = re.compile(r"worker \S+ serving .+ \(instance [0-9a-f]+\)")
RECONCILE_EVERY_S = 0.25
BACKOFF_MAX_S = 30.0


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of ``/proc/<pid>/stat``), which with
    the pid names one process even after the pid is reused; None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may contain spaces: split after its closing one
    rest = stat[stat.rindex(")") + 2:].split()
    if rest[0] == "Z":  # a zombie has exited
        return None
    return int(rest[19])


def process_cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


@dataclass
class LocalWorker:
    pool: str
    pid: int
    start_ticks: int
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None  # None when adopted from an earlier planner
    ready: bool = False
    draining_since: float | None = None
    started: float = field(default_factory=time.monotonic)
    _log_offset: int = 0

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return process_start_ticks(self.pid) == self.start_ticks

    def exit_status(self) -> str:
        if self.proc is not None and self.proc.returncode is not None:
            code = self.proc.returncode
            return f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        return "exited"

    def check_ready(self) -> bool:
        """Read what the log gained since last time; ready once the serving line shows."""
        if self.ready:
            return True
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_offset)
                chunk = f.read()
        except OSError:
            return False
        # keep a line's worth of overlap so a line split between two reads is still seen
        text = chunk.decode(errors="replace")
        if READY.search(text):
            self.ready = True
        else:
            self._log_offset += max(0, len(chunk) - 4096)
        return self.ready

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)  # its own process group: reach whatever it started too
        except (ProcessLookupError, PermissionError):
            pass

    def last_log_line(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def record(self) -> dict:
        return {"pool": self.pool, "pid": self.pid, "start_ticks": self.start_ticks, "argv": self.argv,
                "log": str(self.log_path)}


def _wait_all_gone(workers: list[LocalWorker], deadline: float) -> None:
    """Until every worker exited or the deadline passed (adopted workers are not our children: no
    ``waitpid`` for them, so their ``/proc`` entries are polled)."""
    while any(w.alive() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)


class LocalConnector:
    """Keeps ``targets[pool]`` worker processes running on this machine."""

    def __init__(self, namespace: str, decode_cmd: str, prefill_cmd: str | None, state_dir: Path, log_dir: Path,
                 drain_timeout_s: float = 60.0, stop_workers_on_exit: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.argv: dict[str, list[str]] = {}
        for pool, cmd in ((DECODE, decode_cmd), (PREFILL, prefill_cmd)):
            if cmd is None:
                continue
            try:
                argv = shlex.split(cmd)
            except ValueError as e:
                raise UserError(f"--{pool}-cmd: {e}") from None
            if not argv:
                raise UserError(f"--{pool}-cmd is empty")
            self.argv[pool] = argv
        self.state_file = state_dir / f"local-{namespace}.json"
        self.log_dir = log_dir
        self.drain_timeout_s = drain_timeout_s
        self.stop_workers_on_exit = stop_workers_on_exit
        self.env = env
        self.workers: list[LocalWorker] = []
        self.targets: dict[str, int] = {pool: 0 for pool in POOLS}
        self.failures: dict[str, int] = {pool: 0 for pool in POOLS}
        self.next_start: dict[str, float] = {pool: 0.0 for pool in POOLS}
        self._task: asyncio.Task[None] | None = None
        self._counter = 0

    # ------------------------------------------------------------------ the Connector face

    async def start(self) -> FleetState:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        self._adopt()
        for pool in POOLS:
            self.targets[pool] = sum(1 for w in self.workers if w.pool == pool)
        self._task = asyncio.create_task(self._reconcile_forever(), name="planner-local-connector")
        return self._state()

    async def fleet(self) -> FleetState:
        return self._state()

    async def scale(self, prefill: int, decode: int) -> bool:
        if prefill and PREFILL not in self.argv:
            raise UserError("a prefill pool needs --prefill-cmd")
        self.targets[PREFILL], self.targets[DECODE] = prefill, decode
        self._reconcile()
        return True

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.stop_workers_on_exit:
            for w in self.workers:
                w.signal(signal.SIGTERM)
            await asyncio.to_thread(_wait_all_gone, self.workers, time.monotonic() + self.drain_timeout_s)
            for w in self.workers:
                if w.alive():
                    w.signal(signal.SIGKILL)
            self.workers = []
        else:
            log.info("leaving %d worker(s) running (the next planner adopts them from %s)",
                     sum(1 for w in self.workers if w.draining_since is None), self.state_file)
        self._save()

    # ------------------------------------------------------------------ the work

    def _state(self) -> FleetState:
        def pool(name: str) -> PoolState:
            ws = [w for w in self.workers if w.pool == name]
            return PoolState(ready=sum(1 for w in ws if w.ready and w.draining_since is None),
                             starting=sum(1 for w in ws if not w.ready and w.draining_since is None),
                             draining=sum(1 for w in ws if w.draining_since is not None))

        return FleetState(prefill=pool(PREFILL), decode=pool(DECODE))

    async def _reconcile_forever(self) -> None:
        while True:
            try:
                self._reconcile()
            except Exception:  # noqa: BLE001 - one bad pass (a full disk for the logs) must not end supervision
                log.exception("local connector: reconcile failed; retrying")
            await asyncio.sleep(RECONCILE_EVERY_S)

    def _reconcile(self) -> None:
        changed = self._reap()
        now = time.monotonic()
        for w in self.workers:
            if w.draining_since is None and not w.ready and w.check_ready():
                self.failures[w.pool] = 0
                log.info("%s worker pid %d serving (%.1f s after start)", w.pool, w.pid, now - w.started)
            if w.draining_since is not None and now - w.draining_since > self.drain_timeout_s:
                log.warning("%s worker pid %d still draining after %.0f s: killing it", w.pool, w.pid,
                            self.drain_timeout_s)
                w.signal(signal.SIGKILL)
        for pool in POOLS:
            active = [w for w in self.workers if w.pool == pool and w.draining_since is None]
            missing = self.targets[pool] - len(active)
            if missing > 0 and pool in self.argv and now >= self.next_start[pool]:
                for _ in range(missing):
                    self._spawn(pool)
                changed = True
            elif missing < 0:
                # leave the cheapest first: a worker still starting serves nobody; then the newest
                active.sort(key=lambda w: (w.ready, w.started))
                for w in active[:-missing]:
                    self._drain(w)
                changed = True
        if changed:
            self._save()

    def _reap(self) -> bool:
        gone = [w for w in self.workers if not w.alive()]
        for w in gone:
            self.workers.remove(w)
            if w.draining_since is not None:
                log.info("%s worker pid %d drained and exited (%s, %.1f s)", w.pool, w.pid, w.exit_status(),
                         time.monotonic() - w.draining_since)
                continue
            if not w.ready:
                self.failures[w.pool] += 1
                delay = min(BACKOFF_MAX_S, 2.0 ** (self.failures[w.pool] - 1))
                self.next_start[w.pool] = time.monotonic() + delay
                log.error("%s worker pid %d %s before serving: %s (log %s); next start in %.0f s", w.pool, w.pid,
                          w.exit_status(), w.last_log_line() or "no output", w.log_path, delay)
            else:
                log.warning("%s worker pid %d %s unasked; replacing it (log %s)", w.pool, w.pid, w.exit_status(),
                            w.log_path)
        return bool(gone)

    def _spawn(self, pool: str) -> None:
        argv = self.argv[pool]
        self._counter += 1
        log_path = self.log_dir / f"{pool}-{int(time.time())}-{os.getpid()}-{self._counter}.log"
        with log_path.open("ab") as out:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True, env=self.env)
            except OSError as e:
                self.failures[pool] += 1
                self.next_start[pool] = time.monotonic() + min(BACKOFF_MAX_S, 2.0 ** (self.failures[pool] - 1))
                log.error("--%s-cmd could not start: %s", pool, e)
                return
        ticks = process_start_ticks(proc.pid) or 0
        self.workers.append(LocalWorker(pool, proc.pid, ticks, argv, log_path, proc=proc))
        log.info("started %s worker pid %d (log %s)", pool, proc.pid, log_path)

    def _drain(self, w: LocalWorker) -> None:
        w.draining_since = time.monotonic()
        log.info("draining %s worker pid %d (%s)", w.pool, w.pid, "serving" if w.ready else "not serving yet")
        w.signal(signal.SIGTERM)

    def _save(self) -> None:
        records = [w.record() for w in self.workers]
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"workers": records}, indent=1))
        tmp.replace(self.state_file)

    def _adopt(self) -> None:
        try:
            data = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("state file %s unreadable (%s); adopting nothing", self.state_file, e)
            return
        for rec in data.get("workers", []):
            try:
                pid, ticks, argv, pool = int(rec["pid"]), int(rec["start_ticks"]), list(rec["argv"]), rec["pool"]
                log_path = Path(rec["log"])
            except (KeyError, TypeError, ValueError):
                continue
            if pool not in POOLS or process_start_ticks(pid) != ticks or process_cmdline(pid) != argv:
                continue
            w = LocalWorker(pool, pid, ticks, argv, log_path)
            w.check_ready()
            self.workers.append(w)
            log.info("adopted %s worker pid %d (%s)", pool, pid, "serving" if w.ready else "starting")
