"""The wire protocol between engine processes and the HPKV Server.

Frames: a 4-byte big-endian length, then one msgpack-encoded message (a tagged msgspec Struct).
Only metadata crosses the socket (keys, offsets, counts); KV bytes go through the shared pool.
Every request gets exactly one reply, in order: its result or an `Error`. A frame longer than
`MAX_FRAME_BYTES`, undecodable, or of an unknown type is answered with an `Error` and closes that
connection only (its framing can no longer be trusted).

Version rule: the first message is `Hello`; a different `PROTOCOL_VERSION` is refused with an
error naming both versions. `Hello`, `Welcome` and `Error` keep their fields across versions (a
later version may only add fields at their end), so that check holds between any two versions;
every other message may change with the version.

Batches: `Lookup`, `Lease` and `Reserve` take the keys of several namespaces at once (`Part`s), so
an engine asks one request whatever its ranks and KV cache groups; a `Lease` answers the tiers of
what it leased (no `Lookup` before it); `Reserve` names its reservation, which `Commit` and
`Abort` name back (the keys are not sent twice); `LeaseWait` waits on the server, up to the
`timeout_s` it names, for every lease it lists. `Release` takes several leases.
Holds: a reservation made with a `hold` name is not the reserving client's to commit; `Settle`
settles the whole hold, every client's part: the keys it names are aborted, the rest committed.
The journal (for KV events): `Journal` watches namespaces (a cursor of -1) and reads what entered
and left their tiers since a cursor, and asks which tiers hold some keys; a page says when records
were lost (the server keeps a bounded number) and `life` changes with the server. It also carries
an engine's descriptions of its blocks (`describe`: opaque blobs the server keeps, bounded, after
the engine is gone) and pages through those kept (`snapshot`), so that a restarted engine
announces what the tiers still hold.
The pool: the `Welcome` frame carries the pool file's descriptor (SCM_RIGHTS, `send_frame_fds` /
`recv_frame_fds`), which the client maps instead of opening the file by name. `pool_bytes` and
`pool_inode` are what it checks the descriptor against; `pool_path` is for messages only
(`display_path`). Must not know: the store, the pool's contents.
"""

from __future__ import annotations

import os
import socket
import struct

import msgspec

# 6: Journal (the tier journal, for KV events); 7: Journal's describe and snapshot (block
# descriptions kept for the next engine: a server of 6 would refuse them as malformed)
PROTOCOL_VERSION = 7
MAX_FRAME_BYTES = 16 << 20
STATS_PAGE_BYTES = 4 << 20  # the descriptions in one Stats reply, past its first (at most 1 MiB)
MAX_BLOB_BYTES = 16 << 10  # one block description in `Journal.describe` (the store's bound: the same)
MAX_DESCRIBED = 1 << 13  # block descriptions in one `Journal`: 128 MiB of blobs at most is past a frame anyway
MAX_SNAPSHOTS = 64  # `Journal.snapshot`s in one request
MAX_SNAPSHOT_NAMESPACES = 256  # their `held_in`, all together (a page's held bits: 4096 keys x these bytes)
SNAPSHOT_PAGE_KEYS = 1 << 12  # descriptions one snapshot reads in one reply (kept or not)
SNAPSHOT_REPLY_BYTES = 8 << 20  # the descriptions in one reply, shared by its snapshots (a reply fits a frame)
SOCKET_NAME = "hpkv.sock"
LOCK_NAME = "hpkv.lock"
_LENGTH = struct.Struct(">I")


class Msg(msgspec.Struct, tag=True, forbid_unknown_fields=True, array_like=True):
    pass


class _Stable(msgspec.Struct, tag=True, array_like=True):
    """The messages of the version handshake: extra trailing fields (a later version's) are
    ignored, so any two versions can tell each other which version they speak."""


# -- requests ------------------------------------------------------------------------------------


class Hello(_Stable):
    version: int
    kind: str  # "vllm-scheduler", "vllm-worker-<rank>", "sglang-<thread>", "cli", "doctor", ...
    pid: int


class Register(Msg):
    desc_json: str  # a NamespaceDesc as JSON


