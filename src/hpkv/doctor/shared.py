"""`hpkv doctor`'s checks of a storage directory on a file system other nodes mount (network,
parallel, distributed: `storage.rescan.on_shared_fs`): whether it does what a tier shared by
nodes needs (a file created exclusively, renamed over another, read back whole by a fresh open),
and whether this node has a host name of its own (temporaries are named by it, and a start-up
scan removes the temporaries of its own host's dead writers).

Primitives: `check_shared_storage(storage)` -> a list of checks (none off a shared file system).
Must not know: the index, how entries are laid out.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from ..config import StorageConfig
from ..fsinfo import mount_of
from ..storage import rescan
from .check import Check, Verdict

_GENERIC_HOSTS = frozenset({"", "localhost", "localhost.localdomain", "localhost6"})


def check_shared_storage(storage: StorageConfig) -> list[Check]:
    path = Path(storage.path)
    if not path.is_dir():
        return []
    try:
        mount = mount_of(path)
    except OSError:
        return []
    if not rescan.on_shared_fs(mount):
        return []
    where = f"{path} is on {mount.fs_type} ({mount.source}), which other nodes may mount"
    return [_probe(path, where, storage.cluster), _host_name()]


def _probe(path: Path, where: str, cluster: str) -> Check:
    name = "storage directory: shared by nodes"
    error = _rename_round_trip(path)
    if error is not None:
        return Check(
            name,
            Verdict.FAIL,
            f"{where}, and {error}: HPKV needs an exclusive create, a rename over an existing name "
            "and a read of the whole new file after it",
            "use a mount that provides them (no client-side write-back that delays renames), or a local SSD",
        )
    works = f"{where}: exclusive create, rename over a name and read-after-rename work"
    if cluster == "off":
        return Check(
            name,
            Verdict.OK,
            f"{works}; each server walks the directory every {rescan.RESCAN_S:.0f} s or more to count other "
            "nodes' files against its capacity (HPKV_KV_STORAGE_CLUSTER=off; set the same "
            "HPKV_KV_STORAGE_SIZE on every node)",
        )
    return Check(
        name,
        Verdict.OK,
        f"{works}; the servers sharing it form a cluster (HPKV_KV_STORAGE_CLUSTER={cluster}): each indexes "
        "and evicts only its share of the parts, the first server's HPKV_KV_STORAGE_SIZE holds for all "
        "(set the same HPKV_KV_STORAGE_CLUSTER and HPKV_KV_STORAGE_LEASE on every node)",
    )


def _rename_round_trip(directory: Path) -> str | None:
    """Create two probes exclusively, rename one over the other, read it back; None if all went right."""
    tag = f".doctor-probe.{socket.gethostname().replace('.', '_')}.{os.getpid()}.{secrets.token_hex(4)}"
    first, second = directory / f"{tag}.a", directory / f"{tag}.b"
    data = secrets.token_bytes(8192)
    try:
        for probe, content in ((first, b"old"), (second, data)):
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, content)
            finally:
                os.close(fd)
        try:
            os.close(os.open(first, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            return "a second exclusive create of one name succeeded"
        except FileExistsError:
            pass
        os.rename(second, first)
        with open(first, "rb") as f:
            if f.read() != data:
                return "a file read right after a rename over it was not the renamed file"
        return None
    except OSError as exc:
        return f"a probe file failed: {exc.strerror} ({exc.filename})"
    finally:
        for probe in (first, second):
            try:
                os.unlink(probe)
            except OSError:
                pass


def _host_name() -> Check:
    name = "storage directory: this node's name"
    host = socket.gethostname()
    if host in _GENERIC_HOSTS:
        return Check(
            name,
            Verdict.WARN,
            f"this node is called {host!r}: nodes sharing a storage directory name their temporary files "
            "by host name, and a server starting up removes the temporaries of its own host's writers "
            "that are not running, so another node's writes in flight may be lost",
            "give every node sharing the directory its own host name (hostnamectl set-hostname)",
        )
    return Check(name, Verdict.OK, f"this node is {host!r}: its temporary files say so")
