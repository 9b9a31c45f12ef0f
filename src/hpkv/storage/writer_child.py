"""The write-through process (`python -m hpkv.storage.writer_child POOL_FD NICE`): maps the pool
read-only from the descriptor it is given, and for each job checksums the slot and writes the
entry file (`write_entry_file`: temporary, then rename), at niceness NICE (`writer.WriterPool`
starts it).

Protocol: one JSON value per line. The process first says `{"hello": "hpkv-writer", "version":
N}`; then each line is a list of jobs, `{"ns", "key" (hex), "offset", "length", "final", "tmp",
"directory", "mkdir", "root", "root_id", "fsync", "format"}` (a `FileTarget`; "format": the file format
version, 2 to write it with O_DIRECT), done in order and answered by one line each, `{"ok":
true}` or `{"errno": E, "error": "..."}`, sent together once the last is done (a batch costs
both processes one wake-up, not one a job).

Owns: the directories it writes into, and the storage root, kept open (`DirCache`) so that a
job does not open its directory below the root again, nor the root by its name: a root is opened
once for each (path, `root_id`) the server names, and only if the path names that directory (a
root replaced under the server is not followed). Must not know: the index, budgets, which entries to write.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import signal
import stat
import sys
from collections import OrderedDict

from . import format as fmt
from . import tree
from .fileio import FileIO, FileTarget, write_entry_file

PROTOCOL_VERSION = 5  # 4: jobs come in batches; 5: "root_id"
HELLO = "hpkv-writer"
_OK = {"ok": True}
_OK_LINE = json.dumps(_OK).encode() + b"\n"  # the reply to a job done


class DirCache:
    """Descriptors of the directories written into lately, opened as `FileTarget.open_directory`
    opens them (no link followed below the root). A directory removed under it (the tree
    `rm -rf`ed) takes no new file (ENOENT): the job's error drops it, and the server's retry,
    which asks for the directory to be made, opens it afresh."""

    MAX = 256
    MAX_ROOTS = 4  # roots the server held lately (one, but for a root removed and made again)

    def __init__(self) -> None:
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._roots: OrderedDict[tuple[str, tuple[int, int]], int] = OrderedDict()

    def open(self, target: FileTarget) -> int:
        fd = None if target.mkdir else self._fds.get(target.directory)
        if fd is not None:
            self._fds.move_to_end(target.directory)
            return fd
        self.drop(target.directory)
        fd = self._fds[target.directory] = target.open_directory(self._root(target))
        if len(self._fds) > self.MAX:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _root(self, target: FileTarget) -> int | None:
        """The root `target` names, held open; None where it names no root id (opened per job)."""
        if target.root is None or target.root_id is None:
            return None
        key = (target.root, target.root_id)
        fd = self._roots.get(key)
        if fd is None:
            fd = self._roots[key] = tree.opened_root(target.root, target.root_id)  # ESTALE: replaced
            if len(self._roots) > self.MAX_ROOTS:
                os.close(self._roots.popitem(last=False)[1])
        return fd

    def drop(self, directory: str) -> None:
        fd = self._fds.pop(directory, None)
        if fd is not None:
            os.close(fd)


def _serve(pool_fd: int, nice: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C stops the server, which closes our stdin
    os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))
    out = sys.stdout.buffer
    try:
        if not stat.S_ISREG(os.fstat(pool_fd).st_mode):
            print(f"hpkv writer: descriptor {pool_fd} is not the pool file", file=sys.stderr)
            return 2
        # The mapping keeps the file; the descriptor is not needed once it is made.
        pool = mmap.mmap(pool_fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(pool_fd)
    buf = memoryview(pool)
    io, dirs = FileIO(), DirCache()
    out.write(json.dumps({"hello": HELLO, "version": PROTOCOL_VERSION}).encode() + b"\n")
    out.flush()
    for line in sys.stdin.buffer:
        replies = [_job(job, buf, io, dirs) for job in json.loads(line)]
        out.write(b"".join(_OK_LINE if r is _OK else json.dumps(r).encode() + b"\n" for r in replies))
        out.flush()
    return 0


def _job(job: dict, buf: memoryview, io: FileIO, dirs: DirCache) -> dict:
    offset, length = job["offset"], job["length"]
    if offset < 0 or length < 0 or offset + length > len(buf):
        return {"errno": errno.EINVAL, "error": f"slot {offset}+{length} outside the pool of {len(buf)} bytes"}
    version = job.get("format", fmt.VERSION)
    if version not in fmt.VERSIONS:
        return {"errno": errno.EINVAL, "error": f"unknown file format version {version}"}
    root_id = job.get("root_id")
    target = FileTarget(
        job["final"], job["tmp"], job["directory"], job["mkdir"], job.get("root"), tuple(root_id) if root_id else None
    )
    payload = buf[offset : offset + length]
    try:
        header = fmt.encode_header(bytes.fromhex(job["ns"]), bytes.fromhex(job["key"]), payload, version)
        # The pool's mapping starts on a page and its slots on ALIGN: the payload is aligned.
        direct = version == fmt.VERSION_ALIGNED and offset % fmt.ALIGN == 0 and length % fmt.ALIGN == 0
        try:
            error = write_entry_file(io, target, [header, payload], job["fsync"], direct, dirs.open(target))
        except OSError as exc:  # the directory: a link or a file in the way, or gone
            error = exc
    finally:
        payload.release()
    if error is None:
        return _OK
    dirs.drop(target.directory)
    return {"errno": error.errno or errno.EIO, "error": error.strerror or str(error)}


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[1]), int(sys.argv[2])))
