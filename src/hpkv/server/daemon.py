"""The HPKV Server process: the tiered store behind a Unix socket.

Start-up: read the configuration and log it with sources; make the pool directory (0700) and
refuse one another uid could replace names in (`pool.directory`); refuse to start if a live
server answers on the socket, remove a stale one; create the store; bind the socket, mode 0600,
and let the uids of HPKV_SERVER_ALLOW_UIDS reach it (`access.py`); a managed server (not
auto-started) under a service manager then marks the directory its own (`autostart.claim_managed`).
Clients: `loop.py` waits on every connection in one thread and has a bounded pool of threads
answer their requests; each connection is one owner in the store (`connection.py`,
`handlers.py`), whose holdings count in the shares of its process and its uid (`limits.py`);
when it closes its reservations are aborted (after QUARANTINE_S if its process lives on: it may
still be copying) and its leases released.
Stop: SIGTERM/SIGINT, or (auto-started servers only) no client for HPKV_SERVER_IDLE_EXIT_S:
stop accepting, write the entries still waiting for storage, stop the write-through processes,
remove socket and pool, exit 0; a second signal, or storage finishing no write for 30 s, gives
those writes up (`TieredStore.close`).
Must not know: what each request does (handlers.py), the store's parts.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from .. import __version__, safefs
from .. import stats as st
from ..cluster import segment
from ..config import Settings, load_settings
from ..errors import HpkvError, PoolError
from ..limits import SlotShares
from ..pool.poolfile import prepare_directory
from ..store import TieredStore, create_store
from . import access, connection
from . import protocol as p
from .autostart import claim_managed
from .handlers import ClientInfo, Handlers
from .loop import ConnectionLoop

if TYPE_CHECKING:
    from .metrics import Metrics

log = logging.getLogger("hpkv.server")

# How long the slots reserved by a client whose connection dropped while its process lives stay
# unusable: far longer than any copy into them takes.
QUARANTINE_S = 30.0


class Server:
    def __init__(self, settings: Settings, auto: bool = False) -> None:
        self.settings = settings
        self.auto = auto
        self.directory = Path(settings.pool.dir)
        self.socket_path = self.directory / p.SOCKET_NAME
        self.store: TieredStore | None = None
        self.handlers: Handlers | None = None
        self.metrics: Metrics | None = None
        self.started_at = time.time()
        self._stop = threading.Event()
        self._abandon = threading.Event()  # a second stop signal: do not wait for storage writes
        self._status = 0  # the exit status
        self._clients: dict[int, ClientInfo] = {}
        self._clients_lock = threading.Lock()
        self._next_id = 1
        self._last_client_left = time.monotonic()
        self._listener: socket.socket | None = None

    # -- life ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until stopped; returns the exit status."""
        self._log_settings()
        self._open()
        try:
            assert self._listener is not None  # _open made it
            ConnectionLoop(
                self._listener,
                self,
                self.settings.server_max_connections_per_uid,
                self.settings.server_frame_timeout_s,
                self.settings.server_connection_idle_s,
            ).run()
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
        log.info(
            "HPKV server %s (pid %d, protocol %d) starting%s",
            __version__,
            os.getpid(),
            p.PROTOCOL_VERSION,
            " (auto-started)" if self.auto else "",
        )
        for s in self.settings.settings:
            log.info("  %s = %s  [%s]", s.key, s.raw, s.where)
        for warning in self.settings.warnings:
            log.warning("%s", warning)

    def _open(self) -> None:
        prepare_directory(self.directory)  # the socket goes there before the pool does
        _claim_socket_path(self.socket_path)
        if self.settings.cluster.enabled:
            # This node's share of the cluster tier lives in a process of its own, which outlives
            # this server (an idle exit, a restart): started here unless it runs.
            segment.ensure(self.settings.cluster, self.directory)
        self.store = create_store(self.settings.pool, self.settings.storage, cluster=self.settings.cluster)
        self.store.set_limits(
            slots=SlotShares(
                self.settings.server_slot_timeout_s,
                self.settings.server_max_slot_share,
                self.settings.server_max_user_slot_share,
            )
        )
        self.handlers = Handlers(self.store, self.settings, self.stats)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            listener.bind(str(self.socket_path))
        except OSError as exc:  # e.g. a path longer than a Unix socket allows
            listener.close()
            self.store.close()
            raise PoolError(
                f"cannot listen on {self.socket_path}: {exc.strerror or exc}; point "
                "HPKV_SHARE_MEM_FILE_PATH at a short, writable directory (a Unix socket path "
                "holds at most 107 bytes)"
            ) from None
        finally:
            os.umask(old_umask)
        try:
            access.open_to(self.directory, self.socket_path, self.settings.server_allow_uids)
        except OSError as exc:
            listener.close()
            self.store.close()
            raise PoolError(
                f"cannot let the uids of HPKV_SERVER_ALLOW_UIDS reach {self.socket_path}: {exc.strerror or exc}; "
                "use a pool directory of this user's own on tmpfs (HPKV_SHARE_MEM_FILE_PATH), or empty the list"
            ) from None
        listener.listen(512)
        self._listener = listener
        if not self.auto:  # once it serves: engines never auto-start a server in its place
            claim_managed(self.directory)
        if self.settings.metrics_port:
            from .metrics import Metrics

            self.metrics = Metrics(self)
            self.metrics.start(self.settings.metrics_host, self.settings.metrics_port)
        region = self.store.region
        backing = region.backing_stats()
        log.info(
            "HPKV server ready: socket %s, pool %s (%d bytes, %d with pages now, the rest reserved in the "
            "background; %s)",
            self.socket_path,
            region.path,
            region.size_bytes,
            backing["ready_bytes"],
            f"no lock needed: {backing['no_lock_why']}" if backing["no_lock_why"] else "locked in memory as it goes",
        )

    def _idle_expired(self) -> bool:
        if not self.auto:
            return False
        with self._clients_lock:
            if self._clients:
                return False
            return time.monotonic() - self._last_client_left > self.settings.server_idle_exit_s

    def _shutdown(self) -> None:
        waiting = 0
        if self.store is not None:  # no write backlog without a storage tier
            backlog = self.store.stats().write_backlog
            waiting = backlog.entries + backlog.deferred if backlog is not None else 0
        if waiting:
            log.info(
                "HPKV server stopping: writing %d entries still waiting for storage (stop it again, with "
                "SIGTERM or Ctrl-C, to leave them unwritten)",
                waiting,
            )
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

    # -- the clients (what `loop.ConnectionLoop` asks) -------------------------------------------

    def refusal(self, uid: int) -> p.Error | None:
        return connection.refusal(uid, self.settings)

    def connected(self, pid: int, uid: int) -> ClientInfo:
        store = self.store
        assert store is not None  # _open ran before the first client
        with self._clients_lock:
            client = ClientInfo(self._next_id, pid, uid)
            self._next_id += 1
            self._clients[client.id] = client
        store.join_owner(client.id, uid, pid)
        return client

    def welcome(self, conn: socket.socket, client: ClientInfo, frame: bytes) -> bool:
        assert self.store is not None
        return connection.admit(conn, client, self.store, self.settings, frame)

    def answer(self, conn: socket.socket, client: ClientInfo, frame: bytes) -> bool:
        assert self.handlers is not None
        return connection.answer(conn, client, self.handlers, frame, self.metrics)

    def holds_nothing(self, client: ClientInfo) -> bool:
        store = self.store
        assert store is not None
        return not store.has_reservations(client.id) and not any(store.get_lease(i) for i in list(client.leases))

    def closed(self, client: ClientInfo) -> None:
        """Reclaim what a client whose connection ended held."""
        store = self.store
        assert store is not None
        # A live client lost its connection (its call timed out): it may still be copying.
        copying = store.has_reservations(client.id) and connection.lives_on(client.pid)
        store.drop_owner(client.id, quarantine_s=QUARANTINE_S if copying else 0.0)
        with self._clients_lock:
            del self._clients[client.id]
            self._last_client_left = time.monotonic()

    def tick(self) -> bool:
        if self._stop.is_set():
            return False
        if self._idle_expired():
            log.info("no client for %.1f s: the auto-started server exits", self.settings.server_idle_exit_s)
            return False
        return True

    def stats(self) -> st.ServerStats:
        """The store's snapshot and this server's."""
        store = self.store
        assert store is not None  # asked for by handlers and metrics, made once the store is open
        snapshot = store.stats()
        if snapshot.cluster is not None:
            snapshot.cluster.segment_pid = segment.running(self.directory)
        with self._clients_lock:
            clients = [
                st.ClientStats(
                    id=c.id,
                    pid=c.pid,
                    uid=c.uid,
                    kind=c.kind,
                    connected_s=round(time.time() - c.connected_at, 1),
                    leases=sum(store.get_lease(i) is not None for i in list(c.leases)),
                )
                for c in self._clients.values()
            ]  # leases: not taken back
        server = st.ServerInfo(
            pid=os.getpid(),
            version=__version__,
            protocol=p.PROTOCOL_VERSION,
            auto=self.auto,
            uptime_s=round(time.time() - self.started_at, 1),
            socket=p.display_path(self.socket_path),
            pool_path=p.display_path(store.region.path),
            storage_path=p.display_path(self.settings.storage.path),
        )
        return st.ServerStats(**msgspec.structs.asdict(snapshot), server=server, clients=clients)


