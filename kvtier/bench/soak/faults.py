"""The soak's faults: what damages kvtier's storage, as a table.

``FAULTS`` maps each fault kind to its injector, a function of the
``Injector`` (which knows the tiers' directories and picks targets) that
damages one thing and returns whether it did. A new fault is one function and
one row; its name becomes a value of ``kvtier bench soak --faults``. The
table's order is part of a seed's meaning (random choices index it): append,
never reorder.

Threads: an ``Injector`` runs its own thread (``start``/``stop``) in the soak
engine's process, and the serving loop calls ``inject_one`` and ``target``
between requests; one lock serialises them. Timed faults register a heal
(``later``) that a later injection or ``stop`` runs.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvtier.codec import CRC_AT, HEADER_STRUCT_SIZE

CHUNK = 256  # tokens per kvtier chunk in the soak's configuration


class Injector:
    """Damages the disk and shared tiers' directories at random, on its own
    thread, while the engine serves. Timed faults (vanish, fill, links) are
    undone after a while; ``stop`` undoes what is left."""

    def __init__(self, dirs: dict[str, Path], tmpfs: list[str], outside: Path, rate: float, seed: int,
                 kinds: tuple[str, ...] | None = None, redis_pid: int | None = None, redis_skip: str | None = None):
        kinds = tuple(FAULTS) if kinds is None else kinds
        self.kinds = [k for k in kinds if not (k == "fill" and "disk" not in tmpfs)
                      and not (k == "redis-stall" and redis_pid is None)]
        self.redis_pid = redis_pid
        self.redis_stopped = False
        self.dirs = dirs
        self.tmpfs = tmpfs
        self.outside = outside
        self.rate = rate
        self.rng = random.Random(seed)
        self.counts = {k: 0 for k in FAULTS}
        self.skipped: list[str] = []
        if "fill" in kinds and "disk" not in tmpfs:
            self.skipped.append("fill: the disk tier is not on a tmpfs this process could mount (needs root)")
        if redis_skip:
            self.skipped.append(redis_skip)
        self._heals: list[tuple[float, Callable[[], None]]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next: list[int] | None = None
        self._ns: dict[str, bytes] = {}
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)
        self._traps: list[tuple[Path, dict]] = []  # outside copies and their snapshot
        self._n = 0
        outside.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        with self._lock:
            for _, heal in self._heals:
                heal()
            self._heals.clear()

    def outside_changes(self) -> list[str]:
        changed = []
        for root, snap in self._traps:
            now = _snapshot(root)
            if now != snap:
                changed.append(f"{root}: {sorted(set(now) ^ set(snap)) or 'contents changed'}")
        return changed

    # -------------------------------------------------------- loop
    def _run(self) -> None:
        while not self._stop.wait(self.rng.expovariate(self.rate) if self.rate > 0 else 3600):
            self.inject_one()

    def inject_one(self, kind: str | None = None) -> None:
        """One fault now, random unless ``kind`` is given (from the
        injector's thread, or between requests by the serving loop); due
        heals first."""
        with self._lock:
            now = time.monotonic()
            for item in [h for h in self._heals if h[0] <= now]:
                self._heals.remove(item)
                item[1]()
            if not self.kinds:
                return
            if kind is None or kind not in self.kinds:
                kind = self.rng.choice(self.kinds)
            try:
                if FAULTS[kind].inject(self):
                    self.counts[kind] += 1
            except (OSError, ValueError):
                pass  # the file went away meanwhile (kvtier evicted or quarantined it): not injected

    # -------------------------------------------------------- targets
    def objects(self, tier: str | None = None) -> list[Path]:
        tiers = [tier] if tier else list(self.dirs)
        out = []
        for t in tiers:
            objects = self.dirs[t] / "store" / "kvtier-v1" / "objects"
            # Not through a folder link this injector planted: the copies
            # outside are the evidence that kvtier never writes there.
            out += [p for p in objects.glob("*/*/*.kvc")
                    if not p.parent.is_symlink() and p.is_file() and not p.is_symlink()]
        return out

    def tier(self) -> str:
        # Mostly the disk tier: loads ask it before the shared tier, so its
        # objects are the ones read.
        return "disk" if self.rng.random() < 0.7 else "shared"

    def pick(self, tier: str | None = None) -> Path | None:
        """An object to damage: half of the time one the next request will
        ask for (if the tier holds any), else any."""
        tier = tier or self.tier()
        objs = self._targets(tier) if self.rng.random() < 0.5 else []
        objs = objs or self.objects(tier)
        return self.rng.choice(objs) if objs else None

    def target(self, tokens: list[int]) -> None:
        """The prompt the engine serves next: faults aim at its chunks too."""
        with self._lock:
            self._next = tokens

    def _targets(self, tier: str) -> list[Path]:
        """The objects of the next prompt's full chunks this tier holds. Their
        names need the namespace digest, which any object's header echoes:
        tried per namespace folder (reference runs use other salts)."""
        from kvtier.codec import parse_header
        from kvtier.keys import next_key, root_key

        objects = self.dirs[tier] / "store" / "kvtier-v1" / "objects"
        tokens = self._next or []
        for folder in sorted(objects.glob("*")):
            ns = self._ns.get(folder.name)
            if ns is None:
                sample = next((p for p in folder.glob("*/*.kvc") if not p.parent.is_symlink() and p.is_file()), None)
                try:
                    with open(sample, "rb") as f:
                        ns = self._ns[folder.name] = parse_header(f.read(HEADER_STRUCT_SIZE)).ns
                except Exception:  # none yet, or damaged: try again later
                    continue
            key, found = root_key(ns), []
            for start in range(0, len(tokens) - CHUNK + 1, CHUNK):
                key = next_key(key, tokens[start : start + CHUNK])
                h = key.digest.hex()
                p = folder / h[:2] / f"{h}.kvc"
                if not p.parent.is_symlink() and p.is_file() and not p.is_symlink():
                    found.append(p)
            if found:
                return found
        return []

    # -------------------------------------------------------- helpers of the faults
    def later(self, seconds: float, heal: Callable[[], None]) -> None:
        """Run ``heal`` once ``seconds`` have passed (or at ``stop``)."""
        self._heals.append((time.monotonic() + seconds, heal))

    def trap(self) -> Path:
        """A fresh folder outside the store for a link to point into."""
        self._n += 1
        trap = self.outside / f"trap-{self._n}"
        trap.mkdir()
        return trap

    def seal(self, trap: Path) -> None:
        """Remember ``trap``'s contents: kvtier must never change them."""
        self._traps.append((trap, _snapshot(trap)))

    def serial(self) -> int:
        self._n += 1
        return self._n - 1


# ---------------------------------------------------------------- the injectors


def flip(inj: Injector) -> bool:
    p = inj.pick()
    if p is None:
        return False
    size = p.stat().st_size
    pos = inj.rng.randrange(size) if inj.rng.random() < 0.7 else inj.rng.randrange(min(size, HEADER_STRUCT_SIZE))
    with open(p, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ (1 << inj.rng.randrange(8))]))
    return True


