"""The files nodes sharing a root keep about it beside the members' leases, under `<root>/cluster/`:
each owner's usage, the capacity they share, and the clear epoch.

- `usage/<member>`: what one owner holds in its parts (parts owned, bytes, files, the oldest use
  it knows), written after each pass over its parts; `hpkv status` and tests sum them
  (`total_usage`). One file per owner, not one per part: 65,536 files would be a walk again.
- `config`: HPKV_KV_STORAGE_SIZE for the whole root, written once by the first server (O_EXCL);
  a server configured otherwise says so and uses the file's (`agree_capacity`): one capacity,
  split among owners by the share of parts each owns.
- `epoch`: replaced (a new inode) by `hpkv clear --storage` on any node; owners `stat` it once a
  pass, and a new one makes them forget and list their parts again.

Written by temporary and rename, so a reader sees a whole file or the previous one.

Primitives: `ClusterFiles` (`write_usage`, `remove_usage`, `total_usage`, `agree_capacity`,
`agreed_capacity`, `bump_epoch`, `epoch`, `members`); one made with `create=False` makes no
directory (`hpkv doctor`, a clear without a server: FileNotFoundError where there is none).
Must not know: the index, parts' owners, how members are judged live.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

from . import tree
from .fileio import FileIO

log = logging.getLogger("hpkv.storage.tier")

CLUSTER_DIR = "cluster"


class ClusterFiles:
    def __init__(self, root: tree.Root, io: FileIO, temp_name, create: bool = True) -> None:
        """`temp_name(what)`: a temporary's name no other writer picks (`EntryPaths.temp_name`)."""
        self._root = root
        self._io = io
        self._temp_name = temp_name
        self._create = create

    def _dir(self, *parts: str):
        return tree.opened_below(self._root.fd(), self._root.path, [CLUSTER_DIR, *parts], create=self._create)

    def _put(self, dir_parts: tuple[str, ...], name: str, text: str) -> None:
        with self._dir(*dir_parts) as dir_fd:
            tmp = self._temp_name(name)
            fd = os.open(tmp, tree.CREATE_FLAGS, 0o600, dir_fd=dir_fd)
            try:
                try:
                    os.write(fd, text.encode())
                finally:
                    os.close(fd)
                self._io.rename(tmp, name, dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise

    def write_usage(self, member: str, usage: dict) -> None:
        self._put(("usage",), member, json.dumps(usage))

    def remove_usage(self, member: str) -> None:
        with contextlib.suppress(OSError), self._dir("usage") as dir_fd:
            self._io.unlink(member, dir_fd=dir_fd)

    def total_usage(self) -> dict:
        """The owners' usage files summed: {"owners", "parts", "bytes", "files"}."""
        total = {"owners": 0, "parts": 0, "bytes": 0, "files": 0}
        with self._dir("usage") as dir_fd:
            for entry in self._io.list_dir(dir_fd):
                if entry.name.startswith("."):
                    continue
                try:
                    with open(os.open(entry.name, os.O_RDONLY | tree.FILE_FLAGS, dir_fd=dir_fd)) as f:
                        usage = json.loads(f.read())
                except (OSError, ValueError):
                    continue
                total["owners"] += 1
                for k in ("parts", "bytes", "files"):
                    total[k] += int(usage.get(k, 0))
        return total

    def agree_capacity(self, capacity_bytes: int) -> int:
        """The root's capacity: the one the first server wrote, or `capacity_bytes` written now."""
        with self._dir() as dir_fd:
            try:
                fd = os.open("config", tree.CREATE_FLAGS, 0o600, dir_fd=dir_fd)
            except FileExistsError:
                pass
            else:
                try:
                    os.write(fd, json.dumps({"capacity_bytes": capacity_bytes}).encode())
                finally:
                    os.close(fd)
                return capacity_bytes
            try:
                with open(os.open("config", os.O_RDONLY | tree.FILE_FLAGS, dir_fd=dir_fd)) as f:
                    agreed = int(json.loads(f.read())["capacity_bytes"])
            except (OSError, ValueError, KeyError, TypeError):
                return capacity_bytes  # being written by another node (empty for a moment): ours
        if agreed != capacity_bytes:
            log.warning(
                "the nodes sharing %s hold %d bytes of KV files together (%s/%s/config, written by the "
                "first server); this server was set to %d and uses the shared figure. Remove that file "
                "with every server stopped to change it",
                self._root.path,
                agreed,
                self._root.path,
                CLUSTER_DIR,
                capacity_bytes,
            )
        return agreed

    def agreed_capacity(self) -> int | None:
        """The capacity in `config` (None: no server wrote it yet, or it cannot be read)."""
        with self._dir() as dir_fd:
            try:
                with open(os.open("config", os.O_RDONLY | tree.FILE_FLAGS, dir_fd=dir_fd)) as f:
                    return int(json.loads(f.read())["capacity_bytes"])
            except (OSError, ValueError, KeyError, TypeError):
                return None

    def members(self) -> int:
        """Lease files in `members/` (live members, and dead ones not reaped yet)."""
        with self._dir("members") as dir_fd:
            return sum(not e.name.startswith(".") for e in self._io.list_dir(dir_fd))

    def bump_epoch(self) -> None:
        """A clear: every owner forgets its parts' files and lists them again."""
        self._put((), "epoch", os.urandom(8).hex())

    def epoch(self) -> tuple[int, int] | None:
        """What identifies the current epoch (the file's inode and mtime); None: never cleared."""
        with self._dir() as dir_fd:
            try:
                st = self._io.stat_path("epoch", dir_fd=dir_fd)
            except FileNotFoundError:
                return None
        return st.st_ino, st.st_mtime_ns