class Part(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The keys of one namespace in a batched request (`Lookup`, `Lease`, `Reserve`)."""

    ns: str
    keys: list[bytes]


class Lookup(Msg):
    parts: list[Part]
    # Indexes of the parts answered key by key (a tier, or 0 for a miss, for every key) instead
    # of up to the first miss: a hybrid model's state namespaces, whose states sit at some
    # block boundaries only.
    each: list[int] = []


class Reserve(Msg):
    parts: list[Part]
    hold: str = ""  # settled by `Settle(hold)`, not committed by this client


class Settle(Msg):
    hold: str
    abort: list[bytes]  # keys to abort (in every namespace of the hold); the rest are committed


class Commit(Msg):
    reservation_id: int  # as `Reserved` named it; a reservation in a hold is the hold's to settle


class Abort(Msg):
    reservation_id: int  # its slots given back, in a hold or not


class Lease(Msg):
    parts: list[Part]  # one lease per part


class LeaseWait(Msg):
    lease_ids: list[int]
    timeout_s: float  # the longest the server waits for every lease's promotions; 0: just poll


class Release(Msg):
    lease_ids: list[int]


class Clear(Msg):
    dram: bool
    storage: bool
    ns: str | None = None


class Stats(Msg):
    """One page of the namespaces: those whose ids follow `after` (in id order), or with
    `busiest` the most looked up; at most `max_namespaces`, and at most STATS_PAGE_BYTES of
    descriptions (at least one). The rest of the snapshot comes whole."""

    after: str = ""
    max_namespaces: int = 256
    busiest: bool = False


class Cursor(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Where a client is in one namespace's journal: the number of the last record it read; -1:
    watch it from now (answered with the last number, no records)."""

    ns: str
    after: int


class Described(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """An engine's descriptions of keys of one namespace: `blobs[i]` describes `keys[i]`, in the
    engine's own encoding (the server never parses them). A blob over MAX_BLOB_BYTES is not kept."""

    ns: str
    keys: list[bytes]
    blobs: list[bytes]


class Snapshot(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Page through the descriptions kept for `ns` numbered past `after` (0: from the first),
    answering those whose keys a tier holds in some namespace of `held_in`, with their tiers
    there (an engine's every rank)."""

    ns: str
    after: int
    held_in: list[str]


class Journal(Msg):
    cursors: list[Cursor]
    held: list[Part] = []  # keys whose tiers to answer (`JournalPages.held`), after the pages are read
    describe: list[Described] = []  # kept before the pages are read; MAX_DESCRIBED keys at most
    snapshot: list[Snapshot] = []  # answered after the pages are read; MAX_SNAPSHOTS at most


Request = (
    Hello | Register | Lookup | Reserve | Commit | Abort | Settle | Lease | LeaseWait | Release | Clear | Stats
) | Journal


# -- replies -------------------------------------------------------------------------------------


class Welcome(_Stable):
    version: int
    server_pid: int
    pool_path: str  # display_path: for messages only (the pool itself comes as a descriptor)
    pool_bytes: int
    pool_inode: int
    client_id: int
    slot_timeout_s: float = 0.0  # HPKV_SERVER_SLOT_TIMEOUT_S; 0: none. Clients void their handles by then


class Registered(Msg):
    ns: str
    entry_bytes: int


class Hits(Msg):
    tiers: list[bytes]  # per part: one byte per leading hit (1 DRAM, 2 storage); per key (0: miss) for `each`


class Reserved(Msg):
    reservation_id: int
    offsets: list[list[int | None]]  # per part, per key; None: skip this key (held already, or no room)


class Count(Msg):
    num: int


class LeasePart(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    lease_id: int  # 0: nothing leased (a miss), nothing to release
    tiers: bytes  # one byte per leading hit leased: 1 DRAM, 2 storage (promoted into its slot)
    offsets: list[int]
    num_ready: int | None  # None while promotions from storage are still running


class Leased(Msg):
    leases: list[LeasePart]  # one per part


class Ready(Msg):
    num_ready: list[int | None]  # per lease waited on; None: its promotions still running


class Cleared(Msg):
    dram: int
    storage: int


class Settled(Msg):
    num_committed: int
    num_aborted: int


class StatsReply(Msg):
    stats: dict


class JournalPage(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One namespace's records past its cursor, numbered on to `last`: `codes[i]` is the tier
    (1 DRAM, 2 storage) of `keys[i]`, plus 4 when it entered the tier (else it left). `lost`:
    records between the cursor and these are gone (learn the tiers again: `Journal.held`);
    `more`: records past `last` wait for the next `Journal`."""

    ns: str
    codes: bytes
    keys: list[bytes]
    last: int
    lost: bool
    more: bool


class SnapshotPage(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Descriptions of `ns` numbered on to `last` whose keys a tier holds: `held[j][i]` is the
    tiers (bits: 1 DRAM, 2 storage) holding `keys[i]` in the `j`th namespace of `held_in`;
    `more`: others past `last` wait for the next `Journal` (ask again from `last`)."""

    ns: str
    keys: list[bytes]
    blobs: list[bytes]
    held: list[bytes]
    last: int
    more: bool


class JournalPages(Msg):
    life: str  # the server's journal: a cursor read from another life is lost
    pages: list[JournalPage]  # one per cursor
    held: list[bytes]  # per part of `Journal.held`: per key the tiers holding it, as bits (1 DRAM, 2 storage)
    snapshot: list[SnapshotPage] = []  # one per `Journal.snapshot`


class Error(_Stable):
    # "version", "permission", "limit" (too many connections of a uid, or keys reserved open on one), "idle"
    # (closed idle: the request sent since was not read), "malformed", "too_large", "unknown_namespace",
    # "bad_request", "internal"
    code: str
    message: str


Reply = (
    Welcome | Registered | Hits | Reserved | Count | Leased | Ready | Cleared | Settled | StatsReply | JournalPages
) | Error

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class FrameError(Exception):
    """The peer sent something that is not a valid frame; `code` says what kind of problem."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def encode(msg: msgspec.Struct) -> bytes:
    body = _encoder.encode(msg)
    return _LENGTH.pack(len(body)) + body


def frame_length(prefix: bytes) -> int:
    (length,) = _LENGTH.unpack(prefix)
    if length > MAX_FRAME_BYTES:
        raise FrameError("too_large", f"frame of {length} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    return length


def decode_request(body: bytes) -> Request:
    try:
        return _request_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError("malformed", f"malformed request: {exc}") from None


def decode_reply(body: bytes) -> Reply:
    try:
        return _reply_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError("malformed", f"malformed reply: {exc}") from None


def recv_exact(sock, num_bytes: int, idle_ok: bool = False) -> bytes:
    """Read exactly `num_bytes`; EOFError if the peer closed first. The socket's timeout
    (TimeoutError) bounds each wait for more bytes; with `idle_ok`, waiting for the first byte
    is not bounded: a peer may stay quiet between frames, not within one."""
    chunks = bytearray()
    while len(chunks) < num_bytes:
        try:
            chunk = sock.recv(num_bytes - len(chunks))
        except TimeoutError:
            if idle_ok and not chunks:
                continue
            raise
        if not chunk:
            raise EOFError("connection closed")
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock, idle_ok: bool = False) -> bytes:
    return recv_exact(sock, frame_length(recv_exact(sock, _LENGTH.size, idle_ok)))


def display_path(path: str | os.PathLike) -> str:
    """A path as text that always encodes: its bytes as UTF-8, any others escaped (a directory
    name need not be UTF-8, and msgpack strings must be)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def send_frame_fds(sock: socket.socket, msg: msgspec.Struct, fds: list[int]) -> None:
    """Send one frame with `fds` attached to its first byte (SCM_RIGHTS)."""
    data = encode(msg)
    sent = socket.send_fds(sock, [data], fds)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_frame_fds(sock: socket.socket, max_fds: int = 1) -> tuple[bytes, list[int]]:
    """One frame and the descriptors that came with it (close-on-exec). The caller owns the
    descriptors; on any error they are closed here. More than `max_fds` are closed by the kernel
    (MSG_CTRUNC) or here."""
    fds: list[int] = []

    def exact(num_bytes: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < num_bytes:
            data, got, _, _ = socket.recv_fds(sock, num_bytes - len(chunks), max_fds)
            fds.extend(got)
            for fd in got:  # recv_fds ignores its flags (MSG_CMSG_CLOEXEC) in CPython 3.11
                os.set_inheritable(fd, False)
            if not data:
                raise EOFError("connection closed")
            chunks += data
        return bytes(chunks)

    try:
        body = exact(frame_length(exact(_LENGTH.size)))
    except BaseException:
        close_fds(fds)
        raise
    if len(fds) > max_fds:
        close_fds(fds[max_fds:])
        del fds[max_fds:]
    return body, fds


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
