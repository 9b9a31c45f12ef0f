"""Stories about the write-through processes: entry files written by child processes at a lower
priority, a writer that dies, one that cannot start or speaks another protocol, and a server that
dies under them."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from helpers.config import make_storage_config
from helpers.processes import stop
from hpkv.config import StorageConfig
from hpkv.stats import WriteBacklogStats
from hpkv.storage.storage_tier import StorageTier
from hpkv.storage.writer import PROTOCOL_VERSION, Job, WriterPool, WriterProcess, WriterUnavailable
from hpkv.store import write_threads
from test_store import desc, keys, load, open_store, payload, save  # noqa: F401 (a fixture)


def storage(storage_dir: Path, write_nice: int = 10) -> StorageConfig:
    return dataclasses.replace(make_storage_config(storage_dir), write_nice=write_nice)


def read_back(storage_dir: Path, ns: str, ks: list[bytes]) -> list[bytes | None]:
    """What a fresh tier on the same directory reads (header and checksum checked)."""
    tier = StorageTier(make_storage_config(storage_dir))
    out = []
    for k in ks:
        dest = bytearray(len(payload(k)))
        out.append(bytes(dest) if tier.read_into(ns, k, memoryview(dest)) else None)
    tier.close()
    return out


def nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_write_throughs_are_written_by_child_processes_at_the_configured_niceness(open_store, storage_dir):
    store = open_store(storage=storage(storage_dir, write_nice=7))
    ns = store.register(desc())
    ks = keys(12)
    save(store, ns, ks)
    assert store.flush(timeout=20)
    assert read_back(storage_dir, ns, ks) == [payload(k) for k in ks]
    pids = store.writers.pids()
    assert 1 <= len(pids) <= write_threads(store.storage.config.io_threads)
    for pid in pids:
        assert parent_of(pid) == os.getpid() and pid != os.getpid()
        assert nice_of(pid) == max(7, os.getpriority(os.PRIO_PROCESS, 0))
    assert store.stats().writers.processes == len(pids)
    store.close()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()  # closed and reaped with the store


def test_the_jobs_a_dead_writer_did_not_answer_go_to_another_and_nothing_is_lost(open_store, storage_dir):
    store = open_store(storage=storage(storage_dir))
    ns = store.register(desc())
    save(store, ns, keys(4, "warm"))
    assert store.flush(timeout=20)
    for pid in store.writers.pids():
        os.kill(pid, signal.SIGKILL)
    ks = keys(8)
    save(store, ns, ks)
    assert store.flush(timeout=20)
    stats = store.stats()
    assert 1 <= stats.writers.died <= write_threads(store.storage.config.io_threads)
    assert stats.storage.write_failures == 0
    assert read_back(storage_dir, ns, ks) == [payload(k) for k in ks]
    later = keys(6, "later")
    save(store, ns, later)
    assert store.flush(timeout=20)
    assert read_back(storage_dir, ns, later) == [payload(k) for k in later]
    assert store.stats().writers.started == store.stats().writers.died + len(store.writers.pids())


def test_a_directory_removed_under_a_writer_that_holds_it_open_is_made_again(open_store, storage_dir):
    """A write-through process keeps the directories it wrote into open: after `rm -rf` of the
    namespace, the next file for the same directory is not created in the removed one (where
    nobody would find it) but in the directory made again."""
    store = open_store(storage=storage(storage_dir))
    ns = store.register(desc())
    first, other = keys(2)
    second = first[:2] + other[2:]  # the same leaf directory
    save(store, ns, [first])
    assert store.flush(timeout=20)
    shutil.rmtree(storage_dir / ns)

    save(store, ns, [second])
    assert store.flush(timeout=20)

    assert read_back(storage_dir, ns, [second]) == [payload(second)]
    assert store.stats().storage.write_failures == 0


def test_a_batch_the_write_budget_pays_for_in_part_writes_what_it_pays_for(open_store, storage_dir):
    """One write thread takes the four entries of a commit as one batch; the budget pays for three
    of them: those three are written by a writer process, the fourth is refused and counted."""
    from hpkv.storage import format as fmt
    from hpkv.storage.budget import BUDGET_BURST_S

    ks = keys(4)
    file_bytes = fmt.header_bytes(len(ks[0])) + len(payload(ks[0]))
    config = dataclasses.replace(
        make_storage_config(storage_dir, io_threads=1),
        write_budget_bytes=int(3.5 * file_bytes * 86400 / BUDGET_BURST_S),
    )
    store = open_store(storage=config)
    ns = store.register(desc())
    save(store, ns, ks)
    assert store.flush(timeout=20)
    stats = store.stats().storage
    assert (stats.writes, stats.over_budget, stats.write_failures) == (3, 1, 0)
    assert sum(got is not None for got in read_back(storage_dir, ns, ks)) == 3
    assert store.writers.pids()  # written by a process, not in the server


def _pool_file(shm_dir: Path, size: int, fill: bytes = b"") -> int:
    pool_path = shm_dir / "pool"
    with open(pool_path, "wb") as f:
        f.truncate(size)
        f.write(fill)
    return os.open(pool_path, os.O_RDWR)


def test_a_writer_killed_mid_job_leaves_no_temporary_behind_and_another_writes_the_file(shm_dir, storage_dir):
    """A temporary carries the server's pid, so no start-up scan removes it while the server lives:
    the server removes the one a process killed mid-job left, before another process takes the job."""
    from hpkv.storage.fileio import FileTarget

    size = 128 << 20  # long enough to write that the test sees the temporary and kills the writer
    pool_fd = _pool_file(shm_dir, size, b"kv" * 1000)
    writers = WriterPool(pool_fd, 1, nice=0)
    try:
        for attempt in range(5):
            target = FileTarget(
                str(storage_dir / f"{attempt}.kv"), str(storage_dir / f".{attempt}.tmp"), str(storage_dir), mkdir=False
            )
            errors: list[OSError | None] = []
            job = threading.Thread(
                target=lambda errors=errors, target=target: errors.append(
                    writers.write("ab" * 16, b"key", 0, size, target, "off")
                )
            )
            job.start()
            deadline = time.monotonic() + 20
            while not os.path.exists(target.tmp) and job.is_alive() and time.monotonic() < deadline:
                time.sleep(0.0005)
            killed = os.path.exists(target.tmp)
            if killed:
                os.kill(writers.pids()[0], signal.SIGKILL)
            job.join(20)
            assert errors == [None]
            if killed:
                break
        assert killed, "every job finished before the test could kill its writer"
        assert not os.path.exists(target.tmp)
        assert read_back_file(target.final, size)[:2000] == b"kv" * 1000
        assert writers.stats().died == 1 and writers.stats().started == 2
    finally:
        writers.close()
        os.close(pool_fd)


def read_back_file(path: str, payload_bytes: int) -> bytes:
    data = Path(path).read_bytes()
    assert len(data) > payload_bytes
    return data[len(data) - payload_bytes :]


def test_a_job_that_kills_every_writer_fails_after_one_more_try_and_leaves_nothing(shm_dir, storage_dir):
    """The pool file cut short under a writer's mapping: reading the slot kills it (SIGBUS); the
    next process, mapping what is left, refuses the slot."""
    from hpkv.storage.fileio import FileTarget

    pool_fd = _pool_file(shm_dir, 2 << 20)
    writers = WriterPool(pool_fd, 1, nice=0)
    target = FileTarget(str(storage_dir / "k.kv"), str(storage_dir / ".k.tmp"), str(storage_dir), mkdir=False)
    try:
        assert writers.write("ab" * 16, b"key", 0, 4096, target, "off") is None  # started, mapped 2 MiB
        os.ftruncate(pool_fd, 1 << 20)
        ok = FileTarget(str(storage_dir / "ok.kv"), str(storage_dir / ".ok.tmp"), str(storage_dir), mkdir=False)
        bad = FileTarget(str(storage_dir / "b.kv"), str(storage_dir / ".b.tmp"), str(storage_dir), mkdir=False)
        errors = writers.write_many(
            [Job("ab" * 16, b"bad", 1 << 20, 64 << 10, bad), Job("ab" * 16, b"ok", 0, 4096, ok)], "off"
        )
        assert errors[0] is not None and errors[0].errno == errno.EINVAL
        assert errors[1] is None and os.path.exists(ok.final)
        assert not os.path.exists(bad.tmp) and not os.path.exists(bad.final)
        assert writers.stats().died == 1 and writers.stats().started == 2
    finally:
        writers.close()
        os.close(pool_fd)


def test_a_job_whose_temporary_name_is_taken_leaves_that_file_alone(shm_dir, storage_dir):
    """A temporary of the same name that somebody else created (EEXIST: the job created none) is
    not the server's to remove after the failed job."""
    from hpkv.storage.fileio import FileTarget

    pool_path = shm_dir / "pool"
    with open(pool_path, "wb") as f:
        f.truncate(1 << 20)
    target = FileTarget(str(storage_dir / "k.kv"), str(storage_dir / ".k.tmp"), str(storage_dir), mkdir=False)
    Path(target.tmp).write_bytes(b"another writer's half file")
    pool_fd = os.open(pool_path, os.O_RDONLY)
    writers = WriterPool(pool_fd, 1, nice=0)
    try:
        error = writers.write("ab" * 16, b"key", 0, 64 << 10, target, "off")
    finally:
        writers.close()
        os.close(pool_fd)

    assert error is not None and error.errno == errno.EEXIST
    assert Path(target.tmp).read_bytes() == b"another writer's half file"
    assert not os.path.exists(target.final)


