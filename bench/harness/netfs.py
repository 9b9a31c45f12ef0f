"""Two real network file systems on this machine, each mounted twice (two mounts = two nodes,
each with its own client and cache): a one-brick GlusterFS volume (default client caching) and a
MooseFS file system (master, one chunkserver), from Debian's packages, through FUSE.

`NodeServer` is an `hpkv server` as one node runs it: in its own UTS namespace, with a host name
of its own (temporaries are named by it).

`local_and_shared()` gives a local directory as both nodes, then each of those that is up: what
a benchmark compares.

`netfs_beds()` installs what is missing (apt, idempotent: nothing is run when installed), starts
both, and yields a `Shared` per file system; everything it started is stopped and unmounted on
the way out, whatever happened inside. `why_not()` says in one line why this machine cannot
(not root, no FUSE, no apt...): the tests skip with it.

GlusterFS: glusterd with a private working directory and CLI socket, bound to 127.0.0.1 (port
24007 is fixed: one bed per machine at a time, others wait on a lock); its CLI refuses 127.0.0.1 as a brick host, so
the brick is named by the host name, which must resolve to a loopback address. MooseFS: every
daemon and both clients in a private network namespace (10.77.0.1 on its loopback), entered with
`nsenter --net` so the mounts stay visible to every process; the chunkserver refuses a 127.x
master.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.harness.report import log

GLUSTER_PACKAGES = ("glusterfs-server", "glusterfs-client")
MOOSE_PACKAGES = ("moosefs-master", "moosefs-chunkserver", "moosefs-client")
MOOSE_ADDRESS = "10.77.0.1"
VOLUME = "hpkvtest"


@dataclass(frozen=True)
class Shared:
    """One file system mounted twice: node A's mount and node B's."""

    name: str
    mount_a: Path
    mount_b: Path


def why_not() -> str | None:
    """Why two-node network file system tests cannot run here, in one line; None if they can."""
    if os.geteuid() != 0:
        return "network file system tests need root (mounts, namespaces)"
    if not os.path.exists("/dev/fuse"):
        return "network file system tests need FUSE (/dev/fuse)"
    for tool in ("apt-get", "dpkg-query", "unshare", "nsenter", "ip", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"network file system tests need {tool}"
    return None


def install(packages: tuple[str, ...]) -> str | None:
    """Install what of `packages` is missing (apt); None when all are there, else why not."""
    missing = [p for p in packages if not _installed(p)]
    if not missing:
        return None
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    for attempt in range(2):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode == 0:
            return None
        if attempt == 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
    return f"cannot install {' '.join(missing)}: {done.stderr.strip().splitlines()[-1:]}"


def _installed(package: str) -> bool:
    done = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return done.returncode == 0 and done.stdout.endswith("installed")


def _run(*command: str, timeout: float = 60.0) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stdout.strip()} {done.stderr.strip()}")
    return done.stdout


def _unmount(path: Path) -> None:
    if os.path.ismount(path):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _kill(pid: int | None) -> None:
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stopped(daemon: str, cfg: Path) -> bool:
    """A MooseFS daemon's own `stop` (by its lock file's pid), from outside any namespace."""
    try:
        return subprocess.run([daemon, "-c", str(cfg), "stop"], capture_output=True, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _wait_room(mount: Path, timeout_s: float) -> None:
    """Until the mount reports free space: MooseFS reports none until its chunkserver has told the
    master its disks' room, a little after it takes writes (a server's automatic size reads it)."""
    deadline = time.monotonic() + timeout_s
    while (st := os.statvfs(mount)).f_bavail * st.f_frsize < 1 << 30:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{mount} reports no free space after {timeout_s:.0f} s")
        time.sleep(0.3)


def _wait_shared(a: Path, b: Path, timeout_s: float) -> None:
    """Until a file written through `a` reads back through `b`."""
    deadline = time.monotonic() + timeout_s
    probe = f".bed-probe-{os.getpid()}"
    while True:
        try:
            (a / probe).write_text("up")
            if (b / probe).read_text() == "up":
                (a / probe).unlink()
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{b} does not show what {a} writes after {timeout_s:.0f} s")
        time.sleep(0.3)


@contextlib.contextmanager
def _bed_lock(name: str, timeout_s: float = 1800.0) -> Iterator[None]:
    """One bed of `name` per machine at a time (GlusterFS's port is fixed): a second one, such as
    `make test`'s other pytest session, waits for the first to be torn down."""
    with open(Path(tempfile.gettempdir()) / f"hpkv-netfs-{name}.lock", "a+") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another {name} bed held this machine's for {timeout_s:.0f} s") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def gluster(work: Path) -> Iterator[Shared]:
    """A one-brick GlusterFS volume with default options, mounted at work/a and work/b."""
    host = socket.gethostname()
    if not socket.gethostbyname(host).startswith("127."):
        raise RuntimeError(f"GlusterFS here needs the host name {host} to resolve to a loopback address")
    with _bed_lock("glusterfs"):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", 24007)) == 0:
                raise RuntimeError("port 24007 is taken (another glusterd runs): GlusterFS cannot start here")
        yield from _gluster(work, host)


def _gluster(work: Path, host: str) -> Iterator[Shared]:
    for d in ("glusterd", "brick", "a", "b"):
        (work / d).mkdir(parents=True)
    sock = work / "glusterd.socket"
    (work / "glusterd.vol").write_text(
        "volume management\n    type mgmt/glusterd\n"
        f"    option working-directory {work}/glusterd\n    option transport-type socket\n"
        f"    option glusterd-sockfile {sock}\n    option transport.socket.bind-address 127.0.0.1\n"
        "    option ping-timeout 0\nend-volume\n"
    )
    cli = ("gluster", f"--glusterd-sock={sock}", "--mode=script")
    pid_file = work / "glusterd.pid"
    try:
        _run("glusterd", f"--volfile={work}/glusterd.vol", f"--pid-file={pid_file}", f"--log-file={work}/glusterd.log")
        _run(*cli, "volume", "create", VOLUME, f"{host}:{work}/brick", "force")
        _run(*cli, "volume", "start", VOLUME)
        for m in ("a", "b"):
            _run("mount", "-t", "glusterfs", f"{host}:/{VOLUME}", str(work / m))
        _wait_shared(work / "a", work / "b", 30)
        yield Shared("glusterfs", work / "a", work / "b")
    finally:
        for m in ("a", "b"):
            _unmount(work / m)
        if pid_file.exists():
            subprocess.run([*cli, "volume", "stop", VOLUME, "force"], capture_output=True, timeout=60)
            subprocess.run([*cli, "volume", "delete", VOLUME], capture_output=True, timeout=60)
        _kill(_pid_in(pid_file))


@contextlib.contextmanager
def moosefs(work: Path) -> Iterator[Shared]:
    """A MooseFS master and chunkserver in a private network namespace, mounted at work/a and work/b."""
    for d in ("master", "cs", "chunks", "a", "b"):
        (work / d).mkdir(parents=True)
    holder = subprocess.Popen(["unshare", "--net", "sleep", "infinity"])
    ns = ("nsenter", f"--net=/proc/{holder.pid}/ns/net")
    master_cfg, cs_cfg = work / "mfsmaster.cfg", work / "mfschunkserver.cfg"
    try:
        time.sleep(0.2)
        _run(*ns, "ip", "link", "set", "lo", "up")
        _run(*ns, "ip", "addr", "add", f"{MOOSE_ADDRESS}/32", "dev", "lo")
        shutil.copy("/var/lib/mfs/metadata.mfs.empty", work / "master/metadata.mfs")
        (work / "mfsexports.cfg").write_text("* / rw,alldirs,maproot=0\n")
        (work / "mfshdd.cfg").write_text(f"{work}/chunks\n")
        user = "WORKING_USER = root\nWORKING_GROUP = root\n"
        master_cfg.write_text(
            f"DATA_PATH = {work}/master\nEXPORTS_FILENAME = {work}/mfsexports.cfg\n{user}"
            + "".join(f"{k}_LISTEN_HOST = {MOOSE_ADDRESS}\n" for k in ("MATOML", "MATOCS", "MATOCL"))
        )
        cs_cfg.write_text(
            f"DATA_PATH = {work}/cs\nHDD_CONF_FILENAME = {work}/mfshdd.cfg\nMASTER_HOST = {MOOSE_ADDRESS}\n"
            f"CSSERV_LISTEN_HOST = {MOOSE_ADDRESS}\nBIND_HOST = {MOOSE_ADDRESS}\n{user}"
        )
        _run(*ns, "mfsmaster", "-c", str(master_cfg), "start")
        _run(*ns, "mfschunkserver", "-c", str(cs_cfg), "start")
        for m in ("a", "b"):
            _run(*ns, "mfsmount", str(work / m), "-H", MOOSE_ADDRESS)
        _wait_shared(work / "a", work / "b", 60)  # the chunkserver registers first
        _wait_room(work / "a", 60)
        yield Shared("moosefs", work / "a", work / "b")
    finally:
        for m in ("a", "b"):
            _unmount(work / m)
        # Stopped from outside the namespace: the holder may be gone (a signal to our process group).
        for cfg, daemon, lock in ((cs_cfg, "mfschunkserver", "cs"), (master_cfg, "mfsmaster", "master")):
            if cfg.exists() and not _stopped(daemon, cfg):
                _kill(_pid_in(work / lock / f".{daemon}.lock"))
        holder.kill()
        holder.wait()


@contextlib.contextmanager
def netfs_beds(names: tuple[str, ...] = ("glusterfs", "moosefs")) -> Iterator[dict[str, Shared | str]]:
    """The file systems `names`, up: name -> `Shared`, or -> why it is not up (a line to skip with)."""
    reason = why_not()
    beds: dict[str, Shared | str] = {}
    with contextlib.ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="hpkv-netfs-"))
        stack.callback(shutil.rmtree, work, True)
        for name, packages, bed in (("glusterfs", GLUSTER_PACKAGES, gluster), ("moosefs", MOOSE_PACKAGES, moosefs)):
            if name not in names:
                continue
            why = reason or install(packages)
            if why is None:
                try:
                    beds[name] = stack.enter_context(bed(work / name))
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                    why = f"{name} does not start here: {exc}"
            if why is not None:
                beds[name] = why
        yield beds


def local_and_shared(prefix: str, local_name: str = "local") -> Iterator[tuple[str, Path, Path]]:
    """(name, node A's root, node B's root): a fresh local directory under /var/tmp (both nodes
    on it, removed after), then each network file system of `netfs_beds` that is up (one not up
    is logged, with why, and skipped)."""
    local = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    try:
        yield local_name, local, local
    finally:
        shutil.rmtree(local, ignore_errors=True)
    with netfs_beds() as beds:
        for name, bed in beds.items():
            if not isinstance(bed, Shared):
                log(f"{name}: skipped, {bed}")
                continue
            yield name, bed.mount_a, bed.mount_b


class NodeServer:
    """`hpkv server` (the script beside this Python) in its own UTS namespace, host name `host`,
    with `env`; up once its socket answers. `stop()` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, host: str, env: dict[str, str], log_path: Path) -> None:
        from hpkv.server.autostart import answers

        script = str(Path(sys.executable).parent / "hpkv")
        command = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$1" server', host, script]
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        sock = Path(env["HPKV_SHARE_MEM_FILE_PATH"]) / "hpkv.sock"
        deadline = time.monotonic() + 30
        while not answers(sock, timeout_s=0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"node {host}'s hpkv server did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()
