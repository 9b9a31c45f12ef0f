"""Stories of who may talk to the server: the socket and directory modes, a peer of another uid
refused unless HPKV_SERVER_ALLOW_UIDS admits it, and requests that name paths they should not."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from helpers.server import Node
from helpers.users import NOBODY, as_other_uid
from hpkv.server import protocol as p

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")


def open_to_others(node: Node) -> None:
    """What an operator would do to let another uid reach the socket at all."""
    os.chmod(node.shm_dir, 0o711)
    os.chmod(node.socket_path, 0o666)


def talk(node: Node, *requests: p.Msg) -> dict:
    """Connect, send each request, and report every reply and whether the server then closed."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(node.socket_path))
    replies, closed = [], False
    for request in requests:
        try:
            sock.sendall(p.encode(request))
        except OSError:
            pass  # a refusing server may have closed already; its Error is still there to read
        try:
            replies.append(p.decode_reply(p.recv_frame(sock)))
        except (EOFError, ConnectionResetError):
            closed = True
            break
    if not closed:
        sock.settimeout(1)
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            pass
    sock.close()
    return {
        "uid": os.getuid(),
        "replies": [[type(r).__name__, getattr(r, "code", None)] for r in replies],
        "messages": [getattr(r, "message", "") for r in replies],
        "closed": closed,
    }


def hello() -> p.Hello:
    return p.Hello(p.PROTOCOL_VERSION, "intruder", os.getpid())


def test_socket_is_0600_in_a_0700_directory(shm_dir, tmp_path):
    node = Node(shm_dir / "fresh", tmp_path)  # the server makes the directory itself
    try:
        node.start_server()
        assert stat.S_IMODE(node.shm_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(node.socket_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(node.pool_path.stat().st_mode) == 0o600
    finally:
        node.close()


def test_a_peer_of_another_uid_is_refused(node):
    node.start_server()
    open_to_others(node)
    seen = as_other_uid(lambda: talk(node, hello()))
    assert seen["uid"] == NOBODY
    assert seen["replies"] == [["Error", "permission"]] and seen["closed"]
    assert f"uid {NOBODY}" in seen["messages"][0] and "HPKV_SERVER_ALLOW_UIDS" in seen["messages"][0]
    assert "refused a client of uid 65534" in node.foreground_log(node.servers[0])


def test_hpkv_server_allow_uids_admits_that_uid(node):
    node.start_server(HPKV_SERVER_ALLOW_UIDS=str(NOBODY))
    open_to_others(node)
    seen = as_other_uid(lambda: talk(node, hello(), p.Stats()))
    assert seen["replies"] == [["Welcome", None], ["StatsReply", None]] and not seen["closed"]


def test_an_admitted_uid_maps_the_pool_it_is_passed_though_the_file_is_0600(node):
    """HPKV_SERVER_ALLOW_UIDS names the uids sharing the pool: the server passes them the pool
    file's descriptor, so they need no access to the file by its name (0600, this uid's)."""
    from helpers.keys import desc, entry_key, payload
    from hpkv.server.client import Client

    node.start_server(HPKV_SERVER_ALLOW_UIDS=str(NOBODY))
    open_to_others(node)
    key = entry_key("shared", 0)

    def save() -> dict:
        with Client(node.shm_dir, "admitted", autostart=False) as client:
            ns = client.register(desc())
            res = client.reserve(ns, [key])
            res.view(0)[:] = payload(key)
            return {"committed": client.commit(ns, [key], reservation=res)}

    seen = as_other_uid(save)
    assert seen == {"committed": 1}
    assert stat.S_IMODE(node.pool_path.stat().st_mode) == 0o600
    client = node.client()
    ns = client.register(desc())
    lease = client.lease(ns, [key])
    assert client.wait(lease) == 1 and bytes(lease.view(0)) == payload(key)


def test_clear_refuses_a_namespace_that_is_not_a_namespace_id(node, tmp_path):
    victim = tmp_path / "elsewhere" / "ab" / "cd" / "precious.kv"
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"not hpkv's")
    node.start_server()
    client = node.client("cli")
    from hpkv.server.client import ServerError

    with pytest.raises(ServerError) as raised:
        client.clear(memory=True, storage=True, ns="../elsewhere")
    assert raised.value.code == "bad_request"
    assert victim.exists()
