"""Stories about the shared-memory pool file: one owner creates it, other processes map it; it is
private, exclusive, recovered after a crash, refused when it does not fit, and removed on close."""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.mappings import resident_bytes
from helpers.swap import with_swap_configured
from helpers.users import NOBODY, as_other_uid
from hpkv.errors import PoolError
from hpkv.pool.backing import swap_needs_lock
from hpkv.pool.region import POOL_FILE_NAME, PoolRegion

MiB = 1 << 20
SPAWN = multiprocessing.get_context("spawn")


def attach_by_name(path: Path) -> PoolRegion:
    """What a server's client gets, made here from the name: a descriptor of the pool file."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    return PoolRegion.attach(fd, os.fstat(fd).st_size, path)


# -- what the other processes run (module level, so that spawned children can import them) ------


def _own_pool(directory: str, size_bytes: int, ready, stop) -> None:
    region = PoolRegion.create(Path(directory), size_bytes)
    ready.put(str(region.path))
    stop.wait(30)
    region.close()


def _client(path: str, write_at: int | None, data: bytes, read_at: int | None, num_bytes: int, out) -> None:
    region = attach_by_name(Path(path))
    if write_at is not None:
        region.buf[write_at : write_at + len(data)] = data
    if read_at is not None:
        out.put(bytes(region.view(read_at, num_bytes)))
    region.close()


def run_client(
    path: Path, write_at: int | None = None, data: bytes = b"", read_at: int | None = None, num_bytes: int = 0
) -> bytes | None:
    out = SPAWN.Queue()
    proc = SPAWN.Process(target=_client, args=(str(path), write_at, data, read_at, num_bytes, out))
    proc.start()
    got = out.get(timeout=30) if read_at is not None else None
    proc.join(30)
    assert proc.exitcode == 0
    return got


class OwnerProcess:
    """A child process that owns a pool until told to stop (or killed)."""

    def __init__(self, directory: Path, size_bytes: int) -> None:
        self._ready, self._stop = SPAWN.Queue(), SPAWN.Event()
        self.proc = SPAWN.Process(target=_own_pool, args=(str(directory), size_bytes, self._ready, self._stop))
        self.proc.start()
        self.path = Path(self._ready.get(timeout=30))

    def stop(self) -> None:
        self._stop.set()
        self.proc.join(30)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(30)


def _raised_as(uid: int, fn) -> tuple[str, str]:
    """Run `fn` as `uid` (a forked child): the type and message of what it raised (empty if nothing)."""
    seen = as_other_uid(lambda: fn() and None, uid) or {}
    return seen.get("raised", ""), seen.get("message", "")


@pytest.fixture
def owner_process():
    owners = []

    def start(directory: Path, size_bytes: int = 4 * MiB) -> OwnerProcess:
        owners.append(OwnerProcess(directory, size_bytes))
        return owners[-1]

    yield start
    for owner in owners:
        if owner.proc.is_alive():
            owner.kill()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 8 MiB tmpfs, mounted for the test and unmounted afterwards."""
    point = tmp_path / "tmpfs-8m"
    point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {result.stderr.strip()}")
    yield point
    subprocess.run(["umount", "-l", str(point)], check=True)


@pytest.fixture
def regions():
    opened = []

    def track(region: PoolRegion) -> PoolRegion:
        opened.append(region)
        return region

    yield track
    for region in reversed(opened):
        region.close()


# -- stories -----------------------------------------------------------------------------------


def test_a_pool_created_by_one_process_is_shared_by_two_others(shm_dir, owner_process):
    owner = owner_process(shm_dir)
    from_b, from_c = os.urandom(5000), os.urandom(3000)

    run_client(owner.path, write_at=4096, data=from_b)  # process B writes
    seen_by_c = run_client(
        owner.path,
        read_at=4096,
        num_bytes=5000,  # process C reads, then writes
        write_at=MiB + 8192,
        data=from_c,
    )
    seen_by_b = run_client(owner.path, read_at=MiB + 8192, num_bytes=3000)  # and B reads that

    assert seen_by_c == from_b
    assert seen_by_b == from_c
    owner.stop()
    assert owner.proc.exitcode == 0
    assert not owner.path.exists()  # the owner removed it on close