def truncate(inj: Injector) -> bool:
    p = inj.pick()
    if p is None:
        return False
    os.truncate(p, inj.rng.randrange(1, p.stat().st_size))
    return True


def zero(inj: Injector) -> bool:
    p = inj.pick()
    if p is None:
        return False
    os.truncate(p, 0)
    return True


def delete(inj: Injector) -> bool:
    p = inj.pick()
    if p is None:
        return False
    p.unlink()
    return True


def version(inj: Injector) -> bool:
    p = inj.pick()
    if p is None:
        return False
    data = bytearray(p.read_bytes())
    if len(data) < HEADER_STRUCT_SIZE:
        return False
    struct.pack_into("<H", data, 8, inj.rng.choice((0, 1, 7)))  # versions other than this reader's
    struct.pack_into("<I", data, CRC_AT, zlib.crc32(bytes(data[:CRC_AT])))
    _replace(p, bytes(data))
    return True


def swap(inj: Injector) -> bool:
    tier = inj.tier()
    b = inj.pick(tier)
    if b is None:
        return False
    size = b.stat().st_size  # same size: same shape, so that only the key check can tell
    others = [p for p in inj.objects(tier) if p != b and p.stat().st_size == size]
    if not others:
        return False
    _replace(b, inj.rng.choice(others).read_bytes())  # b's name, another chunk's KV
    return True


