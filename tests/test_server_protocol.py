"""Stories of peers that speak the protocol badly: another version, requests before Hello,
oversized or undecodable frames, and a fuzzer sending anything at all. The server answers each
bad connection with an `Error` or closes it, and goes on serving a well-behaved client."""

from __future__ import annotations

import os
import socket
import struct
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.keys import desc, entry_key
from helpers.server import Node, raw_connect, read_replies
from helpers.waiting import wait_for
from hpkv.server import protocol as p
from hpkv.server.client import ServerError


def length_prefix(num_bytes: int) -> bytes:
    return struct.pack(">I", num_bytes)


def frame(body: bytes) -> bytes:
    return length_prefix(len(body)) + body


def exchange(node: Node, data: bytes, hello: bool) -> list[p.Reply]:
    """Send `data` (after a Hello or without one), end the sending side, read until closed."""
    sock = raw_connect(node, hello=hello)
    try:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may close before it has read everything
        return read_replies(sock)
    finally:
        sock.close()


def test_a_hello_of_another_version_is_refused_naming_both_versions(node):
    node.start_server()
    other = p.PROTOCOL_VERSION + 1
    replies = exchange(node, p.encode(p.Hello(other, "engine", os.getpid())), hello=False)
    assert len(replies) == 1 and replies[0].code == "version"
    assert f"protocol {other}" in replies[0].message and f"speaks {p.PROTOCOL_VERSION}" in replies[0].message


def test_the_client_raises_the_version_error(node, monkeypatch):
    node.start_server()
    server_version = p.PROTOCOL_VERSION
    monkeypatch.setattr(p, "PROTOCOL_VERSION", 99)  # this process now plays a newer hpkv
    client = node.client("engine")
    with pytest.raises(ServerError) as raised:
        client.stats()
    assert raised.value.code == "version"
    assert "protocol 99" in str(raised.value) and f"speaks {server_version}" in str(raised.value)


def test_a_later_versions_hello_with_more_fields_still_gets_the_version_error(node):
    """Hello keeps its fields across versions, and a later one may add some at its end: the
    server must still read its version and answer with the error naming both."""
    node.start_server()
    later_hello = msgspec.msgpack.encode(["Hello", p.PROTOCOL_VERSION + 1, "engine", os.getpid(), "new", [1, 2]])
    replies = exchange(node, frame(later_hello), hello=False)
    assert [(type(r), r.code) for r in replies] == [(p.Error, "version")]
    welcome_with_more = msgspec.msgpack.encode(["Welcome", 3, 1, "/dev/shm/x", 4096, 7, 1, 300.0, "new"])
    assert p.decode_reply(welcome_with_more).version == 3  # and an older client reads a later Welcome


def test_keys_longer_than_a_file_name_allows_are_refused(node):
    node.start_server()
    client = node.client("engine")
    ns = client.register(desc())
    with pytest.raises(ServerError, match="longer than 64 bytes") as raised:
        client.reserve(ns, [entry_key("ok", 0), b"k" * 200])
    assert raised.value.code == "bad_request"
    assert client.reserve(ns, [entry_key("ok", 0)]).offsets[0] is not None


BAD = {
    "a request before Hello": (p.encode(p.Stats()), False, "bad_request"),
    "an oversized length prefix": (length_prefix(p.MAX_FRAME_BYTES + 1) + b"x" * 64, True, "too_large"),
    "an oversized length prefix before Hello": (length_prefix(0xFFFFFFFF), False, "too_large"),
    "an unknown tag": (frame(msgspec.msgpack.encode(["Shutdown", 1])), True, "malformed"),
    "fields of the wrong type": (frame(msgspec.msgpack.encode(["Lookup", 7, "keys"])), True, "malformed"),
    "a body that is not msgpack": (frame(b"\xc1" * 10), True, "malformed"),
    "an empty body": (frame(b""), False, "malformed"),
}


@pytest.mark.parametrize("data,hello,code", BAD.values(), ids=BAD.keys())
def test_a_bad_frame_gets_an_error_and_only_that_connection_closes(node, data, hello, code):
    node.start_server()
    good = node.client("engine")
    ns = good.register(desc())
    bystander = raw_connect(node)
    replies = exchange(node, data, hello)
    assert [(type(r), r.code) for r in replies] == [(p.Error, code)]
    assert good.lookup(ns, [entry_key("k", 0)]).num_hit == 0
    bystander.sendall(p.encode(p.Stats()))
    assert isinstance(p.decode_reply(p.recv_frame(bystander)), p.StatsReply)
    bystander.close()


