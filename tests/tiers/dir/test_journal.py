"""The shared tier's removal journal: what collection passes deleted, read
by every engine once, and never more than whole records of regular files."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvtier.tiers.dir.journal import RemovalJournal
from kvtier.tiers.removals import RECORD
from kvtier.tiers.shared import SharedTier
from tests.support import OBJ, make_chunks, shared_config


def _tier(tmp_path, capacity=10 * OBJ, **kw) -> SharedTier:
    return SharedTier(shared_config(tmp_path / "shared", capacity, **kw))


def test_a_collection_pass_journals_what_it_deleted_and_each_reader_reads_it_once(tmp_path):
    tier = _tier(tmp_path, high_watermark=0.5, low_watermark=0.3)
    other = _tier(tmp_path)  # another engine's view of the same folder
    try:
        c = make_chunks(8)
        tier.store(c.objs)
        assert other.journal.read_new() == []
        r = tier.gc()
        gone = set(c.keys[i].digest for i in range(8) if not tier.lookup([c.keys[i]]))
        assert r.deleted == 5 and len(gone) == 5
        assert set(other.journal.read_new()) == gone
        assert other.journal.read_new() == []  # read once
        assert tier.gc().deleted == 0
        assert other.journal.read_new() == []  # a pass that deleted nothing writes nothing
    finally:
        tier.close()
        other.close()


def test_kvtier_store_gc_from_another_process_journals_its_deletions(tmp_path):
    tier = _tier(tmp_path, capacity=64 * OBJ)
    try:
        c = make_chunks(4)
        tier.store(c.objs)
        subprocess.run([sys.executable, "-m", "kvtier.cli", "store", "gc", "--dir", str(tmp_path / "shared"),
                        "--capacity", "1KiB", "--yes"], check=True, capture_output=True)
        assert set(tier.journal.read_new()) == {k.digest for k in c.keys}
    finally:
        tier.close()


def test_a_dry_run_journals_nothing(tmp_path):
    tier = _tier(tmp_path, high_watermark=0.5, low_watermark=0.3)
    try:
        tier.store(make_chunks(8).objs)
        assert tier.gc(dry_run=True).deleted == 5
        assert tier.journal.read_new() == []
    finally:
        tier.close()


def test_forged_files_give_whole_records_at_most(tmp_path):
    tier = _tier(tmp_path)
    try:
        j = tier.journal
        assert j.append([b"a" * RECORD, b"short"]) == RECORD  # only whole digests are written
        folder = tier.journal.path
        (folder / f"{time.time_ns()}.evil.1.x.rm").write_bytes(b"b" * RECORD + b"c" * 7)  # a torn record
        os.symlink(folder / "elsewhere", folder / f"{time.time_ns()}.evil.2.y.rm")  # a link: not followed
        os.mkdir(folder / f"{time.time_ns()}.evil.3.z.rm")  # not a file
        (folder / "notes.txt").write_bytes(b"d" * RECORD)  # not a journal name
        assert sorted(j.read_new()) == [b"a" * RECORD, b"b" * RECORD]
    finally:
        tier.close()


def test_old_journal_files_are_swept_by_the_next_pass_that_writes(tmp_path):
    tier = _tier(tmp_path)
    try:
        j = RemovalJournal(tier.dir, keep_s=60)
        folder = tier.journal.path
        j.append([b"a" * RECORD])
        old = folder / f"{time.time_ns() - 120 * 10**9}.host.1.old.rm"
        old.write_bytes(b"o" * RECORD)
        j.append([b"b" * RECORD])
        assert not old.exists() and len(os.listdir(folder)) == 2
    finally:
        tier.close()
