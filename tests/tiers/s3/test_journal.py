"""The S3 tier's removal journal, against a real SeaweedFS: what collection
passes deleted, read by every other instance once, never more than whole
records of sane objects, and never an exception."""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import replace

from kvtier.tiers.removals import RECORD
from kvtier.tiers.s3.journal import S3RemovalJournal
from kvtier.tiers.s3.tier import S3Tier
from tests.support import OBJ, make_chunks
from tests.tiers.s3server import BUCKET, s3_config, shared_server


def _pair(name: str, capacity: int = 10 * OBJ, **kw) -> tuple[S3Tier, S3Tier]:
    """Two instances ("nodes") on one fresh prefix."""
    srv = shared_server()
    prefix = f"journal/{name}-{os.getpid()}-{time.monotonic_ns()}"
    a = S3Tier(s3_config(srv, prefix, capacity, name=f"{name}-a", **kw))
    b = S3Tier(s3_config(srv, prefix, capacity, name=f"{name}-b", **kw))
    return a, b


def _journal_names(tier: S3Tier) -> list[str]:
    listed = shared_server().client().list_objects_v2(Bucket=BUCKET, Prefix=tier.journal.prefix)
    return sorted(o["Key"] for o in listed.get("Contents", ()))


def test_a_collection_pass_journals_what_it_deleted_and_another_node_reads_it_once():
    a, b = _pair("once", high_watermark=0.5, low_watermark=0.3)
    try:
        c = make_chunks(8)
        assert a.store(c.objs) == 8
        assert b.journal.read_new() == []
        assert a.gc(dry_run=True).deleted == 5
        assert _journal_names(a) == [] and b.journal.read_new() == []  # a dry run journals nothing
        r = a.gc()
        gone = {k.digest for k in c.keys if not b.lookup([k])}
        assert r.deleted == 5 and len(gone) == 5
        (name,) = _journal_names(a)
        assert name.startswith(f"{a.base}/removed/") and name.endswith(".rm")
        got = b.journal.read_new()
        assert len(got) == 5 and set(got) == gone  # exactly the deleted objects' digests
        assert b.journal.read_new() == []  # read once
        assert a.gc().deleted == 0
        assert len(_journal_names(a)) == 1  # a pass that deleted nothing writes nothing
        assert b.journal.read_new() == []
    finally:
        a.close()
        b.close()


def test_old_journal_objects_are_swept_by_the_next_pass_that_writes():
    a, _b = _pair("sweep")
    _b.close()
    try:
        j = S3RemovalJournal(a._client, a.bucket, a.base, keep_s=60)
        client = shared_server().client()
        old = f"{j.prefix}{time.time_ns() - 120 * 10**9}.host.1.old.rm"
        client.put_object(Bucket=BUCKET, Key=old, Body=b"o" * RECORD)
        other = f"{j.prefix}notes.txt"  # not a journal name: never swept
        client.put_object(Bucket=BUCKET, Key=other, Body=b"n")
        assert j.append([b"a" * RECORD]) == RECORD
        names = _journal_names(a)
        assert old not in names and other in names and len(names) == 2
    finally:
        a.close()


def test_forged_objects_give_whole_records_at_most():
    a, _b = _pair("forged")
    _b.close()
    try:
        j = S3RemovalJournal(a._client, a.bucket, a.base, max_entry=4 * RECORD)
        assert j.append([b"a" * RECORD, b"short"]) == RECORD  # only whole digests are written
        client = shared_server().client()
        now = time.time_ns()
        forged = {
            f"{now}.evil.1.x.rm": b"b" * RECORD + b"c" * 7,  # a torn record
            f"{now}.evil.2.y.rm": b"d" * (5 * RECORD),  # larger than max_entry: not read
            f"{now}.evil.3.z.rm": b"",  # empty
            f"sub/{now}.evil.4.w.rm": b"e" * RECORD,  # below the folder
            "notes.txt": b"f" * RECORD,  # not a journal name
            f"{now}.evil.5.v.rm.tmp": b"g" * RECORD,  # nor this
        }
        for name, data in forged.items():
            client.put_object(Bucket=BUCKET, Key=j.prefix + name, Body=data)
        assert sorted(j.read_new()) == [b"a" * RECORD, b"b" * RECORD]
        assert j.read_new() == []
    finally:
        a.close()


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    return port


def test_a_server_that_is_down_is_nothing_new_with_a_warning(caplog):
    cfg = s3_config(shared_server(), "journal/down", 10 * OBJ, name="down", max_attempts=1)
    tier = S3Tier(replace(cfg, endpoint=f"http://127.0.0.1:{_dead_port()}"))
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.s3.journal"):
            assert tier.journal.read_new() == []
            assert tier.journal.append([b"a" * RECORD]) == 0
        warned = [r.getMessage() for r in caplog.records if r.name == "kvtier.tiers.s3.journal"]
        assert len(warned) == 2 and "not read" in warned[0] and "not written" in warned[1]
    finally:
        tier.close()
