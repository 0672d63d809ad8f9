"""Import aiohttp without paying, at start-up, for TLS client contexts a server does not use.

``import aiohttp`` (which ``aiohttp.web`` implies) builds two client ``SSLContext`` objects at import
time, each loading the system's CA bundle: with OpenSSL 3.0 that is a fifth of the whole import of
``aiohttp.web`` on our machine (docs/performance.md, "Start-up").  :func:`import_aiohttp` imports aiohttp
with ``SSLContext.set_default_verify_paths`` (the call that loads the CA bundle, also from
``load_default_certs``) recorded instead of run, for the contexts made during that import only; each such
context loads its CA certificates exactly as it would have, the first time it is used:
``wrap_socket``/``wrap_bio`` (every TLS connection in ``ssl``, asyncio and uvloop goes through one of them)
and the introspection methods.  Contexts made after the import are untouched.  Not on Windows, where
``load_default_certs`` also reads the system stores.
"""

from __future__ import annotations

import contextlib
import ssl
import sys
import threading
from _ssl import _SSLContext  # the C class: its set_default_verify_paths is the real one
from typing import Any, Iterator

_lock = threading.Lock()


class _DeferredCAContext(ssl.SSLContext):
    """An ``SSLContext`` whose default CA certificates are loaded just before its first use."""

    def _load_deferred_ca(self) -> None:
        if "_ca_deferred" in self.__dict__:
            with _lock:
                if self.__dict__.pop("_ca_deferred", None):
                    _SSLContext.set_default_verify_paths(self)

    def set_default_verify_paths(self) -> None:
        self.__dict__.pop("_ca_deferred", None)
        _SSLContext.set_default_verify_paths(self)

    def wrap_socket(self, *args: Any, **kwargs: Any) -> Any:
        self._load_deferred_ca()
        return super().wrap_socket(*args, **kwargs)

    def wrap_bio(self, *args: Any, **kwargs: Any) -> Any:
        self._load_deferred_ca()
        return super().wrap_bio(*args, **kwargs)

    def cert_store_stats(self) -> dict[str, int]:
        self._load_deferred_ca()
        return super().cert_store_stats()

    def get_ca_certs(self, binary_form: bool = False) -> Any:
        self._load_deferred_ca()
        return super().get_ca_certs(binary_form)


def _defer(self: ssl.SSLContext) -> None:
    if type(self) is not ssl.SSLContext:  # somebody's subclass: leave it alone
        _SSLContext.set_default_verify_paths(self)
        return
    self.__dict__["_ca_deferred"] = True
    self.__class__ = _DeferredCAContext


@contextlib.contextmanager
def deferred_ca_loading() -> Iterator[None]:
    """Within: ``SSLContext`` objects made with the default CA certificates load them on first use."""
    if sys.platform == "win32" or "set_default_verify_paths" in ssl.SSLContext.__dict__:
        yield  # Windows, or already within (nested): nothing to do
        return
    ssl.SSLContext.set_default_verify_paths = _defer  # type: ignore[method-assign]
    try:
        yield
    finally:
        del ssl.SSLContext.set_default_verify_paths  # the inherited C method again


def import_aiohttp() -> None:
    """Import aiohttp (once per process) with its import-time CA loading deferred to first use."""
    if "aiohttp" in sys.modules:
        return
    with deferred_ca_loading():
        import aiohttp  # noqa: F401