def test_a_file_in_the_way_of_a_directory_is_a_failed_write_not_a_crash(open_store, storage_dir):
    store = open_store(storage=storage(storage_dir))
    ns = store.register(desc())
    k = keys(1)[0]
    (storage_dir / ns).mkdir(exist_ok=True)
    (storage_dir / ns / k.hex()[:2]).write_bytes(b"not a directory")
    save(store, ns, [k])
    assert store.flush(timeout=20)
    assert store.stats().storage.write_failures == 1
    assert store.writers is not None and store.writers.pids()  # the writer is fine
    assert load(store, ns, [k]) == [payload(k)]  # from DRAM


def test_when_no_writer_can_start_the_server_writes_in_process(open_store, storage_dir, monkeypatch, caplog):
    monkeypatch.setattr(sys, "executable", "/bin/false")
    store = open_store(storage=storage(storage_dir))
    ns = store.register(desc())
    threads = write_threads(store.storage.config.io_threads)
    ks = keys(threads + 3)
    save(store, ns, ks)
    assert store.flush(timeout=20)
    writers = store.stats().writers
    # Each write thread may have tried once at the same moment; none tries again for a minute.
    assert writers.processes == 0 and 1 <= writers.start_failures <= threads < len(ks)
    assert "exited" in writers.unavailable
    said = [r.getMessage() for r in caplog.records if "run in the server process" in r.getMessage()]
    assert len(said) == writers.start_failures and "another start is tried in 60 s" in said[0]
    assert read_back(storage_dir, ns, ks) == [payload(k) for k in ks]


