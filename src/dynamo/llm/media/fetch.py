"""Fetching an image URL under the media policy: each hop resolved, checked, and connected to the
address that was checked.

Checking a host's address and then handing the URL to an HTTP client that resolves it again leaves a
gap: a name that answers with a public address to the check and with 127.0.0.1 to the connect (DNS
rebinding) walks through.  So the fetch resolves each host once, refuses it when any of its addresses
is internal (unless the policy allows internal addresses), and opens the TCP connection to that very
address itself; TLS still verifies the certificate against the host name.  Redirects are followed
here, one hop at a time, and every hop goes through the same checks.  The body is read up to the
policy's byte limit and no further, and the whole fetch, redirects included, has one deadline.

A small HTTP/1.1 GET of our own (``Connection: close``, no compression, Content-Length, chunked or
read-to-close bodies) does the requests: it is all an image fetch needs, and it keeps the model logic
free of a network library.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from dataclasses import dataclass, field
from typing import Awaitable, Callable
from urllib.parse import urljoin, urlsplit

from dynamo.llm.media.policy import ALLOW_INTERNAL_ENV, MediaError, MediaPolicy, is_internal_address

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""(host, port) -> the host's IP addresses (a test can give its own)."""

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_HEADER_LINES = 100
_USER_AGENT = "dynamo-run (image fetch)"


async def system_resolver(host: str, port: int) -> list[str]:
    """The host's addresses from the system resolver (``/etc/hosts`` and DNS), in its order."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise MediaError(f"Cannot fetch the image: cannot resolve host {host!r} ({e})") from None
    out: list[str] = []
    for info in infos:
        addr = str(info[4][0])
        if addr not in out:
            out.append(addr)
    return out


@dataclass
class Fetcher:
    """One policy's fetches; ``resolve`` and ``internal`` are the resolver and the address test (tests
    swap them to stand a loopback server in for a public one)."""

    policy: MediaPolicy
    resolve: Resolver = system_resolver
    internal: Callable[[str], bool] = is_internal_address
    connected: list[str] = field(default_factory=list)  # the addresses connected to, in order

    async def fetch(self, url: str) -> bytes:
        """The body of ``url`` (``https://``, or ``http://`` where allowed), redirects followed and
        re-checked; a refusal or failure is a :class:`MediaError`."""
        try:
            async with asyncio.timeout(self.policy.timeout_s):
                return await self._follow(url)
        except TimeoutError:
            raise MediaError(f"Cannot fetch the image: no complete answer within {self.policy.timeout_s:g} s") from None

    async def _follow(self, url: str) -> bytes:
        for _ in range(self.policy.max_redirects + 1):
            status, location, body = await self._get(url)
            if location is None:
                if status != 200:
                    raise MediaError(f"Cannot fetch the image: the server answered HTTP {status}")
                return body
            url = urljoin(url, location)
        raise MediaError(f"Cannot fetch the image: more than {self.policy.max_redirects} redirects")

    async def _get(self, url: str) -> tuple[int, str | None, bytes]:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme == "http" and not self.policy.allow_http:
            raise MediaError(f"Image URLs must be https:// or data: (http:// needs {ALLOW_INTERNAL_ENV}=1 on the server)")
        if scheme not in ("http", "https"):
            raise MediaError(f"Image URL scheme '{scheme}:' is not allowed here (https:// and data: are)")
        host = (parts.hostname or "").rstrip(".")
        if not host:
            raise MediaError("Image URL has no host")
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise MediaError("Image URL has an invalid port") from None
        addresses = await self.resolve(host, port)
        if not addresses:
            raise MediaError(f"Cannot fetch the image: host {host!r} has no address")
        if not self.policy.allow_private:
            bad = next((a for a in addresses if self.internal(a)), None)
            if bad is not None:
                said = host if host == bad else f"{host} ({bad})"
                raise MediaError(f"Image URL refused: {said} is an internal address (allowed only with "
                                 f"{ALLOW_INTERNAL_ENV}=1 on the server)")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host_header = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            host_header += f":{parts.port}"
        return await self._exchange(addresses, port, scheme == "https", host, host_header, target)

    async def _exchange(self, addresses: list[str], port: int, tls: bool, host: str, host_header: str,
                        target: str) -> tuple[int, str | None, bytes]:
        ctx = ssl.create_default_context() if tls else None
        last: OSError | None = None
        for address in addresses:
            try:
                reader, writer = await asyncio.open_connection(
                    address, port, ssl=ctx, server_hostname=host if tls else None, limit=64 * 1024)
            except ssl.SSLError as e:
                raise MediaError(f"Cannot fetch the image: TLS with {host} failed ({e.reason or e})") from None
            except OSError as e:
                last = e
                continue
            self.connected.append(address)
            try:
                request = (f"GET {target} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: {_USER_AGENT}\r\n"
                           "Accept: image/*\r\nAccept-Encoding: identity\r\nConnection: close\r\n\r\n")
                writer.write(request.encode("ascii", "strict"))
                await writer.drain()
                return await _read_response(reader, self.policy.max_bytes)
            except UnicodeEncodeError:
                raise MediaError("Image URL has characters that must be percent-encoded") from None
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                raise MediaError(f"Cannot fetch the image: the connection to {host} failed ({e})") from None
            finally:
                writer.close()
        raise MediaError(f"Cannot fetch the image: cannot connect to {host} ({last.strerror if last else 'no address'})")


async def _read_response(reader: asyncio.StreamReader, max_bytes: int) -> tuple[int, str | None, bytes]:
    """(status, the redirect's Location or None, the body); a body over ``max_bytes`` is refused as soon
    as it is known to be (from its Content-Length, or once that many bytes arrived)."""
    status_line = (await reader.readline()).decode("latin-1").strip()
    fields = status_line.split(" ", 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/1.") or not fields[1].isdigit():
        raise MediaError("Cannot fetch the image: the server's answer is not HTTP/1.x")
    status = int(fields[1])
    headers: dict[str, str] = {}
    for _ in range(_MAX_HEADER_LINES):
        line = (await reader.readline()).decode("latin-1")
        if line in ("\r\n", "\n", ""):
            break
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    else:
        raise MediaError("Cannot fetch the image: too many response headers")
    if status in _REDIRECTS and headers.get("location"):
        return status, headers["location"], b""
    if status != 200:
        return status, None, b""
    too_big = MediaError(f"Image too large: more than {max_bytes} bytes")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return status, None, await _read_chunked(reader, max_bytes, too_big)
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise MediaError("Cannot fetch the image: bad Content-Length")
        if int(length) > max_bytes:
            raise too_big
        return status, None, await reader.readexactly(int(length))
    body = bytearray()  # no length given: the body ends when the server closes
    while len(body) <= max_bytes:
        more = await reader.read(max_bytes + 1 - len(body))
        if not more:
            break
        body += more
    if len(body) > max_bytes:
        raise too_big
    return status, None, bytes(body)


async def _read_chunked(reader: asyncio.StreamReader, max_bytes: int, too_big: MediaError) -> bytes:
    body = bytearray()
    while True:
        size_line = (await reader.readline()).split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise MediaError("Cannot fetch the image: bad chunked encoding") from None
        if size == 0:
            return bytes(body)
        if len(body) + size > max_bytes:
            raise too_big
        body += await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF
