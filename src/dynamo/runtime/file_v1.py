"""Keys under ``v1/`` in the file store, in Dynamo 1.x's own file format, so that 1.6.1 processes and ours
sharing one ``DYN_FILE_KV`` directory read each other's discovery records.

1.x's format (observed from 1.6.1): a bucket (``v1/instances``, ``v1/mdc``, ...) is a directory under the
root; each key is one file in it named by the key's part after the bucket, percent-encoded with every
byte that is not an ASCII letter or digit as ``%XX`` (upper-case hex: ``/`` -> ``%2F``, ``-`` -> ``%2D``,
``_`` -> ``%5F``); the file holds the value's raw bytes. Writes go to ``.tmp_<16 hex>`` in the same
directory and are renamed (create-if-absent: hard-linked) over the name, so a reader never sees half a
value, and 1.x's watcher skips ``.tmp_`` names. There are no leases: a writer keeps its files alive by
touching their mtime every TTL/3, and a file untouched for 10 s is gone (1.x deletes such files in the
buckets it uses; so do we, in :meth:`V1Files.reap`).

How it maps onto our :class:`~.file_kv.FileKv`: keys starting ``v1/`` live here instead of in ``kv/``;
they take no lock and bump no revision (1.x's processes do neither, so neither could be relied on). A
file's lease is known only to the process that wrote it: it is kept in :attr:`V1Files.owned`, touched
while that lease lives (:meth:`touch`), removed when it is revoked or expires (:meth:`drop_lease`), and
to everyone else the file lives by its mtime alone (``lease`` 0 in their listings), or until its lease
expires: the lease's record (``leases/<id>``, :mod:`.file_kv`) lists its ``v1/`` files (:meth:`names_of`),
and whoever finds the lease expired removes them (:meth:`remove_named`). Why: every record of ours is a
``v1/`` file now, and 1.x's 10 s staleness alone would keep a killed worker listed for 10 s whatever
``DYN_LEASE_TTL`` says (with a 3 s TTL they now go within the TTL and a watcher's tick, as the kill -9
tests of tests/e2e/test_distributed.py and test_distributed_backends.py check; before, over 10 s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from urllib.parse import unquote_to_bytes

from .discovery import KeyValue
from .store_dir import FileStoreError, make_private_dir

log = logging.getLogger(__name__)

PREFIX = "v1/"
BUCKETS = ("instances", "mdc", "event_channels", "event_sources")  # made at open, so they can be watched
STALE_AFTER = 10.0  # seconds without a touch after which a file is gone (1.x's TTL, which it also reaps at)
TOUCH_PERIOD = STALE_AFTER / 3  # how often a writer touches its files (1.x: TTL/3)
TMP_PREFIX = ".tmp_"  # 1.x's watcher skips these names; so do we
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")

__all__ = ["BUCKETS", "PREFIX", "STALE_AFTER", "TOUCH_PERIOD", "V1Files", "decode_name", "encode_name", "is_v1_key"]


def is_v1_key(key: str) -> bool:
    return key.startswith(PREFIX)


def encode_name(key: str) -> str:
    """A key (the part after its bucket) as 1.x names its file: every byte but ASCII letters and digits
    as ``%XX``."""
    return "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in key.encode())


def decode_name(name: str) -> str:
    return unquote_to_bytes(name).decode("utf-8", errors="replace")


def _split(key: str) -> tuple[str, str]:
    """``v1/<bucket>/<rest>`` -> (``<bucket>``, ``<rest>``); ValueError for a key with no rest."""
    parts = key.split("/", 2)
    if len(parts) < 3 or not parts[1] or not parts[2]:
        raise ValueError(f"a v1/ key names a bucket and a key in it (v1/<bucket>/<key>), not {key!r}")
    return parts[1], parts[2]


class V1Files:
    """The ``v1/`` directories of one file store; thread-safe (the store calls it from worker threads)."""

    def __init__(self, root: Path) -> None:
        self.dir = Path(root) / "v1"
        try:
            make_private_dir(self.dir)  # first: a parent mkdir makes would not be private
            for bucket in BUCKETS:
                make_private_dir(self.dir / bucket)
        except OSError as exc:
            raise FileStoreError(f"cannot use {self.dir} for Dynamo 1.x records: {exc.strerror}") from None
        # path -> (lease, value) of every file this process wrote and keeps alive
        self.owned: dict[Path, tuple[int, bytes]] = {}
        self._lock = threading.Lock()
        # file name -> ((device, inode, size), value): a file is read again only when it was replaced
        self._cache: dict[Path, tuple[tuple[int, int, int], bytes]] = {}

    def bucket_dirs(self) -> list[Path]:
        """Every bucket directory there is now (1.x may have made others than ours)."""
        try:
            return [p for p in self.dir.iterdir() if p.is_dir()]
        except FileNotFoundError:
            return []

    def path(self, key: str) -> Path:
        bucket, rest = _split(key)
        return self.dir / bucket / encode_name(rest)

    # ------------------------------------------------------------------ reads

    def _read(self, path: Path, now: float) -> bytes | None:
        """The value of a live file (touched within STALE_AFTER), else None."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if st.st_mtime < now - STALE_AFTER:
            return None
        sig = (st.st_dev, st.st_ino, st.st_size)  # a touch changes the mtime only: no need to read again
        with self._lock:
            hit = self._cache.get(path)
        if hit is not None and hit[0] == sig:
            return hit[1]
        try:
            value = path.read_bytes()
        except FileNotFoundError:
            return None
        with self._lock:
            self._cache[path] = (sig, value)
        return value

    def _kv(self, key: str, path: Path, value: bytes) -> KeyValue:
        with self._lock:
            lease = self.owned.get(path, (0, b""))[0]
        return KeyValue(key, value, lease=lease)

    def get(self, key: str) -> KeyValue | None:
        path = self.path(key)
        value = self._read(path, time.time())
        return None if value is None else self._kv(key, path, value)

    def list(self, prefix: str) -> list[KeyValue]:
        """The live keys under ``prefix`` (any prefix: those not under ``v1/`` match nothing here)."""
        if not (prefix.startswith(PREFIX) or PREFIX.startswith(prefix)):
            return []
        now = time.time()
        out = []
        seen: set[Path] = set()
        for bucket_dir in self.bucket_dirs():
            bucket_key = f"{PREFIX}{bucket_dir.name}/"
            if not (bucket_key.startswith(prefix) or prefix.startswith(bucket_key)):
                continue
            try:
                names = os.listdir(bucket_dir)
            except FileNotFoundError:
                continue
            for name in names:
                if name.startswith("."):
                    continue
                key = bucket_key + decode_name(name)
                if not key.startswith(prefix):
                    continue
                path = bucket_dir / name
                seen.add(path)
                value = self._read(path, now)
                if value is not None:
                    out.append(self._kv(key, path, value))
        if prefix in ("", PREFIX[:1], PREFIX[:2], PREFIX):  # a full listing: forget files that went
            with self._lock:
                for gone in [p for p in self._cache if p not in seen]:
                    del self._cache[gone]
        return out

    # ------------------------------------------------------------------ changes

    def _temp(self, directory: Path, value: bytes) -> Path:
        for _ in range(16):
            tmp = directory / f"{TMP_PREFIX}{secrets.randbits(64):016x}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue
            try:
                view = memoryview(value)
                while view:
                    view = view[os.write(fd, view):]
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
            os.close(fd)
            return tmp
        raise FileStoreError(f"cannot create a temporary file in {directory}")

    def _publish(self, key: str, value: bytes, lease: int, *, if_absent: bool) -> bool:
        path = self.path(key)
        make_private_dir(path.parent)  # a bucket of another name than ours
        tmp = self._temp(path.parent, value)
        try:
            if if_absent:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    if self._read(path, time.time()) is not None:
                        return False
                    os.replace(tmp, path)  # a stale file (its writer died): as good as absent
            else:
                os.replace(tmp, path)
        except OSError as exc:
            raise FileStoreError(f"cannot write {key} to the file store {self.dir.parent}: {exc.strerror}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        with self._lock:
            self.owned[path] = (lease, value)  # lease 0: kept alive for as long as this process runs
        return True

    def put(self, key: str, value: bytes, lease: int) -> None:
        self._publish(key, value, lease, if_absent=False)

    def create(self, key: str, value: bytes, lease: int) -> bool:
        return self._publish(key, value, lease, if_absent=True)

    def put_if_changed(self, key: str, value: bytes, lease: int) -> bool:
        current = self.get(key)
        if current is not None and current.value == value and current.lease == lease:
            return False
        self.put(key, value, lease)
        return True

    def delete(self, key: str) -> int:
        path = self.path(key)
        live = self._read(path, time.time()) is not None
        with self._lock:
            self.owned.pop(path, None)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return int(live)

    def delete_prefix(self, prefix: str) -> int:
        kvs = self.list(prefix)
        for kv in kvs:
            self.delete(kv.key)
        return len(kvs)

    # ------------------------------------------------------------------ liveness

    def touch(self, alive: "set[int] | None" = None) -> None:
        """Refresh the mtime of every file this process keeps alive (of the leases in ``alive``, if given;
        lease 0 always); a file someone removed meanwhile (reaped while this process was stopped) is
        written again."""
        with self._lock:
            owned = list(self.owned.items())
        now = time.time()
        for path, (lease, value) in owned:
            if alive is not None and lease and lease not in alive:
                continue
            try:
                os.utime(path, (now, now))
            except FileNotFoundError:
                with self._lock:
                    if self.owned.get(path) != (lease, value):
                        continue  # deleted or rewritten meanwhile
                log.info("file store: %s was removed while this process still holds it; writing it again", path)
                with contextlib.suppress(OSError, FileStoreError):
                    tmp = self._temp(path.parent, value)
                    os.replace(tmp, path)
            except OSError as exc:
                log.warning("file store: cannot keep %s alive: %s", path, exc.strerror)

    def leases(self) -> set[int]:
        with self._lock:
            return {lease for lease, _ in self.owned.values()}

    def names_of(self, lease: int) -> tuple[str, ...]:
        """This process's files of ``lease``, as ``<bucket>/<file name>``: what its lease record lists, so
        that whoever expires the lease removes them (:meth:`remove_named`)."""
        with self._lock:
            return tuple(sorted(f"{p.parent.name}/{p.name}" for p, (owner, _) in self.owned.items() if owner == lease))

    def remove_named(self, names: object) -> int:
        """Remove the files an expired lease's record lists (another process's: it died); a name that is
        not ``<bucket>/<file name>`` is skipped, so a record cannot point outside the buckets."""
        gone = 0
        for name in names if isinstance(names, list) else []:
            parts = name.split("/") if isinstance(name, str) else []
            if len(parts) != 2 or any(part in ("", ".", "..") for part in parts):
                continue
            with contextlib.suppress(FileNotFoundError):
                (self.dir / parts[0] / parts[1]).unlink()
                gone += 1
        return gone

    def drop_lease(self, lease: int) -> int:
        """Remove this process's files of ``lease`` (revoked or expired); how many went."""
        with self._lock:
            paths = [p for p, (owner, _) in self.owned.items() if owner == lease]
            for p in paths:
                del self.owned[p]
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        return len(paths)

    def reap(self) -> int:
        """Remove files untouched for STALE_AFTER (their writers died), as 1.x does; how many went."""
        deadline = time.time() - STALE_AFTER
        gone = 0
        for bucket_dir in self.bucket_dirs():
            try:
                entries = list(os.scandir(bucket_dir))
            except FileNotFoundError:
                continue
            for entry in entries:
                try:
                    if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < deadline:
                        os.unlink(entry.path)
                        gone += 1
                except FileNotFoundError:
                    continue
        return gone
