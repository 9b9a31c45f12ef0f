"""Stories about the storage index (`storage/index.py`): packed index values shared by files, files
too large to be ours, and unreadable marks with their expiry."""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

import pytest

from helpers import storage_stories as stories
from helpers.clock import FakeClock
from helpers.storage_stories import NS, OTHER_NS, age, file_bytes, key, write
from hpkv.errors import StorageError
from hpkv.storage.index import MAX_FILE_BYTES, FileIndex, size_of, used_minute_s
from hpkv.storage.marks import UnreadableMarks

open_tier = stories.open_tier


def test_files_found_by_a_scan_or_a_lookup_share_their_index_values(open_tier):
    """The index keeps per file the minute it knew it used, packed with its size: files scanned
    or adopted get the minute they were found in, not their own mtimes, so files of one size
    share one int (10 million mtimes of their own cost 350 MB); the scan's order is still theirs."""
    first = open_tier()
    for i in range(6):
        write(first, key(i))
    age(first, {i: 3600 * (i + 1) for i in range(6)})
    first.close()
    again = open_tier(capacity=9 * file_bytes())
    assert again.scan_done.wait(10)
    other = open_tier()
    for i in range(6, 9):
        write(other, key(i))
    age(other, {i: 3600 * (i + 1) for i in range(6, 9)})

    assert all(again.contains(NS, key(i)) for i in range(6, 9))  # adopted

    values = [value for _, value in again.index.items()]
    assert len(values) == 9 and len({id(v) for v in values}) <= 3  # the scan's minute, the lookups'
    write(again, key(9))
    assert not os.path.exists(again.paths.path_of(NS, key(5)))  # the oldest mtime scanned: the first evicted


def test_a_file_of_a_terabyte_or_more_is_never_indexed(open_tier):
    """An index value keeps a file's size in 40 bits: a larger file (no KV file of ours) is
    neither adopted by a lookup nor found by a scan, and counts for nothing."""
    tier = open_tier()
    assert tier.scan_done.wait(10)  # else its scan may index the file while it is still empty
    huge = Path(tier.paths.path_of(NS, key(1)))
    huge.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(huge, "wb") as f:
            f.truncate(1 << 40)  # sparse
    except OSError as exc:
        pytest.skip(f"cannot make a sparse file of 1 TiB here: {exc}")

    assert not tier.contains(NS, key(1))
    again = open_tier()
    assert again.scan_done.wait(10)
    assert not again.indexed(NS, key(1)) and again.stats().used_bytes == 0


def test_a_full_set_of_unreadable_marks_drops_those_past_their_time_first():
    """Room for four marks: three past their time and one for good (a file this tier is refused).
    A fifth mark drops the three, not the one for good (which would be a hit again)."""
    lock, clock = threading.Lock(), FakeClock()
    marks = UnreadableMarks(lock, clock, max_marks=4)
    with lock:
        for i in range(3):
            marks.mark(b"past%d" % i, 60.0)
        marks.mark(b"refused", math.inf)
        clock.advance(60.0)
        marks.mark(b"new", 60.0)

    assert sorted(marks) == [b"new", b"refused"]


def test_a_mark_holds_until_its_time_then_the_file_may_be_found_again():
    lock, clock = threading.Lock(), FakeClock()
    marks = UnreadableMarks(lock, clock)
    with lock:
        marks.mark(b"eio", 60.0)
        marks.mark(b"refused", math.inf)

    clock.advance(59.0)
    assert marks.is_marked(b"eio") and marks.is_marked(b"refused")
    clock.advance(1.0)
    assert not marks.is_marked(b"eio") and b"eio" not in marks
    assert marks.is_marked(b"refused")
    marks.unmark(b"refused")  # written or read after all
    assert not marks.is_marked(b"refused")


class MarkedAgainWhileAsked(FakeClock):
    """A clock that runs `meanwhile` the next time it is read: a failed read marking the file
    again between a lookup's look at its mark and the drop of it."""

    meanwhile = None

    def __call__(self) -> float:
        hook, self.meanwhile = self.meanwhile, None
        if hook is not None:
            hook()
        return self.now