def test_a_second_create_while_the_owner_process_lives_is_refused(shm_dir, owner_process):
    owner = owner_process(shm_dir)
    inode = os.stat(owner.path).st_ino

    with pytest.raises(PoolError) as caught:
        PoolRegion.create(shm_dir, 4 * MiB)

    message = str(caught.value)
    assert str(owner.path) in message
    assert "owned by a running HPKV process" in message
    assert "stop it" in message and "HPKV_SHARE_MEM_FILE_PATH" in message
    assert os.stat(owner.path).st_ino == inode  # the live owner's file is untouched


def test_a_pool_file_another_user_left_is_refused_with_its_owner_named(shm_dir):
    """A shared pool directory (a world-writable ramfs with the sticky bit) holds a pool file
    that this uid may not open: a PoolError naming the file, its owner and the fix, not a
    traceback, and the file is left alone."""
    left = shm_dir / POOL_FILE_NAME
    left.write_bytes(b"")
    if os.geteuid() == 0:  # root opens anything: the server that finds the file runs as nobody
        shm_dir.chmod(0o1777)
        left.chmod(0o600)
        raised = _raised_as(NOBODY, lambda: PoolRegion.create(shm_dir, 2 * MiB))
    else:
        left.chmod(0)  # as good as another user's, to this uid
        with pytest.raises(Exception) as caught:
            PoolRegion.create(shm_dir, 2 * MiB)
        raised = (type(caught.value).__name__, str(caught.value))

    kind, message = raised
    assert kind == "PoolError"
    assert str(left) in message and f"uid {left.stat().st_uid}" in message
    assert "HPKV_SHARE_MEM_FILE_PATH" in message
    assert left.exists()


def test_a_second_create_in_the_same_process_is_refused_too(shm_dir, regions):
    regions(PoolRegion.create(shm_dir, 2 * MiB))

    with pytest.raises(PoolError, match="owned by a running HPKV process"):
        PoolRegion.create(shm_dir, 2 * MiB)


def test_the_pool_file_is_readable_and_writable_by_its_user_only(shm_dir, regions):
    region = regions(PoolRegion.create(shm_dir, 2 * MiB))

    assert region.path == shm_dir / POOL_FILE_NAME
    assert stat.S_IMODE(os.stat(region.path).st_mode) == 0o600


def test_the_pool_file_has_its_full_size_reserved_up_front(shm_dir, regions):
    region = regions(PoolRegion.create(shm_dir, 4 * MiB))

    st = os.stat(region.path)
    assert st.st_size == 4 * MiB
    assert st.st_blocks * 512 >= 4 * MiB  # fallocate, not a sparse file


def test_a_file_left_by_a_killed_owner_is_recovered_as_stale(shm_dir, owner_process, regions, caplog):
    dead = owner_process(shm_dir)
    dead.kill()
    assert dead.path.exists()
    stale_inode = os.stat(dead.path).st_ino

    with caplog.at_level(logging.WARNING, logger="hpkv.pool.region"):
        region = regions(PoolRegion.create(shm_dir, 4 * MiB))

    assert region.path == dead.path
    assert region.inode != stale_inode
    assert any("stale pool file" in r.getMessage() and str(dead.path) in r.getMessage() for r in caplog.records)


def test_a_stale_file_does_not_count_against_the_free_space(small_tmpfs, owner_process, regions):
    # After a crash the old pool still fills most of the mount; the new one must fit in its place.
    dead = owner_process(small_tmpfs, 6 * MiB)
    dead.kill()

    region = regions(PoolRegion.create(small_tmpfs, 6 * MiB))

    assert region.size_bytes == 6 * MiB


