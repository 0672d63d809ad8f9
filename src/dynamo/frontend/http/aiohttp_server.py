"""Import aiohttp's server (``aiohttp.web``) without running ``aiohttp/__init__.py``, which imports the
whole HTTP client as well.

Why: ``dynamo-run in=http`` should answer soon after ``exec`` (the goal: within 0.15 s), and start-up is
mostly imports.  ``import aiohttp.web`` runs the package's ``__init__`` first, and that imports the client
side (``aiohttp.client``, ``connector``, ``cookiejar``, ``tracing``, ``client_ws``, ``formdata``,
``resolver``, ...) and builds its TLS contexts, none of which a server that makes no HTTP request uses:
about a sixth of the CPU of a start (docs/performance.md, "Start-up").

How: the package's module object is made from aiohttp's own import spec (the real ``__path__``,
``__file__``, ``__spec__``) with just ``__version__`` (the one package attribute the server's modules
read, taken from the first lines of ``__init__.py``), and registered in ``sys.modules`` before
``import aiohttp.web``; the submodules import as they always do.  The package completes itself on first
use: the first lookup of any other attribute (``aiohttp.ClientSession``, ``from aiohttp import
ClientTimeout``, ``dir(aiohttp)``, ``__all__``) runs the real ``__init__`` into that same module object,
with its client TLS contexts' CA certificates loaded on first use (tls_defer.py), and from then on it is
the package a plain ``import aiohttp`` gives.  A submodule's name (``aiohttp.hdrs``) imports that
submodule.  Nothing completes it in the background: a process that never uses the client never pays for
it, and one that does (etcd's client in ``out=dyn``) pays at its first use, as before.

Robustness: if anything about this fails (no ``__version__`` line, an error while importing), the attempt
is undone and aiohttp imported the plain way.  Written against aiohttp 3.14.5 (constraints.txt); a
version whose server modules read more from the package at import time completes it at that moment:
slower, not wrong.  tests/unit/frontend/test_aiohttp_server.py checks the client after it, in the same process,
and the fallback.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
import re
import sys
import threading
import types
from typing import Any, Callable

from dynamo.frontend.http.tls_defer import deferred_ca_loading, import_aiohttp

log = logging.getLogger(__name__)

_VERSION = re.compile(rb'^__version__ = "([^"]+)"', re.M)
_lock = threading.RLock()  # one completion at a time; other threads wait for it


def import_aiohttp_web() -> None:
    """Import ``aiohttp.web``, leaving aiohttp's client side until something uses it."""
    if "aiohttp" not in sys.modules:
        before = set(sys.modules)
        try:
            _import_server_only()
            return
        except Exception as e:  # any surprise: undo, and the plain import below
            log.debug("importing aiohttp's server alone failed (%r); importing all of aiohttp", e)
            for name in set(sys.modules) - before:
                if name == "aiohttp" or name.startswith("aiohttp."):
                    del sys.modules[name]
    import_aiohttp()  # a no-op when aiohttp is there already
    import aiohttp.web  # noqa: F401


def is_partial(module: types.ModuleType) -> bool:
    """Whether ``module`` is the package as this module left it: its ``__init__`` not run yet."""
    hook = module.__dict__.get("__getattr__")
    return getattr(hook, "_completes_aiohttp", False)


def _import_server_only() -> None:
    spec = importlib.util.find_spec("aiohttp")
    if spec is None or spec.loader is None or spec.origin is None or not spec.submodule_search_locations:
        raise ImportError("aiohttp is not an importable package here")
    with open(spec.origin, "rb") as f:
        found = _VERSION.search(f.read(4096))
    if found is None:
        raise ImportError(f"no __version__ line at the top of {spec.origin}")
    package = importlib.util.module_from_spec(spec)
    package.__version__ = found.group(1).decode()  # type: ignore[attr-defined]
    package.__getattr__, package.__dir__ = _completion_hooks(package, spec)  # type: ignore[method-assign]
    sys.modules["aiohttp"] = package
    import aiohttp.web  # noqa: F401


def _completion_hooks(package: types.ModuleType, spec: Any) -> tuple[Callable[[str], Any], Callable[[], Any]]:
    """The package's ``__getattr__`` and ``__dir__`` (PEP 562) until its ``__init__`` has run."""
    state: dict[str, Any] = {"thread": None, "submodules": None}

    def submodule_names() -> set[str]:
        if state["submodules"] is None:  # what pkgutil.iter_modules would list, without importing pkgutil
            names = set()
            suffixes = tuple(importlib.machinery.all_suffixes())
            for folder in spec.submodule_search_locations:
                for entry in os.listdir(folder):
                    if entry.endswith(suffixes) and not entry.startswith("__init__."):
                        names.add(entry.split(".", 1)[0])
                    elif os.path.isfile(os.path.join(folder, entry, "__init__.py")):
                        names.add(entry)
            state["submodules"] = names
        return state["submodules"]

    def complete() -> None:
        with _lock:
            if not is_partial(package) or state["thread"] is not None:
                return  # done (by another thread, while we waited), or under way in this thread
            state["thread"] = threading.get_ident()
            try:
                with deferred_ca_loading():
                    spec.loader.exec_module(package)
            finally:
                state["thread"] = None
            for name, hook in (("__getattr__", getattr_hook), ("__dir__", dir_hook)):
                if package.__dict__.get(name) is hook:  # the real __init__ did not define its own
                    del package.__dict__[name]

    def getattr_hook(name: str) -> Any:
        if name.startswith("__") and name.endswith("__") and name != "__all__":
            raise AttributeError(f"module 'aiohttp' has no attribute {name!r}")
        if name in submodule_names():
            return importlib.import_module(f"aiohttp.{name}")
        if state["thread"] == threading.get_ident():  # the real __init__ is running: what it has not set yet
            raise AttributeError(f"partially initialized module 'aiohttp' has no attribute {name!r}")
        complete()
        return getattr(package, name)

    def dir_hook() -> Any:
        complete()
        return dir(package)

    getattr_hook._completes_aiohttp = True  # type: ignore[attr-defined]
    return getattr_hook, dir_hook
