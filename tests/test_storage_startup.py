"""Stories about the start-up rebuild of the storage index (`storage/startup.py`): restarts, the order
of age, lookups while the scan runs, temporaries of dead writers, removes during the scan."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from helpers import storage_stories as stories
from helpers.storage_stories import NS, OTHER_NS, eventually, file_bytes, held_scan, key, payload, read, write
from hpkv.keys import make_key
from hpkv.storage import startup
from hpkv.storage.scan import STALE_TEMP_S
from hpkv.storage.storage_tier import StorageTier

open_tier = stories.open_tier


def test_a_restarted_tier_finds_its_entries_again(open_tier, storage_dir):
    first = open_tier()
    for i in range(3):
        write(first, key(i))
    first.close()

    again = open_tier()
    assert again.scan_done.wait(10)

    assert again.stats().files_scanned == 3
    assert again.stats().num_entries == 3
    assert again.stats().used_bytes == 3 * file_bytes()
    assert all(read(again, key(i)) == payload(key(i)) for i in range(3))


def test_after_a_restart_the_file_used_longest_ago_is_evicted_first(open_tier):
    first = open_tier()
    for i in range(3):
        write(first, key(i))
    first.close()
    now = time.time()
    for i, age_s in ((0, 100), (1, 300), (2, 200)):  # key 1 was used longest ago, then key 2
        os.utime(first.paths.path_of(NS, key(i)), (now - age_s, now - age_s))

    again = open_tier(capacity=3 * file_bytes())
    assert again.scan_done.wait(10)
    write(again, key(3))
    assert not os.path.exists(again.paths.path_of(NS, key(1)))
    write(again, key(4))
    assert not os.path.exists(again.paths.path_of(NS, key(2)))
    assert os.path.exists(again.paths.path_of(NS, key(0)))


def test_a_restart_with_a_smaller_capacity_evicts_the_oldest_files(open_tier):
    first = open_tier()
    for i in range(5):
        write(first, key(i))
        os.utime(first.paths.path_of(NS, key(i)), (time.time() - 100 + i, time.time() - 100 + i))
    first.close()

    again = open_tier(capacity=3 * file_bytes())
    assert again.scan_done.wait(10)

    assert eventually(lambda: again.stats().evictions == 2)
    assert [os.path.exists(again.paths.path_of(NS, key(i))) for i in range(5)] == [False, False, True, True, True]
    assert again.stats().used_bytes == 3 * file_bytes()


def test_the_start_up_index_merged_in_slices_keeps_the_files_in_age_order(open_tier, monkeypatch):
    """A large directory is merged into the index a slice at a time (the lock is let go between
    slices); the order of age across slices is the order of one merge."""
    monkeypatch.setattr(startup, "_MERGE_SLICE", 2)
    first = open_tier()
    ages = [50, 10, 70, 30, 60, 20, 40]
    for i, age_s in enumerate(ages):
        write(first, key(i))
        os.utime(first.paths.path_of(NS, key(i)), (time.time() - age_s, time.time() - age_s))
    first.close()

    again = open_tier(capacity=len(ages) * file_bytes())
    assert again.scan_done.wait(10)
    assert again.stats().num_entries == len(ages)
    oldest_first = sorted(range(len(ages)), key=lambda i: -ages[i])
    for n, i in enumerate(oldest_first[:4]):
        write(again, key(100 + n))  # each new file evicts the oldest one left
        assert not os.path.exists(again.paths.path_of(NS, key(i))), (n, i)
    assert all(os.path.exists(again.paths.path_of(NS, key(i))) for i in oldest_first[4:])


def test_a_one_byte_key_survives_a_restart_and_a_remove(open_tier):
    short = make_key(b"\x07")
    first = open_tier()
    write(first, short)
    first.close()

    again = open_tier()
    assert again.scan_done.wait(10)
    assert again.stats().files_scanned == 1

    assert again.remove(NS) == 1
    assert not os.path.exists(again.paths.path_of(NS, short))


def test_lookups_work_while_the_start_up_scan_is_still_running(open_tier):
    HeldScan = held_scan()
    first = open_tier()
    write(first, key(1))
    first.close()

    started = time.monotonic()
    again = open_tier(cls=HeldScan)
    assert time.monotonic() - started < 5  # start() did not wait for the scan

    assert not again.scan_done.is_set()
    assert again.contains(NS, key(1))
    assert read(again, key(1)) == payload(key(1))
    assert not again.scan_done.is_set()

    HeldScan.gate.set()
    assert again.scan_done.wait(10)
    assert again.stats().num_entries == 1
    assert again.stats().used_bytes == file_bytes()  # the scan did not count it twice


def make_temp(tier: StorageTier, k: bytes, node: str, pid: int, age_s: float = 0.0) -> Path:
    final = Path(tier.paths.path_of(NS, k))
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.parent / f".{k.hex()}.{node}.{pid}.1.tmp"
    temp.write_bytes(b"half a file")
    if age_s:
        os.utime(temp, (time.time() - age_s, time.time() - age_s))
    return temp


def test_temporaries_of_dead_writers_are_removed_at_start_and_live_ones_kept(open_tier):
    first = open_tier()
    node = first.paths.node
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead_mine = make_temp(first, key(1), node, finished.pid)
    live_mine = make_temp(first, key(2), node, os.getpid())
    fresh_elsewhere = make_temp(first, key(3), "othernode", 12345)
    old_elsewhere = make_temp(first, key(4), "othernode", 12345, age_s=STALE_TEMP_S + 60)
    first.close()

    again = open_tier()
    assert again.scan_done.wait(10)

    assert not dead_mine.exists()
    assert live_mine.exists()
    assert fresh_elsewhere.exists()
    assert not old_elsewhere.exists()
    assert again.stats().temps_removed == 2
    assert again.stats().num_entries == 0  # a temporary is never an entry


def test_entries_removed_while_the_start_up_scan_runs_do_not_come_back(open_tier, monkeypatch):
    walked, gate = threading.Event(), threading.Event()
    merge = startup.merge

    def gated_merge(index, found):
        """The walk has found the files; the merge waits at a gate the test opens."""
        walked.set()
        gate.wait(10)
        merge(index, found)

    first = open_tier()
    assert first.scan_done.wait(10)  # its own scan is not the one held
    for i in range(4):
        write(first, key(i))
        write(first, key(i), ns=OTHER_NS)
    first.close()
    monkeypatch.setattr(startup, "merge", gated_merge)
    with open(first.paths.path_of(NS, key(2)), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff")

    again = open_tier()
    assert walked.wait(10)
    assert read(again, key(2)) is None  # a bad file: removed during the scan
    again.remove(OTHER_NS)  # a whole namespace cleared during the scan
    gate.set()
    assert again.scan_done.wait(10)

    assert [again.contains(NS, key(i)) for i in range(4)] == [True, True, False, True]
    assert not any(again.contains(OTHER_NS, key(i)) for i in range(4))
    assert again.stats().used_bytes == 3 * file_bytes()
