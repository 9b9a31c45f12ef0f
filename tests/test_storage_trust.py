"""Stories of a storage tree that others can write to: links planted for directories, for the
description's temporary, FIFOs and directories named as entry files; a read-only storage
directory; a Register the pool refuses; and what `hpkv doctor` says about who can write the tree.

Every story uses real files, FIFOs, links and mounts; those about a server run a real one.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers.config import make_pool_config, make_storage_config
from helpers.keys import desc, entry_key, fill
from helpers.keys import payload as server_payload
from helpers.server import Node
from helpers.waiting import wait_for
from hpkv.doctor import Verdict, run_checks
from hpkv.errors import PoolError
from hpkv.storage import paths as paths_module
from hpkv.storage.storage_tier import StorageTier
from hpkv.store import create_store

NS = "0123456789abcdef" * 2
OTHER_NS = "fedcba9876543210" * 2
ENTRY = 16 << 10
HPKV_SCRIPT = Path(sys.executable).parent / "hpkv"
NODE = socket.gethostname().replace(".", "_")


def key(i: int | str) -> bytes:
    return entry_key("trust", i)


def payload(k: bytes, size: int = ENTRY) -> bytes:
    return fill(k, size)


def fan(root: Path, ns: str, k: bytes) -> Path:
    """The directory holding (ns, k)'s file."""
    h = k.hex()
    return root / ns / h[:2] / h[2:4]


def keys_in_other_fans(first: bytes, n: int) -> list[bytes]:
    """`n` keys whose files go to directories other than `first`'s."""
    out, i = [], 0
    while len(out) < n:
        k, i = key(f"other-{i}"), i + 1
        if k.hex()[:4] != first.hex()[:4]:
            out.append(k)
    return out


def entry_file_bytes(k: bytes, ns: str = NS) -> bytes:
    """A valid entry file for (ns, k), as a tier elsewhere wrote it."""
    from hpkv.storage import format as fmt

    data = payload(k)
    return fmt.encode_header(bytes.fromhex(ns), k, data) + data


def read(tier: StorageTier, k: bytes, ns: str = NS) -> bytes | None:
    dest = bytearray(ENTRY)
    return bytes(dest) if tier.read_into(ns, k, memoryview(dest)) else None


def read_bounded(tier: StorageTier, k: bytes, fifo: Path | None = None, timeout_s: float = 5.0):
    """`read` on a thread, given `timeout_s`: a read blocked on a FIFO fails the test instead of
    hanging it (the FIFO is then opened for writing and closed, which lets the reader go)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(read(tier, k)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() and fifo is not None:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
    assert result, f"the read of {k.hex()} did not return within {timeout_s} s"
    return result[0]


@pytest.fixture(params=["openat2", "walk"])
def open_tier(request, storage_dir, monkeypatch):
    """Tiers on `storage_dir`; each story runs twice: with the kernel's openat2 resolving paths
    without links, and with the directory-by-directory walk used where it has none."""
    from hpkv.storage import tree

    if request.param == "walk":
        monkeypatch.setattr(tree, "_openat2_works", False)
    elif not tree._openat2_works:
        pytest.skip("this kernel has no openat2")
    tiers = []

    def _open(root: Path = storage_dir, capacity: int | None = 64 * (ENTRY + 4096)) -> StorageTier:
        tier = StorageTier(make_storage_config(root, capacity))
        tiers.append(tier)
        tier.start()
        return tier

    yield _open
    for tier in tiers:
        tier.close()


@pytest.fixture
def elsewhere(tmp_path):
    """Another user's directory, outside the tree."""
    path = tmp_path / "elsewhere"
    path.mkdir()
    return path


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_read_with_direct_io_is_a_miss_and_leaves_direct_io_on(storage_dir, elsewhere, kind):
    """O_DIRECT is refused (EINVAL) for a FIFO or a directory as by a file system without it: a
    planted one must not turn direct I/O off for the whole tier."""
    tier = StorageTier(dataclasses.replace(make_storage_config(storage_dir, 64 * (ENTRY + 4096)), direct_io=True))
    tier.start()
    try:
        if not tier.reader.direct:
            pytest.skip(f"{storage_dir} does not take O_DIRECT")
        k = key("direct")
        slot = mmap.mmap(-1, ENTRY)  # page-aligned, as a pool slot is
        slot[:] = payload(k)
        assert tier.write_from(NS, k, memoryview(slot))
        path = fan(storage_dir, NS, k) / f"{k.hex()}.kv"
        path.unlink()
        plant(kind, path, elsewhere, k)

        done = []
        reader = threading.Thread(target=lambda: done.append(tier.read_into(NS, k, memoryview(slot))), daemon=True)
        reader.start()
        reader.join(5)
        if reader.is_alive():
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(5)
        assert done == [False]
        assert tier.reader.direct and tier.stats().direct_io
        assert tier.stats().untrusted_files == 1
    finally:
        tier.close()


