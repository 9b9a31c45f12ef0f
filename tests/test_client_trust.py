"""Stories of whom a client trusts: the server that listens on the socket of its pool directory
must run as this user or root, and must pass its pool file's descriptor (a regular file of the
size it announces); a server log planted as a symbolic link is not followed."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from helpers.users import NOBODY, become
from hpkv.server import protocol as p
from hpkv.server.autostart import LOG_NAME, ServerUnavailable, ensure_server


def impostor(directory, welcome: p.Welcome, fds: list[int] = ()) -> threading.Thread:
    """A server of sorts on `directory`'s socket: it answers one Hello with `welcome`, passing
    `fds` with it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(directory / p.SOCKET_NAME))
    listener.listen(1)

    def answer_one() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                p.recv_frame(conn)
                p.send_frame_fds(conn, welcome, list(fds))
                conn.recv(1)  # until the client hangs up

    thread = threading.Thread(target=answer_one, daemon=True)
    thread.start()
    return thread


def test_a_server_of_this_user_is_trusted(node):
    node.start_server()
    client = node.client()
    client.connect()

    assert client.connected and client.region.path == node.pool_path


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("passed", ["nothing", "a pipe", "a file of another size"])
def test_a_server_that_does_not_pass_its_pool_file_is_refused(node, tmp_path, passed):
    """The client maps only the descriptor its server passes with the Welcome, once it is known to
    be a regular file of the size announced; anything else is refused, and every descriptor that
    came is closed."""
    fds: list[int] = []
    if passed == "a pipe":
        fds = list(os.pipe())[:1]
    elif passed == "a file of another size":
        other = tmp_path / "other"
        other.write_bytes(b"x" * 4096)
        fds = [os.open(other, os.O_RDWR)]
    before = open_fds()
    inode = os.fstat(fds[0]).st_ino if fds else 0
    thread = impostor(
        node.shm_dir, p.Welcome(p.PROTOCOL_VERSION, os.getpid(), "/dev/shm/x/hpkv.pool", 1 << 20, inode, 1), fds
    )
    client = node.client()
    with pytest.raises(ServerUnavailable) as refused:
        client.connect()
    thread.join(5)

    assert not client.connected and client.region is None
    message = str(refused.value)
    assert {"nothing": "passed 0 descriptors", "a pipe": "is a FIFO", "a file of another size": "a file of 4096 bytes"}[
        passed
    ] in message
    assert "restart" in message
    assert open_fds() <= before  # what was received is closed
    for fd in fds:
        os.close(fd)


def connect_to_nobody(node, **client_kw) -> tuple[ServerUnavailable, bool]:
    """Connect a client to a child that became uid NOBODY and listens on the node's socket (it
    never answers): the error the connection ended in, and whether the client said anything."""
    node.shm_dir.chmod(0o1777)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            become(NOBODY)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(node.socket_path))
            listener.listen(1)
            os.write(ready_w, b"1")
            listener.settimeout(10)
            conn, _ = listener.accept()
            conn.settimeout(10)
            os.write(ready_w, b"y" if conn.recv(1) else b"n")
        finally:
            os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1"
        client = node.client(**client_kw)
        with pytest.raises(ServerUnavailable) as failed:
            client.connect()
        assert not client.connected
        return failed.value, os.read(ready_r, 1) == b"y"
    finally:
        os.close(ready_r)
        os.waitpid(pid, 0)


@pytest.mark.skipif(os.geteuid() != 0, reason="listening as another uid needs root")
def test_a_server_of_another_user_is_refused(node):
    """A pool directory anyone may write to (a shared ramfs at /mnt/hpkv, say): another user got
    there first and listens on the socket. The client hangs up before it says a word."""
    refused, said = connect_to_nobody(node)

    assert not said
    message = str(refused)
    assert f"uid {NOBODY}" in message and "HPKV_SHARE_MEM_FILE_PATH" in message
    assert "HPKV_SERVER_ALLOW_UIDS" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="listening as another uid needs root")
def test_a_server_uid_listed_in_allow_uids_is_spoken_to(node):
    """HPKV_SERVER_ALLOW_UIDS names the uids sharing the pool: an engine (root in its container)
    speaks to a server run by one of them. This one never answers the Hello, so the connection
    still fails, but not at the peer check."""
    failed, said = connect_to_nobody(node, timeout_s=1.0, trusted_uids=(NOBODY,))

    assert said
    assert "refusing" not in str(failed)


def test_a_server_log_planted_as_a_symbolic_link_is_not_followed(node, tmp_path, monkeypatch):
    for key, value in node.env.items():  # a server started anyway would be the node's, and stopped
        if key.startswith("HPKV_"):
            monkeypatch.setenv(key, value)
    target = tmp_path / "precious"
    target.write_text("mine\n")
    (node.shm_dir / LOG_NAME).symlink_to(target)

    with pytest.raises(ServerUnavailable, match="symbolic link"):
        ensure_server(node.shm_dir, timeout_s=10)

    assert target.read_text() == "mine\n"
    assert node.server_pids() == []  # none was started
