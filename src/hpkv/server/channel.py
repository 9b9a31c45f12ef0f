"""The channel of a `Client` to the node's HPKV Server: socket, handshake, pool mapping.

Owns the socket (one, calls serialised by a lock), the Hello/Welcome handshake, the trust checks
(a pool directory no other uid can replace names in; a server running as this uid, root or a
uid in HPKV_SERVER_ALLOW_UIDS, by SO_PEERCRED), the mapping of the pool file the server passes
as a descriptor (never opened by name: a name can be swapped), reconnection with doubling
backoff up to MAX_RETRY_S (a server that cannot start must not cost a start-up a second), cut
short once the server this channel lost is dead and another answers on the socket (looked at
most every PROBE_S: a server restarted after a crash is used again within a second of answering,
not after the backoff), the re-registering of known namespaces on a new connection, and the
epoch, which bumps when a connection ends so handles made on it are known void. A connection
whose server ended while the client was idle, with another answering already, is replaced
before the next call is sent (that call is the new server's, not a miss); one the server closed
for being idle (it answers `Error("idle")`, or takes no more bytes) is opened again at once, and
a request it did not read is sent again, once (`_call`).
Primitives: `_call`/`_ask` (one request and its reply), `_drop`, `_region`, `_deadline`.
Knows nothing of what the requests mean.

The clients of one process share a mapping per server pool file (`_shared_region`): each
mapping costs page tables, and an engine keeps a client per copying thread.
"""

from __future__ import annotations

import math
import os
import select
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import NoReturn, TypeVar

from .. import safefs
from ..errors import HpkvError, PoolError
from ..pool import directory as pool_directory
from ..pool.region import POOL_FILE_NAME, PoolRegion
from ..procs import peer_ids, pid_running
from . import protocol as p
from .autostart import ServerUnavailable, answers, check_socket, ensure_server

_R = TypeVar("_R")
_C = TypeVar("_C", bound="Channel")