def _claim_socket_path(path: Path) -> None:
    """Refuse if a live server answers on `path`; remove a socket left by a dead one. What is
    not a socket of this uid or root (a link, a FIFO, another user's socket) is refused."""
    try:
        if not safefs.check_socket(path, safefs.owners()):
            return
    except safefs.UnsafeFile as exc:
        raise PoolError(
            f"cannot listen on {path}: it {exc.why}, which no HPKV server leaves; remove it (as its "
            "owner or root), or point HPKV_SHARE_MEM_FILE_PATH at a directory of this user's own"
        ) from None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    busy = ""
    try:
        probe.connect(str(path))
    except (TimeoutError, ConnectionRefusedError, FileNotFoundError):
        log.warning("removing stale socket %s left by a server that is gone", path)
        path.unlink(missing_ok=True)
        return
    except BlockingIOError:  # EAGAIN: the server's queue of connections to accept is full
        busy = " (so busy that its queue of connections to accept is full)"
    except PermissionError as exc:
        raise PoolError(
            f"cannot check whether a server answers on {path}: {exc.strerror}; it belongs to "
            "another user: use a pool directory of this user's own (HPKV_SHARE_MEM_FILE_PATH)"
        ) from None
    finally:
        probe.close()
    raise PoolError(
        f"an HPKV server is already running on {path}{busy}; use it (hpkv status), or stop it "
        "first, or give this one another HPKV_SHARE_MEM_FILE_PATH"
    )


def serve(auto: bool = False, settings: Settings | None = None) -> int:
    """Entry point of `hpkv server` and of auto-started servers."""
    settings = settings or load_settings()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
    )
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
    parser.add_argument(
        "--settings-cwd",
        help="resolve relative paths in the settings from this directory "
        "(the auto-starter's), although the server runs in /",
    )
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
