"""Whose folders the directory tiers use (tiers/dir/folders.py).

A node's private tiers (node memory ``shm``, ``disk``) use only folders and
lock files of their own user, writable by nobody else: another user of the
node who owns one could plant objects or hold the tier's lock. The tests
run as root and play the other user by chown to ``nobody`` (65534). A
shared tier's folder must exist (an unmounted mount point is refused, not
filled on the local disk), and a link planted inside a store is refused
with a message naming it and the fix."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.tiers import shm
from kvtier.tiers.disk import DiskConfig, DiskTier
from kvtier.tiers.shared import SharedConfig, SharedTier
from kvtier.tiers.shm import ShmConfig, ShmTier
from tests.support import OBJ, make_chunks

OTHER = 65534  # nobody: the other user of the node


@pytest.fixture(autouse=True)
def _as_root():
    assert os.geteuid() == 0, "these tests play another user by chown, which needs root"


def _shm(path: Path) -> ShmTier:
    return ShmTier(ShmConfig(capacity=16 * OBJ, path=str(path)))


def _disk(path: Path) -> DiskTier:
    return DiskTier(DiskConfig(path=str(path), capacity=16 * OBJ, io_threads=2))


def _refused(open_tier, *needles: str) -> str:
    with pytest.raises(ConfigError) as info:
        open_tier().close()
    msg = str(info.value)
    for n in needles:
        assert n in msg, msg
    assert "Fix:" in msg
    return msg


def _works(tier) -> None:
    try:
        c = make_chunks(2)
        assert tier.store(c.objs) == 2 and tier.lookup(c.keys) == 2
    finally:
        tier.close()


def test_a_default_node_memory_folder_made_by_another_user_is_refused(tmp_path, monkeypatch):
    """Another user creates /dev/shm/kvtier-UID before kvtier does: kvtier
    must not make its tier inside it, nor use one they made there."""
    planted = tmp_path / "kvtier-0"
    planted.mkdir(mode=0o755)
    os.chown(planted, OTHER, OTHER)
    monkeypatch.setattr(shm, "default_dir", lambda: str(planted))
    _refused(lambda: ShmTier(ShmConfig(capacity=16 * OBJ)), str(planted), "nobody (uid 65534)")
    assert os.listdir(planted) == []  # nothing made in their folder
    (planted / "shm").mkdir(mode=0o700)  # the tier's own folder, theirs too
    os.chown(planted / "shm", OTHER, OTHER)
    _refused(lambda: ShmTier(ShmConfig(capacity=16 * OBJ)), str(planted / "shm"), "nobody (uid 65534)")
    assert os.listdir(planted / "shm") == []


@pytest.mark.parametrize("open_tier", [_shm, _disk], ids=["shm", "disk"])
def test_a_private_tiers_folder_of_another_user_is_refused(tmp_path, open_tier):
    root = tmp_path / "tier"
    _works(open_tier(root))
    for path in (root, root / "kvtier-v1", root / "kvtier-v1" / "tmp"):
        os.chown(path, OTHER, OTHER)
        _refused(lambda: open_tier(root), f"{path} belongs to nobody (uid 65534)", "chown -R 0")
        os.chown(path, 0, 0)
    _works(open_tier(root))


@pytest.mark.parametrize("open_tier", [_shm, _disk], ids=["shm", "disk"])
@pytest.mark.parametrize("mode,who", [(0o770, "its group"), (0o707, "every user"), (0o777, "its group and every user")])
def test_a_private_tiers_folder_others_can_write_is_refused(tmp_path, open_tier, mode, who):
    root = tmp_path / "tier"
    _works(open_tier(root))
    for path in (root, root / "kvtier-v1" / "objects"):
        os.chmod(path, mode)
        _refused(lambda: open_tier(root), f"{path} is writable by {who}", f"chmod go-w {path}")
        os.chmod(path, 0o700)


def test_the_folder_a_private_tier_is_in_must_be_safe_from_other_users(tmp_path):
    parent = tmp_path / "parent"
    parent.mkdir(mode=0o777)
    os.chmod(parent, 0o777)  # whoever can rename entries here can swap the tier's folder
    _refused(lambda: _shm(parent / "tier"), f"{parent}, the folder {parent / 'tier'} is in", "not sticky")
    assert os.listdir(parent) == []
    os.chmod(parent, 0o1777)  # sticky, as /tmp and /dev/shm: others cannot rename what is ours
    _works(_shm(parent / "tier"))
    os.chmod(parent, 0o755)
    os.chown(parent, OTHER, OTHER)
    _refused(lambda: _shm(parent / "tier"), f"{parent}, the folder {parent / 'tier'} is in, belongs to nobody")


def test_a_link_of_another_user_on_the_way_is_refused(tmp_path):
    """Whoever owns a link on the tier's path can point it elsewhere after
    the checks (kvtier opens its folders by path for each operation)."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    os.lchown(link, OTHER, OTHER)
    _refused(lambda: _shm(link / "tier"), f"{link}, on the way to {link / 'tier'}, is a symbolic link of nobody")
    assert os.listdir(real) == []
    os.lchown(link, 0, 0)  # this user's own link: the operator's choice of path
    _works(_shm(link / "tier"))


