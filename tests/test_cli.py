"""`kvtier store ...` against real tier directories: shared ones, a running engine's disk tier, the node memory tier."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvtier.codec import HEADER_BLOCK, encode
from kvtier.keys import Namespace, chunk_keys
from kvtier.tiers.shared import SharedConfig, SharedTier


def kvtier(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def populate(path, n=6, tokens_per_chunk=16):
    ns = Namespace("m", "fp", "float16", "test", 2, 2, 8, chunk_tokens=tokens_per_chunk)
    keys = chunk_keys(ns, list(range(n * tokens_per_chunk)))
    objs = [encode(k, "float16", (2, 2, 2, k.num_tokens, 8), os.urandom(k.num_tokens * 128)) for k in keys]
    path.mkdir(parents=True, exist_ok=True)  # a shared tier's folder must exist (a mount point)
    with SharedTier(SharedConfig(path=str(path), capacity=1 << 30, gc_interval_s=0)) as t:
        assert t.store(objs) == n
        paths = [t.dir.path(k) for k in keys]
    return keys, objs, paths


def test_store_stat_ls(tmp_path):
    keys, objs, _ = populate(tmp_path)
    doc = json.loads(kvtier("store", "stat", "--dir", str(tmp_path), "--json").stdout)
    assert doc["objects"] == 6
    assert doc["bytes"] == sum(o.nbytes for o in objs)
    assert len(doc["namespaces"]) == 1
    out = kvtier("store", "ls", "--dir", str(tmp_path)).stdout.splitlines()
    assert sorted(line.split()[1] for line in out) == sorted(k.hex for k in keys)
    human = kvtier("store", "stat", "--dir", str(tmp_path), "--capacity", "1MiB").stdout
    assert "objects      6" in human and "% used" in human


def test_store_verify_finds_and_quarantines_corruption(tmp_path):
    _, _, paths = populate(tmp_path)
    assert "verified 6 objects; 0 bad" in kvtier("store", "verify", "--dir", str(tmp_path), "--no-progress").stdout
    with open(paths[2], "r+b") as f:
        f.seek(HEADER_BLOCK + 5)
        b = f.read(1)
        f.seek(HEADER_BLOCK + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    before = _tree(tmp_path)
    proc = kvtier("store", "verify", "--dir", str(tmp_path), "--no-progress", check=False)
    assert proc.returncode == 1
    assert "5 objects; 1 bad" in proc.stdout and "checksum" in proc.stdout and "left in place" in proc.stdout
    assert _tree(tmp_path) == before  # only looked
    proc = kvtier("store", "verify", "--dir", str(tmp_path), "--no-progress", "--quarantine", check=False)
    assert proc.returncode == 1 and "(quarantined)" in proc.stdout
    assert not paths[2].exists()
    (moved,) = (tmp_path / "kvtier-v1" / "quarantine").iterdir()
    assert moved.name.startswith(paths[2].stem + ".")  # the tiers' own naming: KEY.TIME.kvc


def test_store_gc_collects_least_recently_used(tmp_path):
    _, objs, paths = populate(tmp_path, n=10)
    for i, p in enumerate(paths):  # path i last used at time 1000 + i
        os.utime(p, (1000 + i, 1000 + i))
    size = objs[0].nbytes
    capacity = 8 * size  # usage 10/8 > high watermark; collect to <= 0.5 * 8 = 4 objects
    proc = kvtier("store", "gc", "--dir", str(tmp_path), "--capacity", f"{capacity}B",
                  "--high-watermark", "0.9", "--low-watermark", "0.5", "--dry-run")
    assert "would delete 6" in proc.stdout and all(p.exists() for p in paths)
    listed = [line.split()[1] for line in proc.stdout.splitlines()[1:]]
    assert listed == [p.stem for p in paths[:6]]  # what would go, least recently used first
    proc = kvtier("store", "gc", "--dir", str(tmp_path), "--capacity", f"{capacity}B",
                  "--high-watermark", "0.9", "--low-watermark", "0.5", "--yes")
    assert "deleted 6" in proc.stdout
    assert [p.exists() for p in paths] == [False] * 6 + [True] * 4


def test_store_gc_runs_a_routine_pass_without_asking(tmp_path):
    _, objs, paths = populate(tmp_path, n=10)
    for i, p in enumerate(paths):
        os.utime(p, (1000 + i, 1000 + i))
    capacity = int(10.4 * objs[0].nbytes)  # 96 % used: over 0.95, collected down to 0.85, 2 of 10 objects
    proc = kvtier("store", "gc", "--dir", str(tmp_path), "--capacity", f"{capacity}B")
    assert "deleted 2" in proc.stdout
    assert [p.exists() for p in paths] == [False] * 2 + [True] * 8


def test_store_gc_with_a_capacity_that_would_empty_the_tier_asks_for_yes(tmp_path):
    """``--capacity 20B`` (or 20 with the unit forgotten) would delete every
    object: refused, exit 2, nothing deleted, saying what would go and how
    to confirm; --dry-run lists it; --yes does it."""
    _, _, paths = populate(tmp_path, n=10)
    objects = tmp_path / "kvtier-v1" / "objects"
    before = _tree(objects)
    proc = kvtier("store", "gc", "--dir", str(tmp_path), "--capacity", "20B", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "would delete 10 of the 10 objects" in proc.stderr and "100%" in proc.stderr
    assert "--dry-run" in proc.stderr and "--yes" in proc.stderr and "Traceback" not in proc.stderr
    assert _tree(objects) == before
    assert not (tmp_path / "kvtier-v1" / "gc.lease").exists()  # the refused pass gave its lease back
    proc = kvtier("store", "gc", "--dir", str(tmp_path), "--capacity", "20B", "--dry-run")
    assert "would delete 10" in proc.stdout
    assert sorted(line.split()[1] for line in proc.stdout.splitlines()[1:]) == sorted(p.stem for p in paths)
    assert _tree(objects) == before
    proc = kvtier("store", "gc", "--dir", str(tmp_path), "--capacity", "20B", "--yes")
    assert "deleted 10" in proc.stdout and not any(p.exists() for p in paths)


def test_store_gc_needs_capacity_and_sane_watermarks(tmp_path):
    proc = kvtier("store", "gc", "--dir", str(tmp_path), check=False)
    assert proc.returncode == 2 and "--capacity" in proc.stderr and "Fix:" in proc.stderr
    proc = kvtier("store", "gc", "--dir", str(tmp_path), "--capacity", "1GiB", "--low-watermark", "0.99", check=False)
    assert proc.returncode == 2 and "low_watermark" in proc.stderr


def test_a_size_without_its_unit_is_refused_naming_the_flag(tmp_path):
    populate(tmp_path)
    for cmd in (["gc", "--capacity", "20"], ["stat", "--capacity", "20"], ["gc", "--capacity", "inf"]):
        proc = kvtier("store", *cmd, "--dir", str(tmp_path), check=False)
        assert proc.returncode == 2 and "--capacity" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "20GiB" in kvtier("store", "gc", "--capacity", "20", "--dir", str(tmp_path), check=False).stderr


def _without_root_privileges():
    """In the child: drop the capabilities that let root read and enter
    folders whatever their mode (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so
    that a mode of 000 stops it as it stops any other user."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone at exec
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.parametrize("locked", [".", "kvtier-v1"])
def test_a_store_this_user_may_not_read_is_a_message_and_exit_2(tmp_path, locked):
    populate(tmp_path)
    folder = tmp_path / locked
    folder.chmod(0)
    try:
        for cmd in (["ls"], ["stat"], ["verify", "--no-progress"], ["gc", "--capacity", "1GiB"]):
            proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "store", *cmd, "--dir", str(tmp_path)],
                                  capture_output=True, text=True, timeout=120, preexec_fn=_without_root_privileges)
            assert proc.returncode == 2, (cmd, proc.stderr)
            assert "Traceback" not in proc.stderr and "permission denied" in proc.stderr and "Fix:" in proc.stderr
            assert str(folder.resolve()) in proc.stderr or str(tmp_path) in proc.stderr
    finally:
        folder.chmod(0o755)


