"""What the operating system says about a path (its mount, file system type and free space) and
about memory (what this process may still take: `mem_available_bytes`).

Used by the pool (ramfs/tmpfs expected), the storage tier (auto capacity: `room_bytes`) and
`hpkv doctor`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MEMORY_FS = frozenset({"ramfs", "tmpfs"})
# Kernel interfaces mounted as file systems: they cannot hold ordinary files (no KV files, no pool).
PSEUDO_FS = frozenset(
    {
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "devpts",
        "configfs",
        "bpf",
        "pstore",
        "efivarfs",
        "fusectl",
        "mqueue",
        "binfmt_misc",
        "nsfs",
        "rpc_pipefs",
        "selinuxfs",
        "smackfs",
        "hugetlbfs",
    }
)
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")
# What is read, as names (tests point them at files of their own).
_MOUNTINFO = "/proc/self/mountinfo"
_MEMINFO = "/proc/meminfo"
_SELF_CGROUP = "/proc/self/cgroup"
_CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fs_type: str
    source: str
    options: str = ""  # the file system's own (super block) options, comma-separated

    def option(self, name: str) -> str | None:
        """The value of `name=value` among the options, or None."""
        for item in self.options.split(","):
            key, _, value = item.partition("=")
            if key == name:
                return value
        return None

    @property
    def huge_pages(self) -> str | None:
        """A tmpfs's `huge=` policy (its default is never); None on other file systems."""
        if self.fs_type != "tmpfs":
            return None
        return self.option("huge") or "never"


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as octal; other characters,
    # UTF-8 included, stand as they are (so no "unicode_escape", which would mangle them).
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str | os.PathLike) -> Mount:
    """The mount holding `path` (the longest mount point that is a prefix of its real path)."""
    target = os.path.realpath(existing_ancestor(Path(path)))
    best = Mount("/", "unknown", "unknown")
    with open(_MOUNTINFO, encoding="utf-8", errors="replace") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            point = _unescape(left.split()[4])
            fs_type, source, options = (right.split() + ["", "", ""])[:3]
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best.mount_point):
                best = Mount(point, fs_type, source, options)
    return best


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path`."""
    st = os.statvfs(existing_ancestor(Path(path)))
    return st.f_bavail * st.f_frsize


def room_bytes(path: str | os.PathLike, promised_ram_bytes: int = 0) -> int:
    """Bytes the file system holding `path` has room for: its free space, or on ramfs (which has
    no size, and says 0 free) half of the memory available (`mem_available_bytes`), the most a
    tmpfs of the default size may take, less `promised_ram_bytes` first: memory promised and not
    taken yet (a pool on ramfs, whose pages arrive on first touch, is still counted available)."""
    if mount_of(path).fs_type == "ramfs":
        return max(0, mem_available_bytes() - promised_ram_bytes) // 2
    return free_bytes(path)


def total_bytes(path: str | os.PathLike) -> int:
    st = os.statvfs(existing_ancestor(Path(path)))
    return st.f_blocks * st.f_frsize


def mem_available_bytes() -> int:
    """Memory this process may still take: MemAvailable, at most what its cgroup has left
    (`cgroup_memory_left`). In a container /proc/meminfo is the host's. An estimate for sizing
    (the storage tier's auto capacity), never for refusing: a cgroup's usage moves."""
    available = meminfo_available_bytes()
    left = cgroup_memory_left()
    return available if left is None else min(available, left)


def meminfo_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (the host's, in a container)."""
    with open(_MEMINFO, encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def cgroup_memory_left() -> int | None:
    """What this process's cgroup v2 may still take before its memory.max, the least of it and
    of every cgroup above it (a pod's limit sits above its container's): memory.max less the
    memory.current that is reclaimable (`_reclaimable_bytes`). None
    where no limit applies ("max") or none can be read (cgroup v1, no /sys/fs/cgroup)."""
    try:
        with open(_SELF_CGROUP, encoding="utf-8", errors="replace") as f:
            own = next((line[3:].rstrip("\n") for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    if own is None:
        return None
    root = os.path.normpath(_CGROUP_ROOT)
    cgroup = os.path.normpath(root + "/" + own.lstrip("/"))
    if cgroup != root and not cgroup.startswith(root + "/"):  # outside this namespace's view
        cgroup = root
    least = None
    while True:
        left = _cgroup_left(cgroup)
        if left is not None and (least is None or left < least):
            least = left
        if cgroup == root:
            return least
        cgroup = os.path.dirname(cgroup)


def _cgroup_left(cgroup: str) -> int | None:
    try:
        with open(f"{cgroup}/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(f"{cgroup}/memory.current", encoding="ascii") as f:
            current = int(f.read())
        return max(0, int(limit) - current + _reclaimable_bytes(cgroup))
    except (OSError, ValueError):
        return None


_RECLAIMABLE = ("active_file", "inactive_file", "slab_reclaimable")


def _reclaimable_bytes(cgroup: str) -> int:
    """What the kernel reclaims before the cgroup's limit bites: its page cache (active too: a
    file read twice is active, and still dropped under pressure) and reclaimable slab."""
    num = 0
    try:
        with open(f"{cgroup}/memory.stat", encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name in _RECLAIMABLE:
                    num += int(value)
    except (OSError, ValueError):
        return 0
    return num


def existing_ancestor(path: Path) -> Path:
    """`path` itself if it exists, else its nearest existing parent."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
