"""The object store in a directory (a :class:`~dynamo.runtime.object_store.ObjectStore`): blobs of the
processes of one host, beside the file discovery store, for fleets that run without NATS JetStream.

Each object is one file, ``<root>/objects/<bucket>/<percent-encoded name>``. A put writes a temporary
file and hard-links it to the final name, which fails if the name exists: create-if-absent is atomic
without a lock, and a reader sees the whole object or none.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from pathlib import Path
from urllib.parse import quote

from .object_store import ObjectStoreError
from .store_dir import make_private_dir, write_private


class FileObjectStore:
    def __init__(self, root: Path | str, bucket: str) -> None:
        self.bucket = bucket
        self.dir = Path(root) / "objects" / quote(bucket, safe="")

    def _path(self, name: str) -> Path:
        return self.dir / ("o_" + quote(name, safe=""))

    def _put(self, name: str, data: bytes) -> bool:
        final = self._path(name)
        if final.exists():
            return False
        try:
            make_private_dir(self.dir.parent)  # the store's files are this user's only (runtime/store_dir.py)
            make_private_dir(self.dir)
            tmp = self.dir / f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
            write_private(tmp, data)
        except OSError as exc:
            raise ObjectStoreError(f"cannot write to the object store {self.dir}: {exc.strerror}") from None
        try:
            os.link(tmp, final)
            return True
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def _get(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            raise ObjectStoreError(f"no object {name!r} in the {self.bucket} object store ({self.dir})") from None

    async def put_if_absent(self, name: str, data: bytes) -> bool:
        return await asyncio.to_thread(self._put, name, data)

    async def get(self, name: str) -> bytes:
        return await asyncio.to_thread(self._get, name)
