"""The storage tier's capacity: how many bytes of entry files it may hold, and the one place the
HPKV_KV_STORAGE_SIZE=auto formula lives (`auto_capacity_bytes`; `hpkv doctor` asks it too).

Sized at start (a setting, or auto: a share of the room the file system has, plus, once the
start-up scan is in, the same share of what this tier's files take there). A write counts its
bytes in flight until it is done (`reserve`/`release`), so eviction makes room for them
(`excess`). A file system with no room even after an eviction (a full disk, a quota `auto`
cannot see) teaches what fits (`learn`): only lowered, to at least one file, and back to the
size after CAPACITY_RECOVERY_S without another such error (others' files that took the room may
be gone by then).

Primitives: `auto_capacity_bytes`, `little_room`, `CapacityPolicy` (`size_at_start`,
`size_with_own`, `reserve`, `release`, `excess`, `share`, `no_room`, `learn`, `recover`).
Must not know: the index, the files, how eviction picks its victims.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..fsinfo import MEMORY_FS, room_bytes
from . import root as storage_root

log = logging.getLogger("hpkv.storage.tier")

AUTO_CAPACITY_FRACTION = 0.8
SMALL_AUTO_CAPACITY = 1 << 30  # below this an automatic capacity is worth a warning
CAPACITY_RECOVERY_S = 600.0  # a capacity learned from "no room" holds this long after the last such error


def auto_capacity_bytes(room: int, own_bytes: int = 0) -> int:
    """HPKV_KV_STORAGE_SIZE=auto: a share of the `room` the file system has (`fsinfo.room_bytes`)
    and of the `own_bytes` HPKV's files already take there."""
    return int(room * AUTO_CAPACITY_FRACTION) + int(own_bytes * AUTO_CAPACITY_FRACTION)


def little_room(capacity_bytes: int) -> bool:
    """Whether an automatic capacity is small enough to warn about."""
    return capacity_bytes < SMALL_AUTO_CAPACITY


class CapacityPolicy:
    def __init__(self, root: Path, configured_bytes: int | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._root = root
        self.auto = configured_bytes is None
        self.capacity_bytes = configured_bytes or 0
        self.sized_bytes = self.capacity_bytes  # what the setting (or auto) gave; `learn` goes below it
        self._room_bytes = 0
        self._inflight_bytes = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._learned = False
        self._no_room_at = -math.inf
        self.share = 1.0  # of the capacity this tier evicts for: in a cluster, its share of the parts

    def size_at_start(self, fs_type: str, promised_ram_bytes: int) -> None:
        """Auto: a share of the room there is now. `promised_ram_bytes`: memory promised and not
        taken yet (a DRAM pool on ramfs), which a ramfs's room leaves out."""
        if self.auto:
            self._room_bytes = room_bytes(self._root, promised_ram_bytes)
            self.capacity_bytes = self.sized_bytes = auto_capacity_bytes(self._room_bytes)
        if fs_type in MEMORY_FS:
            storage_root.say_memory_fs(
                self._root, fs_type, self.auto, self.capacity_bytes, promised_ram_bytes, AUTO_CAPACITY_FRACTION
            )

    def size_with_own(self, own_bytes: int) -> None:
        """Auto, once the start-up scan has counted this tier's files: they count too."""
        if not self.auto:
            return
        self.capacity_bytes = self.sized_bytes = auto_capacity_bytes(self._room_bytes, own_bytes)
        if little_room(self.capacity_bytes):
            fate = "are not written" if self.capacity_bytes == 0 else "are evicted soon after they are written"
            log.warning(
                "the storage tier holds only %d bytes: HPKV_KV_STORAGE_SIZE=auto takes %d%% of the "
                "space free under %s when the server starts, and there was little; KV files %s. Free "
                "space there and restart the server, or set HPKV_KV_STORAGE_SIZE",
                self.capacity_bytes,
                round(AUTO_CAPACITY_FRACTION * 100),
                self._root,
                fate,
            )

    def reserve(self, size: int) -> bool:
        """Count `size` bytes in flight; False (nothing counted) if they can never fit."""
        if self._learned and self._clock() - self._no_room_at >= CAPACITY_RECOVERY_S:
            self.recover()
        if size > self.capacity_bytes:
            return False
        with self._lock:
            self._inflight_bytes += size
        return True

    def release(self, size: int) -> None:
        """The write `reserve` counted is done (its file indexed or not)."""
        with self._lock:
            self._inflight_bytes -= size

    def excess(self, used_bytes: int) -> int:
        """Bytes over the capacity (this tier's share of it) with `used_bytes` counted and what is in flight."""
        limit = self.capacity_bytes if self.share >= 1.0 else int(self.capacity_bytes * self.share)
        return used_bytes + self._inflight_bytes - limit

    def no_room(self) -> None:
        """A write met "no room" even after an eviction: the recovery counts from now."""
        with self._lock:  # `recover` reads it under the lock: it cannot undo what is learned now
            self._no_room_at = self._clock()

    def learn(self, used_bytes: int, size: int) -> None:
        """No room with `used_bytes` of this tier's files there, even after an eviction: that is
        what fits, whatever the setting said. Only lowered, and to at least one file, so the
        tier goes on writing what fits."""
        with self._lock:
            learned = max(used_bytes, size)
            if learned >= self.capacity_bytes:
                return
            self.capacity_bytes = learned
            first, self._learned = not self._learned, True
        if first:
            log.warning(
                "the file system under %s has no room for more KV files (full, or a quota) with %d bytes of "
                "them there: the storage tier now holds at most that, not the %d bytes it was sized to "
                "(HPKV_KV_STORAGE_SIZE=%s), until %.0f minutes pass without such an error, when it tries "
                "that size again. Set HPKV_KV_STORAGE_SIZE below the space (or quota) HPKV may use there",
                self._root,
                learned,
                self.sized_bytes,
                "auto" if self.auto else self.sized_bytes,
                CAPACITY_RECOVERY_S / 60,
            )

    def recover(self) -> None:
        """Back to the size, if CAPACITY_RECOVERY_S passed since the last "no room"."""
        with self._lock:  # checked again here: a "no room" just before must keep what it learned
            if not self._learned or self._clock() - self._no_room_at < CAPACITY_RECOVERY_S:
                return
            learned, self.capacity_bytes, self._learned = self.capacity_bytes, self.sized_bytes, False
        log.info(
            "no room errors under %s for %.0f minutes: the storage tier holds up to %d bytes again (it held "
            "at most %d since the last one)",
            self._root,
            CAPACITY_RECOVERY_S / 60,
            self.sized_bytes,
            learned,
        )
