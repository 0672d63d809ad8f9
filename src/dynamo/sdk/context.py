"""``dynamo_context``: what the running service process knows about itself, for the service's code.

A plain dict filled by the service process before the class's ``__init__`` runs (the original SDK's
shape): ``runtime`` (the process's :class:`~dynamo.runtime.DistributedRuntime`), ``namespace``,
``service`` (the class name), ``component`` (the runtime component named after the class), ``endpoints``
(its endpoint names), ``lease`` (the instance id: the primary lease), ``replica`` (0..workers-1).
Outside a service process it is empty.
"""

from __future__ import annotations

from typing import Any

dynamo_context: dict[str, Any] = {}
