"""Read buffers: page alignment, and huge-page buffers that are exact
mappings on a 2 MiB boundary, on transparent huge pages where the kernel
offers them, unmapped with their last view."""

from __future__ import annotations

import gc

import pytest

from kvtier import buffers
from kvtier.buffers import ALIGN, HUGE, BufferPool, LoadBuffers, address, align_up, alloc, mapped_bytes, slot


def _mapping(addr: int) -> dict | None:
    """The /proc/self/smaps entry of the mapping that starts at ``addr``:
    its length and its AnonHugePages in bytes; None if nothing starts there."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                found = {"length": end - start} if start == addr else None
            elif found is not None and head == "AnonHugePages:":
                found["huge"] = int(line.split()[1]) * 1024
                return found
    return found


def _thp_on() -> bool:
    return buffers._thp_mode() in ("always", "madvise")


def _small_pages(m: dict | None) -> bool:
    """No huge page in the mapping, where the kernel only makes them when
    asked (THP "madvise" or "never"; under "always" every mapping may get them)."""
    return buffers._thp_mode() == "always" or m is None or m.get("huge", 0) == 0


def test_a_huge_buffer_is_an_exact_mapping_on_a_2mib_boundary_on_huge_pages():
    n = 3 * (1 << 20) + 4096  # a 0.5B model's 256-token chunk object
    buf = alloc(n, populate=True, huge=True)
    assert buf.nbytes == n and not buf.readonly and buf.format == "B"
    assert bytes(buf[:64]) == bytes(64) and buf[n - 1] == 0
    buf[:] = b"\x07" * n
    assert buf[0] == buf[n - 1] == 7
    m = _mapping(address(buf))
    if _thp_on():
        assert address(buf) % HUGE == 0
        # No slack: the mapping is the buffer, so no huge page is ever made of
        # bytes the buffer does not own.
        assert m is not None and m["length"] == align_up(n)
        assert m["huge"] >= HUGE  # the first 2 MiB is one huge page
    else:
        # THP off: an ordinary mapping, still page aligned.
        assert address(buf) % ALIGN == 0 and _small_pages(m)


def test_a_huge_buffer_is_unmapped_with_its_last_view():
    buf = alloc(4 << 20, populate=True, huge=True)
    addr = address(buf)
    part = buf[100:200]
    del buf
    gc.collect()
    assert _mapping(addr) is not None  # a slice still holds it
    part[0] = 1
    del part
    gc.collect()
    assert _mapping(addr) is None


def test_buffers_below_a_huge_page_or_without_huge_stay_on_small_pages():
    small = alloc(1 << 20, populate=True, huge=True)
    plain = alloc(4 << 20, populate=True)
    for b in (small, plain):
        assert address(b) % ALIGN == 0
        assert _small_pages(_mapping(address(b)))


@pytest.mark.parametrize("huge", [True, False])
def test_the_pool_recycles_buffers_on_the_pages_it_was_asked_for(huge):
    pool = BufferPool(64 << 20, huge=huge)
    a = pool.get(6 << 20)
    addr = address(a)
    m = _mapping(addr)
    assert (m is not None and m["huge"] >= HUGE) if (huge and _thp_on()) else _small_pages(m)
    pool.put(a)
    b = pool.get(6 << 20)
    assert address(b) == addr and pool.reused == 1 and pool.allocated == 1


def test_whole_huge_page_buffers_go_to_direct_reads_only_and_count_at_their_mapped_size():
    n = 3 * (1 << 20) + 4096
    pool = BufferPool(64 << 20, huge=True, whole_reads=True)
    r = pool.get(n, direct_read=True)
    w = pool.get(n)  # an encode's buffer, say: exact
    assert r.nbytes == w.nbytes == n
    mr, mw = _mapping(address(r)), _mapping(address(w))
    if _thp_on():
        # Whole huge pages: the read goes to the device in one request.
        assert mr["length"] == 4 << 20 and mr["huge"] == 4 << 20
        assert mw["length"] == align_up(n)
    pool.put(r)
    pool.put(w)
    assert pool._kept == (mr["length"] if _thp_on() else align_up(n)) + align_up(n)
    # Each comes back to the same kind of use.
    assert address(pool.get(n, direct_read=True)) == address(r)
    assert address(pool.get(n)) == address(w)
    # Without whole_reads, a direct read takes an exact buffer.
    exact = BufferPool(64 << 20, huge=True).get(n, direct_read=True)
    assert _mapping(address(exact))["length"] == align_up(n)


def test_a_store_gives_whole_page_reads_only_when_no_tier_keeps_buffers(tmp_path):
    from kvtier.config import StoreConfig, TierSpec
    from kvtier.engine.store import TieredStore
    from kvtier.tiers.disk import DiskConfig
    from kvtier.tiers.memory import MemoryConfig

    def disk(name):  # a disk folder is one process's (and one store's) own
        return TierSpec("disk", DiskConfig(path=str(tmp_path / name), capacity=1 << 30))

    mem = TierSpec("memory", MemoryConfig(capacity=1 << 30))
    with TieredStore(StoreConfig(tiers=(disk("a"),))) as alone, TieredStore(StoreConfig(tiers=(mem, disk("b")))) as kept:
        assert alone.pool.whole_reads is True
        assert kept.pool.whole_reads is False  # the memory tier keeps promoted reads' buffers


def test_the_pool_takes_a_free_buffer_of_the_other_mapping_before_making_one():
    """Reads (whole huge pages) and saves (exact) of one object size share
    the pool: neither makes a fresh buffer while one of the other kind is free."""
    n = 3 * (1 << 20) + 4096
    pool = BufferPool(64 << 20, huge=True, whole_reads=True)
    r = pool.get(n, direct_read=True)
    pool.put(r)
    w = pool.get(n)  # a save: no exact buffer free, so the read's is taken
    assert address(w) == address(r) and pool.allocated == 1
    pool.put(w)
    e = BufferPool(64 << 20, huge=False)
    x = e.get(n)
    e.put(x)
    assert address(e.get(n, direct_read=True)) == address(x) and e.allocated == 1


@pytest.mark.skipif(not _thp_on(), reason="needs transparent huge pages (madvise or always)")
def test_a_huge_buffer_takes_the_room_of_free_small_ones_when_the_pool_is_full():
    n = 3 * (1 << 20) + 4096
    pool = BufferPool(8 << 20, huge=False)
    small = [pool.get(n), pool.get(n)]
    for b in small:
        pool.put(b)
    assert pool._kept == 2 * align_up(n)
    big = alloc(n, populate=True, huge=True, whole=True)
    pool.put(big)  # 4 MiB: room made by dropping one small buffer
    assert pool._kept == align_up(n) + (4 << 20)
    pool.huge, pool.whole_reads = True, True
    assert address(pool.get(n, direct_read=True)) == address(big)


# ---------------------------------------------------------------- LoadBuffers


def test_lent_slots_are_aligned_whole_object_buffers_with_read_only_payload_views():
    pool = BufferPool(64 << 20)
    lb = LoadBuffers(pool, 3, 10_000)
    assert len(lb) == 3 and lb.payload_bytes == 10_000
    for i in range(3):
        buf = lb._bufs[i]
        assert buf.nbytes == 4096 + align_up(10_000) and address(buf) % 4096 == 0
        view = lb.payload(i)
        assert view.readonly and view.nbytes == 10_000
    with pytest.raises(TypeError):
        lb.payload(0)[0] = 1
    with pytest.raises(IndexError):
        lb.payload(3)


def test_a_slice_is_a_view_of_the_same_slots():
    lb = LoadBuffers(BufferPool(64 << 20), 4, 4096)
    tail = lb[1:]
    assert len(tail) == 3 and len(lb[:2]) == 2 and len(lb[3:1]) == 0
    tail.writable(0)[:4] = b"abcd"
    assert bytes(lb.payload(1)[:4]) == b"abcd"
    lb.writable(3)[:2] = b"zz"
    assert len(tail[1:]) == 2 and bytes(tail[1:].payload(1)[:2]) == b"zz"


def test_a_slot_is_lent_to_a_read_of_its_size_only_and_is_busy_until_given_back():
    pool = BufferPool(64 << 20)
    lb = LoadBuffers(pool, 2, 4096)
    lender = lb.lender(0)
    other = lender.get(4096)  # a header read first, say: not the slot's
    assert other.obj is not lb._bufs[0].obj
    lender.put(other)  # to the pool
    assert pool._kept == mapped_bytes(other)
    buf = lender.get(8192)
    assert buf.obj is lb._bufs[0].obj and lb._busy[0] and lender.holds(buf)
    lender.put(buf)
    assert not lb._busy[0] and lb._bufs[0].obj is buf.obj  # free again, still the slot's


def test_a_busy_slot_gets_a_fresh_buffer_and_the_old_one_goes_to_the_pool_when_let_go():
    """A read that lands after its load gave up (or an object the memory tier
    holds) keeps the old buffer: the next load must not write into it, nor
    the pool recycle it before its holder lets go."""
    pool = BufferPool(64 << 20)
    lb = LoadBuffers(pool, 1, 4096)
    lender = lb.lender(0)
    held = lender.get(8192)  # a read in flight into the slot
    dst = lb.writable(0)  # the next load copies into slot 0
    assert dst.obj is not held.obj and lb._bufs[0].obj is dst.obj
    assert pool._kept == 0  # the held buffer is not the pool's yet
    lender.put(held)  # the late read lands and is let go
    assert pool._kept == mapped_bytes(held) and lb._bufs[0].obj is dst.obj and not lb._busy[0]
    again = lender.get(8192)  # a new read: the slot's new buffer, not the old one
    assert again.obj is dst.obj


def test_slot_finds_the_lent_payload_to_copy_into_or_none_for_another_size():
    lb = LoadBuffers(BufferPool(64 << 20), 2, 4096)
    assert slot(lb, 1, 4096).obj is lb._bufs[1].obj and not slot(lb, 1, 4096).readonly
    assert slot(lb, 1, 4095) is None and slot(lb, 2, 4096) is None
    assert slot([memoryview(bytearray(8))], 0, 8) is not None and slot([memoryview(bytearray(8))], 0, 7) is None
