"""The client library engine processes use to talk to the node's HPKV Server.

    client = Client(settings.pool.dir, kind="worker")
    ns = client.register(desc)
    hit = client.lookup(ns, keys)                # leading hits and their tiers
    res = client.reserve(ns, keys)               # copy into res.view(i), then:
    client.commit(ns, keys, reservation=res)     # or client.abort(ns, keys, reservation=res)
    lease = client.lease(ns, keys)               # lease.wait() -> entries ready; copy from lease.view(i)
    client.release(lease)

Every call is bounded by `timeout_s`. When the server cannot be reached, or dies, a call raises
`ServerUnavailable` at once and the caller treats everything as a miss (the engine recomputes);
after `retry_interval_s` the next call tries again, starting a server when `autostart` is on,
and re-registers the namespaces it knew, so a restarted server is picked up without the caller
doing anything. Each failure in a row doubles the wait, up to MAX_RETRY_S: a server that cannot
start (a bad setting) must not cost the engine a Python start-up every second. Reservations and
leases always name the pool mapping they were made in, so bytes never go to or come from the pool
of another server generation.

A handle is only as good as the connection that made it: when that connection closes (a timeout,
a server restart), the server reclaims its reservations and leases, and their slots may be
reused. `holds(handle)` says whether the connection that made a handle is still the live one; a
reader checks it after copying out of a lease and discards the bytes if not. `commit` and `abort`
given the reservation do nothing unless its connection is the live one: on a newer connection
the same key may be reserved again, in a slot another copy is still filling. Neither ever
connects: a new connection holds no reservation to end. Give each thread that copies its own
Client, so one thread's timeout cannot close another's connection mid-copy.

A client trusts only a pool directory that no other uid can replace names in (`pool.directory`:
owned by this uid, root or a uid it is given, and not writable by others without the sticky
bit), checked before it starts or connects to a server; a socket name there that is not a
socket (a link, say) is refused; and only a server that runs as its own uid, root or a uid
it is given (SO_PEERCRED; HPKV_SERVER_ALLOW_UIDS, the uids sharing the pool). It maps the pool
file the server passes as a descriptor with its Welcome, checked to be a regular file of the
size and inode announced, and never opens the pool by name: a name can be swapped.

The clients of one process share their mapping of a server's pool file (`_shared_region`, keyed
by the server's pid and the file's device and inode): each mapping costs page tables, 2 MiB per
GiB of pool once prefaulted, and an engine process keeps a client per copying thread. A mapping
lives while a client or a handle still refers to it, so a handle's bytes stay valid after a
restart; a new server's pool file gets a mapping of its own. A descriptor received for a pool
already mapped is closed at once.

Thread-safe: one connection, calls serialised by a lock.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TypeVar

from .. import safefs
from ..errors import HpkvError, PoolError
from ..keys import NamespaceDesc
from ..pool import directory as pool_directory
from ..pool.region import POOL_FILE_NAME, PoolRegion
from ..procs import peer_ids
from ..stats import ServerStats
from ..stats import from_wire as stats_from_wire
from ..types import Lookup, Tier
from . import protocol as p
from .autostart import ServerUnavailable, check_socket, ensure_server

_TIERS = {int(t): t for t in Tier}  # wire code -> Tier, without Enum's slow constructor
_R = TypeVar("_R")


class ServerError(HpkvError):
    """The server refused a request; `code` says why (see protocol.Error)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Reservation:
    region: PoolRegion
    entry_bytes: int
    offsets: list[int | None]  # None: skip this key (held already, or no room)
    epoch: int = 0
    deadline: float = math.inf  # time.monotonic() past which the server may have taken the slots back

    def view(self, i: int) -> memoryview:
        offset = self.offsets[i]
        if offset is None:
            raise ValueError(f"key {i} of this reservation has no slot (held already, or no room)")
        return self.region.view(offset, self.entry_bytes)


@dataclass
class LeaseHandle:
    id: int
    region: PoolRegion
    entry_bytes: int
    offsets: list[int]
    num_ready: int | None
    epoch: int
    deadline: float = math.inf  # as Reservation's

    def view(self, i: int) -> memoryview:
        return self.region.view(self.offsets[i], self.entry_bytes)


MAX_RETRY_S = 30.0

# (server pid, device, inode, prefaulted) -> the mapping this process's clients share. Weak:
# the last client or handle to let go of a mapping unmaps it. The inode cannot be reused while
# the mapping lives (its file stays open), and a new server has a new pid, so a key never names
# a mapping of another file. Prefaulted mappings are apart: a client that only looks up keys
# (a scheduler) does not take on the page tables of a copying one.
_regions: weakref.WeakValueDictionary[tuple, PoolRegion] = weakref.WeakValueDictionary()
_regions_lock = threading.Lock()


