"""The server's connections: one thread waits on all of them; a bounded pool of threads answers.

Owns every client connection from accept to close. One thread (`ConnectionLoop.run`) accepts,
refuses a peer whose uid may not talk to this server (`Error("permission")`, logged at most once
a minute with the count refused meanwhile) or that has HPKV_SERVER_MAX_CONNECTIONS_PER_UID
connections already (`Error("limit")`), and reads each frame whole without blocking. It closes a
connection that sends part of a frame, or no Hello, and then nothing for
HPKV_SERVER_FRAME_TIMEOUT_S, and one that sent nothing for HPKV_SERVER_CONNECTION_IDLE_S while it
holds no slot: it is told so first (`Error("idle")`: the client knows its next request was not
read, and sends it again on a new connection). A whole frame goes to a pool of at most WORKERS
threads, which answer it (`Server.welcome` for the Hello, `Server.answer` after); a connection
has at most one request in hand and the rest of its bytes wait, and one uid has at most
USER_WORKERS requests in hand, so a request that blocks (a lease wait, a clear of storage) holds
one thread and stalls nobody else, and idle connections hold no thread at all.
Primitives: `ConnectionLoop(listener, peer, ...)`, `run()`. Must not know what a request does,
nor what a client holds beyond `peer.holds_nothing`.
"""

from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Protocol

from ..procs import peer_ids
from ..throttle import Throttle
from . import protocol as p
from .handlers import ClientInfo

log = logging.getLogger("hpkv.server")

WORKERS = 64  # threads answering requests, at most; made as requests need them
USER_WORKERS = 48  # of which one uid's requests hold at most: the rest are left to other uids
TICK_S = 0.2  # how often time-outs (and the server's stop) are looked at
READ_BYTES = 1 << 16
REFUSAL_LOG_S = 60.0
ACCEPT_RETRY_S = 0.2  # the pause after a failed accept (out of file descriptors): no spinning


class Peer(Protocol):
    """What the loop asks of the server."""

    def refusal(self, uid: int) -> p.Error | None: ...
    def connected(self, pid: int, uid: int) -> ClientInfo: ...
    def welcome(self, conn: socket.socket, client: ClientInfo, frame: bytes) -> bool: ...
    def answer(self, conn: socket.socket, client: ClientInfo, frame: bytes) -> bool: ...
    def holds_nothing(self, client: ClientInfo) -> bool: ...
    def closed(self, client: ClientInfo) -> None: ...
    def tick(self) -> bool: ...  # False: stop serving


@dataclass
class _Conn:
    sock: socket.socket
    client: ClientInfo
    welcomed: bool = False
    busy: bool = False  # a frame of it is in a worker's hands
    buf: bytearray = field(default_factory=bytearray)
    since: float = field(default_factory=time.monotonic)  # last frame answered, or connected
    partial_since: float = 0.0  # when the unfinished frame's first byte came (0: none)


