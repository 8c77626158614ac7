"""The directory tiers' folders, as this user sees them: nothing is created.

A node's own folders (``disk``, ``shm``, and the node memory folder that the
vLLM connector keeps a ``memory`` tier in) must be this user's and writable
by nobody else: whoever else can write them can plant or swap KV. Where one
does not exist yet, the tier makes it (0700) at start, so the nearest folder
above must let this user create it. Those on tmpfs are memory, anything
else is a disk.

A ``shared`` folder belongs to the cluster: it must exist and be writable by
this user, its ``kvtier-v1`` store (once there) must be this user's, since
every node runs kvtier as one uid, and it should lie on a mount of its own:
a folder on the root file system is usually a mount point whose file system
is not mounted. The objects already there should be of the format this
kvtier writes (one object's header is read): nodes of two releases that
write different formats share nothing.

Free space is compared with ``capacity``: what kvtier already holds there
counts toward its capacity, so a WARN on a folder in service may be only
that (``kvtier store stat --dir`` shows it).
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from kvtier.check.report import Report
from kvtier.config import fmt_bytes
from kvtier.tiers.dir.layout import LAYOUT_DIR

_MEMORY_FS = ("tmpfs", "ramfs")
# File systems that only this node sees: a shared tier there shares only
# among this node's engines.
_LOCAL_FS = ("tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "overlay")


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    source: str


def private_folder(report: Report, label: str, path: str, capacity: int, memory: bool, root: str | None = None) -> None:
    """A node's own tier folder (``memory``: it should be on tmpfs; ``root``:
    a folder above it that must be this user's too, the node memory folder)."""
    name = f"{label} folder"
    if not os.path.isabs(path):
        report.warn(name, f"{path} is a relative path: it is resolved against the engine's working directory",
                    "write an absolute path")
    p = Path(os.path.abspath(path))
    above = _existing(p)
    problems = []  # (folder, what is wrong with it)
    for d in ([Path(root)] if root else []) + [p, p / LAYOUT_DIR]:  # the tier's folder and its store's
        why = _private_problem(d) if d.exists() or d.is_symlink() else None
        if why:
            problems.append((d, why))
    if above == p and not p.is_dir():
        report.fail(name, f"{p} is not a directory", "point path at a directory, or remove what is there")
        return
    if problems:
        d = problems[0][0]
        report.fail(name, "; ".join(f"{d} {why}" for d, why in problems), f"chown {os.geteuid()} {d} && chmod 700 "
                    f"{d} (kvtier makes its folders 0700), or use a folder of this user's")
    elif above == p:
        st = p.stat()
        report.ok(name, f"{p}: owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}")
    elif not os.access(above, os.W_OK | os.X_OK):
        report.fail(name, f"{p} does not exist and this user (uid {os.geteuid()}) cannot create it in {above}",
                    f"create it as root: mkdir -p {p} && chown {os.geteuid()} {p} && chmod 700 {p}")
    else:
        report.ok(name, f"{p} does not exist yet: the tier creates it (mode 0700) in {above}")
    if memory:
        mount = mount_of(above)
        if mount is not None and mount.fstype not in _MEMORY_FS:
            report.warn(f"{label} tmpfs", f"{p} is on {mount.fstype} ({mount.point}), not tmpfs: the node's "
                        "memory tier would be written to disk", "put it on /dev/shm or another tmpfs "
                        "(node_memory_dir for memory tiers, path for shm tiers)")
        elif mount is not None:
            report.ok(f"{label} tmpfs", f"{p} is on {mount.fstype} ({mount.point})")
    _space(report, label, p, above, capacity, memory)


def shared_folder(report: Report, label: str, path: str, capacity: int) -> None:
    name = f"{label} folder"
    p = Path(os.path.abspath(path))
    if not p.exists():
        report.fail(name, f"{p} does not exist", f"mount the shared file system, then create {p} as the user "
                    "kvtier runs as (mkdir -p)")
        return
    if not p.is_dir():
        report.fail(name, f"{p} is not a directory", "point path at the shared directory")
        return
    st = p.stat()
    mode = stat.S_IMODE(st.st_mode)
    store = p / LAYOUT_DIR
    if not os.access(p, os.W_OK | os.X_OK):
        report.fail(name, f"this user (uid {os.geteuid()}) cannot write {p} (owner uid {st.st_uid}, mode {mode:04o}"
                    f"{', read-only mount' if _read_only(p) else ''})",
                    "run kvtier as the folder's owner, or give that user write access (on every node)")
    elif store.exists() and store.stat().st_uid != os.geteuid():
        report.fail(name, f"{store} belongs to uid {store.stat().st_uid}, not to this user (uid {os.geteuid()}): "
                    "its objects are 0600, so this node could not read them",
                    f"run kvtier as uid {store.stat().st_uid} on every node (on NFS: mapped to one owner)")
    elif mode & 0o002:
        report.warn(name, f"{p} is writable by every user (mode {mode:04o}): anyone on a node can plant objects",
                    f"chmod o-w {p}; with a cluster key (auth_key_file) planted objects are refused anyway")
    else:
        report.ok(name, f"{p}: owner uid {st.st_uid}, mode {mode:04o}, writable by this user")
    mount = mount_of(p)
    where = f"{mount.fstype} {mount.source} at {mount.point}" if mount else "its file system"
    on_root = mount.point == "/" if mount else p.stat().st_dev == os.stat("/").st_dev
    if on_root:
        report.warn(f"{label} mount", f"{p} is on the root file system, not on a mount of its own: is the "
                    "shared file system mounted?", "mount the shared file system there (ignore this where "
                    "only this node's engines share the folder)")
    elif mount is not None and mount.fstype in _LOCAL_FS:
        report.ok(f"{label} mount", f"on {where}: local to this node, only its engines share it")
    else:
        report.ok(f"{label} mount", f"on {where}")
    _store_format(report, label, p)
    _space(report, label, p, p, capacity, False)