def test_a_mark_past_its_time_is_not_dropped_once_marked_again():
    """A lookup finds a mark past its time while a failed read marks the file again: the new
    mark stays."""
    lock, clock = threading.Lock(), MarkedAgainWhileAsked()
    marks = UnreadableMarks(lock, clock)
    with lock:
        marks.mark(b"ik", 60.0)
    clock.advance(61.0)

    def marked_again() -> None:
        with lock:
            marks.mark(b"ik", math.inf)

    clock.meanwhile = marked_again

    assert not marks.is_marked(b"ik")  # past its time when looked at

    assert marks.is_marked(b"ik")


def test_an_index_value_holds_a_size_and_a_minute_and_is_shared():
    index = FileIndex("/nowhere")
    value = index.value_of(12345, 3600 * 24 + 59.9)

    assert size_of(value) == 12345 and used_minute_s(value) == 3600 * 24
    assert index.value_of(12345, 3600 * 24 + 1.0) is value  # the same minute: one int object
    assert size_of(index.value_of(MAX_FILE_BYTES, 0.0)) == MAX_FILE_BYTES


def test_remember_forget_and_touch_keep_the_order_and_the_bytes():
    """Written 1, 2, 3; 1 touched: the order is 2, 3, 1; 2 forgotten: 3, 1, and its bytes go."""
    index = FileIndex("/nowhere")
    iks = [index.key(NS, key(i)) for i in range(4)]
    for ik in iks[1:]:
        index.remember(ik, 100)
    index.touch(index.key(NS, b""), [key(1), key(0)])  # key 0 is not indexed: nothing
    index.forget(iks[2])

    assert [ik for ik, _ in index.items()] == [iks[3], iks[1]]
    assert index.used_bytes == 200 and len(index) == 2
    assert index.split(iks[1]) == (NS, key(1))


def test_files_scanned_do_not_come_back_once_forgotten_or_their_namespace_removed():
    index = FileIndex("/nowhere")
    kept, forgotten, other = index.key(NS, key(1)), index.key(NS, key(2)), index.key(OTHER_NS, key(1))
    index.forget(forgotten)  # a bad file read while the scan runs
    index.remove(OTHER_NS)

    assert index.add_scanned([(kept, 10), (forgotten, 10), (other, 10)])
    index.scan_merged()

    assert [ik for ik, _ in index.items()] == [kept] and index.used_bytes == 10


def test_namespace_numbers_no_file_and_no_registration_uses_are_taken_back():
    """Every namespace looked up once takes an index number; once unused (no file indexed, not
    registered, no walk or eviction holding keys) the number is taken back, with the unreadable
    marks of its keys, so that new namespaces never run out (issue 31, row 8: 65,536 namespaces
    looked up once made every later namespace fail until a restart)."""
    index = FileIndex("/root", max_namespaces=8)
    index.scan_merged()
    kept = index.key("with-a-file", b"k")
    index.remember(kept, 100)
    index.numbers.pin("registered")
    registered = index.key("registered", b"k")
    for i in range(6):
        index.key(f"looked-up-once-{i}", b"k")
    index.forget(index.key("looked-up-once-0", b"bad"), unreadable_s=math.inf)
    with index.busy():  # a walk holds keys: nothing is taken back
        with pytest.raises(StorageError, match="all 8 namespace numbers"):
            index.key("new", b"k")

    new = index.key("new", b"k")

    assert index.split(new) == ("new", b"k")
    assert index.split(kept) == ("with-a-file", b"k") and index.split(registered) == ("registered", b"k")
    assert len(index.numbers) <= 3 + 1
    assert not any(True for _ in index.marks)  # the mark of a number taken back went with it
    index.numbers.unpin("registered")
    index.forget(kept)
    for i in range(6):  # both numbers free again
        index.key(f"later-{i}", b"k")


def test_a_hundred_thousand_namespaces_looked_up_once_leave_the_index_its_numbers():
    index = FileIndex("/root")
    index.scan_merged()
    for i in range(100_000):
        index.key(f"{i:032x}", b"")
    assert len(index.numbers) < 20_000  # taken back in batches as new ones come
    ik = index.key("last", b"k")
    index.remember(ik, 1)
    assert index.split(ik) == ("last", b"k")
