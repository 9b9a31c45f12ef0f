"""Stories about `hpkv doctor`: a healthy node, a pool that cannot fit, a bad setting, a dead server."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from helpers.cli import hpkv, hpkv_env
from helpers.stats import stats_from
from hpkv.config import PoolConfig, StorageConfig
from hpkv.doctor import (
    Check,
    ServerProbe,
    Verdict,
    check_hash_seed,
    check_memlock,
    check_pool_fs,
    check_pool_pages,
    check_pool_permissions,
    check_pool_space,
    check_socket_path,
    check_storage,
    check_storage_permissions,
    check_storage_space,
    check_write_backlog,
    run_checks,
)
from hpkv.fsinfo import mount_of


def by_name(checks: list[dict]) -> dict[str, dict]:
    return {c["name"]: c for c in checks}


def doctor_json(env: dict[str, str]) -> tuple[int, dict[str, dict]]:
    result = hpkv(env, "doctor", "--json")
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, by_name(json.loads(result.stdout)["checks"])


def test_doctor_reports_the_running_server_and_exits_0(server, env):
    code, checks = doctor_json(env)
    assert code == 0
    assert "storage directory: shared by nodes" not in checks  # a local directory: no network checks
    s = checks["server"]
    assert s["verdict"] == "ok"
    assert f"pid {server.proc.pid}" in s["detail"] and "managed" in s["detail"]
    assert checks["pool directory: file system"]["verdict"] == "ok"  # /dev/shm is tmpfs
    assert checks["pool directory: free space"]["verdict"] == "ok"
    assert checks["memlock"]["verdict"] == "ok"
    assert checks["storage directory: permissions"]["verdict"] in ("ok", "warn")  # warn: its mode
    backlog = checks["storage: write backlog"]
    assert backlog["verdict"] == "ok" and backlog["detail"].startswith("0 entries (0 B, 0% of the pool)")
    assert "hash stability" in checks


def test_doctor_table_names_every_check_and_counts_verdicts(server, env):
    result = hpkv(env, "doctor")
    assert result.returncode == 0, result.stderr
    for name in ("pool directory: free space", "memlock", "storage directory: file system", "server", "hash stability"):
        assert name in result.stdout
    assert "0 fail" in result.stdout


def test_doctor_without_a_server_says_auto_start_will_start_one(env, pool_dir):
    code, checks = doctor_json(env)
    assert code == 0
    assert checks["server"]["verdict"] == "info"
    assert "auto-start" in checks["server"]["detail"]
    assert not (pool_dir / "hpkv.sock").exists()  # doctor never starts a server


def test_doctor_warns_about_the_socket_of_a_killed_server(env, pool_dir):
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(pool_dir / "hpkv.sock"))
    stale.close()
    code, checks = doctor_json(env)
    assert code == 0
    assert checks["server"]["verdict"] == "warn"
    assert "next one removes the stale socket" in checks["server"]["fix"]


def mount_tmpfs(mount_point: Path, options: str, fs_type: str = "tmpfs"):
    """A real tmpfs (or other memory file system) at mount_point (needs root; the test is
    skipped without it)."""
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", fs_type, "-o", options, fs_type, str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 8 MiB tmpfs."""
    yield from mount_tmpfs(tmp_path / "small-tmpfs", "size=8m,mode=0700")


@pytest.fixture(params=["never", "within_size", "advise"])
def huge_tmpfs(tmp_path, request):
    mounted = mount_tmpfs(tmp_path / "huge-tmpfs", f"size=8m,mode=0700,huge={request.param}")
    yield request.param, next(mounted)
    mounted.close()  # unmounts


def test_the_pool_page_size_is_read_from_the_tmpfs_mount_options(huge_tmpfs):
    """A tmpfs mounted huge=within_size (or always) gives the pool 2 MiB pages; huge=never (the
    default) or advise leave it on 4 KiB pages, with the mount command as the fix."""
    policy, mount_point = huge_tmpfs
    pool = PoolConfig(dir=mount_point / "hpkv", size_bytes=1 << 20, prefault=True)
    assert mount_of(pool.dir).huge_pages == policy

    check = check_pool_pages(pool)

    if policy == "within_size":
        assert check.verdict is Verdict.OK and "huge=within_size" in check.detail
    else:
        assert check.verdict is Verdict.INFO and f"huge={policy}" in check.detail and "4 KiB" in check.detail
        assert f"huge=within_size,mode=0700 tmpfs {pool.dir}" in check.fix


