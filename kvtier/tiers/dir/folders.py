"""The folders and small files a directory tier keeps beside its objects,
opened so that nobody else controls them.

A node's private tiers (the node memory tier ``shm`` and the ``disk`` tier)
are one user's: any other user of the node is a possible attacker. Whoever
owns or can write one of their folders can plant objects that every engine
of the node reads, and can hold the tier's lock so that no engine stores.
So for a private tier (``ObjectDir(..., shared=False)``):

- its folder and every folder kvtier keeps in it (``kvtier-v1/``,
  ``objects/``, ``tmp/``, ``quarantine/``) must be owned by this process's
  user and writable by nobody else (no group or world write bit);
- the folder it sits in (and, where kvtier makes the tier's folder, the
  existing folder it makes it in) must be owned by this user or root, and
  writable by nobody else unless sticky (as ``/tmp`` and ``/dev/shm`` are):
  anyone who can rename entries there could swap the tier's folder for one
  of their own; so must every link on the configured path (whoever owns a
  link can point it elsewhere);
- missing folders are made 0700, one level at a time, each opened with
  O_NOFOLLOW and checked through its descriptor (``fstat``), so that a link
  or a foreign folder put in place between ``mkdir`` and the check is
  refused, not used;
- lock files and ledgers are opened with O_NOFOLLOW and must be regular
  files of this user, writable by nobody else (``open_private_file``).

A shared tier's folder is used by many nodes, under one user or several
(an NFS export's uids), so its owners and modes are the operator's to set:
kvtier checks only what keeps it inside the store. The configured folder
must exist already (it is a mount point, as a rule: one that is not mounted
must not be filled on the local disk), kvtier makes only ``kvtier-v1/`` and
its folders in it, and none of those may be a link or a file (kvtier follows
no link inside a store). Each refusal is a ``ConfigError`` naming the path
and the fix.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from pathlib import Path

from kvtier.errors import ConfigError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def user(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` where the uid has no name here."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_private(st: os.stat_result, path: Path, key: str, what: str = "folder") -> None:
    """Raise ConfigError unless ``st`` (of ``path``) is this user's and
    writable by nobody else."""
    me = os.geteuid()
    if st.st_uid != me:
        fix = (f"remove it (or, if it is this user's own tier, chown -R {me} {path}) and start again, or set {key} "
               "to a folder of this user's; kvtier makes its folders itself, 0700") if what == "folder" else (
               f"remove it (rm {path}) and start again; kvtier makes it itself, 0600")
        raise ConfigError(
            key, f"the {what} {path} belongs to {user(st.st_uid)}, not to this user, {user(me)}: whoever owns it "
            "can plant objects in the tier or hold its lock", fix)
    if st.st_mode & _OTHERS_WRITE:
        raise ConfigError(
            key, f"the {what} {path} is writable by {_writers(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o}): "
            "any of them can plant objects in the tier or hold its lock",
            f"chmod go-w {path} (kvtier makes its folders 0700 and its files 0600)")


def check_parent(st: os.stat_result, path: Path, child: Path, key: str) -> None:
    """Raise ConfigError unless folder ``path`` (``st``), where the tier's
    folder ``child`` is or will be, lets nobody but this user and root
    replace ``child``."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise ConfigError(
            key, f"{path}, the folder {child} is in, belongs to {user(st.st_uid)}, who can swap {child} for a "
            "folder of their own",
            f"set {key} to a folder inside one that only this user ({user(me)}) or root owns")
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(
            key, f"{path}, the folder {child} is in, is writable by {_writers(st.st_mode)} (mode "
            f"{stat.S_IMODE(st.st_mode):04o}, not sticky): any of them can swap {child} for a folder of their own",
            f"chmod go-w {path} (or chmod +t {path}, as /tmp is), or set {key} to a folder inside one only this "
            "user or root can write")


def _explain(path: Path, check) -> None:
    """``path`` could not be opened: raise ``check``'s ConfigError if its
    owner or mode is why (another user's folder), else return."""
    try:
        st = os.stat(path)
    except OSError:
        return
    check(st)


def _writers(mode: int) -> str:
    who = [w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "every user")) if mode & bit]
    return " and ".join(who)


def open_root(root: Path, key: str, shared: bool) -> int:
    """A descriptor of the tier's folder ``root`` (links in the configured
    path are followed: the operator chose it), checked as the module's
    docstring says. A private tier's missing folders are made; a shared
    tier's folder must exist."""
    root = Path(os.path.abspath(root))
    if not shared:
        _check_links(root, key)
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        if shared:
            raise _no_shared_root(root, key) from None
        return _make_root(root, key)
    except NotADirectoryError:
        raise ConfigError(key, f"{root} is not a folder", f"set {key} to a folder") from None
    except PermissionError:
        if not shared:
            _explain(root, lambda st: check_private(st, root, key))
        raise
    if not shared:
        try:
            check_private(os.fstat(fd), root, key)
            parent = root.parent
            if parent != root:
                check_parent(os.stat(parent), parent, root, key)
        except BaseException:
            os.close(fd)
            raise
    return fd


