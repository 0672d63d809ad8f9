"""A JSON object decoded only when something looks inside it.

Why: a frontend serving a remote Chat worker receives every OpenAI chunk as JSON and sends it on as
JSON. Decoding it (a nested dict per token) and encoding it again were about a quarter of the
frontend's CPU per token (py-spy, docs/performance.md). A :class:`LazyJson` keeps the worker's bytes:
the SSE writer sends them as they are (``raw``) when nobody changed the object, and the per-token
questions the pipeline asks ("is there a usage block?", "are there choices?") are answered from the
bytes. Anything else (a unary response folding the chunks, a parser, a change) decodes it first, so it
behaves as the dict it is.
"""

from __future__ import annotations

from typing import Any, Iterator

import orjson

_loads = orjson.loads
_MISSING = object()
_CONTAINERS = (dict, list)  # what a reader may change in place
_NEEDLES: dict[str, bytes] = {}  # key -> b'"key":', built once per key (asked per token)
_LIST_NEEDLES: dict[str, bytes] = {}  # key -> b'"key":['
USAGE_KEY = b'"usage":'  # a chunk whose bytes lack this has no usage block (the pipeline asks per token)


def _needle(key: str) -> bytes:
    needle = _NEEDLES.get(key)
    if needle is None:
        needle = orjson.dumps(key) + b":"
        if len(_NEEDLES) < 256:  # the keys asked are the code's own few
            _NEEDLES[key] = needle
    return needle


class LazyJson(dict):
    """A dict whose content is the JSON object ``raw``, decoded on first use.

    ``raw`` is the exact JSON while the object is unchanged, and None once anything modified it.
    C code reading dict storage directly (``orjson.dumps``, ``json`` module) must call :meth:`load`
    first; Python-level access loads by itself.
    """

    __slots__ = ("raw", "_loaded")

    def __init__(self, raw: bytes) -> None:
        # (no ``dict.__init__``: the dict is empty until load, and the call was a third of the
        # construction, which a pre-rendered stream pays per token)
        self.raw: bytes | None = raw
        self._loaded = False

    def load(self) -> "LazyJson":
        if not self._loaded:
            self._loaded = True
            assert self.raw is not None
            dict.update(self, _loads(self.raw))
        return self

    def mentions(self, key: str) -> bool:
        """False when ``key`` is certainly not a key of this object (from the bytes, without decoding);
        True means it may be."""
        if self._loaded:
            return dict.__contains__(self, key)
        assert self.raw is not None
        return _needle(key) in self.raw  # a quote inside a JSON string is escaped: no false absence

    def has_items(self, key: str) -> bool:
        """``bool(self.get(key))`` for a list-valued key, from the bytes when they tell."""
        if not self._loaded:
            raw = self.raw
            assert raw is not None
            needle = _LIST_NEEDLES.get(key)
            if needle is None:
                needle = _needle(key) + b"["
                if len(_LIST_NEEDLES) < 256:
                    _LIST_NEEDLES[key] = needle
            at = raw.find(needle)
            if at < 0:
                if _needle(key) not in raw:
                    return False
            elif raw.find(needle, at + 1) < 0:  # one list under that name: look at its first byte
                end = at + len(needle)
                return end < len(raw) and raw[end] != 0x5D  # b"]"
        return bool(self.load().get(key))

    # reading: load first (or answer from the bytes when the key is absent). A nested list or dict
    # handed out may be changed by its reader (``chunk["choices"][0]["index"] = i``), which this object
    # cannot see: the bytes are dropped then, as for a change of its own keys.
    def _out(self, value: Any) -> Any:
        if type(value) in _CONTAINERS:
            self.raw = None
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        if not self._loaded and isinstance(key, str) and not self.mentions(key):
            return default
        return self._out(dict.get(self.load(), key, default))

    def __contains__(self, key: object) -> bool:
        if not self._loaded and isinstance(key, str) and not self.mentions(key):
            return False
        return dict.__contains__(self.load(), key)

    def __getitem__(self, key: Any) -> Any:
        return self._out(dict.__getitem__(self.load(), key))

    def __iter__(self) -> Iterator[Any]:
        return dict.__iter__(self.load())

    def __len__(self) -> int:
        return dict.__len__(self.load())

    def __eq__(self, other: object) -> bool:
        return dict.__eq__(self.load(), other)

    def __ne__(self, other: object) -> bool:
        return dict.__ne__(self.load(), other)

    __hash__ = None

    def __repr__(self) -> str:
        return dict.__repr__(self.load())

    def keys(self):
        return dict.keys(self.load())

    def values(self):
        self.load()
        self.raw = None  # the values may be changed through the view
        return dict.values(self)

    def items(self):
        self.load()
        self.raw = None
        return dict.items(self)

    def copy(self) -> dict:
        self.load()
        self.raw = None  # a shallow copy shares the nested values, which may be changed through it
        return dict(dict.items(self))

    # changing: load, then the bytes no longer describe the object
    def _changing(self) -> None:
        self.load()
        self.raw = None

    def __setitem__(self, key: Any, value: Any) -> None:
        self._changing()
        dict.__setitem__(self, key, value)

    def __delitem__(self, key: Any) -> None:
        self._changing()
        dict.__delitem__(self, key)

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        self._changing()
        return dict.pop(self, key) if default is _MISSING else dict.pop(self, key, default)

    def popitem(self) -> tuple[Any, Any]:
        self._changing()
        return dict.popitem(self)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._changing()
        return dict.setdefault(self, key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._changing()
        dict.update(self, *args, **kwargs)

    def clear(self) -> None:
        self._changing()
        dict.clear(self)

    def __reduce__(self) -> Any:
        return (dict, (dict(self.items()),))
