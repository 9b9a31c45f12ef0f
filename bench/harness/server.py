"""A real HPKV server process (`python -m hpkv.server.daemon`) for benchmarks that measure through
a client. Primitives: `server_env(pool_dir, storage_dir, **settings)` -> the process environment
(no user config file), `start_server(env)` -> the process once its socket answers,
`stop_server(process)`, and `temporary_server(...)`, all three with fresh directories that are
removed on the way out; `huge_tmpfs(size)`, a place for a pool on 2 MiB pages. The server's own
settings come from its environment, as in production."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SHM = Path("/dev/shm")


def server_env(pool_dir: Path, storage_dir: Path, **settings: str) -> dict[str, str]:
    """This process's environment for a server in `pool_dir`, its storage in `storage_dir`, a 1 GiB
    pool, warnings only, and no config file; `settings` (HPKV_* names) override."""
    (pool_dir / "none.ini").touch()  # the config file it is told to read: empty
    return {
        **os.environ,
        "HPKV_SHARE_MEM_FILE_PATH": str(pool_dir),
        "HPKV_KV_STORAGE_PATH": str(storage_dir),
        "HPKV_KV_MEM_POOL_SIZE": "1g",
        "HPKV_CONFIG_FILE_PATH": str(pool_dir / "none.ini"),
        "HPKV_LOG_LEVEL": "warning",
        **settings,
    }


def start_server(env: dict[str, str], log_path: Path | None = None, timeout_s: float = 60.0) -> subprocess.Popen:
    """The server process, once its socket answers; its output to `log_path` (None: ours)."""
    from hpkv.server.autostart import answers
    from hpkv.server.protocol import SOCKET_NAME

    with open(log_path, "ab") if log_path else contextlib.nullcontext() as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpkv.server.daemon"], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
    deadline = time.monotonic() + timeout_s
    socket_path = Path(env["HPKV_SHARE_MEM_FILE_PATH"]) / SOCKET_NAME
    while not answers(socket_path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = log_path.read_text(errors="replace")[-2000:] if log_path else "(its output is above)"
            raise SystemExit(f"the HPKV server did not start: {tail}")
        time.sleep(0.05)
    return proc


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def temporary_server(prefix: str, storage_parent: Path | None = None, **settings: str) -> Iterator[tuple[Path, Path]]:
    """A server in a fresh directory under /dev/shm, its storage in a fresh one under
    `storage_parent` (None: the system's temporary directory); yields (pool_dir, storage_dir)."""
    pool_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=SHM))
    storage_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=storage_parent))
    try:
        server = start_server(server_env(pool_dir, storage_dir, **settings))
        try:
            yield pool_dir, storage_dir
        finally:
            stop_server(server)
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)
        shutil.rmtree(storage_dir, ignore_errors=True)


@contextlib.contextmanager
def huge_tmpfs(size_bytes: int) -> Iterator[Path | None]:
    """A fresh tmpfs mounted huge=within_size, or None where it cannot be mounted (not root)."""
    point = Path(tempfile.mkdtemp(prefix="hpkv-bench-huge-"))
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes},huge=within_size,mode=0700", "tmpfs", str(point)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        point.rmdir()
        yield None
        return
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
        point.rmdir()