def symlink(inj: Injector) -> bool:
    objs = inj.objects()
    if len(objs) < 2:
        return False
    a, b = inj.rng.sample(objs, 2)
    trap = inj.trap()
    target = trap / "foreign.kvc"
    target.write_bytes(a.read_bytes())
    inj.seal(trap)
    tmp = b.with_name(b.name + ".link")
    os.symlink(target, tmp)
    os.replace(tmp, b)
    return True


def symlink_dir(inj: Injector) -> bool:
    p = inj.pick()
    if p is None:
        return False
    fan = p.parent
    trap = inj.trap()
    copy = trap / fan.name
    shutil.copytree(fan, copy, symlinks=True)
    inj.seal(trap)
    aside = fan.with_name(fan.name + ".soak-aside")
    os.rename(fan, aside)
    os.symlink(copy, fan)

    def heal():
        try:
            if fan.is_symlink():
                os.unlink(fan)
            if not fan.exists():
                os.rename(aside, fan)
            else:
                shutil.rmtree(aside, ignore_errors=True)
        except OSError:
            pass

    inj.later(inj.rng.uniform(0.5, 2.0), heal)
    return True


def fifo(inj: Injector) -> bool:
    p = inj.pick()
    if p is None:
        return False
    tmp = p.with_name(p.name + ".fifo")
    os.mkfifo(tmp, 0o600)
    os.replace(tmp, p)
    return True


def vanish(inj: Injector) -> bool:
    base = inj.dirs["shared"] / "store" / "kvtier-v1"
    away = base.with_name("kvtier-v1.soak-away")
    if not base.exists() or away.exists():
        return False
    os.rename(base, away)

    def heal():
        try:
            if base.exists():  # something recreated it meanwhile: keep both, ours wins
                shutil.rmtree(base)
            os.rename(away, base)
        except OSError:
            pass

    inj.later(inj.rng.uniform(0.3, 1.5), heal)
    return True


def fill(inj: Injector) -> bool:
    filler = inj.dirs["disk"] / f"filler.{inj.serial()}"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\1" * (1 << 16)):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    inj.later(inj.rng.uniform(0.3, 1.5), lambda: filler.unlink(missing_ok=True))
    return True


def redis_stall(inj: Injector) -> bool:
    if inj.redis_stopped:
        return False
    os.kill(inj.redis_pid, signal.SIGSTOP)
    inj.redis_stopped = True

    def heal():
        os.kill(inj.redis_pid, signal.SIGCONT)
        inj.redis_stopped = False

    inj.later(inj.rng.uniform(0.3, 1.5), heal)
    return True


@dataclass(frozen=True)
class Fault:
    inject: Callable[[Injector], bool]
    doc: str


FAULTS: dict[str, Fault] = {
    "flip": Fault(flip, "one byte of an object (header or payload)"),
    "truncate": Fault(truncate, "an object cut short"),
    "zero": Fault(zero, "an object emptied"),
    "delete": Fault(delete, "an object removed behind kvtier's back"),
    "version": Fault(version, "an object rewritten with another format version"),
    "swap": Fault(swap, "an object's bytes replaced by another chunk's (foreign KV)"),
    "symlink": Fault(symlink, "an object replaced by a link to a foreign object outside"),
    "symlink-dir": Fault(symlink_dir, "a fan-out folder replaced by a link to a copy outside"),
    "fifo": Fault(fifo, "an object replaced by a FIFO"),
    "vanish": Fault(vanish, "the shared directory's layout taken away for a while"),
    "fill": Fault(fill, "the disk tier's file system filled for a while (needs a tmpfs, so root; reported as "
                  "skipped otherwise)"),
    "redis-stall": Fault(redis_stall, "the Redis server stopped (SIGSTOP) for a while: a hung backend (with a "
                         "Redis tier, when redis-server and redis-py are installed; reported as skipped otherwise)"),
}


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".soak")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _snapshot(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        st = os.lstat(p)
        out[str(p.relative_to(root))] = (p.read_bytes() if p.is_file() and not p.is_symlink() else b"", st.st_mtime_ns)
    return out