def test_a_reader_gone_away_ends_ls_quietly(tmp_path):
    """``kvtier store ls | head``: once the reader has gone, the listing stops
    without a traceback, as ``ls`` does."""
    populate(tmp_path)
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first line
    try:
        proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "store", "ls", "--dir", str(tmp_path)],
                              stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert proc.returncode == 141 and proc.stderr == ""
    shell = subprocess.run(f"{sys.executable} -m kvtier.cli store ls --dir {tmp_path} | head -n 1",
                           shell=True, capture_output=True, text=True, timeout=120)
    assert len(shell.stdout.splitlines()) == 1 and "Error" not in shell.stderr


def _tree(root) -> dict:
    """Every path under ``root`` with its size and mtime (what "touched" means)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


def test_a_missing_or_mistyped_store_is_an_error_and_is_not_created(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for missing in (tmp_path / "typo", f / "sub"):
        for cmd in (["stat"], ["ls"], ["verify", "--no-progress"], ["gc", "--capacity", "1GiB", "--dry-run"],
                    ["gc", "--capacity", "1GiB"]):
            proc = kvtier("store", *cmd, "--dir", str(missing), check=False)
            assert proc.returncode == 2, (cmd, proc.stderr)
            assert str(missing) in proc.stderr and "no kvtier store" in proc.stderr and "Fix:" in proc.stderr
            assert not missing.exists()


def test_looking_touches_nothing_and_works_on_a_read_only_mount(tmp_path):
    _, objs, paths = populate(tmp_path / "store", n=10)
    for i, p in enumerate(paths):
        os.utime(p, (1000 + i, 1000 + i))
    tmp = tmp_path / "store" / "kvtier-v1" / "tmp"
    stale = tmp / "otherhost.1.abcd.tmp"  # another node's write in progress, hours old
    stale.write_bytes(b"x")
    os.utime(stale, (1, 1))
    before = _tree(tmp_path / "store")
    capacity = f"{8 * objs[0].nbytes}B"
    assert kvtier("store", "stat", "--dir", str(tmp_path / "store"), "--json").returncode == 0
    assert len(kvtier("store", "ls", "--dir", str(tmp_path / "store")).stdout.splitlines()) == 10
    assert "0 bad" in kvtier("store", "verify", "--dir", str(tmp_path / "store"), "--no-progress").stdout
    out = kvtier("store", "gc", "--dir", str(tmp_path / "store"), "--capacity", capacity, "--dry-run").stdout
    assert "would delete" in out
    assert _tree(tmp_path / "store") == before  # nothing created, swept, stamped or deleted

    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(tmp_path / "store"), str(ro)], capture_output=True).returncode == 0
    assert mounted or os.geteuid() != 0, "root could not bind-mount: the read-only case was not tested"
    if mounted:
        try:
            assert subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode == 0
            assert len(kvtier("store", "ls", "--dir", str(ro)).stdout.splitlines()) == 10
            assert json.loads(kvtier("store", "stat", "--dir", str(ro), "--json").stdout)["objects"] == 10
            assert "0 bad" in kvtier("store", "verify", "--dir", str(ro), "--no-progress").stdout
        finally:
            subprocess.run(["umount", str(ro)], capture_output=True)
    assert _tree(tmp_path / "store") == before


def test_help_explains_every_command():
    top = kvtier("--help").stdout
    assert "bench" in top and "store" in top
    for sub in (["bench", "storage"], ["store", "gc"], ["store", "verify"], ["store", "stat"], ["store", "ls"]):
        assert "usage: kvtier" in kvtier(*sub, "--help").stdout


def test_soak_refuses_a_directory_it_did_not_make(tmp_path):
    mine = tmp_path / "precious"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    proc = kvtier("bench", "soak", "--dir", str(mine), check=False)
    assert proc.returncode == 2 and "not made by kvtier bench soak" in proc.stderr and "Fix:" in proc.stderr
    assert (mine / "notes.txt").read_text() == "keep me"


def test_demo_exits_1_when_a_configuration_failed(tmp_path, monkeypatch, capsys):
    from kvtier import cli
    from kvtier.bench import resume, resume_report

    summary = {"failed": [{"config": "example", "case": "2048", "round": 0, "error": "boom"}]}
    monkeypatch.setattr(resume, "run", lambda cfg, progress=None: summary)
    monkeypatch.setattr(resume_report, "format_table", lambda s: "table")
    monkeypatch.setattr(resume_report, "write_report", lambda s, d: [])
    assert cli.main(["demo", "--dir", str(tmp_path)]) == 1
    assert "example failed" in capsys.readouterr().err
    summary["failed"] = []
    assert cli.main(["demo", "--dir", str(tmp_path)]) == 0


@pytest.mark.parametrize("dtype,flag,tokens", [("bfloat16", [], 2048), ("float32", [], 512),
                                                ("float32", ["--tokens", "1024"], 1024)])
def test_demo_sessions_are_shorter_where_prefill_runs_in_float32(tmp_path, monkeypatch, capsys, dtype, flag, tokens):
    """On a CPU without native bfloat16 the dummy weights run in float32 at
    tens of tokens per second: the demo's sessions shrink so that it still
    takes minutes, unless --tokens says otherwise."""
    from kvtier import cli
    from kvtier.bench import resume, resume_report

    seen = []
    monkeypatch.setattr(resume, "resolve_dtype", lambda d: dtype)
    monkeypatch.setattr(resume, "run", lambda cfg, progress=None: seen.append(cfg) or {"failed": []})
    monkeypatch.setattr(resume_report, "format_table", lambda s: "table")
    monkeypatch.setattr(resume_report, "write_report", lambda s, d: [])
    assert cli.main(["demo", "--dir", str(tmp_path), *flag]) == 0
    assert seen[0].contexts == (tokens,)
    assert (f"sessions of {tokens} tokens" in capsys.readouterr().out)


def test_demo_runs_each_configuration_twice_abba_unless_told_otherwise(tmp_path, monkeypatch, capsys):
    """The demo's bars compare configurations measured in separate engine
    runs, whose TTFTs drift tens of ms apart on a noisy host: by default
    each runs twice, in ABBA order, so that the spread a bar is held
    against includes that drift; --rounds 1 halves the time; 0 is refused."""
    from kvtier import cli
    from kvtier.bench import resume, resume_report

    seen = []
    monkeypatch.setattr(resume, "run", lambda cfg, progress=None: seen.append(cfg) or {"failed": []})
    monkeypatch.setattr(resume_report, "format_table", lambda s: "table")
    monkeypatch.setattr(resume_report, "write_report", lambda s, d: [])
    assert cli.main(["demo", "--dir", str(tmp_path)]) == 0
    assert seen[-1].rounds == 2 and "2 rounds in ABBA order." in capsys.readouterr().out
    assert resume.round_order(("a", "b"), 1, seen[-1].workload) == ("b", "a")
    assert cli.main(["demo", "--dir", str(tmp_path), "--rounds", "1"]) == 0
    assert seen[-1].rounds == 1 and "1 round." in capsys.readouterr().out
    assert cli.main(["demo", "--dir", str(tmp_path), "--rounds", "0"]) == 2
    assert len(seen) == 2 and "--rounds 0: need 1 or more" in capsys.readouterr().err


# ---------------------------------------------------------------- ownership: whose directory it is


def _consume(tier, keys) -> int:
    n = 0
    for obj in tier.fetch(keys):
        obj.release()
        n += 1
    return n


def test_verify_and_gc_refuse_a_running_engines_disk_tier_and_work_once_it_stopped(tmp_path):
    from kvtier.tiers.disk import DiskTier
    from tests.support import OBJ, disk_config, make_chunks

    c = make_chunks(10)
    engine = DiskTier(disk_config(tmp_path, 64 * OBJ))  # this process is the engine: it holds the folder
    try:
        assert engine.store(c.objs) == 10
        assert _consume(engine, c.keys[:1]) == 1  # chunk 0 is now the most recently used
        before = _tree(tmp_path)
        for cmd in (["verify", "--no-progress"], ["verify", "--no-progress", "--quarantine"],
                    ["gc", "--capacity", f"{8 * OBJ}B"], ["gc", "--capacity", f"{8 * OBJ}B", "--dry-run"]):
            proc = kvtier("store", *cmd, "--dir", str(tmp_path), check=False)
            assert proc.returncode == 2, (cmd, proc.stdout, proc.stderr)
            assert "disk tier of a running kvtier engine" in proc.stderr and "disk.lock" in proc.stderr, proc.stderr
            assert "Fix: stop that engine first" in proc.stderr
        assert _tree(tmp_path) == before  # nothing the engine counts was touched
        # Looking is still fine while it runs.
        assert json.loads(kvtier("store", "stat", "--dir", str(tmp_path), "--json").stdout)["objects"] == 10
        assert engine.stats().objects == 10 and engine.lookup(c.keys) == 10
    finally:
        engine.close()

    assert "verified 10 objects; 0 bad" in kvtier("store", "verify", "--dir", str(tmp_path), "--no-progress").stdout
    # The tier's own eviction, by its access log: the reads count, not the files' mtimes.
    gc = ["store", "gc", "--dir", str(tmp_path), "--capacity", f"{8 * OBJ}B", "--high-watermark", "0.9",
          "--low-watermark", "0.5"]
    before = _tree(tmp_path)
    out = kvtier(*gc, "--dry-run").stdout
    assert "would delete 6" in out
    assert [line.split()[1] for line in out.splitlines()[1:]] == [k.hex for k in c.keys[1:7]]
    proc = kvtier(*gc, check=False)  # 60 % of the tier: more than a routine pass
    assert proc.returncode == 2 and "would delete 6 of the 10 objects" in proc.stderr and "--yes" in proc.stderr
    assert _tree(tmp_path) == before  # neither the plan nor the refusal changed anything
    out = kvtier(*gc, "--yes").stdout
    assert "deleted 6" in out
    again = DiskTier(disk_config(tmp_path, 64 * OBJ))
    try:
        assert [again.lookup([k]) for k in c.keys] == [1] + [0] * 6 + [1] * 3
        assert again.stats().used_bytes == 4 * OBJ
    finally:
        again.close()


def test_verify_and_gc_work_on_a_shared_directory_engines_are_using(tmp_path):
    from tests.support import OBJ, make_chunks, shared_config

    c = make_chunks(10)
    engines = [SharedTier(shared_config(tmp_path, 64 * OBJ)) for _ in range(2)]  # two engines on one mount
    try:
        assert engines[0].store(c.objs[:5]) == 5 and engines[1].store(c.objs[5:]) == 5
        for i, p in enumerate(engines[0].dir.path(k) for k in c.keys):
            os.utime(p, (1000 + i, 1000 + i))
        assert "verified 10 objects; 0 bad" in kvtier("store", "verify", "--dir", str(tmp_path), "--no-progress",
                                                     "--quarantine").stdout
        out = kvtier("store", "gc", "--dir", str(tmp_path), "--capacity", f"{8 * OBJ}B",
                     "--high-watermark", "0.9", "--low-watermark", "0.5", "--yes").stdout
        assert "deleted 6" in out
        assert [engines[0].lookup([k]) for k in c.keys] == [0] * 6 + [1] * 4
    finally:
        for e in engines:
            e.close()


def test_a_node_memory_tier_is_only_looked_at(tmp_path):
    import tempfile

    from kvtier.tiers.shm import ShmConfig, ShmTier
    from tests.support import OBJ, make_chunks

    folder = tempfile.mkdtemp(prefix="kvtier-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    tier = ShmTier(ShmConfig(capacity=64 * OBJ, path=folder))
    try:
        assert tier.store(make_chunks(3).objs) == 3
        assert "verified 3 objects; 0 bad" in kvtier("store", "verify", "--dir", folder, "--no-progress").stdout
        for cmd in (["verify", "--no-progress", "--quarantine"], ["gc", "--capacity", f"{OBJ}B"]):
            proc = kvtier("store", *cmd, "--dir", folder, check=False)
            assert proc.returncode == 2 and "node memory tier" in proc.stderr and "Fix:" in proc.stderr, proc.stderr
        assert tier.stats().objects == 3
    finally:
        tier.close()
        shutil.rmtree(folder, ignore_errors=True)
