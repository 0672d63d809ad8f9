"""The OpenAI-compatible HTTP frontend.

aiohttp is imported here, first, through :func:`dynamo.frontend.http.aiohttp_server.import_aiohttp_web`:
the same aiohttp, with its client side (which the server does not use) imported on first use, and the
client's CA certificates loaded on first use (tls_defer.py).
"""

from dynamo.frontend.http.aiohttp_server import import_aiohttp_web

import_aiohttp_web()