def _check_links(root: Path, key: str) -> None:
    """A link on the way to a private tier's folder must be this user's or
    root's: whoever owns it can point it elsewhere at any time, and kvtier
    opens the tier's folders by their path again for each operation."""
    me = os.geteuid()
    at = Path(root.anchor)
    for part in root.parts[1:]:
        at = at / part
        try:
            st = os.lstat(at)
        except OSError:
            return  # missing: made, and checked, by ``_make_root``
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (me, 0):
            raise ConfigError(
                key, f"{at}, on the way to {root}, is a symbolic link of {user(st.st_uid)}, who can point it "
                "elsewhere at any time", f"set {key} to a path without that link, or remove it")


def check_shared_root(root: str | os.PathLike, key: str) -> None:
    """Raise ConfigError unless a shared tier's folder ``root`` exists
    (``kvtier serve`` checks before it starts an engine)."""
    root = Path(os.path.abspath(root))
    if not root.exists():
        raise _no_shared_root(root, key)
    if not root.is_dir():
        raise ConfigError(key, f"{root} is not a folder", f"set {key} to a folder")


def _no_shared_root(root: Path, key: str) -> ConfigError:
    return ConfigError(
        key, f"{root} does not exist; a shared tier's folder is not made by kvtier (it is usually a mount point, and "
        "one that is not mounted must not be filled on the local disk)",
        f"mount the shared file system at {root} (or make the folder, if it is meant to be there) and start again; "
        "kvtier makes only kvtier-v1/ inside it")


def _make_root(root: Path, key: str) -> int:
    """Make a private tier's missing folder ``root``: every missing level
    0700, each checked; the existing folder they are made in must be one
    nobody else can swap them out of."""
    missing: list[str] = []
    at = root
    while True:
        try:
            fd = os.open(at, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
            break
        except FileNotFoundError:
            if at.parent == at:
                raise
            missing.append(at.name)
            at = at.parent
        except PermissionError:
            _explain(at, lambda st: check_parent(st, at, at / missing[-1], key) if missing
                     else check_private(st, at, key))
            raise
    try:
        check_parent(os.fstat(fd), at, at / missing[-1], key)
        for name in reversed(missing):
            nxt = subfolder(fd, at, name, key, shared=False)
            os.close(fd)
            fd, at = nxt, at / name
    except BaseException:
        os.close(fd)
        raise
    return fd


def subfolder(parent_fd: int, parent: Path, name: str, key: str, shared: bool) -> int:
    """A descriptor of folder ``name`` in ``parent`` (``parent_fd``), made
    0700 if missing and opened with O_NOFOLLOW; a private tier's must be
    this user's alone. A link or a file there is refused with the fix."""
    path = parent / name
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            _refuse_not_ours(path, key, parent_fd, name)
        raise
    if not shared:
        try:
            check_private(os.fstat(fd), path, key)
        except BaseException:
            os.close(fd)
            raise
    return fd


def _refuse_not_ours(path: Path, key: str, parent_fd: int | None, name: str, what: str = "folder") -> None:
    """Raise ConfigError for a link, or something other than a ``what``, at
    ``path`` (``name`` in ``parent_fd``), where kvtier keeps a ``what`` of
    its own; return if nothing is there any more."""
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(name, dir_fd=parent_fd)
        except OSError:
            target = "?"
        raise ConfigError(
            key, f"{path} is a symbolic link (to {target}) where kvtier keeps a {what} of its own; kvtier follows "
            "no link inside a store, so that nobody who can write the store leads its writes and reads elsewhere",
            f"remove the link (rm {path}, which leaves its target alone); kvtier makes the {what} again when it "
            "starts")
    raise ConfigError(
        key, f"{path} is {_kind(st.st_mode)} where kvtier keeps a {what} of its own",
        f"move it away (mv {path} {path}.moved) and start again; kvtier makes the {what} itself")


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "a folder" if stat.S_ISDIR(mode) else "not a file"


def make_layout(root: Path, layout: tuple[str, tuple[str, ...]], key: str, shared: bool, probe: str) -> None:
    """Make (or check) the tier's folder ``root``, its layout folder
    ``layout[0]`` and the folders ``layout[1]`` in it, one level at a time
    through descriptors, then write and remove the file ``probe`` in the
    layout's ``tmp`` (unique per open: two opens at once must not remove
    each other's)."""
    top, subs = layout
    fds = [open_root(root, key, shared)]
    try:
        fds.append(subfolder(fds[0], root, top, key, shared))
        for name in subs:
            fds.append(subfolder(fds[1], root / top, name, key, shared))
        tdir = fds[2 + subs.index("tmp")]
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=tdir))
        os.unlink(probe, dir_fd=tdir)
    finally:
        for fd in fds:
            os.close(fd)


def open_private_file(folder_fd: int, folder: Path, name: str, flags: int, key: str) -> int:
    """Open (creating it 0600 if missing) the lock file, ledger or log
    ``name`` in a private tier's ``folder`` (``folder_fd``), following no
    link: a regular file of this user, writable by nobody else, or
    ConfigError naming the fix (a lock another user can open is a lock they
    can hold)."""
    path = folder / name
    try:
        fd = os.open(name, flags | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600, dir_fd=folder_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            _refuse_not_ours(path, key, folder_fd, name, what="file")
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _refuse_not_ours(path, key, folder_fd, name, what="file")
            raise ConfigError(key, f"{path} is not a regular file", f"move it away (mv {path} {path}.moved)")
        check_private(st, path, key, what="file")
    except BaseException:
        os.close(fd)
        raise
    return fd
