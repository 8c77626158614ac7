"""Open a file beneath a folder in one system call, following no symlink on
the way: Linux's ``openat2`` with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``
(Linux 5.6 and later), through ``ctypes``.

Why: ``ObjectDir`` must never read through a symlink planted in a shared
folder, and O_NOFOLLOW guards only a path's last component, so it opens an
object's folders one at a time (four opens and four closes per object read;
on a network file system each open of a folder may be a round trip to its
metadata server). ``openat2`` refuses a symlink anywhere on the path
(ELOOP) and a file where a folder belongs (ENOTDIR) in the same call.

Where the kernel or a seccomp filter has no ``openat2`` (ENOSYS, EPERM),
``available()`` answers False once and callers open folder by folder.

Threads: any.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

_NR_OPENAT2 = 437  # one number on every architecture (added after the tables were unified)
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    # struct open_how (linux/openat2.h)
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_syscall = ctypes.CDLL(None, use_errno=True).syscall if sys.platform.startswith("linux") else None
if _syscall is not None:
    _syscall.restype = ctypes.c_long

_available: bool | None = None  # probed once


def available() -> bool:
    """Whether ``open_beneath`` works here (probed on first use)."""
    global _available
    if _available is None:
        _available = _probe()
    return _available


def _probe() -> bool:
    if _syscall is None:
        return False
    try:
        root = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        os.close(open_beneath(root, ".", os.O_RDONLY | os.O_DIRECTORY))
        return True
    except OSError:  # ENOSYS (an old kernel), EPERM (seccomp), EINVAL (a struct it does not know)
        return False
    finally:
        os.close(root)


def open_beneath(dfd: int, path: str, flags: int) -> int:
    """``openat(dfd, path, flags | O_CLOEXEC)`` that fails with ELOOP where any
    component of ``path`` is a symlink, ENOTDIR where a file stands for a
    folder, and EXDEV where ``path`` would leave ``dfd`` (absolute, or
    ``..``). Raises OSError (FileNotFoundError for a missing component)."""
    how = _OpenHow(flags | getattr(os, "O_CLOEXEC", 0), 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
    raw = os.fsencode(path)
    while True:
        fd = _syscall(ctypes.c_long(_NR_OPENAT2), ctypes.c_int(dfd), ctypes.c_char_p(raw), ctypes.byref(how),
                      ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err), path)