class ConnectionLoop:
    def __init__(
        self,
        listener: socket.socket,
        peer: Peer,
        max_per_uid: int,
        frame_timeout_s: float,
        idle_timeout_s: float,
    ) -> None:
        self._listener = listener
        self._peer = peer
        self._max_per_uid = max_per_uid
        self._frame_timeout_s = frame_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._done: queue.SimpleQueue[tuple[_Conn, bool]] = queue.SimpleQueue()
        self._pool = _Workers(WORKERS)
        self._conns: dict[socket.socket, _Conn] = {}
        self._per_uid: dict[int, int] = defaultdict(int)  # connections open
        self._in_hand: dict[int, int] = defaultdict(int)  # requests with a worker
        self._queued: dict[int, deque[tuple[_Conn, bytes]]] = defaultdict(deque)  # past USER_WORKERS
        self._refusals = Throttle()
        self._accept_warnings = Throttle()
        self._accept_paused_until = 0.0  # 0: the listener is waited on

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until `peer.tick()` says stop; then close every connection."""
        self._listener.setblocking(False)
        self._wake_r.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        next_tick = 0.0
        try:
            while True:
                for key, _ in self._selector.select(TICK_S):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._finished()
                    else:
                        self._read(self._conns[key.fileobj])  # type: ignore[index]
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK_S
                    if not self._peer.tick():
                        return
                    self._expire(now)
                    if self._accept_paused_until and now >= self._accept_paused_until:
                        self._accept_paused_until = 0.0
                        self._selector.register(self._listener, selectors.EVENT_READ)
        finally:
            self._pool.shutdown()
            for conn in list(self._conns.values()):
                conn.sock.close()
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept(self) -> None:
        for _ in range(64):  # a batch, then the others get a turn
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of file descriptors or memory: the connected go on
                if self._accept_warnings.allows(time.monotonic(), 60.0):
                    log.warning(
                        "cannot accept a connection: %s; the clients connected already are served, new ones "
                        "are retried (raise the limit on open files, `ulimit -n`, if this repeats)",
                        exc,
                    )
                self._selector.unregister(self._listener)  # until the next tick but one
                self._accept_paused_until = time.monotonic() + ACCEPT_RETRY_S
                return
            pid, uid, _ = peer_ids(sock)
            refusal = self._peer.refusal(uid)
            if refusal is None and self._per_uid[uid] >= self._max_per_uid:
                refusal = p.Error(
                    "limit",
                    f"uid {uid} has {self._per_uid[uid]} connections to this HPKV server already, its limit "
                    "(HPKV_SERVER_MAX_CONNECTIONS_PER_UID); close some, or raise the limit where the server starts",
                )
            if refusal is not None:
                self._refuse(sock, pid, uid, refusal)
                continue
            sock.setblocking(False)
            conn = _Conn(sock, self._peer.connected(pid, uid))
            self._per_uid[uid] += 1
            self._conns[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ)

    def _refuse(self, sock: socket.socket, pid: int, uid: int, refusal: p.Error) -> None:
        try:
            sock.setblocking(False)
            sock.send(p.encode(refusal))  # a few hundred bytes: an empty socket buffer takes them
        except OSError:
            pass
        sock.close()
        kind = refusal.code
        unsaid = self._refusals.num_refused(kind)
        if self._refusals.allows(time.monotonic(), REFUSAL_LOG_S, kind):
            log.warning(
                "refused a client of uid %d (pid %d): %s (said at most once a minute; %d refused unsaid before it)",
                uid,
                pid,
                refusal.message,
                unsaid,
            )

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        if not conn.buf:
            conn.partial_since = time.monotonic()
        conn.buf += data
        self._next_frame(conn)

    def _next_frame(self, conn: _Conn) -> None:
        """Hand a whole frame of `conn` to a worker, if its buffer holds one."""
        if len(conn.buf) < 4:
            return
        try:
            length = p.frame_length(bytes(conn.buf[:4]))
        except p.FrameError as exc:
            self._refuse_frame(conn, p.Error(exc.code, str(exc)))
            return
        if len(conn.buf) < 4 + length:
            return
        frame = bytes(conn.buf[4 : 4 + length])
        del conn.buf[: 4 + length]
        conn.partial_since = time.monotonic() if conn.buf else 0.0
        conn.busy = True
        self._selector.unregister(conn.sock)
        uid = conn.client.uid
        if self._in_hand[uid] >= USER_WORKERS:
            self._queued[uid].append((conn, frame))
        else:
            self._submit(conn, frame)

    def _submit(self, conn: _Conn, frame: bytes) -> None:
        self._in_hand[conn.client.uid] += 1
        self._pool.submit(self._work, conn, frame)

    def _refuse_frame(self, conn: _Conn, error: p.Error) -> None:
        try:
            conn.sock.send(p.encode(error))
        except OSError:
            pass
        self._close(conn)

    # -- the workers --------------------------------------------------------------------------

    def _work(self, conn: _Conn, frame: bytes) -> None:
        """In a worker: answer one frame; the loop learns whether to go on with the connection."""
        keep = False
        try:
            conn.sock.settimeout(self._frame_timeout_s)  # the reply: a client must read it in time
            if conn.welcomed:
                keep = self._peer.answer(conn.sock, conn.client, frame)
            else:
                keep = conn.welcomed = self._peer.welcome(conn.sock, conn.client, frame)
        except (TimeoutError, EOFError, OSError):
            keep = False  # the client went away, or stopped reading its replies
        except Exception:
            log.exception("internal error serving client %d", conn.client.id)
        finally:
            self._done.put((conn, keep))
            try:
                self._wake_w.send(b"\0")
            except OSError:
                pass  # the loop has ended

    def _finished(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                conn, keep = self._done.get_nowait()
            except queue.Empty:
                return
            uid = conn.client.uid
            self._in_hand[uid] -= 1
            if self._queued[uid]:
                self._submit(*self._queued[uid].popleft())
            elif not self._in_hand[uid]:
                del self._in_hand[uid], self._queued[uid]
            conn.busy = False
            if not keep:
                self._close(conn, registered=False)
                continue
            conn.since = time.monotonic()
            conn.sock.setblocking(False)
            self._selector.register(conn.sock, selectors.EVENT_READ)
            self._next_frame(conn)

    # -- time-outs and closing ----------------------------------------------------------------

    def _expire(self, now: float) -> None:
        for conn in list(self._conns.values()):
            if conn.busy:
                continue
            if conn.partial_since and now - conn.partial_since > self._frame_timeout_s:
                self._stalled(conn, "sent part of a message and then nothing")
            elif not conn.welcomed and now - conn.since > self._frame_timeout_s:
                self._stalled(conn, "connected and sent no Hello")
            elif now - conn.since > self._idle_timeout_s and self._peer.holds_nothing(conn.client):
                log.debug("client %d (pid %d, %s) idle, holding nothing: closed", *_who(conn.client))
                self._refuse_frame(
                    conn,
                    p.Error(
                        "idle",
                        f"connection idle for {self._idle_timeout_s:g} s (HPKV_SERVER_CONNECTION_IDLE_S), holding "
                        "nothing: closed; a request sent since was not read, send it again on a new connection",
                    ),
                )

    def _stalled(self, conn: _Conn, what: str) -> None:
        log.warning(
            "client %d (pid %d, %s) %s for %.0f s; closing its connection and releasing its leases "
            "(HPKV_SERVER_FRAME_TIMEOUT_S)",
            *_who(conn.client),
            what,
            self._frame_timeout_s,
        )
        self._close(conn)

    def _close(self, conn: _Conn, registered: bool = True) -> None:
        """End a connection; what its client held is reclaimed on a worker (that may wait a little)."""
        if registered:
            self._selector.unregister(conn.sock)
        del self._conns[conn.sock]
        conn.sock.close()
        uid = conn.client.uid
        self._per_uid[uid] -= 1
        if not self._per_uid[uid]:
            del self._per_uid[uid]
        self._pool.submit(self._peer.closed, conn.client)


class _Workers:
    """At most `max_threads` daemon threads, made as jobs need them and kept for the next ones.
    Daemon threads: a request still waiting (a lease wait, a clear) must not hold up the exit of a
    server that has stopped."""

    def __init__(self, max_threads: int) -> None:
        self._max = max_threads
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, fn, *args) -> None:
        with self._lock:
            if self._idle == 0 and self._threads < self._max:
                self._threads += 1
                threading.Thread(target=self._run, name=f"hpkv-request-{self._threads}", daemon=True).start()
        self._jobs.put((fn, args))

    def shutdown(self) -> None:
        """Let the threads end once the jobs queued before are done (none waits for them)."""
        for _ in range(self._max):
            self._jobs.put(None)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            job = self._jobs.get()
            with self._lock:
                self._idle -= 1
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except Exception:
                log.exception("internal error in a request thread")


def _who(client: ClientInfo) -> tuple[int, int, str]:
    return client.id, client.pid, client.kind
