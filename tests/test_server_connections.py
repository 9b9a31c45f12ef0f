"""Stories about what connections cost the server: idle ones hold no thread (on the socket or
the metrics port), one uid holds at most HPKV_SERVER_MAX_CONNECTIONS_PER_UID, a silent one that
holds nothing is closed after HPKV_SERVER_CONNECTION_IDLE_S (and its client carries on), and
opening more clients in one process gets that process no more of the pool."""

from __future__ import annotations

import os
import socket
import time
import urllib.request

import pytest

from helpers.cli import free_port
from helpers.keys import desc, entry_key, payload
from helpers.server import Node
from helpers.waiting import wait_for
from hpkv.server import loop
from hpkv.server import protocol as p


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def hello_socket(node: Node) -> tuple[socket.socket, p.Reply]:
    """A raw connection that has said Hello, and the server's answer (the pool descriptor closed)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(node.socket_path))
    try:
        sock.sendall(p.encode(p.Hello(p.PROTOCOL_VERSION, "idle", os.getpid())))
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused at once: the server's Error is there to read
    body, fds = p.recv_frame_fds(sock)
    p.close_fds(fds)
    return sock, p.decode_reply(body)


def closed(sock: socket.socket) -> bool:
    """Whether the server closed `sock` (a reset: it had not read what this side sent)."""
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def many_fds():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_idle_connections_hold_no_thread(node, many_fds):
    server = node.start_server(HPKV_SERVER_MAX_CONNECTIONS_PER_UID="1000")
    first, _ = hello_socket(node)
    baseline = threads_of(server.pid)
    conns = [hello_socket(node) for _ in range(300)]
    assert {type(reply).__name__ for _, reply in conns} == {"Welcome"}
    time.sleep(0.5)
    assert threads_of(server.pid) <= baseline + loop.WORKERS < 300
    client = node.client()  # and everyone is still served
    assert client.stats().clients.__len__() == 302
    for sock, _ in conns:
        sock.close()
    first.close()


def test_a_uid_holds_at_most_its_connections(node):
    node.start_server(HPKV_SERVER_MAX_CONNECTIONS_PER_UID="20")
    conns = [hello_socket(node) for _ in range(20)]
    over, reply = hello_socket(node)
    assert isinstance(reply, p.Error) and reply.code == "limit"
    assert "HPKV_SERVER_MAX_CONNECTIONS_PER_UID" in reply.message
    assert closed(over)
    conns.pop()[0].close()
    wait_for(lambda: type(hello_socket(node)[1]).__name__ == "Welcome", what="a connection's place back")
    log = node.foreground_log(node.servers[0])
    assert log.count("HPKV_SERVER_MAX_CONNECTIONS_PER_UID") >= 1


def test_a_silent_connection_that_holds_nothing_is_closed_and_its_client_carries_on(node):
    node.start_server(HPKV_SERVER_CONNECTION_IDLE_S="1")
    sock, _ = hello_socket(node)
    sock.settimeout(10)
    reply = p.decode_reply(p.recv_frame(sock))  # unasked: the server says why it closes
    assert isinstance(reply, p.Error) and reply.code == "idle"
    assert closed(sock)

    client, holder = node.client("engine"), node.client("holder")
    ns = client.register(desc(0))
    holder.register(desc(0))
    key = entry_key("kept", 0)
    res = client.reserve(ns, [key])
    res.view(0)[:] = payload(key)
    assert client.commit(res) == 1
    lease = holder.lease(ns, [key])
    epoch = client.epoch
    time.sleep(2.5)  # both silent past the time-out; the holder holds a lease
    assert client.lookup(ns, [key]).num_hit == 1  # sent again on a new connection: no miss
    assert client.epoch == epoch + 1
    assert holder.alive(lease) and holder.wait(lease) == 1 and bytes(lease.view(0)) == payload(key)
    assert holder.epoch == 0  # the connection that holds something was left open


def test_a_process_with_two_clients_holds_one_share(shm_dir, tmp_path):
    """HPKV_SERVER_MAX_SLOT_SHARE is a process's, whatever connections it opens: another engine
    (a process of the same uid) still gets the rest of the pool."""
    node = Node(shm_dir, tmp_path, HPKV_SERVER_MAX_SLOT_SHARE="0.5", HPKV_SERVER_MAX_USER_SLOT_SHARE="1")
    try:
        node.start_server()
        first, second = node.client("hog-1"), node.client("hog-2")
        ns = first.register(desc(0))
        second.register(desc(0))
        pool_entries = (64 << 20) // (256 << 10)
        took = [
            sum(o is not None for o in hog.reserve(ns, [entry_key(f"hog{i}", k) for k in range(pool_entries)]).offsets)
            for i, hog in enumerate((first, second))
        ]
        assert sum(took) == pool_entries // 2
        other = node.agent("engine")
        other.call("register")
        assert other.call("reserve", prefix="other", n=pool_entries // 2)["reserved"] == pool_entries // 2
    finally:
        node.close()


def test_idle_connections_to_the_metrics_port_hold_no_thread_and_scrapes_go_on(node):
    port = free_port()

    def scraped() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                return b"hpkv_connected_clients" in response.read()
        except OSError:
            return False

    server = node.start_server(HPKV_METRICS_PORT=str(port))
    wait_for(scraped, what="the metrics endpoint")
    baseline = threads_of(server.pid)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    time.sleep(1.0)
    assert threads_of(server.pid) <= baseline + 2
    wait_for(scraped, timeout_s=30, what="a scrape past the idle connections")
    for sock in idle:
        sock.close()
