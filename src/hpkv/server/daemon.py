"""The HPKV Server process: the tiered store behind a Unix socket, one thread per client.

Start-up: read the configuration (file > env > default) and log it with sources; make the pool
directory (0700), and refuse one another uid could replace names in (`pool.directory`); refuse
to start if a live server answers on the socket, remove a stale socket; create the store (pool
file, storage tier); bind the socket with mode 0600. Each client is welcomed with the pool
file's descriptor, never its name.

Clients: every connection is one owner in the store; when it closes, for whatever reason, its
reservations are aborted and its leases released (the reservations of a client whose process
lives on stay unusable for QUARANTINE_S first: it may still be copying into them). Peers of
another uid are refused (SO_PEERCRED) unless HPKV_SERVER_ALLOW_UIDS lists them. A bad frame gets
an `Error` and closes only that connection. A client may stay quiet between messages as long as
it likes, but one that stops within a message, or stops reading replies, for
HPKV_SERVER_FRAME_TIMEOUT_S loses its connection (and what it held) instead of keeping a server
thread and its leases for good. A reservation or lease is taken back after HPKV_SERVER_SLOT_TIMEOUT_S
(its slots quarantined first), and one client holds at most HPKV_SERVER_MAX_SLOT_SHARE of the
pool: keys past it are not reserved or leased (`limits.py`).

Stop: SIGTERM/SIGINT, or (auto-started servers only) no client for HPKV_SERVER_IDLE_EXIT_S. The
server stops accepting, writes the entries still waiting for storage (and stops its write-through
processes), removes socket and pool, exits 0. A second SIGTERM/SIGINT while it writes gives those
entries up, and so does a storage device that finishes no write for 30 s (`TieredStore.close`).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from .. import __version__, safefs
from .. import stats as st
from ..config import Settings, load_settings
from ..errors import HpkvError, PoolError
from ..keys import MAX_KEY_BYTES, NS_DIGEST_BYTES, NamespaceDesc
from ..pool.region import prepare_directory
from ..procs import pid_running
from ..store import TieredStore
from . import protocol as p

log = logging.getLogger("hpkv.server")

_PEERCRED = struct.Struct("3i")
# How long the slots reserved by a client whose connection dropped while its process lives stay
# unusable: far longer than any copy into them takes.
QUARANTINE_S = 30.0
ACCEPT_RETRY_S = 0.2  # the pause after a failed accept (out of file descriptors, say)
MAX_HOLD_CHARS = 128


@dataclass
class ClientInfo:
    id: int
    pid: int
    uid: int
    kind: str = "?"
    connected_at: float = field(default_factory=time.time)
    leases: set[int] = field(default_factory=set)
    after_reply: Callable[[], None] | None = None  # work that must not delay the reply


class Server:
    def __init__(self, settings: Settings, auto: bool = False) -> None:
        self.settings = settings
        self.auto = auto
        self.directory = Path(settings.pool.dir)
        self.socket_path = self.directory / p.SOCKET_NAME
        self.store: TieredStore | None = None
        self.metrics = None
        self.started_at = time.time()
        self._stop = threading.Event()
        self._abandon = threading.Event()  # a second stop signal: do not wait for storage writes
        self._status = 0  # the exit status
        self._clients: dict[int, ClientInfo] = {}
        self._clients_lock = threading.Lock()
        self._next_id = 1
        self._last_client_left = time.monotonic()
        self._listener: socket.socket | None = None
        self._accept_warned_at = -math.inf

    # -- life ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until stopped; returns the exit status."""
        self._log_settings()
        self._open()
        try:
            self._accept_loop()
        except Exception:
            log.exception("the HPKV server failed; stopping")
            self._status = 1
        finally:
            self._shutdown()
        return self._status

    def stop(self, *_args) -> None:
        if self._stop.is_set():
            self._abandon.set()
        self._stop.set()

    def _log_settings(self) -> None:
        log.info("HPKV server %s (pid %d, protocol %d) starting%s", __version__, os.getpid(),
                 p.PROTOCOL_VERSION, " (auto-started)" if self.auto else "")
        for s in self.settings.settings:
            log.info("  %s = %s  [%s]", s.key, s.raw, s.where)
        for warning in self.settings.warnings:
            log.warning("%s", warning)

    def _open(self) -> None:
        prepare_directory(self.directory)  # the socket goes there before the pool does
        _claim_socket_path(self.socket_path)
        self.store = TieredStore.open(self.settings.pool, self.settings.storage)
        self.store.held.configure(self.settings.server_slot_timeout_s, max_slot_bytes(self.store, self.settings))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            listener.bind(str(self.socket_path))
        except OSError as exc:  # e.g. a path longer than a Unix socket allows
            listener.close()
            self.store.close()
            raise PoolError(f"cannot listen on {self.socket_path}: {exc.strerror or exc}; point "
                            "HPKV_SHARE_MEM_FILE_PATH at a short, writable directory (a Unix socket path "
                            "holds at most 107 bytes)") from None
        finally:
            os.umask(old_umask)
        listener.listen(128)
        listener.settimeout(0.2)
        self._listener = listener
        if self.settings.metrics_port:
            from .metrics import Metrics

            self.metrics = Metrics(self)
            self.metrics.start(self.settings.metrics_host, self.settings.metrics_port)
        log.info("HPKV server ready: socket %s, pool %s (%d bytes)", self.socket_path,
                 self.store.region.path, self.store.region.size_bytes)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                if self._idle_expired():
                    log.info("no client for %.1f s: the auto-started server exits",
                             self.settings.server_idle_exit_s)
                    return
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                # Out of file descriptors or memory, or a client that gave up while queued: the
                # clients already connected go on, and so does the server.
                self._accept_failed(f"cannot accept a connection: {exc}")
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="hpkv-client", daemon=True).start()
            except RuntimeError as exc:  # "can't start new thread"
                conn.close()
                self._accept_failed(f"cannot start a thread for a new client: {exc}")

    def _accept_failed(self, why: str) -> None:
        """Logged at most once a minute (the rest at DEBUG); a short pause so that a lasting cause
        (EMFILE) does not spin. The client sees its connection refused or closed and retries."""
        now = time.monotonic()
        if now - self._accept_warned_at >= 60.0:
            self._accept_warned_at = now
            log.warning("%s; the clients connected already are served, new ones are retried (raise the limit "
                        "on open files, `ulimit -n`, or the memory limit if this repeats)", why)
        else:
            log.debug("%s", why)
        self._stop.wait(ACCEPT_RETRY_S)

    def _idle_expired(self) -> bool:
        if not self.auto:
            return False
        with self._clients_lock:
            if self._clients:
                return False
            return time.monotonic() - self._last_client_left > self.settings.server_idle_exit_s

    def _shutdown(self) -> None:
        waiting = 0
        if self.store is not None and self.store.storage is not None:
            backlog = self.store.stats()["write_backlog"]
            waiting = backlog["entries"] + backlog["deferred"]
        if waiting:
            log.info("HPKV server stopping: writing %d entries still waiting for storage (stop it again, with "
                     "SIGTERM or Ctrl-C, to leave them unwritten)", waiting)
        else:
            log.info("HPKV server stopping")
        if self._listener is not None:
            self._listener.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        if self.metrics is not None:
            self.metrics.stop()
        abandoned = self.store is not None and self.store.close(abandon=self._abandon)
        log.info("HPKV server stopped")
        if abandoned:
            # A thread may still be stuck in a system call on the storage device, and a normal
            # exit would wait for it: socket and pool are gone already, so leave now.
            logging.shutdown()
            os._exit(self._status)

    # -- one client ---------------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        pid, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        with self._clients_lock:
            client = ClientInfo(self._next_id, pid, uid)
            self._next_id += 1
            self._clients[client.id] = client
        try:
            if self._admit(conn, client):
                self._dialogue(conn, client)
        except (EOFError, ConnectionError, socket.timeout, OSError):
            pass  # the client went away; what it held is reclaimed below
        finally:
            conn.close()
            # A live client lost its connection (its call timed out): it may still be copying.
            copying = self.store.holds_reservations(client.id) and _lives_on(client.pid)
            self.store.drop_owner(client.id, quarantine_s=QUARANTINE_S if copying else 0.0)
            with self._clients_lock:
                del self._clients[client.id]
                self._last_client_left = time.monotonic()

    def _admit(self, conn: socket.socket, client: ClientInfo) -> bool:
        if client.uid != os.geteuid() and client.uid not in self.settings.server_allow_uids:
            log.warning("refused a client of uid %d (pid %d): not this server's uid %d", client.uid,
                        client.pid, os.geteuid())
            _send(conn, p.Error("permission", f"uid {client.uid} may not use this HPKV server (uid "
                                f"{os.geteuid()}); run as uid {os.geteuid()} or start the server with "
                                f"HPKV_SERVER_ALLOW_UIDS={client.uid}"))
            return False
        conn.settimeout(self.settings.server_frame_timeout_s)
        try:
            hello = p.decode_request(p.recv_frame(conn))
        except p.FrameError as exc:
            _send(conn, p.Error(exc.code, str(exc)))
            return False
        if not isinstance(hello, p.Hello):
            _send(conn, p.Error("bad_request", "the first message must be Hello"))
            return False
        if hello.version != p.PROTOCOL_VERSION:
            log.warning("refused client pid %d: protocol %d, this server speaks %d", hello.pid, hello.version,
                        p.PROTOCOL_VERSION)
            _send(conn, p.Error("version", f"client speaks HPKV protocol {hello.version}, server (version "
                                f"{__version__}) speaks {p.PROTOCOL_VERSION}; run the same hpkv version on both "
                                "sides (restart the server after upgrading)"))
            return False
        client.kind = hello.kind[:32]
        region = self.store.region
        try:
            pool_fd = region.share_fd()
        except PoolError:  # the pool is closing: the server is stopping
            _send(conn, p.Error("internal", "the HPKV server is stopping; a new one takes its place"))
            return False
        # The pool goes as a descriptor: the client maps this file, whatever its name is by now.
        p.send_frame_fds(conn, p.Welcome(p.PROTOCOL_VERSION, os.getpid(), p.display_path(region.path),
                                         region.size_bytes, region.inode, client.id,
                                         self.settings.server_slot_timeout_s or 0.0), [pool_fd])
        return True

    def _dialogue(self, conn: socket.socket, client: ClientInfo) -> None:
        while True:
            try:
                request = p.decode_request(p.recv_frame(conn, idle_ok=True))
            except p.FrameError as exc:
                _send(conn, p.Error(exc.code, str(exc)))
                return  # framing is lost: close this connection only
            except TimeoutError:
                log.warning("client %d (pid %d, %s) sent part of a message and then nothing for %.0f s; closing "
                            "its connection and releasing its leases (HPKV_SERVER_FRAME_TIMEOUT_S)", client.id,
                            client.pid, client.kind, self.settings.server_frame_timeout_s)
                return
            started = time.perf_counter()
            reply = self._handle(request, client)
            if self.metrics is not None:
                self.metrics.observe(type(request).__name__, time.perf_counter() - started)
            try:
                _send(conn, reply)
            finally:
                if client.after_reply is not None:
                    after, client.after_reply = client.after_reply, None
                    after()

    def _handle(self, request: p.Request, client: ClientInfo) -> p.Reply:
        handler = getattr(self, "_on_" + type(request).__name__, None)
        if handler is None:
            return p.Error("bad_request", f"{type(request).__name__} is not valid here")
        try:
            return handler(request, client)
        except KeyError as exc:
            return p.Error("unknown_namespace", f"namespace {exc.args[0]!r} is not registered; send Register first")
        except (HpkvError, ValueError, TypeError) as exc:
            return p.Error("bad_request", str(exc))
        except Exception as exc:  # a bug: keep serving everyone else
            log.exception("internal error handling %s", type(request).__name__)
            return p.Error("internal", f"internal server error: {exc!r}")

    # -- handlers -----------------------------------------------------------------------------

    def _on_Register(self, r: p.Register, client: ClientInfo) -> p.Reply:
        try:
            desc = NamespaceDesc.from_json(r.desc_json)
        except (ValueError, TypeError, AttributeError) as exc:  # JSON of the wrong shape is the peer's fault
            return p.Error("bad_request", f"not a namespace description ({exc}): {r.desc_json[:200]!r}")
        return p.Registered(self.store.register(desc), desc.entry_bytes)

    def _on_Lookup(self, r: p.Lookup, client: ClientInfo) -> p.Reply:
        return p.Hits(bytes(self.store.lookup(r.ns, r.keys).tiers))

    def _on_Reserve(self, r: p.Reserve, client: ClientInfo) -> p.Reply:
        self._check_ns(r.ns)
        long_keys = [key for key in r.keys if len(key) > MAX_KEY_BYTES]
        if long_keys:  # each becomes a file name: make_key digests longer ones
            return p.Error("bad_request", f"{len(long_keys)} key(s) longer than {MAX_KEY_BYTES} bytes (the first "
                           f"is {len(long_keys[0])}); build keys with hpkv.keys.make_key")
        if len(r.hold) > MAX_HOLD_CHARS:
            return p.Error("bad_request", f"hold name of {len(r.hold)} characters; at most {MAX_HOLD_CHARS}")
        return p.Offsets(self.store.reserve(r.ns, r.keys, owner=client.id, hold=r.hold))

    def _on_Commit(self, r: p.Commit, client: ClientInfo) -> p.Reply:
        return p.Count(self.store.commit(r.ns, r.keys, owner=client.id))

    def _on_Abort(self, r: p.Abort, client: ClientInfo) -> p.Reply:
        return p.Count(self.store.abort(r.ns, r.keys, owner=client.id, hold=r.hold))

    def _on_Settle(self, r: p.Settle, client: ClientInfo) -> p.Reply:
        return p.Settled(*self.store.settle(r.hold, r.abort))

    def _on_Lease(self, r: p.Lease, client: ClientInfo) -> p.Reply:
        self._check_ns(r.ns)
        lease = self.store.lease(r.ns, r.keys, owner=client.id, start_reads=False)
        client.leases.add(lease.id)
        if lease.reads:
            client.after_reply = lambda: self.store.start_reads(lease)
            return p.Leased(lease.id, lease.offsets, None)
        return p.Leased(lease.id, lease.offsets, lease.wait() if lease.done else None)

    def _on_LeaseWait(self, r: p.LeaseWait, client: ClientInfo) -> p.Reply:
        lease = self.store.get_lease(r.lease_id) if r.lease_id in client.leases else None
        if lease is None:
            return p.Error("bad_request", f"lease {r.lease_id} is not held by this client (released, or held "
                           f"past HPKV_SERVER_SLOT_TIMEOUT_S={self.settings.server_slot_timeout_s:g} s)")
        try:
            num_ready = lease.wait(timeout=max(0.0, min(r.timeout_s, 60.0)))
        except FutureTimeout:
            num_ready = None
        return p.Leased(lease.id, lease.offsets, num_ready)

    def _on_Release(self, r: p.Release, client: ClientInfo) -> p.Reply:
        if r.lease_id not in client.leases:
            return p.Count(0)
        client.leases.discard(r.lease_id)
        return p.Count(int(self.store.release(r.lease_id)))

    def _on_Clear(self, r: p.Clear, client: ClientInfo) -> p.Reply:
        if r.ns is not None and not _is_ns_id(r.ns):  # it becomes a path under the storage root
            return p.Error("bad_request", f"{r.ns[:80]!r} is not a namespace id ({2 * NS_DIGEST_BYTES} hex "
                           "digits, as `hpkv status` shows them)")
        removed = self.store.clear(memory=r.memory, storage=r.storage, ns=r.ns)
        log.info("cleared %s%s (ns %s) at the request of pid %d: %s", "memory " if r.memory else "",
                 "storage" if r.storage else "", r.ns or "all", client.pid, removed)
        return p.Cleared(removed["memory"], removed["storage"])

    def _on_Stats(self, r: p.Stats, client: ClientInfo) -> p.Reply:
        return p.StatsReply(msgspec.to_builtins(self.stats()))

    def _check_ns(self, ns: str) -> None:
        if ns not in self.store.namespaces():
            raise KeyError(ns)

    def stats(self) -> st.ServerStats:
        """The store's components' snapshots and this server's, checked against `hpkv.stats`."""
        out = self.store.stats()
        with self._clients_lock:
            clients = [{"id": c.id, "pid": c.pid, "uid": c.uid, "kind": c.kind,
                        "connected_s": round(time.time() - c.connected_at, 1),
                        "leases": sum(self.store.get_lease(i) is not None for i in list(c.leases))}  # not taken back
                       for c in self._clients.values()]
        out["server"] = {"pid": os.getpid(), "version": __version__, "protocol": p.PROTOCOL_VERSION,
                         "auto": self.auto, "uptime_s": round(time.time() - self.started_at, 1),
                         "socket": p.display_path(self.socket_path),
                         "pool_path": p.display_path(self.store.region.path),
                         "storage_path": p.display_path(self.settings.storage.path)}
        out["clients"] = clients
        return st.from_parts(out)


