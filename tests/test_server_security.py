"""Stories of who may talk to the server: the socket and directory modes, a peer of another uid
refused unless HPKV_SERVER_ALLOW_UIDS admits it (the socket lets the listed uids reach it, and no
other), what one admitted uid may hold, and requests that name paths they should not."""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import stat

import pytest

from helpers.keys import desc, entry_key
from helpers.server import Node
from helpers.users import NOBODY, as_other_uid, become
from hpkv.pool import directory as pool_directory
from hpkv.server import access
from hpkv.server import protocol as p
from hpkv.server.client import Client  # imported as root: another uid cannot read this Python's modules

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")


def open_to_others(node: Node) -> None:
    """What the server does on a file system without ACLs (ramfs) to let a listed uid reach the
    socket: any uid can then connect, and SO_PEERCRED is the only gate."""
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


def test_refused_peers_are_logged_at_a_bounded_rate(node):
    node.start_server()
    open_to_others(node)
    seen = as_other_uid(lambda: [talk(node, hello())["replies"] for _ in range(30)])
    assert seen == [[["Error", "permission"]]] * 30
    log = node.foreground_log(node.servers[0])
    assert log.count("refused a client of uid 65534") == 1


def test_hpkv_server_allow_uids_admits_that_uid(node):
    """As documented: no chmod by hand, the server lets the uid reach its socket."""
    node.start_server(HPKV_SERVER_ALLOW_UIDS=str(NOBODY))
    seen = as_other_uid(lambda: talk(node, hello(), p.Stats()))
    assert seen["replies"] == [["Welcome", None], ["StatsReply", None]] and not seen["closed"]


def test_an_admitted_uid_maps_the_pool_it_is_passed_though_the_file_is_0600(node):
    """HPKV_SERVER_ALLOW_UIDS names the uids sharing the pool: the server passes them the pool
    file's descriptor, so they need no access to the file by its name (0600, this uid's)."""
    from helpers.keys import payload
    from hpkv.server.client import Client

    node.start_server(HPKV_SERVER_ALLOW_UIDS=str(NOBODY))
    key = entry_key("shared", 0)

    def save() -> dict:
        with Client(node.shm_dir, "admitted", autostart=False) as client:
            ns = client.register(desc())
            res = client.reserve(ns, [key])
            res.view(0)[:] = payload(key)
            return {"committed": client.commit(res)}

    seen = as_other_uid(save)
    assert seen == {"committed": 1}
    assert stat.S_IMODE(node.pool_path.stat().st_mode) == 0o600
    client = node.client()
    ns = client.register(desc())
    lease = client.lease(ns, [key])
    assert client.wait(lease) == 1 and bytes(lease.view(0)) == payload(key)


def connects() -> dict:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(NODE_SOCKET))
        return {"connected": True}
    except OSError as exc:
        return {"connected": False, "errno": exc.errno}
    finally:
        sock.close()


NODE_SOCKET = ""


def test_the_socket_lets_in_the_listed_uids_and_no_other(node):
    global NODE_SOCKET
    NODE_SOCKET = str(node.socket_path)
    proc = node.start_server(HPKV_SERVER_ALLOW_UIDS=str(NOBODY))
    assert as_other_uid(connects) == {"connected": True}
    assert as_other_uid(connects, uid=NOBODY - 1) == {"connected": False, "errno": errno.EACCES}
    mode = stat.S_IMODE(node.shm_dir.stat().st_mode)
    assert not mode & 0o022 and pool_directory.problem(node.shm_dir, frozenset({0})) is None
    assert stat.S_IMODE(node.socket_path.stat().st_mode) & 0o007 == 0  # others: nothing

    proc.terminate()
    proc.wait(timeout=30)
    node.start_server()  # restarted without the uid: the door is shut again
    assert as_other_uid(connects) == {"connected": False, "errno": errno.EACCES}
    assert not any(tag == 0x02 for tag, _, _ in access.acl_of(node.shm_dir) or ())


