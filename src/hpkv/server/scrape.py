"""A bounded HTTP server for the metrics endpoint (prometheus_client's makes a thread a connection).

Owns the endpoint's connections: one thread (`serve_forever`) accepts each and holds it until it
has sent its request, and only then gives it to one of SCRAPE_WORKERS threads; at most
SCRAPE_QUEUE connections are open (a new one past that takes the place of one that has sent
nothing, or is closed at once), and one not answered within SCRAPE_DEADLINE_S (one that sends
nothing, or a byte at a time) is closed. So idle connections cost no thread and cannot keep a
scrape out. Primitives: `ScrapeServer(host, port, handler)`, then `serve_forever(POLL_S)`,
`shutdown`, `server_close`. Must not know what it serves.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import HTTPServer
from typing import Any

log = logging.getLogger(__name__)

SCRAPE_WORKERS = 2  # threads answering scrapes
SCRAPE_QUEUE = 16  # connections accepted and not yet answered, at most
POLL_S = 0.05  # how often the accept loop looks at the connections waiting for a worker
SCRAPE_DEADLINE_S = 5.0  # from accept to the last byte of the answer (a scraper asks at once)


class ScrapeServer(HTTPServer):
    """An HTTP server with a bounded pool of threads (prometheus_client's makes one a connection).
    A connection waits in the accept loop until it has sent something, and only then goes to a
    worker."""

    request_queue_size = 128  # the listen backlog: connections are accepted (or shut) one a turn

    def __init__(self, host: str, port: int, handler: type) -> None:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        self.address_family = family  # an IPv6 host needs AF_INET6 (HTTPServer assumes AF_INET)
        self._pool = ThreadPoolExecutor(SCRAPE_WORKERS, thread_name_prefix="hpkv-scrape")
        self._open: dict[socket.socket, float] = {}  # accepted, not yet done -> deadline
        self._waiting: dict[socket.socket, Any] = {}  # of those, the ones no worker has -> address
        self._lock = threading.Lock()
        super().__init__((str(sockaddr[0]), port), handler)  # binds: OSError if the port is taken

    def process_request(self, request, client_address) -> None:
        with self._lock:
            full = len(self._open) >= SCRAPE_QUEUE
            silent = next((sock for sock in self._waiting if full and _silent(sock)), None)
            if silent is not None:  # make room: a waiting connection that has asked nothing gives way
                del self._open[silent], self._waiting[silent]
                silent.close()
            if len(self._open) >= SCRAPE_QUEUE:
                self.shutdown_request(request)
                return
            self._open[request] = time.monotonic() + SCRAPE_DEADLINE_S
            self._waiting[request] = client_address
        request.settimeout(SCRAPE_DEADLINE_S)

    def service_actions(self) -> None:
        """Each turn of the accept loop (POLL_S): a waiting connection that has sent something goes
        to a worker; one past its deadline is closed, or shut if a worker has it (which ends the
        worker's wait on it)."""
        now = time.monotonic()
        with self._lock:
            late = [sock for sock, deadline in self._open.items() if deadline < now]
            for sock in late:
                del self._open[sock]
            closed = [sock for sock in late if self._waiting.pop(sock, False) is not False]
            ready = [(sock, address) for sock, address in self._waiting.items() if not _silent(sock)]
            for sock, _ in ready:
                del self._waiting[sock]
        for sock in late:
            if sock in closed:
                sock.close()
            else:
                _shut(sock)
        for sock, address in ready:
            self._pool.submit(self._answer, sock, address)

    def _answer(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception as exc:  # the client went away, or was too slow
            log.debug("metrics scrape from %s failed: %s", client_address, exc)
        finally:
            with self._lock:
                self._open.pop(request, None)
            self.shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _silent(sock: socket.socket) -> bool:
    """Whether a connection has sent nothing yet (nor closed). A poll, not a recv: a socket with a
    timeout waits that long before any recv, MSG_DONTWAIT or not."""
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return not poll.poll(0)


def _shut(sock: socket.socket) -> None:
    """End a connection a worker may be waiting on (the worker then closes it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