class ServerError(HpkvError):
    """The server refused a request; `code` says why (see protocol.Error)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Unsent(ServerUnavailable):
    """The connection ended before the server read the request (it closed an idle connection):
    the request may be sent again, once, on a new connection."""


MAX_RETRY_S = 30.0
PROBE_S = 0.25  # while waiting to retry, how often the socket is looked at for a new server

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
            raise ServerUnavailable(
                f"the HPKV server passed a descriptor of inode {st.st_ino}, not of its pool "
                f"file {welcome.pool_path} (inode {welcome.pool_inode}); restart the server"
            )
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


class Channel:
    """One connection to the server, opened on demand and again after a failure (with backoff)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        kind: str,
        timeout_s: float = 5.0,
        autostart: bool = True,
        retry_interval_s: float = 1.0,
        start_timeout_s: float = 60.0,
        prefault: bool = False,
        trusted_uids: tuple[int, ...] = (),
    ) -> None:
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
        self._lost_pid = 0  # the server whose connection ended last (0: none yet)
        self._probe_at = 0.0
        self._namespaces: dict[str, tuple[str, int]] = {}  # ns -> (desc json, entry bytes)

    def connect(self) -> None:
        with self._lock:
            self._ensure()

    def close(self) -> None:
        with self._lock:
            self._drop("closed")
            self._retry_at = 0.0
            self._failures = 0

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def _ensure(self) -> socket.socket:
        if self._sock is not None:
            if not self._server_replaced(self._sock):
                return self._sock
            self._drop("the HPKV server of this connection ended, and another answers")
            self._failures, self._retry_at = 0, 0.0  # no failure: the call goes to the new one now
        now = time.monotonic()
        if now < self._retry_at and not self._socket_renewed(now):
            raise ServerUnavailable(
                f"HPKV server unavailable ({self._last_error}); retrying in {self._retry_at - now:.1f} s"
            )
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
                raise ServerUnavailable(
                    f"the HPKV server on {socket_path} passed {len(fds)} descriptors with its "
                    "Welcome, not its pool file; restart it (with this hpkv version)"
                )
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
                f"or, if uid {uid} is meant to share this pool, add it to HPKV_SERVER_ALLOW_UIDS"
            )

    def _fail(self, message: str) -> NoReturn:
        self._failures += 1
        self._drop(message)
        raise ServerUnavailable(message)

    def _server_replaced(self, sock: socket.socket) -> bool:
        """Whether the server of `sock` closed it and is dead, and another answers on the socket
        (restarted while this client was idle): a poll per call, the rest only then."""
        try:
            closed = _readable(sock) and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except OSError:
            closed = True
        return closed and not pid_running(self.server_pid) and answers(self.directory / p.SOCKET_NAME)

    def _socket_renewed(self, now: float) -> bool:
        """Whether the server this channel lost is dead and another answers on the socket:
        looked at most every PROBE_S, so a server that keeps failing to start costs a request a
        clock read. A live server that failed a call (overloaded, say) gets the whole backoff."""
        if now < self._probe_at or not self._lost_pid:
            return False
        self._probe_at = now + PROBE_S
        return not pid_running(self._lost_pid) and answers(self.directory / p.SOCKET_NAME)

    def _drop(self, reason: str) -> None:
        sock = self._sock
        if sock is not None:
            # The epoch first, the close after: `alive` reads both without the lock, and must
            # say False before the server can see the connection end and reuse its slots.
            self.epoch += 1
            self._sock = None
            sock.close()
        self._last_error = reason
        if sock is not None:
            self._lost_pid = self.server_pid
        self._probe_at = time.monotonic() + PROBE_S
        wait = self.retry_interval_s * 2 ** min(max(self._failures - 1, 0), 16)
        self._retry_at = time.monotonic() + min(wait, max(self.retry_interval_s, MAX_RETRY_S))

    def _call(self, msg: p.Msg, timeout_s: float | None = None) -> p.Reply:
        with self._lock:
            self._ensure()
            try:
                return self._roundtrip(msg, timeout_s or self.timeout_s)
            except _Unsent:
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
            try:
                sock.sendall(p.encode(msg))
            except (BrokenPipeError, ConnectionResetError):
                if _told_idle(sock):  # the server closed this connection idle: it read nothing
                    self._closed_by_server()
                raise
            reply = p.decode_reply(p.recv_frame(sock))
        except _Unsent:
            raise
        except TimeoutError:
            self._fail(f"the HPKV server did not answer {type(msg).__name__} within {timeout_s:.1f} s")
        except (OSError, EOFError, p.FrameError) as exc:
            self._fail(f"lost the HPKV server: {exc or type(exc).__name__}")
        except BaseException:  # interrupted between request and reply: the next reply read would be this one's
            self._drop("a call was interrupted")
            raise
        if isinstance(reply, p.Error):
            if reply.code == "idle":
                self._closed_by_server()
            raise ServerError(reply.code, reply.message)
        return reply

    def _closed_by_server(self) -> NoReturn:
        """The server closed this connection, idle, before it read a request: drop it, and let
        the next call connect at once (this is no failure of the server's)."""
        self._drop("the HPKV server closed an idle connection")
        self._failures = 0
        self._retry_at = 0.0
        raise _Unsent("the HPKV server closed an idle connection before reading the request")

    def _region(self) -> PoolRegion:
        """The pool mapping of the live connection. Caller holds the lock, after a call."""
        assert self.region is not None  # _open maps the pool before it answers any call
        return self.region

    def _deadline(self) -> float:
        """When a handle asked for now stops being held: the server's time limit counts from
        when it got the request, later than now, so the client lets go first."""
        return time.monotonic() + self.slot_timeout_s if self.slot_timeout_s > 0 else math.inf


def _readable(sock: socket.socket) -> bool:
    """Whether `sock` has bytes or an end to read now (between calls: only if its server closed it)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _told_idle(sock: socket.socket) -> bool:
    """Whether what the server sent before it closed `sock` is its `Error("idle")`."""
    try:
        sock.setblocking(False)
        reply = p.decode_reply(p.recv_frame(sock))
    except (OSError, EOFError, p.FrameError):
        return False
    return isinstance(reply, p.Error) and reply.code == "idle"


def _expect(reply: p.Reply, reply_type: type[_R]) -> _R:
    """`reply` as the type its request is answered with; ServerError if the server sent another."""
    if not isinstance(reply, reply_type):
        raise ServerError("bad_reply", f"the HPKV server answered {type(reply).__name__}, not {reply_type.__name__}")
    return reply
