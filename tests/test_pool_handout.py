"""Stories of a pool descriptor in hostile hands (issue 31, row 4): a uid the server admits
truncates or grows the pool file it was passed, while another user's engine copies out of it.
Nobody can change the pool's size through the descriptor clients get; a pool cut short all the
same (here by its owner, as on a kernel without Landlock's truncate right) costs an engine its
copy, never its life; and the server hands out a whole pool again to every later client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from helpers.env import pythonpath, without_hpkv
from helpers.keys import desc, entry_key, payload
from helpers.server import Node
from helpers.users import NOBODY, as_other_uid
from helpers.waiting import wait_for
from hpkv.pool import handout
from hpkv.pool.region import PoolRegion
from hpkv.server import protocol as p

landlock = pytest.mark.skipif(handout.landlock_abi() < 3, reason="this kernel has no Landlock truncate right")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another uid needs root")

KEY = entry_key("victim", 0)

# An engine's copying thread, as a process of its own: copies an entry out of the pool with the
# vLLM copier and the SGLang one on each line it reads, and reports per copier whether it got the
# bytes saved or the error it was told (a copy past the file's end would be a SIGBUS). Its entry:
# KEY, leased from the server of a pool directory (`server DIR`), or the first bytes of a pool
# file it is passed (`fd N SIZE`).
VICTIM = """
import json, sys
import torch
from helpers.env import pythonpath, without_hpkv
from helpers.keys import ENTRY_BYTES, desc, entry_key, payload
from hpkv.errors import HpkvError
from hpkv.integrations.sglang import pages
from hpkv.pool.region import PoolRegion
from hpkv.server.client import Client
from hpkv.transfer.blocks import BlockCopier

key = entry_key("victim", 0)
if sys.argv[1] == "server":
    client = Client(sys.argv[2], "victim", autostart=False)
    ns = client.register(desc())
    lease = client.lease(ns, [key])
    assert client.wait(lease) == 1
    region, offsets = lease.region, lease.offsets
else:
    region, offsets = PoolRegion.attach(int(sys.argv[2]), int(sys.argv[3]), "a pool"), [0]
blocks = torch.zeros((1, ENTRY_BYTES), dtype=torch.int8)
copier = BlockCopier([blocks], (0,))
host = bytearray(ENTRY_BYTES)
page = pages.PageBuffers([[torch.frombuffer(host, dtype=torch.int8).data_ptr()]], (ENTRY_BYTES,))
print("ready", flush=True)
for _ in sys.stdin:
    seen = {}
    for name, copy, out in (
        ("vllm", lambda: copier.load(region, [0], offsets), lambda: blocks.numpy().tobytes()),
        ("sglang", lambda: pages.load(region, offsets, page), lambda: bytes(host)),
    ):
        try:
            copy()
            seen[name] = out() == payload(key)
        except HpkvError as exc:
            seen[name] = str(exc)
    print(json.dumps(seen), flush=True)
