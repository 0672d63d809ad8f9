"""The OpenAI-compatible HTTP frontend.

aiohttp is imported here, first, through :func:`dynamo.frontend.http.tls_defer.import_aiohttp`: the same
aiohttp, without loading CA certificates for client contexts at start-up (they load on first use).
"""

from dynamo.frontend.http.tls_defer import import_aiohttp

import_aiohttp()