def test_a_pool_larger_than_the_mount_names_path_size_and_free_space(small_tmpfs):
    with pytest.raises(PoolError) as caught:
        PoolRegion.create(small_tmpfs, 16 * MiB)

    message = str(caught.value)
    assert str(small_tmpfs) in message
    assert "16.0 MiB" in message  # asked
    assert "8.0 MiB is free" in message
    assert "HPKV_KV_MEM_POOL_SIZE" in message
    assert not (small_tmpfs / POOL_FILE_NAME).exists()


def test_a_pool_that_fits_the_mount_exactly_is_created(small_tmpfs, regions):
    region = regions(PoolRegion.create(small_tmpfs, 8 * MiB))

    assert os.stat(region.path).st_blocks * 512 >= 8 * MiB


def test_a_pool_directory_on_disk_logs_the_risk(tmp_path, regions, caplog):
    directory = tmp_path / "pool-on-disk"

    with caplog.at_level(logging.WARNING, logger="hpkv.pool.region"):
        regions(PoolRegion.create(directory, 2 * MiB))

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(directory) in w and "not ramfs/tmpfs" in w and "written back to disk" in w for w in warnings), (
        warnings
    )


def test_a_pool_directory_on_tmpfs_logs_no_warning(shm_dir, regions, caplog):
    with caplog.at_level(logging.WARNING, logger="hpkv.pool.region"):
        regions(PoolRegion.create(shm_dir, 2 * MiB))

    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_tmpfs_whose_mount_point_has_a_space_and_an_accent_is_known_as_tmpfs(tmp_path, regions, caplog):
    point = tmp_path / "pool dir é"
    point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(point)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs (needs root)")
    try:
        with caplog.at_level(logging.WARNING, logger="hpkv.pool.region"):
            region = PoolRegion.create(point, 2 * MiB)
        region.close()
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True)

    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_on_tmpfs_the_pool_is_locked_in_memory_or_says_why_not(shm_dir, regions, caplog):
    with caplog.at_level(logging.WARNING, logger="hpkv.pool.region"):
        region = regions(PoolRegion.create(shm_dir, 4 * MiB))

    if os.geteuid() == 0:
        assert region.locked_in_memory
    elif not region.locked_in_memory:
        assert any("RLIMIT_MEMLOCK" in r.getMessage() for r in caplog.records)


LOCK_WITHOUT_PRIVILEGE = """
import logging, resource, sys
from pathlib import Path
from hpkv.pool.region import PoolRegion
logging.basicConfig(stream=sys.stdout, format="%(levelname)s %(message)s")
resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))
region = PoolRegion.create(Path(sys.argv[1]), 4 << 20)
print("locked_in_memory", region.locked_in_memory)
region.close()
"""


def test_without_the_right_to_lock_memory_the_pool_warns_and_goes_on(shm_dir, tmp_path):
    # A process without CAP_IPC_LOCK and with a 64 KiB memlock limit, as in many containers.
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop CAP_IPC_LOCK")
    command = ["setpriv", "--bounding-set=-ipc_lock", sys.executable, "-c", LOCK_WITHOUT_PRIVILEGE, str(shm_dir)]
    if swap_needs_lock("tmpfs") is not None:  # nothing to lock where no swap is configured: show one
        result = with_swap_configured(tmp_path, *command)
    else:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)

    assert result.returncode == 0, result.stderr
    assert "locked_in_memory False" in result.stdout
    assert "WARNING cannot lock the 4.0 MiB pool in memory" in result.stdout
    assert "RLIMIT_MEMLOCK is 64.0 KiB" in result.stdout and "ulimit -l unlimited" in result.stdout
    assert not (shm_dir / POOL_FILE_NAME).exists()


