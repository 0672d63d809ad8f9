"""``--http-workers N``: N frontend processes serving one HTTP port, under a supervising parent.

Why processes: one Python frontend saturates one core long before the machine does (docs/performance.md);
N processes use N cores.  How:

* The parent binds N listening sockets to the same address with ``SO_REUSEPORT`` (the kernel spreads new
  connections over them by a hash of the client's address and port) and forks one worker per socket.
  Before that it binds once *without* ``SO_REUSEPORT``, so a port already in use (even by another
  ``--http-workers`` group) is an error here, as without the flag.  The parent keeps every socket open:
  a worker that dies is forked again on the same socket, and the connections that arrived meanwhile wait
  in its accept queue instead of being refused.
* Each worker is a whole frontend: its own event loop, engine (echo) or discovery from etcd (out=dyn;
  with ``--router-mode kv`` each follows the workers' KV events over NATS, as separate frontends do).
* Signals: workers run in their own process group, so a Ctrl-C at the terminal reaches the parent only;
  SIGINT/SIGTERM to the parent is passed on to every worker as one SIGTERM (each stops gracefully, as a
  single frontend does), a second one is passed on again (stop now).  Workers get SIGTERM if the parent
  dies (``PR_SET_PDEATHSIG``).
* A worker that exits with status 1 or 2 reported an error (bad configuration, etcd unreachable...) that
  its siblings will hit too: everything stops and the parent exits with that status.  A worker that dies
  otherwise (a signal, the OOM killer) is restarted; more than ``MAX_RESTARTS`` restarts within
  ``RESTART_WINDOW_S`` stop everything (exit 1).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING, Callable

from dynamo.errors import UserError

if TYPE_CHECKING:
    from dynamo.run_config import RunConfig

log = logging.getLogger(__name__)

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
KILL_AFTER_S = 10.0  # after the graceful period, workers still running are killed
_SIGNALS = (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


def bind_sockets(host: str, port: int, n: int, backlog: int) -> list[socket.socket]:
    """N listening sockets on (host, port) sharing it with ``SO_REUSEPORT``; port 0 picks one free port."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise UserError("--http-workers needs SO_REUSEPORT (Linux); run one frontend per port instead")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))  # no SO_REUSEPORT: fails if anyone listens there, even a REUSEPORT group
        port = probe.getsockname()[1]
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    finally:
        probe.close()
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError as e:
        for sock in socks:
            sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return socks


class Supervisor:
    """Forks the HTTP workers, passes signals on, restarts the ones that die; see the module docstring."""

    def __init__(self, socks: list[socket.socket], serve: Callable[[], int], grace_s: float) -> None:
        self.socks = socks
        self.serve = serve
        self.grace_s = grace_s
        self.children: dict[int, int] = {}  # pid -> worker index
        self.restarts: deque[float] = deque()
        self.stopping_since: float | None = None
        self.exit_code = 0
        self._parent_pid = os.getpid()
        self._old_mask: set[int | signal.Signals] = set()

    def run(self) -> int:
        self._old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            for index in range(len(self.socks)):
                self._spawn(index)
            log.info("%d HTTP worker processes on port %d (pids %s)", len(self.socks), self.socks[0].getsockname()[1],
                     " ".join(map(str, self.children)))
            while self.children:
                info = signal.sigtimedwait(_SIGNALS, 1.0)
                if info is None:
                    self._check_deadline()
                elif info.si_signo == signal.SIGCHLD:
                    self._reap()
                else:
                    self._on_stop_signal(info.si_signo)
            return self.exit_code
        finally:
            for sock in self.socks:
                sock.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, self._old_mask)

    # -- children
    def _spawn(self, index: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._child(index)  # never returns
        self.children[pid] = index

    def _child(self, index: int) -> None:
        rc = 1
        try:
            os.setpgid(0, 0)  # the terminal's Ctrl-C goes to the parent, which passes it on once
            _die_with_parent(self._parent_pid)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, self._old_mask)
            from dynamo.frontend.http.listen import adopt

            for i, sock in enumerate(self.socks):
                if i != index:
                    sock.close()
            adopt(self.socks[index], index)
            rc = self.serve()
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except KeyboardInterrupt:
            rc = 130
        except BaseException:
            traceback.print_exc()
            rc = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(rc)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            index = self.children.pop(pid, None)
            if index is None:
                continue
            rc = os.waitstatus_to_exitcode(status)
            self._on_exit(index, pid, rc)

    def _on_exit(self, index: int, pid: int, rc: int) -> None:
        how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"
        code = 128 - rc if rc < 0 else rc
        if self.stopping_since is not None:
            log.debug("HTTP worker %d (pid %d) %s", index, pid, how)
            if code not in (0, 130, 128 + signal.SIGTERM) and self.exit_code == 0:
                self.exit_code = code
            return
        if rc in (1, 2):  # it said why on stderr; its siblings would hit the same error
            log.error("HTTP worker %d (pid %d) %s; stopping the others", index, pid, how)
            self.exit_code = rc
            self._stop_all()
            return
        now = time.monotonic()
        self.restarts.append(now)
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
            self.restarts.popleft()
        if len(self.restarts) > MAX_RESTARTS:
            log.error("HTTP worker %d (pid %d) %s; %d restarts in %gs: giving up", index, pid, how,
                      len(self.restarts) - 1, RESTART_WINDOW_S)
            self.exit_code = 1
            self._stop_all()
            return
        self._spawn(index)
        new_pid = next(p for p, i in self.children.items() if i == index)
        log.warning("HTTP worker %d (pid %d) %s; restarted it (pid %d)", index, pid, how, new_pid)

    # -- stopping
    def _on_stop_signal(self, signo: int) -> None:
        if self.stopping_since is None:
            log.info("%s received, stopping %d HTTP worker(s)", signal.Signals(signo).name, len(self.children))
        else:
            log.warning("second %s: telling the HTTP workers to exit now", signal.Signals(signo).name)
        self._stop_all()

    def _stop_all(self) -> None:
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _check_deadline(self) -> None:
        if self.stopping_since is None:
            return
        if time.monotonic() - self.stopping_since > self.grace_s + KILL_AFTER_S:
            for pid, index in self.children.items():
                log.warning("HTTP worker %d (pid %d) still running: killing it", index, pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.stopping_since = time.monotonic()  # and again in another period, should SIGKILL not do


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM to this process when the parent dies (Linux); if it already has, stop now."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def supervise(cfg: RunConfig, serve: Callable[[], int]) -> int:
    """Bind the port, run ``cfg.http_workers`` processes each calling ``serve()``, until told to stop."""
    from dynamo.cli.launch import shutdown_grace
    from dynamo.frontend.http.service import LISTEN_BACKLOG

    socks = bind_sockets(cfg.http_host, cfg.http_port, cfg.http_workers, LISTEN_BACKLOG)
    return Supervisor(socks, serve, shutdown_grace()).run()
