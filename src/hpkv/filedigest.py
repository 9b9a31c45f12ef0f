"""The sha256 of a file's every byte, computed once per version of the file and remembered.

A model's identity covers all of its bytes (`identity.py`); reading 640 GiB at every start would
cost minutes, so each file's digest is read once and then remembered:
- in a cache this user owns (`cache_dir()`: `$XDG_CACHE_HOME/hpkv/file-digests`, else
  `~/.cache/...`), one small entry per file version, named by what cannot be kept while the
  content changes: host, device, inode, and checked against size, `mtime_ns` and `ctime_ns` (the
  kernel sets ctime to now at every write, truncate, chmod, rename or utime; no unprivileged
  process can set it back). The directory is made 0700, opened without following links and
  refused when it is not this user's or others can write it; entries are opened `O_NOFOLLOW`
  and must be this user's regular files. A file changed within RACY_S of being hashed is not
  remembered (a write in the same timestamp tick could leave its stat unchanged).
- Hugging Face snapshot files are taken by their blob's name, unread: an LFS blob is named by
  the sha256 of its content. Trusted only where nobody but this user or root can have written
  the blob, its directory or the snapshot directory, and the blob has not changed since its link
  was made (blob ctime <= the link's mtime: a download writes the blob, then links it; a write
  through the link later, as `save_pretrained` over a snapshot does, moves the blob's ctime past
  it). Blobs named by 40 hex digits (git's sha1 of small files kept in git) are read: sha1 is not
  collision-resistant, and such files are small.
Hashing runs on threads (hashlib releases the GIL on large buffers), one file per thread, at a
lower CPU priority than the engine; a process hashing a file holds `flock` on it, so engine
processes of one node hash each file once between them.

Primitives: `digests(paths, num_threads)` -> `Digests`; `cache_dir()`. Raises `OSError` for a
file that cannot be read or changes while read. Must not know: models, engines, namespaces.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("hpkv.identity")

READ_BYTES = 4 << 20  # per read and thread: hashlib hashes buffers this large without the GIL
LOCK_BYTES_S = 256 << 20  # another process hashing a file gets this long per byte before we hash it too
RACY_S = 2.0  # a file changed this recently is hashed but not remembered
MAX_ENTRIES = 20_000  # the cache's bound; the least recently written entries go first
HASH_NICE = 10  # hashing threads yield the cores to the engine's own start-up
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Digests:
    sha256: dict[Path, str]  # each file's content digest, hex
    num_bytes_read: int  # hashed now
    num_remembered: int  # found in this user's cache
    num_named: int  # Hugging Face blobs taken by name


def digests(paths: list[Path], num_threads: int | None = None) -> Digests:
    """The sha256 of each file (links followed, as the engines follow them)."""
    cache = _Cache.open()
    named = {path: name for path in paths if (name := hub_blob_sha256(path))}
    rest = [path for path in paths if path not in named]
    if num_threads is None:
        num_threads = max(1, min(16, (len(os.sched_getaffinity(0)) + 1) // 2))
    results: dict[Path, tuple[str, int]] = {}
    if rest:
        with ThreadPoolExecutor(max(1, min(num_threads, len(rest))), "hpkv-digest", _lower_priority) as pool:
            results = dict(zip(rest, pool.map(lambda p: _digest(p, cache), rest)))
    sha = {**named, **{path: hexdigest for path, (hexdigest, _) in results.items()}}
    num_read = sum(n for _, n in results.values())
    return Digests(sha, num_read, sum(n == 0 for _, n in results.values()), len(named))


def _lower_priority() -> None:
    try:  # Linux: a thread's nice value is its own
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HASH_NICE)
    except (OSError, AttributeError):
        pass


def _digest(path: Path, cache: _Cache | None) -> tuple[str, int]:
    """(hex digest, bytes read: 0 when remembered)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO planted as a weight file: no hang
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise OSError(f"{path} is not a regular file")
        if cache and (known := cache.get(before)):
            return known, 0
        if _lock(fd, 5.0 + before.st_size / LOCK_BYTES_S) and cache and (known := cache.get(before)):
            return known, 0
        started = time.time()
        h, num = hashlib.sha256(), 0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buf = bytearray(READ_BYTES)
        view = memoryview(buf)
        with open(fd, "rb", buffering=0, closefd=False) as f:
            while got := f.readinto(buf):
                h.update(view[:got])
                num += got
        after = os.fstat(fd)
        if _version(after) != _version(before) or num != before.st_size:
            raise OSError(f"{path} changed while it was read")
        if cache and after.st_ctime_ns < (started - RACY_S) * 1e9:
            cache.put(after, h.hexdigest())
        return h.hexdigest(), num
    finally:
        os.close(fd)


