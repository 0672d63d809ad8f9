"""aiohttp's server imported without its client (``dynamo/frontend/http/aiohttp_server.py``): the client
still works in the same process (its package ``__init__`` runs on first use), and any failure of the
trick falls back to a plain import.

Each check runs in a fresh interpreter: the test process imported aiohttp long ago.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# a server and a client in one process, the server started before anything touched the client side
SERVE_THEN_FETCH = r"""
import asyncio, sys
import dynamo.frontend.http
from dynamo.frontend.http.aiohttp_server import is_partial
import aiohttp
from aiohttp import web

package = sys.modules["aiohttp"]
print("client imported before use:", "aiohttp.client" in sys.modules, "partial:", is_partial(aiohttp))

async def main():
    app = web.Application()
    app.router.add_get("/", lambda r: web.Response(text="served"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    print("raw:", (await reader.read()).decode().rsplit("\r\n", 1)[-1], "partial:", is_partial(aiohttp))
    from aiohttp import ClientTimeout  # a from-import of a client name completes the package
    async with aiohttp.ClientSession(timeout=ClientTimeout(total=10)) as s:
        async with s.get(f"http://127.0.0.1:{port}/") as r:
            print("client:", r.status, await r.text())
    try:
        async with aiohttp.ClientSession() as s:
            await s.get("http://127.0.0.1:1/")
    except aiohttp.ClientConnectionError as e:
        print("refused:", type(e).__name__)
    await runner.cleanup()

asyncio.run(main())
print("partial:", is_partial(aiohttp), "same module:", sys.modules["aiohttp"] is package,
      "__all__ has ClientSession:", "ClientSession" in aiohttp.__all__, "dir:", "TCPConnector" in dir(aiohttp))
print("aiohttp's own __getattr__:", aiohttp.__getattr__.__module__, aiohttp.GunicornWebWorker is None or True)
"""

# two threads use the client side at once: one completes the package, the other waits for it
THREADS = r"""
import sys, threading
import dynamo.frontend.http
import aiohttp
barrier, seen = threading.Barrier(4), []
def use():
    barrier.wait()
    seen.append(aiohttp.ClientSession.__name__)
threads = [threading.Thread(target=use) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print("seen:", sorted(seen))
"""

# the trick fails half way (one of aiohttp's server modules cannot be imported, once): undone, plain import
FAIL_HALF_WAY = r"""
import sys
class Fail:
    armed = True
    def find_spec(self, name, path=None, target=None):
        if name == "aiohttp.web_app" and Fail.armed:
            Fail.armed = False
            raise ImportError("injected")
        return None
sys.meta_path.insert(0, Fail())
import dynamo.frontend.http
from dynamo.frontend.http.aiohttp_server import is_partial
import aiohttp
from aiohttp import web
print("injected:", not Fail.armed, "partial:", is_partial(aiohttp), "client imported:", "aiohttp.client" in sys.modules,
      "web from this package:", web.Application.__module__ == "aiohttp.web_app" and sys.modules["aiohttp.web_app"] is not None)
"""

def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_the_client_works_in_the_same_process_after_the_server_only_import():
    out = _run(SERVE_THEN_FETCH).splitlines()
    assert out[0] == "client imported before use: False partial: True"
    assert out[1] == "raw: served partial: True"  # serving does not need the client side
    assert out[2] == "client: 200 served"
    assert out[3] == "refused: ClientConnectorError"
    assert out[4] == "partial: False same module: True __all__ has ClientSession: True dir: True"
    assert out[5] == "aiohttp's own __getattr__: aiohttp True"


def test_threads_using_the_client_at_once_all_get_it():
    assert _run(THREADS).strip() == "seen: ['ClientSession', 'ClientSession', 'ClientSession', 'ClientSession']"


def test_a_failure_half_way_falls_back_to_the_plain_import():
    out = _run(FAIL_HALF_WAY).strip()
    assert out == "injected: True partial: False client imported: True web from this package: True"


def test_no_version_line_falls_back_to_the_plain_import():
    # the package's __init__ would run the import at once: load this one module without it, then break it
    code = (
        "import importlib.util, re, sys\n"
        "spec = importlib.util.find_spec('dynamo.frontend.http')\n"
        "sys.modules['dynamo.frontend.http'] = importlib.util.module_from_spec(spec)\n"
        "import dynamo.frontend.http.aiohttp_server as m\n"
        "assert 'aiohttp' not in sys.modules\n"
        "m._VERSION = re.compile(rb'^no such line$', re.M)\n"
        "m.import_aiohttp_web()\n"
        "import aiohttp\n"
        "print('partial:', m.is_partial(aiohttp), 'client imported:', 'aiohttp.client' in sys.modules,\n"
        "      'web:', 'aiohttp.web' in sys.modules)\n"
    )
    assert _run(code).strip() == "partial: False client imported: True web: True"
