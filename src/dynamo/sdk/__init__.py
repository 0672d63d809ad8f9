"""The Dynamo SDK: a serving graph written as Python classes, started by ``dynamo serve`` (docs/serve.md).

``@service`` classes with ``@endpoint`` methods (served on ``dyn://<namespace>.<Class>.<method>`` over
:mod:`dynamo.runtime`), ``@api`` methods (HTTP routes), ``depends(Other)`` edges that are clients of the
other service, ``@async_on_start``/``@async_on_shutdown`` hooks, the merged config
(``dynamo.sdk.lib.config.ServiceConfig``) and ``dynamo_context``: the names of Dynamo 0.1-0.3's SDK.
This package is a process role on top of the others: a service process is neither a frontend nor a
worker of ``dynamo-run``, though its code may build on both.
"""

from .context import dynamo_context
from .lib.config import ServiceConfig
from .service import (
    api,
    async_on_shutdown,
    async_on_start,
    depends,
    dynamo_endpoint,
    endpoint,
    service,
)

__all__ = ["ServiceConfig", "api", "async_on_shutdown", "async_on_start", "depends", "dynamo_context",
           "dynamo_endpoint", "endpoint", "service"]
