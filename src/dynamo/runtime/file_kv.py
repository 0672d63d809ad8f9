"""The file store's directory, synchronously: keys as files, leases as files with an expiry time, a
revision counter, one lock. :mod:`.file_store` runs these calls off the event loop and adds watches.

Layout under the root (``DYN_FILE_KV``, default ``$TMPDIR/dynamo_store_kv``)::

    kv/k_<percent-encoded key>   one file per key (h_<sha256> when the encoding is too long for a name):
                                 a JSON header line (key, lease, revisions, version), then the value
    leases/<hex id>              {"id", "ttl", "expires": wall-clock seconds, "pid", "v1": [its v1/ files]}
    revision                     the store's revision counter
    lock                         flock'ed around every change, by every process
    local_secret                 the store's own secret, made when first asked for (store_dir.local_secret)
    v1/<bucket>/<encoded key>    keys starting ``v1/``: Dynamo 1.x's records in 1.x's own format, no lock,
                                 alive while touched (:mod:`.file_v1`)

Why files and one lock: the processes of one host need to agree on who is alive without a server to
start. Every change takes the lock (``fcntl.flock``: released by the kernel when its holder dies, even by
kill -9), so create-if-absent, compare-and-write and the revision counter are atomic across processes;
every file is written whole to a temporary name and renamed over (``os.replace``), so readers never
take the lock and never see half a file.

A lease is alive while its file's ``expires`` is in the future; its owner moves it forward on every
keep-alive. Nobody has to notice a process die: to every reader, a key whose lease is gone or past its
expiry does not exist, and whoever next cleans up (a keep-alive, a watcher's tick, a new process opening
the store) deletes those files. Expiry uses the wall clock because the processes share nothing else;
a clock jump by more than a TTL can expire (or extend) leases once, as it would on any host.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Iterator
from urllib.parse import quote

import orjson

from .discovery import KeyValue
from .file_v1 import V1Files, is_v1_key
from .store_dir import FileStoreError, make_private_dir, open_private, write_private

__all__ = ["FileKv", "FileStoreError", "check_writable", "key_file_name", "write_atomically"]

MAX_ENCODED_NAME = 200  # longest percent-encoded key kept readable as a file name (names stop at 255 bytes)


def key_file_name(key: str) -> str:
    """A key as a file name: percent-encoded (readable, injective), or hashed when that is too long."""
    encoded = quote(key, safe="")
    if len(encoded) <= MAX_ENCODED_NAME:
        return "k_" + encoded
    return "h_" + hashlib.sha256(key.encode()).hexdigest()


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` (mode 0600: the store's records are this user's
    only) and rename it over ``path``."""
    tmp = path.parent / f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        write_private(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class FileKv:
    """The store's directory; thread-safe (its callers run it in worker threads)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.keys_dir = self.root / "kv"
        self.leases_dir = self.root / "leases"
        try:
            for path in (self.root, self.keys_dir, self.leases_dir):
                make_private_dir(path)
        except OSError as exc:
            raise FileStoreError(f"cannot use {self.root} as the file discovery store: {exc.strerror}") from None
        self._lock_path = self.root / "lock"
        self._revision_path = self.root / "revision"
        # file name -> ((inode, mtime, size), record): a file is read again only when it was replaced
        self._cache: dict[str, tuple[tuple[int, int, int], KeyValue]] = {}
        self._cache_lock = threading.Lock()
        self.v1 = V1Files(self.root)  # keys under v1/, shared with Dynamo 1.x processes

    # ------------------------------------------------------------------ primitives

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The store's one lock, across processes (a new open file each time, so threads exclude too)."""
        fd = open_private(self._lock_path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def revision(self) -> int:
        try:
            return int(self._revision_path.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _bump(self) -> int:
        """The next revision (under the lock)."""
        rev = self.revision() + 1
        write_atomically(self._revision_path, str(rev).encode())
        return rev

    def _read_key_file(self, path: Path) -> KeyValue | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._cache_lock:
            hit = self._cache.get(path.name)
        if hit is not None and hit[0] == sig:
            return hit[1]
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        header, _, value = raw.partition(b"\n")
        try:
            meta = orjson.loads(header)
            kv = KeyValue(meta["key"], value, meta["create"], meta["mod"], meta["version"], meta["lease"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None  # not ours (a stray file): ignored
        with self._cache_lock:
            self._cache[path.name] = (sig, kv)
        return kv

    def _write_key(self, kv: KeyValue) -> None:
        header = orjson.dumps({"key": kv.key, "lease": kv.lease, "create": kv.create_revision,
                               "mod": kv.mod_revision, "version": kv.version})
        write_atomically(self.keys_dir / key_file_name(kv.key), header + b"\n" + kv.value)

    def _unlink_key(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.keys_dir / key_file_name(key)).unlink()

    def _all_keys(self) -> list[KeyValue]:
        """Every key file as written, live or not."""
        out = []
        try:
            names = os.listdir(self.keys_dir)
        except FileNotFoundError:
            return []
        live_names = set()
        for name in names:
            if name.startswith("."):
                continue
            live_names.add(name)
            kv = self._read_key_file(self.keys_dir / name)
            if kv is not None:
                out.append(kv)
        with self._cache_lock:
            for gone in [n for n in self._cache if n not in live_names]:
                del self._cache[gone]
        return out

    def lease_expiries(self) -> dict[int, float]:
        """Lease id -> expiry (wall-clock seconds) of every lease file."""
        out: dict[int, float] = {}
        try:
            names = os.listdir(self.leases_dir)
        except FileNotFoundError:
            return out
        for name in names:
            if name.startswith("."):
                continue
            record = self._read_lease(name)
            if record is not None:
                out[int(record["id"])] = float(record["expires"])
        return out

    def _read_lease(self, name: str) -> dict | None:
        try:
            record = orjson.loads((self.leases_dir / name).read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            return None
        return record if isinstance(record, dict) and "id" in record and "expires" in record else None

    def _lease_path(self, lease_id: int) -> Path:
        return self.leases_dir / format(lease_id, "x")

    def _lease_alive(self, lease_id: int, now: float | None = None) -> bool:
        if not lease_id:
            return True
        record = self._read_lease(self._lease_path(lease_id).name)
        return record is not None and float(record["expires"]) > (now if now is not None else time.time())

    def _current(self, key: str) -> KeyValue | None:
        """The key as readers see it: None when absent or when its lease is gone."""
        kv = self._read_key_file(self.keys_dir / key_file_name(key))
        if kv is None or kv.key != key or not self._lease_alive(kv.lease):
            return None
        return kv

    # ------------------------------------------------------------------ reads (no lock)

    def get(self, key: str) -> KeyValue | None:
        return self.v1.get(key) if is_v1_key(key) else self._current(key)

    def get_prefix_with_revision(self, prefix: str) -> tuple[list[KeyValue], int]:
        """The live keys under ``prefix`` (by key) and the revision read before listing them."""
        revision = self.revision()
        now = time.time()
        leases = self.lease_expiries()
        kvs = [kv for kv in self._all_keys()
               if kv.key.startswith(prefix) and (not kv.lease or leases.get(kv.lease, 0.0) > now)]
        kvs.extend(self.v1.list(prefix))
        kvs.sort(key=lambda kv: kv.key)
        return kvs, revision

    # ------------------------------------------------------------------ changes (under the lock)

    def _write(self, key: str, value: bytes, lease: int, old: KeyValue | None) -> int:
        if lease and not self._lease_alive(lease):
            raise FileStoreError(f"lease {lease:x} not found in the file store (expired or revoked)")
        rev = self._bump()
        created = old.create_revision if old is not None else rev
        version = old.version + 1 if old is not None else 1
        self._write_key(KeyValue(key, value, created, rev, version, lease))
        return rev

    def _check_lease(self, lease: int) -> None:
        if lease and not self._lease_alive(lease):
            raise FileStoreError(f"lease {lease:x} not found in the file store (expired or revoked)")

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        if is_v1_key(key):
            self._check_lease(lease)
            self.v1.put(key, value, lease)
            self._bind_v1(lease)
            return self.revision()
        with self.locked():
            return self._write(key, value, lease, self._current(key))

    def create(self, key: str, value: bytes, lease: int = 0) -> bool:
        if is_v1_key(key):
            self._check_lease(lease)
            created = self.v1.create(key, value, lease)
            if created:
                self._bind_v1(lease)
            return created
        with self.locked():
            if self._current(key) is not None:
                return False
            self._write(key, value, lease, None)
            return True

    def put_if_changed(self, key: str, value: bytes, lease: int) -> bool:
        if is_v1_key(key):
            self._check_lease(lease)
            changed = self.v1.put_if_changed(key, value, lease)
            if changed:
                self._bind_v1(lease)
            return changed
        with self.locked():
            old = self._current(key)
            if old is not None and old.value == value and old.lease == lease:
                return False
            self._write(key, value, lease, old)
            return True

    def delete(self, key: str) -> int:
        if is_v1_key(key):
            return self.v1.delete(key)
        with self.locked():
            live = self._current(key) is not None
            self._unlink_key(key)
            if live:
                self._bump()
            return int(live)

    def delete_prefix(self, prefix: str) -> int:
        gone = self.v1.delete_prefix(prefix)
        with self.locked():
            kvs = [kv for kv in self.get_prefix_with_revision(prefix)[0] if not is_v1_key(kv.key)]
            for kv in kvs:
                self._unlink_key(kv.key)
            if kvs:
                self._bump()
            return len(kvs) + gone

    def grant_lease(self, ttl: int, lease_id: int = 0) -> int:
        with self.locked():
            if lease_id and self._lease_alive(lease_id):
                raise FileStoreError(f"lease {lease_id:x} already exists in the file store")
            while not lease_id:
                candidate = secrets.randbits(62) or 1
                if not self._lease_path(candidate).exists():
                    lease_id = candidate
            self._drop_lease_keys(lease_id)  # leftovers of an expired lease with this id are gone, not revived
            self._write_lease(lease_id, ttl)
            return lease_id

    def _write_lease(self, lease_id: int, ttl: int) -> None:
        record: dict[str, object] = {"id": lease_id, "ttl": ttl, "expires": time.time() + ttl, "pid": os.getpid()}
        names = self.v1.names_of(lease_id)
        if names:  # whoever expires the lease removes them (file_v1.py)
            record["v1"] = names
        write_atomically(self._lease_path(lease_id), orjson.dumps(record))

    def _bind_v1(self, lease: int) -> None:
        """List a ``v1/`` file just written under ``lease`` in the lease's record at once (not at the next
        keep-alive), so that a process killed right after writing it leaves nothing for 10 s."""
        if not lease:
            return
        with self.locked():
            record = self._read_lease(self._lease_path(lease).name)
            if record is not None and float(record["expires"]) > time.time():
                record["v1"] = self.v1.names_of(lease)
                write_atomically(self._lease_path(lease), orjson.dumps(record))

    def keep_alive(self, lease_id: int) -> tuple[int, int]:
        """(TTL, revision); TTL 0 when the lease is gone or expired (its keys are deleted then)."""
        with self.locked():
            record = self._read_lease(self._lease_path(lease_id).name)
            if record is None or float(record["expires"]) <= time.time():
                self._expire(lease_id)
                return 0, self.revision()
            ttl = int(record.get("ttl", 0)) or 1
            self._write_lease(lease_id, ttl)
            return ttl, self.revision()

    def revoke_lease(self, lease_id: int) -> None:
        with self.locked():
            self._expire(lease_id)

    def _drop_lease_keys(self, lease_id: int) -> int:
        gone = [kv.key for kv in self._all_keys() if kv.lease == lease_id]
        for key in gone:
            self._unlink_key(key)
        self.v1.drop_lease(lease_id)  # this process's v1/ files of it (others' go stale by themselves)
        return len(gone)

    def _expire(self, lease_id: int) -> None:
        """Delete a lease's keys and its file (under the lock)."""
        if self._drop_lease_keys(lease_id):
            self._bump()
        with contextlib.suppress(FileNotFoundError):
            self._lease_path(lease_id).unlink()

    def touch_v1(self) -> None:
        """Keep this process's ``v1/`` files alive while their leases live (1.x readers go by mtime)."""
        alive = {lease for lease in self.v1.leases() if self._lease_alive(lease)}
        self.v1.touch(alive)

    def clean_up(self) -> int:
        """Delete every expired lease with its keys, keys whose lease file is gone (a crash between the two
        deletions) and stale ``v1/`` files; how many keys went. Cheap when there is nothing to do: no lock
        taken."""
        reaped = self.v1.reap()
        return reaped + self._clean_up_leases()

    def _clean_up_leases(self) -> int:
        now = time.time()
        leases = self.lease_expiries()
        expired = {lid for lid, expires in leases.items() if expires <= now}
        orphans = [kv for kv in self._all_keys() if kv.lease and kv.lease not in leases]
        if not expired and not orphans:
            return 0
        deleted = 0
        with self.locked():
            leases = self.lease_expiries()  # again, under the lock: an owner may have refreshed meanwhile
            now = time.time()
            for kv in self._all_keys():
                if kv.lease and leases.get(kv.lease, 0.0) <= now:
                    self._unlink_key(kv.key)
                    deleted += 1
            for lid, expires in leases.items():
                if expires <= now:
                    record = self._read_lease(self._lease_path(lid).name) or {}
                    deleted += self.v1.remove_named(record.get("v1"))  # its dead owner's v1/ files
                    with contextlib.suppress(FileNotFoundError):
                        self._lease_path(lid).unlink()
            if deleted:
                self._bump()
        return deleted


def check_writable(root: Path) -> None:
    """A clear error when the store's directory cannot be written (read-only, wrong owner)."""
    # unique per call: several runtimes of one process (the mocker's --num-workers) probe at once
    probe = root / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = "permission denied" if exc.errno in (errno.EACCES, errno.EPERM) else exc.strerror
        raise FileStoreError(f"cannot write to the file discovery store {root}: {reason}") from None