"""


class Victim:
    """Another user's engine holding a lease on KEY (a real process)."""

    def __init__(self, env: dict, *args: str | int, pass_fds: tuple[int, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", VICTIM, *map(str, args)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            pass_fds=pass_fds,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", line + self.proc.stderr.read() if self.proc.stderr else ""

    @classmethod
    def of_server(cls, node: Node) -> Victim:
        return cls(node.env, "server", node.shm_dir)

    def copy(self) -> dict | str:
        """What one copy gave, or how the process ended."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write("copy\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = self.proc.stdout.readline()
        if line:
            return json.loads(line)
        code = self.proc.wait(timeout=30)
        return f"died of {signal.Signals(-code).name}" if code < 0 else f"exited {code}"

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=30)


def seed(node: Node) -> None:
    """KEY saved, by a process that is gone: this one maps no pool a test cuts short."""
    from hpkv.server.client import Client

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with Client(node.shm_dir, "seed", autostart=False) as client:
                ns = client.register(desc())
                res = client.reserve(ns, [KEY])
                res.view(0)[:] = payload(KEY)
                code = 0 if client.commit(res) == 1 else 1
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0


def served(node: Node) -> str:
    """What a client connecting now, in a process of its own, gets: the entry, or why not."""
    from hpkv.server.client import Client, ServerUnavailable

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # never returns into pytest
        seen = "nothing"
        try:
            with Client(node.shm_dir, "later", autostart=False) as client:
                ns = client.register(desc())
                lease = client.lease(ns, [KEY])
                ok = client.wait(lease) == 1 and bytes(lease.view(0)) == payload(KEY)
                seen = "the entry" if ok else "other bytes"
        except ServerUnavailable as exc:
            seen = f"refused: {exc}"
        except BaseException as exc:
            seen = f"raised {type(exc).__name__}: {exc}"
        finally:
            try:
                os.write(write_fd, seen.encode())
            finally:
                os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        seen = f.read().decode()
    status = os.waitpid(pid, 0)[1]
    return seen if os.WIFEXITED(status) else f"died of {signal.Signals(os.WTERMSIG(status)).name}"


def passed_pool_fd(node: Node) -> tuple[socket.socket, int]:
    """Connect as a client does and keep the pool descriptor the Welcome carries."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(node.socket_path))
    sock.sendall(p.encode(p.Hello(p.PROTOCOL_VERSION, "intruder", os.getpid())))
    body, fds = p.recv_frame_fds(sock)
    assert isinstance(p.decode_reply(body), p.Welcome) and len(fds) == 1
    return sock, fds[0]


def pool_bytes(node: Node) -> int:
    return int(node.env["HPKV_KV_MEM_POOL_SIZE"].rstrip("m")) << 20


def admit_nobody(node: Node) -> None:
    node.start_server(HPKV_SERVER_ALLOW_UIDS=str(NOBODY))
    os.chmod(node.shm_dir, 0o711)  # what an operator does to let that uid reach the socket
    os.chmod(node.socket_path, 0o666)


@as_root
@landlock
def test_an_admitted_uid_cannot_truncate_the_pool_under_another_users_engine(node):
    """Row 4: the admitted uid's ftruncate of its pool descriptor is refused; the engine copying
    from a lease goes on getting its bytes, and a client connecting afterwards is served."""
    admit_nobody(node)
    seed(node)
    victim = Victim.of_server(node)

    def truncate() -> dict:
        sock, fd = passed_pool_fd(node)
        try:
            os.ftruncate(fd, 4096)
            return {"truncate": "done"}
        except OSError as exc:
            return {"truncate": exc.strerror}
        finally:
            os.close(fd)
            sock.close()

    attack = as_other_uid(truncate)
    after = {"attack": attack, "victim": victim.copy(), "pool": node.pool_path.stat().st_size, "later": served(node)}

    assert after == {
        "attack": {"truncate": "Permission denied"},
        "victim": {"vllm": True, "sglang": True},
        "pool": pool_bytes(node),
        "later": "the entry",
    }
    assert victim.close() == 0


@as_root
def test_a_pool_grown_by_an_admitted_uid_is_set_back_and_refuses_no_later_client(node):
    """Writing past the end grows a file whatever its descriptor may not do: no mapping sees it,
    and the server sets the size back at once."""
    admit_nobody(node)
    seed(node)
    size = pool_bytes(node)

    def grow() -> dict:
        sock, fd = passed_pool_fd(node)
        try:
            return {"wrote": os.pwrite(fd, b"x", size + (1 << 20))}  # allowed: no right forbids it
        finally:
            os.close(fd)
            sock.close()

    assert as_other_uid(grow) == {"wrote": 1}
    wait_for(lambda: node.pool_path.stat().st_size == size, timeout_s=10, what="the pool's size set back")
    assert "changed its size; setting it back" in node.foreground_log(node.servers[0])
    assert served(node) == "the entry"


def test_an_engine_whose_pool_was_cut_short_recomputes_and_lives(shm_dir):
    """The engine's side, whoever cut the pool short (anyone holding a descriptor, where the
    kernel has no Landlock truncate right): its copies are refused with an error it recomputes
    on, never a SIGBUS."""
    size = 4 << 20
    fd = os.open(shm_dir / "pool", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        os.pwrite(fd, payload(KEY), 0)
        victim = Victim({**without_hpkv(), "PYTHONPATH": pythonpath()}, "fd", fd, size, pass_fds=(fd,))
        assert victim.copy() == {"vllm": True, "sglang": True}

        os.ftruncate(fd, 4096)
        seen = victim.copy()

        assert seen != "died of SIGBUS"
        assert isinstance(seen, dict) and all("was cut short" in str(why) for why in seen.values()), seen
        assert victim.close() == 0
    finally:
        os.close(fd)


def test_the_server_sets_a_pool_cut_short_back_at_once(node):
    """A pool file cut short under a connected engine (here by its owner; by anyone holding a
    descriptor where Landlock cannot prevent it): the server sets the size back without waiting
    for a new client, the engine lives on, and later clients are served a whole pool (the cut
    entries' bytes are gone)."""
    node.start_server()
    seed(node)
    victim = Victim.of_server(node)
    assert victim.copy() == {"vllm": True, "sglang": True}

    os.truncate(node.pool_path, 4096)
    wait_for(lambda: node.pool_path.stat().st_size == pool_bytes(node), timeout_s=10, what="the pool's size set back")

    assert isinstance(victim.copy(), dict)  # alive, copying what the cut left
    assert served(node) in ("other bytes", "the entry")
    assert "changed its size; setting it back" in node.foreground_log(node.servers[0])
    assert victim.close() == 0


@landlock
def test_the_shared_descriptor_cannot_change_the_pools_size_but_its_owner_can(shm_dir):
    region = PoolRegion.create(shm_dir, 4 << 20)
    try:
        assert region.unguarded is None
        with pytest.raises(PermissionError):
            os.ftruncate(region.share_fd(), 0)
        child = os.fork()
        if child == 0:  # another process, given the same description
            try:
                os.ftruncate(region.share_fd(), 4096)
                os._exit(1)
            except PermissionError:
                os._exit(0)
        assert os.waitpid(child, 0)[1] == 0
        assert os.fstat(region.share_fd()).st_size == 4 << 20
        os.truncate(region.path, 4 << 20)  # the owner's own rights are whole
    finally:
        region.close()


def test_without_landlock_the_pool_is_shared_as_before_and_says_why(shm_dir, monkeypatch):
    monkeypatch.setattr(handout, "landlock_abi", lambda: 0)
    region = PoolRegion.create(shm_dir, 4 << 20)
    try:
        assert region.unguarded is not None and "Landlock ABI 0" in region.unguarded
        os.ftruncate(region.share_fd(), 4096)  # nothing stops it here
        region.share_fd()  # handing it out again sets the size back
        assert os.fstat(region.share_fd()).st_size == 4 << 20
    finally:
        region.close()


def test_hpkv_doctor_says_what_admitted_uids_could_do_to_the_pool(shm_dir, monkeypatch):
    from hpkv.config import PoolConfig
    from hpkv.doctor import Verdict, check_pool_sharing

    pool = PoolConfig(dir=shm_dir, size_bytes=64 << 20)  # /dev/shm: tmpfs
    if handout.landlock_abi() >= 3:
        found = check_pool_sharing(pool, (NOBODY,))
        assert found.verdict == Verdict.WARN and "punch holes" in found.detail and "ramfs" in found.fix
    monkeypatch.setattr(handout, "landlock_abi", lambda: 0)
    found = check_pool_sharing(pool, (NOBODY,))
    assert found.verdict == Verdict.WARN and "can truncate" in found.detail and "6.2" in found.fix


def test_without_inotify_the_size_is_set_back_when_the_pool_is_next_handed_out(shm_dir, monkeypatch):
    monkeypatch.setattr(handout, "_watch", lambda fd: -1)  # the per-user limit of inotify instances met, say
    region = PoolRegion.create(shm_dir, 4 << 20)
    try:
        os.truncate(region.path, 4096)
        assert os.stat(region.path).st_size == 4096  # nothing watches
        region.share_fd()
        assert os.stat(region.path).st_size == 4 << 20
    finally:
        region.close()