def test_a_pool_on_ramfs_has_no_huge_pages_to_ask_for(tmp_path):
    for mount_point in mount_tmpfs(tmp_path / "ramfs", "mode=0700", fs_type="ramfs"):
        check = check_pool_pages(PoolConfig(dir=mount_point / "pool", size_bytes=1 << 20, prefault=True))
        assert mount_of(mount_point).fs_type == "ramfs" and mount_of(mount_point).huge_pages is None
        assert check.verdict is Verdict.INFO and "only a tmpfs" in check.detail


def test_doctor_fails_a_pool_larger_than_its_tmpfs_with_a_fix(small_tmpfs, tmp_path):
    env = hpkv_env(small_tmpfs, tmp_path / "storage", tmp_path, HPKV_KV_MEM_POOL_SIZE="64m")
    code, checks = doctor_json(env)
    assert code == 1
    space = checks["pool directory: free space"]
    assert space["verdict"] == "fail"
    assert "64.0 MiB" in space["detail"] and "8.0 MiB" in space["detail"]
    assert "lower HPKV_KV_MEM_POOL_SIZE" in space["fix"] and str(small_tmpfs) in space["fix"]
    table = hpkv(env, "doctor")
    assert table.returncode == 1 and "1 fail" in table.stdout


def test_doctor_reports_a_bad_setting_as_a_failed_check(pool_dir, tmp_path):
    code, checks = doctor_json(hpkv_env(pool_dir, tmp_path / "storage", tmp_path, HPKV_KV_MEM_POOL_SIZE="lots"))
    assert code == 1
    assert checks["config"]["verdict"] == "fail"
    assert "HPKV_KV_MEM_POOL_SIZE" in checks["config"]["detail"]


def test_doctor_fails_a_storage_path_that_is_a_file(pool_dir, tmp_path):
    (tmp_path / "a-file").write_text("")
    code, checks = doctor_json(hpkv_env(pool_dir, tmp_path / "a-file", tmp_path))
    assert code == 1
    assert checks["storage directory: permissions"]["verdict"] == "fail"


# -- single checks, in process ---------------------------------------------------------------------


def test_a_storage_directory_others_can_read_is_a_warning(tmp_path):
    storage = tmp_path / "storage"
    storage.mkdir()
    os.chmod(storage, 0o755)
    config = StorageConfig(path=storage, enabled=True, capacity_bytes=None, fsync="off", io_threads=1)
    check = check_storage_permissions(config)
    assert check.verdict is Verdict.WARN and "prompts" in check.detail and "chmod 700" in check.fix
    os.chmod(storage, 0o700)
    assert check_storage_permissions(config).verdict is Verdict.OK


def test_a_pool_directory_others_can_read_gets_a_chmod_fix(tmp_path):
    directory = tmp_path / "pool"
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)
    check = check_pool_permissions(PoolConfig(dir=directory, size_bytes=1 << 20))
    assert check.verdict is Verdict.WARN
    assert "0755" in check.detail and check.fix == f"chmod 700 {directory}"


def test_storage_and_pool_on_kernel_pseudo_file_systems_fail_with_a_fix(tmp_path):
    storage = StorageConfig(
        path=Path("/proc/hpkv-storage"), enabled=True, capacity_bytes=None, fsync="off", io_threads=1
    )
    checks = {c.name: c for c in check_storage(storage, ServerProbe(tmp_path / "no.sock"))}
    fs = checks["storage directory: file system"]
    assert fs.verdict is Verdict.FAIL and "on proc" in fs.detail and "pseudo file system" in fs.detail
    assert "HPKV_KV_STORAGE_PATH" in fs.fix
    assert "storage directory: free space" not in checks  # nothing to size there
    pool = check_pool_fs(PoolConfig(dir=Path("/sys/hpkv"), size_bytes=1 << 20))
    assert pool.verdict is Verdict.FAIL and "on sysfs" in pool.detail and "HPKV_SHARE_MEM_FILE_PATH" in pool.fix


def test_a_path_below_a_file_is_named_as_such(tmp_path):
    (tmp_path / "a-file").write_text("")
    below = tmp_path / "a-file" / "x"
    storage = check_storage_permissions(
        StorageConfig(path=below, enabled=True, capacity_bytes=None, fsync="off", io_threads=1)
    )
    pool = check_pool_permissions(PoolConfig(dir=below, size_bytes=1 << 20))
    for check in (storage, pool):
        assert check.verdict is Verdict.FAIL
        assert f"{tmp_path / 'a-file'} is a file, not a directory" in check.detail


