"""Where entry files live below the storage root, and the names of their temporaries.

`<root>/<ns>/<hex[0:2]>/<hex[2:4]>/<hex>.kv`; a temporary is `.<what>.<node>.<pid>.<seq>.tmp` in
the directory of the file it becomes (`scan` reads the writer back from the name). Every name is
looked up from the root held open (`tree.Root`); removal is an `unlink` by name in a directory
reached without following a link.

Primitives: `EntryPaths.where`, `path_of`, `stat`, `unlink`, `temp_name`, `target`, `close`; `io`, the system
calls (a seam tests replace, also on a running tier).
Must not know: the index, capacity, what a file holds.
"""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

from . import tree
from .fileio import FileIO, FileTarget

# One sequence for every tier in the process: two tiers on one root (same node, same pid) must
# never pick the same temporary name, or one's O_EXCL fails and its clean-up deletes the other's.
_TEMP_SEQ = itertools.count(1)


class EntryPaths:
    def __init__(self, root: Path, io: FileIO) -> None:
        self.root = root
        self.tree = tree.Root(str(root))  # held open: everything below it starts there
        self.io = io
        self.node = socket.gethostname().replace(".", "_")

    @staticmethod
    def where(ns: str, key: bytes) -> tuple[tuple[str, str, str], str]:
        """The directories below the root holding (ns, key)'s file, and its name."""
        name = key.hex()
        fan = name.ljust(4, "0")  # keys under 2 bytes still get both levels, where the scan looks
        return (ns, fan[0:2], fan[2:4]), f"{name}.kv"

    def path_of(self, ns: str, key: bytes) -> str:
        parts, name = self.where(ns, key)
        return f"{self.root}/{'/'.join(parts)}/{name}"

    def stat(self, ns: str, key: bytes) -> os.stat_result:
        """(ns, key)'s file itself (a link there not followed), looked up from the held root."""
        parts, name = self.where(ns, key)
        return self.io.stat_path("/".join((*parts, name)), dir_fd=self.tree.fd())

    def unlink(self, ns: str, key: bytes) -> None:
        """Remove (ns, key)'s file by name in its directory, reached without following a link."""
        parts, name = self.where(ns, key)
        dir_fd = self.tree.open("/".join(parts), tree.DIR_FLAGS)
        try:
            self.io.unlink(name, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def temp_name(self, what: str) -> str:
        """A temporary's name no other writer (thread, process, node) picks."""
        return f".{what}.{self.node}.{os.getpid()}.{next(_TEMP_SEQ)}.tmp"

    def target(self, ns: str, key: bytes, known_dirs: set[str]) -> FileTarget:
        """Where a new file of (ns, key) is written, then renamed; its directory is made unless
        it is in `known_dirs`."""
        final = self.path_of(ns, key)
        directory = final[: final.rfind("/")]
        tmp = f"{directory}/{self.temp_name(key.hex())}"
        root_fd = self.tree.fd()
        return FileTarget(final, tmp, directory, directory not in known_dirs, str(self.root), self.tree.id, root_fd)

    def close(self) -> None:
        self.tree.close()