def _store_format(report: Report, label: str, p: Path) -> None:
    """The format of the objects already in a shared folder: nodes that
    write another format (another kvtier release) share nothing with this one."""
    from kvtier.codec import MAGIC
    from kvtier.version import FORMAT_VERSION

    name = f"{label} format"
    others = sorted(e for e in os.listdir(p) if e.startswith("kvtier-v") and e != LAYOUT_DIR)
    obj = _first_object(p / LAYOUT_DIR / "objects")
    version = None
    if obj is not None:
        try:
            # No link followed, and no wait on a FIFO someone planted there.
            fd = os.open(obj, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                head = os.pread(fd, 10, 0) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
            finally:
                os.close(fd)
        except OSError:
            head = b""  # gone meanwhile (collected) or unreadable: the folder row says which
        if len(head) == 10 and head[:8] == MAGIC:
            version = int.from_bytes(head[8:10], "little")
    mixed = "roll one kvtier release out to every node that shares this folder"
    if others:
        report.warn(name, f"{p} holds stores of other kvtier releases ({', '.join(others)}) besides {LAYOUT_DIR}: "
                    "nodes running them share nothing with this one", mixed)
    elif version is not None and version != FORMAT_VERSION:
        report.warn(name, f"{obj.name} is object format {version}; this kvtier writes and reads format "
                    f"{FORMAT_VERSION}: nodes of the two releases share nothing", mixed)
    elif version is not None:
        report.ok(name, f"objects are format {version}, as this kvtier writes")
    else:
        report.ok(name, f"no object to compare yet; this kvtier writes format {FORMAT_VERSION}")


def _first_object(objects: Path) -> Path | None:
    """One object file below ``objects/<namespace>/<xx>/``, if any (a few
    folders looked into at each level, however many there are)."""
    from kvtier.tiers.dir.layout import SUFFIX

    for ns in _entries(objects, dirs=True):
        for xx in _entries(ns, dirs=True):
            for f in _entries(xx, dirs=False):
                if f.name.endswith(SUFFIX):
                    return f
    return None


def _entries(d: Path, dirs: bool, limit: int = 4) -> list[Path]:
    out: list[Path] = []
    try:
        with os.scandir(d) as it:
            for e in it:
                if (e.is_dir(follow_symlinks=False) if dirs else e.is_file(follow_symlinks=False)):
                    out.append(Path(e.path))
                    if len(out) >= limit:
                        break
    except OSError:
        pass
    return out


def _space(report: Report, label: str, p: Path, above: Path, capacity: int, memory: bool) -> None:
    try:
        du = shutil.disk_usage(above)
    except OSError as exc:
        report.warn(f"{label} space", f"cannot read the free space of {above}: {exc.strerror}", "check the mount")
        return
    name = f"{label} space"
    grow = ("make the tmpfs larger (a container's /dev/shm: --shm-size) or lower capacity" if memory
            else "lower capacity, or give the file system more room")
    if capacity > du.total:
        report.warn(name, f"capacity {fmt_bytes(capacity)} is more than the whole file system holds "
                    f"({fmt_bytes(du.total)})", grow)
    elif capacity > du.free:
        report.warn(name, f"capacity {fmt_bytes(capacity)}, free {fmt_bytes(du.free)} of {fmt_bytes(du.total)} "
                    "(what kvtier already holds there counts toward its capacity)",
                    f"{grow}; `kvtier store stat --dir {p}` shows what kvtier holds")
    else:
        report.ok(name, f"capacity {fmt_bytes(capacity)}, free {fmt_bytes(du.free)} of {fmt_bytes(du.total)}")


def _private_problem(d: Path) -> str | None:
    st = d.lstat()
    if stat.S_ISLNK(st.st_mode) and d.name == LAYOUT_DIR:
        return "is a symlink"
    st = d.stat()
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _existing(p: Path) -> Path:
    """``p`` or the nearest folder above it that exists."""
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _read_only(p: Path) -> bool:
    try:
        return bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def mount_of(path: Path) -> Mount | None:
    """The mount ``path`` lies on (``/proc/self/mountinfo``); None where it
    cannot be read."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best: Mount | None = None
    for line in lines:
        fields = line.split()
        try:
            sep = fields.index("-")
            point = _unescape(fields[4])
            fstype, source = fields[sep + 1], _unescape(fields[sep + 2])
        except (ValueError, IndexError):
            continue
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        # The later of two mounts at one point is the one on top.
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(point, fstype, source)
    return best


def _unescape(text: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code in ("040", "011", "012", "134"):
        text = text.replace("\\" + code, chr(int(code, 8)))
    return text