def test_an_automatic_capacity_with_little_free_space_is_a_warning(small_tmpfs, tmp_path):
    storage = StorageConfig(path=small_tmpfs / "kv", enabled=True, capacity_bytes=None, fsync="off", io_threads=1)
    probe = ServerProbe(tmp_path / "no.sock")
    space = {c.name: c for c in check_storage(storage, probe)}["storage directory: free space"]
    assert space.verdict is Verdict.WARN
    assert "6.4 MiB" in space.detail and "8.0 MiB free" in space.detail  # 80% of an empty 8 MiB tmpfs
    assert "HPKV_KV_STORAGE_SIZE" in space.fix
    running = ServerProbe(
        tmp_path / "no.sock", stats=stats_from({"storage": {"used_bytes": 0, "capacity_bytes": 3 << 30}})
    )
    space = {c.name: c for c in check_storage(storage, running)}["storage directory: free space"]
    assert space.verdict is Verdict.OK and "the running server sized the tier to 3.0 GiB" in space.detail


def test_an_automatic_capacity_on_ramfs_is_a_share_of_half_the_memory_available(tmp_path):
    """A ramfs says 0 free (it has no size): the storage tier there takes 80% of half the
    memory available, as a default tmpfs may take half the RAM, and doctor says so."""
    for mount_point in mount_tmpfs(tmp_path / "ramfs", "mode=0700", fs_type="ramfs"):
        storage = StorageConfig(
            path=mount_point / "storage", enabled=True, capacity_bytes=None, fsync="off", io_threads=1
        )
        space = {c.name: c for c in check_storage(storage, ServerProbe(tmp_path / "no.sock"))}[
            "storage directory: free space"
        ]
        assert space.verdict is Verdict.OK, space
        assert "half the memory available" in space.detail and "a ramfs has no size of its own" in space.detail
        sized = StorageConfig(
            path=mount_point / "storage", enabled=True, capacity_bytes=1 << 50, fsync="off", io_threads=1
        )
        too_big = check_storage_space(sized, ServerProbe(tmp_path / "no.sock"))
        assert too_big.verdict is Verdict.WARN and "memory the engines and the pool need" in too_big.detail


def test_on_ramfs_beside_the_pool_a_server_starting_now_leaves_the_pool_its_memory(tmp_path, monkeypatch):
    """Storage and a 2 GiB pool on one ramfs, 8 GiB available (in a container: what its cgroup
    leaves): a server starting now takes the pool's memory first, and the tier half of the rest."""
    from helpers.machine import GIB, pretend

    point = tmp_path / "ram"
    pretend(
        monkeypatch, tmp_path, 64 * GIB, ramfs=(point,), cgroup="/ctr", limits={"/ctr": (str(10 * GIB), 2 * GIB, 0)}
    )
    storage = StorageConfig(path=point / "storage", enabled=True, capacity_bytes=None, fsync="off", io_threads=1)
    pool = PoolConfig(dir=point / "pool", size_bytes=2 * GIB)

    space = {c.name: c for c in check_storage(storage, ServerProbe(tmp_path / "no.sock"), pool)}[
        "storage directory: free space"
    ]

    assert "sizes the tier to 2.4 GiB" in space.detail, space.detail
    assert "3.0 GiB of room (half the memory available, less the 2.0 GiB DRAM pool" in space.detail
    running = ServerProbe(
        tmp_path / "no.sock", stats=stats_from({"storage": {"used_bytes": 0, "capacity_bytes": 2 << 30}})
    )
    space = check_storage_space(storage, running, pool)  # its pool is there: in the memory available already
    assert "4.0 GiB of room (half the memory available:" in space.detail, space.detail


def test_a_write_backlog_holding_much_of_the_pool_is_a_warning(tmp_path):
    parts = {
        "dram": {"capacity_bytes": 64 << 20},
        "write_backlog": {"entries": 32, "bytes": 32 << 20, "limit_bytes": 32 << 20, "deferred": 0},
    }
    behind = check_write_backlog(stats_from(parts))
    assert behind.verdict is Verdict.WARN
    assert "32 entries (32.0 MiB, 50% of the pool)" in behind.detail and "unpinned" not in behind.detail
    assert "When storage does not keep up" in behind.fix
    parts["write_backlog"]["deferred"] = 12
    assert "and 12 more wait unpinned" in check_write_backlog(stats_from(parts)).detail
    parts["write_backlog"] = {"entries": 3, "bytes": 3 << 20, "limit_bytes": 32 << 20, "deferred": 0}
    assert check_write_backlog(stats_from(parts)).verdict is Verdict.OK
    storage = StorageConfig(path=tmp_path, enabled=True, capacity_bytes=None, fsync="off", io_threads=1)
    names = [c.name for c in check_storage(storage, ServerProbe(tmp_path / "no.sock"))]
    assert "storage: write backlog" not in names  # only a running server has one


