"""A pretend machine for `hpkv.fsinfo`: the memory /proc/meminfo shows, ramfs mounts over the real
ones, and this process's cgroup v2 limits, all in files of the test's own (no root, no container)."""

from __future__ import annotations

from pathlib import Path

from hpkv import fsinfo

GIB = 1 << 30


def pretend(
    monkeypatch,
    tmp_path: Path,
    mem_available: int,
    ramfs: tuple[Path, ...] = (),
    cgroup: str | None = None,
    limits: dict[str, tuple[str, int, int]] | None = None,
) -> None:
    """Make fsinfo see `mem_available` bytes in /proc/meminfo; each of `ramfs` mounted as a ramfs
    (over the real mounts); this process in cgroup v2 `cgroup` ("/a/b"), and in `limits` (cgroup
    path -> (memory.max, memory.current, inactive_file)) the limits of those cgroups."""
    fake = tmp_path / "fake-proc"
    fake.mkdir(exist_ok=True)
    meminfo = fake / "meminfo"
    meminfo.write_text(
        f"MemTotal:       {4 * mem_available // 1024} kB\n"
        f"MemFree:        {mem_available // 2048} kB\n"
        f"MemAvailable:   {mem_available // 1024} kB\n"
    )
    monkeypatch.setattr(fsinfo, "_MEMINFO", str(meminfo))
    mountinfo = fake / "mountinfo"
    lines = Path("/proc/self/mountinfo").read_text()
    for n, point in enumerate(ramfs):
        point.mkdir(parents=True, exist_ok=True)
        lines += f"{9000 + n} 1 0:{900 + n} / {point.resolve()} rw,relatime shared:900 - ramfs ramfs rw,mode=700\n"
    mountinfo.write_text(lines)
    monkeypatch.setattr(fsinfo, "_MOUNTINFO", str(mountinfo))
    own = fake / "cgroup"
    own.write_text("" if cgroup is None else f"0::{cgroup}\n")
    monkeypatch.setattr(fsinfo, "_SELF_CGROUP", str(own))
    root = fake / "sys-fs-cgroup"
    root.mkdir(exist_ok=True)
    for path, (limit, current, inactive_file) in (limits or {}).items():
        d = root / path.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.stat").write_text(f"anon 4096\nfile 8192\nactive_file 0\ninactive_file {inactive_file}\n")
    monkeypatch.setattr(fsinfo, "_CGROUP_ROOT", str(root))
