"""Stories about what the operating system says: the memory a process may still take (a
container's limit, not the host's memory) and the room of a ramfs, which has no size. The files
read are pointed at files of the test's own (`helpers.machine.pretend`), so no root and no container is needed."""

from __future__ import annotations

from helpers.machine import GIB, pretend
from hpkv import fsinfo


def test_without_a_cgroup_limit_the_memory_available_is_memavailable(monkeypatch, tmp_path):
    pretend(
        monkeypatch,
        tmp_path,
        64 * GIB,
        cgroup="/system.slice/hpkv.service",
        limits={"/system.slice/hpkv.service": ("max", 3 * GIB, 0)},
    )

    assert fsinfo.cgroup_memory_left() is None
    assert fsinfo.mem_available_bytes() == 64 * GIB


def test_in_a_container_the_memory_available_is_what_its_limit_leaves(monkeypatch, tmp_path):
    """/proc/meminfo in a container is the host's: 64 GiB there, but the container may take 8 GiB
    and has 3 GiB of it (1 GiB of which inactive page cache, reclaimed before the limit bites)."""
    pretend(monkeypatch, tmp_path, 64 * GIB, cgroup="/", limits={"/": (str(8 * GIB), 3 * GIB, GIB)})

    assert fsinfo.mem_available_bytes() == 6 * GIB


def test_active_page_cache_and_reclaimable_slab_count_as_left_too(monkeypatch, tmp_path):
    """A container that read its files twice has them in active page cache: the kernel drops that
    too before the limit bites, and reclaimable slab (dentries, inodes) as well."""
    pretend(monkeypatch, tmp_path, 64 * GIB, cgroup="/", limits={"/": (str(8 * GIB), 6 * GIB, 0)})
    (tmp_path / "fake-proc" / "sys-fs-cgroup" / "memory.stat").write_text(
        f"anon {GIB}\nfile {4 * GIB}\nactive_file {2 * GIB}\ninactive_file {GIB}\nslab_reclaimable {GIB}\n"
        f"slab_unreclaimable {GIB}\n"
    )

    assert fsinfo.mem_available_bytes() == 6 * GIB


def test_a_limit_above_the_process_s_own_cgroup_counts_too(monkeypatch, tmp_path):
    """A pod's limit sits above its container's: the least either leaves."""
    pretend(
        monkeypatch,
        tmp_path,
        64 * GIB,
        cgroup="/kubepods/pod1/ctr",
        limits={"/kubepods/pod1": (str(10 * GIB), 8 * GIB, 0), "/kubepods/pod1/ctr": (str(16 * GIB), 7 * GIB, 0)},
    )

    assert fsinfo.mem_available_bytes() == 2 * GIB


def test_a_cgroup_over_its_limit_leaves_nothing(monkeypatch, tmp_path):
    pretend(monkeypatch, tmp_path, 64 * GIB, cgroup="/c", limits={"/c": (str(GIB), 2 * GIB, 0)})

    assert fsinfo.mem_available_bytes() == 0


def test_cgroup_files_that_cannot_be_read_are_no_limit(monkeypatch, tmp_path):
    """cgroup v1 only (no "0::" line), a cgroup directory not mounted, a garbled file: no cap."""
    pretend(monkeypatch, tmp_path, 64 * GIB)
    (tmp_path / "fake-proc" / "cgroup").write_text("4:memory:/process_api/x\n1:cpu:/\n")
    assert fsinfo.mem_available_bytes() == 64 * GIB

    pretend(monkeypatch, tmp_path, 64 * GIB, cgroup="/not/mounted/here")
    assert fsinfo.mem_available_bytes() == 64 * GIB

    pretend(monkeypatch, tmp_path, 64 * GIB, cgroup="/c", limits={"/c": ("lots", GIB, 0)})
    assert fsinfo.mem_available_bytes() == 64 * GIB

    monkeypatch.setattr(fsinfo, "_SELF_CGROUP", str(tmp_path / "no-such-file"))
    assert fsinfo.mem_available_bytes() == 64 * GIB


def test_the_room_of_a_ramfs_is_half_the_memory_left_once_the_pool_takes_its_own(monkeypatch, tmp_path):
    """A ramfs has no size: its room is half the memory available. A pool on ramfs is only sized
    when the tier starts (its pages come on first touch), so the memory available still holds
    it: the room is half of what is left without it, and never below 0."""
    point = tmp_path / "ram"
    pretend(monkeypatch, tmp_path, 64 * GIB, ramfs=(point,), cgroup="/c", limits={"/c": (str(48 * GIB), 8 * GIB, 0)})

    assert fsinfo.mount_of(point / "storage").fs_type == "ramfs"
    assert fsinfo.room_bytes(point / "storage") == 20 * GIB
    assert fsinfo.room_bytes(point / "storage", promised_ram_bytes=30 * GIB) == 5 * GIB
    assert fsinfo.room_bytes(point / "storage", promised_ram_bytes=50 * GIB) == 0