def test_a_pool_directory_to_be_created_is_fine(tmp_path):
    check = check_pool_permissions(PoolConfig(dir=tmp_path / "not" / "yet", size_bytes=1 << 20))
    assert check.verdict is Verdict.OK and "0700" in check.detail


def test_a_pool_directory_too_deep_for_a_unix_socket_fails(tmp_path):
    deep = tmp_path / ("d" * 100)
    check = check_socket_path(PoolConfig(dir=deep, size_bytes=1 << 20))
    assert check.verdict is Verdict.FAIL and "shorter path" in check.fix
    assert check_socket_path(PoolConfig(dir=Path("/dev/shm/hpkv"), size_bytes=1 << 20)).verdict is Verdict.OK


def test_hash_stability_is_a_note_without_pythonhashseed():
    unset = check_hash_seed({})
    assert unset.verdict is Verdict.INFO and "PYTHONHASHSEED" in unset.fix and "xxhash" in unset.detail
    assert check_hash_seed({"PYTHONHASHSEED": "0"}).verdict is Verdict.OK


def test_memlock_trusts_what_the_running_server_says(pool_dir):
    pool = PoolConfig(dir=pool_dir, size_bytes=64 << 20)
    stats = stats_from({"server": {"pid": 42}, "dram": {"locked_in_memory": False, "locked_bytes": 0}})
    check = check_memlock(pool, ServerProbe(Path(pool_dir) / "hpkv.sock", stats=stats))
    assert check.verdict is Verdict.WARN and "pid 42" in check.detail and "LimitMEMLOCK" in check.fix


def test_every_check_has_a_fix_when_it_is_not_ok(pool_dir, tmp_path):
    checks = run_checks(hpkv_env(pool_dir, tmp_path / "storage", tmp_path))
    assert all(isinstance(c, Check) for c in checks)
    assert all(c.fix for c in checks if c.verdict in (Verdict.WARN, Verdict.FAIL))


def test_doctor_checks_direct_io_only_when_it_is_asked_for(tmp_path, monkeypatch):
    storage = tmp_path / "storage"
    storage.mkdir(mode=0o700)
    config = StorageConfig(path=storage, enabled=True, capacity_bytes=None, fsync="off", io_threads=1, direct_io=True)
    probe = ServerProbe(tmp_path / "no.sock")
    by_name = {c.name: c for c in check_storage(config, probe)}
    assert by_name["storage directory: direct I/O"].verdict is Verdict.OK  # ext4 or tmpfs here
    monkeypatch.setattr("hpkv.doctor.storage.direct_supported", lambda path: False)
    check = {c.name: c for c in check_storage(config, probe)}["storage directory: direct I/O"]
    assert check.verdict is Verdict.WARN and str(storage) in check.detail and "page cache" in check.detail
    off = dataclasses.replace(config, direct_io=False)
    assert "storage directory: direct I/O" not in {c.name for c in check_storage(off, probe)}


def test_doctor_names_the_setting_that_keeps_two_engines_from_sharing_kv(server, env):
    """Users cannot tell why reads never happen: one engine saves, another with a different block
    size looks up the same prompts and finds nothing. Doctor names the difference."""
    from helpers.cli import DESC, write_entries

    with server.client() as saver, server.client() as reader:
        write_entries(saver, 8)
        other = dataclasses.replace(DESC, block_size=32, entry_bytes=2 * DESC.entry_bytes)
        ns = reader.register(other)
        for _ in range(3):
            assert reader.lookup(ns, [bytes([i]) * 16 for i in range(32)]).num_hit == 0
        code, checks = doctor_json(env)
    assert code == 0
    check = checks["namespaces: hits"]
    assert check["verdict"] == "warn", check
    assert f"namespace {ns[:12]} (vllm, {DESC.model}, rank 0) looked up 96 keys and found none" in check["detail"]
    assert "block size 32 here, 16 there" in check["detail"] and "bytes per block" in check["detail"]
    assert "same settings" in check["fix"]