def test_without_acls_the_socket_is_opened_by_mode(tmp_path, monkeypatch):
    directory = tmp_path / "pool"
    directory.mkdir(mode=0o700)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(directory / "hpkv.sock"))
    finally:
        os.umask(old)

    def no_acls(*_args, **_kw):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "setxattr", no_acls)
    access.open_to(directory, directory / "hpkv.sock", (NOBODY,))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o701
    assert stat.S_IMODE((directory / "hpkv.sock").stat().st_mode) == 0o666
    sock.close()


class Hog:
    """A process of uid NOBODY that reserves `num_keys` through each of `num_clients` clients,
    reports how many it got, and keeps them until `let_go`."""

    kept: list[Client] = []

    def __init__(self, node: Node, num_clients: int, num_keys: int) -> None:
        release_r, self._release = os.pipe()
        report_r, report_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._release)
            os.close(report_r)
            try:
                become(NOBODY)
                got: object = self._reserve(node, num_clients, num_keys)
            except BaseException as exc:
                got = f"{type(exc).__name__}: {exc}"
            try:
                os.write(report_w, json.dumps(got).encode())
                os.read(release_r, 1)  # until the test lets go
            finally:
                os._exit(0)
        os.close(release_r)
        os.close(report_w)
        ready, _, _ = select.select([report_r], [], [], 30)
        self.got = json.loads(os.read(report_r, 4096) or b"null") if ready else None
        os.close(report_r)

    @staticmethod
    def _reserve(node: Node, num_clients: int, num_keys: int) -> list[int]:
        got = []
        clients = Hog.kept = []  # kept open: a client dropped (by GC, at any time) drops its reservations
        for i in range(num_clients):
            client = Client(node.shm_dir, f"hog-{i}")  # as an engine: it would start a server if none answered
            clients.append(client)
            ns = client.register(desc(0))
            res = client.reserve(ns, [entry_key(f"hog-{os.getpid()}-{i}", k) for k in range(num_keys)])
            got.append(sum(o is not None for o in res.offsets))
        return got

    def let_go(self) -> None:
        os.close(self._release)  # a later Hog holds a copy too: let go of every one before waiting

    def wait(self) -> None:
        os.waitpid(self.pid, 0)


def test_one_uid_holds_one_share_however_many_clients_and_processes(node):
    """A uid opens two clients in one process, and a second process, and reserves the whole pool
    through each: together they hold the uid's share, and this uid's engine gets the rest."""
    node.start_server(
        HPKV_SERVER_ALLOW_UIDS=str(NOBODY), HPKV_SERVER_MAX_SLOT_SHARE="0.5", HPKV_SERVER_MAX_USER_SLOT_SHARE="0.5"
    )
    entries = (64 << 20) // (256 << 10)  # the node's pool, in entries of desc(0)
    hogs = [Hog(node, 2, entries)]
    try:
        hogs.append(Hog(node, 1, entries))
        assert isinstance(hogs[0].got, list) and isinstance(hogs[1].got, list), (hogs[0].got, hogs[1].got)
        assert sum(hogs[0].got) == entries // 2 and hogs[1].got == [0]
        engine = node.client("engine")
        ns = engine.register(desc(0))
        res = engine.reserve(ns, [entry_key("engine", k) for k in range(entries)])
        assert sum(o is not None for o in res.offsets) == entries // 2
    finally:
        for hog in hogs:
            hog.let_go()
        for hog in hogs:
            hog.wait()


def test_clear_refuses_a_namespace_that_is_not_a_namespace_id(node, tmp_path):
    victim = tmp_path / "elsewhere" / "ab" / "cd" / "precious.kv"
    victim.parent.mkdir(parents=True)
    victim.write_bytes(b"not hpkv's")
    node.start_server()
    client = node.client("cli")
    from hpkv.server.client import ServerError

    with pytest.raises(ServerError) as raised:
        client.clear(dram=True, storage=True, ns="../elsewhere")
    assert raised.value.code == "bad_request"
    assert victim.exists()
