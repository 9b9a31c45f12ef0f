"""Stories of a pool directory someone else can write to: nobody takes the pool by its name (the
server passes it as a descriptor to its clients and write-through processes), a directory
another uid could replace names in is refused at start, files planted in it are named, never
followed or waited on, and a directory name that is not UTF-8 works."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.keys import desc, entry_key, payload
from helpers.mappings import pool_mappings
from helpers.server import Node
from helpers.users import NOBODY, as_other_uid
from helpers.waiting import wait_for
from hpkv.config import PoolConfig
from hpkv.doctor import Verdict, check_pool_permissions
from hpkv.errors import PoolError
from hpkv.pool.region import PoolRegion
from hpkv.server import protocol as p
from hpkv.server.autostart import LOG_NAME, ServerUnavailable, ensure_server
from hpkv.server.client import Client

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")


def save(client: Client, ns: str, keys: list[bytes]) -> None:
    res = client.reserve(ns, keys)
    for i, key in enumerate(keys):
        res.view(i)[:] = payload(key)
    assert client.commit(res) == len(keys)


def kv_files(node: Node) -> list[Path]:
    return sorted(node.storage_dir.rglob("*.kv"))


# -- row 1: the write-through processes ---------------------------------------------------------


@as_root
def test_write_throughs_write_the_servers_pool_even_when_its_name_is_swapped(node):
    """Issue 18, row 1. The pool directory becomes writable by others after the server started
    (an operator's chmod; one like it is refused at start). Another user swaps `hpkv.pool` for a
    file of their own before the first write-through: the entry files still hold the engine's KV,
    because the write-through processes map the descriptor the server passes them."""
    node.start_server()
    client = node.client()
    ns = client.register(desc())
    os.chmod(node.shm_dir, 0o777)
    pool_bytes = node.pool_path.stat().st_size

    def swap() -> dict:
        os.rename(node.pool_path, node.shm_dir / "hpkv.pool.theirs")
        with open(node.pool_path, "wb") as f:
            f.write(b"\xa5" * pool_bytes)  # the attacker's KV
        return {"uid": os.getuid()}

    assert as_other_uid(swap) == {"uid": NOBODY}
    keys = [entry_key("victim", i) for i in range(4)]
    save(client, ns, keys)
    wait_for(lambda: len(kv_files(node)) == 4 and client.stats().write_backlog.entries == 0, what="the write-throughs")
    client.clear(dram=True)  # what is read next comes from the entry files

    lease = client.lease(ns, keys)
    assert client.wait(lease, timeout_s=10) == 4
    assert [bytes(lease.view(i)) for i in range(4)] == [payload(key) for key in keys]
    assert all(b"\xa5" * 64 not in path.read_bytes() for path in kv_files(node))


# -- row 2: the clients --------------------------------------------------------------------------


def _file_with_inode(directory: Path, inode: int, size: int, limit: int = 200_000) -> Path | None:
    """A file in `directory` (a fresh tmpfs: inode numbers count up from 2) whose inode number
    is `inode`, or None when that cannot be reached."""
    for i in range(limit):
        path = directory / f"f{i}"
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            st = os.fstat(fd)
            if st.st_ino == inode:
                os.ftruncate(fd, size)
                os.pwrite(fd, b"\xa5" * 4096, 0)
                return path
        finally:
            os.close(fd)
        os.unlink(path)
        if st.st_ino > inode:
            return None
    return None


def mount_tmpfs(point: Path) -> Path:
    point.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=128m,mode=0700", "tmpfs", str(point)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("mounting a tmpfs needs CAP_SYS_ADMIN")
    return point


@pytest.fixture
def two_tmpfs(tmp_path):
    """Two fresh tmpfs mounts: on each, inode numbers count up from 2."""
    mounted = []
    try:
        for name in ("pool-tmpfs", "other-tmpfs"):
            mounted.append(mount_tmpfs(tmp_path / name))
        yield mounted
    finally:
        for point in mounted:
            subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_client_maps_the_servers_pool_whatever_the_name_points_at(tmp_path, two_tmpfs):
    """Issue 18, row 2: `hpkv.pool` replaced by a link to a file on another tmpfs that has the
    same inode number. The client maps the descriptor the server passed: its saves reach the
    server's pool (another engine reads them), and the file the name points at is left alone."""
    pool_tmpfs, other_tmpfs = two_tmpfs
    work = tmp_path / "work"
    work.mkdir()
    node = Node(pool_tmpfs / "pool", work)
    try:
        node.start_server()
        reader = node.agent()  # another engine, attached before the swap
        reader.call("register")
        inode, size = node.pool_path.stat().st_ino, node.pool_path.stat().st_size
        theirs = _file_with_inode(other_tmpfs, inode, size)
        assert theirs is not None, f"no file with inode {inode} on a fresh tmpfs"
        os.rename(node.pool_path, node.shm_dir / "hpkv.pool.real")
        node.pool_path.symlink_to(theirs)
        before = theirs.read_bytes()

        client = node.client()
        client.connect()
        ns = client.register(desc())
        keys = [entry_key("victim", i) for i in range(3)]
        save(client, ns, keys)

        assert reader.call("load", prefix="victim", n=3)["same"] == [True] * 3
        assert theirs.read_bytes() == before  # the attacker read nothing, and wrote nothing into the victim's KV
    finally:
        node.close()


# -- descriptors: never leaked ---------------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_client_reconnecting_keeps_one_mapping_and_leaks_no_descriptor(node):
    """Each Welcome brings a descriptor of the pool; one for a pool this process maps already is
    closed at once, so reconnecting many times costs nothing."""
    node.start_server()
    client = node.client()
    client.connect()
    first = client.region
    fds, maps = open_fds(), pool_mappings(node.shm_dir)

    for _ in range(20):
        client.close()
        client.connect()

    assert client.region is first
    assert (open_fds(), pool_mappings(node.shm_dir)) == (fds, maps)


def test_a_client_across_server_restarts_keeps_only_the_live_pool(node):
    node.start_server()
    client = node.client(retry_interval_s=0.01)
    ns = client.register(desc())
    save(client, ns, [entry_key("gen", 0)])
    fds = open_fds()
    for generation in range(1, 4):
        node.servers[-1].terminate()
        node.servers[-1].wait(30)
        node.start_server()
        wait_for(lambda: _reconnected(client), what="a reconnection")
        save(client, ns, [entry_key("gen", generation)])

    assert open_fds() == fds
    assert pool_mappings(node.shm_dir) == 1


def _reconnected(client: Client) -> bool:
    try:
        client.stats()
        return True
    except ServerUnavailable:
        return False


# -- the pool directory ---------------------------------------------------------------------------


def start_fails(node: Node) -> str:
    """Start a foreground server that must refuse to start: its log."""
    proc = subprocess.run(
        [sys.executable, "-m", "hpkv.server.daemon"], env=node.env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert not node.socket_path.exists() and not node.pool_path.exists()
    return proc.stderr


def test_a_pool_directory_writable_by_others_without_the_sticky_bit_is_refused(node):
    os.chmod(node.shm_dir, 0o777)
    log = start_fails(node)
    assert f"the pool directory {node.shm_dir}" in log and "mode 0777" in log and "uid 0" in log
    assert "without the sticky bit" in log
    assert f"chmod 700 {node.shm_dir}" in log and f"chmod 1777 {node.shm_dir}" in log
    assert "HPKV_SHARE_MEM_FILE_PATH" in log
    doctor = check_pool_permissions(PoolConfig(dir=node.shm_dir, size_bytes=1 << 20))
    assert doctor.verdict is Verdict.FAIL and "mode 0777" in doctor.detail and "chmod 1777" in doctor.fix


@as_root
def test_a_pool_directory_of_another_user_is_refused_by_server_and_engine(node):
    os.chown(node.shm_dir, NOBODY, NOBODY)
    log = start_fails(node)
    assert f"the pool directory {node.shm_dir}" in log and f"uid {NOBODY}" in log and "mode 0700" in log
    assert f"chown 0 {node.shm_dir}" in log and "/dev/shm/hpkv-0" in log

    client = Client(node.shm_dir, "engine", autostart=True, start_timeout_s=10)
    with pytest.raises(ServerUnavailable) as refused:
        client.connect()
    assert f"refusing the pool directory {node.shm_dir}" in str(refused.value)
    assert not (node.shm_dir / p.LOCK_NAME).exists() and node.server_pids() == []  # nothing started
    doctor = check_pool_permissions(PoolConfig(dir=node.shm_dir, size_bytes=1 << 20))
    assert doctor.verdict is Verdict.FAIL and f"uid {NOBODY}" in doctor.detail and "chown" in doctor.fix


@as_root
def test_an_engine_trusts_a_directory_of_a_uid_it_allows(node):
    """HPKV_SERVER_ALLOW_UIDS names a uid whose server the engine uses: its directory is fine."""
    os.chown(node.shm_dir, NOBODY, NOBODY)
    client = Client(node.shm_dir, "engine", autostart=False, trusted_uids=(NOBODY,))
    with pytest.raises(ServerUnavailable) as failed:
        client.connect()
    assert "refusing" not in str(failed.value)  # no server there: that is all


@as_root
def test_a_symbolic_link_of_another_user_as_the_pool_directory_is_refused(node):
    """/dev/shm/hpkv-<uid> made first by another user as a link to this user's own directory: its
    owner could point it elsewhere at any time."""
    shared = node.shm_dir / "shared"
    shared.mkdir()
    os.chmod(node.shm_dir, 0o755)
    os.chmod(shared, 0o1777)
    link = shared / "hpkv-0"
    own = node.shm_dir / "own"
    own.mkdir(mode=0o700)

    def plant() -> dict:
        os.symlink(own, link)
        return {}

    assert as_other_uid(plant) == {}
    with pytest.raises(PoolError, match=f"{link} .*is a symbolic link of uid {NOBODY}"):
        PoolRegion.create(link, 1 << 20)


def test_a_root_owned_0755_mount_serves_roots_engines(shm_dir, tmp_path):
    """The quick start's ramfs at /mnt/hpkv, mounted by root (0755), for an engine run as root."""
    directory = shm_dir / "mnt-hpkv"
    directory.mkdir()
    os.chmod(directory, 0o755)
    node = Node(directory, tmp_path)
    try:
        node.start_server()
        client = node.client()
        ns = client.register(desc())
        save(client, ns, [entry_key("qs", 0)])
        assert len(client.lookup(ns, [entry_key("qs", 0)]).tiers) == 1
    finally:
        node.close()


@as_root
def test_a_root_owned_1777_mount_is_fine_for_every_user(shm_dir):
    """The quick start's ramfs made 1777 for several users: each user's server may create its pool
    there and each user's engine accepts it (the sticky bit keeps every user's files its own)."""
    directory = shm_dir / "mnt-hpkv"
    directory.mkdir()
    os.chmod(directory, 0o1777)
    os.chmod(shm_dir, 0o755)

    def as_a_user() -> dict:
        with PoolRegion.create(directory, 1 << 20) as region:
            owner = os.stat(region.path).st_uid
        try:
            Client(directory, "engine", autostart=False).connect()
        except ServerUnavailable as exc:
            return {"owner": owner, "refused": "refusing" in str(exc)}
        return {"owner": owner, "refused": None}

    assert as_other_uid(as_a_user) == {"owner": NOBODY, "refused": False}  # no server there: that is all


# -- files planted in the pool directory ----------------------------------------------------------


def plant(path: Path, kind: str, target: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to(target)
    else:
        path.mkdir()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
@pytest.mark.parametrize("name", [LOG_NAME, p.LOCK_NAME])
def test_a_lock_or_log_planted_in_the_pool_directory_is_named_never_followed_or_waited_on(
    node, tmp_path, monkeypatch, name, kind
):
    """Issue 18, row 3: a FIFO planted as `server.log` made the auto-start block for ever. Every
    file opened there is O_NOFOLLOW|O_NONBLOCK and checked: a bad one is an error naming it,
    within the start timeout."""
    for key, value in node.env.items():  # a server started anyway would be the node's, and stopped
        if key.startswith("HPKV_"):
            monkeypatch.setenv(key, value)
    target = tmp_path / "precious"
    target.write_text("mine\n")
    path = node.shm_dir / name
    plant(path, kind, target)
    outcome: list = []

    def start() -> None:
        try:
            ensure_server(node.shm_dir, timeout_s=10)
            outcome.append(None)
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(20)
    try:
        assert not thread.is_alive(), f"the auto-start hangs on a {kind} planted as {name}"
        assert isinstance(outcome[0], ServerUnavailable)
        message = str(outcome[0])
        assert str(path) in message or name in message
        assert {"fifo": "a FIFO", "symlink": "a symbolic link", "directory": "a directory"}[kind] in message
        assert "remove it" in message and "HPKV_SHARE_MEM_FILE_PATH" in message
        assert time.monotonic() - started < 10
        assert target.read_text() == "mine\n"
        assert node.server_pids() == []
    finally:
        if kind == "fifo" and thread.is_alive():  # the old code: let its open go
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))


def test_a_fifo_log_with_a_reader_is_refused_too(node, monkeypatch):
    """Someone holding the FIFO's other end open lets a non-blocking open succeed: the check of
    what was opened still refuses it."""
    for key, value in node.env.items():
        if key.startswith("HPKV_"):
            monkeypatch.setenv(key, value)
    path = node.shm_dir / LOG_NAME
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(ServerUnavailable, match="is a FIFO, not a regular file"):
            ensure_server(node.shm_dir, timeout_s=10)
    finally:
        os.close(reader)
    assert node.server_pids() == []


def test_a_socket_name_planted_as_a_link_is_not_connected_through(node, tmp_path):
    elsewhere = Node(tmp_path / "elsewhere-shm", tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    try:
        elsewhere.start_server()
        node.socket_path.symlink_to(elsewhere.socket_path)
        with pytest.raises(ServerUnavailable, match="is a symbolic link, not a socket"):
            node.client().connect()
        assert len(elsewhere.client().stats().clients) == 1  # only the one asking
    finally:
        elsewhere.close()


def test_a_server_refuses_a_socket_name_that_is_not_a_socket(node, tmp_path):
    (tmp_path / "target").write_text("")
    node.socket_path.symlink_to(tmp_path / "target")
    proc = subprocess.run(
        [sys.executable, "-m", "hpkv.server.daemon"], env=node.env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert f"cannot listen on {node.socket_path}: it is a symbolic link, not a socket" in proc.stderr
    assert node.socket_path.is_symlink()


# -- row 10: a directory name that is not UTF-8 -----------------------------------------------------


def test_a_pool_directory_whose_name_is_not_utf8_works(shm_dir, tmp_path):
    """Issue 18, row 10: the server started and every client connection died on a
    UnicodeEncodeError in its Welcome. The path is only a message there now."""
    directory = Path(os.fsdecode(os.fsencode(shm_dir) + b"/pool-\xff\xfe"))
    node = Node(directory, tmp_path)
    try:
        node.start_server()
        client = node.client()
        ns = client.register(desc())
        save(client, ns, [entry_key("bytes", 0)])
        agent = node.agent()
        agent.call("register")
        assert agent.call("load", prefix="bytes", n=1)["same"] == [True]
        stats = client.stats().server
        assert stats.pool_path == os.fsencode(shm_dir).decode() + "/pool-\\xff\\xfe/hpkv.pool"
    finally:
        node.close()


def test_the_fix_for_a_refused_default_directory_does_not_point_back_at_it():
    from hpkv.pool.directory import default_fix

    default = Path(f"/dev/shm/hpkv-{os.geteuid()}")  # another user may make it first: /dev/shm is 1777
    assert "the default" not in default_fix(default) and "root" in default_fix(default)
    assert str(default) in default_fix(Path("/mnt/hpkv"))
