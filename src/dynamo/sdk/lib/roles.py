"""A ``dynamo-run`` role (the OpenAI frontend, an engine worker) run by a service, for graphs of LLM services.

The service's process starts ``python -m dynamo.cli <args>`` as its child, as the original's frontend
service started its HTTP binary: the role keeps its own runtime, signal handling and drain, its output
goes through the service's (so ``dynamo serve`` prefixes it with the service and replica), and it dies
with the service (``PR_SET_PDEATHSIG``).  Running the roles inside the service's process instead would
save a process per service but needs the roles to accept a runtime and a stop signal from outside; that
is not built yet (docs/serve.md).

If the role exits while the service is not stopping, the service stops too: with status 1 or 2 (the role
said what is wrong on stderr: a bad flag, a missing model; every restart would fail the same way) as a
failure to start that the supervisor does not retry, otherwise as a crash it restarts.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import sys

from ..context import dynamo_context

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 30.0


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Role:
    """``dynamo-run`` with ``args`` as a child of this service's process: :meth:`start`, :meth:`stop`."""

    def __init__(self, args: list[str]) -> None:
        self.args = list(args)
        self.proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        log.info("starting dynamo-run %s", " ".join(self.args))
        self.proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "dynamo.cli", *self.args,
                                                         stdin=asyncio.subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self._watch = asyncio.create_task(self._watch_exit(self.proc))

    async def _watch_exit(self, proc: asyncio.subprocess.Process) -> None:
        rc = await proc.wait()
        if self._stopping:
            return
        service = dynamo_context.get("service", "?")
        if rc in (1, 2):
            dynamo_context["fatal"] = f"service {service} failed: dynamo-run exited with status {rc} (its error is above)"
        else:
            log.error("dynamo-run of service %s exited with status %s", service, rc)
            dynamo_context["exit_status"] = 1
        runtime = dynamo_context.get("runtime")
        if runtime is not None:
            runtime.shutdown()

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM (the role drains), SIGKILL after ``timeout``."""
        self._stopping = True
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