def test_a_peer_that_stops_mid_frame_is_closed_without_a_reply(node):
    node.start_server()
    assert exchange(node, length_prefix(100) + b"half", hello=True) == []
    assert exchange(node, b"\x00\x00", hello=False) == []


def call(sock: socket.socket, msg: p.Msg) -> p.Reply:
    sock.sendall(p.encode(msg))
    return p.decode_reply(p.recv_frame(sock))


def test_a_client_stuck_mid_frame_loses_its_connection_and_leases_but_a_quiet_one_keeps_them(node):
    node.start_server(HPKV_SERVER_FRAME_TIMEOUT_S="1")
    ns = desc().ns
    clients = []
    for name in ("stuck", "quiet"):
        sock = raw_connect(node, timeout_s=10.0)
        assert isinstance(call(sock, p.Register(desc().to_json())), p.Registered)
        key = entry_key(name, 0)
        reserved = call(sock, p.Reserve([p.Part(ns, [key])]))
        assert reserved.offsets[0][0] is not None
        assert call(sock, p.Commit(reserved.reservation_id)).num == 1
        assert call(sock, p.Lease([p.Part(ns, [key])])).leases[0].offsets
        clients.append(sock)
    stuck, quiet = clients
    stats = node.client("observer")
    assert stats.stats().leases == 2
    quiet_since = time.monotonic()
    stuck.sendall(length_prefix(100) + b"part of a message")
    assert read_replies(stuck) == []  # closed by the server, within the socket's 10 s
    wait_for(lambda: stats.stats().leases == 1, timeout_s=5.0)
    time.sleep(max(0.0, quiet_since + 2.5 - time.monotonic()))
    quiet.sendall(p.encode(p.Stats()))  # quiet between messages for over twice the timeout: still served
    assert isinstance(p.decode_reply(p.recv_frame(quiet)), p.StatsReply)
    stuck.close()
    quiet.close()


# -- the fuzzer ----------------------------------------------------------------------------------

# Clear is left out: a valid one would empty the well-behaved client's entries (which is its job).
TAGS = [cls.__name__ for cls in p.Request.__args__ if cls is not p.Clear] + ["Shutdown", "hello", ""]
FUZZ_NS = desc(rank=0).ns  # registered, so fuzzed reservations and leases really take slots

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
bodies = st.one_of(
    st.binary(max_size=48),
    values.map(msgspec.msgpack.encode),
    st.tuples(st.sampled_from(TAGS) | st.text(max_size=8), st.lists(values, max_size=4)).map(
        lambda t: msgspec.msgpack.encode([t[0], *t[1]])
    ),
)
ns_names = st.sampled_from([FUZZ_NS, "0" * 32]) | st.text(max_size=8)
keys = st.lists(st.binary(max_size=8), max_size=3)
parts = st.lists(st.builds(p.Part, ns_names, keys), max_size=3)
requests = st.one_of(
    st.builds(p.Hello, st.integers(0, 3), st.text(max_size=8), st.integers(0, 2**31)),
    st.builds(p.Register, st.sampled_from([desc().to_json(), "{}", "[]", '{"extra": 1}']) | st.text(max_size=8)),
    *(st.builds(cls, parts) for cls in (p.Lookup, p.Reserve, p.Lease)),
    st.builds(p.Lookup, parts, st.lists(st.integers(-1, 3), max_size=3)),
    *(st.builds(cls, st.integers(-1, 3)) for cls in (p.Commit, p.Abort)),
    st.builds(p.LeaseWait, st.lists(st.integers(-1, 3), max_size=3), st.floats()),
    st.builds(p.Release, st.lists(st.integers(-1, 3), max_size=3)),
    st.just(p.Stats()),
).map(p.encode)
pieces = st.one_of(
    requests,
    st.binary(max_size=48),
    bodies.map(frame),
    st.tuples(st.integers(p.MAX_FRAME_BYTES + 1, 2**32 - 1), st.binary(max_size=16)).map(
        lambda t: length_prefix(t[0]) + t[1]
    ),
    st.tuples(st.integers(0, 256), bodies).map(lambda t: length_prefix(t[0]) + t[1]),  # a lying length
)