@pytest.mark.parametrize("open_tier,lock", [(_shm, "node.lock"), (_shm, "node.ledger"), (_disk, "disk.lock")])
def test_a_lock_file_another_user_can_hold_is_refused(tmp_path, open_tier, lock):
    """A lock or ledger file of another user's (or one others can write)
    would let them hold the tier's lock or skew its ledger."""
    root = tmp_path / "tier"
    _works(open_tier(root))
    path = root / "kvtier-v1" / lock
    os.chown(path, OTHER, OTHER)
    os.chmod(path, 0o666)
    _refused(lambda: open_tier(root), f"the file {path} belongs to nobody", f"rm {path}")
    os.chown(path, 0, 0)
    _refused(lambda: open_tier(root), f"the file {path} is writable by its group and every user")
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere")
    _refused(lambda: open_tier(root), f"{path} is a symbolic link")
    assert not (tmp_path / "elsewhere").exists()
    path.unlink()
    _works(open_tier(root))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_disk_tiers_access_log_of_another_user_is_replaced_by_its_own(tmp_path):
    """The log is rewritten whole at each start: one that is not the tier's
    own is not appended to, it is replaced."""
    root = tmp_path / "tier"
    _works(_disk(root))
    log = root / "kvtier-v1" / "access.log"
    os.chown(log, OTHER, OTHER)
    os.chmod(log, 0o666)
    _works(_disk(root))
    st = log.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)


def test_a_shared_tiers_folder_must_exist(tmp_path):
    """An unmounted mount point is not filled on the local disk."""
    mnt = tmp_path / "mnt" / "kv"
    _refused(lambda: SharedTier(SharedConfig(path=str(mnt), capacity=16 * OBJ)),
             f"{mnt} does not exist", f"mount the shared file system at {mnt}")
    assert not (tmp_path / "mnt").exists()
    mnt.mkdir(parents=True)
    _works(SharedTier(SharedConfig(path=str(mnt), capacity=16 * OBJ, gc_interval_s=0)))
    assert sorted(os.listdir(mnt)) == ["kvtier-v1"]


def test_a_shared_tiers_owners_and_modes_are_the_operators(tmp_path):
    """Many nodes, possibly under several uids, use one shared folder: its
    owner and mode are not checked (only links and files are refused)."""
    root = tmp_path / "kv"
    root.mkdir()
    os.chown(root, OTHER, OTHER)
    os.chmod(root, 0o777)
    _works(SharedTier(SharedConfig(path=str(root), capacity=16 * OBJ, gc_interval_s=0)))


@pytest.mark.parametrize("where", ["kvtier-v1/tmp", "kvtier-v1/objects", "kvtier-v1"])
def test_a_link_planted_in_a_shared_store_names_itself_and_the_fix(tmp_path, where):
    root = tmp_path / "kv"
    root.mkdir()
    _works(SharedTier(SharedConfig(path=str(root), capacity=16 * OBJ, gc_interval_s=0)))
    target = tmp_path / "target"
    target.mkdir()
    planted = root / where
    os.rename(planted, tmp_path / "moved")
    planted.symlink_to(target)
    msg = _refused(lambda: SharedTier(SharedConfig(path=str(root), capacity=16 * OBJ)),
                   f"{planted} is a symbolic link (to {target})", f"remove the link (rm {planted}")
    assert "not usable" not in msg
    assert os.listdir(target) == []  # nothing written through it
    planted.unlink()
    os.rename(tmp_path / "moved", planted)
    _works(SharedTier(SharedConfig(path=str(root), capacity=16 * OBJ, gc_interval_s=0)))


def test_a_file_where_a_store_keeps_a_folder_names_itself(tmp_path):
    root = tmp_path / "kv"
    root.mkdir()
    (root / "kvtier-v1").mkdir()
    (root / "kvtier-v1" / "tmp").write_text("x")
    _refused(lambda: SharedTier(SharedConfig(path=str(root), capacity=16 * OBJ)),
             f"{root / 'kvtier-v1' / 'tmp'} is a regular file", "mv ")
