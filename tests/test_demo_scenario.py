"""hpkv demo's walk, the parts that need no engine: the KV-files row counts what the
write-through, which runs behind the requests, has written once it is quiet."""

from __future__ import annotations

import threading
import time

from hpkv.demo.scenario import written_files


def test_the_files_row_waits_for_the_write_through_to_be_quiet(tmp_path):
    def write_through() -> None:  # one file every 0.2 s, as a writer behind a long request
        for i in range(6):
            (tmp_path / f"{i}.kv").write_bytes(b"kv")
            time.sleep(0.2)

    writer = threading.Thread(target=write_through)
    writer.start()
    try:
        assert written_files(tmp_path, quiet_s=0.5, timeout_s=10) == 6
    finally:
        writer.join()


def test_the_files_row_gives_up_waiting_after_its_time_out(tmp_path):
    stop = threading.Event()

    def never_quiet() -> None:
        i = 0
        while not stop.is_set():
            (tmp_path / f"{i}.kv").write_bytes(b"kv")
            i += 1
            time.sleep(0.05)

    writer = threading.Thread(target=never_quiet)
    writer.start()
    try:
        started = time.monotonic()
        assert written_files(tmp_path, quiet_s=0.5, timeout_s=1.0) > 0
        assert time.monotonic() - started < 3
    finally:
        stop.set()
        writer.join()
