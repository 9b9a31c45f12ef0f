"""The shared-memory region: one file in the pool directory, mapped by every process.

The owner (the HPKV server, or an in-process store) creates the file with `create`; other
processes `attach` to a descriptor of it and copy bytes in and out of the offsets the owner hands
out. Why each choice:
- `O_CREAT|O_EXCL` and an exclusive `flock` held for the owner's lifetime: two owners would hand
  out the same slots; a file whose lock can be taken is a dead owner's, and is replaced
  (`pool.poolfile`, with the directory's and the space's checks).
- The free space is checked at start and the file sized at once; its pages are reserved
  (`posix_fallocate`: a full tmpfs would otherwise kill a writer with SIGBUS mid-copy) and, where
  they could be swapped, locked, by a background thread (`pool.backing`): `ready_bytes` is the
  prefix done, and nothing beyond it may be handed out. A start that waited for every page would
  grow with the pool.
- Handed over as a descriptor (`share_fd()`), never re-opened by name, which someone able to
  write the directory could swap. `share_fd` is a second open file description (through
  /proc/self/fd), so mappings made from it do not share the owner's `flock`: a client that
  outlives a killed server must not make its pool look live. Where the kernel allows, nobody can
  truncate the file through it, and a size changed is set back (`pool.handout`); a file cut
  short all the same is found before a copy (`check_whole`).
- Every open in the pool directory is O_NOFOLLOW|O_NONBLOCK and fstat-checked (`safefs`), and the
  directory itself must be trustworthy (`pool.directory`).
Must not know: slots, entries, the protocol.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from .. import safefs
from ..errors import PoolError
from ..fsinfo import mount_of
from ..units import human_bytes
from . import handout, poolfile
from .backing import Backing, populate, populate_range, size_file

log = logging.getLogger(__name__)

POOL_FILE_NAME = "hpkv.pool"
MIN_POOL_BYTES = 1 << 20


class PoolRegion:
    """A mapped pool file. Use `create` (owner) or `attach` (any other process, given a
    descriptor of the owner's). `path` is where the owner created it: for messages only."""

    def __init__(self, path: Path, fd: int, size_bytes: int, owner: bool) -> None:
        self.path = path
        self.size_bytes = size_bytes
        self.owner = owner
        self.backing: Backing | None = None  # the owner's: reserves and locks pages in the background
        self._closed = False
        self._fd = fd
        self._shared: handout.Shared | None = None  # the owner's: what it hands out
        self._unshare: Callable[[], object] = lambda: None  # closes it (`create`)
        self._map = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            # Huge pages halve the cost of TLB misses in large copies, and make reserving and
            # locking 512 times fewer faults. Only a tmpfs mounted huge=within_size or huge=always
            # gives them to the pool: shmem_enabled does not apply to a tmpfs mount, and the
            # background posix_fallocate that allocates the pages sees no advice
            # (docs/operations.md).
            self._map.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        self.buf = memoryview(self._map)
        st = os.fstat(fd)
        self.inode = st.st_ino
        self.identity = (st.st_dev, st.st_ino)  # the file, whatever its name says now

    @classmethod
    def create(cls, directory: Path, size_bytes: int) -> PoolRegion:
        """Create the pool file exclusively, reserve its memory and map it.

        Raises PoolError naming the path and the fix when the directory is unusable, the pool
        does not fit, or a live owner already holds the file.
        """
        if size_bytes < MIN_POOL_BYTES:
            raise PoolError(f"HPKV_KV_MEM_POOL_SIZE={size_bytes} bytes is too small; use at least 1m")
        directory = Path(directory)
        poolfile.prepare_directory(directory)
        poolfile.warn_if_not_in_memory(directory)
        path = directory / POOL_FILE_NAME
        fd = poolfile.create_exclusive(path)
        try:
            # Only now: a stale pool left by a crashed owner has been removed and frees its space.
            poolfile.check_space(directory, size_bytes)
            size_file(fd, path, size_bytes)
            shared = handout.Shared(fd, path, size_bytes)
            try:
                region = cls(path, fd, size_bytes, owner=True)
            except BaseException:
                shared.close()
                raise
            region._shared, region._unshare = shared, weakref.finalize(region, shared.close)
        except BaseException:
            if poolfile.names(path, fd):
                os.unlink(path)
            os.close(fd)
            raise
        region.backing = Backing(fd, region._map, size_bytes, path, mount_of(directory).fs_type)
        region.backing.start()
        shared.ready_bytes = functools.partial(getattr, region.backing, "ready_bytes")
        return region

    @property
    def ready_bytes(self) -> int:
        """The owner's: bytes from the start of the pool with pages reserved (and locked where
        needed); no slot beyond may be handed out. Grows only."""
        return self.backing.ready_bytes if self.backing is not None else self.size_bytes

    @property
    def locked_in_memory(self) -> bool:
        return self.backing is not None and self.backing.locked_in_memory

    def backing_stats(self) -> dict:
        """The `DramStats` fields of the pages behind the pool."""
        b = self.backing
        return {
            "locked_in_memory": self.locked_in_memory,
            "ready_bytes": self.ready_bytes,
            "locked_bytes": b.locked_bytes if b is not None else 0,
            "no_lock_why": b.no_lock_why if b is not None else None,
        }

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Whether every page is reserved (and locked where needed) within `timeout_s`."""
        return self.backing is None or self.backing.wait(timeout_s)

    def share_fd(self) -> int:
        """The owner's descriptor to hand to other processes (SCM_RIGHTS, `pass_fds`); it stays
        the region's: send or pass it, never close it. The file has the pool's size when it is
        handed out: set back if a holder changed it."""
        if self._shared is None or self._closed:
            raise PoolError("only the pool's owner, before it closes, can share the pool file")
        return self._shared.handout()

    @property
    def unguarded(self) -> str | None:
        """Why clients could change the owner's pool file's size; None: they cannot."""
        return self._shared.unguarded if self._shared is not None else None

    def check_whole(self) -> None:
        """PoolError unless the pool file still reaches the end of this mapping: a copy past a
        file's end is a SIGBUS, which kills the process. One `fstat`; narrows the window to the
        copy itself where truncation is not prevented (`pool.handout`)."""
        try:
            size = self._map.size()  # fstat of the map's own descriptor
        except (OSError, ValueError):  # closed: the copy says so itself
            return
        if size < self.size_bytes:
            raise PoolError(
                f"the HPKV pool file {self.path} was cut short ({human_bytes(size)} of "
                f"{human_bytes(self.size_bytes)}); the copy is skipped and its blocks are recomputed"
            )

    @classmethod
    def attach(cls, fd: int, size_bytes: int, path: Path | str) -> PoolRegion:
        """Map the pool file open as `fd` (received from its owner), which must be a regular file
        of at least `size_bytes` (what the owner announced; a holder may have written past its
        end); `path` names it in messages. Takes `fd`: it is closed whatever happens."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < size_bytes:
                what = f"{safefs.kind(st.st_mode)}" if not stat.S_ISREG(st.st_mode) else f"a file of {st.st_size} bytes"
                raise PoolError(
                    f"the descriptor passed for the HPKV pool file {path} is {what}, not the "
                    f"pool of {size_bytes} bytes its server announced; restart the HPKV server"
                )
            try:
                region = cls(Path(path), fd, size_bytes, owner=False)
            except (OSError, ValueError) as exc:
                raise PoolError(f"cannot map the HPKV pool file {path}: {exc}") from None
        finally:
            # The map holds the file open by a descriptor of its own, closed with the map (also
            # when the region is collected unclosed): once a restarted server's old pool file has
            # no mapping left, nothing here keeps its memory.
            os.close(fd)
        region._fd = -1
        return region

    def prefault(self) -> None:
        """Map every page of the pool into this process now, in a background thread, so copies
        into and out of it do not take a page fault per 4 KiB (16,384 faults for a 64 MiB load:
        a third of its time here). Costs page tables, 2 MiB per GiB of pool; best effort."""
        # Holds the region weakly: a pool its clients let go of (a dead server's) is unmapped,
        # not populated on to the end.
        target, args = populate, (weakref.WeakMethod(self._populate_range), self.size_bytes)
        threading.Thread(target=target, args=args, name="hpkv-prefault", daemon=True).start()

    def _populate(self) -> None:
        """What `prefault` runs in its thread."""
        populate(weakref.WeakMethod(self._populate_range), self.size_bytes)

    def _populate_range(self, start: int, length: int) -> bool:
        return not self._closed and populate_range(self._map, start, length)

    def unbacked_bytes(self) -> int:
        """Bytes of the pool file with no pages (or blocks) behind them yet: those the background
        reservation has not reached, and on ramfs, which has no fallocate, all those not touched
        yet (they arrive on first touch; until then the memory available still counts them)."""
        return max(0, self.size_bytes - os.fstat(self._fd).st_blocks * 512)

    def view(self, offset: int, num_bytes: int) -> memoryview:
        return self.buf[offset : offset + num_bytes]

    def close(self) -> None:
        """Unmap; the owner also removes the file (mappings held by others stay valid)."""
        if self._closed:
            return
        self._closed = True
        if self.backing is not None:
            self.backing.stop()  # before the map and descriptor it works on go
            self._unshare()  # its watch too
        self.buf.release()
        try:
            self._map.close()
        except BufferError:
            # Someone still holds a view of the map: leave it to the garbage collector.
            log.debug("pool map still exported; leaving unmap to the collector")
        if self._fd < 0:
            return  # a client's: its descriptor was closed once mapped
        if self.owner and poolfile.names(self.path, self._fd):  # not another server's file of the same name
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> PoolRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