def max_slot_bytes(store: TieredStore, settings: Settings) -> int | None:
    """The bytes one client may hold reserved or leased (None: no cap); at least a slab's."""
    if settings.server_max_slot_share >= 1:
        return None
    alloc = store.dram.alloc
    return max(alloc.slab_bytes, int(alloc.num_slabs * alloc.slab_bytes * settings.server_max_slot_share))


def _is_ns_id(text: str) -> bool:
    return len(text) == 2 * NS_DIGEST_BYTES and all(c in "0123456789abcdef" for c in text)


def _lives_on(pid: int, grace_s: float = 0.5) -> bool:
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


def _send(conn: socket.socket, msg: p.Msg) -> None:
    conn.sendall(p.encode(msg))


def _claim_socket_path(path: Path) -> None:
    """Refuse if a live server answers on `path`; remove a socket left by a dead one. What is
    not a socket of this uid or root (a link, a FIFO, another user's socket) is refused."""
    try:
        if not safefs.check_socket(path, safefs.owners()):
            return
    except safefs.UnsafeFile as exc:
        raise PoolError(f"cannot listen on {path}: it {exc.why}, which no HPKV server leaves; remove it (as its "
                        "owner or root), or point HPKV_SHARE_MEM_FILE_PATH at a directory of this user's own") from None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    busy = ""
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError, socket.timeout):
        log.warning("removing stale socket %s left by a server that is gone", path)
        path.unlink(missing_ok=True)
        return
    except BlockingIOError:  # EAGAIN: the server's queue of connections to accept is full
        busy = " (so busy that its queue of connections to accept is full)"
    except PermissionError as exc:
        raise PoolError(f"cannot check whether a server answers on {path}: {exc.strerror}; it belongs to "
                        "another user: use a pool directory of this user's own (HPKV_SHARE_MEM_FILE_PATH)") from None
    finally:
        probe.close()
    raise PoolError(f"an HPKV server is already running on {path}{busy}; use it (hpkv status), or stop it "
                    "first, or give this one another HPKV_SHARE_MEM_FILE_PATH")


def serve(auto: bool = False, settings: Settings | None = None) -> int:
    """Entry point of `hpkv server` and of auto-started servers."""
    settings = settings or load_settings()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    server = Server(settings, auto=auto)
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGINT, server.stop)
    try:
        return server.run()
    except HpkvError as exc:
        log.error("%s", exc)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpkv.server.daemon")
    parser.add_argument("--auto", action="store_true", help="exit after the last client leaves")
    parser.add_argument("--settings-cwd", help="resolve relative paths in the settings from this directory "
                        "(the auto-starter's), although the server runs in /")
    args = parser.parse_args(argv)
    return serve(auto=args.auto, settings=_settings_in(args.settings_cwd) if args.settings_cwd else None)


def _settings_in(directory: str) -> Settings:
    here = os.getcwd()
    try:
        os.chdir(directory)
    except OSError:
        pass  # gone since: resolve from where the server runs
    try:
        return load_settings()
    finally:
        os.chdir(here)


if __name__ == "__main__":
    sys.exit(main())