@pytest.fixture
def node(shm_dir, tmp_path):
    node = Node(shm_dir, tmp_path, HPKV_IO_THREADS="2")
    yield node
    node.close()


# -- row 5: links for directories ---------------------------------------------------------------


def test_the_start_up_scan_neither_removes_nor_indexes_through_a_linked_directory(
    open_tier, storage_dir, elsewhere, caplog
):
    k = key(1)
    fan(storage_dir, NS, k).parent.mkdir(parents=True)
    fan(storage_dir, NS, k).symlink_to(elsewhere, target_is_directory=True)  # <ns>/ab/cd -> elsewhere
    dead_temp = elsewhere / f".{k.hex()}.{NODE}.999999999.1.tmp"  # this node's, its writer dead
    old_temp = elsewhere / f".{k.hex()}.othernode.12345.1.tmp"
    for temp in (dead_temp, old_temp):
        temp.write_bytes(b"someone else's file")
    os.utime(old_temp, (time.time() - 2 * 3600,) * 2)
    (elsewhere / f"{k.hex()}.kv").write_bytes(entry_file_bytes(k))
    other = elsewhere / "other-ns"  # <other ns> -> a tree of someone else's
    (fan(other, "", k)).mkdir(parents=True)
    (fan(other, "", k) / f".{k.hex()}.{NODE}.999999999.2.tmp").write_bytes(b"theirs")
    (storage_dir / OTHER_NS).symlink_to(other / "", target_is_directory=True)

    with caplog.at_level("WARNING", logger="hpkv.storage.tier"):
        tier = open_tier()
        assert tier.scan_done.wait(10)

    assert dead_temp.exists() and old_temp.exists()
    assert (fan(other, "", k) / f".{k.hex()}.{NODE}.999999999.2.tmp").exists()
    assert not tier.indexed(NS, k) and tier.stats().num_entries == 0
    assert tier.stats().untrusted_files == 2  # the two links
    assert tier.stats().temps_removed == 0
    said = next(r.getMessage() for r in caplog.records if "storage scan skipped" in r.getMessage())
    assert str(storage_dir) in said and "symbolic link" in said