def test_namespaces_that_find_their_keys_are_fine():
    from helpers.cli import DESC
    from hpkv.doctor import check_namespaces

    def ns_stats(desc, lookup_keys, hits):
        return {
            "desc": desc.to_json(),
            "lookups": 1,
            "lookup_keys": lookup_keys,
            "hit_keys_dram": hits,
            "hit_keys_storage": 0,
        }

    assert check_namespaces(stats_from({"namespaces": {}})).verdict is Verdict.INFO
    rank1 = dataclasses.replace(DESC, tp_size=2, rank=1)
    rank0 = dataclasses.replace(DESC, tp_size=2, rank=0)
    fine = stats_from({"namespaces": {rank0.ns: ns_stats(rank0, 100, 60), rank1.ns: ns_stats(rank1, 100, 60)}})
    check = check_namespaces(fine)
    assert check.verdict is Verdict.OK and "2 namespaces; 120 of 200 keys looked up were found" in check.detail
    # A cold namespace whose siblings differ only in rank (its own engine's other ranks) is no mismatch.
    cold = stats_from({"namespaces": {rank0.ns: ns_stats(rank0, 100, 0), rank1.ns: ns_stats(rank1, 100, 0)}})
    check = check_namespaces(cold)
    assert check.verdict is Verdict.INFO and "2 namespaces found none yet" in check.detail
    # Pipeline stages of one engine hold different layers, so different bytes per block.
    stage0 = dataclasses.replace(DESC, pp_size=2, rank=0, num_layers=16, entry_bytes=16 * 4096)
    stage1 = dataclasses.replace(DESC, pp_size=2, rank=1, num_layers=15, entry_bytes=15 * 4096)
    cold = stats_from({"namespaces": {stage0.ns: ns_stats(stage0, 100, 0), stage1.ns: ns_stats(stage1, 100, 0)}})
    assert check_namespaces(cold).verdict is Verdict.INFO


def test_a_pool_above_a_container_s_limit_is_a_warning_not_a_failure(tmp_path, monkeypatch):
    """64 GiB available on the host, 2 GiB left under the container's memory.max: the server
    creates an 8 GiB pool on ramfs (it warns), so doctor warns too, naming the limit."""
    from helpers.machine import GIB, pretend

    point = tmp_path / "ram"
    pretend(monkeypatch, tmp_path, 64 * GIB, ramfs=(point,), cgroup="/ctr", limits={"/ctr": (str(4 * GIB), 2 * GIB, 0)})

    space = check_pool_space(PoolConfig(dir=point / "pool", size_bytes=8 * GIB))

    assert space.verdict is Verdict.WARN and "container's memory limit" in space.detail, space.detail


def test_storage_on_ramfs_leaves_out_a_pool_on_tmpfs_too_less_what_its_file_already_holds(
    tmp_path, monkeypatch, shm_dir
):
    """As the server: the pages a pool on any memory file system has yet to take are left out
    of the room, and those a pool file already there holds are not left out twice."""
    from helpers.machine import GIB, pretend
    from hpkv.pool.region import POOL_FILE_NAME

    point = tmp_path / "ram"
    pretend(monkeypatch, tmp_path, 8 * GIB, ramfs=(point,))
    storage = StorageConfig(path=point / "storage", enabled=True, capacity_bytes=None, fsync="off", io_threads=1)
    probe = ServerProbe(tmp_path / "no.sock")

    on_tmpfs = check_storage_space(storage, probe, PoolConfig(dir=shm_dir, size_bytes=2 << 20))
    assert mount_of(shm_dir).fs_type == "tmpfs" and "less the 2.0 MiB DRAM pool" in on_tmpfs.detail, on_tmpfs.detail

    (shm_dir / POOL_FILE_NAME).write_bytes(b"\1" * (1 << 20))  # a stale pool file, its pages taken
    stale = check_storage_space(storage, probe, PoolConfig(dir=shm_dir, size_bytes=2 << 20))
    assert "less the 1.0 MiB DRAM pool" in stale.detail, stale.detail


def test_memlock_is_ok_where_no_lock_is_needed_or_while_the_server_locks_in_the_background(pool_dir):
    pool = PoolConfig(dir=pool_dir, size_bytes=64 << 20)
    unneeded = {"locked_in_memory": True, "no_lock_why": "no swap is configured"}
    locking = {"locked_in_memory": False, "ready_bytes": 32 << 20, "locked_bytes": 32 << 20}
    for dram in (unneeded, locking):
        stats = stats_from({"server": {"pid": 42}, "dram": dram})
        check = check_memlock(pool, ServerProbe(Path(pool_dir) / "hpkv.sock", stats=stats))
        assert check.verdict is Verdict.OK, check
    assert (
        "no swap is configured"
        in check_memlock(pool, ServerProbe(Path(pool_dir) / "hpkv.sock", stats=stats_from({"dram": unneeded}))).detail
    )
