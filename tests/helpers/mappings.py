"""This process's memory mappings, from /proc/self: its mappings of pool files, and what a pool
region's mapping holds resident."""

from __future__ import annotations

from pathlib import Path

from hpkv.pool.region import POOL_FILE_NAME


def pool_mappings(directory: Path) -> int:
    """This process's mappings of the pool file of `directory` (removed ones too)."""
    with open("/proc/self/maps") as f:
        return sum(f"{directory}/{POOL_FILE_NAME}" in line for line in f)


def inode_mappings(inode: int) -> int:
    """This process's mappings of the pool file with this inode (unlinked or not)."""
    return sum(
        1
        for line in Path("/proc/self/maps").read_text().splitlines()
        if line.split()[4:5] == [str(inode)] and POOL_FILE_NAME in line
    )


def resident_bytes(region) -> int:
    """Rss of this region's own mapping of the pool file, from /proc/self/smaps."""
    import ctypes

    start = ctypes.addressof(ctypes.c_char.from_buffer(region.buf))
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and ":" in fields[3]:  # a mapping's header line
            inside = int(fields[0].split("-")[0], 16) == start
        elif inside and fields[0] == "Rss:":
            return int(fields[1]) * 1024
    raise AssertionError("the pool mapping is not in /proc/self/smaps")