def _shared_region(fd: int, welcome: p.Welcome, path: Path, prefault: bool) -> PoolRegion:
    """This process's mapping of the pool file open as `fd` (which the server that sent `welcome`
    passed), made on first use. Takes `fd`: closed whatever happens. ServerUnavailable: `fd` is
    not the pool the Welcome announced."""
    try:
        st = os.fstat(fd)
        if st.st_ino != welcome.pool_inode:
            raise ServerUnavailable(f"the HPKV server passed a descriptor of inode {st.st_ino}, not of its pool "
                                    f"file {welcome.pool_path} (inode {welcome.pool_inode}); restart the server")
        key = (welcome.server_pid, st.st_dev, st.st_ino, prefault)
        with _regions_lock:
            region = _regions.get(key)
            if region is not None:
                return region
            region = PoolRegion.attach(os.dup(fd), welcome.pool_bytes, path)
            if prefault:
                region.prefault()
            _regions[key] = region
            return region
    finally:
        os.close(fd)


class Client:
    def __init__(self, directory: str | os.PathLike, kind: str, timeout_s: float = 5.0,
                 autostart: bool = True, retry_interval_s: float = 1.0, start_timeout_s: float = 60.0,
                 prefault: bool = False, trusted_uids: tuple[int, ...] = ()) -> None:
        """`prefault`: map every pool page as soon as the pool is attached (for clients that copy
        through the pool: a first touch per 4 KiB page costs as much as the copy).
        `trusted_uids`: server uids accepted besides this one's and root (HPKV_SERVER_ALLOW_UIDS)."""
        self.directory = Path(directory)
        self.prefault = prefault
        self.trusted_uids = trusted_uids
        self.kind = kind
        self.timeout_s = timeout_s
        self.autostart = autostart
        self.retry_interval_s = retry_interval_s
        self.start_timeout_s = start_timeout_s
        self.region: PoolRegion | None = None
        self.client_id = 0
        self.server_pid = 0
        self.epoch = 0  # bumps whenever a connection ends: handles made before are void
        self.slot_timeout_s = 0.0  # the server's limit on a handle (Welcome); 0: none
        self._sock: socket.socket | None = None
        self._lock = threading.RLock()
        self._retry_at = 0.0
        self._failures = 0  # in a row: each doubles the wait before the next attempt
        self._last_error = ""
        self._namespaces: dict[str, tuple[str, int]] = {}  # ns -> (desc json, entry bytes)

    # -- connection ---------------------------------------------------------------------------

    def connect(self) -> None:
        with self._lock:
            self._ensure()

    def close(self) -> None:
        with self._lock:
            self._drop("closed")
            self._retry_at = 0.0
            self._failures = 0

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def _ensure(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        now = time.monotonic()
        if now < self._retry_at:
            raise ServerUnavailable(f"HPKV server unavailable ({self._last_error}); retrying in "
                                    f"{self._retry_at - now:.1f} s")
        try:
            self._open()
        except ServerUnavailable as exc:
            self._fail(str(exc))
        except ServerError as exc:  # refused (another protocol version, say): the same wait before trying again
            self._failures += 1
            self._drop(str(exc))
            raise
        except OSError as exc:
            self._fail(f"cannot reach the HPKV server in {self.directory}: {exc.strerror or exc}")
        assert self._sock is not None  # _open connected, or raised
        return self._sock

    def _open(self) -> None:
        socket_path = self.directory / p.SOCKET_NAME
        trusted = safefs.owners(self.trusted_uids)
        try:
            pool_directory.check(self.directory, trusted)
        except PoolError as exc:
            raise ServerUnavailable(str(exc)) from None
        if self.autostart:
            ensure_server(self.directory, self.start_timeout_s, self.trusted_uids)
        else:
            check_socket(socket_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        fds: list[int] = []
        try:
            sock.connect(str(socket_path))
            self._check_peer(sock, socket_path)
            sock.sendall(p.encode(p.Hello(p.PROTOCOL_VERSION, self.kind, os.getpid())))
            body, fds = p.recv_frame_fds(sock)
            welcome = p.decode_reply(body)
            if isinstance(welcome, p.Error):
                raise ServerError(welcome.code, welcome.message)
            welcome = _expect(welcome, p.Welcome)
            if len(fds) != 1:
                raise ServerUnavailable(f"the HPKV server on {socket_path} passed {len(fds)} descriptors with its "
                                        "Welcome, not its pool file; restart it (with this hpkv version)")
            # Takes the descriptor; a new server maps a new pool file, even where the file
            # system gave it the old one's inode number (not tmpfs): its pid tells them apart.
            region = _shared_region(fds.pop(), welcome, self.directory / POOL_FILE_NAME, self.prefault)
        except (OSError, EOFError, p.FrameError) as exc:
            sock.close()
            raise ServerUnavailable(f"cannot reach the HPKV server at {socket_path}: {exc}") from None
        except PoolError as exc:  # not a pool of the size announced
            sock.close()
            raise ServerUnavailable(str(exc)) from None
        except BaseException:
            sock.close()
            raise
        finally:
            p.close_fds(fds)
        self.region = region  # the old map lives on in old handles
        self._sock = sock
        self.client_id = welcome.client_id
        self.server_pid = welcome.server_pid
        self.slot_timeout_s = welcome.slot_timeout_s
        for desc_json, _ in list(self._namespaces.values()):
            self._roundtrip(p.Register(desc_json), self.timeout_s)
        self._failures = 0

    def _check_peer(self, sock: socket.socket, socket_path: Path) -> None:
        """Refuse a server that runs as neither this uid nor root: in a pool directory others may
        write to (a shared ramfs), anyone could listen on the socket and be handed the KV
        cache, or hand out bytes of their own."""
        _, uid, _ = peer_ids(sock)
        if uid not in (os.geteuid(), 0, *self.trusted_uids):
            raise ServerUnavailable(
                f"refusing the HPKV server on {socket_path}: it runs as uid {uid}, not as this user (uid "
                f"{os.geteuid()}), root or a uid in HPKV_SERVER_ALLOW_UIDS; give this user a pool directory only "
                f"it can write to (HPKV_SHARE_MEM_FILE_PATH, mode 0700), run the server as uid {os.geteuid()}, "
                f"or, if uid {uid} is meant to share this pool, add it to HPKV_SERVER_ALLOW_UIDS")

    def _fail(self, message: str) -> NoReturn:
        self._failures += 1
        self._drop(message)
        raise ServerUnavailable(message)

    def _drop(self, reason: str) -> None:
        sock = self._sock
        if sock is not None:
            # The epoch first, the close after: `holds` reads both without the lock, and must
            # say False before the server can see the connection end and reuse its slots.
            self.epoch += 1
            self._sock = None
            sock.close()
        self._last_error = reason
        wait = self.retry_interval_s * 2 ** min(max(self._failures - 1, 0), 16)
        self._retry_at = time.monotonic() + min(wait, max(self.retry_interval_s, MAX_RETRY_S))

    def _call(self, msg: p.Msg, timeout_s: float | None = None) -> p.Reply:
        with self._lock:
            self._ensure()
            return self._roundtrip(msg, timeout_s or self.timeout_s)

    def _ask(self, msg: p.Msg, reply_type: type[_R], timeout_s: float | None = None) -> _R:
        """`_call`, for the one reply type `msg` is answered with."""
        return _expect(self._call(msg, timeout_s), reply_type)

    def _roundtrip(self, msg: p.Msg, timeout_s: float) -> p.Reply:
        sock = self._sock
        assert sock is not None  # the caller holds the lock and has connected
        try:
            sock.settimeout(timeout_s)
            sock.sendall(p.encode(msg))
            reply = p.decode_reply(p.recv_frame(sock))
        except TimeoutError:
            self._fail(f"the HPKV server did not answer {type(msg).__name__} within {timeout_s:.1f} s")
        except (OSError, EOFError, p.FrameError) as exc:
            self._fail(f"lost the HPKV server: {exc or type(exc).__name__}")
        except BaseException:  # interrupted between request and reply: the next reply read would be this one's
            self._drop("a call was interrupted")
            raise
        if isinstance(reply, p.Error):
            raise ServerError(reply.code, reply.message)
        return reply

    # -- operations ---------------------------------------------------------------------------

    def register(self, desc: NamespaceDesc) -> str:
        reply = self._ask(p.Register(desc.to_json()), p.Registered)
        self._namespaces[reply.ns] = (desc.to_json(), reply.entry_bytes)
        return reply.ns

    def lookup(self, ns: str, keys: Sequence[bytes]) -> Lookup:
        return Lookup(tuple(map(_TIERS.__getitem__, self._ask(p.Lookup(ns, _as_list(keys)), p.Hits).tiers)))

    def reserve(self, ns: str, keys: Sequence[bytes], hold: str = "") -> Reservation:
        """With `hold`, the reservation is settled by whoever calls `settle(hold)` (this client
        neither commits nor aborts it)."""
        with self._lock:
            deadline = self._deadline()
            offsets = self._ask(p.Reserve(ns, _as_list(keys), hold), p.Offsets).offsets
            return Reservation(self._region(), self._namespaces[ns][1], offsets, self.epoch, deadline)

    def commit(self, ns: str, keys: Sequence[bytes], *, reservation: Reservation | None = None) -> int:
        """Publish reserved keys; returns how many were. With `reservation` (the handle that
        reserved them), 0 and nothing sent unless the connection that made it is the live one
        (else a reservation of the same keys made since would be published before it is copied
        into). Without it, any reservation of the keys the live connection holds is published."""
        with self._lock:
            if not self._live(reservation):
                return 0
            return _expect(self._roundtrip(p.Commit(ns, _as_list(keys)), self.timeout_s), p.Count).num

    def abort(self, ns: str, keys: Sequence[bytes], hold: str = "", *, reservation: Reservation | None = None) -> None:
        """Give back reserved slots (those reserved in `hold`, with one: its owner may always
        give them back, never commit them). With `reservation`, only if the connection that made
        it is the live one: slots a newer one reserved may be being copied into."""
        with self._lock:
            if self._live(reservation):
                self._roundtrip(p.Abort(ns, _as_list(keys), hold), self.timeout_s)

    def _live(self, reservation: Reservation | None) -> bool:
        """Connected, and (given a reservation) on the connection that made it. Caller holds the
        lock. Never connects: a new connection holds no reservation to commit or abort."""
        return self._sock is not None and (reservation is None or reservation.epoch == self.epoch)

    def settle(self, hold: str, abort: Sequence[bytes]) -> p.Settled:
        """Commit every client's reservations made with `hold`, except the keys in `abort`."""
        return self._ask(p.Settle(hold, _as_list(abort)), p.Settled)

    def lease(self, ns: str, keys: Sequence[bytes]) -> LeaseHandle:
        with self._lock:
            deadline = self._deadline()
            r = self._ask(p.Lease(ns, _as_list(keys)), p.Leased)
            return LeaseHandle(r.lease_id, self._region(), self._namespaces[ns][1], r.offsets, r.num_ready,
                               self.epoch, deadline)

    def _region(self) -> PoolRegion:
        """The pool mapping of the live connection. Caller holds the lock, after a call."""
        assert self.region is not None  # _open maps the pool before it answers any call
        return self.region

    def _deadline(self) -> float:
        """When a handle asked for now stops being held: the server's time limit counts from
        when it got the request, later than now, so the client lets go first."""
        return time.monotonic() + self.slot_timeout_s if self.slot_timeout_s > 0 else math.inf

    def wait(self, lease: LeaseHandle, timeout_s: float = 5.0) -> int | None:
        """Entries of the lease ready to copy from, or None if promotions are still running."""
        if lease.num_ready is not None:
            return lease.num_ready
        with self._lock:
            if lease.epoch != self.epoch:
                return 0  # the connection that held it is gone, and the lease with it
            r = self._ask(p.LeaseWait(lease.id, timeout_s), p.Leased, timeout_s + self.timeout_s)
        lease.num_ready = r.num_ready
        return r.num_ready

    def release(self, lease: LeaseHandle) -> None:
        with self._lock:
            if self.holds(lease):
                self._call(p.Release(lease.id))

    def holds(self, handle: LeaseHandle | Reservation) -> bool:
        """Whether the server still holds `handle`'s slots for us: the connection that made it is
        the live one, and the server's time limit on it (HPKV_SERVER_SLOT_TIMEOUT_S) has not
        passed. Lock-free: the epoch is read first, and it bumps before the connection closes
        (`_drop`)."""
        return handle.epoch == self.epoch and self._sock is not None and time.monotonic() < handle.deadline

    def clear(self, memory: bool = True, storage: bool = False, ns: str | None = None) -> p.Cleared:
        return self._ask(p.Clear(memory, storage, ns), p.Cleared, max(self.timeout_s, 300.0))

    def stats(self) -> ServerStats:
        """The server's snapshot; `StatsMismatch` if it does not fit `hpkv.stats`."""
        return stats_from_wire(self._ask(p.Stats(), p.StatsReply).stats)


def _expect(reply: p.Reply, reply_type: type[_R]) -> _R:
    """`reply` as the type its request is answered with; ServerError if the server sent another."""
    if not isinstance(reply, reply_type):
        raise ServerError("bad_reply", f"the HPKV server answered {type(reply).__name__}, not {reply_type.__name__}")
    return reply


def _as_list(keys: Sequence[bytes]) -> list[bytes]:
    """Keys as the list a message holds: typed keys (`keys.Key`) are bytes; a list goes as it is."""
    return keys if isinstance(keys, list) else list(keys)