def test_writers_that_could_not_start_are_tried_again_later(open_store, storage_dir, monkeypatch):
    """A start that failed once (a fork refused under memory pressure, say) does not leave the
    server writing in process for the rest of its life."""
    monkeypatch.setattr(WriterPool, "RETRY_S", 0.5)
    python = sys.executable
    monkeypatch.setattr(sys, "executable", "/bin/false")
    store = open_store(storage=storage(storage_dir))
    ns = store.register(desc())
    first = keys(3)
    save(store, ns, first)
    assert store.flush(timeout=20)
    assert store.stats().writers.processes == 0

    monkeypatch.setattr(sys, "executable", python)
    time.sleep(0.6)
    later = keys(6)[3:]
    save(store, ns, later)
    assert store.flush(timeout=20)

    writers = store.stats().writers
    assert writers.processes >= 1 and writers.unavailable is None
    assert store.writers.pids()
    assert read_back(storage_dir, ns, first + later) == [payload(k) for k in first + later]


def test_a_writer_of_another_protocol_version_is_refused_with_the_reason(shm_dir, tmp_path, monkeypatch):
    impostor = tmp_path / "python"
    impostor.write_text('#!/bin/sh\necho \'{"hello": "hpkv-writer", "version": 99}\'\ncat >/dev/null\n')
    impostor.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(impostor))
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(WriterUnavailable, match=f"expected protocol {PROTOCOL_VERSION}"):
            WriterProcess(read_end, nice=10)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_writers_exit_when_their_server_is_killed(shm_dir, storage_dir):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from helpers.config import make_pool_config, make_storage_config
        from hpkv.store import create_store
        from test_store import desc, keys, save
        store = create_store(make_pool_config({str(shm_dir)!r}, 16 << 20),
                             make_storage_config({str(storage_dir)!r}))
        ns = store.register(desc())
        save(store, ns, keys(8))
        assert store.flush(timeout=20)
        print(*store.writers.pids(), flush=True)
        time.sleep(600)
    """)
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in server.stdout.readline().split()]
        assert pids
        server.kill()
        server.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_running(pid) for pid in pids):
            time.sleep(0.05)
        assert not any(_running(pid) for pid in pids)
    finally:
        server.kill()
        server.wait()


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_entries_waiting_for_their_write_through_are_counted_until_written(open_store, storage_dir):
    """An operator sees a storage device that falls behind: the entries not yet written, which
    pin their DRAM slots, in the stats (and from there in `hpkv status` and the metrics)."""
    store = open_store(storage=storage(storage_dir))
    ns = store.register(desc())
    save(store, ns, keys(write_threads(store.storage.config.io_threads) * 2, "warm"))  # starts every writer
    assert store.flush(timeout=20)
    assert store.stats().write_backlog == WriteBacklogStats(entries=0, bytes=0, limit_bytes=8 << 20, deferred=0)
    pids = store.writers.pids()
    assert len(pids) == write_threads(store.storage.config.io_threads)  # no place left to start another
    for pid in pids:
        stop(pid)  # a storage device that stopped answering
    try:
        ks = keys(6)
        save(store, ns, ks)
        assert not store.flush(timeout=0.5)
        backlog = store.stats().write_backlog
        assert backlog == WriteBacklogStats(
            entries=6, bytes=6 * store.namespaces()[ns].entry_bytes, limit_bytes=8 << 20, deferred=0
        )
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert store.flush(timeout=20)
    assert store.stats().write_backlog.entries == 0
    assert read_back(storage_dir, ns, ks) == [payload(k) for k in ks]


def test_a_storage_device_that_falls_behind_pins_at_most_half_the_pool(open_store, storage_dir):
    """Entries past the backlog limit wait unpinned: the engines' saves still land in DRAM (before,
    a stalled device pinned every slot and every save after that was skipped), and what the pool
    still holds is written once the device answers again."""
    store = open_store(storage=storage(storage_dir))  # 16 MiB: 256 entries of 64 KiB
    ns = store.register(desc())
    entry = store.namespaces()[ns].entry_bytes
    save(store, ns, keys(write_threads(store.storage.config.io_threads) * 2, "warm"))  # starts every writer
    assert store.flush(timeout=20)
    pids = store.writers.pids()
    for pid in pids:
        stop(pid)
    try:
        first = keys(200, "first")
        assert save(store, ns, first) == 200
        backlog = store.stats().write_backlog
        assert backlog.limit_bytes == 8 << 20
        assert backlog.entries == 128 and backlog.bytes == 128 * entry and backlog.deferred == 72
        later = keys(100, "later")  # more than the unpinned rest of the pool
        assert save(store, ns, later) == 100  # 56 before the limit: the rest found every slot pinned
        assert store.dram.counters.reserve_failures == 0
        assert store.stats().write_backlog.entries == 128
        assert not store.flush(timeout=0.3)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert store.flush(timeout=60)
    stats = store.stats()
    assert stats.write_backlog == WriteBacklogStats(entries=0, bytes=0, limit_bytes=8 << 20, deferred=0)
    on_storage = read_back(storage_dir, ns, first + later)
    in_dram = [k in store.dram.index_of(ns) for k in first + later]
    for k, stored, held in zip(first + later, on_storage, in_dram):
        assert stored == payload(k) or (stored is None and not held)  # nothing the pool holds is unwritten
    lost = on_storage.count(None)
    assert stats.store.write_through_deferred == 72 + 100
    assert stats.store.write_through_lost == lost > 0  # deferred entries evicted before their turn
    # Commits go last first: the pinned 128 are the tail of the first prefix, all written.
    assert on_storage[72:200] == [payload(k) for k in first[72:]]


def test_closing_gives_up_the_writes_of_a_storage_device_that_stopped_answering(open_store, storage_dir, caplog):
    """A server that stops waits for its storage writes, but not for ever: once none has ended for
    STALLED_S it gives them up, so the pool file the next server needs is not held for ever."""
    store = open_store(storage=storage(storage_dir))
    store.STALLED_S = 1.0
    ns = store.register(desc())
    save(store, ns, keys(write_threads(store.storage.config.io_threads) * 2, "warm"))  # starts every writer
    assert store.flush(timeout=20)
    pids = store.writers.pids()
    for pid in pids:
        stop(pid)
    ks = keys(6)
    save(store, ns, ks)
    started = time.monotonic()
    store.close()
    assert 1.0 <= time.monotonic() - started < 10.0
    assert not store.region.path.exists()
    assert "storage has finished no write for 1 s: stopping without writing the 6 entries" in caplog.text
    assert read_back(storage_dir, ns, ks) == [None] * 6
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(pid) for pid in pids)  # killed, stopped as they were


def test_entries_cleared_while_deferred_are_not_written(open_store, storage_dir):
    """`hpkv clear` empties the DRAM tier: deferred entries go with it, and are not written when
    the backlog drains (counted as lost); the backlog's own entries are written."""
    store = open_store(storage=storage(storage_dir))  # 16 MiB: a backlog of 128 entries at most
    ns = store.register(desc())
    save(store, ns, keys(write_threads(store.storage.config.io_threads) * 2, "warm"))
    assert store.flush(timeout=20)
    pids = store.writers.pids()
    for pid in pids:
        stop(pid)
    try:
        ks = keys(150)
        assert save(store, ns, ks) == 150
        assert store.stats().write_backlog.deferred == 22
        store.clear(dram=True)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert store.flush(timeout=60)
    on_storage = read_back(storage_dir, ns, ks)
    assert on_storage[:22] == [None] * 22  # the deferred ones (commits go last first)
    assert on_storage[22:] == [payload(k) for k in ks[22:]]  # pinned when cleared: written, then freed
    assert store.counters.write_through_lost == 22
    assert store.stats().dram.num_entries == 0


def test_a_store_closing_while_an_engine_still_commits_writes_what_was_queued_and_stops(open_store, storage_dir):
    """Engines connected to a stopping server may go on saving. What they commit once close()
    has begun is not written (the pool goes with the server), so close() ends even when they save
    faster than storage writes."""
    store = open_store(storage=storage(storage_dir))
    ns = store.register(desc())
    queued = keys(40, "queued")
    save(store, ns, queued)
    stop_saving = threading.Event()

    def saver() -> None:
        i, deadline = 0, time.monotonic() + 30  # if close() waited for it, the test fails, not hangs
        while not stop_saving.is_set() and time.monotonic() < deadline:
            try:
                save(store, ns, keys(8, f"late-{i}"))
            except Exception:  # the store closed under us
                return
            i += 1

    thread = threading.Thread(target=saver, daemon=True)
    thread.start()
    time.sleep(0.2)
    started = time.monotonic()
    try:
        assert store.close() is False  # nothing given up
        assert time.monotonic() - started < 20
    finally:
        stop_saving.set()
        thread.join(10)
    assert read_back(storage_dir, ns, queued) == [payload(k) for k in queued]