def hpkv_env(tmp_path: Path, storage_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPKV_")}
    env.update(
        HPKV_SHARE_MEM_FILE_PATH=str(tmp_path / "no-server"),
        HPKV_KV_STORAGE_PATH=str(storage_dir),
        HPKV_CONFIG_FILE_PATH=str(tmp_path / "no-config.ini"),
        HPKV_KV_MEM_POOL_SIZE="64m",
    )
    return env


@pytest.mark.parametrize("only_ns", [False, True])
def test_clear_storage_removes_entry_files_in_the_tree_only(open_tier, storage_dir, elsewhere, tmp_path, only_ns):
    """`hpkv clear --storage` (without a server, so with its own walk) deletes the real entry
    files, and nothing a link in the tree points at: not through a linked fan-out directory, nor
    through a linked namespace directory."""
    tier = open_tier()
    mine = key(1)
    assert tier.write_from(NS, mine, memoryview(payload(mine)))
    planted = keys_in_other_fans(mine, 1)[0]
    fan(storage_dir, NS, planted).parent.mkdir(parents=True, exist_ok=True)
    fan(storage_dir, NS, planted).symlink_to(elsewhere, target_is_directory=True)
    theirs = elsewhere / f"{planted.hex()}.kv"
    theirs.write_bytes(b"another user's file")
    (elsewhere / NS).mkdir()
    (elsewhere / NS / f"{mine.hex()}.kv").write_bytes(b"theirs too")
    (storage_dir / OTHER_NS).symlink_to(elsewhere, target_is_directory=True)
    fan(elsewhere, "", mine).mkdir(parents=True)
    (fan(elsewhere, "", mine) / f"{mine.hex()}.kv").write_bytes(b"and this")
    tier.close()

    args = ["clear", "--storage"] + (["--namespace", NS] if only_ns else [])
    result = subprocess.run(
        [str(HPKV_SCRIPT), *args], env=hpkv_env(tmp_path, storage_dir), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "removed 1 entry files" in result.stdout
    assert not (fan(storage_dir, NS, mine) / f"{mine.hex()}.kv").exists()
    assert theirs.read_bytes() == b"another user's file"
    assert (elsewhere / NS / f"{mine.hex()}.kv").exists()
    assert (fan(elsewhere, "", mine) / f"{mine.hex()}.kv").read_bytes() == b"and this"


def test_eviction_and_a_bad_file_remove_nothing_through_a_linked_directory(open_tier, storage_dir, elsewhere):
    """A fan-out directory swapped for a link after its file was indexed: the read refuses to go
    through it (a miss, counted), and neither removing it as bad nor evicting it unlinks the
    file of that name where the link points."""
    k = key(1)
    tier = open_tier(capacity=2 * (ENTRY + 4096))
    assert tier.scan_done.wait(10)
    assert tier.write_from(NS, k, memoryview(payload(k)))
    real = fan(storage_dir, NS, k)
    real.rename(real.with_name("moved-away"))
    real.symlink_to(elsewhere, target_is_directory=True)
    victim = elsewhere / f"{k.hex()}.kv"
    victim.write_bytes(b"not an HPKV file: removed as bad, were it read")

    assert read(tier, k) is None
    assert victim.exists() and tier.stats().bad_files == 0 and tier.stats().untrusted_files == 1

    tier2 = open_tier(capacity=2 * (ENTRY + 4096))  # k indexed again by a tier that has not read it
    assert tier2.scan_done.wait(10)
    tier2.index.remember(tier2.index.key(NS, k), ENTRY + 4096)
    for other in keys_in_other_fans(k, 3):
        assert tier2.write_from(NS, other, memoryview(payload(other)))
    assert tier2.stats().evictions >= 1 and not tier2.indexed(NS, k)
    assert victim.exists()


def test_writes_go_through_no_planted_directory_link(open_tier, storage_dir, elsewhere, caplog):
    """KV written through a planted link would land where its planter reads it. A link for a
    fan-out directory or for a namespace directory: the write fails (counted, said), and
    nothing is written there."""
    tier = open_tier()
    assert tier.scan_done.wait(10)
    k = key(1)
    fan(storage_dir, NS, k).parent.mkdir(parents=True)
    fan(storage_dir, NS, k).symlink_to(elsewhere, target_is_directory=True)
    (storage_dir / OTHER_NS).symlink_to(elsewhere, target_is_directory=True)

    with caplog.at_level("WARNING", logger="hpkv.storage.tier"):
        assert not tier.write_from(NS, k, memoryview(payload(k)))
        assert not tier.write_from(OTHER_NS, k, memoryview(payload(k)))

    assert list(elsewhere.rglob("*")) == []
    assert tier.stats().write_failures == 2 and tier.stats().untrusted_files == 2
    assert "symbolic link" in caplog.text and "not followed" in caplog.text
    other = keys_in_other_fans(k, 1)[0]
    assert tier.write_from(NS, other, memoryview(payload(other)))  # the rest of the tree works
    assert read(tier, other) == payload(other)


def test_a_server_writes_through_no_planted_directory_link(node, tmp_path):
    """The same with a real server, whose write-through processes write the files: the entry
    stays in DRAM only, nothing lands where the link points, and `hpkv status` counts it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ns, k = desc().ns, entry_key("w", 0)
    fan(node.storage_dir, ns, k).parent.mkdir(parents=True)
    fan(node.storage_dir, ns, k).symlink_to(elsewhere, target_is_directory=True)
    node.start_server()
    agent = node.agent()
    agent.call("register")
    assert agent.call("save", prefix="w", n=3)["committed"] == 3

    def written() -> dict | None:
        stats = agent.call("stats")["stats"]
        done = stats["write_backlog"]["entries"] == 0 and stats["storage"]["writes"] == 2
        return stats if done and stats["storage"]["write_failures"] == 1 else None

    stats = wait_for(written, what="the write-throughs")
    assert list(elsewhere.rglob("*")) == []
    assert stats["storage"]["untrusted_files"] == 1 and stats["writers"]["processes"] >= 1
    status = subprocess.run([str(HPKV_SCRIPT), "status"], env=node.env, capture_output=True, text=True, timeout=60)
    assert "1 names skipped that are not regular files" in " ".join(status.stdout.split()), status.stdout
    agent.exit()


# -- row 6: links at the temporaries' names ----------------------------------------------------------


def test_the_description_is_written_through_no_planted_link(open_tier, storage_dir, tmp_path):
    """Links planted at the next temporary names of namespace.json (and of an entry) must not
    let HPKV truncate what they point at; a link planted as namespace.json itself is replaced by
    the description, its target untouched."""
    tier = open_tier()
    assert tier.scan_done.wait(10)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (storage_dir / NS).mkdir()
    k = key(1)
    fan(storage_dir, NS, k).mkdir(parents=True)
    seq = next(paths_module._TEMP_SEQ)
    for n in range(seq + 1, seq + 20):
        (storage_dir / NS / f".namespace.{NODE}.{os.getpid()}.{n}.tmp").symlink_to(victim)
        (fan(storage_dir, NS, k) / f".{k.hex()}.{NODE}.{os.getpid()}.{n}.tmp").symlink_to(victim)

    tier.add_namespace(NS, '{"test": true}')
    assert not tier.write_from(NS, k, memoryview(payload(k)))

    assert victim.read_text() == "precious"
    assert not (storage_dir / NS / "namespace.json").is_symlink()

    other_victim = tmp_path / "other-victim.txt"
    other_victim.write_text("precious too")
    (storage_dir / OTHER_NS).mkdir()
    (storage_dir / OTHER_NS / "namespace.json").symlink_to(other_victim)

    tier.add_namespace(OTHER_NS, '{"test": 2}')

    assert other_victim.read_text() == "precious too"
    description = storage_dir / OTHER_NS / "namespace.json"
    assert not description.is_symlink() and description.read_text() == '{"test": 2}\n'
    assert stat.S_IMODE(description.stat().st_mode) == 0o600


# -- row 7: FIFOs, directories and links named as entry files ---------------------------------------


def plant(kind: str, path: Path, elsewhere: Path, k: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:  # a link to a valid entry file outside the tree
        (elsewhere / path.name).write_bytes(entry_file_bytes(k))
        path.symlink_to(elsewhere / path.name)


@pytest.mark.parametrize("kind", ["fifo", "directory", "link"])
def test_a_non_regular_entry_is_never_a_hit_nor_a_wedged_read(open_tier, storage_dir, elsewhere, kind):
    """Found by the start-up scan, adopted by a lookup, or swapped in for an indexed file: skipped
    and counted, never indexed, and a read of it returns a miss at once (a FIFO opened for
    reading blocked the I/O thread for ever)."""
    at_scan, at_lookup, swapped = key("scan"), key("lookup"), key("swapped")
    plant(kind, fan(storage_dir, NS, at_scan) / f"{at_scan.hex()}.kv", elsewhere, at_scan)
    tier = open_tier()
    assert tier.scan_done.wait(10)
    assert not tier.indexed(NS, at_scan) and tier.stats().untrusted_files == 1
    assert not tier.contains(NS, at_scan)

    plant(kind, fan(storage_dir, NS, at_lookup) / f"{at_lookup.hex()}.kv", elsewhere, at_lookup)
    assert not tier.contains(NS, at_lookup) and not tier.contains(NS, at_lookup)
    assert tier.stats().untrusted_files == 3 and tier.stats().num_entries == 0

    assert tier.write_from(NS, swapped, memoryview(payload(swapped)))
    path = fan(storage_dir, NS, swapped) / f"{swapped.hex()}.kv"
    path.unlink()
    plant(kind, path, elsewhere, swapped)
    assert read_bounded(tier, swapped, fifo=path if kind == "fifo" else None) is None
    assert not tier.indexed(NS, swapped) and not tier.contains(NS, swapped)
    assert tier.stats().untrusted_files == 4 and tier.stats().bad_files == 0
    assert path.exists() or path.is_symlink()  # not ours to remove: only skipped


def test_fifos_in_the_tree_neither_wedge_the_io_threads_nor_a_stop(node):
    """Two FIFOs named as entry files and two I/O threads: storage hits still come, and SIGTERM
    still stops the server."""
    ns = desc().ns
    real = entry_key("real", 0)
    seed = StorageTier(make_storage_config(node.storage_dir))
    seed.start()
    assert seed.write_from(ns, real, memoryview(server_payload(real)))
    seed.close()
    for i in range(2):
        k = entry_key("fifo", i)
        fifo = fan(node.storage_dir, ns, k) / f"{k.hex()}.kv"
        fifo.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(fifo)

    server = node.start_server()
    agent = node.agent()
    agent.call("register")
    wait_for(lambda: agent.call("stats")["stats"]["storage"]["index_ready"], what="storage index")
    fifo_lookup = agent.call("lookup", prefix="fifo", n=2)["tiers"]
    fifo_load = agent.call("load", prefix="fifo", n=2)  # were they hits, each would hold an I/O thread for ever
    loaded = agent.call("load", prefix="real", n=1)
    stats = agent.call("stats")["stats"]
    agent.exit()
    server.send_signal(signal.SIGTERM)
    try:
        stopped = server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        stopped = None

    log = node.foreground_log(server)[-2000:]
    # Both together: the storage hit became ready, and SIGTERM stopped the server (exit 0).
    assert ((loaded["num_leased"], loaded["num_ready"], loaded["same"]), stopped) == ((1, 1, [True]), 0), log
    assert fifo_lookup == [] and fifo_load["num_leased"] == 0
    assert stats["storage"]["untrusted_files"] >= 2 and stats["reservations"] == 0


# -- row 11: a read-only storage directory -----------------------------------------------------------


def test_a_read_only_storage_directory_leaves_the_server_running_on_dram(node, tmp_path):
    point = node.storage_dir
    point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.strip()}")
    try:
        server = node.start_server()
        agent = node.agent()
        agent.call("register")
        assert agent.call("save", prefix="a", n=2)["committed"] == 2
        loaded = agent.call("load", prefix="a", n=2)
        assert loaded["num_ready"] == 2 and loaded["same"] == [True, True]
        stats = agent.call("stats")["stats"]
        assert stats["storage"] is None and str(point) in stats["storage_unusable"]

        log = node.foreground_log(server)
        said = next(line for line in log.splitlines() if "DRAM tier only" in line)
        assert str(point) in said and "read-only mount" in said and "mount -o remount,rw" in said

        status = subprocess.run([str(HPKV_SCRIPT), "status"], env=node.env, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        row = " ".join(status.stdout.split())
        assert "UNUSABLE, the server runs with the DRAM tier only" in row and "read-only mount" in row

        checks = {c.name: c for c in run_checks(node.env)}
        assert checks["storage directory: permissions"].verdict is Verdict.FAIL
        assert "read-only mount" in checks["storage directory: permissions"].detail
        running = checks["storage: running server"]
        assert running.verdict is Verdict.WARN and "DRAM tier only" in running.detail
        assert str(point) in running.detail and "restart the server" in running.fix
        agent.exit()
    finally:
        node.close()
        subprocess.run(["umount", "-l", str(point)], check=True)


def test_a_storage_path_on_a_pseudo_file_system_still_stops_the_server(shm_dir, tmp_path):
    """A setting that can never work is refused at start, as before, with the error named."""
    with pytest.raises(Exception, match="pseudo file system"):
        create_store(make_pool_config(shm_dir), make_storage_config(Path("/proc/hpkv-storage")))


# -- row 12: a refused Register --------------------------------------------------------------------


def test_a_register_the_server_refuses_writes_nothing(node):
    node.start_server()
    agent = node.agent()
    too_big = 8 << 20  # the 64 MiB pool's slabs hold 2 MiB
    refused = agent.try_call("register", entry_bytes=too_big)
    assert refused["error"] == "ServerError" or "does not fit" in refused.get("message", ""), refused
    assert not (node.storage_dir / desc(0, too_big).ns).exists()
    agent.call("register")
    assert (node.storage_dir / desc().ns / "namespace.json").is_file()


def test_a_refused_register_in_process_writes_nothing(shm_dir, storage_dir):
    with create_store(make_pool_config(shm_dir, 32 << 20), make_storage_config(storage_dir)) as store:
        with pytest.raises(PoolError, match="does not fit"):
            store.register(desc(0, 4 << 20))
        assert not (storage_dir / desc(0, 4 << 20).ns).exists()
        assert desc(0, 4 << 20).ns not in store.namespaces()


# -- doctor: who can write the tree -------------------------------------------------------------------


def test_doctor_warns_when_another_uid_can_write_the_storage_tree(storage_dir, tmp_path):
    from hpkv.doctor import check_storage_writers

    config = make_storage_config(storage_dir)
    storage_dir.chmod(0o700)
    assert check_storage_writers(config).verdict is Verdict.OK

    (storage_dir / NS).mkdir(mode=0o700)
    os.chown(storage_dir / NS, 12345, 12345)
    (storage_dir / OTHER_NS).symlink_to(tmp_path, target_is_directory=True)
    storage_dir.chmod(0o777)

    check = check_storage_writers(config)
    assert check.verdict is Verdict.WARN
    assert f"{storage_dir} (mode 0777) is writable by group" in check.detail and "every user" in check.detail
    assert f"{storage_dir / NS} (mode 0700) is owned by uid 12345" in check.detail
    assert f"{storage_dir / OTHER_NS} is a symbolic link" in check.detail
    assert "plant KV" in check.detail and "checksum" in check.detail
    assert f"chmod -R go-w {storage_dir}" in check.fix

    env = {
        "HPKV_KV_STORAGE_PATH": str(storage_dir),
        "HPKV_SHARE_MEM_FILE_PATH": str(tmp_path / "pool"),
        "HPKV_CONFIG_FILE_PATH": str(tmp_path / "none.ini"),
    }
    names = {c.name: c.verdict for c in run_checks(env)}
    assert names["storage directory: who can write it"] is Verdict.WARN
