"""Fetching image URLs from real HTTP servers (aiohttp on loopback): redirects followed and re-checked at
every hop, the byte limit (announced and streamed bodies), the deadline, and the connection pinned to
the address that was checked.

A server on 127.0.0.1 stands in for a public image host and one on 127.0.0.2 for a private one: the
fetcher's address test is told that 127.0.0.1 is public and everything else internal, and its resolver
maps ``public.test`` and ``private.test`` to them, so the refusals are the real code path against real
sockets.  The tests that need no such stand-in use ``DYN_MM_ALLOW_INTERNAL=1``, as an operator would.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import pytest
from aiohttp import web

from dynamo.llm.media import MediaError, MediaPolicy, load_image, load_images
from dynamo.llm.media.fetch import Fetcher
from harness.images import image_bytes

pytestmark = pytest.mark.timeout(60)

PUBLIC, PRIVATE = "127.0.0.1", "127.0.0.2"
RED_PNG = image_bytes(5, 4)


@dataclass
class Host:
    """A real HTTP server and the paths it was asked for."""

    address: str
    port: int = 0
    hits: list[str] = field(default_factory=list)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)  # a streamed body's reader went away
    release: asyncio.Event = field(default_factory=asyncio.Event)  # lets a stalled answer end

    def url(self, path: str, host: str | None = None) -> str:
        return f"http://{host or self.address}:{self.port}{path}"


def _routes(me: Host, others: Callable[[], dict[str, Host]]) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        me.hits.append(request.path_qs)
        path = request.path
        if path == "/red.png":
            return web.Response(body=RED_PNG, content_type="image/png")
        if path == "/text.png":
            return web.Response(body=b"I am not a picture", content_type="image/png")
        if path.startswith("/to/"):  # /to/<host name or address>/<path>: a redirect there, on that server's port
            _, _, target, rest = path.split("/", 3)
            dest = others()[target]
            raise web.HTTPFound(f"http://{target}:{dest.port}/{rest}")
        if path == "/relative":
            raise web.HTTPMovedPermanently("/red.png")
        if path == "/loop":
            raise web.HTTPFound("/loop")
        if path == "/to-file":
            raise web.HTTPFound("file:///etc/passwd")
        if path == "/big-announced":
            return web.Response(body=b"\x89PNG" + b"\0" * 5000, content_type="image/png")
        if path == "/big-streamed":  # chunked, without end: the fetcher must stop reading
            resp = web.StreamResponse(headers={"Content-Type": "image/png"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            try:
                while True:
                    await resp.write(b"\0" * 1024)
                    await asyncio.sleep(0)
            except (ConnectionResetError, ConnectionError, RuntimeError):
                me.aborted.set()
                raise
        if path == "/stall":
            await me.release.wait()
            return web.Response(body=RED_PNG, content_type="image/png")
        if path == "/chunked.png":
            resp = web.StreamResponse(headers={"Content-Type": "image/png"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for i in range(0, len(RED_PNG), 7):
                await resp.write(RED_PNG[i:i + 7])
            await resp.write_eof()
            return resp
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    return app


@pytest.fixture
async def hosts() -> AsyncIterator[dict[str, Host]]:
    servers = {"public.test": Host(PUBLIC), "private.test": Host(PRIVATE)}
    by_name = {**servers, PUBLIC: servers["public.test"], PRIVATE: servers["private.test"]}
    runners = []
    for srv in servers.values():
        runner = web.AppRunner(_routes(srv, lambda: by_name), shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, srv.address, 0)
        await site.start()
        srv.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        runners.append(runner)
    yield by_name
    for srv in servers.values():
        srv.release.set()
    for runner in runners:
        await runner.cleanup()


def stand_in(policy: MediaPolicy, calls: list[str] | None = None,
             answers: dict[str, list[list[str]]] | None = None) -> Fetcher:
    """A fetcher for which 127.0.0.1 is public, with ``public.test``/``private.test`` resolved to the two
    servers (``answers``: a name's successive answers, for the rebinding test)."""
    fixed = {"public.test": [PUBLIC], "private.test": [PRIVATE]}

    async def resolve(host: str, port: int) -> list[str]:
        if calls is not None:
            calls.append(host)
        if answers and answers.get(host):
            return answers[host].pop(0)
        return fixed.get(host, [host])

    return Fetcher(policy, resolve=resolve, internal=lambda a: a != PUBLIC)


OPEN_HTTP = MediaPolicy(allow_http=True)  # http:// allowed, internal addresses not (the stand-in's view)
INTERNAL = MediaPolicy.from_env({"DYN_MM_ALLOW_INTERNAL": "1"})


async def test_allow_internal_fetches_from_a_loopback_server(hosts: dict[str, Host]):
    img = await load_image(hosts[PUBLIC].url("/red.png"), INTERNAL)
    assert (img.width, img.height, img.mime, img.data) == (5, 4, "image/png", RED_PNG)


async def test_without_allow_internal_loopback_is_refused_and_never_contacted(hosts: dict[str, Host]):
    with pytest.raises(MediaError, match="DYN_MM_ALLOW_INTERNAL"):
        await load_image(hosts[PUBLIC].url("/red.png"), MediaPolicy())
    with pytest.raises(MediaError, match="internal address"):
        await load_image(hosts[PUBLIC].url("/red.png"), OPEN_HTTP)
    assert hosts[PUBLIC].hits == []


async def test_redirects_are_followed(hosts: dict[str, Host]):
    fetcher = stand_in(OPEN_HTTP)
    assert await fetcher.fetch(hosts[PUBLIC].url("/to/public.test/relative", "public.test")) == RED_PNG
    assert hosts[PUBLIC].hits == ["/to/public.test/relative", "/relative", "/red.png"]
    assert fetcher.connected == [PUBLIC] * 3


@pytest.mark.parametrize("target", ["private.test", PRIVATE])
async def test_redirect_to_a_private_address_is_refused(hosts: dict[str, Host], target: str):
    fetcher = stand_in(OPEN_HTTP)
    with pytest.raises(MediaError, match="internal address"):
        await fetcher.fetch(hosts[PUBLIC].url(f"/to/{target}/red.png", "public.test"))
    assert hosts[PUBLIC].hits == [f"/to/{target}/red.png"]
    assert hosts[PRIVATE].hits == []  # refused before connecting


async def test_redirect_to_a_file_url_is_refused(hosts: dict[str, Host]):
    with pytest.raises(MediaError, match="scheme 'file:'"):
        await load_image(hosts[PUBLIC].url("/to-file"), INTERNAL)


async def test_redirect_loop_ends(hosts: dict[str, Host]):
    with pytest.raises(MediaError, match="more than 3 redirects"):
        await load_image(hosts[PUBLIC].url("/loop"), INTERNAL)
    assert len(hosts[PUBLIC].hits) == 4


async def test_announced_oversize_body_is_refused(hosts: dict[str, Host]):
    with pytest.raises(MediaError, match="too large"):
        await load_image(hosts[PUBLIC].url("/big-announced"), MediaPolicy(allow_http=True, allow_private=True,
                                                                         max_bytes=4096))


async def test_streamed_oversize_body_is_cut_off(hosts: dict[str, Host]):
    """A body that never ends: the fetcher stops at the limit and hangs up, which the server notices."""
    policy = MediaPolicy(allow_http=True, allow_private=True, max_bytes=64 * 1024)
    with pytest.raises(MediaError, match="too large"):
        await load_image(hosts[PUBLIC].url("/big-streamed"), policy)
    await asyncio.wait_for(hosts[PUBLIC].aborted.wait(), 30)


async def test_chunked_body_is_read_whole(hosts: dict[str, Host]):
    assert (await load_image(hosts[PUBLIC].url("/chunked.png"), INTERNAL)).data == RED_PNG


async def test_a_server_that_does_not_answer_runs_into_the_deadline(hosts: dict[str, Host]):
    policy = MediaPolicy(allow_http=True, allow_private=True, timeout_s=0.5)
    with pytest.raises(MediaError, match="no complete answer within 0.5 s"):
        await load_image(hosts[PUBLIC].url("/stall"), policy)


async def test_errors_and_disguised_content_are_refused(hosts: dict[str, Host]):
    with pytest.raises(MediaError, match="HTTP 404"):
        await load_image(hosts[PUBLIC].url("/missing.png"), INTERNAL)
    with pytest.raises(MediaError, match="PNG, JPEG, WEBP and GIF"):
        await load_image(hosts[PUBLIC].url("/text.png"), INTERNAL)


async def test_the_connection_goes_to_the_address_that_was_checked(hosts: dict[str, Host]):
    """DNS rebinding: the name answers once with the public address and would answer next with the
    private one; the fetcher asks once and connects to what it checked."""
    calls: list[str] = []
    fetcher = stand_in(OPEN_HTTP, calls, {"rebind.test": [[PUBLIC], [PRIVATE], [PRIVATE]]})
    assert await fetcher.fetch(hosts[PUBLIC].url("/red.png", "rebind.test")) == RED_PNG
    assert calls == ["rebind.test"] and fetcher.connected == [PUBLIC]
    assert hosts[PRIVATE].hits == []


async def test_a_name_with_any_internal_address_is_refused(hosts: dict[str, Host]):
    fetcher = stand_in(OPEN_HTTP, answers={"mixed.test": [[PUBLIC, PRIVATE]]})
    with pytest.raises(MediaError, match=r"mixed.test \(127.0.0.2\) is an internal address"):
        await fetcher.fetch(hosts[PUBLIC].url("/red.png", "mixed.test"))
    assert hosts[PUBLIC].hits == []


async def test_the_first_failure_ends_the_other_fetches(hosts: dict[str, Host]):
    """One image of a request is refused: a stalled fetch of another is not left running."""
    policy = MediaPolicy(allow_http=True, allow_private=True)
    stalled = asyncio.ensure_future(load_images([hosts[PUBLIC].url("/stall"), "data:image/png;base64,AAAA"], policy))
    with pytest.raises(MediaError, match="PNG, JPEG, WEBP and GIF"):
        await stalled
    assert not [t for t in asyncio.all_tasks() if "load_image" in repr(t.get_coro())]
