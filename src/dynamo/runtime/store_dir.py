"""The file store's directory is this user's alone: created 0700, records written 0600, and a directory
someone else could have planted refused.

Why: the default store is ``$TMPDIR/dynamo_store_kv``, a predictable name in a directory every user can
write. Whoever owns it, or can write in it, can read the fleet's records and register an instance of
their own under our namespace, and the frontend then sends our users' prompts to their process. So a
directory that exists and belongs to another user, or that group or others may write, is refused with
one line naming the path and the fix; the one exception is a directory ``DYN_FILE_KV`` names
deliberately whose owner the user trusts, and even that must not be writable by group or others.

Files are created with an explicit mode and ``fchmod``-ed to it, so the process's umask never widens
(or, with an unusual umask, narrows) them.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from pathlib import Path

from .errors import DynamoRuntimeError

log = logging.getLogger(__name__)

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH
_GROUP_OTHER_ANY = 0o077


class FileStoreError(DynamoRuntimeError):
    """The store refused a change (a lease that is not there, a lease id in use, an unusable directory)."""


def make_private_dir(path: Path) -> bool:
    """Create ``path`` (and missing parents) with mode 0700; True when this call created it."""
    try:
        path.mkdir(mode=PRIVATE_DIR, parents=True)
    except FileExistsError:
        return False
    os.chmod(path, PRIVATE_DIR)  # mkdir's mode goes through the umask
    return True


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` (which must not exist) readable by this user only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE)
    try:
        os.fchmod(fd, PRIVATE_FILE)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def open_private(path: Path, flags: int) -> int:
    """``os.open`` of a file this store owns (the lock file): created 0600, whatever the umask."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, PRIVATE_FILE)
    except OSError:
        os.close(fd)
        raise
    return fd


def _fix(root: Path) -> str:
    return f"set DYN_FILE_KV to a directory of your own (it is created 0700), or remove {root}"


def secure_store_dir(root: Path, *, explicit: bool) -> None:
    """Create the store's directory 0700, or check that the one there is safe to use.

    ``explicit``: ``DYN_FILE_KV`` (or the code) named this directory, so another owner is accepted (the
    user chose to trust them); a directory that group or others may write never is. A default directory
    of ours that others may still read (made by an earlier version under the umask) is narrowed to 0700:
    nobody else can have been using it, since that needs writing. Raises :class:`FileStoreError` with
    one line naming the path and the fix.
    """
    try:
        if make_private_dir(root):
            return
        link = os.lstat(root)
        st = os.stat(root)
    except OSError as exc:
        reason = "permission denied" if exc.errno in (errno.EACCES, errno.EPERM) else exc.strerror
        raise FileStoreError(f"cannot use {root} as the file discovery store: {reason}") from None
    me = os.geteuid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, 0) and not explicit:
        raise FileStoreError(f"the file discovery store {root} is a symbolic link owned by another user "
                             f"(uid {link.st_uid}), who could point it anywhere: {_fix(root)}")
    if not stat.S_ISDIR(st.st_mode):
        raise FileStoreError(f"cannot use {root} as the file discovery store: not a directory")
    mode = stat.S_IMODE(st.st_mode)
    if mode & _GROUP_OTHER_WRITE:
        raise FileStoreError(
            f"the file discovery store {root} is writable by group or others (mode {mode:04o}), so another "
            f"user could read this fleet's records or register a worker in it: chmod 700 {root}, or set "
            "DYN_FILE_KV to a directory of your own")
    if st.st_uid != me and not explicit:
        raise FileStoreError(
            f"the file discovery store {root} is owned by another user (uid {st.st_uid}), who could read "
            f"this fleet's records or register a worker in it: {_fix(root)} (point DYN_FILE_KV at it only "
            "if you trust its owner)")
    if st.st_uid == me and mode & _GROUP_OTHER_ANY and not explicit:
        try:
            os.chmod(root, PRIVATE_DIR)
        except OSError as exc:
            raise FileStoreError(f"cannot make the file discovery store {root} private (chmod 700): "
                                 f"{exc.strerror}") from None
        log.info("file store %s: mode %04o narrowed to 0700 (this user's only)", root, mode)


LOCAL_SECRET = "local_secret"  # the store's own secret (:func:`local_secret`)
_MIN_LOCAL_SECRET = 32


def is_private_dir(root: Path) -> bool:
    """Whether ``root`` is this user's alone: owned by them, and neither group nor others may read, write
    or enter it (the default store always is, once opened; a ``DYN_FILE_KV`` directory may not be)."""
    st = os.stat(root)
    return st.st_uid == os.geteuid() and not stat.S_IMODE(st.st_mode) & _GROUP_OTHER_ANY


def local_secret(root: Path) -> bytes:
    """A secret only this user's processes sharing the store ``root`` can read: 64 hex characters in
    ``root/local_secret`` (0600), made by whichever process asks first.

    Why: on one machine the store is the one thing the fleet's processes share that no other user can
    read, so a key kept there authenticates them to each other with nothing to configure (another local
    user reaches loopback ports, not this directory). Create-if-absent by hard link, so processes starting
    together agree on one secret. Call it only for a store :func:`is_private_dir` accepts.
    """
    path = root / LOCAL_SECRET
    if not path.exists():
        tmp = root / f".tmp-secret-{os.getpid()}-{secrets.token_hex(6)}"
        write_private(tmp, secrets.token_hex(32).encode())
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process made it first: theirs it is
            pass
        finally:
            tmp.unlink()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & _GROUP_OTHER_ANY:
            raise FileStoreError(f"{path} is not this user's alone (owner uid {st.st_uid}, mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}): remove it")
        value = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(value) < _MIN_LOCAL_SECRET:
        raise FileStoreError(f"{path} holds {len(value)} characters, not a secret: remove it")
    return value
