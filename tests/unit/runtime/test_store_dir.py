"""The file store's directory is this user's alone (runtime/store_dir.py): created 0700 whatever the umask,
records 0600, and a directory someone else could have planted refused with one line naming the path and
the fix; a directory ``DYN_FILE_KV`` names deliberately may belong to a trusted owner, but never be
writable by group or others."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterator

import pytest

from dynamo.runtime.file_kv import FileKv
from dynamo.runtime.file_object_store import FileObjectStore
from dynamo.runtime.file_store import FileStore
from dynamo.runtime.store_dir import FileStoreError, secure_store_dir, write_private

OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask that takes nothing away: modes must come from the code, not from the umask."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("explicit", [False, True])
def test_a_new_directory_is_created_0700(tmp_path: Path, open_umask: None, explicit: bool) -> None:
    root = tmp_path / "parent" / "store"
    secure_store_dir(root, explicit=explicit)
    assert mode(root) == 0o700


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("unsafe", [0o777, 0o1777, 0o770, 0o702])
def test_a_directory_group_or_others_may_write_is_refused(tmp_path: Path, explicit: bool, unsafe: int) -> None:
    root = tmp_path / "store"
    root.mkdir()
    os.chmod(root, unsafe)
    with pytest.raises(FileStoreError) as info:
        secure_store_dir(root, explicit=explicit)
    message = str(info.value)
    assert "\n" not in message
    assert str(root) in message and f"mode {unsafe:04o}" in message
    assert f"chmod 700 {root}" in message and "DYN_FILE_KV" in message
    assert mode(root) == unsafe  # refused, not changed behind the user's back


def test_a_default_directory_of_ours_that_others_may_read_is_narrowed(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    os.chmod(root, 0o755)  # as an earlier version left it under umask 022
    secure_store_dir(root, explicit=False)
    assert mode(root) == 0o700


def test_a_directory_named_deliberately_keeps_its_safe_mode(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    os.chmod(root, 0o750)
    secure_store_dir(root, explicit=True)
    assert mode(root) == 0o750


def test_a_file_in_the_way_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.write_text("not a directory")
    with pytest.raises(FileStoreError, match=f"cannot use {root} as the file discovery store: not a directory"):
        secure_store_dir(root, explicit=False)


@as_root
def test_a_default_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(FileStoreError) as info:
        secure_store_dir(root, explicit=False)
    message = str(info.value)
    assert "\n" not in message
    assert f"{root} is owned by another user (uid {OTHER_UID})" in message
    assert "set DYN_FILE_KV to a directory of your own" in message


@as_root
def test_a_trusted_owner_is_accepted_when_named_deliberately_and_safe(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    os.chown(root, OTHER_UID, OTHER_UID)
    secure_store_dir(root, explicit=True)
    os.chmod(root, 0o775)
    with pytest.raises(FileStoreError, match="writable by group or others"):
        secure_store_dir(root, explicit=True)


@as_root
def test_a_default_path_that_is_another_users_link_is_refused(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    root = tmp_path / "store"
    root.symlink_to(mine)
    os.lchown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(FileStoreError, match="symbolic link owned by another user"):
        secure_store_dir(root, explicit=False)


def test_write_private_is_0600_whatever_the_umask(tmp_path: Path, open_umask: None) -> None:
    write_private(tmp_path / "record", b"x" * 100_000)
    assert mode(tmp_path / "record") == 0o600
    assert (tmp_path / "record").read_bytes() == b"x" * 100_000
    with pytest.raises(FileExistsError):  # a new file only: never follows or reuses a planted one
        write_private(tmp_path / "record", b"y")


async def test_every_file_and_directory_of_the_store_is_private(tmp_path: Path, open_umask: None) -> None:
    root = tmp_path / "store"
    store = FileStore(root)
    await store.connect()
    try:
        lease = await store.grant_lease(10)
        await store.put("instances/ns/c/e:1", b"{}", lease)
        await store.keep_alive(lease)
        assert await FileObjectStore(root, "mdc").put_if_absent("tokenizer.json", b"{}")
    finally:
        await store.close()
    FileKv(tmp_path / "made-by-the-directory-class")  # created 0700 even without FileStore's check
    paths = [root, *root.rglob("*"), tmp_path / "made-by-the-directory-class"]
    dirs = {str(p.relative_to(tmp_path)): mode(p) for p in paths if p.is_dir()}
    files = {str(p.relative_to(tmp_path)): mode(p) for p in paths if p.is_file()}
    assert set(dirs.values()) == {0o700}, dirs
    assert set(files.values()) == {0o600}, files
    assert {"store/lock", "store/revision"} <= set(files) and any("leases/" in f for f in files)
    assert any("/kv/" in f for f in files) and any("objects/mdc/" in f for f in files)


async def test_file_store_refuses_an_open_default_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_FILE_KV", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    planted = tmp_path / "dynamo_store_kv"
    planted.mkdir()
    os.chmod(planted, 0o777)
    store = FileStore()
    assert store.root == planted and not store.explicit
    with pytest.raises(FileStoreError, match=f"{planted} is writable by group or others"):
        await store.connect()