def test_close_by_the_owner_removes_the_file_but_an_attached_map_stays_valid(shm_dir, regions):
    owner = regions(PoolRegion.create(shm_dir, 2 * MiB))
    client = regions(attach_by_name(owner.path))
    owner.buf[0:5] = b"hello"

    owner.close()

    assert not owner.path.exists()
    assert bytes(client.view(0, 5)) == b"hello"


def test_close_by_a_client_keeps_the_file(shm_dir, regions):
    owner = regions(PoolRegion.create(shm_dir, 2 * MiB))
    client = attach_by_name(owner.path)

    client.close()
    client.close()  # twice is harmless

    assert owner.path.exists()
    assert client.size_bytes == 2 * MiB


def test_close_with_a_view_still_held_removes_the_file(shm_dir, regions):
    owner = regions(PoolRegion.create(shm_dir, 2 * MiB))
    view = owner.view(4096, 4096)

    owner.close()

    assert not owner.path.exists()
    view.release()


def test_attaching_a_descriptor_that_is_not_a_regular_file_is_a_pool_error(shm_dir):
    read_end, write_end = os.pipe()
    fds_before = len(os.listdir("/proc/self/fd"))

    with pytest.raises(PoolError, match="is a FIFO, not the pool of 1048576 bytes"):
        PoolRegion.attach(read_end, MiB, shm_dir / POOL_FILE_NAME)

    assert len(os.listdir("/proc/self/fd")) == fds_before - 1  # taken, and closed
    os.close(write_end)


def test_attaching_a_pool_file_not_of_the_announced_size_is_a_pool_error(shm_dir):
    # What a client would see of a file swapped in (or of an owner between create and fallocate).
    path = shm_dir / POOL_FILE_NAME
    path.touch()
    fd = os.open(path, os.O_RDWR)
    fds_before = len(os.listdir("/proc/self/fd"))

    with pytest.raises(PoolError, match=f"{path} is a file of 0 bytes"):
        PoolRegion.attach(fd, MiB, path)

    assert len(os.listdir("/proc/self/fd")) == fds_before - 1  # no descriptor left open


def test_a_pool_under_one_mebibyte_is_refused():
    with pytest.raises(PoolError, match="at least 1m"):
        PoolRegion.create(Path("/dev/shm/never-created"), MiB - 1)
    assert not Path("/dev/shm/never-created").exists()


def test_a_missing_pool_directory_is_created_private(shm_dir, regions):
    directory = shm_dir / "a" / "b"

    regions(PoolRegion.create(directory, 2 * MiB))

    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_a_prefaulted_attachment_has_every_pool_page_mapped(shm_dir, regions):
    owner = regions(PoolRegion.create(shm_dir, 32 * MiB))
    attached = regions(attach_by_name(owner.path))

    before = resident_bytes(attached)
    attached._populate()  # what prefault() runs in its thread
    after = resident_bytes(attached)

    assert after - before >= 31 * MiB
    data = os.urandom(4096)
    attached.buf[7 * MiB : 7 * MiB + 4096] = data  # still the same shared file
    assert bytes(owner.buf[7 * MiB : 7 * MiB + 4096]) == data


def test_a_pool_above_a_container_s_limit_is_created_with_a_warning(tmp_path, monkeypatch, regions, caplog):
    """On ramfs the pool is checked against MemAvailable, as before; what the container's cgroup
    has left (an estimate that moves with its page cache) only warns, naming the limit."""
    from helpers.machine import GIB, pretend

    point = tmp_path / "ram"
    pretend(monkeypatch, tmp_path, 64 * GIB, ramfs=(point,), cgroup="/ctr", limits={"/ctr": (str(GIB), GIB, 0)})

    with caplog.at_level(logging.WARNING, logger="hpkv.pool.region"):
        region = regions(PoolRegion.create(point / "pool", 2 * MiB))

    assert region.size_bytes == 2 * MiB
    assert any("container's memory limit" in r.getMessage() for r in caplog.records)
