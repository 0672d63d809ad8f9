"""Exceptions of the distributed runtime.

They are distinct types because callers act on them differently: migration retries on
:class:`NoRespondersError` and :class:`StreamIncompleteError`, the HTTP layer maps
:class:`NoInstancesError` to 500/503, and a CLI prints :class:`RuntimeConnectionError` as one line.
"""

from __future__ import annotations

STREAM_INCOMPLETE_MESSAGE = "Stream ended before generation completed"


class DynamoRuntimeError(Exception):
    """Base of every error raised by ``dynamo.runtime``."""


class RuntimeConnectionError(DynamoRuntimeError, ConnectionError):
    """etcd or NATS cannot be reached; the message is one line naming the address."""


class RuntimeConfigError(DynamoRuntimeError, ValueError):
    """A runtime setting from the environment is malformed; the message names the variable."""


class LeaseLostError(DynamoRuntimeError):
    """The primary lease expired or was revoked, so this instance is no longer registered."""


class ServiceAlreadyExistsError(DynamoRuntimeError):
    """``create_service`` was called twice for one component in one process."""


class NoInstancesError(DynamoRuntimeError):
    """No live instance serves the endpoint."""

    def __init__(self, etcd_prefix: str) -> None:
        super().__init__(f'no instances found for endpoint "{etcd_prefix}"')
        self.etcd_prefix = etcd_prefix


class InstanceNotFoundError(DynamoRuntimeError):
    """``direct()`` named an instance id that is not (or no longer) available."""

    def __init__(self, instance_id: int, etcd_prefix: str) -> None:
        super().__init__(f'instance_id={instance_id} not found for endpoint "{etcd_prefix}"')
        self.instance_id = instance_id


class NoRespondersError(DynamoRuntimeError):
    """NATS had no subscriber on the instance subject: the instance is gone (it is marked down)."""

    def __init__(self, subject: str, instance_id: int | None = None) -> None:
        super().__init__(f"no responders on subject {subject}")
        self.subject = subject
        self.instance_id = instance_id


class AckTimeoutError(NoRespondersError):
    """The instance did not acknowledge the request in time: frozen, partitioned or hopelessly overloaded.

    A NoRespondersError, so callers that retry elsewhere on "no responders" do so here too: the stream key
    is withdrawn, so a late worker that calls home is turned away and nothing is received twice. The
    instance is set aside (probed until it answers again) rather than marked down.
    """

    def __init__(self, subject: str, instance_id: int | None, timeout: float) -> None:
        super().__init__(subject, instance_id)
        self.args = (f"no acknowledgement from {subject} within {timeout:g}s",)


class WorkerBusyError(DynamoRuntimeError):
    """The instance refused the request because it already serves its limit of requests in flight."""

    def __init__(self, subject: str, instance_id: int | None = None) -> None:
        super().__init__(f"instance on {subject} is at its limit of requests in flight")
        self.subject = subject
        self.instance_id = instance_id


class EngineError(DynamoRuntimeError, ValueError):
    """An error item in a response stream (the remote handler failed). A ValueError, as in the original."""


class StreamIncompleteError(EngineError):
    """The response stream ended without its completion marker: the worker died or vanished.

    The message is exactly ``Stream ended before generation completed``; request migration keys on it.
    """

    def __init__(self, message: str = STREAM_INCOMPLETE_MESSAGE) -> None:
        super().__init__(message)


class WorkerDrainedError(StreamIncompleteError):
    """The worker was shutting down and stopped this stream before it ended (its drain timed out).

    Everything it sent before is valid; the request is to be resumed on another worker, whatever the
    migration limit: the worker went away on purpose, not because the request made it fail.
    """


class StreamStalledError(StreamIncompleteError):
    """The worker sent nothing, not even a heartbeat, for longer than the liveness bound (frozen worker).

    Same message as :class:`StreamIncompleteError`, so migration treats it alike; the instance is set
    aside until it answers a probe again.
    """