def expected_replies(data: bytes, hello: bool) -> list[tuple[str, str | None]] | None:
    """What the protocol promises for `data`: (reply type, error code) per frame, with ("any",
    None) for a valid request after Hello. None for input the fuzzer must not send (a Clear)."""
    out: list[tuple[str, str | None]] = []
    pos = 0
    while len(data) - pos >= 4:
        (length,) = struct.unpack_from(">I", data, pos)
        if length > p.MAX_FRAME_BYTES:
            return out + [("Error", "too_large")]
        if len(data) - pos - 4 < length:
            return out  # the server waits for the rest, then sees the end
        body, pos = data[pos + 4 : pos + 4 + length], pos + 4 + length
        try:
            request = p.decode_request(body)
        except p.FrameError as exc:
            return out + [("Error", exc.code)]
        if isinstance(request, p.Clear):
            return None
        if hello:
            out.append(("any", None))
        elif not isinstance(request, p.Hello):
            return out + [("Error", "bad_request")]
        elif request.version != p.PROTOCOL_VERSION:
            return out + [("Error", "version")]
        else:
            out.append(("Welcome", None))
            hello = True
    return out


def test_fuzzed_connections_never_take_the_server_down(node):
    server = node.start_server()
    good = node.client("engine")
    good.register(desc(rank=0))
    ns = good.register(desc(rank=1))
    keys = [entry_key("kept", i) for i in range(4)]
    res = good.reserve(ns, keys)
    for i in range(4):
        res.view(i)[:] = bytes([i]) * len(res.view(i))
    good.commit(res)
    lease = good.lease(ns, keys)  # pinned: whatever the fuzzer reserves, these stay

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(data=st.lists(pieces, min_size=1, max_size=3).map(b"".join), hello=st.booleans())
    def one_connection(data: bytes, hello: bool) -> None:
        expected = expected_replies(data, hello)
        if expected is None:
            return
        replies = exchange(node, data, hello)
        got = [(type(r).__name__, getattr(r, "code", None)) for r in replies]
        assert len(got) == len(expected), (got, expected)
        for (got_type, got_code), (want_type, want_code) in zip(got, expected):
            if want_type != "any":
                assert (got_type, got_code) == (want_type, want_code)
            assert got_code != "internal", replies
        assert good.lookup(ns, keys).num_hit == 4

    one_connection()
    assert server.poll() is None
    assert good.lookup(ns, keys).num_hit == 4
    assert [bytes(lease.view(i))[:1] for i in range(4)] == [b"\x00", b"\x01", b"\x02", b"\x03"]
    good.release(lease)
    wait_for(lambda: [c.kind for c in good.stats().clients] == ["engine"], what="bad peers gone")
    stats = good.stats()
    assert stats.reservations == 0 and stats.leases == 0


@pytest.mark.parametrize(
    "desc_json",
    [
        "",
        "[]",
        "{}",
        '{"extra": 1}',
        '{"engine": "x"}',
        desc().to_json().replace('"block_size":16', '"block_size":"16"'),
    ],
)
def test_a_broken_namespace_description_is_a_bad_request(node, desc_json):
    node.start_server()
    sock = raw_connect(node)
    sock.sendall(p.encode(p.Register(desc_json)) + p.encode(p.Register(desc().to_json())))
    broken, fine = p.decode_reply(p.recv_frame(sock)), p.decode_reply(p.recv_frame(sock))
    assert isinstance(broken, p.Error) and broken.code == "bad_request", broken
    assert fine == p.Registered(desc().ns, desc().entry_bytes)
    sock.close()


def test_a_descriptor_received_with_a_frame_is_close_on_exec(tmp_path):
    """The pool's descriptor must not leak into a process another engine thread starts."""
    from hpkv.server import protocol as p

    a, b = socket.socketpair()
    target = tmp_path / "f"
    target.write_bytes(b"x")
    fd = os.open(target, os.O_RDONLY)
    try:
        p.send_frame_fds(a, p.Count(1), [fd])
        _, fds = p.recv_frame_fds(b)
        assert len(fds) == 1 and not os.get_inheritable(fds[0])
        p.close_fds(fds)
    finally:
        os.close(fd)
        a.close()
        b.close()
