"""The node memory tier across processes: one copy per node, one capacity.

What the contract suite cannot show with one instance: several processes
(the scheduler, TP workers, other engines of the node) open the same
directory, see each other's chunks, and together never hold more than the
capacity; a writer that dies mid-write gives its reservation back."""

from __future__ import annotations

import multiprocessing as mp
import os

from kvtier.tiers.shm import ShmConfig, ShmTier
from tests.support import OBJ, assert_object, keys_for, objs_for


def _open(path: str, capacity: int, name: str = "shm") -> ShmTier:
    return ShmTier(ShmConfig(capacity=capacity, path=path, name=name, touch_interval_s=0.0))


def _held(path: str) -> int:
    """What the directory really holds: every object and temp file, counted
    once per inode (a write published during the walk keeps its inode)."""
    sizes: dict[int, int] = {}
    for root, _, files in os.walk(os.path.join(path, "kvtier-v1")):
        for f in files:
            if f.endswith((".kvc", ".tmp")):
                try:
                    st = os.stat(os.path.join(root, f))
                except FileNotFoundError:
                    continue  # published or evicted meanwhile
                sizes[st.st_ino] = st.st_size
    return sum(sizes.values())


def test_two_instances_see_one_copy(node_dir):
    a, b = _open(node_dir, 16 * OBJ, "a"), _open(node_dir, 16 * OBJ, "b")
    try:
        keys = keys_for(1, 4)
        assert a.store(objs_for(keys)) == 4
        assert b.lookup(keys) == 4
        got = list(b.fetch(keys))
        for obj, k in zip(got, keys):
            assert_object(obj, k)
            obj.release()
        assert len(got) == 4
        assert b.store(objs_for(keys)) == 4  # already there: skipped, not stored twice
        assert a.stats().used_bytes == b.stats().used_bytes == _held(node_dir) == 4 * OBJ
    finally:
        a.close()
        b.close()


def _writer(path: str, seed: int, capacity: int, rounds: int, q) -> None:
    tier = _open(path, capacity, f"w{seed}")
    worst = 0
    try:
        for r in range(rounds):
            tier.store(objs_for(keys_for(seed * 1000 + r, 2)))
            # Under the node lock nothing is admitted or evicted while the
            # walk runs (a walk racing an eviction and a new write would
            # count both); a publish keeps its inode, which _held counts once.
            with tier._node():
                worst = max(worst, _held(path))
    finally:
        tier.close()
    q.put(worst)


def test_processes_never_exceed_the_node_capacity(node_dir):
    capacity = 12 * OBJ
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(node_dir, s, capacity, 20, q)) for s in (1, 2, 3)]
    for p in procs:
        p.start()
    worst = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert max(worst) <= capacity, f"held {max(worst)} B, capacity {capacity} B"
    tier = _open(node_dir, capacity)
    try:
        assert tier.stats().used_bytes == _held(node_dir) <= capacity
        assert tier.stats().objects > 0
    finally:
        tier.close()


def _die_mid_write(path: str) -> None:
    tier = _open(path, 8 * OBJ)
    with tier._node():
        tier.dir.begin_write(OBJ)  # reserved and created, never published
        tier._set_used(tier._used() + OBJ)
    os._exit(0)


def test_a_dead_writer_gives_its_reservation_back(node_dir):
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_die_mid_write, args=(node_dir,))
    p.start()
    p.join(60)
    tier = _open(node_dir, 8 * OBJ)  # opening reconciles
    try:
        assert tier.stats().used_bytes == 0 == _held(node_dir)
    finally:
        tier.close()


def test_eviction_is_lru_across_instances(node_dir):
    a, b = _open(node_dir, 4 * OBJ, "a"), _open(node_dir, 4 * OBJ, "b")
    try:
        old, new = keys_for(1, 2), keys_for(2, 2)
        assert a.store(objs_for(old)) == 2
        assert b.store(objs_for(new)) == 2
        import time

        time.sleep(0.012)
        for obj in a.fetch(old[:1]):  # old[0] is now the most recent
            obj.release()
        more = keys_for(3, 1)
        assert b.store(objs_for(more)) == 1
        assert a.lookup(old[:1]) == 1 and b.lookup(more) == 1
        assert _held(node_dir) <= 4 * OBJ
    finally:
        a.close()
        b.close()


def test_a_write_published_while_the_ledger_is_recounted_is_not_lost(node_dir, monkeypatch):
    """Another process publishes (renames out of tmp/) without the node
    lock: a publish between the recount's two walks must not vanish from
    the ledger (it did: the node then admitted one object past capacity)."""
    tier = _open(node_dir, 16 * OBJ)
    try:
        (obj,) = objs_for(keys_for(7, 1))
        key = keys_for(7, 1)[0]
        w = tier.dir.begin_write(obj.nbytes)
        w.fill(obj, False)
        walks = []
        real_scan, real_tmp = tier.dir.scan, tier.dir.tmp_bytes

        def after_first_walk(result):
            walks.append(1)
            if len(walks) == 1:
                w.publish(key)  # lands between the two walks
            return result

        monkeypatch.setattr(tier.dir, "scan", lambda: iter(after_first_walk(list(real_scan()))))
        monkeypatch.setattr(tier.dir, "tmp_bytes", lambda: after_first_walk(real_tmp()))
        with tier._node():
            used = tier._reconcile()
        assert len(walks) == 2
        assert used >= _held(node_dir) == obj.nbytes
    finally:
        tier.close()
