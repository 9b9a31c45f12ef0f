"""What the operating system says about a path: its mount, file system type and free space.

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
PSEUDO_FS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "devpts",
                       "configfs", "bpf", "pstore", "efivarfs", "fusectl", "mqueue", "binfmt_misc", "nsfs",
                       "rpc_pipefs", "selinuxfs", "smackfs", "hugetlbfs"})
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


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
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
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


def room_bytes(path: str | os.PathLike) -> int:
    """Bytes the file system holding `path` has room for: its free space, or on ramfs (which has
    no size, and says 0 free) half of MemAvailable, the most a tmpfs of the default size may take."""
    if mount_of(path).fs_type == "ramfs":
        return mem_available_bytes() // 2
    return free_bytes(path)


def total_bytes(path: str | os.PathLike) -> int:
    st = os.statvfs(existing_ancestor(Path(path)))
    return st.f_blocks * st.f_frsize


def mem_available_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def existing_ancestor(path: Path) -> Path:
    """`path` itself if it exists, else its nearest existing parent."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