def _lock(fd: int, timeout_s: float) -> bool:
    """Wait (boundedly) for another engine process hashing this file; True if it may have finished.
    A file system without flock, or a lock held too long by anyone, and the file is hashed here too."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        except OSError:
            return False


def _version(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def hub_blob_sha256(path: Path) -> str | None:
    """The sha256 a Hugging Face snapshot file's blob is named by, where that name can be trusted
    (see the module docstring); None where the file must be read."""
    try:
        link = os.lstat(path)
        if not stat.S_ISLNK(link.st_mode):
            return None
        target = os.readlink(path)
        snapshot = Path(os.path.realpath(path.parent))  # a model path may be a link to the snapshot
        blob = Path(os.path.normpath(snapshot / target))
        blobs = blob.parent
        if not _SHA256_NAME.fullmatch(blob.name) or blobs.name != "blobs" or snapshot.parent.name != "snapshots":
            return None
        if blobs.parent != snapshot.parent.parent:  # the blobs of the same repository
            return None
        st = os.lstat(blob)
        if not stat.S_ISREG(st.st_mode) or st.st_ctime_ns > link.st_mtime_ns:
            return None
        if not all(_only_ours(os.lstat(p)) for p in (blob, blobs, snapshot)):
            return None
    except (OSError, ValueError):
        return None
    return blob.name


def _only_ours(st: os.stat_result) -> bool:
    """Nobody but this user or root can have written it."""
    return st.st_uid in (os.geteuid(), 0) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hpkv" / "file-digests"


class _Cache:
    """This user's remembered digests: one entry per file version, in a directory only it can write."""

    def __init__(self, fd: int, host: str) -> None:
        self.fd = fd  # the directory, opened once: names are resolved below it, never through a link
        self.host = host
        self.lock = threading.Lock()

    @classmethod
    def open(cls) -> _Cache | None:
        """None where there is no usable cache (the log says why, once): every digest is read."""
        path = cache_dir()
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            _warn_once(f"cannot open {path} ({exc.strerror or exc})")
            return None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.close(fd)
            _warn_once(f"{path} belongs to uid {st.st_uid} or others can write it (mode {st.st_mode & 0o777:o})")
            return None
        return cls(fd, socket.gethostname())

    def __del__(self) -> None:
        os.close(self.fd)

    def _name(self, st: os.stat_result) -> str:
        return hashlib.sha256(f"{self.host}\0{st.st_dev}\0{st.st_ino}".encode()).hexdigest()[:40]

    def get(self, st: os.stat_result) -> str | None:
        try:
            fd = os.open(self._name(st), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return None
        try:
            own = os.fstat(fd)
            if not stat.S_ISREG(own.st_mode) or own.st_uid != os.geteuid() or own.st_size > 4096:
                return None
            entry = json.loads(os.read(fd, 4096))
            if entry.get("version") != list(_version(st)) or entry.get("host") != self.host:
                return None
            sha = entry.get("sha256")
            return sha if isinstance(sha, str) and _SHA256_NAME.fullmatch(sha) else None
        except (OSError, ValueError, AttributeError):
            return None
        finally:
            os.close(fd)

    def put(self, st: os.stat_result, sha: str) -> None:
        name = self._name(st)
        tmp = f".{name}.{os.getpid()}.{threading.get_native_id()}"
        entry = json.dumps({"host": self.host, "version": list(_version(st)), "sha256": sha}).encode()
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=self.fd)
            try:
                os.write(fd, entry)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            self._bound()
        except OSError as exc:
            _warn_once(f"cannot write to {cache_dir()} ({exc.strerror or exc})")

    def _bound(self) -> None:
        """At most MAX_ENTRIES: past it, the oldest tenth goes (entries of files long gone)."""
        with self.lock:
            names = os.listdir(self.fd)
            if len(names) <= MAX_ENTRIES:
                return
            aged = sorted(names, key=lambda n: _mtime(self.fd, n))
            for name in aged[: len(names) - MAX_ENTRIES * 9 // 10]:
                try:
                    os.unlink(name, dir_fd=self.fd)
                except OSError:
                    pass


def _mtime(dir_fd: int, name: str) -> int:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime_ns
    except OSError:
        return 0


_warned: set[str] = set()


def _warn_once(why: str) -> None:
    if why not in _warned:
        _warned.add(why)
        log.warning(
            "HPKV cannot remember model file digests: %s; every engine start hashes the model's files again. "
            "Fix: make the directory this user's own, mode 0700, or set XDG_CACHE_HOME to one that is",
            why,
        )
