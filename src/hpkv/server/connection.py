"""One client connection of the HPKV Server: the handshake, then one request at a time.

Owns the conversation on one socket, a frame at a time (`loop.py` reads the frames): `refusal`
says why a peer's uid may not talk to this server (SO_PEERCRED); `admit` checks the Hello's
protocol version and hands over the pool file's descriptor (never its name); `answer` has a
request answered, sends the reply and runs the work a reply must not wait for. A bad frame gets
an `Error` and ends only this connection; a client that stops reading replies for
HPKV_SERVER_FRAME_TIMEOUT_S loses its connection. Must not know what a request does
(`handlers.py`), how connections are waited on (`loop.py`) nor who reclaims what the client held
(`daemon.py`).
"""

from __future__ import annotations

import logging
import os
import socket
import time

from .. import __version__
from ..config import Settings
from ..errors import PoolError
from ..procs import pid_running
from ..store import TieredStore
from . import protocol as p
from .handlers import ClientInfo, Handlers

log = logging.getLogger("hpkv.server")
_warned_uids: set[int] = set()  # admitted other uids told of a pool they could truncate


def refusal(uid: int, settings: Settings) -> p.Error | None:
    """Why a peer of `uid` may not talk to this server, or None: the uid is this server's or listed."""
    if uid == os.geteuid() or uid in settings.server_allow_uids:
        return None
    return p.Error(
        "permission",
        f"uid {uid} may not use this HPKV server (uid "
        f"{os.geteuid()}); run as uid {os.geteuid()} or start the server with "
        f"HPKV_SERVER_ALLOW_UIDS={uid}",
    )


def admit(conn: socket.socket, client: ClientInfo, store: TieredStore, settings: Settings, frame: bytes) -> bool:
    """The handshake, `frame` being the client's first: True once the client is welcomed, False
    after telling it why not."""
    try:
        hello = p.decode_request(frame)
    except p.FrameError as exc:
        send(conn, p.Error(exc.code, str(exc)))
        return False
    if not isinstance(hello, p.Hello):
        send(conn, p.Error("bad_request", "the first message must be Hello"))
        return False
    if hello.version != p.PROTOCOL_VERSION:
        log.warning(
            "refused client pid %d: protocol %d, this server speaks %d", hello.pid, hello.version, p.PROTOCOL_VERSION
        )
        send(
            conn,
            p.Error(
                "version",
                f"client speaks HPKV protocol {hello.version}, server (version "
                f"{__version__}) speaks {p.PROTOCOL_VERSION}; run the same hpkv version on both "
                "sides (restart the server after upgrading)",
            ),
        )
        return False
    client.kind = hello.kind[:32]
    region = store.region
    if region.unguarded and client.uid != os.geteuid() and client.uid not in _warned_uids:
        _warned_uids.add(client.uid)
        log.warning(
            "uid %d can truncate the pool it is handed (an engine copying then dies): %s", client.uid, region.unguarded
        )
    try:
        pool_fd = region.share_fd()
    except PoolError:  # the pool is closing: the server is stopping
        send(conn, p.Error("internal", "the HPKV server is stopping; a new one takes its place"))
        return False
    # The pool goes as a descriptor: the client maps this file, whatever its name is by now.
    p.send_frame_fds(
        conn,
        p.Welcome(
            p.PROTOCOL_VERSION,
            os.getpid(),
            p.display_path(region.path),
            region.size_bytes,
            region.inode,
            client.id,
            settings.server_slot_timeout_s or 0.0,
        ),
        [pool_fd],
    )
    return True


def answer(conn: socket.socket, client: ClientInfo, handlers: Handlers, frame: bytes, metrics) -> bool:
    """Answer the request in `frame`; False once the connection must end (a frame that does not
    decode: its framing can no longer be trusted)."""
    try:
        request = p.decode_request(frame)
    except p.FrameError as exc:
        send(conn, p.Error(exc.code, str(exc)))
        return False
    started = time.perf_counter()
    reply = handlers.handle(request, client)
    if metrics is not None:
        metrics.observe(type(request).__name__, time.perf_counter() - started)
    try:
        send(conn, reply)
    finally:
        if client.after_reply is not None:
            after, client.after_reply = client.after_reply, None
            after()
    return True


def lives_on(pid: int, grace_s: float = 0.5) -> bool:
    """Whether the process behind a closed connection is still there `grace_s` later (a killed
    process closes its sockets before it is gone)."""
    if pid <= 0:  # not visible from here (another pid namespace): assume it lives
        return True
    deadline = time.monotonic() + grace_s
    while pid_running(pid):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.01)
    return False


def send(conn: socket.socket, msg: p.Reply) -> None:
    conn.sendall(p.encode(msg))
