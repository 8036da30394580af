"""The fault-injecting FUSE filesystem itself (tests/faultfs.py): pass-through semantics the
orchestrator relies on, and each fault firing and clearing as configured (issue 6)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from orchestrator.protocol import fsio
from tests.faultfs import FaultMount, compile_glob, is_mounted, parse_rules, rules_doc

pytestmark = pytest.mark.timeout(60)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.005):
    """Poll until ``predicate()`` is truthy; returns (value, seconds waited)."""
    start = time.monotonic()
    while True:
        value = predicate()
        if value:
            return value, time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def publish(path, data: bytes) -> None:
    """temp + fsync + rename, as fsio does."""
    tmp = path.with_name(f".{path.name}.{time.monotonic_ns()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def errno_of(fn) -> int | None:
    try:
        fn()
    except OSError as e:
        return e.errno
    return None


# -- pure: globs and rules ---------------------------------------------------------------------

@pytest.mark.parametrize("glob,path,hit", [
    ("attempts/*/arrivals/*", "attempts/a1/arrivals/r00001.json", True),
    ("attempts/*/arrivals/*", "attempts/a1/arrivals/sub/r1.json", False),
    ("attempts/*/release.json", "attempts/a000001-abc/release.json", True),
    ("attempts/*/release.json", "x/attempts/a/release.json", False),
    ("**/release.json", "release.json", True),
    ("**/release.json", "run/attempts/a/release.json", True),
    ("run/**", "run/iterations/000001/rollout/train/r00001.jsonl", True),
    ("iterations/*/rollout/*/*.jsonl", "iterations/000001/rollout/train/r00001.jsonl", True),
    ("iterations/*/rollout/*/*.jsonl", "iterations/000001/rollout/train/r00001.manifest.json", False),
    ("r0000[12].jsonl", "r00002.jsonl", True),
    ("r0000[!12].jsonl", "r00002.jsonl", False),
    ("a?c", "abc", True),
    ("a?c", "a/c", False),
    ("**", "anything/at/all", True),
])
def test_globs_are_relative_to_the_mount_root_and_star_stays_in_one_segment(glob, path, hit):
    assert (compile_glob(glob).match(path) is not None) == hit


def test_malformed_rules_are_refused_before_they_reach_a_mount():
    for bad in ({"rules": {}}, {"rules": [1]}, {"glob": "*", "typo_s": 1}, {"estale": {"seed": 1}},
                {"truncate_once": {"fraction": 1.5}}, {"truncate_once": {"per": "inode"}}):
        with pytest.raises(ValueError):
            parse_rules(rules_doc(bad))
    rules = parse_rules(rules_doc([{"glob": "a", "estale": 2}, {"truncate_once": True}]))
    assert rules[0].estale == {"count": 2}
    assert rules[1].truncate == {"reads": 1, "fraction": 0.5, "per": "version"}


# -- pass-through ------------------------------------------------------------------------------

def test_passthrough_supports_what_the_orchestrator_does(faultfs_mounts):
    backing, (m,) = faultfs_mounts(1)
    root = m.path
    assert os.listdir(root) == []
    (root / "d" / "e").mkdir(parents=True)
    (root / "d" / "e").mkdir(parents=True, exist_ok=True)  # mkdir -p of an existing directory
    f = root / "d" / "e" / "x.bin"
    with open(f, "wb") as out:  # create, write, fsync
        out.write(b"0123456789")
        out.flush()
        os.fsync(out.fileno())
    assert (backing / "d" / "e" / "x.bin").read_bytes() == b"0123456789"
    with open(f, "ab") as out:  # append
        out.write(b"AB")
    with open(f, "r+b") as out:  # truncate through an open file
        out.truncate(4)
    assert f.read_bytes() == b"0123"
    os.truncate(f, 2)
    assert f.read_bytes() == b"01" and f.stat().st_size == 2
    os.utime(f, ns=(1_000_000_000, 2_000_000_000))
    assert f.stat().st_mtime_ns == 2_000_000_000 == (backing / "d" / "e" / "x.bin").stat().st_mtime_ns
    os.chmod(f, 0o600)
    assert f.stat().st_mode & 0o777 == 0o600
    assert f.stat().st_ino == (backing / "d" / "e" / "x.bin").stat().st_ino  # use_ino
    assert sorted(os.listdir(root / "d" / "e")) == ["x.bin"]
    assert os.statvfs(root).f_bsize > 0
    fsio.fsync_dir(root / "d")
    fsio.refresh_dir(root / "d")
    os.rename(f, root / "d" / "y.bin")
    assert not f.exists() and (root / "d" / "y.bin").read_bytes() == b"01"
    os.unlink(root / "d" / "y.bin")
    os.rmdir(root / "d" / "e")
    os.rmdir(root / "d")
    assert os.listdir(backing) == []


def test_records_round_trip_and_rename_replaces_atomically_across_mounts(faultfs_mounts):
    _, (a, b) = faultfs_mounts(2)
    path_a, path_b = a.path / "run" / "release.json", b.path / "run" / "release.json"
    fsio.write_record(path_a, {"n": 0})
    assert fsio.read_record(path_b) == {"n": 0}
    stop = threading.Event()
    seen_bad = []

    def reader():
        while not stop.is_set():
            body = fsio.read_record(path_b)
            if body is None:
                seen_bad.append("absent or invalid")  # a replace must never show a gap or a torn file

    t = threading.Thread(target=reader)
    t.start()
    try:
        for n in range(1, 60):
            fsio.write_record(path_a, {"n": n, "pad": "x" * (n * 37 % 500)})
    finally:
        stop.set()
        t.join(timeout=10)
    assert not seen_bad
    assert fsio.read_record(path_b)["n"] == 59
    assert not [p for p in os.listdir(a.path / "run") if p.endswith(".tmp")]


def test_exclusive_create_has_one_winner_across_mounts(faultfs_mounts):
    _, (a, b) = faultfs_mounts(2)
    def claim(mount, name, barrier, results):
        barrier.wait(timeout=5)
        results.append(fsio.create_record_exclusive(mount.path / "claims" / name, {"by": str(mount.path)}))

    for i in range(20):
        results, barrier = [], threading.Barrier(2)
        threads = [threading.Thread(target=claim, args=(m, f"gen-{i}", barrier, results)) for m in (a, b)]
        [t.start() for t in threads]
        [t.join(timeout=10) for t in threads]
        assert sorted(results) == [False, True], f"race {i}: {results}"
    assert errno_of(lambda: os.open(a.path / "claims" / "gen-0", os.O_CREAT | os.O_EXCL | os.O_WRONLY)) == errno.EEXIST


def test_two_mounts_see_each_others_files_after_the_delay(faultfs_mounts):
    delay = 0.5
    backing, (a, b) = faultfs_mounts(2, faults={"glob": "**", "delay_new_s": delay})
    publish(a.path / "from-a", b"a")
    publish(b.path / "from-b", b"b")
    assert (a.path / "from-a").read_bytes() == b"a"  # a client sees its own files at once
    assert not (b.path / "from-a").exists() and "from-a" not in os.listdir(b.path)
    for path in (b.path / "from-a", a.path / "from-b"):
        name = path.name
        wait_until(path.exists, 5, f"{path} to show up")
        age = time.time() - (backing / name).stat().st_ctime  # how long after it appeared
        assert delay - 0.01 <= age < delay + 1.0, (name, age)
    assert sorted(os.listdir(a.path)) == sorted(os.listdir(b.path)) == ["from-a", "from-b"]
    assert (b.path / "from-a").read_bytes() == b"a"
    assert b.wait_stats(lambda s: s["counts"]["hidden"] > 0)["first_at"]["hidden"] > 0


def test_delay_new_hides_only_matching_new_names_and_clears_at_once(faultfs_mounts):
    backing, (m,) = faultfs_mounts(1, faults={"glob": "slow/*", "delay_new_s": 30})
    (backing / "slow").mkdir()
    (backing / "slow" / "x").write_text("x")
    (backing / "fast").write_text("f")
    assert (m.path / "fast").read_text() == "f"  # not matched: visible at once
    assert os.listdir(m.path / "slow") == []
    assert errno_of(lambda: open(m.path / "slow" / "x")) == errno.ENOENT
    assert errno_of(lambda: os.stat(m.path / "slow" / "x")) == errno.ENOENT
    # the server says it exists: an exclusive create fails, and the name shows up from then on
    assert errno_of(lambda: os.open(m.path / "slow" / "x", os.O_CREAT | os.O_EXCL | os.O_WRONLY)) == errno.EEXIST
    assert (m.path / "slow" / "x").read_text() == "x"
    (backing / "slow" / "y").write_text("y")
    assert not (m.path / "slow" / "y").exists()
    m.clear_faults()  # lifting the fault takes effect on the next call
    assert (m.path / "slow" / "y").read_text() == "y"


def test_a_name_replaced_faster_than_the_delay_still_shows_up_in_time(faultfs_mounts):
    """A heartbeat is rewritten (temp + rename) more often than the delay; a mount that first
    looks late must date the name from its first appearance, not from the latest replace."""
    delay = 0.6
    _, (writer, reader) = faultfs_mounts(2, faults={"glob": "hb/*", "delay_new_s": delay})
    (writer.path / "hb").mkdir()
    stop = threading.Event()

    def beat():
        n = 0
        while not stop.is_set():
            fsio.write_record(writer.path / "hb" / "r1.json", {"counter": n}, durable=False)
            n += 1
            time.sleep(0.05)

    t = threading.Thread(target=beat)
    t.start()
    try:
        wait_until(lambda: (writer.path / "hb" / "r1.json").exists(), 5, "the first beat")
        started = time.monotonic()
        time.sleep(delay + 0.2)  # the reader has not looked yet
        body, _ = wait_until(lambda: fsio.read_record(reader.path / "hb" / "r1.json"), 2, "the reader to see the heartbeat")
        assert time.monotonic() - started < delay + 1.2
        first = body["counter"]
        wait_until(lambda: (fsio.read_record(reader.path / "hb" / "r1.json") or {}).get("counter", first) > first, 2,
                   "the counter to move")
    finally:
        stop.set()
        t.join(timeout=5)


def test_stale_replace_serves_the_old_inode_until_the_window_ends(faultfs_mounts):
    window = 0.6
    _, (writer, reader) = faultfs_mounts(2, per_mount=[None, {"glob": "*.json", "stale_replace_s": window}])
    publish(writer.path / "r.json", b"old")
    assert (reader.path / "r.json").read_bytes() == b"old"  # fills the reader's cache
    filled = time.monotonic()
    publish(writer.path / "r.json", b"newer!")
    assert (reader.path / "r.json").read_bytes() == b"old"
    assert os.stat(reader.path / "r.json").st_size == 3  # stat agrees with the stale content
    _, _ = wait_until(lambda: (reader.path / "r.json").read_bytes() == b"newer!", 5, "fresh content")
    assert time.monotonic() - filled >= window - 0.05
    assert reader.wait_stats(lambda s: s["counts"]["stale"] > 0)
    # a write through the reader's own mount forgets what it cached
    assert (reader.path / "r.json").read_bytes() == b"newer!"
    publish(writer.path / "r.json", b"third")
    publish(reader.path / "r.json", b"mine")
    assert (reader.path / "r.json").read_bytes() == b"mine"


def test_estale_fires_count_times_and_the_kernel_retries_once(faultfs_mounts):
    backing, (m,) = faultfs_mounts(1, faults={"glob": "f*", "estale": {"count": 3}})
    (backing / "f1").write_text("1")
    (backing / "g").write_text("g")
    assert (m.path / "g").read_text() == "g"  # not matched
    # open 1 fails and the kernel's retry (open 2) fails too: the caller sees ESTALE ...
    assert errno_of(lambda: (m.path / "f1").read_text()) == errno.ESTALE
    # ... open 3 fails, the retry (open 4) succeeds: absorbed by the kernel
    assert (m.path / "f1").read_text() == "1"
    assert (m.path / "f1").read_text() == "1"
    assert m.wait_stats(lambda s: s["counts"]["estale"] == 3)
    assert fsio.read_record(m.path / "f1") is None  # (not a record; a read that never raises)
    m.set_faults({"glob": "f*", "estale": {"count": 2, "per_path": True}})
    (backing / "f2").write_text("2")
    assert errno_of(lambda: (m.path / "f1").read_text()) == errno.ESTALE
    assert errno_of(lambda: (m.path / "f2").read_text()) == errno.ESTALE
    assert (m.path / "f1").read_text() == "1" and (m.path / "f2").read_text() == "2"
    # fsio treats ESTALE as "not there yet"
    m.set_faults({"glob": "rec.json", "estale": {"count": 2, "id": 2}})
    fsio.write_record(backing / "rec.json", {"ok": True})
    assert fsio.read_record(m.path / "rec.json") is None
    assert fsio.read_record(m.path / "rec.json") == {"ok": True}


def test_estale_with_a_probability_is_reproducible_from_its_seed(faultfs_mounts):
    rule = {"glob": "p", "estale": {"probability": 0.5, "seed": 11}}
    backing, mounts = faultfs_mounts(2, faults=rule)
    (backing / "p").write_text("p")
    outcomes = [[errno_of((m.path / "p").read_text) for _ in range(40)] for m in mounts]
    assert outcomes[0] == outcomes[1]
    assert 0 < outcomes[0].count(errno.ESTALE) < 40


def test_enospc_after_the_budget_then_lifted(faultfs_mounts):
    backing, (m,) = faultfs_mounts(1, faults={"glob": "data/*", "enospc_after_bytes": 100})
    (m.path / "data").mkdir()
    fd = os.open(m.path / "data" / "a", os.O_CREAT | os.O_WRONLY)
    try:
        assert os.write(fd, b"x" * 60) == 60
        assert os.write(fd, b"y" * 60) == 40  # what still fits: a short write
        assert errno_of(lambda: os.write(fd, b"z")) == errno.ENOSPC
    finally:
        os.close(fd)
    with pytest.raises(OSError) as e:
        (m.path / "data" / "b").write_bytes(b"more")
    assert e.value.errno == errno.ENOSPC
    (m.path / "other").write_bytes(b"not matched")  # other paths still take writes
    assert os.statvfs(m.path).f_bavail == 0  # df says the disk is full
    stats = m.wait_stats(lambda s: s["counts"]["enospc"] >= 2)
    assert next(e[1:] for e in stats["events"] if e[1] == "enospc") == ["enospc", "data/a"]
    m.set_faults({"glob": "data/*", "enospc_after_bytes": 10})  # a new budget counts afresh
    fd = os.open(m.path / "data" / "c", os.O_CREAT | os.O_WRONLY)
    try:
        assert os.write(fd, b"0123456789abc") == 10
    finally:
        os.close(fd)
    m.clear_faults()
    (m.path / "data" / "b").write_bytes(b"lifted")
    assert (backing / "data" / "b").read_bytes() == b"lifted"
    assert os.statvfs(m.path).f_bavail > 0


def test_truncate_once_cuts_the_first_read_of_each_version(faultfs_mounts):
    backing, (m,) = faultfs_mounts(1, faults={"glob": "t/*", "truncate_once": True})
    (backing / "t").mkdir()
    (backing / "t" / "a").write_bytes(b"0123456789")
    with open(m.path / "t" / "a", "rb") as f:
        assert f.read() == b"01234"
    assert (m.path / "t" / "a").read_bytes() == b"0123456789"  # the second read is whole
    publish(backing / "t" / "a", b"abcdefgh")  # a new version is cut once more
    assert (m.path / "t" / "a").read_bytes() == b"abcd"
    assert (m.path / "t" / "a").read_bytes() == b"abcdefgh"
    rec = {"v": 1, "text": "x" * fsio.PAD_BELOW}  # not padded: a cut ends inside the record
    fsio.write_record(backing / "t" / "rec.json", rec)
    assert fsio.read_record(m.path / "t" / "rec.json") is None  # a cut record fails its checksum
    assert fsio.read_record(m.path / "t" / "rec.json") == rec
    m.set_faults({"glob": "t/*", "truncate_once": {"reads": 2, "fraction": 0.25, "per": "path", "count": 3}})
    assert (m.path / "t" / "a").read_bytes() == b"ab"
    assert (m.path / "t" / "a").read_bytes() == b"ab"
    assert (m.path / "t" / "a").read_bytes() == b"abcdefgh"
    whole = len((backing / "t" / "rec.json").read_bytes())
    assert len((m.path / "t" / "rec.json").read_bytes()) == whole // 4  # third and last cut (count 3)
    assert fsio.read_record(m.path / "t" / "rec.json") == rec
    assert m.wait_stats(lambda s: s["counts"]["truncated"] == 6)


def test_an_invalid_control_file_keeps_the_previous_faults(faultfs_mounts):
    backing, (m,) = faultfs_mounts(1, faults={"glob": "x", "estale": {"count": 100}})
    (backing / "x").write_text("x")
    assert errno_of(lambda: (m.path / "x").read_text()) == errno.ESTALE
    m.control.write_text("{not json")
    assert errno_of(lambda: (m.path / "x").read_text()) == errno.ESTALE
    assert m.wait_stats(lambda s: s.get("control_error"))["control_error"].startswith("JSONDecodeError")
    m.clear_faults()
    assert (m.path / "x").read_text() == "x"
    assert m.wait_stats(lambda s: s.get("control_error") is None and s["rules"] == [])


def test_close_unmounts_a_busy_mount_and_stops_its_process(tmp_path):
    from tests.faultfs_fixtures import require_faultfs

    require_faultfs()
    m = FaultMount(tmp_path / "backing", tmp_path / "mnt", workdir=tmp_path)
    m.start()
    try:
        (m.path / "f").write_text("held open")
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); time.sleep(60)",
                                   str(m.path / "f")], cwd=m.path, start_new_session=True)
        wait_until(lambda: any(p.path == str(m.path / "f") for p in psutil.Process(holder.pid).open_files()),
                   10, "the holder to open the file")
        proc = m.proc
        m.close(busy_retry_s=0.3)  # fusermount -u fails (busy), then the lazy unmount detaches it
        assert not is_mounted(m.path)
        assert proc.poll() is not None
    finally:
        holder.kill()
        holder.wait(timeout=10)
        if is_mounted(m.path):
            m.close()
